"""The job: what train.py does once per run (never per rank), inside Hydra's main.

Config → memory plan (refusal) → GPU preflight → data → run dir → the ranks; the order makes a
run that cannot fit, or a machine that cannot run it, stop before anything is tokenized.
"""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import signal
import sys
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, read_write

from memtune.checkpoints import find_latest
from memtune.config import ConfigError, RunConfig, load_run_config
from memtune.config.decisions import Decisions, rank_machine
from memtune.config.given import given_config
from memtune.exit_codes import (
    EXIT_CONFIG,
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_OOM,
    EXIT_PEER_LOST,
    EXIT_REQUEUE,
)
from memtune.filesystem import write_atomic
from memtune.launcher import oom
from memtune.launcher.preflight import PreflightError, for_launch, planned_device_gib
from memtune.launcher.prepare import (
    RunFinished,
    announce,
    decide,
    prepare_run_dir,
    refuse_files_not_ours,
    stop_if_finished,
)
from memtune.launcher.spawn import check_master_port, launch, tell_nodes_of_failure
from memtune.launcher.sweep_report import record_refused
from memtune.launcher.topology import (
    RANKS_PER_NODE_ENV,
    NodeSpec,
    NodeZeroStopped,
    announce_ready,
    announce_stopped,
    check_nodes_reachable,
    check_sweep_point_nodes,
    failed_node,
    preparing,
    resolve,
    size_from_allocation,
    this_node_rank,
    wait_ready,
    wait_stopped,
)
from memtune.machine import name_cpu_accelerator, versions_line
from memtune.memory.fit import Fitted, format_step_estimates, format_suggestions
from memtune.memory.long_context_choice import format_longest_sequence
from memtune.memory.plan_text import format_plan
from memtune.run_lock import LockNotWritten, RunDirBusy, hold, hold_dated
from memtune.rundir import RecordError, RunDir

WAIT_FOR_NODE0_S = 3600.0
"""Per-node form: how long nodes 1.. wait for node 0 to tokenize the data and plan, and past
it while node 0 still says it is preparing (topology.preparing)."""
WAIT_FOR_STOPPED_S = 60.0
"""Per-node form on Slurm, a stop with a checkpoint: how long node 0 waits for the others to
report theirs (well inside the 120 s between --signal=B:USR2@120 and the time limit)."""


def missing_slurm(argv: list[str]) -> str | None:
    """A Slurm sweep (``-m hydra/launcher=slurm``) on a machine without Slurm's commands:
    said before Hydra starts the sweep (submitit would raise from inside it, a traceback)."""
    sweep = any(a in ("-m", "--multirun") for a in argv)
    if not sweep or "hydra/launcher=slurm" not in argv:
        return None
    missing = [c for c in ("sbatch", "srun") if shutil.which(c) is None]
    if not missing:
        return None
    return (
        f"hydra/launcher=slurm submits one Slurm job per point, but {' and '.join(missing)} "
        f"{'is' if len(missing) == 1 else 'are'} not on PATH here: run the sweep on a Slurm "
        "login node, or drop hydra/launcher=slurm to run the points one after another here"
    )


def print_plan(cfg: DictConfig) -> int:
    """plan_only=true: the per-rank memory plan with what a launch would decide; writes
    nothing, launches nothing."""
    try:
        given = given_config(cfg, inputs=False)
        fitted = decide(given, refuse=False)
    except ConfigError as err:
        print(f"memtune: config error: {err}", file=sys.stderr)
        return EXIT_CONFIG
    settings, machine = fitted.cfg, fitted.machine
    print(format_plan(settings, fitted.given, fitted.given_plan))
    if fitted.changes:
        print(f"\nplan.auto_fit would run it with: {' '.join(fitted.changes)}")
        print(format_plan(settings, fitted.decisions, fitted.plan))
    elif not fitted.given_plan.fits:
        assert fitted.given_plan.counts is not None  # memory.estimate.plan always sets them
        print(format_suggestions(settings, fitted.given, fitted.given_plan.counts, machine))
    assert fitted.plan.counts is not None
    estimate = format_step_estimates(settings, fitted.decisions, fitted.plan.counts, machine)
    if estimate:
        print(estimate)
    if settings.plan.max_seq_len_search and settings.plan.device_gib is not None:
        counts = fitted.plan.counts
        print(format_longest_sequence(settings, fitted.decisions, counts, machine))
    print(f"planned with {versions_line()}")
    return 0


