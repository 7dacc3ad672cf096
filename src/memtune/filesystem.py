"""The filesystem habits every memtune process keeps: writes that land whole or not at all
(:func:`write_atomic`, :func:`replace_dir`), modes that follow the user's umask
(:func:`follow_umask`) and a group's shared folder (:func:`creation_mask`), and the free space a
write can count on (:func:`free_bytes`).

Imports nothing from memtune: the run dir, the data cache, the demo model, a merge and the
ranks' exports all write through it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import pwd
import re
import shutil
import socket
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable (the directory entry itself)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_dir(new: Path, final: Path, before_removal: Callable[[], None] | None = None) -> None:
    """Put the directory ``new`` (written whole under a temporary name) at ``final``: an
    earlier ``final`` of ours moves aside to a fresh ``.old-NAME.<host>-<pid>-XXXXXXXX`` (made
    here, so nothing but what this call moved there is ever removed) and goes only once the
    new one is in place (and ``before_removal`` has run), so a crash leaves one of them
    (find_latest looks at the set-aside name too). What an earlier call killed after its new
    ``final`` was in place left set aside goes first, with a line
    (:func:`set_aside_and_replaced`)."""
    for left in set_aside_and_replaced(final):
        remove_leftover(left, REPLACED_LEFT.format(final.name))
    aside = None
    if final.exists():
        aside = Path(
            tempfile.mkdtemp(prefix=host_pid_prefix(ASIDE.format(final.name)), dir=final.parent)
        )
        os.replace(final, aside)  # onto the empty dir just made
    os.replace(new, final)
    fsync_dir(final.parent)
    if before_removal is not None:
        before_removal()
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


REPLACED_LEFT = "an earlier {} that a process killed after replacing it left set aside"
"""Why :func:`set_aside_and_replaced`'s leftovers are removed, in words (NAME to fill in)."""


ASIDE = ".old-{}."
"""The start of the name :func:`replace_dir` sets an earlier ``final`` aside under (NAME to
fill in), followed by :func:`host_pid_prefix`'s host and pid."""


def set_aside_and_replaced(final: Path) -> list[Path]:
    """The earlier ``final``s that :func:`replace_dir` set aside,
    ``.old-NAME.<host>-<pid>-XXXXXXXX``, and a kill (kill -9, the OOM killer) stopped it from
    removing once the new ``final`` was in place: each a whole older copy (an adapter, a
    checkpoint), one per kill, that nothing read or removed. Only this host's, of a process
    that has ended: a name without them may be a user's (``.old-adapter.20261207``, a backup,
    has the shape mkdtemp's suffix alone would have). Only while ``final`` is there: killed
    between its two renames, the set-aside copy may be the only one (find_latest reads a
    checkpoint's). Its callers hold what the name belongs to (the run dir's job lock)."""
    if final.is_symlink() or not final.is_dir():
        return []
    return [path for path, _ in left_by_dead(final.parent, ASIDE.format(final.name))]


_OWNED: dict[Path, int] = {}
"""The descriptors holding the lock on each :func:`owned_temp_dir` this process made, kept
open while the directory is there under its temporary name (the kernel drops the lock however
the process ends); released at the next call once it was renamed into place or removed."""


def _release_finished() -> None:
    """Close the locks of this process's temporary dirs that are gone (renamed into place or
    removed): a long process (a test worker, a sweep's job) would otherwise hold one
    descriptor per build it ever made."""
    for path, fd in list(_OWNED.items()):
        if not os.path.lexists(path):
            os.close(fd)
            del _OWNED[path]


def owned_temp_dir(parent: Path, prefix: str) -> Path:
    """A fresh directory ``PREFIX<host>-<pid>-XXXXXXXX`` in ``parent`` (``tempfile.mkdtemp``)
    for a write that is renamed into place when whole, locked (flock) by this process until it
    exits. Name and lock tell a later start one a killed process left
    (:func:`remove_left_by_dead`): a kill -9, the OOM killer or a power cut runs no cleanup,
    and such a directory (a whole tokenized data set, a merged model) would otherwise stay,
    unseen behind its dot, one per kill."""
    _release_finished()
    path = Path(tempfile.mkdtemp(prefix=host_pid_prefix(prefix), dir=parent))
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    with contextlib.suppress(OSError):  # no flock here: the pid alone says it is alive
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    _OWNED[path] = fd
    return path


