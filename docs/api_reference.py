"""Generate docs/api.md, partita's API reference, from the public names' docstrings.

    python docs/api_reference.py            # (re)write docs/api.md
    python docs/api_reference.py --check    # exit 1 if docs/api.md is stale or a reference is broken

What it covers: every name in ``partita.__all__`` (the verbs and objects a user holds), every
record in ``partita.types.__all__`` and the errors, with signatures, docstrings, public methods and
properties. A *reference* is a dotted name in double backquotes that starts with ``partita.``
(``partita.planning.manual.manual_plan``); every one in those docstrings must resolve to a module
or an object, else ``--check`` fails (tests/unit/test_api_reference.py runs it in CI).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
import sys
from pathlib import Path

OUT = Path(__file__).with_name("api.md")
REFERENCE = re.compile(r"``(partita(?:\.[A-Za-z_][A-Za-z0-9_]*)+)(?:\(\))?``")

# The order a newcomer meets them in: capture, plan, train, then what they return and raise.
TOP_LEVEL_ORDER = [
    "capture",
    "plan",
    "Cluster",
    "PlanOptions",
    "Plan",
    "Trainer",
    "fit",
    "FitResult",
    "OpGraph",
    "manual_plan",
    "plan_with_baselines",
    "shared_plan",
    "simulate",
    "save_seed",
    "load_into_model",
]


def main(argv: list[str]) -> int:
    text, broken = render()
    if "--check" in argv:
        problems = [f"broken reference ``{ref}`` in the docstring of {where}" for where, ref in broken]
        if not OUT.exists() or OUT.read_text() != text:
            problems.append(f"{OUT} is stale: run `make docs` (python docs/api_reference.py) and commit it")
        for problem in problems:
            print(problem, file=sys.stderr)
        return 1 if problems else 0
    for where, ref in broken:
        print(f"warning: broken reference ``{ref}`` in {where}", file=sys.stderr)
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


def render() -> tuple[str, list[tuple[str, str]]]:
    """The reference as markdown, and (where, reference) for every reference that does not resolve."""
    import partita
    import partita.errors
    import partita.types

    top = [n for n in TOP_LEVEL_ORDER if n in partita.__all__]
    top += sorted(n for n in partita.__all__ if n not in top and not _is_error(getattr(partita, n)))
    errors = sorted(n for n in partita.__all__ if _is_error(getattr(partita, n)))
    records = sorted(n for n in partita.types.__all__ if n not in partita.__all__ and not n.isupper())
    parts = [
        "# partita API reference\n",
        "Generated from the docstrings by `make docs` (`python docs/api_reference.py`); do not edit by hand.\n",
        "- [partita](#partita): the verbs and the objects a user holds",
        "- [partita.types](#partitatypes): the records they return and take",
        "- [Errors](#errors)\n",
        "## partita\n",
    ]
    broken: list[tuple[str, str]] = []
    for section, module, names in (("partita", partita, top), ("partita.types", partita.types, records)):
        if section != "partita":
            parts.append(f"## {section}\n")
        for name in names:
            parts.append(_entry(f"{section}.{name}", getattr(module, name), broken))
    parts.append("## Errors\n")
    for name in errors:
        parts.append(_entry(f"partita.{name}", getattr(partita, name), broken))
    return "\n".join(parts).rstrip() + "\n", broken


def _entry(qualname: str, obj: object, broken: list[tuple[str, str]]) -> str:
    kind = "class" if inspect.isclass(obj) else "function"
    lines = [f"### `{qualname}`\n", f"```python\n{_signature(qualname.rsplit('.', 1)[1], obj, kind)}\n```\n"]
    lines.append(_doc(qualname, obj, broken))
    if inspect.isclass(obj):
        for member, value in _members(obj):
            lines.append(f"#### `{qualname}.{member}`\n")
            if not isinstance(value, property):
                lines.append(f"```python\n{_signature(member, value, 'method')}\n```\n")
            lines.append(_doc(f"{qualname}.{member}", value, broken))
    return "\n".join(line for line in lines if line)


def _signature(name: str, obj: object, kind: str) -> str:
    try:
        target = obj.__init__ if kind == "class" and not dataclasses.is_dataclass(obj) else obj
        signature = str(_readable_defaults(inspect.signature(target)))
    except (TypeError, ValueError):
        return f"{kind} {name}" if kind == "class" else f"{name}(...)"
    if kind == "class":
        signature = signature.replace("(self, ", "(").replace("(self)", "()")
        return f"class {name}{signature}"
    signature = signature.replace("(self, ", "(").replace("(self)", "()")
    return f"{'def ' if kind != 'method' else ''}{name}{signature}"


class _Shown:
    """A default value shown as the code that makes it (``PlanOptions()``, not its long repr)."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _readable_defaults(signature: inspect.Signature) -> inspect.Signature:
    parameters = []
    for p in signature.parameters.values():
        default = p.default
        if dataclasses.is_dataclass(default) and not isinstance(default, type):
            try:
                fresh = type(default)()
            except TypeError:
                fresh = None
            if fresh == default:
                p = p.replace(default=_Shown(f"{type(default).__name__}()"))
        parameters.append(p)
    return signature.replace(parameters=parameters)


def _members(cls: type) -> list[tuple[str, object]]:
    """Public methods and properties the class itself defines (not inherited ones), in source order."""
    found = []
    for member, value in vars(cls).items():
        if member.startswith("_") or not (inspect.isfunction(value) or isinstance(value, (property, staticmethod))):
            continue
        found.append((member, value.__func__ if isinstance(value, staticmethod) else value))
    return found


def _doc(where: str, obj: object, broken: list[tuple[str, str]]) -> str:
    doc = inspect.getdoc(obj.fget if isinstance(obj, property) else obj) or ""
    for ref in REFERENCE.findall(doc):
        if not _resolves(ref):
            broken.append((where, ref))
    return doc + "\n" if doc else ""


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            value: object = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attribute in parts[split:]:
            if not hasattr(value, attribute):
                return False
            value = getattr(value, attribute)
        return True
    return False


def _is_error(obj: object) -> bool:
    return inspect.isclass(obj) and issubclass(obj, Exception)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
