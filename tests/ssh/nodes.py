"""Two "nodes" reached over real ssh, for the hostfile form's tier: an sshd of its own on
127.0.0.1 and pdsh, as DeepSpeed's runner reaches a hostfile's hosts.

What :meth:`SshNodes.up` does:

1. `apt-get install pdsh openssh-server` when either is missing (root; services kept from
   starting, as tests/slurm/cluster.py installs Slurm).
2. In its own dir: a host key and a client key, an sshd_config (a free port on 127.0.0.1, keys
   only, this user) and an ssh_config naming the two nodes, ``127.0.0.1`` and ``localhost``
   (distinct hosts to pdsh and DeepSpeed, both this machine: nothing added to /etc/hosts).
3. ``bin/ssh``, first on the jobs' PATH: the real ssh with ``-F`` that ssh_config, so pdsh and
   DeepSpeed's own ssh check use it without touching the user's ~/.ssh.
4. Starts sshd and waits until ``ssh 127.0.0.1 true`` answers.

The ranks on the "nodes" run under sshd with a login's environment, as on a real cluster: what
the job's environment held reaches them only through what DeepSpeed's runner exports.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from tests.slurm.cluster import ClusterError, _alive, _stop, free_port, log, run, wait_for

PACKAGES = ["pdsh", "openssh-server"]
HOSTS = ("127.0.0.1", "localhost")
SSHD = "/usr/sbin/sshd"


def ensure_installed(timeout: float = 600) -> None:
    """pdsh and sshd, apt-get installed when missing (needs root)."""
    if shutil.which("pdsh") and Path(SSHD).is_file():
        return
    if os.geteuid() != 0:
        raise ClusterError("pdsh or sshd is missing and installing them needs root (apt-get)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    policy = Path("/usr/sbin/policy-rc.d")  # keep the package's sshd service from starting
    made_policy = not policy.exists()
    if made_policy:
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
    try:
        run(["apt-get", "update", "-q"], timeout=timeout, env=env)
        run(
            ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES],
            timeout=timeout,
            env=env,
        )
    finally:
        if made_policy:
            policy.unlink()


@dataclass
class SshNodes:
    dir: Path

    @property
    def hostfile(self) -> Path:
        return self.dir / "hosts"

    @property
    def pid_file(self) -> Path:
        return self.dir / "sshd.pid"

    def env(self) -> dict[str, str]:
        """The job's environment: this one, with bin/ssh first on PATH."""
        return {**os.environ, "PATH": f"{self.dir / 'bin'}:{os.environ.get('PATH', '')}"}

    def up(self) -> SshNodes:
        ensure_installed()
        self.dir.mkdir(parents=True, exist_ok=True)
        d = self.dir
        for key in ("host_key", "client_key"):
            if not (d / key).is_file():
                run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / key)])
        shutil.copy(d / "client_key.pub", d / "authorized_keys")
        port = free_port()
        (d / "sshd_config").write_text(
            f"Port {port}\nListenAddress 127.0.0.1\nHostKey {d / 'host_key'}\n"
            f"AuthorizedKeysFile {d / 'authorized_keys'}\nPasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\nPermitRootLogin prohibit-password\n"
            f"StrictModes no\nUsePAM no\nPidFile {self.pid_file}\n"
        )
        user = subprocess.run(["id", "-un"], capture_output=True, text=True, check=True)
        (d / "ssh_config").write_text(
            f"Host {' '.join(HOSTS)}\n  HostName 127.0.0.1\n  Port {port}\n"
            f"  User {user.stdout.strip()}\n  IdentityFile {d / 'client_key'}\n"
            "  IdentitiesOnly yes\n  StrictHostKeyChecking no\n"
            f"  UserKnownHostsFile {d / 'known_hosts'}\n  BatchMode yes\n  LogLevel ERROR\n"
        )
        (d / "bin").mkdir(exist_ok=True)
        wrapper = d / "bin" / "ssh"
        wrapper.write_text(f'#!/bin/sh\nexec /usr/bin/ssh -F {d / "ssh_config"} "$@"\n')
        wrapper.chmod(0o755)
        self.hostfile.write_text("".join(f"{h} slots=1\n" for h in HOSTS))
        if os.geteuid() == 0:
            Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # its privilege separation dir
        run([SSHD, "-f", str(d / "sshd_config"), "-E", str(d / "sshd.log")])
        check = [str(wrapper), HOSTS[0], "true"]

        def answers() -> bool:
            return run(check, timeout=15, check=False, quiet=True).returncode == 0

        wait_for("sshd on 127.0.0.1", answers, timeout=30)
        log(f"sshd up on 127.0.0.1:{port} ({d})")
        return self

    def pid(self) -> int | None:
        try:
            pid = int(self.pid_file.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
        return pid if _alive(pid) else None

    def down(self) -> None:
        pid = self.pid()
        if pid is not None:
            _stop(pid)  # the listener; a session's own sshd ends with its connection


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """The pids still running after ``timeout`` seconds (zombies count as gone)."""
    deadline = time.monotonic() + timeout
    left = [p for p in pids if _alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = [p for p in left if _alive(p)]
    return left