@contextlib.contextmanager
def sibling_lock(path: Path, waiting: str | None = None) -> Iterator[None]:
    """One writer of ``path`` at a time, across processes (and hosts sharing the filesystem):
    a kernel lock (flock) on ``.NAME.lock`` beside it, released when the holder exits however
    it exits, so a stale lock cannot exist; the file stays. ``waiting``: the line printed when
    another holds it. Opened for writing (on NFS flock is a byte-range lock, and an exclusive
    one needs it), read-only where it cannot be (another user's lock file). Where it cannot be
    opened or locked (a cache memtune may only read, Lustre without ``-o flock``) the work
    goes on unguarded."""
    lock = path.parent / f".{path.name}.lock"
    fd = _open_lock(lock)
    try:
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if waiting:
                    print(waiting, flush=True)
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError:
                pass  # no flock here: unguarded
        yield
    finally:
        if fd is not None:
            os.close(fd)  # the lock goes with it


def _open_lock(lock: Path) -> int | None:
    """The lock file, made here where it is not there yet (group-writable in a folder a group
    shares, :func:`creation_mask`: every member may lock it), opened for writing, else
    read-only (another user's lock file), else None."""
    with contextlib.suppress(OSError):
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
        if shared_by_group(lock.parent):
            with contextlib.suppress(OSError):
                os.fchmod(fd, 0o666 & ~creation_mask(lock.parent))
        return fd
    for flags in (os.O_RDWR, os.O_RDONLY):
        with contextlib.suppress(OSError):
            return os.open(lock, flags)
    return None


def host_pid_prefix(prefix: str) -> str:
    """``PREFIX<host>-<pid>-``: the start of every temporary name memtune makes for a write
    (:func:`owned_temp_dir`, :func:`write_atomic`, a set-aside build), so that a later writer
    can tell one a killed process left (:func:`remove_left_by_dead`)."""
    return f"{prefix}{socket.gethostname()}-{os.getpid()}-"


def pid_alive(pid: int) -> bool:
    """Whether a process of this pid exists on this host (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def open_files() -> Iterator[tuple[int, str]]:
    """``(pid, path)`` for each file a process on this host has open (the processes this user
    may look at), read from /proc. A descriptor or process gone while it is read is passed over,
    not the rest of that process's files."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fds = list((proc / "fd").iterdir())
        except OSError:  # another user's process, or one that has just ended
            continue
        for fd in fds:
            with contextlib.suppress(OSError):
                yield int(proc.name), os.readlink(fd)


def locked_by_another(path: Path, unopenable: bool = True) -> bool:
    """Whether another live process holds the lock (flock) of ``path``, a directory or a file;
    ``unopenable``: the answer where ``path`` cannot be opened. A filesystem without flock
    answers no. A process in another PID namespace (a container beside this one, sharing the
    cache and the host name) has a pid that means nothing here; its lock is the kernel's all
    the same."""
    try:
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    except OSError:
        return unopenable
    try:
        # shared: asks whether an exclusive lock is held, and needs no write access (on NFS,
        # where flock is a byte-range lock, an exclusive one on a read-only descriptor fails)
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:  # no flock here: the pid check alone decides
        return False
    finally:
        os.close(fd)  # releases the lock just taken
    return False


