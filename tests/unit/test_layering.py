"""partita's layers import one way only, at run time as well as in the source.

    level 0   partita.errors, partita.checks, partita.units, partita.types(.*)      ("base")
    level 1   partita.capturing
    level 2   partita.cost
    level 3   partita.planning
    level 4   partita.runtime
    level 5   partita.training   (the loop of partita.fit and `partita train`)
    side      partita.report     level 0 only
    side      partita.examples   levels 0-1 only (never planning, runtime or report)
    top       partita.cli        anything

The root ``partita/__init__.py`` is lazy (PEP 562): anyone may import it, and it imports nothing
eagerly but level 0.

Two checks, one for each way a layer can leak:

* dynamic: every module is imported on its own, in a child forked from a fresh interpreter that
  has loaded torch but no partita module, which reads ``sys.modules`` afterwards (as fresh as
  ``python -c "import partita.X.Y"``, and stricter than one interpreter per package). An import hook
  records who imported every partita module, so a failure names the chain that pulled the
  offending module in. The same children also show that every module imports on its own.
* static: ``ast`` over every .py under partita/: every ``import``/``from ... import`` of
  ``partita.X``, at module level and inside functions (except under ``if TYPE_CHECKING:``), every
  ``partita.Name`` reached through the lazy root, and every ``importlib.import_module("partita.X")``
  must point to the same or an earlier layer. A deliberate lazy convenience import upwards goes in
  ``ALLOWED_UPWARD``, with the reason; only imports inside functions can be allowed that way.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE_DIR = REPO / "partita"

ROOT, BASE, CLI = "root", "base", "cli"

# module-name prefix -> layer group
GROUP_OF_PREFIX = {
    "partita.errors": BASE,
    "partita.checks": BASE,
    "partita.units": BASE,
    "partita.types": BASE,
    "partita.capturing": "capture",
    "partita.cost": "cost",
    "partita.planning": "planning",
    "partita.runtime": "runtime",
    "partita.training": "training",
    "partita.report": "report",
    "partita.examples": "examples",
    "partita.cli": CLI,
}

_CHAIN = [BASE, "capture", "cost", "planning", "runtime", "training"]
# group -> the groups its modules may import (everyone may import the lazy root)
ALLOWED_GROUPS: dict[str, frozenset[str]] = {
    ROOT: frozenset({ROOT, BASE}),
    **{group: frozenset({ROOT, *_CHAIN[: i + 1]}) for i, group in enumerate(_CHAIN)},
    "report": frozenset({ROOT, BASE, "report"}),
    "examples": frozenset({ROOT, BASE, "capture", "examples"}),
    CLI: frozenset({ROOT, *_CHAIN, "report", "examples", CLI}),
}

# ("module:Function.qualname", imported module) -> why: the deliberate lazy imports upwards, each
# inside the one function named (and the functions nested in it); "module" alone would allow every
# function of the module. The imported module covers its submodules. The run-time check never
# consults this list: an import that runs while a module is imported is not lazy.
ALLOWED_UPWARD: dict[tuple[str, str], str] = {
    ("partita.types.plan:Plan.summary", "partita.report.plan"): (
        "Plan.summary() renders itself with report.plan_text, imported when called; report needs level 0 only"
    ),
    ("partita.types.cluster:Cluster.local", "partita.cost.local_machine"): (
        "Cluster.local() calibrates on this machine with cost.local_machine, imported when called"
    ),
}

SUBPROCESS_TIMEOUT_S = 120


def group_of(module: str) -> str | None:
    """The layer group of a partita module name; None for a module no layer claims."""
    if module == "partita":
        return ROOT
    for prefix, group in GROUP_OF_PREFIX.items():
        if module == prefix or module.startswith(prefix + "."):
            return group
    return None


def _inside(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def allowed_upward_key(
    where: str, imported: str, allowed: dict[tuple[str, str], str] = ALLOWED_UPWARD
) -> tuple[str, str] | None:
    """The ALLOWED_UPWARD entry that lets the function at ``where`` ("module:Qual.name") import ``imported``."""
    module, _, qualname = where.partition(":")
    for src, dst in allowed:
        src_module, _, src_qualname = src.partition(":")
        if src_module == module and _inside(imported, dst) and (not src_qualname or _inside(qualname, src_qualname)):
            return src, dst
    return None


def may_import(importer: str, imported: str) -> bool:
    src, dst = group_of(importer), group_of(imported)
    return src is not None and dst is not None and dst in ALLOWED_GROUPS[src]


def iter_modules(package_dir: Path, package: str = "partita") -> dict[str, Path]:
    """Every importable module under ``package_dir`` (packages by their __init__), by name; no __main__."""
    modules = {}
    for path in sorted(package_dir.rglob("*.py")):
        rel = path.relative_to(package_dir).with_suffix("")
        parts = list(rel.parts)
        if "__pycache__" in parts or parts[-1] == "__main__":
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if not all(p.isidentifier() for p in parts):
            continue
        modules[".".join([package, *parts])] = path
    return modules


# ============================================================================== static check


@dataclass(frozen=True)
class Violation:
    importer: str
    imported: str
    path: str
    line: int
    how: str  # "module level", "in a function", ...

    def __str__(self) -> str:
        return (
            f"{self.path}:{self.line}: {self.importer} ({group_of(self.importer)}) imports {self.imported} "
            f"({group_of(self.imported)}) {self.how}"
        )


def _root_exports(init_path: Path) -> dict[str, str]:
    """The lazy root's ``_EXPORTS`` table (public name -> defining module), read from its source."""
    try:
        tree = ast.parse(init_path.read_text())
    except (OSError, SyntaxError):
        return {}
    for node in tree.body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        if any(isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in targets) and node.value is not None:
            try:
                value = eval(compile(ast.Expression(node.value), str(init_path), "eval"), {"__builtins__": {}})
            except Exception:  # noqa: BLE001 - anything but a literal-ish table: no lazy names known
                return {}
            return {str(k): str(v) for k, v in value.items()} if isinstance(value, dict) else {}
    return {}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class _ImportCollector(ast.NodeVisitor):
    """(imported module, line, how) for every run-time reference to a partita module in one file."""

    def __init__(
        self,
        module: str,
        is_package: bool,
        known: set[str],
        exports: dict[str, str],
        package: str,
        type_checking: bool = False,
    ):
        self.module, self.is_package, self.known, self.exports, self.package = (
            module,
            is_package,
            known,
            exports,
            package,
        )
        self.type_checking = type_checking  # also report the imports under ``if TYPE_CHECKING:``
        self.in_type_checking = False
        self.found: list[tuple[str, int, str, str | None]] = []  # imported, line, how, enclosing function
        self.depth = 0  # function nesting
        self.scope: list[str] = []  # the enclosing classes and functions
        self.binds_root = False

    # -------------------------------------------------------------- resolution
    def _submodule_or(self, parent: str, name: str) -> str:
        return f"{parent}.{name}" if f"{parent}.{name}" in self.known else parent

    def _from_root(self, name: str) -> str:
        if f"{self.package}.{name}" in self.known:
            return f"{self.package}.{name}"
        return self.exports.get(name, self.package)  # __version__ and friends: the root itself

    def _absolute(self, node: ast.ImportFrom) -> str | None:
        if not node.level:
            return node.module
        base = self.module.split(".")
        if not self.is_package:
            base = base[:-1]
        base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
        return ".".join(base + ([node.module] if node.module else [])) or None

    def _add(self, imported: str, node: ast.AST, how: str | None = None) -> None:
        function = ".".join(self.scope) if self.depth else None
        where = f"in {function}()" if function else "at module level"
        if self.in_type_checking:
            where += " under TYPE_CHECKING"
        self.found.append((imported, node.lineno, f"{how} {where}" if how else where, function))

    # -------------------------------------------------------------- scopes
    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):
            if self.type_checking:
                outer, self.in_type_checking = self.in_type_checking, True
                for child in node.body:
                    self.visit(child)
                self.in_type_checking = outer
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def _visit_function(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        for deco in getattr(node, "decorator_list", []):  # run at definition time
            self.visit(deco)
        args = node.args
        for default in [*args.defaults, *(d for d in args.kw_defaults if d is not None)]:
            self.visit(default)
        self.depth += 1
        self.scope.append(getattr(node, "name", "<lambda>"))
        for child in node.body if isinstance(node.body, list) else [node.body]:
            self.visit(child)
        self.scope.pop()
        self.depth -= 1
        # annotations are skipped: the house style is ``from __future__ import annotations``

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _visit_function

    def visit_ClassDef(self, node: ast.ClassDef) -> None:  # a class body runs at import: no depth
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self.visit(node.target)
        if node.value is not None:
            self.visit(node.value)

    # -------------------------------------------------------------- imports
    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if _inside(alias.name, self.package):
                self._add(alias.name, node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = self._absolute(node)
        if module is None or not _inside(module, self.package):
            return
        for alias in node.names:
            if alias.name == "*":
                self._add(module, node)
            elif module == self.package:
                self._add(self._from_root(alias.name), node)
            else:
                self._add(self._submodule_or(module, alias.name), node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
        if (
            name == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and _inside(node.args[0].value, self.package)
        ):
            self._add(node.args[0].value, node, "with importlib.import_module")
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        # ``partita.Name`` through the lazy root, in files that bind the name ``partita``
        if isinstance(node.value, ast.Name) and node.value.id == self.package and self.binds_root:
            target = self._from_root(node.attr)
            if target != self.package:
                self._add(target, node, f"through the lazy root (partita.{node.attr})")
        self.generic_visit(node)


@dataclass(frozen=True)
class StaticImport:
    """One reference of ``importer`` to the partita module ``imported``, at ``path``:``line``."""

    importer: str
    imported: str
    path: str
    line: int
    how: str  # "at module level", "in f()", "... under TYPE_CHECKING", ...
    function: str | None  # the enclosing function's qualified name; None at module level


def static_imports(package_dir: Path, package: str = "partita", *, type_checking: bool = False) -> list[StaticImport]:
    """Every reference to a partita module in the files under ``package_dir`` (see _ImportCollector);
    with ``type_checking``, also the imports under ``if TYPE_CHECKING:``."""
    modules = iter_modules(package_dir, package)
    known = set(modules)
    exports = _root_exports(package_dir / "__init__.py")
    found = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        collector = _ImportCollector(module, path.name == "__init__.py", known, exports, package, type_checking)
        # a first pass finds whether the file binds the name ``partita`` anywhere
        collector.binds_root = any(
            isinstance(n, ast.Import) and any(a.asname is None and _inside(a.name, package) for a in n.names)
            for n in ast.walk(tree)
        )
        collector.visit(tree)
        rel = str(path.relative_to(package_dir.parent))
        found += [StaticImport(module, imported, rel, line, how, fn) for imported, line, how, fn in collector.found]
    return found


def static_violations(
    package_dir: Path, package: str = "partita", allowed: dict[tuple[str, str], str] = ALLOWED_UPWARD
) -> tuple[list[Violation], set[tuple[str, str]]]:
    """The upward imports under ``package_dir``, and the ``allowed`` entries that were used."""
    violations, used = [], set()
    for imp in static_imports(package_dir, package):
        if may_import(imp.importer, imp.imported):
            continue
        key = allowed_upward_key(f"{imp.importer}:{imp.function}", imp.imported, allowed) if imp.function else None
        if key:
            used.add(key)
        else:
            violations.append(Violation(imp.importer, imp.imported, imp.path, imp.line, imp.how))
    return violations, used


def test_every_module_belongs_to_a_layer():
    unclaimed = [m for m in iter_modules(PACKAGE_DIR) if group_of(m) is None]
    assert not unclaimed, (
        f"modules no layer claims: {unclaimed}; add their package to GROUP_OF_PREFIX in {Path(__file__).name}"
    )


def test_static_imports_point_down_the_layers():
    violations, used = static_violations(PACKAGE_DIR)
    stale = sorted(set(ALLOWED_UPWARD) - used)
    if stale:
        warnings.warn(f"ALLOWED_UPWARD entries no import uses any more (remove them): {stale}", stacklevel=1)
    assert not violations, (
        "imports against the layers (importer's group -> imported group):\n"
        + "\n".join(f"  {v}" for v in violations)
        + (
            "\nmove the code, pass the value in, or (a lazy convenience import "
            "only) add it to ALLOWED_UPWARD with the reason"
        )
    )


def _write_tree(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


FAKE_TREE = {
    "partita/__init__.py": '_EXPORTS = {"plan": "partita.planning.solve", "Plan": "partita.types"}\n',
    "partita/errors.py": "",
    "partita/types/__init__.py": "",
    "partita/types/plan.py": """
        class Plan:
            def summary(self):
                from partita.report.plan import plan_text  # allowed lazily (FAKE_ALLOWED)
                return plan_text

            def other(self):
                from partita.report.plan import plan_text  # line 8: the same module, another function
                return plan_text
        """,
    "partita/capturing/__init__.py": "",
    "partita/capturing/ok.py": """
        from typing import TYPE_CHECKING

        from partita.errors import *  # noqa
        from partita import errors, Plan

        if TYPE_CHECKING:
            from partita.runtime.trainer import Trainer  # type-only: never reported
        """,
    "partita/capturing/bad.py": """
        import partita
        from partita.planning.solve import solve  # line 3: level 1 -> level 3


        def later():
            import partita.runtime.trainer  # line 7: lazily, still upwards
            return partita.plan  # line 8: the lazy root resolves to planning
        """,
    "partita/capturing/rel.py": "from ..cost import table  # line 1: relative, level 1 -> level 2\n",
    "partita/cost/__init__.py": "",
    "partita/cost/table.py": "",
    "partita/planning/__init__.py": "",
    "partita/planning/solve.py": "def solve(): pass\n",
    "partita/runtime/__init__.py": "",
    "partita/runtime/trainer.py": "class Trainer: pass\n",
    "partita/report/__init__.py": "",
    "partita/report/plan.py": "from partita.types.plan import Plan\nplan_text = 'x'\n",
}
FAKE_ALLOWED = {("partita.types.plan:Plan.summary", "partita.report"): "the test's allowed lazy import"}


def test_static_checker_reports_an_upward_import(tmp_path):
    _write_tree(tmp_path, FAKE_TREE)
    violations, used = static_violations(tmp_path / "partita", allowed=FAKE_ALLOWED)
    found = {(v.importer, v.imported, v.line) for v in violations}
    assert found == {
        ("partita.capturing.bad", "partita.planning.solve", 3),
        ("partita.capturing.bad", "partita.runtime.trainer", 7),
        ("partita.capturing.bad", "partita.planning.solve", 8),
        ("partita.capturing.rel", "partita.cost.table", 1),
        ("partita.types.plan", "partita.report.plan", 8),
    }, "\n".join(map(str, violations))
    assert used == set(FAKE_ALLOWED)
    text = {v.line: str(v) for v in violations if v.importer == "partita.capturing.bad"}
    assert "at module level" in text[3] and "in later()" in text[7], text


# ============================================================================== dynamic check

# Runs in a fresh interpreter: forks one child per module, each starting without any partita module,
# imports it there and reports what it loaded, who imported what, and any error (JSON, last line).
_PROBE = r"""
import importlib, json, os, sys, traceback

args = json.loads(sys.argv[1])
sys.path.insert(0, args["path"])
for name in args["preload"]:  # heavy third-party modules, shared by the forked children
    try:
        importlib.import_module(name)
    except ImportError:
        pass
assert not [m for m in sys.modules if m == "partita" or m.startswith("partita.")], "partita loaded before the probe"

def ours(name):
    return name == "partita" or name.startswith("partita.")

class Recorder:
    def __init__(self):
        self.importers = {}

    def find_spec(self, name, path=None, target=None):
        if ours(name) and name not in self.importers:
            self.importers[name] = importer()
        return None

def importer():
    frame = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if (frame.f_code.co_filename.startswith("<frozen") or module.startswith("importlib")
                or (module == "partita" and frame.f_code.co_name == "__getattr__")):
            frame = frame.f_back
            continue
        return module
    return None

def probe(name):
    recorder = Recorder()
    sys.meta_path.insert(0, recorder)
    before = set(sys.modules)
    result = {"module": name, "error": None}
    try:
        importlib.import_module(name)
    except BaseException as exc:
        result["error"] = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        result["traceback"] = traceback.format_exc()[-4000:]
    result["loaded"] = sorted(m for m in set(sys.modules) - before if ours(m))
    result["importers"] = recorder.importers
    return result

results = []
for name in args["modules"]:
    if not hasattr(os, "fork"):  # no isolation between modules here: still one import each
        results.append(probe(name))
        continue
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        try:
            data = json.dumps(probe(name))
        except BaseException as exc:
            data = json.dumps({"module": name, "error": repr(exc), "loaded": [], "importers": {}})
        with os.fdopen(write_fd, "w") as fh:
            fh.write(data)
        os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd) as fh:
        data = fh.read()
    _, status = os.waitpid(pid, 0)
    results.append(json.loads(data) if data else
                   {"module": name, "error": f"the child importing it died (wait status {status})",
                    "loaded": [], "importers": {}})
sys.stdout.write("\n" + json.dumps(results) + "\n")
"""

# the heavy third-party modules partita's modules import, loaded once before the children fork
PRELOAD = [
    "numpy",
    "torch",
    "torch.fx",
    "torch.export",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.pipelining",
    "torch.utils.checkpoint",
    "torch.utils.flop_counter",
    "torch._subclasses.fake_tensor",
]


def run_probe(modules: list[str], path: Path, preload: list[str] = PRELOAD) -> list[dict]:
    """Import each of ``modules`` in a fresh interpreter (one forked child each) and return the reports."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1"}
    args = json.dumps({"modules": modules, "path": str(path), "preload": preload})
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _PROBE, args],
            cwd=path,
            env=env,
            capture_output=True,
            text=True,
            timeout=SUBPROCESS_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"importing {modules} took over {SUBPROCESS_TIMEOUT_S} s; stderr:\n{exc.stderr}")
    if proc.returncode != 0:
        pytest.fail(f"the import probe failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _chain(result: dict, module: str) -> list[str]:
    """``[imported module, ..., module]``: who imported whom, from the probe's import hook."""
    chain, seen = [module], {module}
    while (up := result["importers"].get(chain[-1])) and up != "__main__" and up not in seen:
        chain.append(up)
        seen.add(up)
    return chain[::-1]


def layer_violations(results: list[dict], group: str) -> list[str]:
    """One line per import that crosses out of ``group``'s allowed layers, with one chain that makes it."""
    allowed = ALLOWED_GROUPS[group]
    crossings: dict[tuple[str, str], tuple[str, list[str]]] = {}
    for result in results:
        for loaded in result["loaded"]:
            if group_of(loaded) in allowed:
                continue
            chain = _chain(result, loaded)
            # the edge where the chain leaves the allowed layers (the module that pulled it in)
            edge = next(
                ((a, b) for a, b in zip(chain, chain[1:]) if group_of(a) in allowed and group_of(b) not in allowed),
                (chain[0], loaded),
            )
            crossings.setdefault(edge, (result["module"], chain))
    # ``import partita.types.devices`` loads partita.cost first: name the module, not its packages too
    crossings = {
        (a, b): v
        for (a, b), v in crossings.items()
        if not any(a2 == a and b2.startswith(b + ".") for a2, b2 in crossings)
    }
    return [
        f"{a} imports {b} ({group_of(b)}), e.g. `import {probe}` loads {' -> '.join(chain)}"
        for (a, b), (probe, chain) in sorted(crossings.items())
    ]


def _groups() -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for module in iter_modules(PACKAGE_DIR):
        groups.setdefault(group_of(module) or "unclaimed", []).append(module)
    return groups


GROUPS = _groups()


@pytest.fixture(scope="module")
def probe_results(request) -> dict[str, list[dict]]:
    """The probe's reports for every package the selected tests need.

    Each module is imported in its own forked child, which starts with no partita module loaded: as
    fresh as an interpreter per module, and stricter than one per package. The packages are spread
    over one fresh interpreter per core (at most 2: the suite shares 2 cores), as the preload of
    torch dominates the cost of each.
    """
    wanted = sorted(
        {
            item.callspec.params["group"]
            for item in request.session.items
            if item.module is request.module and hasattr(item, "callspec") and "group" in item.callspec.params
        }
    )
    batches: list[list[str]] = [[] for _ in range(max(1, min(2, os.cpu_count() or 1, len(wanted))))]
    for group in sorted(wanted, key=lambda g: -len(GROUPS[g])):  # largest first onto the lightest batch
        min(batches, key=lambda b: sum(len(GROUPS[g]) for g in b)).append(group)
    with ThreadPoolExecutor(max_workers=len(batches)) as pool:
        futures = [pool.submit(run_probe, [m for g in batch for m in GROUPS[g]], REPO) for batch in batches if batch]
        by_module = {r["module"]: r for f in futures for r in f.result()}
    return {g: [by_module[m] for m in GROUPS[g]] for g in wanted}


@pytest.mark.slow  # fresh interpreters
@pytest.mark.parametrize("group", sorted(GROUPS))
def test_fresh_imports_stay_in_their_layers(group, probe_results):
    problems = layer_violations(probe_results[group], group)
    assert not problems, (
        f"importing the {group} modules loads modules of layers it may not use "
        f"(allowed: {sorted(ALLOWED_GROUPS[group])}):\n" + "\n".join(f"  {p}" for p in problems)
    )


@pytest.mark.slow  # fresh interpreters
@pytest.mark.parametrize("group", sorted(GROUPS))
def test_every_module_imports_in_a_fresh_interpreter(group, probe_results):
    failures = [r for r in probe_results[group] if r["error"]]
    assert not failures, "modules that fail `python -c 'import MODULE'`:\n" + "\n".join(
        f"  {r['module']}: {r['error']}\n{textwrap.indent(r.get('traceback', ''), '      ')}" for r in failures
    )


@pytest.mark.slow  # a fresh interpreter
def test_dynamic_check_names_the_culprit(tmp_path):
    _write_tree(
        tmp_path,
        {
            **FAKE_TREE,
            "partita/capturing/bad.py": "from partita.capturing import helper\n",
            "partita/capturing/helper.py": "import partita.planning.solve\n",
            "partita/capturing/lazy.py": "import partita\nX = partita.plan\n",
            "partita/__init__.py": FAKE_TREE["partita/__init__.py"]
            + textwrap.dedent("""
            import importlib
            def __getattr__(name):
                return importlib.import_module(_EXPORTS[name])
            """),
        },
    )
    (tmp_path / "partita/capturing/rel.py").unlink()
    modules = [m for m in iter_modules(tmp_path / "partita") if group_of(m) == "capture"]
    results = run_probe(modules, tmp_path, preload=[])
    assert not [r for r in results if r["error"]], results
    problems = layer_violations(results, "capture")
    assert len(problems) == 2, problems
    assert problems[0].startswith("partita.capturing.helper imports partita.planning.solve (planning)"), problems
    assert "partita.capturing.bad -> partita.capturing.helper -> partita.planning" in problems[0], problems
    assert problems[1].startswith("partita.capturing.lazy imports partita.planning"), problems
