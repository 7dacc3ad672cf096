"""Where this process stands in a job of one or more nodes, and how the nodes agree.

Three forms start the ranks (see launch/README.md):

- ``local``: one node; this process starts the ranks, with the environment DeepSpeed's per-node
  launcher would give them (launcher.spawn).
- ``hostfile``: ``deepspeed --hostfile FILE`` from this node starts every node's ranks over ssh.
- ``per-node``: the same ``train.py`` command runs on every node (Slurm: one task per node, or
  by hand with no ssh between nodes). Node 0 prepares the run dir; the others wait for it, then
  each starts its own ranks, as one node does (launcher.spawn), in a world of every node's.

The per-node form needs every node to agree on the master address and port and on *which start*
they belong to, so a node never joins a stale run dir left by an earlier start: the launch id.
On Slurm all three come from the job's environment.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memtune.config import ConfigError, RunConfig
from memtune.exit_codes import EXIT_PEER_LOST
from memtune.filesystem import write_atomic
from memtune.rundir import RunDir, memtune_record

DEFAULT_PORT = 29500


@dataclass(frozen=True)
class NodeSpec:
    form: str
    """local | hostfile | per-node"""
    nnodes: int
    ranks_per_node: int
    node_rank: int
    master_addr: str | None
    master_port: int | None
    """None: a free port on this machine (local form only)."""
    launch_id: str | None = None
    hostfile: Path | None = None


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: ``gpu[07-09,12],cpu1`` → ``gpu07``,
    ``rack[1-2]-n[01-04]`` → ``rack1-n01``.

    ``scontrol show hostnames`` does this where Slurm's tools are installed (train.sbatch uses
    it); this covers the list syntax so the launcher does not need them on the PATH: the
    first item (up to a comma outside brackets), each bracket replaced by its first number.
    """
    text, depth = nodelist.strip(), 0
    for i, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            text = text[:i]
            break
    return re.sub(r"\[([^\]]*)\]", lambda m: m.group(1).split(",")[0].split("-")[0], text)


