"""Launching beyond one box: rendered commands, Slurm's environment, the GPU preflight's logic,
and a real two-node job on this machine (two train.py processes, the per-node form)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from memtune.config import ConfigError, RunConfig, to_run_config
from memtune.launcher.preflight import (
    all_reduce_check,
    all_reduced,
    measured_bus_gb_s,
    nccl_env_decision,
)
from memtune.launcher.spawn import free_port, rank_command
from memtune.launcher.topology import (
    NodeSpec,
    announce_stopped,
    check_hostfile,
    check_sweep_point_nodes,
    first_host,
    resolve,
    size_from_allocation,
    wait_ready,
    wait_stopped,
)
from tests.conftest import FAST, ROOT, compose_cfg, run_train_py

DS = [sys.executable, "-m", "memtune.launcher.ds_runner"]
TAIL = ["--no_local_rank", "--log_level", "warning", "--module", "memtune.worker", "/runs/x"]


def _cfg(*overrides: str) -> RunConfig:
    return to_run_config(compose_cfg(list(overrides)))


def test_one_box_of_four_gpus() -> None:
    cfg = _cfg("experiment=qwen2.5-7b-4x4090-lora", "launcher.num_ranks=4")
    cmd, extra = rank_command(cfg, Path("/runs/x"), 12345, spec=resolve(cfg, env={}), env={})
    assert cmd == [sys.executable, "-u", "-m", "memtune.worker", "/runs/x"]
    assert extra["CUDA_VISIBLE_DEVICES"] == "0,1,2,3" and extra["WORLD_SIZE"] == "4"
    assert extra["MASTER_ADDR"] == "127.0.0.1" and extra["MASTER_PORT"] == "12345"


def test_one_rank_is_a_plain_process() -> None:
    cfg = _cfg("launcher.num_ranks=1")
    cmd, extra = rank_command(cfg, Path("/runs/x"), 12345, spec=resolve(cfg, env={}))
    assert cmd == [sys.executable, "-u", "-m", "memtune.worker", "/runs/x"]
    assert extra["WORLD_SIZE"] == "1" and extra["MASTER_PORT"] == "12345"


def test_hostfile_form(tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# two boxes\nbox-a slots=4\nbox-b slots=4  # second\n")
    cfg = _cfg(
        "launcher.num_ranks=8",
        "launcher.nnodes=2",
        f"launcher.hostfile={hostfile}",
        "launcher.master_addr=10.0.0.1",
    )
    spec = resolve(cfg, env={})
    cmd, _ = rank_command(cfg, Path("/runs/x"), spec.master_port or 0, spec=spec)
    assert cmd == [
        *DS,
        *("--hostfile", str(hostfile), "--num_nodes", "2", "--master_addr", "10.0.0.1"),
        *("--master_port", "29500", "--num_gpus", "4"),
        *TAIL,
    ]


def test_a_hostfile_job_is_refused_what_it_cannot_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hostfile on one node (launcher.nnodes left at 1): DeepSpeed's runner started the ranks
    here after an ssh check of this machine, a RuntimeError traceback without passwordless ssh
    to itself. And a machine without pdsh, which starts the other nodes' ranks: said before
    anything is prepared (topology.check_nodes_reachable; the ssh answers themselves are the
    ssh tier's, tests/ssh)."""
    from memtune.launcher.topology import check_nodes_reachable

    hostfile = tmp_path / "hosts"
    hostfile.write_text("box-a slots=2\nbox-b slots=2\n")
    with pytest.raises(ConfigError, match=r"with launcher.nnodes=1: one machine needs no host"):
        resolve(_cfg("launcher.num_ranks=2", f"launcher.hostfile={hostfile}"), env={})
    cfg = _cfg("launcher.num_ranks=4", "launcher.nnodes=2", f"launcher.hostfile={hostfile}")
    spec = resolve(cfg, env={})
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))  # a machine without pdsh (nor ssh)
    with pytest.raises(ConfigError, match=r": pdsh is not installed on this machine; DeepSpeed"):
        check_nodes_reachable(spec)
    check_nodes_reachable(resolve(_cfg("launcher.num_ranks=2"), env={}))  # local: nothing


def test_bad_hostfiles_are_named_with_their_line(tmp_path: Path) -> None:
    bad = tmp_path / "hosts"
    bad.write_text("box-a slots=4\nbox-b 4\n")
    with pytest.raises(ConfigError, match=r"hosts:2: expected 'HOST slots=N', got 'box-b 4'"):
        check_hostfile(bad, 2, 4)
    bad.write_text("box-a slots=4\nbox-b slots=2\n")
    with pytest.raises(ConfigError, match=r"too few slots on box-b \(2\)"):
        check_hostfile(bad, 2, 4)
    with pytest.raises(ConfigError, match="no such file"):
        check_hostfile(tmp_path / "missing", 1, 1)
    # DeepSpeed's runner raised ValueError on it from its own process, after the plan.
    bad.write_text("box-a slots=4\n# b\nbox-a slots=4  # again\n")
    with pytest.raises(ConfigError, match=r"hosts:3: box-a is listed again \(line 1\): one line"):
        check_hostfile(bad, 2, 4)


