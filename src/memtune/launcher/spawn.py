"""Start the ranks for one prepared run dir, and fail the whole job if any rank fails.

Several ranks go through DeepSpeed's per-node launcher (``deepspeed.launcher.launch``, which on
a CPU machine starts N CPU processes); it watches its children and takes the others down when
one dies, so a crashed rank never leaves the rest hanging in a collective. On one node it is
started directly, with the world description the ``deepspeed`` command would have computed:
that command only works out ``{"localhost": [0..N-1]}`` and starts the same launcher, and in
doing so imports torch and DeepSpeed once more (~4 s per job on a slow CPU) and drops
``CUDA_VISIBLE_DEVICES`` (with ``--num_gpus`` the ranks got cards 0..N-1 whatever was visible).
Jobs over several nodes go through the ``deepspeed`` command (ds_runner.py), which reads the
hostfile. One rank runs as a plain subprocess with the same environment variables a launcher
would set.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import psutil

from memtune.config import RunConfig
from memtune.launcher.extensions import extensions_root
from memtune.launcher.hygiene import clear_shm_buffers, clear_stale_locks
from memtune.launcher.topology import NodeSpec, resolve
from memtune.rundir import RunDir

WORKER_MODULE = "memtune.worker"
DS_RUNNER = "memtune.launcher.ds_runner"
"""DeepSpeed's own launcher, run in a process with memtune's noise filters (ds_runner.py)."""
DS_NODE_LAUNCH = "deepspeed.launcher.launch"
"""DeepSpeed's per-node launcher: what the ``deepspeed`` command starts on each node."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def one_rank_env(port: int) -> dict[str, str]:
    """What a launcher sets for a rank, for a world of one (no launcher is started for it)."""
    return {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def rank_env(cfg: RunConfig, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for the ranks: one OpenMP thread pool per rank, not per core each."""
    env = dict(os.environ if base is None else base)
    if "OMP_NUM_THREADS" not in env:
        here = cfg.launcher.num_ranks // cfg.launcher.nnodes  # ranks on this node
        threads = cfg.launcher.omp_threads or max(1, (os.cpu_count() or 1) // here)
        env["OMP_NUM_THREADS"] = str(threads)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def local_devices(n: int, env: Mapping[str, str] | None = None) -> list[int | str]:
    """The device ids this node's n ranks get: the first n of ``CUDA_VISIBLE_DEVICES`` when it
    lists that many (the GPU preflight counted those; a UUID stays a string), else 0..n-1 (a CPU
    machine, or nothing set)."""
    env = os.environ if env is None else env
    visible = [d.strip() for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if len(visible) < n:
        return list(range(n))
    return [int(d) if d.isdigit() else d for d in visible[:n]]


def world_info(devices: list[int | str]) -> str:
    """One node's world description, encoded as the ``deepspeed`` command encodes it for its
    launcher's ``--world_info`` (``deepspeed.launcher.runner.encode_world_info``, which the
    tests compare against; not imported here, as it would pull torch into the job process)."""
    return base64.urlsafe_b64encode(json.dumps({"localhost": devices}).encode()).decode()


def rank_command(
    cfg: RunConfig,
    run_dir: Path,
    port: int,
    module: str = WORKER_MODULE,
    spec: NodeSpec | None = None,
    env: Mapping[str, str] | None = None,
) -> tuple[list[str], dict[str, str]]:
    """The command line and extra environment that start this node's ranks (launcher.topology
    decides the form; ``env``, default this process's, supplies ``CUDA_VISIBLE_DEVICES``)."""
    spec = spec or resolve(cfg)
    if spec.form == "local" and spec.ranks_per_node == 1:
        return [sys.executable, "-m", module, str(run_dir)], one_rank_env(port)
    if spec.form == "local":
        devices = local_devices(spec.ranks_per_node, env)
        return [
            *(sys.executable, "-u", "-m", DS_NODE_LAUNCH, "--world_info", world_info(devices)),
            *("--master_addr", "127.0.0.1", "--master_port", str(port), "--no_local_rank"),
            *("--log_level", "warning", "--module", module, str(run_dir)),
        ], {}
    cmd = [sys.executable, "-m", DS_RUNNER]
    if spec.form == "hostfile":
        assert spec.hostfile is not None
        cmd += ["--hostfile", str(spec.hostfile), "--num_nodes", str(spec.nnodes)]
    elif spec.form == "per-node":
        cmd += [
            "--hostfile",
            str(RunDir(run_dir).nodes_hostfile),
            "--no_ssh",
            "--node_rank",
            str(spec.node_rank),
            "--num_nodes",
            str(spec.nnodes),
        ]
    if spec.master_addr:
        cmd += ["--master_addr", spec.master_addr]
    cmd += [
        "--master_port",
        str(port),
        "--num_gpus",
        str(spec.ranks_per_node),
        "--no_local_rank",
        "--log_level",
        "warning",
        "--module",
        module,
        str(run_dir),
    ]
    return cmd, {}


def launch(
    cfg: RunConfig,
    run_dir: Path,
    module: str = WORKER_MODULE,
    spec: NodeSpec | None = None,
    extra_env: dict[str, str] | None = None,
) -> int:
    """Run this node's ranks to completion; returns the exit code (0 only if every rank did).

    ``extra_env``: what the GPU preflight decided (NCCL switches), for every rank.
    """
    spec = spec or resolve(cfg)
    port = spec.master_port or free_port()
    cmd, extra = rank_command(cfg, run_dir, port, module, spec)
    env = {**rank_env(cfg), **(extra_env or {}), **extra}
    RunDir(run_dir).launch_cmd(spec.node_rank).write_text(" ".join(cmd) + "\n")
    clear_stale_locks(extensions_root())
    clear_shm_buffers()
    # Ranks start with SIGUSR2 ignored (inherited through exec) until their own handler is in
    # place, so a stop that arrives while they import or load is not fatal; it is re-sent
    # every few seconds until the job ends, which reaches the ranks once they listen.
    proc = subprocess.Popen(
        cmd,
        env=env,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGUSR2, signal.SIG_IGN),
    )
    stopping = False

    def forward_stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True
        _signal_ranks(proc.pid, module)

    previous = {s: signal.signal(s, forward_stop) for s in (signal.SIGTERM, signal.SIGUSR2)}
    try:
        while True:
            try:
                return proc.wait(timeout=STOP_RESEND_S)
            except subprocess.TimeoutExpired:
                if stopping:
                    _signal_ranks(proc.pid, module)
    except KeyboardInterrupt:
        # Ctrl-C: pass it to the whole rank group, then wait for it to go.
        os.killpg(proc.pid, signal.SIGINT)
        try:
            return proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            return proc.wait()
    except BaseException:
        # Whatever stops this process (a test's timeout, an error here) takes the ranks too:
        # orphaned ranks would keep their cores and ports.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if proc.poll() is not None:  # the ranks are gone: their shared memory can go too
            clear_shm_buffers(port)


STOP_RESEND_S = 3.0


def _signal_ranks(pid: int, module: str) -> None:
    """SIGUSR2 to the ranks themselves, not DeepSpeed's launcher (which would kill them):
    each rank saves a checkpoint at the next step boundary and exits with the requeue code."""
    with contextlib.suppress(psutil.Error):
        for worker in rank_processes(pid, module):
            with contextlib.suppress(psutil.Error):
                worker.send_signal(signal.SIGUSR2)


def rank_processes(pid: int, module: str = WORKER_MODULE) -> list[psutil.Process]:
    """The rank processes under a launcher pid (or the pid itself, for one rank)."""
    root = psutil.Process(pid)
    found = []
    for p in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            cmdline = p.cmdline()
            # Ranks run `python [-u] -m MODULE RUN_DIR`; launchers carry `--module MODULE`.
            if any(a == "-m" and b == module for a, b in itertools.pairwise(cmdline)):
                found.append(p)
    return found
