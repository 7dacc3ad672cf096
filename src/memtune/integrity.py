"""Every store memtune writes and later reads back, verified before it is trusted: one
mechanism for the checkpoints, the tokenized data cache, the parameter-count and linear-mixer
caches, the DPO reference tables and the synthesized demo models.

An entry (a directory) is complete only with its manifest: the writer puts every file in place
first; :func:`write_manifest` then fsyncs each, lists it (relative name, size, digest) and
writes ``manifest.json`` in one atomic rename, so a manifest only ever lists bytes that are on
the disk. A reader names the first file that is missing, cut or changed. A single-file entry
(the counts caches' JSON) carries the same record inline: :meth:`Store.write_value` and
:meth:`Store.read_value`.

Two digests, chosen by what a store costs to hash against what a reader has at stake:

- **SHA-256** for checkpoints and a run's final files (summary.json's ``outputs``): they are
  hashed once when saved and once when resumed or exported, and a user may compare them with
  ``sha256sum``.
- **XXH3-128** (the ``xxhash`` package) for the caches, verified on every launch that reuses
  them: a 2 GiB file read from the page cache took 0.14-0.39 s against 1.95 s for SHA-256 on
  the 2-core AMD EPYC the suite runs on (2026-12-05), so a large tokenized cache costs a start
  a fraction of a second, not seconds. It is not a cryptographic hash: it catches a flipped
  byte, a cut or a stale file, not a forger (the checkpoints, which are copied between
  machines, keep SHA-256).

A damaged or incomplete cache entry is moved aside under a fresh name of memtune's own
(:meth:`Store.set_aside`: ``.damaged-NAME.XXXX`` next to it; nothing is deleted) and
rebuilt by its owner, with one line naming it and what was wrong; checkpoints are never
rebuilt (memtune.checkpoints skips a damaged one for the one before it).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from memtune.filesystem import make_dirs, write_atomic

MANIFEST = "manifest.json"
"""A directory's list of files with their sizes and digests, written after every file and read
before the directory is trusted."""

Digest = Literal["sha256", "xxh3_128"]

DIGEST_NAMES: dict[str, str] = {"sha256": "SHA-256", "xxh3_128": "XXH3-128"}
"""How a message names each digest."""

ASIDE_PREFIX = ".damaged-"
"""What a damaged cache entry is renamed to, next to where it was: memtune's own name."""


def _hasher(digest: str) -> Any:
    if digest == "sha256":
        return hashlib.sha256()
    if digest == "xxh3_128":
        import xxhash  # a dependency of memtune (and of datasets and wandb)

        return xxhash.xxh3_128()
    raise ValueError(f"unknown digest {digest!r}")


def file_digest(path: Path, digest: Digest = "sha256") -> str:
    h = _hasher(digest)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return str(h.hexdigest())


def file_sha256(path: Path) -> str:
    return file_digest(path, "sha256")


def list_files(
    root: Path, skip: tuple[str, ...] = (), digest: Digest = "sha256"
) -> dict[str, list[Any]]:
    """Every file under ``root`` (relative name → [size, digest]), fsynced on the way: a
    manifest written after this lists only bytes that are on the disk."""
    files: dict[str, list[Any]] = {}
    for f in sorted(root.rglob("*")):
        if f.is_file() and f.name not in skip:
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
            files[str(f.relative_to(root))] = [f.stat().st_size, file_digest(f, digest)]
    return files


def write_manifest(
    root: Path,
    skip: tuple[str, ...] = (),
    digest: Digest = "sha256",
    header: dict[str, Any] | None = None,
) -> None:
    """Record every file of ``root`` in its manifest (but the manifest itself and the names in
    ``skip``: what the writer adds after it). ``header``: what else the manifest says (the
    store and its format, :class:`Store`)."""
    files = list_files(root, skip=(MANIFEST, *skip), digest=digest)
    record = {**(header or {}), "digest": digest, "files": files}
    write_atomic(root / MANIFEST, json.dumps(record, indent=1) + "\n")


def check_files(root: Path, files: dict[str, list[Any]], digest: Digest = "sha256") -> str | None:
    """What is wrong with ``root``'s files against ``files`` ({name: [size, digest]}): the
    first missing, cut or changed file, named; None when every one verifies."""
    for name, (size, expected) in files.items():
        f = root / name
        if not f.is_file():
            return f"{f} is missing"
        if f.stat().st_size != size:
            return f"{f} has {f.stat().st_size:,} bytes, {size:,} were written"
        if file_digest(f, digest) != expected:
            return (
                f"{f} does not hold the bytes that were written (its {DIGEST_NAMES[digest]} "
                "differs)"
            )
    return None


def _read_manifest(path: Path) -> dict[str, Any] | str:
    """A manifest's record, or what is wrong with it."""
    try:
        record = json.loads(path.read_text())
        files = record["files"]
        digest = record.get("digest", "sha256")  # checkpoints before 2026-12: SHA-256
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return f"{path} cannot be read"
    if (
        digest not in DIGEST_NAMES
        or not isinstance(files, dict)
        or not all(isinstance(v, list) and len(v) == 2 for v in files.values())
    ):
        return f"{path} is not a manifest this memtune reads"
    return record


def verify_manifest(root: Path) -> str | None:
    """What is wrong with a directory, by its manifest; None when it verifies, or when it has
    no manifest (a checkpoint written before manifests: trusted as complete, as before)."""
    path = root / MANIFEST
    if not path.is_file():
        return None
    record = _read_manifest(path)
    if isinstance(record, str):
        return record
    return check_files(root, record["files"], record.get("digest", "sha256"))


