"""A job's processes cut off from what started them: their launcher gone, or their terminal.

The ranks run in a process group of their own (launcher.spawn), so a closed terminal's SIGHUP,
the OOM killer or a kill -9 can end ``train.py`` alone. Its ranks then trained on unseen, held
the GPUs and the run dir's lock, and ended without exit.json; a rank that wrote to the closed
terminal died of it (EIO) at its next line. Here: the launcher's pid, which the ranks watch
at every step boundary (:class:`LauncherWatch`), and output that outlives a closed terminal
or pipe (:func:`outlive_the_terminal`).

No torch here: the launcher imports it too.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
from typing import Any, TextIO

import psutil

LAUNCHER_PID_ENV = "MEMTUNE_LAUNCHER_PID"
"""Set by train.py (launcher.spawn) for the ranks it starts, directly, through DeepSpeed's
per-node launcher or, in the hostfile form, over ssh: its own pid, which the ranks on its
machine watch (:data:`LAUNCHER_BOOT_ENV`). Not in launch.txt: a rank started by hand has no
launcher to lose."""
LAUNCHER_BOOT_ENV = "MEMTUNE_LAUNCHER_BOOT_ID"
"""Where the launcher's pid means something (:func:`pid_space`), set beside
:data:`LAUNCHER_PID_ENV`: a hostfile job's ranks on other nodes get the pid too, and there it
names another machine's process, or another container's. Their stop comes from the ranks that
can see the launcher, through the step's collective."""
BOOT_ID = "/proc/sys/kernel/random/boot_id"


def pid_space() -> str:
    """Where a pid is this process's pid: the kernel's boot id (the machine) and this process's
    pid namespace. Containers on one host share the boot id but not the pids (a Kubernetes pod,
    a compose "node"): there another container's pid names nothing, or something else. ""
    where neither can be read (not Linux)."""
    try:
        with open(BOOT_ID) as f:
            boot = f.read().strip()
    except OSError:
        return ""
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        namespace = 0
    return f"{boot}/pid:{namespace}"


def launcher_env() -> dict[str, str]:
    """What a job gives its ranks so that they can watch it (:class:`LauncherWatch`)."""
    return {LAUNCHER_PID_ENV: str(os.getpid()), LAUNCHER_BOOT_ENV: pid_space()}


class LauncherWatch:
    """This rank's launcher (``MEMTUNE_LAUNCHER_PID``), asked whether it still runs: a reused
    pid does not count (psutil compares the start time it saw first), nor a zombie (a launcher
    killed and not yet reaped by its parent). A launcher whose pid means nothing here (a hostfile
    job's other nodes, another container: ``MEMTUNE_LAUNCHER_BOOT_ID`` is not this process's
    :func:`pid_space`) is not watched."""

    def __init__(self, env: dict[str, str] | os._Environ[str] | None = None):
        env = os.environ if env is None else env
        value = env.get(LAUNCHER_PID_ENV, "")
        machine = env.get(LAUNCHER_BOOT_ENV, "")
        here = not machine or machine == pid_space()
        self.pid = int(value) if value.isdigit() and here else None
        self._process: psutil.Process | None = None
        self._gone = False
        if self.pid is not None:
            try:
                self._process = psutil.Process(self.pid)
            except psutil.Error:  # already gone before this rank looked
                self._gone = True

    def gone(self) -> bool:
        """Whether the launcher has ended (False when there is none to watch)."""
        if self._gone or self._process is None:
            return self._gone
        try:
            running = self._process.is_running()
            self._gone = not running or self._process.status() == psutil.STATUS_ZOMBIE
        except psutil.Error:
            self._gone = True
        return self._gone


class _Outliving:
    """A text stream whose writes go on after its reader left: a terminal that closed (EIO) or
    a pipe whose reader ended (EPIPE, ``| tee`` killed with the terminal). The first such
    failure points the descriptor at /dev/null, so later writes, this process's native
    libraries' included, cost nothing and fail nothing."""

    def __init__(self, stream: TextIO):
        self._stream = stream

    def _silence(self, err: OSError) -> None:
        if err.errno not in (errno.EIO, errno.EPIPE):
            raise err
        fd = self._stream.fileno()
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, fd)
        finally:
            os.close(null)

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as err:
            self._silence(err)
            with contextlib.suppress(OSError):
                self._stream.flush()  # what the buffer still held goes to /dev/null
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as err:
            self._silence(err)
            with contextlib.suppress(OSError):
                self._stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def outlive_the_terminal() -> None:
    """sys.stdout and sys.stderr made to outlive their reader (:class:`_Outliving`): the job's
    end (a checkpoint, exit.json, its exit code) no longer depends on a terminal still being
    there to print its lines. Idempotent."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is None or isinstance(stream, _Outliving):
            continue
        try:
            stream.fileno()
        except (OSError, ValueError, AttributeError):  # not a real file (a test's capture)
            continue
        setattr(sys, name, _Outliving(stream))
