"""Where checkpoints live on disk and when one counts as written.

A checkpoint is a torch.distributed.checkpoint (DCP) directory. It is written to
``<dir>.partial`` and renamed to ``<dir>`` once every rank has finished, and DCP writes its
metadata file last: so a directory named without ``.partial`` that holds the metadata file is
complete, and anything else is an interrupted write. Training checkpoints of one run are named
``step-NNNNNN`` inside a checkpoint directory, so the latest complete one can be found again
after a restart.

Integrity: the last file written before the rename is a manifest (``MANIFEST_FILE``, JSON) of
every other file's size and sha256. A complete checkpoint whose files disagree with it -- cut
short by a full disk, damaged on copy -- is *damaged* (``damage`` says how): loading it raises
InputError, and ``latest_checkpoint`` skips it (with a warning naming it) for the previous
intact one. Checkpoints written before manifests existed still load, with a warning that their
files cannot be verified.

This module has no torch dependency, so that the training checkpoints (checkpoint.py), the seed
checkpoints (materialize.py) and the command line all share these conventions without importing
each other.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import warnings
from collections.abc import Collection

from partita.errors import InputError

__all__ = [
    "CHECKPOINT_PATTERN",
    "MANIFEST_FILE",
    "METADATA_FILE",
    "PARTIAL_SUFFIX",
    "check_writable",
    "checkpoint_path",
    "complete_checkpoints",
    "damage",
    "file_digest",
    "is_complete",
    "latest_checkpoint",
    "manifest_files",
    "warn_unverified",
    "write_manifest",
]

PARTIAL_SUFFIX = ".partial"
METADATA_FILE = ".metadata"  # what dcp.save writes last, after every rank's data files
MANIFEST_FILE = "partita-manifest.json"  # written after DCP's files, before the rename: sizes and sha256
MANIFEST_FORMAT = 1
CHECKPOINT_PATTERN = re.compile(r"^step-(\d+)$")
_CHUNK = 1 << 20


def is_complete(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a finished checkpoint: not a ``.partial`` write, and holding DCP's metadata."""
    path = os.fspath(path)
    return not path.rstrip(os.sep).endswith(PARTIAL_SUFFIX) and os.path.isfile(os.path.join(path, METADATA_FILE))


def checkpoint_path(directory: str, step: int) -> str:
    """The checkpoint of step ``step`` in ``directory``: ``<directory>/step-NNNNNN``."""
    return os.path.join(directory, f"step-{step:06d}")


def complete_checkpoints(directory: str) -> list[str]:
    """The complete checkpoints (``step-NNNNNN`` holding DCP's metadata) in ``directory``, latest
    step first; their files are not verified (see ``damage``)."""
    if not os.path.isdir(directory):
        return []
    steps = sorted(
        (int(m.group(1)) for name in os.listdir(directory) if (m := CHECKPOINT_PATTERN.match(name))), reverse=True
    )
    return [path for path in (checkpoint_path(directory, step) for step in steps) if is_complete(path)]


def latest_checkpoint(directory: str, *, verify: bool = True) -> str | None:
    """The complete checkpoint (``step-NNNNNN`` holding DCP's metadata) with the highest step, or
    None. Interrupted writes are skipped: ``.partial`` directories (another name) and directories
    that lack the metadata file DCP writes last. With ``verify``, so are damaged checkpoints (files
    that differ from the manifest's sizes and sha256), each with a warning that names it; this
    reads every file of the checkpoints it checks."""
    for path in complete_checkpoints(directory):
        if not verify:
            return path
        problem = damage(path)
        if problem is None:
            warn_unverified(path)
            return path
        warnings.warn(f"checkpoint {path!r} is damaged ({problem}): skipped, an earlier one is used", stacklevel=2)
    return None


# ----------------------------------------------------------------------------- integrity


