"""Start training processes with torchrun's launcher, or tell that we already are one of them."""

from __future__ import annotations

import os
from collections.abc import Sequence

from partita.errors import InputError


def under_torchrun() -> bool:
    """True inside a process that torchrun (torch.distributed.run) started."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def restart_count() -> int:
    """How many times torchrun has restarted this job's processes (0 on the first attempt, and
    outside torchrun): torchrun sets TORCHELASTIC_RESTART_COUNT in every worker."""
    value = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    try:
        return int(value)
    except ValueError:
        raise InputError(
            f"TORCHELASTIC_RESTART_COUNT={value!r} is not an integer: it is set by torchrun; "
            "unset it when not running under torchrun"
        ) from None


def launch_local(
    module_argv: Sequence[str], *, nproc: int, max_restarts: int = 0, rendezvous: Sequence[str] | None = None
) -> None:
    """Run ``python -m partita.cli <module_argv>`` in ``nproc`` processes on this machine
    (``torchrun --standalone``), restarting all of them up to ``max_restarts`` times when one
    fails (torchrun's elastic restart; the restarted processes resume from the latest complete
    checkpoint, see train_loop.py). Raises ChildFailedError with the failing rank's error.

    ``rendezvous``: torchrun's options for one node of a multi-node job (``--nnodes``,
    ``--rdzv-backend``, ``--rdzv-endpoint``, ...), in place of ``--standalone``.
    """
    from torch.distributed.run import parse_args, run

    if nproc < 1:
        raise InputError(f"--nproc must be >= 1, got {nproc}")
    if max_restarts < 0:
        raise InputError(f"max_restarts must be >= 0 (restarts after a failure), got {max_restarts}")
    # One intra-op thread per rank unless the user chose otherwise: ranks share this machine's cores.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if max_restarts > 0:
        # torchrun's agent shares one TCPStore with every attempt's workers (torch >= 2.5): the
        # restarted ranks then read the dead ranks' gloo/NCCL addresses and fail to connect
        # (pytorch/pytorch#135712). One store per attempt avoids that.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    args = parse_args(
        [
            *(["--standalone"] if rendezvous is None else rendezvous),
            f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}",
            "--monitor-interval=0.5",
            "-m",
            "partita.cli",
        ]
    )
    # Set after parsing: torchrun's parser would read our options (--nproc) as abbreviations of its own.
    args.training_script_args = list(module_argv)
    run(args)
