"""The machine around a job: other users' files, a full disk, temporary dirs, file modes.

Real files and real processes; where the kernel's answer depends on who runs the test (root
bypasses permission checks), the test takes the unprivileged path itself (seteuid).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from memtune.launcher.hygiene import SHM_PREFIX, clear_shm_buffers

NOBODY = 65534


@contextlib.contextmanager
def unprivileged() -> Iterator[None]:
    """File operations as an ordinary user: as root, the effective uid becomes nobody's for
    the block (the real uid, which names DeepSpeed's buffers, stays); otherwise nothing to do."""
    if os.geteuid() != 0:
        yield
        return
    os.seteuid(NOBODY)
    try:
        yield
    finally:
        os.seteuid(0)


@pytest.fixture
def public_dir() -> Iterator[Path]:
    """A directory every user can reach (pytest's tmp_path is root's 0700 when run as root,
    so an unprivileged block could not even look into it)."""
    path = Path(tempfile.mkdtemp(prefix="memtune-env-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _buffer(shm_dir: Path, uid: int, port: int = 29500, rank: int = 0) -> Path:
    path = shm_dir / f"{SHM_PREFIX}_{uid}_127.0.0.1_{port}_{rank}"
    path.write_bytes(b"\0" * 4096)
    return path


# ------------------------------------------------------------------ 10a: /dev/shm of others


def test_another_users_buffer_is_left_with_a_note(tmp_path: Path) -> None:
    """A buffer named with this user's uid but owned by another (containers sharing /dev/shm
    each name theirs with uid 0; from here the other's is owned by 65534). Before: root
    removed it (another user's file), anyone else stopped with PermissionError."""
    if os.geteuid() != 0:
        pytest.skip("needs root to give a file to another uid (the next test runs as anyone)")
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o1777)
    os.chmod(shm, 0o1777)  # /dev/shm's mode: sticky, world-writable
    foreign = _buffer(shm, os.getuid())
    os.chown(foreign, NOBODY, NOBODY)
    ours = _buffer(shm, os.getuid(), rank=1)
    notes: list[str] = []
    freed = clear_shm_buffers(shm_dir=shm, log=notes.append)
    assert foreign.exists() and not ours.exists()
    assert freed == 4096
    assert any(
        f"left 1 DeepSpeed shared-memory buffer(s) in {shm}" in n and "uid 65534" in n
        for n in notes
    ), notes


def test_a_buffer_this_user_cannot_remove_does_not_stop_the_launch(public_dir: Path) -> None:
    """unlink refused by the kernel (here: a directory without write permission, seen as an
    ordinary user) used to raise PermissionError out of clear_shm_buffers, i.e. out of every
    launch (spawn.launch calls it first)."""
    shm = public_dir / "shm"
    shm.mkdir()
    stuck = _buffer(shm, os.getuid(), port=29501)
    os.chmod(shm, 0o555)
    notes: list[str] = []
    try:
        with unprivileged():
            freed = clear_shm_buffers(29501, shm_dir=shm, log=notes.append)
    finally:
        os.chmod(shm, 0o755)
    assert freed == 0 and stuck.exists()
    assert len(notes) == 1 and f"{stuck.name}: Permission denied" in notes[0], notes