def file_digest(path: str | os.PathLike) -> dict:
    """``{"bytes": size, "sha256": hex}`` of one file."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return {"bytes": size, "sha256": digest.hexdigest()}


def write_manifest(path: str | os.PathLike, known: dict[str, dict] | None = None) -> None:
    """Record the size and sha256 of every file in checkpoint directory ``path`` in its manifest
    (``known``: digests already computed, by file name, e.g. by the ranks that wrote them).
    Call it after every file is written and before the directory is renamed to its final name."""
    path = os.fspath(path)
    known = dict(known or {})
    names = sorted(n for n in os.listdir(path) if n != MANIFEST_FILE and os.path.isfile(os.path.join(path, n)))
    files = {name: known.get(name) or file_digest(os.path.join(path, name)) for name in names}
    tmp = os.path.join(path, MANIFEST_FILE + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"format": MANIFEST_FORMAT, "files": files}, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(path, MANIFEST_FILE))


def manifest_files(path: str | os.PathLike) -> dict[str, dict] | None:
    """File name -> ``{"bytes", "sha256"}`` from the manifest of checkpoint ``path``; None without
    a manifest (written before partita had them). InputError when it is unreadable."""
    manifest = os.path.join(os.fspath(path), MANIFEST_FILE)
    if not os.path.exists(manifest):
        return None
    try:
        with open(manifest, encoding="utf-8") as f:
            data = json.load(f)
        files = data["files"]
        if not isinstance(files, dict) or not all(
            isinstance(v, dict) and {"bytes", "sha256"} <= set(v) for v in files.values()
        ):
            raise ValueError("no file list")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InputError(f"the manifest {manifest!r} is unreadable ({e})") from e
    return files


def damage(path: str | os.PathLike, names: Collection[str] | None = None, *, checksums: bool = True) -> str | None:
    """What is wrong with checkpoint ``path``'s files (``names`` of them, default all): a file the
    manifest lists is missing, has another size or (``checksums``) another sha256; None when they
    all agree, and when there is no manifest to check against (``warn_unverified``)."""
    try:
        files = manifest_files(path)
    except InputError as e:
        return str(e)
    if files is None:
        return None
    for name in sorted(files if names is None else names):
        expected = files.get(name)
        if expected is None:
            return f"{name} is not in its manifest"
        file = os.path.join(os.fspath(path), name)
        try:
            size = os.path.getsize(file)
            if size != expected["bytes"]:
                how = "cut short" if size < expected["bytes"] else "altered"
                return f"{name} has {size} bytes, its manifest says {expected['bytes']}: the file was {how}"
            if checksums and file_digest(file)["sha256"] != expected["sha256"]:
                return f"{name} has another sha256 than its manifest records: its bytes were altered"
        except OSError as e:
            return f"{name} cannot be read ({e.strerror or e})"
    return None


def warn_unverified(path: str | os.PathLike) -> None:
    """Warn when checkpoint ``path`` has no manifest, so that its files cannot be verified."""
    if not os.path.exists(os.path.join(os.fspath(path), MANIFEST_FILE)):
        warnings.warn(
            f"checkpoint {os.fspath(path)!r} has no {MANIFEST_FILE} (written by an earlier partita): its "
            "files cannot be verified; a damaged file shows only when it is read",
            stacklevel=3,
        )


def check_writable(directory: str | os.PathLike, what: str) -> None:
    """Create ``directory`` if needed and write (then remove) a small file in it: InputError now,
    naming ``what`` (e.g. "--checkpoint-dir"), rather than when the first checkpoint is written."""
    directory = os.fspath(directory)
    probe = os.path.join(directory, f".partita-write-test-{os.getpid()}")
    try:
        os.makedirs(directory, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"partita")
        os.remove(probe)
    except OSError as e:
        raise InputError(
            f"{what} {directory!r} is not writable ({e.strerror or e}): choose a folder this user can "
            "create and write, or fix its permissions"
        ) from e