SLURM_NODE1 = {
    "SLURM_JOB_ID": "4242",
    "SLURM_NODEID": "1",
    "SLURM_NNODES": "2",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_RESTART_COUNT": "1",
}


def test_slurm_environment_maps_to_this_nodes_place() -> None:
    cfg = _cfg("launcher.num_ranks=8", "launcher.nnodes=2", "run_dir=/shared/run")
    spec = resolve(cfg, env=SLURM_NODE1)
    assert (spec.form, spec.nnodes, spec.ranks_per_node, spec.node_rank) == ("per-node", 2, 4, 1)
    assert spec.master_addr == "gpu07"  # the sbatch exports MASTER_ADDR; this is the fallback
    assert spec.master_port == 20000 + 4242
    assert spec.launch_id == "4242.1"  # a requeued job is a new start of the same run dir
    # a second srun in the same allocation is a new start too (its step id)
    assert resolve(cfg, env={**SLURM_NODE1, "SLURM_STEP_ID": "3"}).launch_id == "4242.3.1"
    # node 1 starts its 4 ranks itself, in a world of 8 that meets at node 0 (RANK 4..7 and
    # LOCAL_RANK 0..3 added per rank by launch), on the cards Slurm gave it
    visible = {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    cmd, env = rank_command(cfg, Path("/runs/x"), spec.master_port, spec=spec, env=visible)
    assert cmd == [sys.executable, "-u", "-m", "memtune.worker", "/runs/x"]
    assert env == {
        "MASTER_ADDR": "gpu07",
        "MASTER_PORT": "24242",
        "WORLD_SIZE": "8",
        "LOCAL_WORLD_SIZE": "4",
        "LOCAL_SIZE": "4",
        "CROSS_RANK": "1",
        "CROSS_SIZE": "2",
        "CUDA_VISIBLE_DEVICES": "0,1,2,3",
    }
    explicit = resolve(cfg, env={**SLURM_NODE1, "MASTER_ADDR": "10.1.1.7", "MASTER_PORT": "555"})
    assert (explicit.master_addr, explicit.master_port) == ("10.1.1.7", 555)


STEP = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_NODES": "2"}


@pytest.mark.parametrize(
    ("env", "given", "want"),
    [
        # One task per node of a 2-node step, 4 GPUs on each (as Slurm writes --gpus-per-node).
        ({**STEP, "SLURM_GPUS_PER_NODE": "a100:4"}, [], (2, 8)),
        ({**STEP, "SLURM_GPUS_ON_NODE": "4", "MEMTUNE_RANKS_PER_NODE": "1"}, [], (2, 2)),
        # A CPU node with no count: as many per node as the config runs (launcher.num_ranks=3).
        (STEP, [], (2, 6)),
        # Given on the command line: kept; the rest still follows the allocation.
        ({**STEP, "SLURM_GPUS_ON_NODE": "4"}, ["launcher.num_ranks=2"], (2, 2)),
        ({**STEP, "SLURM_GPUS_ON_NODE": "4"}, ["launcher.nnodes=2"], (2, 8)),
        # Not a job step (salloc's shell, a login node): the config as it is.
        ({"SLURM_JOB_ID": "77", "SLURM_NNODES": "2", "SLURM_GPUS_ON_NODE": "4"}, [], (1, 3)),
        ({}, [], (1, 3)),
    ],
    ids=[
        "gpus-per-node",
        "ranks-env-first",
        "cpu-node",
        "ranks-given",
        "nodes-given",
        "salloc-shell",
        "no-slurm",
    ],
)
def test_a_slurm_job_is_sized_from_its_allocation(
    env: dict[str, str], given: list[str], want: tuple[int, int]
) -> None:
    launcher = compose_cfg(["launcher.num_ranks=3", *given]).launcher
    made = size_from_allocation(launcher, given, env)
    assert (launcher.nnodes, launcher.num_ranks) == want
    assert len(made) == (0 if want == (1, 3) else 2 - len(given))


def test_allocation_sizing_can_be_off_and_names_a_bad_count() -> None:
    env = {**STEP, "SLURM_GPUS_ON_NODE": "4"}
    launcher = compose_cfg(["launcher.from_allocation=false", "launcher.num_ranks=3"]).launcher
    assert size_from_allocation(launcher, [], env) == []
    assert (launcher.nnodes, launcher.num_ranks) == (1, 3)
    with pytest.raises(ConfigError, match=r"\$MEMTUNE_RANKS_PER_NODE='two'"):
        size_from_allocation(compose_cfg([]).launcher, [], {**env, "MEMTUNE_RANKS_PER_NODE": "two"})


def test_a_node_count_the_slurm_step_does_not_have_is_refused() -> None:
    """launcher.nnodes=3 on a 2-node train.sbatch job was kept ("given on the command line"):
    the ranks waited for a third node until torch's 30-minute timeout."""
    env = {**STEP, "SLURM_GPUS_ON_NODE": "4"}
    for nnodes in (3, 1):
        launcher = compose_cfg([f"launcher.nnodes={nnodes}", "launcher.num_ranks=4"]).launcher
        with pytest.raises(ConfigError) as err:
            size_from_allocation(launcher, [f"launcher.nnodes={nnodes}"], env)
        assert str(err.value) == (
            f"launcher.nnodes={nnodes}, but this Slurm job step runs on 2 node(s), one train.py "
            "each: leave launcher.nnodes out (it follows the allocation) or submit with "
            f"--nodes={nnodes}"
        )
    # A plan (from an interactive step, of the job to submit) and the hostfile form (one
    # train.py reaching the other hosts over ssh) keep the value given
    launcher = compose_cfg(["launcher.nnodes=3", "launcher.num_ranks=6"]).launcher
    made = size_from_allocation(launcher, ["launcher.nnodes=3"], env, launching=False)
    assert (launcher.nnodes, launcher.num_ranks) == (3, 12) and made == ["launcher.num_ranks=12"]
    launcher = compose_cfg(["launcher.nnodes=3", "launcher.hostfile=/h"]).launcher
    size_from_allocation(launcher, ["launcher.nnodes=3"], env)
    assert launcher.nnodes == 3


def test_what_the_environment_gives_the_nodes_is_checked() -> None:
    """$MASTER_PORT=0 gave each node a free port of its own (nodes that never meet), 70000
    reached DeepSpeed; $SLURM_JOB_ID=abc was int()'s ValueError; a node rank out of range from
    $SLURM_NODEID was called launcher.node_rank; launcher.node_rank with one node or a hostfile
    was dropped without a word."""
    cfg = _cfg("launcher.num_ranks=8", "launcher.nnodes=2", "run_dir=/shared/run")
    for port in ("0", "70000"):
        with pytest.raises(ConfigError, match=rf"^\$MASTER_PORT='{port}' is not a port: choose"):
            resolve(cfg, env={**SLURM_NODE1, "MASTER_PORT": port})
    with pytest.raises(ConfigError, match=r"^\$SLURM_JOB_ID='abc' is not an integer$"):
        resolve(cfg, env={**SLURM_NODE1, "SLURM_JOB_ID": "abc"})
    with pytest.raises(
        ConfigError, match=r"^\$SLURM_NODEID=2 is not in 0..1 \(launcher.nnodes=2\)"
    ):
        resolve(cfg, env={**SLURM_NODE1, "SLURM_NODEID": "2"})
    for extra in ("launcher.num_ranks=2", "launcher.hostfile=hosts"):
        with pytest.raises(ConfigError, match=r"^launcher.node_rank=1 with launcher.(nnodes=1|h)"):
            resolve(_cfg("launcher.node_rank=1", extra), env={})


@pytest.mark.parametrize(
    ("env", "cwd", "args", "said"),
    [
        ({}, "root", ["x=1"], "train.sbatch is a Slurm batch script: submit it with sbatch"),
        ({"SLURM_JOB_ID": "7"}, "tmp", ["x=1"], "which has no train.py or no "),
        ({"SLURM_JOB_ID": "7"}, "root", ["-m", "peft.r=4,8"], "a sweep is one Slurm job per"),
    ],
)
def test_train_sbatch_refuses_what_would_fail_later(env, cwd, args, said, tmp_path) -> None:
    """Run by bash outside Slurm, submitted from another folder, or given a sweep:
    train.sbatch said "SLURM_JOB_ID: unbound variable", srun's execve error on
    .venv/bin/python, or train.py's refusal of the run_dir the script itself set."""
    import os

    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    where = ROOT if cwd == "root" else tmp_path
    proc = subprocess.run(
        ["bash", str(ROOT / "launch" / "slurm" / "train.sbatch"), *args],
        cwd=where,
        env={**base, **env, "SLURM_SUBMIT_DIR": str(where), "MEMTUNE_PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2, proc.stderr
    assert said in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stdout == ""  # nothing started


# Stand-ins for Slurm's two commands, for train.sbatch's own logic (the Slurm tier runs the real
# ones): srun records its arguments and, as the job's step would, ends with $SRUN_CODE, after
# sending $SRUN_SIGNAL to the batch script (what Slurm does on scancel: TERM to every process).
_SRUN = """#!/bin/bash
trap '' USR2
printf '%s\\n' "$@" >"$STANDIN/srun.args"
if [[ -n ${SRUN_SIGNAL:-} ]]; then
  kill -"$SRUN_SIGNAL" "$PPID"
  [[ ${SRUN_SLEEP:-0.3} == 0 ]] || sleep "${SRUN_SLEEP:-0.3}"
fi
exit "${SRUN_CODE:-0}"
"""
_SCONTROL = """#!/bin/bash
echo "$*" >>"$STANDIN/scontrol.calls"
[[ $1 == show ]] && echo node-a && exit 0
[[ $1 == requeue && -n ${REQUEUE_REFUSED:-} ]] && echo "scontrol: error: disabled" >&2 && exit 1
exit 0
"""


def _train_sbatch(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    import os

    standin = tmp_path / "standin"
    standin.mkdir(exist_ok=True)
    for name, text in (("srun", _SRUN), ("scontrol", _SCONTROL)):
        (standin / name).write_text(text)
        (standin / name).chmod(0o755)
    (standin / "scontrol.calls").unlink(missing_ok=True)
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = subprocess.run(
        ["bash", str(ROOT / "launch" / "slurm" / "train.sbatch"), "logger=none"],
        cwd=ROOT,
        env={
            **base,
            "PATH": f"{standin}:{base['PATH']}",
            "STANDIN": str(standin),
            "SLURM_JOB_ID": "7",
            "SLURM_JOB_NODELIST": "node-a",
            "SLURM_SUBMIT_DIR": str(ROOT),
            "MEMTUNE_PYTHON": sys.executable,
            **env,
        },
        capture_output=True,
        text=True,
        timeout=30,
    )
    return proc, standin


def test_train_sbatch_requeues_only_a_stop_it_can_requeue(tmp_path: Path) -> None:
    """After a checkpoint (exit 75): a job submitted with --no-requeue (scontrol requeue
    refused) ended COMPLETED, exit 0, though it had stopped half way; `scancel JOBID` (TERM
    to the script and every task) was requeued, and ran again: a job could not be cancelled."""
    proc, standin = _train_sbatch(tmp_path, SRUN_CODE="75", REQUEUE_REFUSED="1")
    assert proc.returncode == 75, proc.stderr
    assert (standin / "scontrol.calls").read_text().splitlines()[-1] == "requeue 7"
    assert "memtune: scontrol requeue 7 failed (a job submitted with --no-requeue?)" in proc.stderr
    # pasted back as printed, quoted for the shell and Hydra (a job name may hold = or ,)
    assert "and \"run_dir='outputs/slurm/memtune-7'\" continue it" in proc.stderr

    # USR2 arriving as srun exits: bash lost srun's status in the interrupted `wait` and the
    # script exited 140 (FAILED) in most tries instead of requeueing
    for _ in range(4):
        proc, standin = _train_sbatch(tmp_path, SRUN_CODE="75", SRUN_SIGNAL="USR2", SRUN_SLEEP="0")
        assert proc.returncode == 0, proc.stderr
        assert (standin / "scontrol.calls").read_text().splitlines()[-1] == "requeue 7"

    proc, standin = _train_sbatch(tmp_path, SRUN_CODE="75", SRUN_SIGNAL="TERM")
    assert proc.returncode == 75, proc.stderr
    assert "requeue 7" not in (standin / "scontrol.calls").read_text()
    assert "Slurm ended job 7 (scancel, or its time limit): not requeued" in proc.stderr

    proc, standin = _train_sbatch(tmp_path, SRUN_CODE="75", SRUN_SIGNAL="USR2")
    assert proc.returncode == 0, proc.stderr  # the preemption's USR2: requeued
    assert (standin / "scontrol.calls").read_text().splitlines()[-1] == "requeue 7"
    assert "memtune: checkpoint saved; requeueing job 7" in proc.stdout


def test_train_sbatch_run_dir_from_any_job_name(tmp_path: Path) -> None:
    """--job-name=r=8,lr=1e-4 made train.py refuse the run_dir the script had set ("gives
    several values, a sweep"); a quote or [ ] stopped it with Hydra's grammar error."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from memtune.config.command_line import composition_problem

    for name, run_dir in (
        ("r=8,lr=1e-4", "outputs/slurm/r=8,lr=1e-4-7"),
        ("it's [a] ${x} \\", "outputs/slurm/it's [a] _{x} _-7"),
        ("memtune", "outputs/slurm/memtune-7"),
    ):
        proc, standin = _train_sbatch(tmp_path, SLURM_JOB_NAME=name)
        assert proc.returncode == 0, proc.stderr
        argv = (standin / "srun.args").read_text().splitlines()
        given = [a for a in argv if a.startswith("run_dir=")]
        assert len(given) == 1 and composition_problem(argv[4:]) is None, argv
        assert OverridesParser.create().parse_override(given[0]).value() == run_dir


def test_a_sweep_point_on_several_nodes_is_refused_by_name() -> None:
    check_sweep_point_nodes({**STEP, "SLURM_STEP_NUM_NODES": "1"})
    check_sweep_point_nodes({})
    with pytest.raises(ConfigError, match=r"hydra.launcher.nodes=2: a sweep point runs on one"):
        check_sweep_point_nodes(STEP)


def test_node_0_reports_a_stop_after_the_other_nodes(tmp_path: Path) -> None:
    """Nodes 1.. mark their stop for this launch id; node 0 waits for every mark (a mark of an
    earlier start does not count) and names the nodes that never marked."""
    spec = NodeSpec("per-node", 3, 1, 0, "n0", 29500, launch_id="9.1")
    announce_stopped(tmp_path, replace(spec, node_rank=1))
    announce_stopped(tmp_path, replace(spec, node_rank=2, launch_id="9.0"))  # a stale start
    assert wait_stopped(tmp_path, spec, timeout_s=0.2, poll_s=0.05) == [2]
    announce_stopped(tmp_path, replace(spec, node_rank=2))
    assert wait_stopped(tmp_path, spec, timeout_s=0.2, poll_s=0.05) == []


def test_per_node_form_needs_what_the_nodes_must_agree_on() -> None:
    base = ["launcher.num_ranks=2", "launcher.nnodes=2"]
    with pytest.raises(ConfigError, match=r"launcher\.master_addr"):
        resolve(_cfg(*base, "run_dir=/r"), env={})
    with pytest.raises(ConfigError, match="launch id"):
        resolve(_cfg(*base, "run_dir=/r", "launcher.master_addr=h"), env={})
    with pytest.raises(ConfigError, match="run_dir"):
        resolve(_cfg(*base, "launcher.master_addr=h", "launcher.launch_id=1"), env={})
    with pytest.raises(ConfigError, match=r"node_rank=2 is not in 0..1"):
        resolve(_cfg(*base, "run_dir=/r", "launcher.node_rank=2"), env={"MASTER_ADDR": "h"})
    with pytest.raises(ConfigError, match=r"not a multiple of launcher.nnodes=2"):
        from memtune.config import validate

        validate(_cfg("launcher.num_ranks=3", "launcher.nnodes=2", "trainer.global_batch_size=6"))


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [
        ("gpu[07-09,12],cpu1", "gpu07"),
        ("node3", "node3"),
        ("a,b", "a"),
        ("x[1,3]", "x1"),
        ("rack[1-2]-n[01-04],cpu1", "rack1-n01"),
        ("a[1-2]-b[3-4]", "a1-b3"),
        ("gpu-[3,5]-x", "gpu-3-x"),
    ],
)
def test_first_host_of_a_slurm_node_list(nodelist: str, first: str) -> None:
    assert first_host(nodelist) == first


def _gpus(name: str, n: int) -> dict:
    return {"gpus": [{"index": i, "name": name, "total_gib": 23.99, "sm": "89"} for i in range(n)]}


PASSED = {"copy": {"ok": True}, "all_reduce_p2p": {"ok": True}}
FAILED = {"copy": {"ok": True}, "all_reduce_p2p": {"ok": False, "error": "timeout"}}


def test_preflight_turns_p2p_off_on_4090s_unless_it_is_proven() -> None:
    d = nccl_env_decision(_gpus("NVIDIA GeForce RTX 4090 D", 4), FAILED, nnodes=1, env={})
    assert d["env"] == {"NCCL_P2P_DISABLE": "1", "NCCL_IB_DISABLE": "1"}
    assert any("RTX 40-series" in r for r in d["reasons"])
    d = nccl_env_decision(
        _gpus("NVIDIA GeForce RTX 4090 D", 4), {}, nnodes=1, env={}
    )  # no checks ran
    assert d["env"]["NCCL_P2P_DISABLE"] == "1"
    d = nccl_env_decision(_gpus("NVIDIA GeForce RTX 4090", 4), PASSED, nnodes=1, env={})
    assert d["env"] == {"NCCL_IB_DISABLE": "1"}


def test_preflight_elsewhere() -> None:
    h200 = _gpus("NVIDIA H200", 8)
    assert nccl_env_decision(h200, PASSED, nnodes=2, env={})["env"] == {}  # IB may be the fabric
    assert nccl_env_decision(h200, FAILED, nnodes=2, env={})["env"] == {"NCCL_P2P_DISABLE": "1"}
    assert nccl_env_decision(_gpus("NVIDIA H200", 1), {}, nnodes=1, env={})["env"] == {
        "NCCL_IB_DISABLE": "1"
    }
    # What the user set is theirs.
    mine = nccl_env_decision(_gpus("RTX 4090", 4), FAILED, nnodes=1, env={"NCCL_P2P_DISABLE": "0"})
    assert "NCCL_P2P_DISABLE" not in mine["env"]
    assert "NCCL_P2P_DISABLE=0: set by you, kept" in mine["reasons"]


def test_the_preflight_all_reduce_measures_bus_bandwidth_on_gloo() -> None:
    """The GPU preflight's all-reduce (NCCL there) run on 2 CPU processes with gloo: correct
    sums and a bus bandwidth; the one the ranks will see is picked by the P2P decision."""
    check = all_reduce_check(2, {}, timeout_s=120, backend="gloo")
    assert check["ok"] and check["bad_ranks"] == []
    # Every element is checked: one corrupted chunk past the first is a wrong sum.
    summed = torch.full((1 << 12,), 3.0)
    assert all_reduced(summed, 2) and not all_reduced(summed, 3)
    summed[2048:2050] = 0.0
    assert not all_reduced(summed, 2)
    # 2(n-1)/n × 64 MiB per all-reduce over its time, as NCCL's busbw.
    assert check["bus_gb_s"] == pytest.approx(
        2 * 0.5 * (1 << 24) * 4 / check["seconds"] / 1e9, rel=0.01
    )
    assert 0.05 < check["bus_gb_s"] < 500
    p2p = {"ok": True, "bus_gb_s": 20.0}
    no_p2p = {"ok": True, "bus_gb_s": 9.5}
    checks = {"all_reduce_p2p": p2p, "all_reduce_no_p2p": no_p2p}
    assert measured_bus_gb_s({"checks": checks, "env": {"NCCL_P2P_DISABLE": "1"}}) == 9.5
    assert measured_bus_gb_s({"checks": checks, "env": {}}) == 20.0
    assert measured_bus_gb_s({"checks": {}, "env": {}}) is None
    # On several nodes the job's all-reduce crosses their network: node 0's GPUs' figure is
    # not its link (plan.link_gb_s is kept).
    assert measured_bus_gb_s({"checks": checks, "env": {}}, nnodes=2) is None


def test_a_per_node_preprocess_only_leaves_nodes_1_nothing_to_wait_for(tmp_path: Path) -> None:
    """Node 0 tokenizes and marks no launch ready: node 1 waited an hour for that mark."""
    args = ["launcher.nnodes=2", "launcher.node_rank=1", "launcher.master_addr=127.0.0.1"]
    args += ["launcher.num_ranks=2", "launcher.launch_id=p1", "preprocess_only=true"]
    args += [f"run_dir={tmp_path / 'run'}"]
    out = run_train_py(args, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "memtune: preprocess_only: node 1 has nothing to do" in out.stdout
    assert "waiting for node 0" not in out.stdout


def test_a_node_whose_settings_fail_writes_no_record_of_the_run(tmp_path: Path) -> None:
    """exit.json and .hydra/ are node 0's: node 1, stopped by its settings before its place in
    the job was resolved, wrote both (its error over node 0's record of the run)."""
    args = ["launcher.nnodes=2", "launcher.node_rank=1", "launcher.master_addr=127.0.0.1"]
    args += ["launcher.num_ranks=2", "launcher.launch_id=c1", "trainer.lr=-1"]
    out = run_train_py([*args, f"run_dir={tmp_path / 'run'}", "logger=none"], cwd=ROOT)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr == "memtune: config error: trainer.lr must be > 0 (got -1.0)\n"
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["job-node1.lock"]


def _ignored_signals(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(ln for ln in status.splitlines() if ln.startswith("SigIgn:")).split()[1], 16)


def test_a_rank_ignores_sigterm_from_its_first_moment(tmp_path: Path) -> None:
    """A rank that DeepSpeed's launcher starts (the multi-node forms) got SIGTERM's default
    until its stop handler was in place, seconds of imports later: one still loading died of
    Slurm's TERM (exit 143) instead of stopping with a checkpoint (75). The rank's entry point
    ignores it first thing, before torch loads, whoever starts it."""
    import signal
    import time

    cmd = [sys.executable, "-m", "memtune.worker", str(tmp_path / "run")]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not _ignored_signals(proc.pid) & (1 << (signal.SIGTERM - 1)):
            assert proc.poll() is None and time.monotonic() < deadline, "TERM never ignored"
            time.sleep(0.005)
        assert "torch" not in Path(f"/proc/{proc.pid}/maps").read_text()  # before the imports
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        assert proc.poll() is None  # still loading: not killed by it
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_preflight_stops_clearly_without_gpus() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "memtune.cli", "preflight", "--gpus", "4"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "4 GPUs needed, 0 visible" in out.stderr


def test_a_preflight_record_that_cannot_be_written_is_one_line(tmp_path, capsys) -> None:
    """A folder at RUN/preflight.json: the checks' record was written in place, a traceback
    after they passed (the job said only that the GPU checks failed); the user's folder stays."""
    from memtune.launcher.preflight import write_record

    (tmp_path / "preflight.json").mkdir()
    (tmp_path / "preflight.json" / "mine.txt").write_text("mine\n")
    with pytest.raises(SystemExit) as stopped:
        write_record(tmp_path / "preflight.json", {"gpus": 4})
    assert stopped.value.code == 2
    assert capsys.readouterr().err == (
        f"memtune preflight: cannot write {tmp_path / 'preflight.json'} "
        "(IsADirectoryError: Is a directory)\n"
    )
    assert [p.name for p in tmp_path.rglob("*")] == ["preflight.json", "mine.txt"]
    write_record(tmp_path / "preflight-node1.json", {"gpus": 4})
    assert json.loads((tmp_path / "preflight-node1.json").read_text()) == {"gpus": 4}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU refusal")
def test_a_gpu_experiment_stops_before_tokenizing_on_a_machine_without_gpus(tmp_path) -> None:
    run_dir = tmp_path / "run"
    args = ["experiment=qwen2.5-7b-4x4090-qlora", "data=demo", f"run_dir={run_dir}"]
    out = run_train_py(args, cwd=ROOT, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "4 GPUs needed on this node, 0 visible" in out.stderr
    assert "launcher.require_gpus=true" in out.stderr
    # Nothing tokenized, planned or written for the ranks.
    assert "tokenized" not in out.stdout and "memory plan" not in out.stdout
    assert not (run_dir / "config.yaml").exists() and not (run_dir / "data.json").exists()
    # The demo (require_gpus false) on the same machine starts CPU ranks instead.
    assert to_run_config(compose_cfg([])).launcher.require_gpus is False
    # Tokenizing alone needs no GPU (a login node prepares the cache): preprocess_only skips
    # the preflight, even where the run will require GPUs.
    prep = tmp_path / "prep"
    gpus = ["launcher.require_gpus=true", "preprocess_only=true", f"run_dir={prep}"]
    out = run_train_py(gpus, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "memtune: data tokenized into" in out.stdout or "memtune: data reused" in out.stdout
    assert "preprocess_only: run dir" in out.stdout and (prep / "data.json").is_file()


@pytest.mark.slow
def test_two_nodes_started_separately_train_together(tmp_path: Path) -> None:
    # Two train.py processes on this machine play two nodes of one rank each: node 1 waits for
    # node 0's run dir, then both join one job through DeepSpeed's --no_ssh per-node launch.
    run_dir = tmp_path / "run"
    common = [
        *FAST,
        "trainer.max_steps=4",
        "launcher.num_ranks=2",
        "launcher.nnodes=2",
        "launcher.master_addr=127.0.0.1",
        f"launcher.master_port={free_port()}",
        "launcher.launch_id=t1",
        f"run_dir={run_dir}",
    ]

    def both_nodes(args: list[str]) -> list[str]:
        procs = [
            subprocess.Popen(
                [sys.executable, str(ROOT / "train.py"), *args, f"launcher.node_rank={k}"],
                cwd=tmp_path,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for k in (1, 0)  # node 1 first: it must wait
        ]
        outs = [p.communicate(timeout=600)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outs
        return outs

    outs = both_nodes(common)
    assert "waiting for node 0" in outs[0]
    import json

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 4
    # each node started its rank itself: node 1's is rank 1 of 2, meeting at node 0
    node1 = (run_dir / "launch-node1.txt").read_text()
    assert "RANK=1 LOCAL_RANK=0 " in node1 and " CROSS_RANK=1 " in node1
    assert "RANK=0 LOCAL_RANK=0 " in (run_dir / "launch.txt").read_text()
    assert " WORLD_SIZE=2 " in node1 and " MASTER_ADDR=127.0.0.1 " in node1
    # .hydra/ is node 0's start (node 1, which records after node 0 is ready, overwrote it)
    assert "launcher.node_rank=0" in (run_dir / ".hydra" / "overrides.yaml").read_text()
    adapter = load_file(run_dir / "adapter" / "adapter_model.safetensors")
    assert any(bool((t != 0).any()) for k, t in adapter.items() if "lora_B" in k)

    # The finished run started again (another launch id): node 0 says so to node 1 and no
    # node starts a rank or writes a record (node 0 laid the run out again, config.yaml with
    # this start's settings, and every node wrote .hydra/, the record of the start that
    # trained it). Planning only: no rank runs. Node 1 hears it before its GPU preflight
    # (require_gpus=true: on this machine without GPUs the preflight refuses): it ran the
    # preflight first, rewriting preflight-node1.json on GPUs.
    records = ["config.yaml", "decisions.json", "resume.json", "plan.txt", "data.json"]
    records += [".hydra/config.yaml", ".hydra/overrides.yaml", "exit.json", "summary.json"]
    before = {name: (run_dir / name).read_bytes() for name in records}
    again = [o.replace("launch_id=t1", "launch_id=t2") for o in common]
    outs = both_nodes([*again, "launcher.require_gpus=true"])
    assert all("already finished: step-0000004 is step 4" in out for out in outs), outs
    assert all("memtune: data " not in out for out in outs), outs
    assert {name: (run_dir / name).read_bytes() for name in records} == before

    # Node 0 cannot write what the nodes need (a full disk; here a folder where plan.txt goes)
    # for a start with more steps: one line, exit code 2, and the mark node 1 waits for says
    # why (it waited an hour for launch.json).
    (run_dir / "plan.txt").unlink()
    (run_dir / "plan.txt").mkdir()
    more = [o.replace("launch_id=t1", "launch_id=t3") for o in common]
    more = [o.replace("max_steps=4", "max_steps=5") for o in more]
    out = run_train_py([*more, "launcher.node_rank=0"], cwd=tmp_path, timeout=300)
    why = f"cannot use {run_dir / 'plan.txt'} (IsADirectoryError: Is a directory)"
    assert out.returncode == 2 and f"memtune: error: {why}\n" in out.stderr, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    node1 = resolve(_cfg(*more, "launcher.node_rank=1"), env={})
    with pytest.raises(ConfigError, match=re.escape(f"node 0 could not prepare {run_dir}: {why}")):
        wait_ready(run_dir, node1, timeout_s=0)


def test_node_0_stopped_by_an_error_before_its_ranks_tells_the_other_nodes(
    tmp_path: Path,
) -> None:
    """An exception memtune does not catch on node 0 before its ranks start (injected while it
    tokenizes, tests/raise_inject: a library's error on an input no check foresaw): its
    traceback, exit 1, and the mark the other nodes wait for says why. They waited an hour
    for it and then asked whether node 0 ran the same command."""
    demo = (ROOT / "src" / "memtune" / "assets" / "demo_alpaca.jsonl").read_text()
    data = tmp_path / "broken.jsonl"
    data.write_text(demo)
    run_dir = tmp_path / "run"
    args = ["launcher.nnodes=2", "launcher.master_addr=127.0.0.1", "launcher.num_ranks=2"]
    args += ["launcher.launch_id=e1", f"data.path={data}", "logger=none", f"run_dir={run_dir}"]
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT / "tests" / "raise_inject"),
        "MEMTUNE_TEST_RAISE_ON": str(data),
    }
    out = run_train_py([*args, "launcher.node_rank=0"], cwd=tmp_path, env=env, timeout=300)
    why = f"RuntimeError: injected fault tokenizing {data}"
    assert out.returncode == 1 and why in out.stderr, out.stderr[-3000:]
    node1 = resolve(_cfg(*args, "launcher.node_rank=1"), env={})
    told = f"node 0 could not prepare {run_dir}: node 0 stopped on an error: {why}"
    with pytest.raises(ConfigError, match=re.escape(told)):
        wait_ready(run_dir, node1, timeout_s=0)


def test_node_0_says_when_a_stopping_word_cannot_reach_the_other_nodes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """launch.json unwritable (a folder there, as a full disk would fail it): a word that stops
    nodes 1.. (an error, a finished run) is said on node 0's output, since they will wait for it
    until WAIT_FOR_NODE0_S; the plain "ready" returns the line for node 0 to end the job with.
    (When a record could not be written either, node 0 said nothing of the other nodes.)"""
    from memtune.launcher.job import _mark_ready
    from memtune.rundir import RunDir

    spec = NodeSpec("per-node", 2, 1, 0, "n0", 29500, launch_id="9.1")
    RunDir(tmp_path).nodes_ready.mkdir()
    line = f"cannot write {RunDir(tmp_path).nodes_ready} (IsADirectoryError: Is a directory)"
    assert _mark_ready(tmp_path, spec, error="cannot use plan.txt") == line
    assert capsys.readouterr().err == f"memtune: {line}: the other nodes were not told\n"
    assert _mark_ready(tmp_path, spec, finished="already finished") == line
    assert capsys.readouterr().err.endswith("the other nodes were not told\n")
    assert _mark_ready(tmp_path, spec) == line
    assert capsys.readouterr().err == ""


@pytest.mark.faults
def test_sigterm_to_every_process_of_a_per_node_job_saves_and_continues(tmp_path: Path) -> None:
    """What Slurm does on scancel or at the time limit: SIGTERM to every process of the step
    on every node (train.py, and each rank), two ranks a node. Every rank saves at the next
    step boundary and every train.py exits 75; the same commands continue to the end. (The
    nodes used to start their ranks through DeepSpeed's runner and launcher: the runner died of
    the signal, the job said "DeepSpeed's launcher was killed by SIGTERM" and exited 143 while
    its ranks still saved, and the launcher killed ranks that took over 30 s to get there.)"""
    import json
    import signal
    import time

    import psutil

    run_dir = tmp_path / "run"
    common = [  # two ranks a node, as on a real box (every other multi-node test runs one)
        *FAST,
        "trainer.max_steps=30",
        "trainer.save_every=0",
        "launcher.num_ranks=4",
        "launcher.nnodes=2",
        "launcher.master_addr=127.0.0.1",
        f"run_dir={run_dir}",
    ]

    def start(launch_id: str) -> list[subprocess.Popen]:
        these = [f"launcher.master_port={free_port()}", f"launcher.launch_id={launch_id}"]
        return [
            subprocess.Popen(
                [
                    sys.executable,
                    str(ROOT / "train.py"),
                    *common,
                    *these,
                    f"launcher.node_rank={k}",
                ],
                cwd=tmp_path,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,  # a step of its own: the signals are the test's
            )
            for k in (0, 1)
        ]

    nodes = start("s1")
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.is_file() and metrics.read_text().strip()):
        assert time.monotonic() < deadline and all(p.poll() is None for p in nodes)
        time.sleep(0.2)
    every = [
        q for p in nodes for q in [psutil.Process(p.pid), *psutil.Process(p.pid).children(True)]
    ]
    assert sum("memtune.worker" in " ".join(q.cmdline()) for q in every) == 4
    node1 = (run_dir / "launch-node1.txt").read_text().splitlines()
    assert [line.split()[:2] for line in node1] == [
        ["RANK=2", "LOCAL_RANK=0"],
        ["RANK=3", "LOCAL_RANK=1"],
    ]
    for q in every:
        q.send_signal(signal.SIGTERM)
    outs = [p.communicate(timeout=180)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [75, 75], outs
    assert all("killed by SIGTERM" not in out for out in outs), outs
    assert json.loads((run_dir / "exit.json").read_text()) == {"code": 75}
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    stopped_at = json.loads((run_dir / "checkpoints" / latest / "trainer_state.json").read_text())
    assert 1 <= stopped_at["step"] < 30

    nodes = start("s2")
    outs = [p.communicate(timeout=300)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], outs
    assert f"(step {stopped_at['step']})" in outs[0]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 30
