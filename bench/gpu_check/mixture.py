"""A whole mixture on one card (issue #48 item 6; phases ``mixture-qlora`` and
``mixture-qlora-offload``, group ``mixture``): Qwen3-30B-A3B with random weights, QLoRA, one
rank, under a 24 GB cap, as the planner fits it.

With LoRA on every routed expert the adapters alone are 642.5M weights; their fp32 gradients,
master copies and Adam moments (9.6 GiB) do not fit a 24 GB card next to the 16.8 GiB NF4
base. memtune's ``plan.auto_fit`` varies the optimizer, ZeRO and the micro batch, never what
LoRA adapts nor where the optimizer runs, so the phase plans the ways to fit one card itself
(:data:`CANDIDATES`, each planned by memtune's planner with its checkpointed layers decided as
a launch decides them: ``configs.decided_at``) and takes, by auto_fit's own rule, the first in
that order that fits with checkpoint_layers=auto's spare, else the first that fits at all
(:func:`choose`). Every candidate's plan, the pick and why are recorded. ``mixture-qlora``
measures the pick; ``mixture-qlora-offload`` the candidate that keeps LoRA on every expert by
moving the optimizer to the host (ZeRO-Offload), when the planner says it fits and it is not
the pick already.

The base is never whole in bf16 (61 GB): built on the meta device and materialised a layer at
a time, each layer's linear weights quantized by bitsandbytes and its expert stacks by
memtune's own quantization before the next exists (bases.build_mixture_by_layer). Then
memtune's rank (``rank.build.build_rank``: LoRA and the experts' adapters, the loss, the
optimizer, DeepSpeed at world size 1) and its loop (``rank.loop.train``), rows of each of
``mode.mixture_lengths`` tokens, the shorter first: tokens/s over the timed steps after the
warm-up, peak allocated and reserved, the plan's peak and its error, the build's time and
peak."""

from __future__ import annotations

import contextlib
import gc
import itertools
import time
from dataclasses import dataclass
from typing import Any

from .bases import build_mixture_by_layer
from .batches import synthetic_batch
from .configs import compose_cfg, decided_at, plan_record
from .measure import (
    add_mfu,
    add_plan_error,
    cap_allocator,
    empty_cache,
    flops_per_step,
    host_peak,
    is_oom,
    memory_now,
    peak_window,
    step_clock,
    timing,
)
from .memtune_runner import memtune_at_length
from .modes import CAP_GIB
from .recorder import Phase, device_and_env, init_one_rank, time_left

MIXTURE_OVERRIDES = ("trainer.expert_parallel=1", "peft.dropout=0.0")
"""The 4 × 4090 experiment on one card: every expert on it (no expert parallelism); the
experts' adapters take no dropout (peft loads none)."""


@dataclass(frozen=True)
class Candidate:
    """One way to fit the mixture on one card: what it changes and what that costs."""

    label: str
    overrides: tuple[str, ...]
    every_expert: bool
    """LoRA reaches every routed expert (the experiment's peft.target=all-linear)."""
    why: str


CANDIDATES = (
    Candidate("every expert", (), True, "the experiment as written: AdamW on the device"),
    Candidate(
        "every expert, 8-bit Adam",
        ("trainer.optimizer=adamw_8bit",),
        True,
        "the moments in 8 bits (plan.auto_fit's own change)",
    ),
    Candidate(
        "every expert, Adam on the host",
        ("trainer.optimizer=cpu_adam",),
        True,
        "ZeRO-Offload: master weights, moments and the step on the host",
    ),
    Candidate(
        "experts frozen",
        ("peft.target=all-linear-but-experts",),
        False,
        "LoRA on attention only: the routed experts stay frozen",
    ),
)
"""In the order the phase prefers them: the experiment's own target first (LoRA on every
expert), the cheapest change first; freezing the experts (a far smaller adapter) last."""
OFFLOAD = 2
"""The candidate ``mixture-qlora-offload`` measures."""


