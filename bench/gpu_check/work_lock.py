"""One GPU check at a time per parts dir (``--work``).

The orchestrator clears its parts dir's fragments at start and rewrites status.json after each
phase; ``bench/gpu_check.sh`` always names /tmp/gpu_check_parts. A second check started while one
ran (two sessions' dry runs on one shared machine) removed the first one's fragments and wrote
its statuses over them: the first's gpu_check.md lost phases or showed the other's, with no word
said. Now the second is refused, naming the holder.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

LOCK = ".lock"


@contextlib.contextmanager
def holding(work: Path) -> Iterator[str | None]:
    """Hold ``work`` for this check: yields None, or, where another check holds it, why this
    one may not run (its pid named). The lock is the kernel's (flock): it goes with the
    process however it ends, so a killed check leaves none behind."""
    fd = os.open(work / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            yield (
                f"another GPU check (pid {holder}) is running with its parts in {work}: wait "
                "for it to end, or give this one --work and --out of its own"
            )
            return
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield None
    finally:
        os.close(fd)
