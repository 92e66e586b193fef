"""The GPU check script (bench/gpu/check.py) keeps working: its CPU dry run, end to end.

The script is meant to run once, unattended, on a GPU machine with little time on it; this test
runs the same code on tiny models on the CPU so that it cannot rot in between. It runs the dry run
as a subprocess (the script makes and destroys a process group of its own) with one part made to
fail on purpose (``--fail-in``: all of ``llama/bf16``, and ``llama/fp32/mb2``, one micro-batch size
of a part), which must be recorded while everything else goes on.
Timings are never asserted; what is checked is that every part ran, every table has its rows and
the numbers are sane (positive, finite, the roofline terms rebuild ``analytic_costs``).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu" / "check.py"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[Path, dict, str]:
    out = tmp_path_factory.mktemp("gpu-check")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    done = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--dry-run",
            "--device",
            "cpu",
            "--out",
            str(out),
            "--fail-in",
            "llama/bf16,llama/fp32/mb2",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out, json.loads((out / "gpu_check.json").read_text()), done.stdout


def _load_script():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _load_sibling(name: str):
    """A module beside the script (``bench/gpu/NAME.py``), loaded from its file."""
    spec = importlib.util.spec_from_file_location(name, SCRIPT.parent / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_part_ran_and_the_injected_failure_is_recorded(dry_run):
    out, data, stdout = dry_run
    for name in ("gpu_check.json", "gpu_check.md", "calibrated_device.json"):
        assert (out / name).is_file(), name
    status = {p["name"]: p for p in data["parts"]}
    bf16 = "bf16" in data["settings"]["dtypes"]  # only where this CPU runs bf16
    expected_ok = ["environment", "gpt2/fp32", "calibration", "trainer"] + (["gpt2/bf16"] if bf16 else [])
    for name in expected_ok:
        assert status[name]["status"] == "ok", (name, status[name])
    if bf16:
        assert status["llama/bf16"]["status"] == "error" and "injected" in status["llama/bf16"]["error"]
    # one failed micro-batch size: recorded in its configuration, the part says so, the other size ran
    assert status["llama/fp32"]["status"] == "error" and status["llama/fp32"]["microbatches"] == [1]
    configs = {(c["model"], c["dtype"], c["microbatch_size"]): c for c in data["configs"]}
    assert "injected" in configs["llama", "fp32", 2]["errors"]["run"]
    assert configs["llama", "fp32", 1]["errors"] == {}
    assert data["environment"]["torch"] and data["environment"]["device"] == "cpu"
    assert "parts not ok:" in stdout


def test_time_rows_per_stage(dry_run):
    _, data, _ = dry_run
    rows = data["time_rows"]
    for model, mb in (("gpt2", 1), ("gpt2", 2), ("llama", 1)):
        mine = [r for r in rows if (r["model"], r["dtype"], r["microbatch_size"]) == (model, "fp32", mb)]
        kinds = {r["kind"] for r in mine}
        assert {"whole", "half", "quarter"} <= kinds, (model, mb, kinds)
        assert len([r for r in mine if r["kind"] == "quarter"]) == 4
    for r in rows:
        for key in (
            "measured_forward_ms",
            "measured_backward_ms",
            "analytic_forward_ms",
            "analytic_backward_ms",
            "profiled_forward_ms",
            "profiled_backward_ms",
        ):
            assert r[key] > 0 and math.isfinite(r[key]), (r["model"], r["stage"], key)
        assert r["analytic_step_err"] is not None and r["profiled_step_err"] is not None
    # the roofline terms kept for --calibrate rebuild analytic_costs exactly
    assert all(c["terms_check"] < 1e-9 for c in data["configs"] if "terms_check" in c)


def test_memory_rows_per_stage(dry_run):
    _, data, _ = dry_run
    rows = [r for r in data["memory_rows"] if (r["model"], r["dtype"]) == ("gpt2", "fp32")]
    assert {(r["in_flight"], r["recompute"]) for r in rows} == {
        (k, level) for k in (1, 2) for level in ("none", "selective", "full")
    }
    assert len({r["stage"] for r in rows}) == 4
    for r in data["memory_rows"]:
        m = r["measured"]
        assert m["total"] >= m["params"] + m["optimizer"] > 0
        assert r["predicted_analytic"]["total"] > 0 and r["analytic_err"] is not None


def test_trainer_losses_fall_on_one_rank(dry_run):
    _, data, _ = dry_run
    cases = {r["case"]: r for r in data["trainer_rows"]}
    expected = {
        "gpipe/1st/fp32",
        "1f1b/1st/fp32/full",
        "1f1b/1st/fp32/selective",
        "zbv/2st/fp32",
        "interleaved1f1b/2st/fp32",
        "gpipe/1st/fp32/autocast-bf16",
    }
    if "bf16" in data["settings"]["dtypes"]:
        expected.add("zbv/2st/bf16")
    assert set(cases) == expected
    for r in cases.values():
        assert r["finite"] and r["falls"], r
        if r["dtype"] == "fp32":  # the same numbers as unsplit training (under autocast for bf16)
            assert r["unsplit_missing_keys"] == [], r
            tolerance = 1e-5 if r["precision"] == "fp32" else 1e-2  # bf16 products round differently
            assert r["unsplit_loss_diff"] < tolerance and r["unsplit_param_diff"] < tolerance, r
            assert r["unsplit_step_ms"] > 0, r  # timed as the Trainer's step is


def test_markdown_report(dry_run):
    out, _, _ = dry_run
    text = (out / "gpu_check.md").read_text()
    for needle in (
        "## Environment",
        "## Time per stage",
        "| gpt2 | fp32 | 1 | whole |",
        "| llama | fp32 | 1 | half 2/2 |",
        "## Memory of one Adam training step",
        "## Trainer on one rank",
        "## Calibration",
        "## Errors",
        "failure injected",
    ):
        assert needle in text, needle


def test_trainer_table_shows_a_case_that_failed_after_its_steps():
    """The H100 run's rows: a case whose losses were recorded before it failed (comparing with the
    unsplit model) once broke the whole markdown report with a KeyError."""
    script = _load_script()
    rows = [
        {
            "case": "gpipe/1st/fp32",
            "microbatches": 2,
            "global_batch": 8,
            "losses": [11.04, 9.44],
            "error": "RuntimeError: devices",
        },
        {"case": "zbv/2st/fp32", "error": "skipped: time budget"},
    ]
    text = "\n".join(script._trainer_table({"trainer_rows": rows}))
    assert "| gpipe/1st/fp32 | 2 | 8 | 11.040, 9.440; RuntimeError: devices |" in text
    assert "| zbv/2st/fp32 | - | - | skipped: time budget |" in text
    widths = {line.count("|") for line in text.splitlines() if line.startswith("|")}
    assert len(widths) == 1, text  # every row as wide as the header


def test_time_per_operator(dry_run):
    """Each profiled configuration keeps every node's target and profiled times; summed per operator,
    they are the profiled table's total, and the report lists the operators."""
    out, data, _ = dry_run
    op_type_rows = _load_sibling("op_types").op_type_rows

    profiled = [c for c in data["configs"] if c.get("profiled_nodes")]
    assert profiled
    for config in profiled:
        assert len(config["targets"]) == config["num_nodes"] == len(config["profiled_nodes"]["forward_s"])
        rows = op_type_rows(config)
        total = sum(config["profiled_nodes"]["forward_s"]) + sum(config["profiled_nodes"]["backward_s"])
        assert math.isclose(sum(r["measured_ms"] for r in rows), 1e3 * total, rel_tol=1e-9)
        assert {"mm", "addmm", "matmul", "linear"} & {r["op"] for r in rows}
    assert "## Time per operator" in (out / "gpu_check.md").read_text()