def after_out_of_memory(
    cfg: RunConfig, d: Decisions, run_dir: Path, spec: Any, env: dict[str, str]
) -> int:
    """Explain an out-of-memory stop; with plan.auto_fit restart once, from the last
    checkpoint, with the cheapest change that saves memory and keeps the checkpoint valid."""
    machine = rank_machine()
    oom.say(
        f"out of memory (exit code {EXIT_OOM}); run dir {run_dir}\n"
        f"{oom.explain(cfg, d, run_dir, machine)}"
    )
    restart = oom.restart_plan(cfg, d, run_dir, machine)
    if restart is None:
        if cfg.plan.auto_fit:
            oom.say(
                "plan.auto_fit: no restart (done once already, or nothing left that "
                "continues this checkpoint): change the config as above and run again"
            )
        return EXIT_OOM
    variant, changes = restart
    rd = RunDir(run_dir)
    if cfg.resume == "never" or find_latest(rd.checkpoints)[0] is not None:
        # The restart continues this run: its newest checkpoint, else its start (a resume=PATH
        # with nothing saved since still starts from PATH; resume=never must not set this run
        # aside as an earlier one).
        cfg = replace(cfg, resume="auto")
    fresh, _ = prepare_run_dir(Fitted.as_decided(cfg, variant, machine), run_dir, restart=changes)
    resumed = rd.read_resume().checkpoint
    oom.record_restart(run_dir, changes, resumed)
    where = f"from {resumed}" if resumed else "from the start (no checkpoint yet)"
    oom.say(
        f"plan.auto_fit: restarting {where} with {' '.join(changes)} (recorded in {rd.oom_restart})"
    )
    code = launch(fresh, run_dir, spec=spec, extra_env=env)
    if code != 0 and oom.reports(run_dir):  # the restart ran out of memory too
        oom.say(
            f"out of memory again after the restart (exit code {code}); run dir {run_dir}\n"
            f"{oom.explain(fresh, variant, run_dir, machine)}"
        )
    return code


