"""Where checkpoints live on disk and when one counts as written.

A checkpoint is a torch.distributed.checkpoint (DCP) directory. It is written to
``<dir>.partial`` and renamed to ``<dir>`` once every rank has finished, and DCP writes its
metadata file last: so a directory named without ``.partial`` that holds the metadata file is
complete, and anything else is an interrupted write. Training checkpoints of one run are named
``step-NNNNNN`` inside a checkpoint directory, so the latest complete one can be found again
after a restart.

This module has no torch dependency, so that the training checkpoints (checkpoint.py), the seed
checkpoints (materialize.py) and the command line all share these conventions without importing
each other.
"""

from __future__ import annotations

import os
import re

__all__ = ["CHECKPOINT_PATTERN", "METADATA_FILE", "PARTIAL_SUFFIX", "checkpoint_path", "is_complete",
           "latest_checkpoint"]

PARTIAL_SUFFIX = ".partial"
METADATA_FILE = ".metadata"  # what dcp.save writes last, after every rank's data files
CHECKPOINT_PATTERN = re.compile(r"^step-(\d+)$")


def is_complete(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a finished checkpoint: not a ``.partial`` write, and holding DCP's metadata."""
    path = os.fspath(path)
    return not path.rstrip(os.sep).endswith(PARTIAL_SUFFIX) and os.path.isfile(os.path.join(path, METADATA_FILE))


def checkpoint_path(directory: str, step: int) -> str:
    """The checkpoint of step ``step`` in ``directory``: ``<directory>/step-NNNNNN``."""
    return os.path.join(directory, f"step-{step:06d}")


def latest_checkpoint(directory: str) -> str | None:
    """The complete checkpoint (``step-NNNNNN`` holding DCP's metadata) with the highest step, or
    None. Interrupted writes are skipped: ``.partial`` directories (another name) and directories
    that lack the metadata file DCP writes last."""
    if not os.path.isdir(directory):
        return None
    steps = sorted((int(m.group(1)) for name in os.listdir(directory) if (m := CHECKPOINT_PATTERN.match(name))),
                   reverse=True)
    return next((checkpoint_path(directory, step) for step in steps
                 if is_complete(checkpoint_path(directory, step))), None)