def plan_candidates(mode: Any, seq_len: int) -> tuple[list[dict[str, Any]], list[Any]]:
    """Every candidate composed for one card at ``seq_len`` and planned as a launch decides it:
    (one record each, their (settings, decisions, counts))."""
    from memtune.memory.counts import count_params
    from memtune.memory.estimate import plan
    from memtune.memory.recompute import fits_with_spare
    from memtune.memory.step_time import step_time

    records, built = [], []
    counts_by: dict[str, Any] = {}
    for c in CANDIDATES:
        cfg = compose_cfg(
            mode, "mixture", seq_len, (*MIXTURE_OVERRIDES, *c.overrides), model=mode.mixture_model
        )
        key = cfg.peft.target  # what the counts depend on here
        if key not in counts_by:
            counts_by[key] = count_params(cfg)
        counts = counts_by[key]
        cfg, d = decided_at(cfg, seq_len, counts)
        planned = plan(cfg, d, counts)
        estimate = step_time(cfg, d, counts)
        records.append(
            {
                "label": c.label,
                "overrides": list(c.overrides),
                "every_expert": c.every_expert,
                "why": c.why,
                "seq_len": seq_len,
                "total_gib": planned.total_gib,
                "device_gib": planned.device_gib,
                "fits": planned.fits,
                "fits_with_spare": fits_with_spare(planned),
                "rows": {r.what: round(r.gib, 4) for r in planned.rows},
                "loading_device_gib": planned.loading.device_gib if planned.loading else None,
                "loading_host_gib": planned.loading.host_gib if planned.loading else None,
                "checkpointed_layers": d.checkpointing.recomputed,
                "selective_layers": d.checkpointing.selective,
                "zero_stage": d.zero_stage,
                "optimizer": d.optimizer,
                "experts_storage": d.experts.storage if d.experts else None,
                "experts_adapted": bool(d.experts and d.experts.adapted),
                "trainable": counts.lora,
                "plan_step_s": estimate.step_s if estimate else None,
                "plan_step_flops": estimate.flops if estimate else None,
            }
        )
        built.append((cfg, d, counts))
    return records, built


def choose(records: list[dict[str, Any]]) -> tuple[int, str]:
    """plan.auto_fit's rule over the candidates, in :data:`CANDIDATES`' order: the first
    that fits with checkpoint_layers=auto's spare, else the first that fits at all, else the
    smallest plan (to be measured out of memory). Returns its index and why."""
    from memtune.memory.recompute import AUTO_CHECKPOINT_SPARE_GIB

    def passed_over(upto: int) -> str:
        return "".join(
            f"; not {records[i]['label']} ({records[i]['total_gib']:.2f} GiB)" for i in range(upto)
        )

    device = records[0]["device_gib"]
    for i, r in enumerate(records):
        if r["fits_with_spare"]:
            return i, (
                f"the first that fits {device} GiB with {AUTO_CHECKPOINT_SPARE_GIB:g} GiB to "
                f"spare: {r['total_gib']:.2f} GiB" + passed_over(i)
            )
    for i, r in enumerate(records):
        if r["fits"]:
            return i, (
                f"none leaves {AUTO_CHECKPOINT_SPARE_GIB:g} GiB spare; the first that fits at "
                f"all: {r['total_gib']:.2f} GiB" + passed_over(i)
            )
    i = min(range(len(records)), key=lambda j: records[j]["total_gib"])
    return i, f"none fits {device} GiB: the smallest plan, {records[i]['total_gib']:.2f} GiB"


