"""The job's side of an out-of-memory stop: say what happened and what to change, and with
plan.auto_fit restart once from the last checkpoint with a variant that needs less.

A rank that fails to allocate writes RUN_DIR/oom-rankN.json and exits EXIT_OOM; DeepSpeed's
launcher then stops the other ranks (they wait in a collective the failed rank never joins).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from memtune.config import RunConfig
from memtune.memory.counts import count_params
from memtune.memory.estimate import plan
from memtune.memory.fit import Fitted, format_suggestions, out_of_memory_variant

RESTART_RECORD = "oom_restart.json"


def reports(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(run_dir.glob("oom-rank*.json"))]


def explain(cfg: RunConfig, run_dir: Path) -> str:
    """Which ranks, at which step, planned vs measured, and the changes that save memory."""
    lines = []
    for r in reports(run_dir):
        measured = r["measured"].get(r["measure"], 0.0)
        planned = r["planned_gib"]
        lines.append(
            f"rank {r['rank']} ran out of memory at step {r['step']}: planned "
            + (f"{planned:.2f} GiB" if planned is not None else "(no plan)")
            + f", {r['measure'].replace('_gib', '').replace('_', ' ')} {measured:.2f} GiB when "
            f"it failed ({r['error']})"
        )
    if not lines:
        lines.append("a rank ran out of memory (it left no report)")
    tips = format_suggestions(cfg, count_params(cfg))
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


def restart_plan(cfg: RunConfig, run_dir: Path) -> tuple[RunConfig, list[str]] | None:
    """With plan.auto_fit, once per run dir: the config to restart with and its changes."""
    if not cfg.plan.auto_fit or (run_dir / RESTART_RECORD).exists():
        return None
    return out_of_memory_variant(cfg)


def record_restart(run_dir: Path, changes: list[str], resumed: str | None) -> None:
    (run_dir / RESTART_RECORD).write_text(
        json.dumps(
            {"after": reports(run_dir), "changes": changes, "resumed_from": resumed}, indent=2
        )
        + "\n"
    )
    for p in run_dir.glob("oom-rank*.json"):
        p.rename(p.with_name(f"restarted-{p.name}"))


def fitted_for(cfg: RunConfig) -> Fitted:
    """The variant as a launch decision (prepare_run_dir lays the run dir out from it)."""
    result = plan(cfg)
    return Fitted(cfg, result, cfg, result, [], [])


def say(msg: str) -> None:
    print(f"memtune: {msg}", file=sys.stderr, flush=True)