def _int_env(env: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        if env.get(name, "").strip():
            try:
                return int(env[name])
            except ValueError as err:
                raise ConfigError(f"${name}={env[name]!r} is not an integer") from err
    return None


def this_node_rank(lc: Any, env: Mapping[str, str] | None = None) -> int:
    """This node's rank when the job runs once per node: launcher.node_rank, else $SLURM_NODEID
    or $NODE_RANK, else 0 (a hostfile job runs on one machine: 0). ``lc``: the launcher config,
    typed or as composed — the run-dir lock needs it before the job is sized from a Slurm
    allocation, so launcher.nnodes counts only when it cannot change (from_allocation off, or
    no Slurm job here)."""
    env = os.environ if env is None else env
    if lc.hostfile is not None:
        return 0
    if lc.nnodes == 1 and not (lc.from_allocation and env.get("SLURM_JOB_ID")):
        return 0  # one node, as resolve() says
    if lc.node_rank is not None:
        return int(lc.node_rank)
    return _int_env(env, "SLURM_NODEID", "NODE_RANK") or 0


def resolve(cfg: RunConfig, env: Mapping[str, str] | None = None) -> NodeSpec:
    """This node's place in the job, from the config first and the environment second."""
    env = os.environ if env is None else env
    lc = cfg.launcher
    per_node = lc.num_ranks // lc.nnodes
    slurm_job = env.get("SLURM_JOB_ID")
    if lc.node_rank not in (None, 0) and (lc.nnodes == 1 or lc.hostfile is not None):
        # It was dropped without a word: this node ran as node 0 (or started every node)
        form = f"launcher.hostfile={lc.hostfile}" if lc.hostfile else "launcher.nnodes=1"
        raise ConfigError(
            f"launcher.node_rank={lc.node_rank} with {form}: a node rank is for the per-node "
            "form (launcher.nnodes > 1, no hostfile, the same command on every node); "
            "drop launcher.node_rank or the hostfile"
        )
    if lc.nnodes == 1 and lc.hostfile is not None:
        # DeepSpeed's runner then started the ranks here, after asking ssh for this machine:
        # without passwordless ssh to itself, a RuntimeError traceback after the data was ready
        raise ConfigError(
            f"launcher.hostfile={lc.hostfile} with launcher.nnodes=1: one machine needs no "
            "hostfile; drop it, or set launcher.nnodes to the hosts to use (and "
            "launcher.num_ranks to all their ranks)"
        )
    if lc.nnodes == 1:
        return NodeSpec("local", 1, lc.num_ranks, 0, lc.master_addr, lc.master_port)
    master_addr = lc.master_addr or env.get("MASTER_ADDR", "").strip() or None
    if master_addr is None and env.get("SLURM_JOB_NODELIST"):
        master_addr = first_host(env["SLURM_JOB_NODELIST"])
    port = lc.master_port or _int_env(env, "MASTER_PORT")
    if port is not None and not 1 <= port <= 65535:
        # 0 gave each node a free port of its own: nodes that never meet
        raise ConfigError(
            f"$MASTER_PORT={env['MASTER_PORT']!r} is not a port: choose one in 1-65535, or "
            "unset it (launcher.master_port, else memtune's default)"
        )
    if port is None:
        job = _int_env(env, "SLURM_JOB_ID")
        port = 20000 + job % 20000 if job is not None else DEFAULT_PORT
    if lc.hostfile is not None:
        # realpath: a symlink loop was Path.resolve's RuntimeError (Python < 3.13)
        hostfile = Path(os.path.realpath(Path(lc.hostfile).expanduser()))
        check_hostfile(hostfile, lc.nnodes, per_node)
        return NodeSpec("hostfile", lc.nnodes, per_node, 0, master_addr, port, hostfile=hostfile)
    node_rank = this_node_rank(lc, env)
    if not 0 <= node_rank < lc.nnodes:
        given = [f"${n}" for n in ("SLURM_NODEID", "NODE_RANK") if env.get(n, "").strip()]
        source = "launcher.node_rank" if lc.node_rank is not None or not given else given[0]
        raise ConfigError(
            f"{source}={node_rank} is not in 0..{lc.nnodes - 1} (launcher.nnodes={lc.nnodes})"
        )
    if master_addr is None:
        raise ConfigError(
            f"launcher.nnodes={lc.nnodes} without a hostfile runs this command on every node; "
            "set launcher.master_addr (node 0's address) or $MASTER_ADDR"
        )
    launch_id = lc.launch_id
    if launch_id is None and slurm_job:
        # the step too: two sruns in one allocation (salloc, a retry after a fix) are two
        # starts, and an earlier one's marks must not count for the next
        step = env.get("SLURM_STEP_ID", "").strip()
        step = f"{step}." if step else ""
        launch_id = f"{slurm_job}.{step}{env.get('SLURM_RESTART_COUNT') or 0}"
    launch_id = launch_id or env.get("MEMTUNE_LAUNCH_ID", "").strip() or None
    if launch_id is None:
        raise ConfigError(
            "the per-node form needs a launch id that is the same on every node and new for "
            "every start: launcher.launch_id=... or $MEMTUNE_LAUNCH_ID (Slurm sets one itself)"
        )
    if cfg.run_dir is None:
        raise ConfigError(
            "the per-node form needs run_dir=... (the same shared path on every node); "
            "a dated default would differ between nodes"
        )
    return NodeSpec("per-node", lc.nnodes, per_node, node_rank, master_addr, port, launch_id)


@dataclass(frozen=True)
class Allocation:
    """The part of a Slurm allocation this train.py runs on: one task per node."""

    nnodes: int
    ranks_per_node: int | None
    """None: not known from the environment (a CPU node without $MEMTUNE_RANKS_PER_NODE)."""


RANKS_PER_NODE_ENV = ("MEMTUNE_RANKS_PER_NODE", "SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE")
"""The ranks per node of a Slurm task, first found: memtune's own (CPU nodes, or fewer ranks
than GPUs), then the GPUs Slurm gave this node (``--gpus-per-node=a100:4`` gives ``a100:4``)."""


def slurm_allocation(env: Mapping[str, str] | None = None) -> Allocation | None:
    """The nodes and ranks per node of the Slurm job step this process is a task of, or None
    when it is not in a step (a login shell, or ``salloc`` without ``srun``: one process there
    must not wait for nodes that never start)."""
    env = os.environ if env is None else env
    nnodes = _int_env(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES")
    if not env.get("SLURM_JOB_ID") or not env.get("SLURM_STEP_ID", "").strip() or not nnodes:
        return None
    for name in RANKS_PER_NODE_ENV:
        value = env.get(name, "").strip().split(",")[0].rsplit(":", 1)[-1]
        if value:
            try:
                per_node = int(value)
            except ValueError:
                per_node = 0
            if per_node < 1:
                raise ConfigError(f"${name}={env[name]!r}: expected a number of ranks per node")
            return Allocation(nnodes, per_node)
    return Allocation(nnodes, None)


def check_sweep_point_nodes(env: Mapping[str, str] | None = None) -> None:
    """A sweep point's Slurm job (hydra/launcher=slurm) runs on one node. submitit fixes a job's
    task count when it submits and waits for a result from every task, so a multi-node point
    could never come back on fewer nodes after a requeue, and Hydra would run each point's
    job once per node: refused before anything starts, naming what to use instead."""
    alloc = slurm_allocation(env)
    if alloc is not None and alloc.nnodes > 1:
        raise ConfigError(
            f"hydra.launcher.nodes={alloc.nnodes}: a sweep point runs on one node (its ranks "
            "are that node's GPUs); for a run over several nodes submit "
            "launch/slurm/train.sbatch with --nodes=N, one job per point"
        )


def size_from_allocation(
    launcher: Any,
    given_on_command_line: list[str],
    env: Mapping[str, str] | None = None,
    launching: bool = True,
) -> list[str]:
    """launcher.from_allocation: set launcher.nnodes and launcher.num_ranks (a DictConfig
    node, before the typed config exists) from the Slurm allocation, except those given on
    the command line. Returns the assignments made (values equal to the config's included),
    for the start-up line.

    One place decides a Slurm job's size, for train.sbatch and hydra/launcher=slurm alike, so a
    requeued job that comes back on fewer nodes or GPUs resumes on what it got (resume=auto
    accepts another number of ranks, prepare.resume_changes records it). ``launching``: this
    step starts the job's ranks (a plan, from an interactive step, may be of another size)."""
    if not launcher.from_allocation:
        return []
    alloc = slurm_allocation(env)
    if alloc is None:
        return []
    given = {o.split("=", 1)[0].lstrip("+~") for o in given_on_command_line}
    per_node_form = launching and not launcher.hostfile  # one train.py on each node
    if per_node_form and "launcher.nnodes" in given and launcher.nnodes != alloc.nnodes:
        # More: the ranks wait for nodes that never start (torch's 30-minute rendezvous
        # timeout); fewer: the nodes beyond it are refused, or run the same run dir twice.
        raise ConfigError(
            f"launcher.nnodes={launcher.nnodes}, but this Slurm job step runs on "
            f"{alloc.nnodes} node(s), one train.py each: leave launcher.nnodes out (it follows "
            f"the allocation) or submit with --nodes={launcher.nnodes}"
        )
    # (given: the refusal above made it the step's own, unless a plan or the hostfile form)
    nnodes = launcher.nnodes if "launcher.nnodes" in given else alloc.nnodes
    # Unknown from the environment: as many per node as the config runs.
    per_node = alloc.ranks_per_node or max(1, launcher.num_ranks // launcher.nnodes)
    wanted = {"launcher.nnodes": nnodes, "launcher.num_ranks": nnodes * per_node}
    made = []
    for key, value in wanted.items():
        if key not in given:
            launcher[key.split(".", 1)[1]] = value
            made.append(f"{key}={value}")
    return made


def check_hostfile(path: Path, nnodes: int, per_node: int) -> list[tuple[str, int]]:
    """``HOST slots=N`` lines (``#`` comments); a bad line is named with its number."""
    if not path.is_file():
        raise ConfigError(f"launcher.hostfile={path}: no such file")
    hosts = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"(\S+)\s+slots=(\d+)", line)
        if m is None:
            raise ConfigError(f"{path}:{number}: expected 'HOST slots=N', got {raw.strip()!r}")
        if m.group(1) in seen:  # DeepSpeed's runner raised ValueError on it, after the plan
            raise ConfigError(
                f"{path}:{number}: {m.group(1)} is listed again (line {seen[m.group(1)]}): "
                "one line per host, its slots the GPUs it has"
            )
        seen[m.group(1)] = number
        hosts.append((m.group(1), int(m.group(2))))
    short = [f"{h} ({s})" for h, s in hosts[:nnodes] if s < per_node]
    if len(hosts) < nnodes or short:
        raise ConfigError(
            f"{path}: launcher.nnodes={nnodes} × {per_node} ranks per node needs {nnodes} hosts "
            f"with slots >= {per_node}; it lists {len(hosts)}"
            + (f", too few slots on {', '.join(short)}" if short else "")
        )
    return hosts


SSH_CHECK_S = 20.0


def hostfile_hosts(spec: NodeSpec) -> list[str]:
    """The hosts a hostfile job runs on: the first ``nnodes`` of its hostfile, as DeepSpeed's
    runner takes them for ``--num_nodes``."""
    assert spec.hostfile is not None
    return [h for h, _ in check_hostfile(spec.hostfile, spec.nnodes, spec.ranks_per_node)][
        : spec.nnodes
    ]


def check_nodes_reachable(spec: NodeSpec) -> None:
    """A hostfile job's nodes, reached as DeepSpeed's runner will reach them, before anything is
    prepared: pdsh installed here, and every host answering ssh without a password or a
    prompt (the runner checked only the first host, after the plan and the data, and said it
    in a RuntimeError traceback; pdsh then failed on the others, one line each, and the job
    with it). A ConfigError names the host and what ssh said."""
    if spec.form != "hostfile":
        return
    if shutil.which("pdsh") is None:
        raise ConfigError(
            f"launcher.hostfile={spec.hostfile}: pdsh is not installed on this machine; "
            "DeepSpeed's runner starts every node's ranks with it (Debian / Ubuntu: apt "
            "install pdsh), or run the per-node form (docs/multi-node.md)"
        )
    if shutil.which("ssh") is None:
        raise ConfigError(f"launcher.hostfile={spec.hostfile}: ssh is not installed here")
    checks = {
        host: subprocess.Popen(
            ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={SSH_CHECK_S:.0f}", host, "true"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for host in hostfile_hosts(spec)
    }
    unreachable = []
    for host, proc in checks.items():
        try:
            _, err = proc.communicate(timeout=SSH_CHECK_S + 5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            err = f"no answer within {SSH_CHECK_S + 5:.0f} s"
        if proc.returncode != 0:
            said = (err or "").strip().splitlines()
            unreachable.append(f"{host} ({said[-1] if said else f'ssh exit {proc.returncode}'})")
    if unreachable:
        raise ConfigError(
            f"launcher.hostfile={spec.hostfile}: not reachable over ssh without a password or a "
            f"prompt: {', '.join(unreachable)}; the hostfile form starts each node's ranks over "
            "ssh (a key in the node's authorized_keys, its host key known: ssh HOST true must "
            "answer by itself)"
        )


def _write_mark(path: Path, record: dict[str, Any]) -> None:
    """A node's mark in the shared run dir, whole or not at all: filesystem.write_atomic's
    fsynced, per-process temporary name (a plain write then rename could show the other nodes
    an empty mark after a crash on a network filesystem), removed if the write fails."""
    write_atomic(path, json.dumps(record) + "\n")


def _write_own_mark(path: Path, record: dict[str, Any]) -> None:
    """:func:`_write_mark` for a mark whose name is not among the run files node 0 refuses
    (a node's failure, node 0's beat): a file there that is not such a mark is a user's, and
    FileExistsError leaves it as it is."""
    if (path.exists() or path.is_symlink()) and not memtune_record(path, set(record)):
        raise FileExistsError(errno.EEXIST, "not memtune's, left as it is", str(path))
    _write_mark(path, record)


def _mark_of(path: Path, spec: NodeSpec) -> dict[str, Any] | None:
    """The mark at ``path`` if it is this launch id's (a mark of an earlier start is None)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return record if record.get("launch_id") == spec.launch_id else None


def announce_ready(
    run_dir: Path, spec: NodeSpec, error: str | None = None, finished: str | None = None
) -> None:
    """Node 0: the run dir of this launch id is complete (or could not be made: ``error``; or
    its run is finished: ``finished`` says why, and no node starts a rank)."""
    record = {"launch_id": spec.launch_id, "nnodes": spec.nnodes, "error": error}
    if finished is not None:
        record["finished"] = finished
    _write_mark(RunDir(run_dir).nodes_ready, record)


def announce_stopped(run_dir: Path, spec: NodeSpec) -> None:
    """Nodes 1..: this node's ranks stopped with a checkpoint (a requeue's stop)."""
    _write_mark(RunDir(run_dir).node_stopped(spec.node_rank), {"launch_id": spec.launch_id})


def announce_failed(run_dir: Path, spec: NodeSpec, code: int, error: str) -> None:
    """Node K of a per-node job: its part of the job failed (its launcher's exit ``code``, not
    0 or a stop's 75, and the line that says why). The ranks of the other nodes wait for its
    ranks in torch's rendezvous or a collective until torch's timeout (10 min to an hour);
    their launchers watch for this mark (:func:`failed_node`) and stop them. Node 0's word
    before its ranks start is :func:`announce_ready`'s ``error``."""
    record = {"launch_id": spec.launch_id, "node": spec.node_rank, "code": code, "error": error}
    _write_own_mark(RunDir(run_dir).node_failed(spec.node_rank), record)


def failed_node(run_dir: Path, spec: NodeSpec) -> tuple[int, str] | None:
    """Another node's mark that it failed in this launch (:func:`announce_failed`), as (its
    node rank, its line); one that failed for a reason of its own comes before one whose ranks
    only lost their peers (EXIT_PEER_LOST), then the lowest node rank. None: no node failed."""
    rd = RunDir(run_dir)
    failed = []
    for node in range(spec.nnodes):
        record = None if node == spec.node_rank else _mark_of(rd.node_failed(node), spec)
        if record is not None:
            failed.append((record.get("code") == EXIT_PEER_LOST, node, str(record.get("error"))))
    if not failed:
        return None
    _, node, error = min(failed)
    return node, error


def wait_stopped(run_dir: Path, spec: NodeSpec, timeout_s: float, poll_s: float = 0.5) -> list[int]:
    """Node 0, after a stop with a checkpoint: wait until nodes 1.. have marked theirs, so node
    0's exit code 75 (the requeue) comes last. Under ``srun --kill-on-bad-exit`` the first
    non-zero exit kills every other task: a node 0 that exits 75 first would have the others
    killed (their code then is the signal's) and the job would end FAILED, not requeued.
    Returns the nodes that did not mark within ``timeout_s``."""
    rd = RunDir(run_dir)
    deadline = time.monotonic() + timeout_s
    while True:
        missing = [
            node for node in range(1, spec.nnodes) if _mark_of(rd.node_stopped(node), spec) is None
        ]
        if not missing or time.monotonic() > deadline:
            return missing
        time.sleep(poll_s)


PREPARING_BEAT_S = 30.0
"""Per-node form: how often node 0 says it is still preparing the run dir (:func:`preparing`)."""
PREPARING_STALE_S = 300.0
"""Nodes 1..: node 0 counts as preparing while its beat changed within this long, by their own
clocks (a shared filesystem's times are another machine's)."""


@contextlib.contextmanager
def preparing(run_dir: Path, spec: NodeSpec, every_s: float = PREPARING_BEAT_S) -> Iterator[None]:
    """Node 0 of a per-node job while it plans, tokenizes and lays the run dir out: a beat in
    the run dir every ``every_s`` (once the dir exists), so that the other nodes wait for a
    preparation longer than their wait (a large dataset's tokens, a vision dataset's images:
    they gave up after an hour, and under ``srun --kill-on-bad-exit`` took node 0 with them)
    and still give up on a node 0 that stopped beating. Removed at the end."""
    path = RunDir(run_dir).node0_preparing
    stop = threading.Event()

    def beat() -> None:
        n = 0
        while True:
            if run_dir.is_dir():
                # a beat missed (or a user's file of that name, left alone): the wait's limit
                with contextlib.suppress(OSError):
                    _write_own_mark(path, {"launch_id": spec.launch_id, "beat": n})
                    n += 1
            if stop.wait(every_s):
                return

    thread = threading.Thread(target=beat, name="memtune-node0-preparing", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        if _mark_of(path, spec) is not None:
            with contextlib.suppress(OSError):
                path.unlink()


class NodeZeroStopped(ConfigError):
    """Nodes 1..: node 0's word that it could not prepare the run dir, or none within the
    wait (:func:`wait_ready`): node 0 stopped, not this node (it tells no one)."""


def wait_ready(
    run_dir: Path,
    spec: NodeSpec,
    timeout_s: float,
    poll_s: float = 1.0,
    stale_s: float = PREPARING_STALE_S,
) -> str | None:
    """Nodes 1..: wait until node 0 has prepared the run dir for this launch id; what node 0
    said when the run is finished already (nothing to start), else None. Past ``timeout_s``
    they wait on while node 0 still beats (:func:`preparing`: its beat changed within
    ``stale_s``)."""
    rd = RunDir(run_dir)
    start = last_note = beat_seen = time.monotonic()
    beat = None
    while True:
        record = _mark_of(rd.nodes_ready, spec)
        if record is not None:
            if record.get("error"):
                raise NodeZeroStopped(f"node 0 could not prepare {run_dir}: {record['error']}")
            return str(record["finished"]) if record.get("finished") else None
        now = time.monotonic()
        mark = _mark_of(rd.node0_preparing, spec)
        if mark is not None and mark.get("beat") != beat:
            beat, beat_seen = mark.get("beat"), now
        beating = beat is not None and now - beat_seen < stale_s
        if now - start > timeout_s and not beating:
            raise NodeZeroStopped(
                f"node {spec.node_rank}: node 0 did not prepare {run_dir} for launch "
                f"{spec.launch_id} within {timeout_s:.0f} s (is it running the same command?)"
            )
        if now - last_note >= 30:
            still = ", still preparing" if beating else ""
            print(
                f"memtune: node {spec.node_rank}: waiting for node 0 ({now - start:.0f} s{still})"
            )
            last_note = now
        time.sleep(poll_s)