def run_mixture(phase: Phase, deadline: float, offload: bool = False) -> None:
    """The planner's pick (``offload``: the candidate that keeps every expert's LoRA with the
    optimizer on the host) built and trained on one rank under the 24 GB cap, at each of
    ``mode.mixture_lengths`` in turn; the fragment saved after every measurement."""
    from memtune.config.deepspeed import build_ds_config
    from memtune.rank.build import build_rank
    from memtune.rank.model import quantization_config, trainable_by_part

    mode = phase.mode
    device = device_and_env(phase)
    init_one_rank(device)
    first = mode.mixture_lengths[0]
    t0 = time.perf_counter()
    candidates, built = plan_candidates(mode, first)
    pick, why = choose(candidates)
    info: dict[str, Any] = {
        "model": mode.mixture_model,
        "phase": phase.name,
        "candidates": candidates,
        "pick": candidates[pick]["label"],
        "why": why,
        "planning_s": round(time.perf_counter() - t0, 2),
        "warmup": mode.warmup,
        "timed": mode.timed,
        "rows": [],
    }
    phase.data["mixture"] = info
    run = pick
    if offload:
        run = OFFLOAD
        skip = None
        if pick == OFFLOAD:
            skip = "the planner's pick already: mixture-qlora measures it"
        elif not candidates[OFFLOAD]["fits"]:
            skip = f"planned {candidates[OFFLOAD]['total_gib']:.2f} GiB: does not fit"
        if skip:
            info["skipped"] = skip
            phase.data["notes"].append(f"{candidates[OFFLOAD]['label']}: {skip}")
            phase.save()
            return
    info["measured"] = candidates[run]["label"]
    phase.save()
    cfg0, d0, counts = built[run]
    build: dict[str, Any] = {"cap_gib": CAP_GIB}
    cap_allocator(device, CAP_GIB, build)  # the build under the cap too
    leftover = memory_now(device).get("allocated_gib", 0.0)
    quant = quantization_config(cfg0, d0.peft_method)
    assert d0.experts is not None and quant is not None, "a QLoRA mixture"

    def load_base(c: Any, decided: Any) -> Any:
        """The random-weight mixture, quantized a layer at a time (never whole in bf16)."""
        t = time.perf_counter()
        with peak_window(device, build), host_peak(build):
            model, stacks = build_mixture_by_layer(
                c, device, decided.attention, quant, decided.experts.storage
            )
        build.update(base_s=round(time.perf_counter() - t, 2), stacks_quantized=stacks)
        return model

    t = time.perf_counter()
    parts = build_rank(cfg0, d0, build_ds_config(cfg0, d0), device, load_base=load_base)
    build["rank_s"] = round(time.perf_counter() - t, 2)  # base, LoRA, DeepSpeed's engine
    engine = parts.engine
    build.update(
        trainable=parts.trainable,
        total=parts.total,
        trainable_by_part=trainable_by_part(parts.model),
        optimizer=parts.optimizer_note,
        attention=parts.attention,
        loss_kind=parts.loss_kind,
        zero_stage=d0.zero_stage,
        leftover_gib=leftover,
        after_build=memory_now(device),
    )
    info["build"] = build
    phase.save()
    print(
        f"gpu_check: {phase.name}: {candidates[run]['label']} built in {build['rank_s']:.1f} s "
        f"(base {build['base_s']:.1f} s, {build['stacks_quantized']} expert stacks quantized)",
        flush=True,
    )
    for seq_len in mode.mixture_lengths:
        rec: dict[str, Any] = {"seq_len": seq_len, "leftover_gib": leftover}
        if not time_left(deadline, 10 if mode.dry_run else 25):
            rec["error"] = "skipped: out of time"
            info["rows"].append(rec)
            phase.data["errors"].append({"where": f"mixture {seq_len}", "error": rec["error"]})
            phase.save()
            break
        try:
            cap_allocator(device, CAP_GIB, rec)  # again: the CUDA context grew with the engine
            steps_at(engine, cfg0, counts, seq_len, device, rec, mode.warmup, mode.timed)
            arch = cfg0.model.architecture
            add_mfu(rec, flops_per_step(counts, arch, seq_len), device)
            add_plan_error(rec)
        except Exception as err:
            rec["error"] = repr(err)[-2000:]
            rec["oom"] = is_oom(err)
            if rec["oom"] and not (rec.get("plan") or {}).get("fits", True):
                rec["as_planned"] = True  # out of memory where the plan said so: a result
            else:
                phase.error(f"mixture {seq_len}", err)
        finally:
            gc.collect()
            empty_cache(device)
        info["rows"].append(rec)
        phase.save()
        phase.say(rec, seq_len)
        if rec.get("error"):
            break  # an OOM inside a step can leave the engine inconsistent: nothing after it
    cap_allocator(device, None, build)
    with contextlib.suppress(Exception):
        import torch.distributed as dist

        dist.destroy_process_group()


def steps_at(
    engine: Any,
    cfg0: Any,
    counts: Any,
    seq_len: int,
    device: Any,
    rec: dict[str, Any],
    warmup: int,
    timed: int,
) -> None:
    """``warmup`` + ``timed`` steps of memtune's loop at ``seq_len`` (its decisions applied to
    the engine as build_rank applies them), timed, its peak and plan in ``rec``."""
    from memtune.config.decisions import with_sections
    from memtune.rank.loop import TrainResult, train
    from memtune.rank.telemetry import NullLogger

    at, d = memtune_at_length(engine, cfg0, counts, seq_len, device, rec)
    run_cfg = with_sections(at, trainer={"max_steps": warmup + timed})
    rec["plan"] = plan_record(run_cfg, d, counts)
    vocab = int(cfg0.model.architecture["vocab_size"])
    batches = itertools.repeat(synthetic_batch(vocab, seq_len, seq_len))
    clock = step_clock(device)
    with peak_window(device, rec):
        result = train(engine, batches, run_cfg, d, device, NullLogger(), TrainResult(), clock)
    rec["losses"] = result.losses
    rec["real_tokens"] = result.input_tokens
    rec.update(timing(clock.marks, warmup, seq_len))
