"""The job's side of an out-of-memory stop: say what happened and what to change, and with
plan.auto_fit restart once from the last checkpoint with a variant that needs less.

A rank that fails to allocate writes RUN_DIR/oom-rankN.json (rundir.OomReport) and exits
EXIT_OOM; the job's spawner then stops the other ranks (they wait in a collective the failed
rank never joins).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from memtune.config import ConfigError, RunConfig
from memtune.config.decisions import Decisions, RankMachine
from memtune.memory.counts import count_params
from memtune.memory.estimate import plan
from memtune.memory.fit import Fitted, as_restarted, format_suggestions, out_of_memory_variant
from memtune.rundir import OomReport, OomRestart, RecordError, RunDir, at_step


def reports(run_dir: Path) -> list[OomReport]:
    return RunDir(run_dir).oom_reports()


def explain(cfg: RunConfig, d: Decisions, run_dir: Path, machine: RankMachine) -> str:
    """Which ranks, at which step, planned vs measured, and the changes that save memory."""
    lines = []
    for r in reports(run_dir):
        measured = r.measured.get(r.measure, 0.0)
        lines.append(
            f"rank {r.rank} ran out of memory {at_step(r.step)}: planned "
            + (f"{r.planned_gib:.2f} GiB" if r.planned_gib is not None else "(no plan)")
            + f", {r.measure.replace('_gib', '').replace('_', ' ')} {measured:.2f} GiB when "
            f"it failed ({r.error})"
        )
    if not lines:
        lines.append("a rank ran out of memory (it left no report)")
    tips = format_suggestions(cfg, d, count_params(cfg), machine)
    if len(tips.strip().splitlines()) > 1:
        lines.append(tips)
    else:  # nothing the plan says saves much: what the step's size depends on
        lines.append(
            "to need less: a smaller trainer.micro_batch_size or data.max_seq_len, "
            "trainer.activation_checkpointing=true with trainer.checkpoint_layers=all, "
            "plan.auto_fit=true (restarts once from the last checkpoint with the change that "
            "keeps it valid)"
        )
    return "\n".join(lines)


def restart_plan(
    cfg: RunConfig, d: Decisions, run_dir: Path, machine: RankMachine
) -> tuple[Decisions, list[str]] | None:
    """With plan.auto_fit, once per run dir: the decisions to restart with and their changes
    (the settings stay the user's)."""
    if not cfg.plan.auto_fit or RunDir(run_dir).oom_restart.exists():
        return None
    return out_of_memory_variant(cfg, d, machine)


def restart_changes(run_dir: Path, resume: str) -> list[str] | None:
    """What plan.auto_fit changed to restart this run dir's run after an out-of-memory stop
    (oom_restart.json), for a start that continues it; None without a restart, or for a
    fresh start (resume=never). A damaged record: ConfigError naming it."""
    rd = RunDir(run_dir)
    if resume == "never" or not rd.oom_restart.is_file():
        return None
    try:
        return rd.read_oom_restart().changes
    except RecordError as err:
        raise ConfigError(
            f"{err}: it says what plan.auto_fit changed after an out-of-memory stop; restore "
            "it, or start this run afresh (resume=never)"
        ) from None


def with_restart(fitted: Fitted, changes: list[str]) -> Fitted:
    """``fitted`` with a restart's change (memory.fit.as_restarted) and its plan; the same
    object when it already has it."""
    d = as_restarted(fitted.cfg, fitted.decisions, fitted.machine, changes)
    if d == fitted.decisions:
        return fitted
    return dataclasses.replace(fitted, decisions=d, plan=plan(fitted.cfg, d, fitted.plan.counts))


def still_restarted(fitted: Fitted, run_dir: Path) -> Fitted:
    """A later start of a run dir whose run plan.auto_fit restarted (oom_restart.json) keeps
    that restart's change, and says so; a fresh start (resume=never) or a run dir without a
    restart decides as the settings say. (launcher.prepare keeps it again where the data
    makes the run planned anew.)"""
    changes = restart_changes(run_dir, fitted.cfg.resume)
    if changes is None:
        return fitted
    restarted = with_restart(fitted, changes)
    if restarted is not fitted:
        print(
            f"memtune: plan.auto_fit restarted this run after an out-of-memory stop with "
            f"{' '.join(changes)} ({RunDir(run_dir).oom_restart}): so does this start",
            flush=True,
        )
    return restarted


def record_restart(run_dir: Path, changes: list[str], resumed: str | None) -> None:
    """oom_restart.json, and the reports it answers renamed restarted-oom-rankN.json (the next
    stop's reports are then the only oom-rankN.json)."""
    rd = RunDir(run_dir)
    rd.write_oom_restart(OomRestart(rd.oom_reports(), changes, resumed))
    for p in run_dir.glob("oom-rank*.json"):
        p.rename(p.with_name(f"restarted-{p.name}"))


def say(msg: str) -> None:
    print(f"memtune: {msg}", file=sys.stderr, flush=True)
