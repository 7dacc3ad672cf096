"""A directory's manifest: every file with its size and SHA-256, written last and atomically,
verified before the directory is trusted.

The writer puts every file in place first; :func:`write_manifest` then fsyncs each, lists it
(relative name, size, SHA-256) and writes ``manifest.json`` in one atomic rename, so a
manifest only ever lists bytes that are on the disk. A reader (:func:`verify_manifest`, or
:func:`check_files` on a list kept elsewhere) names the first file that is missing, cut or
changed. It knows nothing of what the directory holds: a checkpoint (memtune.checkpoints) and
a run's final files (summary.json's ``outputs``) are verified through it today.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from memtune.filesystem import write_atomic

MANIFEST = "manifest.json"
"""A directory's list of files with their sizes and SHA-256, written after every file and read
before the directory is trusted."""


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def list_files(root: Path, skip: tuple[str, ...] = ()) -> dict[str, list[Any]]:
    """Every file under ``root`` (relative name → [size, sha256]), fsynced on the way: a
    manifest written after this lists only bytes that are on the disk."""
    files: dict[str, list[Any]] = {}
    for f in sorted(root.rglob("*")):
        if f.is_file() and f.name not in skip:
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
            files[str(f.relative_to(root))] = [f.stat().st_size, file_sha256(f)]
    return files


def write_manifest(root: Path, skip: tuple[str, ...] = ()) -> None:
    """Record every file of ``root`` in its manifest (but the manifest itself and the names in
    ``skip``: what the writer adds after it)."""
    files = list_files(root, skip=(MANIFEST, *skip))
    write_atomic(root / MANIFEST, json.dumps({"files": files}, indent=1) + "\n")


def check_files(root: Path, files: dict[str, list[Any]]) -> str | None:
    """What is wrong with ``root``'s files against ``files`` ({name: [size, sha256]}): the
    first missing, cut or changed file, named; None when every one verifies."""
    for name, (size, digest) in files.items():
        f = root / name
        if not f.is_file():
            return f"{f} is missing"
        if f.stat().st_size != size:
            return f"{f} has {f.stat().st_size:,} bytes, {size:,} were written"
        if file_sha256(f) != digest:
            return f"{f} does not hold the bytes that were written (its SHA-256 differs)"
    return None


def verify_manifest(root: Path) -> str | None:
    """What is wrong with a directory, by its manifest; None when it verifies, or when it has
    no manifest (written before manifests: trusted as complete, as before)."""
    path = root / MANIFEST
    if not path.is_file():
        return None
    try:
        files = json.loads(path.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"{path} cannot be read"
    return check_files(root, files)
