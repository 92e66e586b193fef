"""Golden files: plan files and schedule action orders, compared byte for byte with tests/golden/.

A change to the planner's choices, to the plan-file format or to a schedule's order shows up here as
a diff. If it is intended, regenerate and review the diff (tests/golden/README.md):

    .venv/bin/python -m pytest tests/golden --regenerate-golden
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path

import pytest
import torch

import partita
from partita import examples
from partita.types import Schedule
from partita.types.schedule_orders import rank_orders

GOLDEN = Path(__file__).resolve().parent
PLANS, SCHEDULES, VERSIONS = GOLDEN / "plans", GOLDEN / "schedules", GOLDEN / "versions.json"
HOW_TO_REGENERATE = (
    "if the change is intended, regenerate with `.venv/bin/python -m pytest tests/golden "
    "--regenerate-golden` and review `git diff tests/golden`"
)

# model x cluster x options; analytic costs, so the plans are exact (the cases of /tmp/golden_gen.py)
PLAN_CASES = {
    "gpt2-tiny_h100x4": dict(model="gpt2-tiny", batch=8, cluster=dict(device="h100", num_devices=4), gbs=32, kw={}),
    "llama-tiny_a100x8_1f1b": dict(
        model="llama-tiny",
        batch=8,
        cluster=dict(device="a100-80gb", num_devices=8, memory_bytes=2**30),
        gbs=64,
        kw=dict(schedules="1f1b"),
    ),
    "bert-tiny_h100x2_gpipe": dict(
        model="bert-tiny",
        batch=8,
        cluster=dict(device="h100", num_devices=2),
        gbs=16,
        kw=dict(schedules="gpipe", num_stages=2),
    ),
    "llama-tiny_h100x4_fp32_zero2": dict(  # untied embeddings: GPT-2's tied ones keep its stages replicated
        model="llama-tiny",
        batch=8,
        cluster=dict(device="h100", num_devices=4),
        gbs=32,
        kw=dict(precision="fp32", sharding="shard_grads_and_optimizer", replicas=2),
    ),
    "mlp-tiny_h100x6_uneven": dict(
        model="mlp-tiny", batch=8, cluster=dict(device="h100", num_devices=6), gbs=24, kw=dict(uniform_replicas=False)
    ),
}

# schedule -> (num_microbatches, num_rank_groups, num_stages) it runs
SCHEDULE_CASES = {
    Schedule.GPIPE: [(4, 2, 2), (3, 4, 4)],
    Schedule.ONE_F_ONE_B: [(4, 4, 4), (8, 4, 4), (3, 2, 2)],
    Schedule.INTERLEAVED_1F1B: [(4, 2, 4), (8, 4, 8), (6, 2, 6), (2, 4, 8)],
    Schedule.ZBV: [(4, 2, 4), (8, 4, 8), (2, 4, 8)],
}


def _versions() -> dict[str, str]:
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__}


def check_golden(path: Path, actual: bytes, regenerate: bool) -> None:
    """Compare ``actual`` with the file at ``path`` byte for byte, or (regenerate) write it there."""
    if regenerate:
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_bytes() != actual:
            path.write_bytes(actual)
        return
    rel = path.relative_to(GOLDEN.parent.parent)
    if not path.exists():
        pytest.fail(f"{rel} does not exist; {HOW_TO_REGENERATE}")
    expected = path.read_bytes()
    if actual == expected:
        return
    diff = "".join(
        difflib.unified_diff(
            expected.decode(errors="replace").splitlines(keepends=True),
            actual.decode(errors="replace").splitlines(keepends=True),
            fromfile=f"{rel} (expected)",
            tofile="generated now",
        )
    )
    pytest.fail(
        f"{rel} differs from what the code generates now:\n{diff or '(same text, other bytes)'}\n{HOW_TO_REGENERATE}",
        pytrace=False,
    )


def check_no_stale_files(folder: Path, pattern: str, names: set[str], regenerate: bool) -> None:
    stale = sorted(p for p in folder.glob(pattern) if p.name not in names)
    if regenerate:
        for path in stale:
            path.unlink()
        return
    assert not stale, f"golden files no case generates: {[p.name for p in stale]}; {HOW_TO_REGENERATE}"


# ------------------------------------------------------------------------------ plans


@pytest.mark.parametrize("case", sorted(PLAN_CASES))
def test_plan_file_matches_golden(case, tmp_path, regenerate_golden):
    if regenerate_golden:
        VERSIONS.write_text(json.dumps(_versions(), indent=2, sort_keys=True) + "\n")
    c = PLAN_CASES[case]
    ex = examples.build(c["model"], batch_size=c["batch"])
    plan = partita.plan(
        ex.model,
        ex.args,
        ex.kwargs,
        loss_fn=ex.loss_fn,
        target=ex.target,
        cluster=partita.Cluster(**c["cluster"]),
        global_batch_size=c["gbs"],
        options=partita.PlanOptions(costs="analytic", **c["kw"]),
    )
    out = tmp_path / f"{case}.json"
    plan.save(out)
    path, actual = PLANS / out.name, out.read_bytes()
    recorded = json.loads(VERSIONS.read_text())
    if not regenerate_golden and recorded != _versions() and path.exists():
        actual = version_independent(actual, json.loads(path.read_bytes()), recorded)
    check_golden(path, actual, regenerate_golden)


def version_independent(actual: bytes, expected: dict, recorded: dict[str, str]) -> bytes:
    """The plan file generated under other releases than ``recorded`` (versions.json), for comparing
    with the golden one: its torch_version set to the golden file's; the rest must not differ.

    That holds only if these releases capture the very graph the golden plan was made from (same
    ``graph_fingerprint``: nodes, shapes, dtypes, parameters), which is checked first. A different
    graph fails the test; it is not skipped (README.md here)."""
    generated = json.loads(actual)
    if generated["graph_fingerprint"] != expected["graph_fingerprint"]:
        pytest.fail(
            f"the golden plans were made with {recorded}; this is {_versions()}, which captures another "
            f"graph of this model (fingerprint {generated['graph_fingerprint']}, golden "
            f"{expected['graph_fingerprint']}), so the plans cannot be compared. Run the tests under the "
            f"recorded releases (`make test` installs them), or regenerate under new pins and update the "
            f"Makefile's TORCH_SPEC/TRANSFORMERS_SPEC with them",
            pytrace=False,
        )
    line = f'\n  "torch_version": {json.dumps(generated["torch_version"])},\n'.encode()
    assert actual.count(line) == 1, f"the plan file's torch_version line is not {line!r}"
    return actual.replace(line, f'\n  "torch_version": {json.dumps(expected["torch_version"])},\n'.encode())


def test_under_other_releases_all_but_the_torch_version_is_compared():
    golden = (PLANS / "mlp-tiny_h100x6_uneven.json").read_bytes()
    expected, recorded = json.loads(golden), json.loads(VERSIONS.read_text())
    line = f'"torch_version": {json.dumps(expected["torch_version"])},'.encode()
    other = golden.replace(line, b'"torch_version": "9.99.0+cu999",')
    assert other != golden
    assert version_independent(other, expected, recorded) == golden
    changed = other.replace(b'"precision": "bf16"', b'"precision": "fp32"', 1)
    assert changed != other and version_independent(changed, expected, recorded) != golden
    with pytest.raises(pytest.fail.Exception, match="captures another graph"):
        version_independent(other, {**expected, "graph_fingerprint": "0" * 16}, recorded)


def test_no_stale_plan_files(regenerate_golden):
    check_no_stale_files(PLANS, "*.json", {f"{case}.json" for case in PLAN_CASES}, regenerate_golden)


# ------------------------------------------------------------------------------ schedules


def schedule_file_name(schedule: Schedule, m: int, g: int, s: int) -> str:
    return f"{schedule.value}_m{m}_g{g}_s{s}.txt"


def schedule_text(schedule: Schedule, m: int, g: int, s: int) -> str:
    """One line per rank group, its actions in order, space-separated (``2F0``: forward of micro-batch 0 on stage 2)."""
    return "".join(" ".join(map(str, actions)) + "\n" for actions in rank_orders(schedule, m, g, s))


def test_every_schedule_has_cases():
    assert set(SCHEDULE_CASES) == set(Schedule), f"add golden cases for {set(Schedule) - set(SCHEDULE_CASES)}"


@pytest.mark.parametrize(
    ("schedule", "m", "g", "s"),
    [(schedule, *t) for schedule, triples in SCHEDULE_CASES.items() for t in triples],
    ids=lambda v: v.value if isinstance(v, Schedule) else str(v),
)
def test_schedule_order_matches_golden(schedule, m, g, s, regenerate_golden):
    text = schedule_text(schedule, m, g, s)
    check_golden(SCHEDULES / schedule_file_name(schedule, m, g, s), text.encode(), regenerate_golden)


def test_no_stale_schedule_files(regenerate_golden):
    names = {schedule_file_name(schedule, *t) for schedule, triples in SCHEDULE_CASES.items() for t in triples}
    check_no_stale_files(SCHEDULES, "*.txt", names, regenerate_golden)
