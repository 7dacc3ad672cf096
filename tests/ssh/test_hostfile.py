"""The hostfile form (launcher.hostfile) for real: train.py on this machine, its ranks started
over ssh by DeepSpeed's runner and pdsh on two nodes (127.0.0.1 and localhost through an sshd of
the tier's own, nodes.py), each rank under sshd with a login's environment.

    make test-ssh          # or: pytest -m ssh tests/ssh

Before this tier the form was checked only as a rendered command line, and on a real run its
ranks were out of the job's reach: SIGTERM, Ctrl-C and a closed terminal stopped nothing (the
stop went to train.py's descendants, and the ranks are sshd's), a second Ctrl-C left them
training, and they got none of the job's environment (threads, the ops' build dir, wandb's and
memtune's settings, the launcher to watch).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from memtune.config import to_run_config
from memtune.detached import LAUNCHER_BOOT_ENV, LAUNCHER_PID_ENV, pid_space
from memtune.launcher.extensions import extensions_root
from memtune.launcher.rank_signals import is_rank
from memtune.launcher.spawn import free_port, launch
from memtune.launcher.topology import check_nodes_reachable, resolve
from memtune.rundir import RunDir
from tests.conftest import FAST, ROOT, compose_cfg, wait_for_step
from tests.ssh.nodes import HOSTS, SshNodes

pytestmark = pytest.mark.ssh


def _job(nodes: SshNodes, run_dir: Path, *extra: str, per_node: int = 1) -> list[str]:
    hostfile = nodes.hostfile
    if per_node > 1:  # this job's own hostfile, beside its run dir
        hostfile = run_dir.parent / f"hosts-{per_node}"
        hostfile.write_text("".join(f"{h} slots={per_node}\n" for h in HOSTS))
    return [
        *FAST,
        f"launcher.num_ranks={2 * per_node}",
        "launcher.nnodes=2",
        f"launcher.hostfile={hostfile}",
        "launcher.master_addr=127.0.0.1",
        f"launcher.master_port={free_port()}",
        f"run_dir={run_dir}",
        *extra,
    ]


def _start(nodes: SshNodes, args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *args],
        cwd=ROOT,
        env=nodes.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # as from a terminal of its own: signals are the test's to send
    )


def _ranks_of(run_dir: Path) -> list[psutil.Process]:
    """This run's ranks on this machine (both nodes are this machine), by command line."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if is_rank(proc.info["cmdline"] or [], run_dir=str(run_dir)):
            found.append(proc)
    return found


def _running(procs: list[psutil.Process]) -> list[psutil.Process]:
    alive = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.Error:
            pass
    return alive


def _stopped_at(run_dir: Path) -> int:
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    return json.loads((run_dir / "checkpoints" / latest / "trainer_state.json").read_text())["step"]


