"""The launches the multi-process tests share (dist_launch.SharedLaunches).

A test module lists its jobs in ``SHARED_JOBS`` (label -> dist_launch.Job) and gives each a
module-scoped fixture of the same name that returns ``launches.results_of(__name__, label)``. The jobs
that the selected tests use (a test uses a job when it uses the fixture of its label) run together,
one launch per world size, when a test first asks for one.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from dist_launch import Job, SharedLaunches

HERE = Path(__file__).resolve().parent
WANTED = pytest.StashKey[dict]()
LAUNCHES = pytest.StashKey[SharedLaunches]()


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected
def pytest_collection_modifyitems(config, items):
    """Find the jobs the selected tests use; give those tests the time of every launch they may wait
    for (pytest-timeout counts a module fixture's set-up in the first test that uses it)."""
    wanted: dict[tuple[str, str], Job] = {}
    users = []
    for item in items:
        jobs: dict[str, Job] = getattr(item.module, "SHARED_JOBS", {}) if HERE in Path(item.path).parents else {}
        used = [label for label in jobs if label in item.fixturenames]
        wanted |= {(item.module.__name__, label): jobs[label] for label in used}
        if used:
            users.append(item)
    config.stash[WANTED] = wanted
    # a failed shared launch is run again job by job: twice the jobs' time, at worst
    total_s = 2 * sum(job.timeout_s for job in wanted.values()) + 600
    for item in users:
        item.add_marker(pytest.mark.timeout(total_s))


@pytest.fixture(scope="session")
def launches(request, tmp_path_factory) -> SharedLaunches:
    shared = SharedLaunches(request.config.stash.get(WANTED, {}), tmp_path_factory.mktemp("launches"))
    request.config.stash[LAUNCHES] = shared
    return shared


@pytest.fixture(scope="session")
def machine_cache(tmp_path_factory) -> Path:
    """One ``--cache-dir`` for the suite's CLI runs on this machine: its calibration (matmul speed,
    gloo links, contention; about 17 s of a 2-process run) is measured by the first run and read by
    the rest, as a user's runs share theirs. Cost tables are keyed by model, so each model's are
    still measured. Shared by the pytest-xdist workers of one session (entries are written
    atomically); a session's runs never see another session's. The runs that test measuring
    itself (two nodes, each its own machine; the natural script's ranks) keep caches of their own."""
    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "partita-cache"
    folder.mkdir(exist_ok=True)
    return folder


def pytest_terminal_summary(terminalreporter, config):
    """What the shared launches ran (with -v or -rA: every job), so that their count can be followed."""
    shared = config.stash.get(LAUNCHES, None)
    if shared is None or not shared.launches:
        return
    jobs = sum(len(launch) for launch in shared.launches)
    terminalreporter.write_line(f"shared launches: {len(shared.launches)}, running {jobs} job(s)")
    if config.option.verbose > 0 or "A" in (config.option.reportchars or ""):
        for launch in shared.launches:
            terminalreporter.write_line(f"  {len(launch)} job(s): {', '.join(launch)}")
