"""A process group partita initialises is destroyed at interpreter exit (a script that never calls
``destroy_process_group`` otherwise leaves it to the interpreter's teardown, where a rank now and
then aborted under torchrun after training), but not after an uncaught exception, and a group the
script destroyed itself is left alone. Each case runs a script in an interpreter of its own; an
``atexit`` handler registered before partita's runs after it and prints what it left."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow

SCRIPT = """
import atexit, sys
import torch.distributed as dist
atexit.register(lambda: print("initialized at exit:", dist.is_initialized(), flush=True))
from partita.runtime.process_groups import init_process_group
init_process_group(num_devices=1)  # a world of one, as a plain `python script.py` gets
init_process_group(num_devices=1)  # already initialised: joined, no second teardown
print("initialized:", dist.is_initialized(), flush=True)
{ending}
"""


def _run(ending: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-c", SCRIPT.format(ending=ending)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_group_partita_initialised_is_destroyed_at_exit():
    done = _run("")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["initialized: True", "initialized at exit: False"], done.stdout


def test_a_group_the_script_destroyed_is_left_alone():
    done = _run("dist.destroy_process_group()")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["initialized: True", "initialized at exit: False"], done.stdout


def test_after_an_uncaught_exception_the_group_is_not_waited_on():
    done = _run("raise RuntimeError('a failed step')")
    assert done.returncode == 1 and "a failed step" in done.stderr, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["initialized: True", "initialized at exit: True"], done.stdout