def remove_left_by_dead(
    parent: Path,
    prefix: str,
    what: str,
    log: Callable[[str], None] | None = None,
    files: bool = False,
) -> list[Path]:
    """Remove what memtune's writers made in ``parent`` under a temporary name starting with
    ``prefix`` and left behind when their process was killed (kill -9, the OOM killer, a power
    cut: no cleanup runs): the directories ``PREFIX<host>-<pid>-XXXXXXXX`` of
    :func:`owned_temp_dir` (and a set-aside build named alike), or with ``files`` the files
    ``PREFIX<host>-<pid>`` of :func:`write_atomic`. Only those made on this host (another
    host's may be alive; its pids mean nothing here) by a pid no process has now, and locked
    by none (a writer in another PID namespace has a pid that means nothing here; its lock is
    the kernel's all the same). Nothing else is touched (another name, another host's, a live
    process's, this process's own). Each removal is one line naming it, its size and
    ``what`` it was; one that cannot be removed (another user's) is left quietly. Returns the
    paths removed."""
    removed = []
    for path, pid in left_by_dead(parent, prefix, files):
        why = f"{what} that process {pid} left unfinished when it was killed"
        if remove_leftover(path, why, log):
            removed.append(path)
    return removed


def left_by_dead(parent: Path, prefix: str, files: bool = False) -> list[tuple[Path, int]]:
    """What :func:`remove_left_by_dead` removes (the rule is its docstring's), with the pid
    each name carries."""
    host = re.escape(socket.gethostname())
    tail = "" if files else "-[a-z0-9_]{8}"
    pattern = re.compile(rf"{re.escape(prefix)}{host}-(\d+){tail}")
    left = []
    try:
        names = sorted(p for p in parent.iterdir() if pattern.fullmatch(p.name))
    except OSError:
        return []
    for path in names:
        match = pattern.fullmatch(path.name)
        assert match is not None
        pid = int(match.group(1))
        if pid == os.getpid() or pid_alive(pid) or path.is_symlink():
            continue
        if not (path.is_file() if files else path.is_dir()) or locked_by_another(path):
            continue
        left.append((path, pid))
    return left


def remove_leftover(path: Path, why: str, log: Callable[[str], None] | None = None) -> bool:
    """Remove ``path`` (a directory, or a file), one of memtune's own that a killed process
    left, with one line naming it, its size and ``why`` it is there; False (and nothing said)
    when it cannot be read or removed whole (another user's)."""
    folder = path.is_dir() and not path.is_symlink()
    try:
        if folder:
            size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        else:
            size = path.lstat().st_size
    except OSError:
        return False  # not this user's to read: not to remove either
    if folder:
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()
    if os.path.lexists(path):
        return False
    (log or _print)(f"memtune: removed {path} ({human_bytes(size)}): {why}")
    return True


def _print(line: str) -> None:
    print(line, flush=True)


def write_atomic(path: Path, text: str | bytes) -> None:
    """Write ``text`` (or bytes: a figure) to ``path`` through a temporary sibling that is
    fsynced and renamed into place: a reader (or a crash, or a full disk) sees the old file or
    the whole new one; a symlink at ``path`` is replaced, never written through.

    The sibling is ``.NAME.tmp-<host>-<pid>`` (two writers of one name on a shared filesystem,
    the nodes of a job, differ), locked (flock) by its writer until it is renamed. A process
    killed while it wrote (kill -9, the OOM killer: no cleanup runs) leaves it; the next write
    of ``path`` removes the ones this host's dead writers left, with a line, as the killed
    builds' dirs are (:func:`remove_left_by_dead`): else one stayed per kill, behind a dot, in
    run dirs, the counts cache, a sweep's reports. The lock, not only the pid, tells a dead
    writer: most writes last milliseconds, but metrics.jsonl's rewrite or a figure can last
    longer, and a writer in another PID namespace (a container beside this one with the same
    host name, sharing the folder) has a pid that names nothing here. The lock costs one call
    on the descriptor the write has open anyway, so the rule is one, the builds' rule; an age
    limit instead would guess at how slow a disk may be."""
    remove_left_by_dead(path.parent, f".{path.name}.tmp-", f"a write of {path.name}", files=True)
    tmp = path.with_name(f".{path.name}.tmp-{socket.gethostname()}-{os.getpid()}")
    data = text.encode() if isinstance(text, str) else text
    try:
        with open(tmp, "wb") as f:
            with contextlib.suppress(OSError):  # no flock here: the pid alone says it is alive
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            if shared_by_group(path.parent):
                with contextlib.suppress(OSError):  # else the umask's mode
                    os.fchmod(f.fileno(), 0o666 & ~creation_mask(path.parent))
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
            os.replace(tmp, path)  # before the lock goes with the descriptor
    except OSError as err:
        # Named for the file asked for, not its temporary sibling: the one a user can act on
        # (a folder where the file goes, a read-only or full disk).
        raise type(err)(err.errno, err.strerror, str(path)) from err
    finally:
        # ours: left only when the write or the rename failed. Asked only where it is: on a
        # read-only filesystem unlink says EROFS even for a name that is not there, and that
        # error replaced the one above (naming the temporary file, not ``path``).
        if os.path.lexists(tmp):
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()


