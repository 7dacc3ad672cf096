"""What finished or killed ranks leave on a machine, and its removal before it does harm.

Two things outlive the ranks that made them:

* **Torch JIT-extension build locks.** Torch guards each build directory of an extension (here:
  DeepSpeed's ops) with a ``lock`` file that the builder creates and keeps open until the build
  is loaded. A rank killed while holding it (kill -9, the OOM killer, a Ctrl-C or a preemption
  during start-up) leaves the file, and every later rank that loads the op waits on it forever,
  printing nothing. A lock that no live process has open is stale.
* **DeepSpeed's shared-memory all-reduce buffers** (CPU ranks): each rank maps a 66 MB file
  ``/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>`` and DeepSpeed never
  unlinks it, so every job leaks ``ranks × 66 MB`` of RAM-backed tmpfs until the machine runs
  out of memory. The launcher removes its job's buffers when the ranks are gone, and any buffer
  no process maps before it starts a job.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from memtune.filesystem import open_files

LOCK_NAME = "lock"
SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "deepspeed_allreduce_buffer"
# Torch's holder closes the lock's fd and removes the file microseconds apart; a lock seen
# closed twice this far apart is not in that window.
RECHECK_S = 1.0


def _pids() -> Iterable[Path]:
    return (p for p in Path("/proc").iterdir() if p.name.isdigit())


def open_paths() -> set[str]:
    """Every file some process on this machine has open (that we may look at)."""
    return {path for _, path in open_files()}


def mapped_paths() -> set[str]:
    """Every file some process has open or mapped into memory."""
    paths = open_paths()
    for proc in _pids():
        with contextlib.suppress(OSError):
            for line in (proc / "maps").read_text().splitlines():
                fields = line.split(maxsplit=5)
                if len(fields) == 6:
                    paths.add(fields[5].removesuffix(" (deleted)"))
    return paths


def build_locks(root: Path) -> list[Path]:
    """Lock files under root: root/<ext>/lock and root/<py_accel>/<ext>/lock."""
    if not root.is_dir():
        return []
    return sorted({*root.glob(f"*/{LOCK_NAME}"), *root.glob(f"*/*/{LOCK_NAME}")})


def stale_locks(root: Path, recheck_s: float = RECHECK_S) -> list[Path]:
    """Lock files that nobody holds open, seen so twice ``recheck_s`` apart."""
    candidates = [p for p in build_locks(root) if str(p.resolve()) not in open_paths()]
    if not candidates:
        return []
    time.sleep(recheck_s)
    held = open_paths()
    return [p for p in candidates if p.exists() and str(p.resolve()) not in held]


def clear_stale_locks(
    root: Path, log: Callable[[str], None] = print, recheck_s: float = RECHECK_S
) -> list[Path]:
    """Remove stale build locks under ``root``; returns the removed paths."""
    removed = []
    for lock in stale_locks(root, recheck_s):
        try:
            lock.unlink()
        except FileNotFoundError:
            continue
        except PermissionError as err:  # another user's build dir: say so, rather than stop
            log(
                f"memtune: note: a stale build lock {lock} cannot be removed by this user "
                f"({err.strerror}); ranks that load this op will wait on it until its owner "
                "removes it"
            )
            continue
        removed.append(lock)
        log(
            f"memtune: removed a stale build lock left by a killed process: {lock} "
            "(without this, every rank would wait on it forever)"
        )
    return removed


def shm_buffers(port: int | None = None, shm_dir: Path = SHM_DIR) -> list[Path]:
    """This user's DeepSpeed all-reduce buffers (of one job's master port, if given)."""
    if not shm_dir.is_dir():
        return []
    pattern = f"{SHM_PREFIX}_{os.getuid()}_*_{'*' if port is None else port}_*"
    return sorted(shm_dir.glob(pattern))


def clear_shm_buffers(
    port: int | None = None, shm_dir: Path = SHM_DIR, log: Callable[[str], None] = print
) -> int:
    """Remove the buffers of a finished job (``port``), or every buffer no process maps.

    Returns the bytes freed. Removing a name never pulls memory from under a live mapping (the
    kernel frees it at the last unmap), but a buffer a live job maps is kept all the same.

    Only this user's files are removed. The name carries the uid DeepSpeed's rank had, which
    is not always the file's owner: containers that share /dev/shm (``--ipc=host``) and each
    run as their own "root" name their buffers with uid 0, and another container's buffer
    then matches this one's pattern while it belongs to a user this job does not know (owner
    65534, nobody, as seen from here). Such a file, or one the kernel will not let this
    process remove (a sticky /dev/shm, a read-only dir: PermissionError, which used to stop
    every launch), is left in place with a note.
    """
    found = shm_buffers(port, shm_dir)
    if port is None and found:
        in_use = mapped_paths()
        found = [p for p in found if str(p) not in in_use]
    freed, removed = 0, 0
    left: list[str] = []
    for path in found:
        try:
            st = path.stat()
            if st.st_uid != os.getuid():
                left.append(f"{path.name} belongs to uid {st.st_uid}")
                continue
            path.unlink()
        except FileNotFoundError:  # its job removed it meanwhile
            continue
        except PermissionError as err:
            left.append(f"{path.name}: {err.strerror}")
            continue
        freed += st.st_size
        removed += 1
    if freed and port is None:
        log(
            f"memtune: removed {removed} shared-memory buffer(s) left in {shm_dir} by earlier "
            f"DeepSpeed CPU jobs ({freed / 1024**2:.0f} MiB of RAM)"
        )
    if left:
        log(
            f"memtune: note: left {len(left)} DeepSpeed shared-memory buffer(s) in {shm_dir} "
            f"that are not this user's to remove (first: {left[0]}); they hold RAM until "
            "their owner removes them"
        )
    return freed