def test_implied_efficiencies_per_operator():
    op_type_rows = _load_sibling("op_types").op_type_rows

    config = {
        "model": "m",
        "dtype": "bf16",
        "microbatch_size": 1,
        "targets": ["aten.mm.default", "aten.add.Tensor", "aten.mm.default", "aten.view.default"],
        "terms": {
            "c_f": [1e-3, 0.0, 3e-3, 0.0],
            "m_f": [1e-4, 2e-3, 1e-4, 0.0],
            "n_f": [1, 1, 1, 1],
            "c_b": [2e-3, 0.0, 6e-3, 0.0],
            "m_b": [2e-4, 2e-3, 2e-4, 0.0],
            "n_b": [2, 1, 2, 0],
        },
        "profiled_nodes": {"forward_s": [2e-3, 4e-3, 6e-3, 1e-5], "backward_s": [4e-3, 2e-3, 12e-3, 0.0]},
    }
    rows = {(r["op"], r["direction"]): r for r in op_type_rows(config)}
    assert set(rows) == {
        ("mm", "forward"),
        ("mm", "backward"),
        ("add", "forward"),
        ("add", "backward"),
        ("view", "forward"),
    }
    assert math.isclose(rows[("mm", "forward")]["compute_efficiency"], 0.5)  # 4 ms of FLOPs in 8 ms
    assert math.isclose(rows[("mm", "backward")]["compute_efficiency"], 0.5)
    assert math.isclose(rows[("add", "forward")]["memory_efficiency"], 0.5)
    assert math.isclose(rows[("add", "backward")]["memory_efficiency"], 1.0)
    assert math.isclose(rows[("view", "forward")]["us_per_op"], 10.0)
    assert rows[("mm", "forward")]["nodes"] == 2


