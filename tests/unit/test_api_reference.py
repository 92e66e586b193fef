"""The public API is intentional and documented: the README's examples use only what ``partita``
exports, and docs/api.md is the reference generated from the docstrings, with no broken reference."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import partita

REPO = Path(__file__).resolve().parents[2]


def _python_blocks(markdown: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", markdown, flags=re.S)


def test_readme_examples_import_nothing_from_a_submodule():
    code = "\n".join(_python_blocks((REPO / "README.md").read_text()))
    submodule_imports = re.findall(r"^\s*(?:from partita\.[\w.]+ import .*|import partita\.[\w.]+.*)$", code, re.M)
    assert submodule_imports == [], submodule_imports


def test_every_partita_name_the_readme_uses_is_exported():
    code = "\n".join(_python_blocks((REPO / "README.md").read_text()))
    used = set(re.findall(r"\bpartita\.([A-Za-z_]\w*)", code)) - {"types"}  # records live in partita.types
    assert used, "the README shows the Python API"
    assert used <= set(partita.__all__), sorted(used - set(partita.__all__))


def test_the_top_level_is_the_verbs_objects_and_errors():
    names = set(partita.__all__)
    assert {"capture", "plan", "PlanOptions", "Cluster", "Plan", "Trainer", "fit", "manual_plan"} <= names
    assert {"plan_with_baselines", "shared_plan", "save_seed", "load_into_model"} <= names
    assert not names & {"StagePlan", "Schedule", "CostTable", "OpNode", "ModelSpecError"}, (
        "records live in partita.types"
    )
    for name in names:
        assert getattr(partita, name) is not None


def test_moved_names_still_resolve_with_a_deprecation_warning():
    import warnings

    import partita.types

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert partita.Schedule is partita.types.Schedule
    assert any(issubclass(w.category, DeprecationWarning) and "partita.types" in str(w.message) for w in caught)


def test_the_api_reference_is_current_and_every_reference_resolves():
    """`make docs` regenerates docs/api.md; CI fails when it is stale or a docstring names a
    ``partita.x.y`` that does not exist."""
    spec = importlib.util.spec_from_file_location("api_reference", REPO / "docs" / "api_reference.py")
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    text, broken = generator.render()
    assert broken == [], f"docstrings name partita objects that do not exist: {broken}"
    assert (REPO / "docs" / "api.md").read_text() == text, "docs/api.md is stale: run `make docs` and commit it"
