"""`partita train path/file.py:factory`: a user's own model trains from the command line."""

import json
import os
import subprocess
import sys

from dist_launch import REPO


def _train(tmp_path, cache, model: str, *options: str) -> tuple[list[float], str]:
    losses = tmp_path / "losses.json"
    argv = [
        sys.executable,
        "-m",
        "partita.cli",
        "train",
        model,
        "--nproc",
        "2",
        "--steps",
        "3",
        "--losses-out",
        str(losses),
        "--cache-dir",
        str(cache),
        *options,
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TRANSFORMERS_VERBOSITY": "error",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(losses.read_text())["losses"], done.stdout


def test_the_example_factory_trains_with_falling_loss(tmp_path, machine_cache):
    losses, out = _train(tmp_path, machine_cache, "examples/own_model.py:build", "--global-batch", "16", "--lr", "1e-2")
    assert len(losses) == 3 and losses[-1] < losses[0], losses
    assert "plan:" in out and "loss:" in out


def test_hf_resnet_trains_as_a_1f1b_pipeline_of_two_microbatches(tmp_path, machine_cache):
    """An in-place residual add right after a cut, and BatchNorm per micro-batch slice (as documented)."""
    losses, out = _train(
        tmp_path,
        machine_cache,
        "tests/dist/factories.py:hf_resnet",
        "--global-batch",
        "8",
        "--schedule",
        "1f1b",
        "--num-stages",
        "2",
        "--microbatches",
        "2",
    )
    assert len(losses) == 3 and all(loss == loss for loss in losses), losses
    assert "plan: 2 stages on 2 rank groups" in out
