"""`partita train` as users run it: a killed rank is restarted by torchrun and the job resumes from
its latest complete checkpoint, ending with the parameters of an uninterrupted run; and two runs
with the same plan and seed record identical losses.

Three jobs (launcher + torchrun agent + 2 gloo ranks each) start at once, so that their start-up
(imports, graph capture: most of the ~25 s each takes here) overlaps:

- ``reference``: 12 uninterrupted steps; ``repeat``: the same again (determinism);
- ``killed``: the same with ``--max-restarts 2``; once ``step-000006`` exists the test SIGKILLs
  rank 1 of the attempt running then (the first, unless one ended by itself), found among the
  launcher's child processes by its environment (RANK=1; Linux /proc, no hook in partita).

GPT-2 tiny at sequence length 256 makes a step ~0.2 s, so ~1 s of training is left after the
checkpoint the kill waits for, against the ~10 ms the test needs to react.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dist_launch import REPO

pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds ranks through /proc")

STEPS, EVERY, SEQ_LEN, BATCH = 12, 3, 256, 8
KILL_AFTER = 6  # SIGKILL rank 1 once checkpoint step-000006 exists
TOLERANCE = 1e-5
TIMEOUT_S = 240


def _model():
    from partita import examples

    return examples.build("gpt2", batch_size=BATCH, seq_len=SEQ_LEN).model


def _make_plan(path: Path) -> None:
    import partita
    from partita import examples
    from partita.planning.manual import manual_plan

    ex = examples.build("gpt2", batch_size=BATCH, seq_len=SEQ_LEN)
    graph = partita.capture(ex.model, ex.args, ex.kwargs)
    n = graph.num_nodes
    manual_plan(
        graph, [0, n // 2, n], schedule="1f1b", num_rank_groups=2, num_microbatches=2, global_batch_size=BATCH
    ).save(path)


def _start(name: str, out: Path, plan: Path, *extra: str) -> tuple[subprocess.Popen, Path]:
    """``partita train`` in the background; its output goes to ``out/<name>.log``."""
    log = out / f"{name}.log"
    argv = [
        sys.executable,
        "-m",
        "partita.cli",
        "train",
        "gpt2",
        "--nproc",
        "2",
        "--seq-len",
        str(SEQ_LEN),
        "--steps",
        str(STEPS),
        "--plan",
        str(plan),
        "--checkpoint-every",
        str(EVERY),
        "--checkpoint-dir",
        str(out / name),
        "--losses-out",
        str(out / f"{name}.json"),
        *extra,
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TRANSFORMERS_VERBOSITY": "error",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    with open(log, "w") as f:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
    return proc, log


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text() if entry.isdigit() else ""
        except OSError:
            continue
        if stat and int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry))
    return found


def _rank_pid(launcher: int, rank: int) -> int | None:
    """The process of ``rank`` among the launcher's children, if one runs now (of the first attempt,
    or of a restart when an attempt ended by itself: a port another process took in between)."""
    wanted = {f"RANK={rank}".encode()}
    for pid in _children(launcher):
        try:
            environ = set(Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"))
        except OSError:
            continue
        if wanted <= environ:
            return pid
    return None


def _kill_rank_after_checkpoint(proc: subprocess.Popen, log: Path, ckpt_dir: Path) -> None:
    marker = ckpt_dir / f"step-{KILL_AFTER:06d}"
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        assert proc.poll() is None, f"the job ended before the kill:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {marker.name} after {TIMEOUT_S} s:\n{log.read_text()[-3000:]}"
        pid = _rank_pid(proc.pid, rank=1) if marker.exists() else None
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
                return
            except ProcessLookupError:  # that attempt ended meanwhile: its restart's rank is next
                pass
        time.sleep(0.01)


def _stop(proc: subprocess.Popen) -> None:
    """End a launcher that is still running, and its ranks (torchrun starts each in its own session,
    so they are found by parent pid): SIGTERM lets torchrun stop them; SIGKILL what is left."""
    if proc.poll() is not None:
        return
    ranks = _children(proc.pid)
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    for pid in ranks:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _finish(proc: subprocess.Popen, log: Path, deadline: float) -> str:
    try:
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        _stop(proc)
        pytest.fail(f"partita train timed out:\n{log.read_text()[-3000:]}")
    text = log.read_text()
    assert proc.returncode == 0, f"partita train failed (exit {proc.returncode}):\n{text[-3000:]}"
    return text


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("restart")
    plan = out / "plan.json"
    _make_plan(plan)
    deadline = time.monotonic() + TIMEOUT_S
    jobs = {
        name: _start(name, out, plan, *extra)
        for name, extra in [("reference", ()), ("repeat", ()), ("killed", ("--max-restarts", "2"))]
    }
    try:
        _kill_rank_after_checkpoint(*jobs["killed"], out / "killed")
        logs = {name: _finish(proc, log, deadline) for name, (proc, log) in jobs.items()}
    finally:
        for proc, _ in jobs.values():
            _stop(proc)
    losses = {name: json.loads((out / f"{name}.json").read_text()) for name in jobs}
    return out, logs, losses


def _final_state(ckpt_dir: Path) -> dict:
    import partita

    model = _model()
    partita.load_into_model(model, ckpt_dir / f"step-{STEPS:06d}")
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_killed_rank_restarts_and_resumes_to_the_uninterrupted_parameters(runs):
    from workers import max_diff

    out, logs, losses = runs
    resumed = re.search(r"restart \d+: resuming from \S+ \(step (\d+)\)", logs["killed"])
    assert resumed, f"no restart or no resume:\n{logs['killed'][-3000:]}"
    step = int(resumed.group(1))
    assert KILL_AFTER <= step < STEPS, step
    assert losses["killed"]["first_step"] == step + 1
    reference = losses["reference"]["losses"]
    for got, want in zip(losses["killed"]["losses"], reference[step:], strict=True):
        assert abs(got - want) <= TOLERANCE, (losses["killed"], reference)
    diff, where = max_diff(_final_state(out / "killed"), _final_state(out / "reference"))
    assert diff <= TOLERANCE, f"after the restart, {where} differs from the uninterrupted run's by {diff:.3g}"
    initial = {k: v.detach() for k, v in _model().state_dict().items()}
    assert max_diff(_final_state(out / "reference"), initial)[0] > 1e-3, "the runs did not train"


def test_two_runs_with_the_same_plan_and_seed_record_identical_losses(runs):
    _, _, losses = runs
    assert losses["reference"]["first_step"] == 1 and len(losses["reference"]["losses"]) == STEPS
    assert losses["repeat"] == losses["reference"]
