"""The job lock: one job per run dir, held for the job's whole life.

The job takes it before it writes anything (launcher.job), and the ranks it starts inherit the
lock's descriptor (launcher.spawn), so a second job on the same run dir is refused until the
first and all of its ranks have ended.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import itertools
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from memtune.filesystem import locked_by_another, open_files, pid_alive
from memtune.rundir import RunDir


class RunDirBusy(RuntimeError):
    """Another job holds the run dir (:func:`hold`)."""


class LockNotWritten(RuntimeError):
    """The run dir's job lock cannot be made or written (a full disk): nothing was started."""


def _not_written(path: Path, err: OSError) -> LockNotWritten:
    return LockNotWritten(f"cannot use {path} ({type(err).__name__}: {err.strerror or err})")


_HELD: set[int] = set()
"""The descriptors of the run-dir locks this process holds (:func:`hold`)."""


def held_lock_fds() -> tuple[int, ...]:
    """For the ranks the job starts (launcher.spawn passes them on): a flock belongs to the
    open file, so the run dir stays held until the job and every rank have ended."""
    return tuple(sorted(_HELD))


@contextlib.contextmanager
def hold(run_dir: Path, node_rank: int = 0) -> Iterator[Path]:
    """One job per run dir: an exclusive kernel lock (flock) on ``job.lock`` for the whole job.

    The kernel drops it when the holder exits, however it exits, so a stale lock cannot exist
    and nothing ever has to be removed. The file says who holds it (host, pid, start time,
    command) for the refusal of a second job. In the per-node (Slurm) form every node runs
    the job command on the same run dir: node K > 0 holds ``job-nodeK.lock``. On a shared
    filesystem this needs working flock: local disks and NFSv4 have it (Linux maps it onto
    NFS byte-range locks), Lustre only when mounted with ``-o flock``; where the filesystem
    refuses locks the job warns and goes on unguarded.
    """
    path = RunDir(run_dir).lock(node_rank)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise _not_written(path, err) from None
    try:
        try:
            _lock_now_or_soon(fd)
        except BlockingIOError:
            raise RunDirBusy(
                f"run dir {run_dir} is in use by another memtune job ({_holder(path)}): wait "
                "for it to end, or give this job another run_dir"
            ) from None
        except OSError as err:
            if err.errno not in (errno.ENOLCK, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                raise
            print(
                f"memtune: warning: cannot lock {path} ({err.strerror}: the filesystem has no "
                "flock; on Lustre mount with -o flock): a second job on this run dir would not "
                "be refused",
                file=sys.stderr,
                flush=True,
            )
        started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        who = {"host": socket.gethostname(), "pid": os.getpid(), "started": started}
        record = (json.dumps({**who, "command": sys.argv}) + "\n").encode()
        try:
            os.ftruncate(fd, 0)
            done = 0
            while done < len(record):  # a short write (a disk filling up): the rest says why
                done += os.pwrite(fd, record[done:], done)
        except OSError as err:  # a full disk: os.pwrite's error names no file (a traceback)
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)  # empty, as memtune's lock being written: not cut-off JSON
            raise _not_written(path, err) from None
        _HELD.add(fd)
        yield run_dir
    finally:
        _HELD.discard(fd)
        os.close(fd)  # releases the lock, unless ranks started with it still run


LOOKS = 5
"""Tries of a job's lock, 20 ms apart, before the run dir is taken for another job's: a
``memtune report`` looking whether a sweep point still runs (:func:`held`) holds a shared lock
on it for an instant, and a job starting in that instant was refused as if a job held it."""


def _lock_now_or_soon(fd: int) -> None:
    for attempt in range(LOOKS):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if attempt == LOOKS - 1:
                raise
            time.sleep(0.02)


def held(run_dir: Path) -> bool:
    """Whether a job holds ``run_dir`` now (:func:`hold`, on this host or another sharing the
    filesystem): it, or a rank it started, has not ended. Asked by a shared lock taken and
    dropped at once; False where there is no job lock or the filesystem has no flock."""
    return locked_by_another(RunDir(run_dir).lock(), unopenable=False)


def _holder(path: Path) -> str:
    try:
        who = json.loads(path.read_text())
        said = f"host {who['host']}, pid {who['pid']}, started {who['started']}"
    except (OSError, ValueError, KeyError):
        return "its holder is still starting"
    if who["host"] != socket.gethostname() or pid_alive(int(who["pid"])):
        return said
    # The job was killed (kill -9, the OOM killer) but the ranks it started hold the lock
    # (they inherit it): the pid in job.lock names no process, and the ones to wait for or
    # stop are these.
    ranks = " ".join(str(pid) for pid in _has_open(path))
    still = f"pids {ranks}" if ranks else "not visible to this user"
    return (
        f"{said}; pid {who['pid']} has ended, but the ranks it started still run and hold the "
        f"lock: {still}; stop them with kill -TERM {ranks or 'PID'}, or wait for them"
    )


def _has_open(path: Path) -> list[int]:
    """The pids of this host's other processes (those this user may look at) with ``path``
    open."""
    target = os.path.realpath(path)
    return sorted({pid for pid, f in open_files() if f == target and pid != os.getpid()})


def _fresh(run_dir: Path) -> bool:
    """Nothing in ``run_dir`` but, at most, its lock file: no other start wrote there."""
    if not run_dir.exists():
        return True
    return {p.name for p in run_dir.iterdir()} <= {RunDir(run_dir).lock().name}


@contextlib.contextmanager
def hold_dated(first: Path) -> Iterator[Path]:
    """Hold Hydra's dated default run dir (``outputs/DATE/TIME-EXPERIMENT``), or, when another
    start of the same experiment in the same second has it (held, or already written to), the
    first free ``NAME-2``, ``NAME-3``, ...; yields the dir held. The user named no dir, so two
    starts must not collide on the one Hydra named for both. Each candidate is checked for
    another start's files before its lock is taken and again once held (that start may have
    ended in between)."""
    for n in itertools.count(1):
        candidate = first if n == 1 else first.with_name(f"{first.name}-{n}")
        if not _fresh(candidate):
            continue
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(hold(candidate))
            except RunDirBusy:
                continue
            if _fresh(candidate):
                yield candidate
                return
