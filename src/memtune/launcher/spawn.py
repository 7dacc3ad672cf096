"""Start the ranks for one prepared run dir, and fail the whole job if any rank fails.

On one node memtune starts the ranks itself, as its own children, with the environment
DeepSpeed's per-node launcher (``deepspeed.launcher.launch``) would give them (RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, CUDA_VISIBLE_DEVICES = this node's cards, …). That
launcher only set those and watched its children, but it imported torch and DeepSpeed to do it
(~4 s per job on a slow CPU), ended a job whose rank died during start-up only after a 30 s
SIGTERM grace, exited with whichever failed rank it polled first (5 or 247 for one kill -9),
and could not tell which rank died of what. Here each rank's exit status is this process's to
read: the first rank to fail (a code other than 0 and 75, or a signal) is named with its code
or signal, the others get RANK_FAILURE_GRACE_S to end on their own and are then killed, and the
job exits with one code that does not depend on polling order (:func:`job_code`). Each node of
the per-node form does the same for its own ranks, and marks in the run dir when its part of the
job fails (topology.announce_failed): the other nodes' launchers watch for that mark while their
ranks run and stop them (they waited for the failed node's ranks in torch's rendezvous or a
collective until torch's timeout, 10 minutes and more). The hostfile form goes through the
``deepspeed`` command (ds_runner.py), which reads the hostfile and starts DeepSpeed's per-node
launcher on every node over ssh.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import psutil

from memtune.config import ConfigError, RunConfig
from memtune.detached import LAUNCHER_BOOT_ENV, LAUNCHER_PID_ENV, launcher_env
from memtune.exit_codes import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_PEER_LOST, EXIT_REQUEUE
from memtune.filesystem import write_atomic
from memtune.launcher.extensions import extensions_root
from memtune.launcher.hygiene import clear_shm_buffers, clear_stale_locks
from memtune.launcher.rank_signals import WORKER_MODULE, NodesOverSsh, is_rank
from memtune.launcher.topology import (
    NodeSpec,
    announce_failed,
    failed_node,
    hostfile_hosts,
    resolve,
)
from memtune.machine import usable_cores
from memtune.run_lock import held_lock_fds
from memtune.rundir import RunDir

DS_RUNNER = "memtune.launcher.ds_runner"
"""DeepSpeed's own launcher, run in a process with memtune's noise filters (ds_runner.py)."""
RANK_FAILURE_GRACE_S = 5.0
"""After one rank fails, how long the others get to end by themselves (a peer that lost its
connection reports it and exits) before they are killed: they cannot go on without it."""
POLL_S = 0.1
NODE_WATCH_S = 2.0
"""The per-node form: how often a node's launcher looks for another node's failure mark while
its ranks run (topology.failed_node: a few small files on the shared run dir)."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_in_use(port: int, addr: str = "127.0.0.1") -> bool:
    """Whether something on this machine holds ``port`` at ``addr`` (a listening socket: the
    rank-0 rendezvous store could not bind it). Bound with SO_REUSEADDR, as torch's store
    binds, so the TIME_WAIT connections a finished job leaves on its port do not count; an
    address that is not this machine's (a hostfile's node 0 elsewhere) is not checked."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((addr, port))
    except OSError as err:  # socket.gaierror too: a name that does not resolve here
        return err.errno == errno.EADDRINUSE
    return False


def check_master_port(cfg: RunConfig, spec: NodeSpec) -> None:
    """A launcher.master_port in use on this machine, refused before the ranks start (they
    stopped with DistNetworkError EADDRINUSE after launch): on one node at 127.0.0.1, the
    address the ranks meet at, where the user set it (unset, memtune picks a free one); in
    the per-node form on node 0, at launcher.master_addr, where the store listens, set or
    derived ($MASTER_PORT, or 20000 + the Slurm job id mod 20000: inside Linux's ephemeral
    range for about a third of job ids, where an outgoing connection may hold it). A hostfile
    job's node 0 may be another machine: not checked; nor a run that starts no rank
    (preprocess_only, plan_only)."""
    port = cfg.launcher.master_port if spec.form == "local" else spec.master_port
    if port is None or spec.node_rank != 0 or spec.form == "hostfile":
        return
    if cfg.preprocess_only or cfg.plan_only:
        return
    addr = "127.0.0.1" if spec.form == "local" else spec.master_addr
    if addr is None or not port_in_use(port, addr):
        return
    if spec.form == "local":
        name = f"launcher.master_port={port}"
        fix = "choose a free port, or leave it unset: memtune picks a free one"
    elif cfg.launcher.master_port is not None:
        name, fix = f"launcher.master_port={port}", "choose a free port"
    else:
        name = f"the rendezvous port {port} (from $MASTER_PORT or the Slurm job id)"
        fix = "set launcher.master_port (or $MASTER_PORT) to a free port"
    raise ConfigError(
        f"{name}: the port is in use on this machine ({addr}: another job's ranks, or "
        f"another program); {fix}"
    )


def rank_env(cfg: RunConfig, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for the ranks: one OpenMP thread pool per rank, not per core each (of
    the cores this process may use: a Slurm job's or taskset's, not the whole node's); the
    DeepSpeed ops built for this environment (launcher.extensions)."""
    env = dict(os.environ if base is None else base)
    env.setdefault("TORCH_EXTENSIONS_DIR", str(extensions_root()))
    if "OMP_NUM_THREADS" not in env:
        here = cfg.launcher.num_ranks // cfg.launcher.nnodes  # ranks on this node
        threads = cfg.launcher.omp_threads or max(1, usable_cores() // here)
        env["OMP_NUM_THREADS"] = str(threads)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def listed_devices(value: str) -> list[str]:
    """The cards a ``CUDA_VISIBLE_DEVICES`` value shows, as CUDA reads it: the entries up to
    the first negative one (``-1`` hides every card, ``0,-1,2`` shows card 0 only)."""
    listed: list[str] = []
    for entry in (d.strip() for d in value.split(",")):
        if not entry or entry.startswith("-"):
            break
        listed.append(entry)
    return listed


def visible_devices(n: int, env: Mapping[str, str] | None = None) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` this node's n ranks get: the first n cards it lists when it
    lists that many (the GPU preflight counted those); unset, cards 0..n-1; set but showing
    fewer, unchanged: ``""`` or ``-1`` hid every card (CPU ranks; cards 0..n-1 were given to
    them instead), and a GPU run on fewer cards than ranks was refused before the launch
    (launcher.preflight)."""
    env = os.environ if env is None else env
    value = env.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return ",".join(str(i) for i in range(n))
    listed = listed_devices(value)
    return ",".join(listed[:n]) if len(listed) >= n else value


def node_env(
    ranks: int, port: int, spec: NodeSpec | None = None, visible: str | None = None
) -> dict[str, str]:
    """What every rank of this node gets besides RANK and LOCAL_RANK: the variables DeepSpeed's
    per-node launcher sets (torch.distributed's env:// rendezvous reads them), for this node's
    ``ranks`` on the cards ``visible`` (:func:`visible_devices`; default 0..ranks-1). One node
    meets at 127.0.0.1; a node of a per-node job (``spec``) at node 0's address, in a world of
    every node's ranks."""
    nnodes, node = (spec.nnodes, spec.node_rank) if spec and spec.form == "per-node" else (1, 0)
    addr = (spec.master_addr if spec else None) if nnodes > 1 else "127.0.0.1"
    return {
        "MASTER_ADDR": addr or "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(ranks * nnodes),
        "LOCAL_WORLD_SIZE": str(ranks),
        "LOCAL_SIZE": str(ranks),
        "CROSS_RANK": str(node),
        "CROSS_SIZE": str(nnodes),
        "CUDA_VISIBLE_DEVICES": visible_devices(ranks, {}) if visible is None else visible,
    }


def rank_command(
    cfg: RunConfig,
    run_dir: Path,
    port: int,
    module: str = WORKER_MODULE,
    spec: NodeSpec | None = None,
    env: Mapping[str, str] | None = None,
) -> tuple[list[str], dict[str, str]]:
    """The command line and extra environment that start this node's ranks (launcher.topology
    decides the form; ``env``, default this process's, supplies ``CUDA_VISIBLE_DEVICES``).

    One node, and each node of the per-node form: this process starts its ranks itself, one
    command for every rank (RANK and LOCAL_RANK added per rank, :func:`launch`). The per-node
    form went through DeepSpeed's runner and per-node launcher, which Slurm's SIGTERM to every
    process of the step (scancel, the time limit) took apart: the runner died of it, so the job
    exited 143 while its ranks still saved, and the launcher sent the ranks SIGTERM itself and
    killed them after 30 s. The hostfile form needs DeepSpeed's runner (ssh, pdsh)."""
    spec = spec or resolve(cfg)
    if spec.form in ("local", "per-node"):
        n = spec.ranks_per_node
        world = node_env(n, port, spec, visible_devices(n, env))
        return [sys.executable, "-u", "-m", module, str(run_dir)], world
    assert spec.hostfile is not None
    cmd = [sys.executable, "-m", DS_RUNNER]
    cmd += ["--hostfile", str(spec.hostfile), "--num_nodes", str(spec.nnodes)]
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
    """Run this node's ranks to completion; returns the job's exit code (0 only if every rank
    exited 0; :func:`job_code`).

    ``extra_env``: what the GPU preflight decided (NCCL switches), for every rank.
    """
    spec = spec or resolve(cfg)
    port = spec.master_port or free_port()
    cmd, extra = rank_command(cfg, run_dir, port, module, spec)
    env = {**rank_env(cfg), **(extra_env or {}), **extra}
    # What the ranks get beyond this process's environment (the world, threads, NCCL switches).
    added = {k: v for k, v in env.items() if os.environ.get(k) != v}
    nodes = None
    if spec.form == "hostfile":  # ranks over ssh: they get only what DeepSpeed's runner exports
        nodes = NodesOverSsh(hostfile_hosts(spec), run_dir, module)
        # the threads a rank: train.py's machine's figure only if asked for (a login node's
        # cores are not a node's); else each rank divides its own machine's
        # (rank.this_machine.threads_for_this_machine)
        asked = cfg.launcher.omp_threads is not None
        mine = {k: v for k, v in added.items() if k != "OMP_NUM_THREADS" or asked}
        sent, withheld = node_exports({**os.environ, **mine, **launcher_env()}, mine)
        added[EXPORT_ENV] = env[EXPORT_ENV] = ",".join(sent)
        if withheld:
            print(f"memtune: not sent to the other nodes: {withheld}", file=sys.stderr)
    starts: list[dict[str, str]] = [{}]  # hostfile: DeepSpeed's runner starts the ranks
    record = _shell_line(added, cmd)
    own = spec.form != "hostfile"
    first = spec.node_rank * spec.ranks_per_node
    if own:
        starts = [
            {"RANK": str(first + r), "LOCAL_RANK": str(r)} for r in range(spec.ranks_per_node)
        ]
        record = "".join(_shell_line({**start, **added}, cmd) for start in starts)
    write_atomic(RunDir(run_dir).launch_cmd(spec.node_rank), record)
    # This process's pid, which the ranks watch (memtune.detached): not in launch.txt above.
    env.update(launcher_env())
    clear_stale_locks(extensions_root())
    clear_shm_buffers()
    envs = [{**env, **start} for start in starts]
    per_node = spec.form == "per-node"
    watch = functools.partial(failed_node, run_dir, spec) if per_node else None
    ranks = _Ranks(cmd, envs, module, own, nodes, first if own else 0, watch)
    try:
        code = ranks.wait()
    except BaseException as err:
        # Whatever stops this process (a test's timeout, an error here) takes the ranks too:
        # orphaned ranks would keep their cores and ports.
        ranks.kill()
        for proc in ranks.procs:
            proc.wait()
        if per_node:
            why = " ".join(f"{type(err).__name__}: {err}".split()).removesuffix(":")
            tell_nodes_of_failure(run_dir, spec, EXIT_ERROR, f"train.py stopped on {why}")
        raise
    finally:
        ranks.restore_signals()
        if ranks.ended():  # the ranks are gone: their shared memory can go too
            clear_shm_buffers(port)
    if per_node and code not in CLEAN_CODES and ranks.peer is None:
        tell_nodes_of_failure(run_dir, spec, code, ranks.report or f"exit code {code}")
    return code


def tell_nodes_of_failure(run_dir: Path, spec: NodeSpec, code: int, why: str) -> None:
    """This node's part of a per-node job failed on its own (not because another node's did),
    while its ranks ran or before they started (launcher.job): its mark for the other nodes'
    launchers (topology.announce_failed); a mark that cannot be written (a full disk) is
    said, since their ranks then wait until torch's timeout."""
    try:
        announce_failed(run_dir, spec, code, why)
    except OSError as err:
        path = RunDir(run_dir).node_failed(spec.node_rank)
        print(
            f"memtune: cannot write {path} ({type(err).__name__}: {err.strerror or err}): the "
            "other nodes were not told",
            file=sys.stderr,
            flush=True,
        )


EXPORT_ENV = "MEMTUNE_EXPORT"
"""The variables a hostfile job's ranks get from train.py's environment, by name (ds_runner
adds them to what DeepSpeed's runner exports over ssh, beside its own NCCL_*, PYTHON*, UCX*)."""
NODE_ENV_PREFIXES = (
    "MEMTUNE_",
    "WANDB_",
    "HF_",
    "HUGGINGFACE_",
    "TRANSFORMERS_",
    "TOKENIZERS_",
    "OMP_",
    "PYTORCH_CUDA_ALLOC_CONF",
    "PYTORCH_ALLOC_CONF",
    "TORCH_EXTENSIONS_DIR",
    "DS_ACCELERATOR",
)
"""Besides what memtune sets for the ranks itself (threads, the ops' build dir, NCCL switches):
the user's settings the ranks read (memtune's, wandb's, Hugging Face's, the CUDA allocator's)."""
CREDENTIAL = re.compile(r"(^|_)(KEY|TOKEN|SECRET|PASSWORD)(_|$)")
"""Names kept off the ssh command line, where every user of a node could read them: wandb and
the Hub log in from each node's own ``wandb login`` / ``hf auth login`` (a shared home)."""
UNQUOTABLE = re.compile(r'["$`%\\\n]')
"""What DeepSpeed's runner cannot pass: it puts a value between double quotes in a shell line,
which pdsh reads for its own ``%`` expansions first."""


