"""A signal to one run's ranks on this machine, found by their command line; and the same over
ssh to every node of a hostfile job.

    python -m memtune.launcher.rank_signals USR2 RUN_DIR [MODULE]

In the hostfile form (launcher.hostfile) the ranks are started over ssh by pdsh, under each
node's sshd: they are no descendants of ``train.py``, so the stop it passes on (SIGUSR2: a
checkpoint at the next step boundary) and the kill after a second Ctrl-C reached none of them,
and a stopped job trained on. :class:`NodesOverSsh` runs this module on every node through pdsh,
as DeepSpeed's own runner reaches its launchers there (its ``pkill``), but only this run's
ranks: a rank is ``python [-u] -m MODULE RUN_DIR`` with this run dir, so another job's ranks on
the same nodes are never signalled.

Light on purpose (no torch): it starts once per node for every signal.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import psutil

WORKER_MODULE = "memtune.worker"
MODULE = "memtune.launcher.rank_signals"


def is_rank(
    cmdline: Sequence[str], module: str = WORKER_MODULE, run_dir: str | None = None
) -> bool:
    """Whether a command line is a rank's: ``python [-u] -m MODULE RUN_DIR`` (a launcher carries
    ``--module MODULE``, never ``-m MODULE``), of ``run_dir`` when given (compared resolved)."""
    for i, (flag, name) in enumerate(itertools.pairwise(cmdline)):
        if flag == "-m" and name == module:
            if run_dir is None:
                return True
            rest = cmdline[i + 2 : i + 3]
            return bool(rest) and os.path.realpath(rest[0]) == os.path.realpath(run_dir)
    return False


def handles(pid: int, sig: signal.Signals) -> bool:
    """Whether process ``pid`` catches or ignores ``sig`` (/proc/PID/status): a rank that has
    not yet reached its own first line (memtune.worker ignores the stop signals there) would
    die of a stop signal's default, and DeepSpeed's launcher starts the hostfile form's ranks
    with the defaults."""
    bit = 1 << (int(sig) - 1)
    try:
        with open(f"/proc/{pid}/status") as f:
            masks = dict(line.split(":", 1) for line in f if line.startswith(("SigIgn", "SigCgt")))
    except OSError:
        return False
    return any(int(value, 16) & bit for value in masks.values())


def signal_here(sig: signal.Signals, run_dir: str, module: str = WORKER_MODULE) -> int:
    """``sig`` to this user's ranks of ``run_dir`` on this machine; how many got it. A stop
    (any signal but SIGKILL) skips a rank not yet listening for it: the job sends it again."""
    sent = 0
    me = os.getuid()
    for proc in psutil.process_iter(["cmdline", "uids"]):
        with contextlib.suppress(psutil.Error, TypeError):
            mine = proc.info["uids"].real == me
            if not mine or not is_rank(proc.info["cmdline"] or [], module, run_dir):
                continue
            if sig != signal.SIGKILL and not handles(proc.pid, sig):
                continue
            proc.send_signal(sig)
            sent += 1
    return sent


class NodesOverSsh:
    """A hostfile job's nodes, reached as DeepSpeed's runner reaches them (pdsh over ssh): a
    signal for the run's ranks on every node, sent without waiting (it is sent from a signal
    handler, and re-sent until the ranks end) or, for a kill, waited for."""

    def __init__(self, hosts: Sequence[str], run_dir: Path, module: str = WORKER_MODULE):
        self.hosts, self.run_dir, self.module = list(hosts), run_dir, module
        self._sending: subprocess.Popen | None = None
        self.failures: list[str] = []
        """What pdsh said when a signal could not be sent (the job says each once)."""

    def command(self, sig: signal.Signals) -> list[str]:
        """pdsh's command line: the remote command is one shell line on every node (each word
        quoted, a run dir with a space included) in which pdsh itself expands ``%`` (``%%``)."""
        name = sig.name.removeprefix("SIG")
        here = [sys.executable, "-m", MODULE, name, str(self.run_dir), self.module]
        line = " ".join(shlex.quote(word).replace("%", "%%") for word in here)
        return ["pdsh", "-S", "-w", ",".join(self.hosts), line]

    def _start(self, sig: signal.Signals) -> subprocess.Popen:
        env = {**os.environ, "PDSH_RCMD_TYPE": "ssh"}
        return subprocess.Popen(
            self.command(sig),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # a Ctrl-C in the terminal is the job's, not pdsh's
        )

    def send(self, sig: signal.Signals) -> None:
        """Start sending ``sig`` unless the last one is still on its way."""
        if self._sending is not None and self._sending.poll() is None:
            return
        self.collect()
        try:
            self._sending = self._start(sig)
        except OSError as err:
            self.failures.append(f"pdsh: {err}")

    def finish(self, timeout_s: float = 10.0) -> None:
        """The last send waited for, and ended if it hangs: one still on its way when the job
        ends could stop the ranks of the next start on the same run dir."""
        if self._sending is None:
            return
        try:
            self._sending.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):
                os.killpg(self._sending.pid, signal.SIGKILL)
        self.collect()

    def send_and_wait(self, sig: signal.Signals, timeout_s: float = 30.0) -> None:
        """``sig`` to every node, waited for (a kill: nothing may be left training)."""
        try:
            proc = self._start(sig)
        except OSError as err:
            self.failures.append(f"pdsh: {err}")
            return
        try:
            _, err_text = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            self.failures.append(f"pdsh did not finish within {timeout_s:.0f} s")
            return
        if proc.returncode:
            self.failures.append(err_text.strip())

    def collect(self) -> None:
        """The last send's outcome, once it has ended: what pdsh said when it failed."""
        if self._sending is None or self._sending.poll() is None:
            return
        done, self._sending = self._sending, None
        _, err_text = done.communicate()
        if done.returncode:
            self.failures.append(err_text.strip() or f"pdsh exited with {done.returncode}")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (2, 3):
        print(f"usage: python -m {MODULE} SIGNAL RUN_DIR [MODULE]", file=sys.stderr)
        return 2
    try:
        sig = signal.Signals[f"SIG{args[0].removeprefix('SIG')}"]
    except KeyError:
        print(f"{MODULE}: no signal {args[0]!r}", file=sys.stderr)
        return 2
    signal_here(sig, args[1], *args[2:])
    return 0  # no rank left here is no failure: it may have ended already


if __name__ == "__main__":
    sys.exit(main())