NO_SPACE = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "the disk quota is used up",
    errno.EFBIG: "the file is larger than this process may write (ulimit -f)",
}
"""The errors a write gets when the disk (or the user's share of it, or ulimit -f) is full,
in words."""
FULL_DISK = tuple(NO_SPACE)


@contextlib.contextmanager
def safetensors_write_errors(path: Path) -> Iterator[None]:
    """safetensors' failed write as the OSError it is, named ``path``: safetensors (and so
    save_pretrained's weights) reports it as SafetensorError("... I/O error: No space left on
    device (os error 28)"), its errno only in the text, which a caller's full-disk handling
    (an ``except OSError``) let through as a traceback."""
    from safetensors import SafetensorError  # here: only the writers of weights need it

    try:
        yield
    except SafetensorError as err:
        code = re.search(r"\(os error (\d+)\)", str(err))
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(path)) from err


def umask() -> int:
    """The process's umask, read without changing it (/proc/self/status, Linux ≥ 4.7); else by
    setting and restoring it (a moment in which another thread's new file would get 0)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def shared_by_group(folder: Path) -> bool:
    """Whether ``folder`` is set up for a group to share: setgid and group-writable (``chmod
    2775``, the usual way to give a team one folder: what is made in it takes its group)."""
    try:
        mode = os.stat(folder).st_mode
    except OSError:
        return False
    return bool(mode & stat.S_ISGID and mode & stat.S_IWGRP)


def creation_mask(folder: Path) -> int:
    """The umask for what memtune makes in ``folder``: the process's, without its group bits
    in a folder shared by a group (:func:`shared_by_group`). Under the usual umask 022 the
    first member of a team to make the data cache's folder in the team's folder made it 0755:
    no one else could tokenize into it, nor set a damaged entry of the first's aside."""
    mask = umask()
    return mask & ~0o070 if shared_by_group(folder) else mask


def make_dirs(path: Path) -> None:
    """``path.mkdir(parents=True, exist_ok=True)``, each folder made here given the mode
    :func:`creation_mask` says in its parent (group-writable, and setgid as the kernel made
    it, in a folder a group shares). A folder another process made meanwhile is left as it
    is."""
    path = Path(path)
    missing = []
    for folder in [path, *path.parents]:
        if os.path.lexists(folder):
            break
        missing.append(folder)
    for folder in reversed(missing):
        try:
            folder.mkdir()
        except FileExistsError:
            continue  # another process's
        except OSError:
            break  # the call below says why, as mkdir(parents=True) always did
        if shared_by_group(folder.parent):
            # through a descriptor of the folder made here (never a link another member put in
            # its place since), and only where it still is ours; a failure leaves the umask's
            with contextlib.suppress(OSError):
                fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
                try:
                    st = os.fstat(fd)
                    if st.st_uid == os.geteuid():
                        mode = 0o777 & ~creation_mask(folder.parent) | st.st_mode & stat.S_ISGID
                        os.fchmod(fd, mode)
                finally:
                    os.close(fd)
    path.mkdir(parents=True, exist_ok=True)


