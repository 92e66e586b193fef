import os

import pytest
import torch

# One thread per process: the suite runs on 2 cores, and multi-process tests start several ranks.
torch.set_num_threads(1)
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


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
