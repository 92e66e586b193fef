"""What every test shares: one thread per process, a fixed seed, the markers of the tiers, the zoo
graphs most unit tests plan or run (``mlp``, ``gpt2``), and ``--regenerate-golden``.

Tiers (README "Tests"): ``make test-fast`` runs ``-m "not dist and not slow"``; ``make test`` runs all.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

# One thread per process: the suite runs on 2 cores, and multi-process tests start several ranks.
torch.set_num_threads(1)
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

DIST = Path(__file__).resolve().parent / "dist"


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker, and before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """Every test under tests/dist starts processes of its own: marked ``dist``. Every test gets the
    ``xdist_group`` that ``make test`` (``pytest -n 2 --dist loadgroup``) keeps on one worker: its file
    (module fixtures are built once), or, for the users of shared launches (tests/dist/conftest.py),
    one group per set of world sizes that share users (a launch runs on the worker that holds all its
    jobs' tests, so that no job runs twice)."""
    launch_groups = _launch_groups(items)
    for item in items:
        if DIST in Path(item.path).parents:
            item.add_marker(pytest.mark.dist)
        item.add_marker(pytest.mark.xdist_group(launch_groups.get(item.nodeid, item.location[0])))
    if getattr(config.option, "loadgroup", False):  # xdist hands the groups out in this order: longest first
        rank = {}
        for item in items:
            group = item.get_closest_marker("xdist_group").args[0]
            rank[group] = min(rank.get(group, 3), _kind_rank(item, group))
        items.sort(key=lambda item: rank[item.get_closest_marker("xdist_group").args[0]])


def _kind_rank(item, group: str) -> int:
    """Shared launches (the longest), then the other multi-process tests, then the slow ones."""
    if group.startswith("launches-"):
        return 0
    if item.get_closest_marker("dist"):
        return 1
    return 2 if item.get_closest_marker("slow") else 3


def pytest_collection_finish(session):
    """Under ``--dist loadgroup`` every test's node id carries its group (pytest-xdist appends it):
    fail at once where it does not (a pytest that xdist cannot group), rather than run shared
    launches twice, once on each worker."""
    if getattr(session.config.option, "loadgroup", False) and any("@" not in item.nodeid for item in session.items):
        raise pytest.UsageError(
            f"pytest-xdist's --dist loadgroup has no effect under pytest {pytest.__version__}: install the "
            "test extra's pytest (pyproject.toml), or run pytest without -n"
        )


def _launch_groups(items) -> dict[str, str]:
    """nodeid -> ``launches-2-4``-style group of every test that uses a shared launch's job: world
    sizes used by one test join (union-find), as a launch runs all the jobs of its size."""
    sizes_of = {}
    for item in items:
        jobs = getattr(item.module, "SHARED_JOBS", {}) if DIST in Path(item.path).parents else {}
        sizes = {job.world_size for label, job in jobs.items() if label in item.fixturenames}
        if sizes:
            sizes_of[item.nodeid] = sizes
    parent = {size: size for sizes in sizes_of.values() for size in sizes}

    def root(size: int) -> int:
        while parent[size] != size:
            size = parent[size]
        return size

    for sizes in sizes_of.values():
        first, *rest = sorted(sizes)
        for size in rest:
            parent[root(size)] = root(first)
    members = {}
    for size in parent:
        members.setdefault(root(size), []).append(size)
    names = {r: "launches-" + "-".join(map(str, sorted(m))) for r, m in members.items()}
    return {nodeid: names[root(min(sizes))] for nodeid, sizes in sizes_of.items()}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def one_thread():
    """Every test runs on one thread, as set above, even after a test that changed the count (tiny
    models run fastest so, and the suite shares 2 cores); the count is restored afterwards."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


def capture_example(name: str, batch_size: int = 8):
    """The zoo model ``name`` (partita.examples) at ``batch_size``, and its captured graph (with the
    example's loss function and target): ``(example, graph)``."""
    import partita
    from partita import examples

    ex = examples.build(name, batch_size=batch_size)
    return ex, partita.capture(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)


# Module scope: the tests of one module share the model and graph (a test that trains changes the
# weights in place, for the module's later tests only); every module captures its own.
@pytest.fixture(scope="module")
def mlp():
    """The zoo MLP at batch 8 and its captured graph: ``(example, graph)``."""
    return capture_example("mlp")


@pytest.fixture(scope="module")
def mlp_graph(mlp):
    return mlp[1]


@pytest.fixture(scope="module")
def gpt2():
    """The zoo GPT-2 (tiny) at batch 8 and sequence 32, and its captured graph: ``(example, graph)``."""
    return capture_example("gpt2")


@pytest.fixture(scope="module")
def gpt2_graph(gpt2):
    return gpt2[1]


@pytest.fixture(scope="module")
def one_rank():
    """A 1-rank gloo process group in this process (a HashStore: no port), for the module's tests."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _no_process_group_left(request):
    """No test leaves a process group behind (``one_rank``'s lives until its module ends): the next
    test would find it, and what that test checks would depend on the order the tests ran in."""

    def initialized() -> bool:  # without importing torch.distributed where no test did
        dist = sys.modules.get("torch.distributed")
        return dist is not None and dist.is_available() and dist.is_initialized()

    before = initialized()
    yield
    if not before and initialized() and "one_rank" not in request.fixturenames:
        sys.modules["torch.distributed"].destroy_process_group()
        pytest.fail(f"{request.node.nodeid} left a process group behind (destroyed now)", pytrace=False)


def pytest_addoption(parser):
    parser.addoption(
        "--regenerate-golden",
        action="store_true",
        default=False,
        help="rewrite the reference files under tests/golden/ instead of comparing (see its README)",
    )


@pytest.fixture
def regenerate_golden(request) -> bool:
    return request.config.getoption("--regenerate-golden")
