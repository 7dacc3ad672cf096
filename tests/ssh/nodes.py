"""Two "nodes" reached over real ssh, for the hostfile form's tier: an sshd of its own on
127.0.0.1 and pdsh, as DeepSpeed's runner reaches a hostfile's hosts.

What :meth:`SshNodes.up` does:

1. `apt-get install pdsh openssh-server` when either is missing (root; services kept from
   starting, as tests/slurm/cluster.py installs Slurm).
2. In its own dir: a host key and a client key, an sshd_config per node (a free port on
   127.0.0.1, keys only) and an ssh_config naming the two nodes, ``127.0.0.1`` and ``localhost``
   (distinct hosts to pdsh and DeepSpeed: nothing added to /etc/hosts). The second node's sshd
   runs in a pid namespace of its own (``unshare --pid --mount-proc``, root): its ranks see
   only their node's processes, as on another machine, and train.py's pid means nothing there
   (the same boot id, as containers on one host have), so a signal must reach each node over
   ssh and only the first node's ranks watch train.py.
3. ``bin/ssh``, first on the jobs' PATH: the real ssh with ``-F`` that ssh_config, so pdsh and
   DeepSpeed's own ssh check use it without touching the user's ~/.ssh.
4. Starts both sshds and waits until each node answers ``ssh HOST true``.

The ranks on the "nodes" run under sshd with a login's environment, as on a real cluster: what
the job's environment held reaches them only through what DeepSpeed's runner exports.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from tests.slurm.cluster import ClusterError, apt_install, free_port, log, run, wait_for

PACKAGES = ["pdsh", "openssh-server"]
HOSTS = ("127.0.0.1", "localhost")
SSHD = "/usr/sbin/sshd"


def ensure_installed(timeout: float = 600) -> None:
    """pdsh and sshd, apt-get installed when missing (needs root)."""
    if shutil.which("pdsh") and Path(SSHD).is_file():
        return
    if os.geteuid() != 0:
        raise ClusterError("pdsh or sshd is missing and installing them needs root (apt-get)")
    apt_install(PACKAGES, timeout)


@dataclass
class SshNodes:
    dir: Path
    sshds: list[subprocess.Popen] = field(default_factory=list)

    @property
    def hostfile(self) -> Path:
        return self.dir / "hosts"

    def env(self) -> dict[str, str]:
        """The job's environment: this one, with bin/ssh first on PATH."""
        return {**os.environ, "PATH": f"{self.dir / 'bin'}:{os.environ.get('PATH', '')}"}

    def up(self) -> SshNodes:
        ensure_installed()
        if os.geteuid() != 0:
            raise ClusterError("the ssh tier needs root: its second node is a pid namespace")
        self.dir.mkdir(parents=True, exist_ok=True)
        d = self.dir
        for key in ("host_key", "client_key"):
            if not (d / key).is_file():
                run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / key)])
        shutil.copy(d / "client_key.pub", d / "authorized_keys")
        user = subprocess.run(["id", "-un"], capture_output=True, text=True, check=True)
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # its privilege separation dir
        ssh_config = ""
        for i, host in enumerate(HOSTS):
            port = free_port()
            config = d / f"sshd_config.{i}"
            config.write_text(
                f"Port {port}\nListenAddress 127.0.0.1\nHostKey {d / 'host_key'}\n"
                f"AuthorizedKeysFile {d / 'authorized_keys'}\nPasswordAuthentication no\n"
                "KbdInteractiveAuthentication no\nPermitRootLogin prohibit-password\n"
                f"StrictModes no\nUsePAM no\nPidFile none\n"
            )
            ssh_config += (
                f"Host {host}\n  HostName 127.0.0.1\n  Port {port}\n"
                f"  User {user.stdout.strip()}\n  IdentityFile {d / 'client_key'}\n"
                "  IdentitiesOnly yes\n  StrictHostKeyChecking no\n"
                f"  UserKnownHostsFile {d / 'known_hosts'}\n  BatchMode yes\n  LogLevel ERROR\n"
            )
            sshd = [SSHD, "-D", "-f", str(config), "-E", str(d / f"sshd.{i}.log")]
            if i:  # another node: its own pids (a /proc of its own), as another machine's
                sshd = ["unshare", "--pid", "--kill-child", "--mount-proc", *sshd]
            self.sshds.append(subprocess.Popen(sshd, stdin=subprocess.DEVNULL))
        (d / "ssh_config").write_text(ssh_config)
        (d / "bin").mkdir(exist_ok=True)
        wrapper = d / "bin" / "ssh"
        wrapper.write_text(f'#!/bin/sh\nexec /usr/bin/ssh -F {d / "ssh_config"} "$@"\n')
        wrapper.chmod(0o755)
        self.hostfile.write_text("".join(f"{h} slots=1\n" for h in HOSTS))
        for host in HOSTS:
            check = [str(wrapper), host, "true"]

            def answers(check: list[str] = check) -> bool:
                return run(check, timeout=15, check=False, quiet=True).returncode == 0

            wait_for(f"sshd of {host}", answers, timeout=30)
        log(f"two nodes up over ssh ({d}); {HOSTS[1]} in a pid namespace of its own")
        return self

    def down(self) -> None:
        for sshd in self.sshds:  # the listeners; a session's own sshd ends with its connection
            if sshd.poll() is None:
                sshd.terminate()
                try:
                    sshd.wait(10)
                except subprocess.TimeoutExpired:
                    sshd.kill()
                    sshd.wait()