@dataclass(frozen=True)
class Store:
    """One kind of entry memtune writes and reads back. ``format`` is bumped when what an entry
    holds changes meaning: an entry of another format is not this memtune's to trust."""

    name: str
    """How a message names an entry: "data cache", "demo model", ..."""
    format: int
    digest: Digest = "xxh3_128"
    required: tuple[str, ...] = ()
    """The files every entry holds: a manifest that does not list one is damage, not an entry
    (a manifest listing no files at all verifies every file it lists, and the reader then
    fails on the file it needs)."""

    def _header(self) -> dict[str, Any]:
        return {"store": self.name, "format": self.format}

    def _other_format(self, record: dict[str, Any]) -> str | None:
        written = (record.get("store"), record.get("format"))
        if written == (self.name, self.format):
            return None
        return (
            f"its manifest is {written[0] or 'of no store'}'s, format {written[1]}, not the "
            f"{self.name} format {self.format} this memtune writes"
        )

    # ---------------------------------------------------------------- directory entries

    def seal(self, entry: Path, skip: tuple[str, ...] = ()) -> None:
        """The entry's last write, once every file is in it: its manifest."""
        write_manifest(entry, skip=skip, digest=self.digest, header=self._header())

    def problem(self, entry: Path, required: tuple[str, ...] = ()) -> str | None:
        """What is wrong with the entry ``entry``; None when every file verifies and the
        manifest lists every file the store requires (:attr:`required`, and ``required``: what
        this entry holds besides, by its settings). An entry without a manifest is incomplete
        (its writing was cut short)."""
        path = entry / MANIFEST
        if not path.is_file():
            return f"it has no {MANIFEST}: its writing was cut short"
        record = _read_manifest(path)
        if isinstance(record, str):
            return record
        other = self._other_format(record)
        if other is not None:
            return other
        for name in (*self.required, *required):
            if name not in record["files"]:
                return f"its {MANIFEST} does not list {name}, which the entry must hold"
        return check_files(entry, record["files"], record["digest"])

    def is_ours(self, entry: Path) -> bool:
        """Whether ``entry`` bears this store's manifest (whatever its files' state)."""
        record = _read_manifest(entry / MANIFEST)
        return not isinstance(record, str) and record.get("store") == self.name

    # ---------------------------------------------------------------- single-file entries

    def write_value(self, path: Path, value: Any) -> None:
        """A one-file entry: ``value`` (JSON) with its store, format and digest, atomically;
        its folder made where it is missing (:func:`memtune.filesystem.make_dirs`)."""
        make_dirs(path.parent)
        body = json.dumps(value, sort_keys=True)
        record = {**self._header(), "digest": self.digest, "sum": _text_digest(body, self.digest)}
        write_atomic(path, json.dumps({**record, "value": value}, sort_keys=True) + "\n")

    def read_value(self, path: Path) -> tuple[Any, str | None]:
        """(value, None) for a verified entry; (None, None) when there is none; (None, what is
        wrong) for a damaged one: unreadable, of another format, or a value whose digest
        differs (one digit changed)."""
        if not path.is_file():
            return None, None
        try:
            record = json.loads(path.read_text())
            value, digest, written = record["value"], record["digest"], record["sum"]
        except (OSError, ValueError, KeyError, TypeError):
            return None, "it cannot be read"
        other = self._other_format(record)
        if other is not None:
            return None, other
        if digest not in DIGEST_NAMES or written != _text_digest(
            json.dumps(value, sort_keys=True), digest
        ):
            return None, "its value does not hold what was written (its digest differs)"
        return value, None

    # ---------------------------------------------------------------- a damaged entry

    def set_aside(self, entry: Path) -> Path | None:
        """Move the damaged ``entry`` (a directory or a file) to a fresh ``.damaged-NAME.XXXX``
        beside it, made here, so nothing is ever removed or replaced (an earlier aside, or a
        name the user chose, stays as it is) and two jobs never aim at one name; returns where
        it went. Raises OSError where the store cannot be changed (read-only, no permission).
        An entry already gone (another job that found the same damage moved it) is not an
        error: the fresh name made for it is removed again, and None returned (the line named
        that removed name as where the entry went: two jobs that found one damage both said
        "set aside as", one of them naming nothing)."""
        prefix = f"{ASIDE_PREFIX}{entry.name}."
        if entry.is_dir() and not entry.is_symlink():
            aside = Path(tempfile.mkdtemp(prefix=prefix, dir=entry.parent))
        else:
            fd, name = tempfile.mkstemp(prefix=prefix, dir=entry.parent)
            os.close(fd)
            aside = Path(name)
        try:
            os.replace(entry, aside)  # onto the empty dir / file just made
        except OSError as err:
            with contextlib.suppress(OSError):  # ours, made above, empty: not left behind
                if aside.is_dir():
                    aside.rmdir()
                else:
                    aside.unlink()
            if isinstance(err, FileNotFoundError) and not entry.exists():
                return None
            raise  # not ours to move (another user's entry under the sticky bit), read-only
        return aside

    def damaged_line(self, entry: Path, problem: str, aside: Path | None, then: str) -> str:
        """The one line a reader prints for a damaged entry it set aside (``aside`` None:
        another job set it aside first, :meth:`set_aside`)."""
        where = f"set aside as {aside}" if aside else "another job set it aside meanwhile"
        return f"memtune: {self.name} {entry} was damaged ({problem}): {where}; {then}"


def _text_digest(text: str, digest: str) -> str:
    h = _hasher(digest)
    h.update(text.encode())
    return str(h.hexdigest())