def node_exports(env: Mapping[str, str], added: Mapping[str, str]) -> tuple[list[str], str]:
    """The names a hostfile job passes to its nodes (:data:`EXPORT_ENV`), and those it does not
    with why, for the job's line (empty when none)."""
    wanted = {*added, LAUNCHER_PID_ENV, LAUNCHER_BOOT_ENV}
    wanted |= {k for k in env if k.startswith(NODE_ENV_PREFIXES)}
    wanted = {k for k in wanted if k in env and k != EXPORT_ENV}
    credentials = sorted(k for k in wanted if CREDENTIAL.search(k) and k not in added)
    unquotable = sorted(k for k in wanted if UNQUOTABLE.search(env[k]))
    why = []
    if credentials:
        why.append(
            f"{', '.join(credentials)} (credentials stay off the ssh command line: log in on "
            "each node, e.g. `wandb login` with a shared home)"
        )
    if unquotable:
        why.append(f"{', '.join(unquotable)} (a \", $, `, % or \\ DeepSpeed's runner cannot quote)")
    return sorted(wanted - {*credentials, *unquotable}), "; ".join(why)


def _shell_line(env: dict[str, str], cmd: list[str]) -> str:
    """One rank's start as a shell line (launch.txt): its environment, then the command."""
    return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()), *cmd]) + "\n"


