"""A per-node job whose part on one node fails after node 0 marked the run dir ready: the other
nodes stop their ranks at once and say which node failed and why (they waited for its ranks in
torch's rendezvous until torch's timeout, 10 minutes, and then printed a DistNetworkError
traceback that named no node). Before the ready mark, node 0's word is its launch.json
(tests/test_nodes.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from memtune.exit_codes import EXIT_PEER_LOST
from memtune.launcher.spawn import free_port
from memtune.launcher.topology import NodeSpec, announce_failed, failed_node
from memtune.rundir import RunDir
from tests.conftest import FAST, ROOT


def test_a_nodes_failure_mark_is_this_launchs_and_names_the_cause(tmp_path: Path) -> None:
    """Another node's mark of this launch id only (an earlier start's does not count, nor this
    node's own); a node that failed for a reason of its own before one whose ranks only lost
    their peers."""
    spec = NodeSpec("per-node", 3, 1, 0, "n0", 29500, launch_id="9.1")
    assert failed_node(tmp_path, spec) is None
    announce_failed(tmp_path, replace(spec, launch_id="9.0", node_rank=1), 1, "an earlier start")
    announce_failed(tmp_path, spec, 1, "this node's own")
    assert failed_node(tmp_path, spec) is None
    announce_failed(tmp_path, replace(spec, node_rank=1), EXIT_PEER_LOST, "lost its peers")
    assert failed_node(tmp_path, spec) == (1, "lost its peers")
    announce_failed(tmp_path, replace(spec, node_rank=2), 137, "rank 2 was killed by SIGKILL")
    assert failed_node(tmp_path, spec) == (2, "rank 2 was killed by SIGKILL")
    assert failed_node(tmp_path, replace(spec, node_rank=2)) == (0, "this node's own")
    assert RunDir(tmp_path).node_failed(2).name == "failed-node2.json"
    # a dir that never held a run: node 0 starts beside memtune's marks (a node refused before
    # node 0 laid the run out), not beside a user's file of the same name
    (tmp_path / "failed-node7.json").write_text('{"mine": 1}\n')
    assert RunDir(tmp_path).run_names_taken() == [tmp_path / "failed-node7.json"]
    # nor are they an earlier run's, set aside by resume=never: this start's may be there
    (tmp_path / "base.json").write_text("{}\n")
    assert tmp_path / "failed-node1.json" not in RunDir(tmp_path).earlier_run()
    assert tmp_path / "failed-node7.json" in RunDir(tmp_path).earlier_run()
    # a user's file under a mark's name is never written over (nor is node 0's beat's)
    with pytest.raises(FileExistsError, match="not memtune's, left as it is"):
        announce_failed(tmp_path, replace(spec, node_rank=7), 1, "a failure")
    assert (tmp_path / "failed-node7.json").read_text() == '{"mine": 1}\n'
    from memtune.launcher.topology import preparing

    beat = RunDir(tmp_path).node0_preparing
    beat.write_text("my notes\n")
    with preparing(tmp_path, spec, every_s=0.01):
        time.sleep(0.05)
    assert beat.read_text() == "my notes\n"


def test_the_other_nodes_wait_past_their_limit_while_node_0_still_prepares(
    tmp_path: Path,
) -> None:
    """Node 0 beats while it prepares (a dataset whose tokens or images take longer than the
    other nodes' wait): they wait on past their limit while the beat changes, take its ready
    mark, and give up once it stops changing (a node 0 that died). The beat is gone after."""
    import threading

    from memtune.launcher.topology import NodeZeroStopped, announce_ready, preparing, wait_ready

    node0 = NodeSpec("per-node", 2, 1, 0, "n0", 29500, launch_id="h1")
    node1 = replace(node0, node_rank=1)
    beat = RunDir(tmp_path).node0_preparing
    with preparing(tmp_path, node0, every_s=0.05):
        timer = threading.Timer(1.5, announce_ready, (tmp_path, node0))
        timer.start()
        start = time.monotonic()
        # a beat every 0.05 s, given up after 1 s without one (a loaded machine's fsyncs)
        assert wait_ready(tmp_path, node1, timeout_s=0.1, poll_s=0.02, stale_s=1.0) is None
        assert time.monotonic() - start >= 1.4  # past the 0.1 s limit: node 0 was beating
        timer.join()
        assert beat.exists()
    assert not beat.exists()
    (tmp_path / "launch.json").unlink()
    with preparing(tmp_path, node0, every_s=0.05):
        time.sleep(0.15)
    beat.write_text('{"launch_id": "h1", "beat": 7}\n')  # a beat that no longer changes
    start = time.monotonic()
    with pytest.raises(NodeZeroStopped, match="node 0 did not prepare"):
        wait_ready(tmp_path, node1, timeout_s=0.1, poll_s=0.02, stale_s=1.0)
    assert time.monotonic() - start < 5


def test_a_nodes_ranks_stop_when_another_node_failed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The launcher's wait (launcher.spawn) with a watch that finds another node's failure:
    this node's ranks (here processes that would wait a minute, as in torch's rendezvous) get
    the grace a rank's failure gives the others, are then killed, and the job's code is
    EXIT_PEER_LOST with one line naming the node; the ranks it killed are not its report."""
    from memtune.launcher import spawn

    monkeypatch.setattr(spawn, "NODE_WATCH_S", 0.2)
    monkeypatch.setattr(spawn, "RANK_FAILURE_GRACE_S", 0.3)
    told: list[tuple[int, str] | None] = [None, None, (0, "rank 0 (pid 7) exited with code 1")]
    cmd = [sys.executable, "-c", "import time; time.sleep(60)"]
    envs = [dict(os.environ), dict(os.environ)]
    ranks = spawn._Ranks(cmd, envs, "x", True, None, 2, watch=lambda: told.pop(0) or None)
    start = time.monotonic()
    try:
        assert ranks.wait() == EXIT_PEER_LOST
    finally:
        ranks.kill()
        ranks.restore_signals()
    assert time.monotonic() - start < 10 and ranks.ended()
    assert ranks.peer == (0, "rank 0 (pid 7) exited with code 1") and ranks.report is None
    assert capsys.readouterr().err == (
        "memtune: node 0 failed: rank 0 (pid 7) exited with code 1; stopping this node's "
        f"ranks (they cannot go on without it; exit code {EXIT_PEER_LOST})\n"
    )


@pytest.mark.faults
@pytest.mark.parametrize("failing", [0, 1], ids=["node0", "node1"])
def test_a_node_whose_rank_fails_at_start_stops_the_other_node(
    tmp_path: Path, failing: int
) -> None:
    """Two train.py processes on this machine play two nodes of one rank each; one node's rank
    raises as it starts (tests/raise_inject), before torch's rendezvous, after node 0 marked
    the run dir ready. That node says its rank's failure and exits with its code; the other
    node's rank, waiting for it in the rendezvous, is stopped within seconds, and its node
    says which node failed and why, exit code 5 (it waited until torch's 10-minute timeout;
    node 0, whose rank hosts the rendezvous, too)."""
    run_dir = tmp_path / "run"
    inject = str(ROOT / "tests" / "raise_inject")
    path = os.pathsep.join(p for p in (inject, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "MEMTUNE_TEST_RAISE_IN_RANK": str(failing)}
    nodes, out, other, waited = _two_nodes(tmp_path, run_dir, env, failing)
    assert nodes[failing].returncode == 1, out[-3000:]
    said = re.search(rf"memtune: (rank {failing} \(pid \d+\) exited with code 1)\n", out)
    assert said, out[-3000:]
    assert nodes[1 - failing].returncode == EXIT_PEER_LOST, other[-3000:]
    told = f"memtune: node {failing} failed: {said.group(1)}; stopping this node's ranks"
    assert told in other, other[-3000:]
    # the node's poll (2 s) and the ranks' grace (5 s); torch's rendezvous waits 600 s
    assert waited < 20, waited
    assert "Traceback" not in other, other[-3000:]  # its rank was killed while it waited
    mark = RunDir(run_dir).node_failed(failing).read_text()
    assert '"launch_id": "f1"' in mark and '"code": 1' in mark
    if failing == 1:  # node 0's exit.json names the node that stopped the job
        assert RunDir(run_dir).read_exit().error == f"node 1 failed: {said.group(1)}"
    assert not RunDir(run_dir).node_failed(1 - failing).exists()  # it only lost its peer


@pytest.mark.faults
def test_a_node_with_another_number_of_ranks_is_refused_and_stops_node_0(tmp_path: Path) -> None:
    """Node 1 sized for 2 ranks (Slurm's --gpus=3 over 2 nodes gives 2 and 1), node 0 for 1:
    node 1 refuses once it has read node 0's plan, naming both counts, and marks its failure;
    node 0's rank, waiting for a world of 2 in the rendezvous, is stopped within seconds (it
    met ranks numbered for a world of 4: duplicates, missing ones, a hang)."""
    run_dir = tmp_path / "run"
    extra = {1: ["launcher.num_ranks=4"]}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MEMTUNE_RANKS"))}
    nodes, out, other, waited = _two_nodes(tmp_path, run_dir, env, 1, extra)
    assert nodes[1].returncode == 2, out[-3000:]
    said = (
        "node 1 would start 2 rank(s) and node 0 planned 1 per node (2 ranks on 2 nodes): every "
        "node of a job runs as many ranks (the same launcher.num_ranks=2 on every node)"
    )
    assert f"memtune: config error: {said}" in out, out[-3000:]
    assert nodes[0].returncode == EXIT_PEER_LOST, other[-3000:]
    assert f"memtune: node 1 failed: config error: {said}" in other, other[-3000:]
    assert waited < 20, waited


@pytest.mark.faults
def test_node_0_starts_no_rank_when_another_node_failed_while_it_prepared(
    tmp_path: Path,
) -> None:
    """Node 1 marked its failure (its preflight, its own refusal) while node 0 planned and
    tokenized: node 0 starts no rank (they would wait for node 1's in torch's rendezvous, to
    be stopped seconds later by its own watch), says why, exit 5, and its ready mark tells
    any node still waiting."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    spec = NodeSpec("per-node", 2, 1, 1, "127.0.0.1", free_port(), launch_id="w1")
    announce_failed(run_dir, spec, 2, "preflight: 2 GPUs needed, 1 visible")
    args = [
        *FAST,
        "launcher.num_ranks=2",
        "launcher.nnodes=2",
        "launcher.master_addr=127.0.0.1",
        f"launcher.master_port={spec.master_port}",
        "launcher.launch_id=w1",
        f"run_dir={run_dir}",
        "launcher.node_rank=0",
    ]
    out = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    said = "node 1 failed: preflight: 2 GPUs needed, 1 visible"
    assert out.returncode == EXIT_PEER_LOST, out.stderr[-3000:]
    assert f"memtune: error: {said}; node 0 starts no rank\n" in out.stderr, out.stderr[-3000:]
    assert "train: step" not in out.stdout + out.stderr
    assert f'"error": "{said}"' in RunDir(run_dir).nodes_ready.read_text()


def _two_nodes(
    tmp_path: Path,
    run_dir: Path,
    env: dict[str, str],
    failing: int,
    extra: dict[int, list[str]] | None = None,
) -> tuple[list[subprocess.Popen], str, str, float]:
    """Two train.py processes on this machine as nodes 0 and 1 of one rank each (``extra``:
    a node's own overrides); node ``failing``'s output, then the other's and how long it took
    after the first ended."""
    args = [
        *FAST,
        "trainer.max_steps=4",
        "launcher.num_ranks=2",
        "launcher.nnodes=2",
        "launcher.master_addr=127.0.0.1",
        f"launcher.master_port={free_port()}",
        "launcher.launch_id=f1",
        f"run_dir={run_dir}",
    ]
    extra = extra or {}
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                str(ROOT / "train.py"),
                *args,
                f"launcher.node_rank={k}",
                *extra.get(k, []),
            ],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for k in (1, 0)  # node 1 first: it waits for node 0's mark
    ][::-1]
    try:
        out = nodes[failing].communicate(timeout=120)[0]
        ended = time.monotonic()
        other = nodes[1 - failing].communicate(timeout=60)[0]
        waited = time.monotonic() - ended
    finally:
        for proc in nodes:  # a node still waiting: its ranks go with it (launcher.spawn)
            proc.kill()
            proc.wait()
    return nodes, out, other, waited