def run_job(cfg: DictConfig) -> int:
    """One job: a plan (plan_only), or validate, plan, preflight, prepare the run dir and start
    this node's ranks, holding the run dir's lock throughout (one job per run dir). Exits with
    the job's code unless it is a point of a sweep that goes on: then returns it (0: done). In
    a sweep an exception memtune does not catch ends its point only (:func:`_crashed`)."""
    name_cpu_accelerator()
    hydra_cfg = HydraConfig.get()
    sweeping = hydra_cfg.mode == RunMode.MULTIRUN
    if cfg.run_dir and sweeping:
        print(
            "memtune: config error: run_dir cannot be set in a sweep (-m): every point "
            "needs its own dir; set hydra.sweep.dir instead",
            file=sys.stderr,
        )
        sys.exit(EXIT_CONFIG)
    run_dir = Path(hydra_cfg.runtime.output_dir).resolve()
    if cfg.plan_only:  # reads no run dir and writes none: nothing to hold
        return _point(cfg, run_dir, sweeping)
    if sweeping and (other := _another_points_dir(run_dir, hydra_cfg)) is not None:
        line, row = _shared_dir_refusal(run_dir, other, hydra_cfg)
        print(f"memtune: config error: {line}", file=sys.stderr)
        _refused_point(hydra_cfg, row)
        return _failed(EXIT_CONFIG, sweeping)  # nothing written into the other point's dir
    try:
        node_rank = this_node_rank(cfg.launcher)
        dated = _dated_by_hydra(cfg, hydra_cfg, sweeping)
        taken = [] if dated else RunDir(run_dir).not_ours(node_rank)
        if taken:  # the user's files under memtune's names: nothing written, not the refusal
            try:
                refuse_files_not_ours(RunDir(run_dir), taken)
            except ConfigError as err:
                _tell_other_nodes(cfg, run_dir, str(err), taken)
                raise
        with hold_dated(run_dir) if dated else hold(run_dir, node_rank) as held:
            if held != run_dir:
                print(
                    f"memtune: run dir {run_dir} was taken by another start of "
                    f"{cfg.experiment} in the same second (running, or one that stopped "
                    f"already): this job writes to {held.name}",
                    flush=True,
                )
                run_dir = held
            return _point(cfg, run_dir, sweeping)
    except KeyboardInterrupt:
        # Ctrl-C before the ranks started (planning, tokenizing): nothing to save.
        print("\nmemtune: interrupted before any rank started", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
    except (RunDirBusy, LockNotWritten, ConfigError) as err:
        # Another job's run dir, no node rank to tell which lock is this node's, or a lock
        # that cannot be written (a full disk): nothing of this job's to write there (no
        # exit.json), only the refusal.
        kind = {ConfigError: "config error: ", LockNotWritten: "error: "}.get(type(err), "")
        print(f"memtune: {kind}{err}", file=sys.stderr)
        if sweeping:
            _refused_point(hydra_cfg, f"{kind}{err}")
        return _failed(EXIT_CONFIG, sweeping)
    except Exception as err:
        if not sweeping:
            raise  # a single run: Hydra prints the traceback, exit 1
        return _crashed(cfg, None, err)  # before the run dir was held: nothing written there


def _point(cfg: DictConfig, run_dir: Path, sweeping: bool) -> int:
    """The job (:func:`_run`); in a sweep, an exception memtune does not catch ends this point
    only (:func:`_crashed`)."""
    try:
        return _run(cfg, run_dir, sweeping)
    except KeyboardInterrupt:
        if sweeping:
            _interrupted_point(cfg, run_dir)
        raise  # run_job's line; the sweep stops here
    except (RunDirBusy, LockNotWritten, ConfigError):
        raise  # memtune's own refusals: run_job's one line, exit 2, in a sweep too
    except Exception as err:
        if not sweeping:
            raise  # a single run: Hydra prints the traceback, exit 1
        return _crashed(cfg, run_dir, err)


def _interrupted_point(cfg: DictConfig, run_dir: Path) -> None:
    """A sweep point stopped by Ctrl-C before its ranks started (planning, tokenizing): its run
    dir records that (.hydra/, exit.json), as a refusal's does. With no record it was a
    "not run" row of the sweep report, as if never started."""
    with contextlib.suppress(ConfigError, OSError):
        if this_node_rank(cfg.launcher) == 0 and not (cfg.plan_only or _finished_run(run_dir)):
            _record_composition(cfg, run_dir)
            _record_exit(run_dir, EXIT_INTERRUPTED, "interrupted before any rank started")


def _crashed(cfg: DictConfig, run_dir: Path | None, err: Exception) -> int:
    """A sweep point stopped by an exception memtune does not catch (a library's error on an
    input no check foresaw, a bug): Hydra's sweeper kept it and raised it after the last
    point, which ended the sweep in a traceback without its report, the point's dir without
    .hydra/ (so that a later report left it out). Its traceback, its line, and its row: in
    its run dir (.hydra/ and exit.json, code EXIT_ERROR) as for a refusal, or, ``run_dir``
    None (raised before the job held it), among the sweep dir's refused points."""
    traceback.print_exception(err, file=sys.stderr)
    why = _error_line(err)
    if run_dir is not None:
        return _stopped_before_launch(cfg, run_dir, "error", why, True, code=EXIT_ERROR)
    print(f"memtune: error: {why}", file=sys.stderr)
    _refused_point(HydraConfig.get(), f"error: {why}", code=EXIT_ERROR)
    return EXIT_ERROR


def _refused_point(hydra_cfg: Any, error: str, code: int | None = None) -> None:
    """A sweep point refused (or, ``code`` given, failed) before it wrote into its run dir: its
    row of the sweep report, kept in the sweep dir (it had none: the report listed the sweep
    without it)."""
    with contextlib.suppress(OSError):  # the refusal, said above, is the report then
        overrides = list(hydra_cfg.overrides.task)
        record_refused(Path(hydra_cfg.sweep.dir), hydra_cfg.job.num, overrides, error, code)


def _dated_by_hydra(cfg: DictConfig, hydra_cfg: Any, sweeping: bool) -> bool:
    """The run dir is the one Hydra dates for a single run (outputs/DATE/TIME-EXPERIMENT): the
    user named none (neither run_dir nor hydra.run.dir), so another start in the same second
    may have been given the same name (run_lock.hold_dated takes the next free one)."""
    named = any(o.lstrip("+~").startswith("hydra.run.dir=") for o in hydra_cfg.overrides.hydra)
    return cfg.run_dir is None and not sweeping and not named


def _shared_dir_refusal(run_dir: Path, other: int, hydra_cfg: Any) -> tuple[str, str]:
    """Why a sweep point is refused the run dir another point's run holds (the line, and its
    report row's words). A point of this number with other overrides is another sweep's: two
    sweeps into one hydra.sweep.dir (started together, or the dir reused for other values),
    which the line blamed on hydra.sweep.subdir, a setting the user had not touched."""
    num = hydra_cfg.job.num
    if other == num:
        return (
            f"run dir {run_dir} holds point {other} of another sweep (other overrides than "
            f"this point {num}'s): hydra.sweep.dir={hydra_cfg.sweep.dir} is another sweep's; "
            "give this sweep a dir of its own",
            f"its run dir {run_dir.name} holds point {other} of another sweep",
        )
    return (
        f"run dir {run_dir} holds point {other}'s run of this sweep and this is point {num}: "
        f"hydra.sweep.subdir={hydra_cfg.sweep.subdir} gives several points one dir; keep "
        "${hydra.job.num} in it (the default), so that every point has its own",
        f"its run dir {run_dir.name} holds point {other}'s run",
    )


def _another_points_dir(run_dir: Path, hydra_cfg: Any) -> int | None:
    """The sweep point (hydra.job.num) whose run a sweep point's run dir already holds, when it
    is another point's: a hydra.sweep.subdir that does not tell the points apart gives several
    one dir, where the second point was refused as a resume of the first and rewrote its
    record (.hydra/, exit.json), or resumed it. A point is told by its overrides, not its
    number: the same point again (a requeue, the sweep run again, or another sweep whose
    subdir is ${hydra.job.override_dirname}, where a point's number may differ) is None."""
    import yaml

    record_dir = run_dir / ".hydra"
    try:
        record = yaml.safe_load((record_dir / "hydra.yaml").read_text())
        other = record["hydra"]["job"]["num"]
        sweep = record["hydra"]["mode"] == "MULTIRUN"
        overrides = yaml.safe_load((record_dir / "overrides.yaml").read_text())
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return None  # no record, or not memtune's: the checks of the run dir say so
    same = list(overrides or []) == list(hydra_cfg.overrides.task)
    return other if sweep and isinstance(other, int) and not same else None


def _tell_other_nodes(cfg: DictConfig, run_dir: Path, error: str, taken: list[Path]) -> None:
    """Node 0 of a per-node job refused before it holds the run dir: the other nodes wait for
    its launch.json (topology.wait_ready), so it says why there, unless a launch.json there is
    among what is not memtune's. The one record written into such a dir, so that no node
    waits an hour for a job that will not start."""
    with contextlib.suppress(ConfigError, OSError):
        spec = resolve(given_config(cfg))
        per_node_0 = spec.form == "per-node" and spec.node_rank == 0
        if per_node_0 and RunDir(run_dir).nodes_ready not in taken:
            announce_ready(run_dir, spec, error=error)


def _record_composition(cfg: DictConfig, run_dir: Path) -> None:
    """``.hydra/``: the composed config, Hydra's own and the command-line overrides, as Hydra
    writes them (conf/config.yaml turns Hydra's writing off: it came before the lock), once
    the start has laid the run out or was refused: a start of a finished run (nothing to
    train) leaves the record of the start that trained it."""
    hydra_cfg: Any = HydraConfig.instance().cfg  # the whole config under its hydra key
    if hydra_cfg.hydra.output_subdir is not None:
        return  # set on the command line: Hydra wrote it
    if Path(hydra_cfg.hydra.runtime.output_dir).resolve() != run_dir:
        # the dated dir another start took first (run_lock.hold_dated): this job's is named
        hydra_cfg = copy.deepcopy(hydra_cfg)
        with read_write(hydra_cfg.hydra.runtime):
            hydra_cfg.hydra.runtime.output_dir = str(run_dir)
    record = run_dir / ".hydra"
    with contextlib.suppress(OSError):  # a full disk is said by the step that needs the space
        record.mkdir(parents=True, exist_ok=True)
        write_atomic(record / "config.yaml", OmegaConf.to_yaml(cfg))
        write_atomic(record / "hydra.yaml", OmegaConf.to_yaml(hydra_cfg))
        overrides = hydra_cfg.hydra.overrides.task
        write_atomic(record / "overrides.yaml", OmegaConf.to_yaml(overrides))


def _record_exit(run_dir: Path, code: int, error: str) -> None:
    """exit.json for a job that stopped before launch; when even that cannot be written (the
    disk that stopped it is full), the one line already said is the report."""
    rd = RunDir(run_dir)
    if rd.exit.exists() and not (rd.held_a_run() or rd.refused_here()):
        return  # a user's exit.json (not_ours refuses a start over it; a race got here)
    with contextlib.suppress(OSError):
        rd.write_exit(code, error)


def _failed(code: int, sweeping: bool) -> int:
    """The one end of a failed job: exit with its code, or in a sweep that goes on return it
    (the other points still run; train.py exits 1 after the last when one failed)."""
    if not sweeping:
        sys.exit(code)
    return code


@dataclass
class Job:
    """What this node launches: the run's resolved config, its place in the job, and the
    environment the GPU preflight decided for the ranks."""

    cfg: RunConfig
    decisions: Decisions
    spec: NodeSpec
    env: dict[str, str]


def _run(cfg: DictConfig, run_dir: Path, sweeping: bool) -> int:
    """prepare → launch → report; a failure before launch ends in _stopped_before_launch."""
    hydra_cfg = HydraConfig.get()
    if sweeping and cfg.logger.group is None:
        cfg.logger.group = Path(hydra_cfg.sweep.dir).name  # one wandb group per sweep
    try:
        if sweeping and os.environ.get("SUBMITIT_EXECUTOR") == "slurm":
            check_sweep_point_nodes()
        overrides = list(hydra_cfg.overrides.task)
        sized = size_from_allocation(cfg.launcher, overrides, launching=not cfg.plan_only)
    except ConfigError as err:
        return _stopped_before_launch(cfg, run_dir, "config error", str(err), sweeping)
    if sized:
        print(
            f"memtune: Slurm job {os.environ.get('SLURM_JOB_ID')}: {' '.join(sized)}, sized "
            "from its allocation (launcher.from_allocation)",
            flush=True,
        )
    if cfg.plan_only:
        # Each point of a sweep plans (it ended the sweep after its first point, exit 0).
        code = print_plan(cfg)
        return _failed(code, sweeping) if code else 0
    job = _prepare(cfg, run_dir, sweeping)
    if isinstance(job, int):
        return job
    return _report(_launch(job, run_dir), job.spec, run_dir, sweeping)


def _prepare(cfg: DictConfig, run_dir: Path, sweeping: bool) -> Job | int:
    """Validate, decide, check the GPUs, lay out the run dir; the job's code when there is
    nothing to launch (stopped before launch; 0: preprocess_only, a finished run)."""
    spec = None
    try:
        given = given_config(cfg)
        spec = resolve(given)
        check_master_port(given, spec)
        if not (given.preprocess_only or given.plan_only):
            check_nodes_reachable(spec)
        if given.preprocess_only and spec.node_rank != 0:
            # Node 0 tokenizes into the shared cache and starts no rank: nothing to wait for
            # (this node waited an hour for a ready mark node 0 never writes).
            print(f"memtune: preprocess_only: node {spec.node_rank} has nothing to do", flush=True)
            return 0
        beating = spec.form == "per-node" and spec.node_rank == 0
        with preparing(run_dir, spec) if beating else contextlib.nullcontext():
            run_cfg, decisions, env = _decide_and_lay_out(cfg, given, spec, run_dir)
        if spec.node_rank == 0:  # node 0's record: another node's has its own node_rank
            _record_composition(cfg, run_dir)
    except RunFinished as finished:
        # Nothing to train: say so instead of starting the ranks to repeat the old summary.
        # A per-node job's node 0 tells the other nodes (they wait for its word), and no node
        # writes a record of the run: they stay those of the start that trained it.
        if spec is not None and spec.form == "per-node" and spec.node_rank == 0:
            _mark_ready(run_dir, spec, finished=str(finished))
        print(f"memtune: {finished}; run dir {run_dir}", flush=True)
        return 0
    except (ConfigError, PreflightError, OSError) as err:
        stopped = _why_stopped(err)
        if stopped is None:
            _tell_of_crash(spec, run_dir, err)
            raise
        kind, why, told = stopped
        if spec is not None and spec.form == "per-node" and spec.node_rank == 0:
            _mark_ready(run_dir, spec, error=told)
        elif not isinstance(err, NodeZeroStopped):
            _tell_of_crash(spec, run_dir, err, f"{kind}: {why}", EXIT_CONFIG)
        # Another node of a per-node job says why on its own output (and preflight-nodeK.json):
        # exit.json and .hydra/ are node 0's.
        node_rank = None if spec is None else spec.node_rank
        return _stopped_before_launch(cfg, run_dir, kind, why, sweeping, node_rank)
    except Exception as err:  # a library's error on an input no check foresaw, a bug
        _tell_of_crash(spec, run_dir, err)
        raise
    if run_cfg.preprocess_only:
        print(f"memtune: preprocess_only: run dir {run_dir} laid out, no ranks started", flush=True)
        return 0
    if spec.form == "per-node" and spec.node_rank == 0:
        failed = failed_node(run_dir, spec)
        if failed is not None:  # another node stopped while this one prepared: no rank starts
            told = f"node {failed[0]} failed: {failed[1]}"
            _mark_ready(run_dir, spec, error=told)
            why = f"{told}; node 0 starts no rank"
            return _stopped_before_launch(cfg, run_dir, "error", why, sweeping, 0, EXIT_PEER_LOST)
        unsaid = _mark_ready(run_dir, spec)
        if unsaid:  # not written: nor can the reason be (nodes 1.. wait for WAIT_FOR_NODE0_S)
            return _stopped_before_launch(cfg, run_dir, "error", unsaid, sweeping, 0)
    return Job(run_cfg, decisions, spec, env)


def _error_line(err: BaseException) -> str:
    """An exception memtune does not catch, as one line: its type and message."""
    return " ".join(f"{type(err).__name__}: {err}".split()).removesuffix(":")


def _tell_of_crash(
    spec: NodeSpec | None,
    run_dir: Path,
    err: Exception,
    line: str | None = None,
    code: int = EXIT_ERROR,
) -> None:
    """A node of a per-node job stopped before its ranks: by an exception memtune does not
    catch (its traceback follows, or a sweep's failed row), or on another node than 0 by a
    refusal (``line``, ``code``). Node 0's word is its ready mark: the other nodes waited for
    it until WAIT_FOR_NODE0_S (an hour) and then blamed the command; told, they stop at once
    with the exception's line. Node K's is its failure mark (spawn.tell_nodes_of_failure):
    node 0's ranks, and the other nodes', waited for its ranks in torch's rendezvous until
    torch's timeout (a node whose GPUs differ in number from node 0's, a preflight that
    failed there); their launchers now stop them."""
    if spec is None or spec.form != "per-node":
        return
    why = line or _error_line(err)
    if spec.node_rank == 0:
        _mark_ready(run_dir, spec, error=f"node 0 stopped on an error: {why}")
    else:
        tell_nodes_of_failure(run_dir, spec, code, why)


def _why_stopped(err: Exception) -> tuple[str, str, str] | None:
    """A failure before launch as (its kind, its line, what node 0 tells the other nodes of a
    per-node job). An OSError naming a file: a record of the run dir that cannot be written
    (a folder in its place, a read-only or full disk) or a file that cannot be read, one line
    naming it, not a traceback; one that names no file is None, left to say where it came
    from."""
    if isinstance(err, ConfigError):
        return "config error", str(err), str(err)
    if isinstance(err, PreflightError):
        return "preflight", str(err), f"the GPU preflight failed on node 0: {err}"
    if not isinstance(err, OSError) or not err.filename:
        return None
    why = f"cannot use {err.filename} ({type(err).__name__}: {err.strerror or err})"
    return "error", why, why


def _cannot_write(path: Path, err: OSError) -> str:
    return f"cannot write {path} ({type(err).__name__}: {err.strerror or err})"


def _mark_ready(
    run_dir: Path, spec: NodeSpec, error: str | None = None, finished: str | None = None
) -> str | None:
    """Node 0's word to the other nodes (topology.announce_ready); when it cannot be written
    (a full disk), why, in one line: nodes 1.. then wait for it until WAIT_FOR_NODE0_S. A
    word that stops them (``error``, ``finished``) not written is said here; the caller of
    the plain "ready" ends the job with the returned line."""
    try:
        announce_ready(run_dir, spec, error=error, finished=finished)
    except OSError as err:
        unsaid = _cannot_write(RunDir(run_dir).nodes_ready, err)
        if error is not None or finished is not None:
            print(f"memtune: {unsaid}: the other nodes were not told", file=sys.stderr)
        return unsaid
    return None


def _decide_and_lay_out(
    cfg: DictConfig, given: RunConfig, spec: NodeSpec, run_dir: Path
) -> tuple[RunConfig, Decisions, dict[str, str]]:
    """Config and memory first, then the GPUs, then the data: a run that cannot fit, or a
    machine that cannot run it, stops before anything is tokenized. Node 0 decides and writes
    the run dir; the other nodes of a per-node job wait for it and read it."""
    fitted = decide(given, say=False) if spec.node_rank == 0 else None
    run_dir.mkdir(parents=True, exist_ok=True)
    # Nodes 1.. of a run that ended well: node 0's word first, which may be that it is
    # finished (they ran their GPU preflight and rewrote preflight-nodeK.json for nothing).
    hear_first = fitted is None and _finished_run(run_dir)
    if fitted is not None:
        stop_if_finished(fitted, run_dir)  # before the preflight's record and the data
    elif hear_first:
        _wait_for_node0(run_dir, spec)
    rd = RunDir(run_dir)
    preflight = rd.preflight(spec.node_rank)
    env: dict[str, str]
    measured: float | None
    if given.preprocess_only:  # tokenizing needs no GPU: a login node prepares the cache
        env, measured = {}, None
    else:
        planned = None if fitted is None else planned_device_gib(fitted.plan)
        env, measured = for_launch(
            given.launcher, spec.ranks_per_node, spec.nnodes, preflight, planned
        )
    if fitted is None:
        if not hear_first:
            _wait_for_node0(run_dir, spec)
        try:
            decisions = rd.read_decisions()
        except RecordError as err:
            raise ConfigError(str(err)) from None
        run_cfg = load_run_config(rd.config)
        _check_ranks_per_node(run_cfg, spec)
        return run_cfg, decisions, env
    if measured is not None:
        print(
            f"memtune: preflight: {measured:g} GB/s all-reduce bus bandwidth between the "
            f"GPUs (plan.link_gb_s was {given.plan.link_gb_s}); the run's choices and "
            "step-time estimate use it",
            flush=True,
        )
        # Decided again: auto_fit and the long-context choice order variants by step time.
        fitted = decide(given, link_gb_s=measured, say=False)
    fitted = oom.still_restarted(fitted, run_dir)
    announce(fitted)
    # A finished run: nothing to train, and its records stay the ones it trained with (a
    # per-node job's node 0 says so to the other nodes: _prepare).
    return (*prepare_run_dir(fitted, run_dir, finished_stops=True), env)


def _check_ranks_per_node(run_cfg: RunConfig, spec: NodeSpec) -> None:
    """Nodes 1..: the ranks this node would start (sized from its own allocation: Slurm's
    ``--gpus=6`` on 2 nodes gives 4 and 2) are node 0's per node, or the ranks would meet in a
    world of two sizes (duplicate ranks, missing ones: a hang until torch's timeout)."""
    lc = run_cfg.launcher
    planned = lc.num_ranks // lc.nnodes
    if spec.ranks_per_node != planned:
        own = RANKS_PER_NODE_ENV[0]  # CPU nodes' count (topology.size_from_allocation)
        if os.environ.get(own):
            how = f"${own}={planned} on every node"
        elif os.environ.get("SLURM_JOB_ID"):
            how = f"on Slurm, ask for GPUs per node, --gpus-per-node={planned}, not a total"
        else:
            how = f"the same launcher.num_ranks={lc.num_ranks} on every node"
        raise ConfigError(
            f"node {spec.node_rank} would start {spec.ranks_per_node} rank(s) and node 0 "
            f"planned {planned} per node ({lc.num_ranks} ranks on {lc.nnodes} nodes): every "
            f"node of a job runs as many ranks ({how})"
        )


def _wait_for_node0(run_dir: Path, spec: NodeSpec) -> None:
    """Nodes 1.. of a per-node job: until node 0 has prepared the run dir for this launch;
    RunFinished when it says the run is finished (nothing to start)."""
    print(f"memtune: node {spec.node_rank}: waiting for node 0 to prepare {run_dir}")
    finished = wait_ready(run_dir, spec, timeout_s=WAIT_FOR_NODE0_S)
    if finished is not None:
        raise RunFinished(finished)


def _stopped_before_launch(
    cfg: DictConfig,
    run_dir: Path,
    kind: str,
    error: str,
    sweeping: bool,
    node_rank: int | None = None,
    code: int = EXIT_CONFIG,
) -> int:
    """The one place that decides what a failure before launch ends: this job, or in a sweep
    this point only (the other points still run). The run dir Hydra made says why it holds no
    run, and what was asked (.hydra/): node 0's to write; ``code`` is the job's (EXIT_ERROR:
    an exception memtune does not catch, in a sweep). ``node_rank`` None: stopped before
    this node's place was resolved (its settings failed), so the node the run-dir lock was
    taken for (topology.this_node_rank); node 1 of a per-node job wrote exit.json and .hydra/
    when its own settings failed."""
    print(f"memtune: {kind}: {error}", file=sys.stderr)
    if node_rank is None:
        try:
            node_rank = this_node_rank(cfg.launcher)
        except ConfigError:  # no node rank to tell (run_job refused it first): not node 0's
            node_rank = -1
    if node_rank == 0 and not (cfg.plan_only or _finished_run(run_dir)):
        _record_composition(cfg, run_dir)
        _record_exit(run_dir, code, f"{kind}: {error}")
    return _failed(code, sweeping)


def _finished_run(run_dir: Path) -> bool:
    """A run dir whose run ended well (exit.json code 0): a start refused there (a setting
    the checkpoint contradicts) keeps its records, or the run would no longer count as
    finished and the next right start would train and export it again."""
    rd = RunDir(run_dir)
    if not (rd.held_a_run() and rd.exit.is_file()):
        return False
    try:
        return rd.read_exit().code == 0
    except (OSError, ValueError):  # RecordError is a ValueError
        return False


def _launch(job: Job, run_dir: Path) -> int:
    """This node's ranks to their end; after an out-of-memory stop, plan.auto_fit's restart."""
    print(f"memtune: run dir {run_dir}", flush=True)
    code = launch(job.cfg, run_dir, spec=job.spec, extra_env=job.env)
    # Any rank's report counts, whatever the code (a peer that lost its connection may have
    # exited first).
    spec = job.spec
    if code != 0 and oom.reports(run_dir) and spec.node_rank == 0 and spec.form != "per-node":
        code = after_out_of_memory(job.cfg, job.decisions, run_dir, spec, job.env)
    return code


def _report(code: int, spec: NodeSpec, run_dir: Path, sweeping: bool) -> int:
    """exit.json and the closing line on node 0; the exit code on every node."""
    if spec.form == "per-node" and code == EXIT_REQUEUE and os.environ.get("SLURM_STEP_ID"):
        # A stop with a checkpoint is node 0's to report (exit 75, the requeue), and last: under
        # srun --kill-on-bad-exit the first non-zero exit kills the other nodes' tasks, which
        # would then end the job FAILED instead of requeued (topology.wait_stopped).
        if spec.node_rank != 0:
            announce_stopped(run_dir, spec)
            sys.exit(0)
        late = wait_stopped(run_dir, spec, timeout_s=WAIT_FOR_STOPPED_S)
        if late:
            print(
                f"memtune: node(s) {late} did not report their stop within "
                f"{WAIT_FOR_STOPPED_S:.0f} s",
                file=sys.stderr,
            )
    if spec.node_rank != 0:
        sys.exit(code)
    if code == EXIT_REQUEUE and os.environ.get("SUBMITIT_EXECUTOR") == "slurm":
        # A sweep point in a submitit job: its checkpoint is saved; submitit's own handler for
        # the same signal now requeues the job (hydra/launcher=slurm, max_num_timeout).
        signal.raise_signal(signal.SIGUSR2)
    error = None
    if spec.form == "per-node" and code not in (0, EXIT_REQUEUE, EXIT_INTERRUPTED):
        failed = failed_node(run_dir, spec)  # another node's failure stopped this one's ranks
        error = None if failed is None else f"node {failed[0]} failed: {failed[1]}"
    RunDir(run_dir).write_exit(code, error)
    if code == EXIT_REQUEUE and find_latest(RunDir(run_dir).checkpoints)[0] is None:
        print(
            f"memtune: stopped before the first step (exit code {code}): nothing was saved, the "
            f"same command starts over; run dir {run_dir}"
        )
    elif code == EXIT_REQUEUE:
        print(f"memtune: stopped with a checkpoint (exit code {code}); run dir {run_dir}")
    elif code == EXIT_INTERRUPTED:
        print(
            f"memtune: stopped at once by a second Ctrl-C (exit code {code}); the same command "
            f"continues from the last saved checkpoint; run dir {run_dir}",
            file=sys.stderr,
        )
    elif code != 0:
        print(f"memtune: the ranks failed (exit code {code}); run dir {run_dir}", file=sys.stderr)
    if code == 0:
        return 0
    stopped = code in (EXIT_REQUEUE, EXIT_INTERRUPTED) and not os.environ.get("SUBMITIT_EXECUTOR")
    if sweeping and stopped:
        # A stop (Ctrl-C, SIGTERM) of a local sweep stops the sweep, not just this point.
        print("memtune: the sweep stops here (`memtune report` writes its table)", flush=True)
    return _failed(code, sweeping and not stopped)