def follow_umask(path: Path) -> None:
    """Give ``path``, and for a directory everything under it, the mode a plain create gives
    under the umask (dirs 0o777, files 0o666, less the umask; group-writable in a folder a
    group shares, :func:`creation_mask`; a folder's setgid bit kept). Two writers memtune uses
    are private by design, not by the user's choice: ``tempfile.mkdtemp`` makes 0700 dirs, and
    safetensors' ``save_file`` writes a 0600 temporary file and renames it into place (every
    ``.safetensors``: the data cache, an adapter, a model). A group sharing a cache or a run
    dir could then not read them. Only for what the caller has just written."""
    root = Path(path)
    mask = creation_mask(root.parent)
    # deepest first, ``root`` last: a folder opens to the group only once what it holds is set
    for item in reversed([root, *root.rglob("*")]) if root.is_dir() else [root]:
        if item.is_symlink():
            continue
        if item.is_dir():
            item.chmod(0o777 & ~mask | item.stat().st_mode & stat.S_ISGID)
        else:
            item.chmod(0o666 & ~mask)


def whose(path: Path, before: str) -> str:
    """``before`` and ``path``'s owner and mode (``alice's, drwxr-sr-x``), for a refusal that
    says why another member of a team cannot write there; empty when they cannot be asked."""
    try:
        st = os.stat(path)
    except OSError:
        return ""
    try:
        owner = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        owner = f"uid {st.st_uid}"
    return f"{before}{owner}'s, {stat.filemode(st.st_mode)}"


def refused_by(path: Path, err: OSError) -> str:
    """Whose file or folder made the kernel refuse to move ``path`` (``err``), in words for a
    refusal: under a folder's sticky bit (EPERM) only ``path``'s owner may; otherwise (EACCES)
    the folder is not the user's to write."""
    if err.errno == errno.EPERM:
        return whose(path, "; it is ")
    if err.errno == errno.EACCES:
        return whose(path.parent, f"; {path.parent} is ")
    return ""


def free_bytes(path: Path) -> int | None:
    """Free bytes on the filesystem that holds ``path`` (or its nearest existing parent: the
    path may not be made yet); None when it cannot be asked."""
    try:
        return shutil.disk_usage(_nearest_existing(Path(path).expanduser().absolute())).free
    except OSError:
        return None


def human_bytes(n: int) -> str:
    if n >= 1 << 30:
        return f"{n / (1 << 30):.1f} GiB"
    if n < 1 << 20:  # a small file (a record a killed writer left): not "0.0 MiB"
        return f"{n / (1 << 10):.1f} KiB"
    return f"{n / (1 << 20):.1f} MiB"


def cannot_write(path: Path) -> str | None:
    """Why memtune could not make or write into folder ``path``, in words, before it tries
    (the path is a file, a folder on the way cannot be entered, or its nearest existing folder
    is read-only or not the user's to write); None when it can. The run dir, the data cache
    and the demo model's cache are checked with it, so the refusal names the setting instead of
    an OSError from deep inside."""
    probe = Path(path).expanduser().absolute()
    try:
        if probe.exists() and not probe.is_dir():
            return f"{probe} is a file, not a folder"
        broken = _broken_link(probe)
        if broken is not None:
            return broken
        probe = _nearest_existing(probe)
    except PermissionError:
        return f"cannot reach {path} (permission denied on a folder on the way)"
    if not probe.is_dir():
        return f"{probe} is a file, not a folder"
    if os.access(probe, os.W_OK | os.X_OK, effective_ids=os.access in os.supports_effective_ids):
        return None
    try:
        read_only = bool(os.statvfs(probe).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    why = "read-only filesystem" if read_only else "permission denied" + whose(probe, ": ")
    return f"cannot write in {probe} ({why})"


def _broken_link(path: Path) -> str | None:
    """A symlink at ``path``, or on the way to it, that leads nowhere or round a loop, in
    words: the folder would be made through it and cannot be (mkdir's FileExistsError)."""
    while not path.exists() and path != path.parent:
        if path.is_symlink():
            try:
                os.stat(path)
            except OSError as err:
                if err.errno == errno.ELOOP:
                    return f"{path} is a symlink loop"
            return f"{path} is a symlink to {os.readlink(path)}, which does not exist"
        path = path.parent
    return None


def _nearest_existing(path: Path) -> Path:
    """``path`` or its nearest existing parent (PermissionError where one cannot be entered)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path
