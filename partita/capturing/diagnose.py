"""Turn a torch.export failure into a CaptureError that names the line, the cause and the fix."""

from __future__ import annotations

import os
import re
import traceback

import torch

from partita.errors import CaptureError

_TORCH_DIR = os.path.dirname(torch.__file__)
_PARTITA_DIR = os.path.dirname(os.path.dirname(__file__))
_FILE_LINE = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)')

# (pattern in the error text, cause, fix). The first pattern that matches wins.
_KNOWN_CAUSES: tuple[tuple[str, str, str], ...] = (
    (
        r"DynamicCache|Cache\b.*not a known type|past_key_values",
        "the model returns a key/value cache object, which is not a tensor tree",
        "pass use_cache=False (in the config or as an input) so the model returns tensors only",
    ),
    (
        r"data-dependent|GuardOnDataDependentSymNode|unbacked",
        "Python control flow or a size depends on the values inside a tensor "
        "(e.g. `if x.sum() > 0:` or `int(t.item())`), which a graph cannot capture",
        "make the branch not depend on tensor values (torch.where, masking), use torch.cond "
        "for true branches, or compute the value outside the model and pass it as an input",
    ),
    (
        r"not a known type|register a pytree|pytree",
        "the model returns an object that is not a tensor, tuple, list, dict or registered dataclass",
        "return tensors (or a dict/tuple of them), or register the output type with "
        "torch.utils._pytree.register_pytree_node",
    ),
    (
        r"\.numpy\(\)|data pointer|tolist|Cannot access storage|not supported for tensor subclasses",
        "the model reads tensor data on the host (.numpy(), .tolist(), data_ptr), which cannot be traced",
        "replace the host-side computation with torch operations",
    ),
    (
        r"[Uu]nsupported|no fake|Meta|NotImplementedError|could not find kernel|operator .* does not exist",
        "the model calls an operation that torch.export cannot trace (no fake/meta kernel or an "
        "unsupported Python construct)",
        "replace the operation with a standard torch op, or register a fake kernel for your "
        "custom op (torch.library.register_fake)",
    ),
)


def explain_export_failure(error: BaseException) -> CaptureError:
    """Classify ``error`` raised by torch.export and build a CaptureError for the user."""
    text = f"{type(error).__name__}: {error}"
    cause, fix = _classify(text)
    where = user_location(error)
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    message = (
        f"could not capture the model{(' at ' + where) if where else ''}: {cause}.\n"
        f"  fix: {fix}.\n"
        f"  torch.export said: {type(error).__name__}: {first_line[:400]}"
    )
    err = CaptureError(message)
    err.location = where
    err.cause = cause
    return err


def _classify(text: str) -> tuple[str, str]:
    for pattern, cause, fix in _KNOWN_CAUSES:
        if re.search(pattern, text):
            return cause, fix
    return (
        "torch.export failed while tracing the model on the example inputs",
        "check that the model runs eagerly on the same inputs (model(*args, **kwargs)) and "
        "follows the torch.export rules (no data-dependent control flow, tensor outputs)",
    )


def user_location(error: BaseException) -> str:
    """``file.py:LINE in func: code`` of the user's code that failed, or '' if none is found."""
    matches = _FILE_LINE.findall(str(error))
    for filename, line, func, code in reversed(matches):
        if _is_user_file(filename):
            return f"{os.path.basename(filename)}:{line} in {func}: {code.strip()}"
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        if _is_user_file(frame.filename):
            code = (frame.line or "").strip()
            return f"{os.path.basename(frame.filename)}:{frame.lineno} in {frame.name}: {code}"
    return ""


def _is_user_file(filename: str) -> bool:
    return not (
        filename.startswith(_TORCH_DIR)
        or filename.startswith(_PARTITA_DIR)
        or filename.startswith("<")
        or "/site-packages/torch/" in filename
    )