def test_calibrate_from_the_json(dry_run, tmp_path, capsys):
    from partita.types.devices import load_device_file

    out, _, _ = dry_run
    check = _load_script()
    assert check.main(["--calibrate", str(out / "gpu_check.json"), "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "compute_efficiency" in printed and "op_overhead_s" in printed
    spec = load_device_file(tmp_path / "calibrated_device.json")
    assert spec.name == "h200-calibrated" and 0 < spec.compute_efficiency <= 1 and spec.op_overhead_s >= 0
    assert spec.peak_flops["bfloat16"] == 989.4e12  # the rest comes from the base entry


def test_calibration_recovers_known_efficiencies():
    """Stage times made from the roofline with known values are fitted back to those values."""
    import numpy as np

    check = _load_script()
    rng = np.random.default_rng(0)
    n = 400
    compute_bound = rng.random(n) < 0.3  # matmuls: compute-bound; the rest memory-bound, with tiny ops
    terms = {
        "c_f": np.where(compute_bound, rng.uniform(1e-5, 1e-3, n), 0.0),
        "m_f": rng.uniform(1e-7, 1e-5, n) * np.where(compute_bound, 0.1, 1.0),
        "n_f": np.ones(n),
    }
    terms |= {"c_b": 2 * terms["c_f"], "m_b": 2 * terms["m_f"], "n_b": 2 * terms["n_f"]}
    truth = dict(ce=0.55, me=0.65, oh=12e-6)
    configs, rows = [], []
    for scale, mb in ((1.0, 1), (4.0, 4)):  # a second micro-batch size: 4x the work, the same op count
        t = {k: (v * scale if k[0] in "cm" else v) for k, v in terms.items()}
        configs.append(
            {"model": "m", "dtype": "fp32", "microbatch_size": mb, "terms": {k: v.tolist() for k, v in t.items()}}
        )
        for start, stop in ((0, n), (0, n // 2), (n // 2, n), (0, n // 4), (n // 4, n // 2), (10, 30), (300, 310)):
            ms = {
                d: 1e3 * float(check.roofline_time(t, d, truth["ce"], truth["me"], truth["oh"])[start:stop].sum())
                for d in "fb"
            }
            rows.append(
                {
                    "model": "m",
                    "dtype": "fp32",
                    "microbatch_size": mb,
                    "start": start,
                    "stop": stop,
                    "measured_forward_ms": ms["f"],
                    "measured_backward_ms": ms["b"],
                }
            )
    base = {"name": "h200", "compute_efficiency": 0.7, "memory_efficiency": 0.8, "op_overhead_s": 5e-6}
    fit = check.calibrate({"configs": configs, "time_rows": rows, "analytic_device": base})["all"]
    assert abs(fit["compute_efficiency"] - truth["ce"]) <= 0.02
    assert abs(fit["memory_efficiency"] - truth["me"]) <= 0.02
    assert abs(fit["op_overhead_s"] - truth["oh"]) <= 1e-6
    assert fit["after"]["worst_abs_err_pct"] < 3 < fit["before"]["worst_abs_err_pct"]