STOP_RESEND_S = 3.0
STOP_RESEND_OVER_SSH_S = 15.0
"""The same over ssh (the hostfile form): each resend is a pdsh to every node and a process
scan there, and only a rank still importing when the first came needs it (a rank keeps a stop
it got until its next step boundary, which on a 4090 can be minutes away)."""


def _start_in_group(group: int, own: bool) -> None:
    """In a started rank, before exec: join process group ``group`` (0: a new one of its own)
    and ignore SIGUSR2 until the rank's own handler is in place. A rank this process starts
    itself (``own``) ignores SIGTERM too until then: Slurm sends it to every process of the step
    (scancel, the time limit, a preemption), and a rank still importing died of it (exit 143,
    "the ranks failed") instead of stopping at the first step with the others (this process,
    which got it too, sends SIGUSR2 until the ranks end). DeepSpeed's launcher sets its own."""
    os.setpgid(0, group)
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    if own:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


class _Ranks:
    """This node's started processes (the ranks themselves, or DeepSpeed's launcher for a
    multi-node form) and the signals the job passes on to them while it waits."""

    def __init__(
        self,
        cmd: list[str],
        envs: list[dict[str, str]],
        module: str,
        own: bool,
        nodes: NodesOverSsh | None = None,
        first_rank: int = 0,
        watch: Callable[[], tuple[int, str] | None] | None = None,
    ):
        self.module, self.own = module, own
        self.watch = watch
        """The per-node form: another node's failure mark, if any (topology.failed_node)."""
        self.peer: tuple[int, str] | None = None
        """The node whose failure stopped this node's ranks, and its line: the job's report
        when it was seen before a rank here failed, or they only lost their peers."""
        self.report: str | None = None
        """This node's own failure, as its line says it (for the other nodes' launchers)."""
        self.first_rank = first_rank
        """The global rank of this node's first (the per-node form: the node's rank × its
        ranks): a failed rank is named as its own line names it."""
        self.said_failures = 0
        self.nodes = nodes
        """The hostfile form's nodes: its ranks run under each node's sshd, no descendants of
        this process, and are reached over ssh (rank_signals)."""
        self.procs: list[subprocess.Popen] = []
        self.group = 0  # the ranks' process group: the first one's pid
        self.stopping = False
        self.interrupts = 0
        self.killed: set[int] = set()
        """Ranks this process killed (after another rank failed, or a second Ctrl-C)."""
        # The handlers come first: a stop while the ranks are being started reaches those
        # already started, and an error half way takes them down (none is left orphaned).
        self.previous = {
            signal.SIGTERM: signal.signal(signal.SIGTERM, self.forward_stop),
            signal.SIGUSR2: signal.signal(signal.SIGUSR2, self.forward_stop),
            signal.SIGINT: signal.signal(signal.SIGINT, self.interrupt),
        }
        # A closed terminal (an ssh connection dropped) sends SIGHUP: its default ended this
        # process alone, and the ranks, in their own group, trained on unseen. Now a stop like
        # SIGTERM's; under nohup (SIGHUP ignored) the job goes on, as nohup promises.
        if signal.getsignal(signal.SIGHUP) != signal.SIG_IGN:
            self.previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, self.hang_up)
        # A stop that arrives while the ranks import or load is not fatal (SIGUSR2 ignored
        # until they listen); it is re-sent every few seconds until the job ends. The ranks
        # run in a process group of their own, so a Ctrl-C in the terminal reaches this
        # process alone (interrupt()), and read no terminal (a background group that reads
        # the tty is stopped, and would never end). They hold the run dir's lock too
        # (run_lock.held_lock_fds): killed, this process alone would free it while they train.
        try:
            for env in envs:
                start = functools.partial(_start_in_group, self.group, own)
                proc = subprocess.Popen(
                    cmd,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    preexec_fn=start,
                    pass_fds=held_lock_fds(),
                )
                self.procs.append(proc)
                self.group = self.group or proc.pid
        except BaseException:
            self.kill()
            self.restore_signals()
            raise

    def forward_stop(self, signum: int, frame: object) -> None:
        self.stopping = True
        self.signal_ranks()

    def hang_up(self, signum: int, frame: object) -> None:
        print(
            "\nmemtune: SIGHUP (the terminal closed?): stopping at the next step boundary with a "
            "checkpoint; nohup, setsid, tmux or screen keep a job running after a logout",
            file=sys.stderr,
            flush=True,
        )
        self.forward_stop(signum, frame)

    def interrupt(self, signum: int, frame: object) -> None:
        # The first Ctrl-C is a stop like SIGTERM's: a checkpoint at the next step boundary,
        # exit 75. The second ends the ranks at once (SIGKILL: no tracebacks from every rank
        # and library).
        self.interrupts += 1
        if self.interrupts == 1:
            print(
                "\nmemtune: Ctrl-C: stopping at the next step boundary with a checkpoint "
                "(Ctrl-C again stops at once, without one)",
                file=sys.stderr,
                flush=True,
            )
            self.forward_stop(signum, frame)
        else:
            self.kill()

    def signal_ranks(self) -> None:
        """SIGUSR2 to the ranks themselves (never to DeepSpeed's launcher, which would kill
        them): each saves a checkpoint at the next step boundary and exits with the requeue
        code."""
        if self.nodes is not None:
            self.nodes.send(signal.SIGUSR2)
            return
        for proc in self.procs:
            if self.own:  # Popen's own send_signal: nothing once the rank is reaped
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGUSR2)
                continue
            with contextlib.suppress(psutil.Error):
                for worker in rank_processes(proc.pid, self.module):
                    with contextlib.suppress(psutil.Error):
                        worker.send_signal(signal.SIGUSR2)

    def kill(self) -> None:
        self.killed |= {i for i, p in enumerate(self.procs) if p.poll() is None}
        if self.nodes is not None:  # the ranks are sshd's on every node: not in the group
            self.nodes.send_and_wait(signal.SIGKILL)
        if self.group:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.group, signal.SIGKILL)

    def ended(self) -> bool:
        return all(p.poll() is not None for p in self.procs)

    def restore_signals(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def wait(self) -> int:
        codes: dict[int, int] = {}
        failed: tuple[int, float] | None = None  # the first rank to fail, and when
        peer_at: float | None = None  # when another node's failure was seen
        resent = watched = time.monotonic()
        while len(codes) < len(self.procs):
            now = time.monotonic()
            for i, proc in enumerate(self.procs):
                code = proc.poll()
                if code is None or i in codes:
                    continue
                codes[i] = code
                if failed is None and code not in CLEAN_CODES and i not in self.killed:
                    # after another node's failure: a consequence of it, not a cause
                    failed = (i, now) if peer_at is None else None
            if peer_at is None and failed is None and now - watched >= NODE_WATCH_S:
                watched = now
                peer_at = now if self._watch_nodes() else None
            since = failed[1] if failed else peer_at
            if since is not None and not self.killed and now - since >= RANK_FAILURE_GRACE_S:
                self.kill()  # the others cannot go on without it (or without the other node)
            every = STOP_RESEND_S if self.nodes is None else STOP_RESEND_OVER_SSH_S
            if self.stopping and now - resent >= every:
                self.signal_ranks()
                resent = now
            self._say_ssh_failures()
            time.sleep(POLL_S)
        if self.nodes is not None:
            self.nodes.finish()
            self._say_ssh_failures()
        if self.interrupts > 1:
            self.report = "stopped at once by a second Ctrl-C"
            return EXIT_INTERRUPTED
        first = failed[0] if failed else None
        if first is not None and codes[first] == EXIT_PEER_LOST and self.peer is None:
            self._watch_nodes()  # ranks that only lost their peers: another node's failure?
        if self.peer is not None and (first is None or codes[first] == EXIT_PEER_LOST):
            return EXIT_PEER_LOST  # the other node's line (said) is this node's report
        code, rank, line = job_code(codes, self.killed, first)
        if line is not None:
            who = f"rank {self.first_rank + rank}" if self.own else "DeepSpeed's launcher"
            self.report = f"{who} (pid {self.procs[rank].pid}) {line}"
            print(f"memtune: {self.report}", file=sys.stderr, flush=True)
        return code

    def _watch_nodes(self) -> bool:
        """Whether another node of a per-node job has marked its failure, said once, in one
        line: this node's ranks would wait for its ranks (torch's rendezvous, a collective)
        until torch's timeout, so they are stopped as after a rank's failure here."""
        if self.watch is None:
            return False
        self.peer = self.watch()
        if self.peer is None:
            return False
        node, why = self.peer
        print(
            f"memtune: node {node} failed: {why}; stopping this node's ranks (they cannot go on "
            f"without it; exit code {EXIT_PEER_LOST})",
            file=sys.stderr,
            flush=True,
        )
        return True

    def _say_ssh_failures(self) -> None:
        """A signal pdsh could not deliver, said when it is known (the stop, re-sent, may still
        get through), with the command that sends it by hand."""
        if self.nodes is None:
            return
        self.nodes.collect()
        while len(self.nodes.failures) > self.said_failures:
            said = self.nodes.failures[self.said_failures] or "no reason given"
            self.said_failures += 1
            by_hand = shlex.join(self.nodes.command(signal.SIGUSR2))
            print(
                f"memtune: a signal for the ranks could not be sent over ssh ({said}); to stop "
                f"them by hand: PDSH_RCMD_TYPE=ssh {by_hand}",
                file=sys.stderr,
                flush=True,
            )


CLEAN_CODES = (0, EXIT_REQUEUE)
"""A rank that exits with these ended with the others (a stop with a checkpoint is agreed by
every rank in a collective): nothing to take down."""


def job_code(
    codes: dict[int, int], killed: set[int], first_failed: int | None
) -> tuple[int, int, str | None]:
    """The job's exit code from its ranks' (``codes``: rank → return code, negative for a
    signal), the rank it comes from and what happened to it. Ranks this process killed after
    the first failure do not count; a rank that only lost its peer (EXIT_PEER_LOST) gives way
    to one that failed for a reason of its own. The code does not depend on the order in which
    the ranks were seen to end."""
    if first_failed is None:
        return (EXIT_REQUEUE if EXIT_REQUEUE in codes.values() else 0), 0, None
    rank = first_failed
    if codes[rank] == EXIT_PEER_LOST:
        causes = [
            r
            for r, c in codes.items()
            if r not in killed and c not in (*CLEAN_CODES, EXIT_PEER_LOST)
        ]
        rank = min(causes, default=rank)
    code = codes[rank]
    stopped = "; the other ranks were stopped" if killed - {rank} else ""
    if code < 0:
        name = signal.Signals(-code).name
        return 128 - code, rank, f"was killed by {name} (signal {-code}){stopped}"
    return code, rank, f"exited with code {code}{stopped}"


def rank_processes(pid: int, module: str = WORKER_MODULE) -> list[psutil.Process]:
    """The rank processes under a pid (the job, or DeepSpeed's launcher on a node), by their
    command line."""
    root = psutil.Process(pid)
    found = []
    for p in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            if is_rank(p.cmdline(), module):
                found.append(p)
    return found
