"""A two-node Slurm cluster on 127.0.0.1 for the Slurm test tier, from nothing.

    python -m tests.slurm.cluster up       # install if needed, start, print `export SLURM_CONF=`
    python -m tests.slurm.cluster status   # what runs, sinfo / squeue
    python -m tests.slurm.cluster down     # stop every daemon by its pid file (--rm: and the dir)

What `up` does, each step only if it is not done yet:

1. `apt-get install slurmctld slurmd slurm-client slurmdbd mariadb-server` when `sbatch` is
   missing (Debian 12 ships Slurm 22.05); services are kept from starting during the install.
2. Writes slurm.conf and slurmdbd.conf into the cluster dir (default /tmp/memtune-slurm, or
   $MEMTUNE_SLURM_DIR), with free ports on 127.0.0.1. Slurm runs as root without systemd,
   cgroups or munge: auth/none, cred/none, proctrack/linuxproc, task/none, cons_tres on cores;
   two nodes (memtune-node0, memtune-node1), each declared as `slurmd -C` reports this machine,
   each served by its own slurmd on its own port (`slurmd -N NAME`, `%n` in the pid, spool
   and log paths), their names added to /etc/hosts as 127.0.0.1.
3. Starts MariaDB by hand (its own datadir and socket, 127.0.0.1 only) for slurmdbd: without
   accounting `sacct` fails, and submitit then waits forever on a job that died.
4. Starts slurmdbd, registers the cluster, starts slurmctld and slurmd, and waits until
   `sinfo` shows both nodes idle.

Requeued jobs are eligible again after ~10 s rather than 120 s (`AuthInfo=cred_expire=10`,
`sched_interval=1`). Every external call has a timeout; `down` cancels the jobs, then stops
the daemons by the PIDs in their pid files (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "slurmdbd", "mariadb-server"]
CLUSTER_NAME = "memtune"
NODES = ("memtune-node0", "memtune-node1")  # two slurmds on this machine, one port each
PARTITION = "debug"
DB_USER = "slurm"
DB_PASSWORD = "memtune-slurm"  # a throwaway database on 127.0.0.1 of a test machine
DEFAULT_DIR = Path(os.environ.get("MEMTUNE_SLURM_DIR", "/tmp/memtune-slurm"))
T = TypeVar("T")
DAEMONS = (*(f"slurmd.{n}" for n in NODES), "slurmctld", "slurmdbd", "mariadbd")  # stop order


class ClusterError(RuntimeError):
    pass


def log(msg: str) -> None:
    print(f"slurm-cluster: {msg}", flush=True)


def run(
    cmd: list[str],
    timeout: float = 30,
    check: bool = True,
    env: dict[str, str] | None = None,
    quiet: bool = False,
) -> subprocess.CompletedProcess[str]:
    """One external call, always with a timeout; a failure says what ran and what it printed."""
    if not quiet:
        log("$ " + " ".join(cmd))
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired as err:
        raise ClusterError(f"{cmd[0]} did not finish within {timeout:.0f} s") from err
    if check and proc.returncode != 0:
        raise ClusterError(
            f"{' '.join(cmd)} exited with {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
        )
    return proc


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(what: str, check: Callable[[], T], timeout: float, interval: float = 0.5) -> T:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise ClusterError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


# ---------------------------------------------------------------------------------- install


def ensure_installed(timeout: float = 1200) -> bool:
    """apt-get install the Slurm daemons and MariaDB if `sbatch` is missing; True if it did."""
    if shutil.which("sbatch") and shutil.which("slurmdbd") and _mariadbd():
        return False
    if os.geteuid() != 0:
        raise ClusterError("Slurm is not installed and installing it needs root (apt-get)")
    apt_install(PACKAGES, timeout)
    return True


def apt_install(packages: list[str], timeout: float) -> None:
    """apt-get install ``packages`` (root), their services kept from starting (the Docker way:
    a policy-rc.d that says no, removed after unless it was there before)."""
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    policy = Path("/usr/sbin/policy-rc.d")
    made_policy = not policy.exists()
    if made_policy:
        log(f"writing {policy} (exit 101) so the install starts no services")
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
    start = time.monotonic()
    try:
        run(["apt-get", "update", "-q"], timeout=timeout, env=env)
        run(
            ["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages],
            timeout=timeout,
            env=env,
        )
    finally:
        if made_policy:
            policy.unlink()
            log(f"removed {policy}")
    log(f"installed {' '.join(packages)} in {time.monotonic() - start:.0f} s")


def _mariadbd() -> str | None:
    return shutil.which("mariadbd") or shutil.which("mysqld") or _sbin("mariadbd")


def _sbin(name: str) -> str | None:
    for d in ("/usr/sbin", "/usr/bin", "/sbin"):
        p = Path(d) / name
        if p.is_file():
            return str(p)
    return None


def _bin(name: str) -> str:
    found = shutil.which(name) or _sbin(name)
    if not found:
        raise ClusterError(f"{name} not found; is Slurm installed?")
    return found


# ---------------------------------------------------------------------------------- cluster


@dataclass
class Cluster:
    dir: Path = DEFAULT_DIR

    @property
    def conf(self) -> Path:
        return self.dir / "etc" / "slurm.conf"

    @property
    def dbd_conf(self) -> Path:
        return self.dir / "etc" / "slurmdbd.conf"

    @property
    def logs(self) -> Path:
        return self.dir / "log"

    def pid_file(self, daemon: str) -> Path:
        return self.dir / "run" / f"{daemon}.pid"

    @property
    def db_socket(self) -> Path:
        return self.dir / "run" / "mariadb.sock"

    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    # -- state -----------------------------------------------------------------------------

    def pid(self, daemon: str) -> int | None:
        """The daemon's pid if its pid file names a live process of that program."""
        try:
            pid = int(self.pid_file(daemon).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            return None
        return pid if comm == daemon.split(".")[0][:15] else None

    def running(self) -> dict[str, int | None]:
        return {d: self.pid(d) for d in DAEMONS}

    def node_states(self) -> dict[str, str]:
        """Each node's state as sinfo reports it (empty if slurmctld does not answer)."""
        if not self.conf.is_file() or not shutil.which("sinfo"):
            return {}
        proc = run(
            ["sinfo", "-h", "-N", "-o", "%N %T"],
            timeout=15,
            check=False,
            env=self.env(),
            quiet=True,
        )
        if proc.returncode != 0:
            return {}
        return dict(line.split(None, 1) for line in proc.stdout.splitlines() if " " in line)

    def nodes_are(self, states: set[str]) -> bool:
        found = self.node_states()
        return set(found) == set(NODES) and all(s.rstrip("*") in states for s in found.values())

    def is_up(self) -> bool:
        return all(self.running().values()) and self.nodes_are({"idle", "mixed", "allocated"})

    # -- up --------------------------------------------------------------------------------

    def up(self, install: bool = True) -> Cluster:
        """Bring the cluster up (installing Slurm if needed); a no-op if it already is."""
        if self.is_up():
            log(f"already up in {self.dir}")
            return self
        start = time.monotonic()
        if install:
            ensure_installed()
        self.down(quiet=True)  # a half-started cluster from before goes first
        if self.dir.exists():
            shutil.rmtree(self.dir)
        for sub in ("etc", "log", "run", "state", "spool", "mysql", "tmp"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        ports = {"ctld": free_port(), "dbd": free_port(), "db": free_port()}
        ports.update({node: free_port() for node in NODES})
        self._write_configs(ports)
        ensure_hosts_entry()
        self._start_mariadb(ports["db"])
        self._start_slurmdbd(ports["dbd"])
        self._start_slurm()
        log(f"up in {time.monotonic() - start:.1f} s; export SLURM_CONF={self.conf}")
        return self

    def _write_configs(self, ports: dict[str, int]) -> None:
        hardware = self._node_line()
        node_lines = "\n".join(
            f"NodeName={node} NodeAddr=127.0.0.1 NodeHostname=localhost Port={ports[node]} "
            f"{hardware} State=UNKNOWN"
            for node in NODES
        )
        d = self.dir
        self.conf.write_text(
            f"""# Generated by tests/slurm/cluster.py: two nodes on 127.0.0.1, root, no munge.
ClusterName={CLUSTER_NAME}
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ports["ctld"]}
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
AuthInfo=cred_expire=10
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
JobRequeue=1
KillWait=30
MinJobAge=600
SlurmctldTimeout=30
SlurmdTimeout=60
InactiveLimit=0
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={self.pid_file("slurmctld")}
SlurmdPidFile={d}/run/slurmd.%n.pid
SlurmctldLogFile={self.logs}/slurmctld.log
SlurmdLogFile={self.logs}/slurmd.%n.log
SlurmctldDebug=info
SlurmdDebug=info
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort={ports["dbd"]}
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
{node_lines}
PartitionName={PARTITION} Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
"""
        )
        self.dbd_conf.write_text(
            f"""# Generated by tests/slurm/cluster.py
AuthType=auth/none
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort={ports["dbd"]}
SlurmUser=root
PidFile={self.pid_file("slurmdbd")}
LogFile={self.logs}/slurmdbd.log
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={ports["db"]}
StorageUser={DB_USER}
StoragePass={DB_PASSWORD}
StorageLoc=slurm_acct_db
"""
        )
        self.dbd_conf.chmod(0o600)  # slurmdbd refuses a readable config (it holds a password)

    def _node_line(self) -> str:
        """The hardware part of the node line, as `slurmd -C` reports this machine."""
        out = run([_bin("slurmd"), "-C"], timeout=30, env=self.env()).stdout
        fields = dict(re.findall(r"(\w+)=(\S+)", out.splitlines()[0]))
        keep = ["CPUs", "Boards", "SocketsPerBoard", "CoresPerSocket", "ThreadsPerCore"]
        parts = [f"{k}={fields[k]}" for k in keep if k in fields]
        if "RealMemory" in fields:  # leave room for the OS: jobs that ask --mem still fit
            parts.append(f"RealMemory={int(int(fields['RealMemory']) * 0.9)}")
        return " ".join(parts)

    # -- daemons ---------------------------------------------------------------------------

    def _spawn(self, daemon: str, cmd: list[str]) -> None:
        """Start a daemon in its own session, output to its log; wait for its pid file."""
        out = (self.logs / f"{daemon}.out").open("ab")
        subprocess.Popen(
            cmd,
            env=self.env(),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
        )
        out.close()
        try:
            wait_for(f"{daemon}'s pid file", lambda: self.pid(daemon), timeout=60)
        except ClusterError as err:
            raise ClusterError(f"{err}\n{self._tail(daemon)}") from None

    def _tail(self, daemon: str, lines: int = 30) -> str:
        texts = []
        for name in (f"{daemon}.log", f"{daemon}.out"):
            path = self.logs / name
            if path.is_file():
                tail = path.read_text(errors="replace").splitlines()[-lines:]
                texts.append(f"--- {path}\n" + "\n".join(tail))
        return "\n".join(texts)

    def _start_mariadb(self, port: int) -> None:
        datadir = self.dir / "mysql"
        install_db = _bin("mariadb-install-db")
        run(
            [
                install_db,
                "--no-defaults",
                f"--datadir={datadir}",
                "--user=root",
                "--auth-root-authentication-method=socket",
                "--skip-test-db",
            ],
            timeout=180,
        )
        mariadbd = _mariadbd()
        assert mariadbd
        self._spawn(
            "mariadbd",
            [
                mariadbd,
                "--no-defaults",
                f"--datadir={datadir}",
                f"--socket={self.db_socket}",
                f"--pid-file={self.pid_file('mariadbd')}",
                f"--log-error={self.logs}/mariadbd.log",
                f"--tmpdir={self.dir}/tmp",
                f"--port={port}",
                "--bind-address=127.0.0.1",
                "--user=root",
                "--skip-name-resolve",
                "--innodb-buffer-pool-size=64M",
                "--innodb-log-file-size=48M",
                "--innodb-lock-wait-timeout=900",
                "--max-connections=50",
                "--performance-schema=OFF",
            ],
        )
        client = _bin("mariadb")
        wait_for(
            "MariaDB to accept connections",
            lambda: (
                run(
                    [
                        client,
                        "--no-defaults",
                        f"--socket={self.db_socket}",
                        "-uroot",
                        "-e",
                        "SELECT 1",
                    ],
                    timeout=10,
                    check=False,
                    quiet=True,
                ).returncode
                == 0
            ),
            timeout=90,
        )
        sql = (
            f"CREATE USER IF NOT EXISTS '{DB_USER}'@'127.0.0.1' IDENTIFIED BY '{DB_PASSWORD}';"
            f"CREATE DATABASE IF NOT EXISTS slurm_acct_db;"
            f"GRANT ALL ON slurm_acct_db.* TO '{DB_USER}'@'127.0.0.1';"
        )
        run([client, "--no-defaults", f"--socket={self.db_socket}", "-uroot", "-e", sql])

    def _start_slurmdbd(self, port: int) -> None:
        self._spawn("slurmdbd", [_bin("slurmdbd")])  # reads SLURM_CONF's dir: slurmdbd.conf
        wait_for("slurmdbd to listen", lambda: _listening(port), timeout=90)
        sacctmgr = _bin("sacctmgr")
        # Creates the cluster's tables; slurmctld would register it too, but later.
        proc = run(
            [sacctmgr, "-i", "add", "cluster", CLUSTER_NAME],
            timeout=60,
            env=self.env(),
            check=False,
        )
        if proc.returncode != 0 and "already exists" not in proc.stdout + proc.stderr:
            raise ClusterError(f"sacctmgr add cluster failed:\n{proc.stdout}{proc.stderr}")

    def _start_slurm(self) -> None:
        self._spawn("slurmctld", [_bin("slurmctld")])
        for node in NODES:
            (self.dir / "spool" / node).mkdir(parents=True, exist_ok=True)
            self._spawn(f"slurmd.{node}", [_bin("slurmd"), "-N", node])
        try:
            wait_for(
                "the nodes to be idle in sinfo",
                lambda: self.nodes_are({"idle"}),
                timeout=120,
                interval=1,
            )
        except ClusterError as err:
            raise ClusterError(
                f"{err} (states {self.node_states()})\n{self._tail('slurmctld')}\n"
                + "\n".join(self._tail(f"slurmd.{node}") for node in NODES)
            ) from None

    # -- down ------------------------------------------------------------------------------

    def cancel_jobs(self, timeout: float = 90) -> None:
        """Cancel every job of this cluster and wait until none is left running."""
        if not self.pid("slurmctld"):
            return
        run(
            ["scancel", "--full", "--partition", PARTITION], timeout=30, check=False, env=self.env()
        )

        def empty() -> bool:
            proc = run(
                ["squeue", "-h", "-o", "%i"], timeout=15, check=False, env=self.env(), quiet=True
            )
            return proc.returncode != 0 or not proc.stdout.strip()

        with contextlib.suppress(ClusterError):
            wait_for("the jobs to end", empty, timeout=timeout, interval=1)

    def down(self, quiet: bool = False, remove: bool = False) -> None:
        """Cancel the jobs, then stop every daemon by its pid file; the dir (logs, database)
        stays unless ``remove``."""
        if not self.dir.exists():
            return
        self.cancel_jobs()
        for daemon in DAEMONS:
            pid = self.pid(daemon)
            if pid is None:
                continue
            if not quiet:
                log(f"stopping {daemon} (pid {pid})")
            _stop(pid)
        self._kill_leftover_steps()
        if remove:
            if any(self.running().values()):
                raise ClusterError(f"daemons still running; not removing {self.dir}")
            shutil.rmtree(self.dir)
            remove_hosts_entry()
            if not quiet:
                log(f"removed {self.dir}")

    def _kill_leftover_steps(self) -> None:
        """slurmstepd processes of this cluster that outlived slurmd (a job still ending)."""
        mine = f"SLURM_CONF={self.conf}".encode()
        for proc_dir in Path("/proc").iterdir():
            if not proc_dir.name.isdigit():
                continue
            try:
                if not (proc_dir / "comm").read_text().startswith("slurmstepd"):
                    continue
                if mine in (proc_dir / "environ").read_bytes().split(b"\0"):
                    log(f"stopping a leftover slurmstepd (pid {proc_dir.name})")
                    _stop(int(proc_dir.name))
            except (OSError, ValueError):
                continue

    def status(self) -> str:
        lines = [f"cluster dir {self.dir}"]
        for daemon, pid in self.running().items():
            lines.append(f"  {daemon:10s} {'pid ' + str(pid) if pid else 'not running'}")
        if self.pid("slurmctld"):
            for cmd in (["sinfo"], ["squeue"]):
                proc = run(cmd, timeout=15, check=False, env=self.env(), quiet=True)
                lines.append(proc.stdout.rstrip() or proc.stderr.rstrip())
        return "\n".join(lines)


HOSTS = Path("/etc/hosts")
HOSTS_LINE = f"127.0.0.1 {' '.join(NODES)}  # memtune Slurm test cluster (tests/slurm/cluster.py)"


def ensure_hosts_entry() -> None:
    """The node names resolve to 127.0.0.1, as a real cluster's node names resolve: the jobs
    use the first node's name as the master address (train.sbatch, launcher.topology)."""
    try:
        if all(socket.gethostbyname(node) == "127.0.0.1" for node in NODES):
            return
    except OSError:
        pass
    log(f"adding to {HOSTS}: {HOSTS_LINE}")
    with HOSTS.open("a") as f:
        f.write(f"\n{HOSTS_LINE}\n")


def remove_hosts_entry() -> None:
    if HOSTS.is_file() and HOSTS_LINE in HOSTS.read_text():
        kept = [line for line in HOSTS.read_text().splitlines() if line != HOSTS_LINE]
        HOSTS.write_text("\n".join(kept).rstrip("\n") + "\n")
        log(f"removed the cluster's line from {HOSTS}")


def _listening(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _stop(pid: int, timeout: float = 30) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if _alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        wait_deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < wait_deadline:
            time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.slurm.cluster",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("action", choices=["up", "down", "status"])
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="cluster dir")
    parser.add_argument(
        "--rm", action="store_true", help="down: also delete the dir (logs, state, database)"
    )
    args = parser.parse_args(argv)
    cluster = Cluster(args.dir.resolve())
    try:
        if args.action == "up":
            cluster.up()
            print(f"export SLURM_CONF={cluster.conf}")
        elif args.action == "down":
            cluster.down(remove=args.rm)
            log("down")
        else:
            print(cluster.status())
            if cluster.is_up():
                print(f"export SLURM_CONF={cluster.conf}")
    except ClusterError as err:
        print(f"slurm-cluster: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