def test_the_ranks_on_every_node_get_the_jobs_environment(
    ssh_nodes: SshNodes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the job sets for its ranks and the user's settings they read reach both nodes'
    ranks, which run under sshd; credentials do not (they would be on the ssh command line)."""
    monkeypatch.chdir(ROOT)  # DeepSpeed's runner puts its cwd on the nodes' PYTHONPATH
    monkeypatch.setenv("PATH", ssh_nodes.env()["PATH"])  # bin/ssh: the tier's ssh_config
    monkeypatch.setenv("WANDB_PROJECT", "memtune-ssh-tier")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("WANDB_API_KEY", "not-for-the-command-line")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = to_run_config(compose_cfg(_job(ssh_nodes, run_dir)))
    code = launch(cfg, run_dir, module="tests.ssh.env_probe", spec=resolve(cfg))
    assert code == 0
    expected = {
        # not train.py's machine's figure: each rank divides its own machine's cores
        # (rank.this_machine.threads_for_this_machine) unless launcher.omp_threads asks
        "OMP_NUM_THREADS": None,
        "TORCH_EXTENSIONS_DIR": str(extensions_root()),
        "TOKENIZERS_PARALLELISM": "false",
        "WANDB_PROJECT": "memtune-ssh-tier",
        "HF_HUB_OFFLINE": "1",
        LAUNCHER_PID_ENV: str(os.getpid()),
        LAUNCHER_BOOT_ENV: pid_space(),
    }
    for rank, host in enumerate(HOSTS):
        env = json.loads((run_dir / f"env-rank{rank}.json").read_text())
        assert env["SSH_CONNECTION"].startswith("127.0.0.1 "), host  # started over ssh
        assert {k: env.get(k) for k in expected} == expected, host
        assert "WANDB_API_KEY" not in env
    # launch.txt holds what a start by hand needs, the exported names among it
    record = RunDir(run_dir).launch_cmd(0).read_text()
    assert "MEMTUNE_EXPORT=" in record and "WANDB_PROJECT" in record
    assert "not-for-the-command-line" not in record


def test_sigterm_stops_every_nodes_ranks_and_the_same_command_continues(
    ssh_nodes: SshNodes, tmp_path: Path
) -> None:
    """SIGTERM to train.py: the ranks on both nodes, two a node, save a checkpoint at the next
    step boundary and exit 75; the same command continues from it to the end. (Before, the stop
    reached no rank: train.py re-sent it every 3 s while the ranks trained to max_steps.)"""
    run_dir = tmp_path / "run"
    args = _job(ssh_nodes, run_dir, "trainer.max_steps=16", "trainer.save_every=0", per_node=2)
    proc = _start(ssh_nodes, args)
    wait_for_step(run_dir, 1, proc)
    assert len(_ranks_of(run_dir)) == 4  # two a node: DeepSpeed's launcher starts both
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 75, out[-3000:]
    stopped_at = _stopped_at(run_dir)
    assert 1 <= stopped_at < 16, stopped_at
    assert "stopped by a signal" in out
    # each node's DeepSpeed launcher logs at the job's level (warning), as without ssh
    assert "WORLD INFO DICT" not in out and "spawned with command" not in out
    assert json.loads((run_dir / "exit.json").read_text()) == {"code": 75}
    assert not _running(_ranks_of(run_dir))

    again = _start(ssh_nodes, args)
    out, _ = again.communicate(timeout=300)
    assert again.returncode == 0, out[-3000:]
    assert f"(step {stopped_at})" in out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 16 and summary["world_size"] == 4


def test_kill_9_of_train_py_stops_the_ranks_with_a_checkpoint(
    ssh_nodes: SshNodes, tmp_path: Path
) -> None:
    """train.py killed (-9): the ranks on its machine see it gone and, through the step's
    collective, every node's ranks stop together with a checkpoint; rank 0 writes exit.json.
    Then a second Ctrl-C ends both nodes' ranks at once."""
    run_dir = tmp_path / "run"
    args = _job(ssh_nodes, run_dir, "trainer.max_steps=200", "trainer.save_every=0")
    proc = _start(ssh_nodes, args)
    wait_for_step(run_dir, 1, proc)
    ranks = _ranks_of(run_dir)
    assert len(ranks) == 2
    proc.kill()
    proc.communicate(timeout=60)
    deadline = time.monotonic() + 120
    while _running(ranks) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _running(ranks)
    stopped_at = _stopped_at(run_dir)
    said = (
        f"stopped by the end of its launcher (train.py, pid {proc.pid}) after step "
        f"{stopped_at}; checkpoint saved. Run the same command again to continue (exit code 75)."
    )
    assert json.loads((run_dir / "exit.json").read_text()) == {"code": 75, "error": said}

    proc = _start(ssh_nodes, args)  # resumes; then two Ctrl-Cs
    wait_for_step(run_dir, stopped_at + 1, proc)
    ranks = _ranks_of(run_dir)
    assert len(ranks) == 2
    proc.send_signal(signal.SIGINT)
    time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out[-3000:]
    deadline = time.monotonic() + 30
    while _running(ranks) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _running(ranks), "a second Ctrl-C left ranks training on the nodes"


def test_a_node_ssh_cannot_reach_is_named_before_anything_is_prepared(
    ssh_nodes: SshNodes, tmp_path: Path
) -> None:
    """A hostfile whose second host does not answer ssh: one line naming it and what ssh said,
    exit 2, before the plan, the data and the run dir (DeepSpeed's runner checked only the first
    host, after all that; pdsh then failed on the others). The tier's own nodes pass the same
    check."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"{HOSTS[0]} slots=1\nmemtune-no-such-node.invalid slots=1\n")
    run_dir = tmp_path / "run"
    args = [a for a in _job(ssh_nodes, run_dir) if not a.startswith("launcher.hostfile=")]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args, f"launcher.hostfile={hostfile}"],
        cwd=ROOT,
        env=ssh_nodes.env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    said = f"launcher.hostfile={hostfile}: not reachable over ssh without a password or a prompt: "
    assert f"memtune: config error: {said}memtune-no-such-node.invalid (" in proc.stderr
    assert f"{HOSTS[0]} (" not in proc.stderr  # the one that answers is not named
    assert "Traceback" not in proc.stderr and "tokenized" not in proc.stdout
    assert not (run_dir / "plan.json").exists()

    cfg = to_run_config(compose_cfg(_job(ssh_nodes, run_dir)))
    path = os.environ["PATH"]
    os.environ["PATH"] = ssh_nodes.env()["PATH"]
    try:
        check_nodes_reachable(resolve(cfg))  # both tier nodes answer: no error
    finally:
        os.environ["PATH"] = path
