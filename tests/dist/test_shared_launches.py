"""dist_launch.SharedLaunches, with run_ranks replaced by a recorder (no process starts): which jobs
share a launch, in which order, with which directories, and what a failed shared launch does."""

from __future__ import annotations

import sys
import types

import dist_launch
import pytest
from dist_launch import Job, SharedLaunches


@pytest.fixture
def recorded(monkeypatch):
    """The launches run_ranks was asked for: (world size, timeout, [(label, target, params)]); a launch
    holding a job whose target starts with "boom" fails as a failed rank does."""
    calls = []

    def fake_run_ranks(job, world_size, out_dir, *, timeout_s, jobs):
        assert job == "several"
        calls.append((world_size, timeout_s, jobs))
        if any(target.startswith("boom") for _, target, _ in jobs):
            raise AssertionError("rank 1 failed (exit 1)")
        return [{label: (rank, target, params) for label, target, params in jobs} for rank in range(world_size)]

    monkeypatch.setattr(dist_launch, "run_ranks", fake_run_ranks)
    return calls


def _module(monkeypatch, name: str, jobs: dict[str, Job]) -> None:
    module = types.ModuleType(name)
    module.SHARED_JOBS = jobs
    monkeypatch.setitem(sys.modules, name, module)


def test_jobs_of_one_world_size_share_one_launch_in_order_last_ones_last(monkeypatch, recorded, tmp_path):
    _module(monkeypatch, "mod_a", {"a": Job("w:a", 2, 10, dict(x=1)), "hang": Job("w:h", 2, 5, last=True)})
    _module(monkeypatch, "mod_b", {"b": Job("w:b", 2, 20, dir_params=("dir",)), "four": Job("w:f", 4, 30)})
    wanted = {
        (m, label): sys.modules[m].SHARED_JOBS[label]
        for m, label in [("mod_a", "hang"), ("mod_a", "a"), ("mod_b", "b"), ("mod_b", "four")]
    }
    shared = SharedLaunches(wanted, tmp_path)
    assert shared.results_of("mod_b", "b") == [
        (r, "w:b", {"dir": str(tmp_path / "launch0-2ranks" / "mod_b.b")}) for r in range(2)
    ]
    assert (tmp_path / "launch0-2ranks" / "mod_b.b").is_dir()
    assert shared.results_of("mod_a", "a")[1] == (1, "w:a", {"x": 1})
    assert shared.results_of("mod_a", "hang")[0][1] == "w:h"
    ((world_size, timeout_s, jobs),) = recorded  # one launch for the three 2-rank jobs
    assert world_size == 2 and timeout_s == 35
    assert [label for label, _, _ in jobs] == ["mod_a:a", "mod_b:b", "mod_a:hang"]
    assert len(shared.results_of("mod_b", "four")) == 4 and len(recorded) == 2
    assert shared.launches == [["mod_a:a", "mod_b:b", "mod_a:hang"], ["mod_b:four"]]


def test_a_job_no_selected_test_uses_runs_with_the_jobs_not_yet_run(monkeypatch, recorded, tmp_path):
    _module(monkeypatch, "mod_a", {"a": Job("w:a", 2, 10), "late": Job("w:late", 2, 10), "c": Job("w:c", 2, 10)})
    shared = SharedLaunches({("mod_a", "a"): Job("w:a", 2, 10), ("mod_a", "c"): Job("w:c", 2, 10)}, tmp_path)
    shared.results_of("mod_a", "a")
    shared.results_of("mod_a", "late")  # asked for although not wanted (a test that looks its fixture up)
    assert shared.launches == [["mod_a:a", "mod_a:c"], ["mod_a:late"]]


def test_a_failed_shared_launch_is_run_again_job_by_job(monkeypatch, recorded, tmp_path):
    jobs = {"ok": Job("w:ok", 2, 10), "bad": Job("boom:bad", 2, 10), "other": Job("w:other", 2, 10)}
    _module(monkeypatch, "mod_a", jobs)
    shared = SharedLaunches({("mod_a", label): job for label, job in jobs.items()}, tmp_path)
    assert shared.results_of("mod_a", "ok")[0] == (0, "w:ok", {})
    with pytest.raises(AssertionError, match=r"job mod_a:bad \(boom:bad\): rank 1 failed"):
        shared.results_of("mod_a", "bad")
    with pytest.raises(AssertionError, match="rank 1 failed"):  # not launched again
        shared.results_of("mod_a", "bad")
    assert shared.results_of("mod_a", "other")[1] == (1, "w:other", {})
    assert shared.launches == [["mod_a:ok", "mod_a:bad", "mod_a:other"], ["mod_a:ok"], ["mod_a:bad"], ["mod_a:other"]]
