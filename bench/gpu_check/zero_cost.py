"""ZeRO's own cost on one card (issue #47 item 7, phase ``zero-cost``): memtune's LoRA step at
the profile's length through DeepSpeed's ZeRO engine, against the same step without DeepSpeed.

One model, built once as a rank builds it (``rank.build.build_model``, from the decisions a
launch makes), steps twice:

- **plain** first: memtune's loss module (``rank.build.loss_module``: the objective and the
  decided loss kernel), ``backward()``, gradient clipping at ``trainer.max_grad_norm`` and the
  optimizer memtune builds (``rank.optim.build_optimizer``, torch's AdamW), on the LoRA weights
  in the dtype the engine trains them in;
- **engine** then: ``rank.build.build_engine`` wraps the same model as the rank does and
  memtune's training loop (``rank.loop.train``) runs it.

What differs is what DeepSpeed adds on one rank: its gradient hooks and reduce buckets, the
fp32 master weights (the optimizer steps on them, then they are copied back), its step's
bookkeeping and the loop's collectives over one rank. Per side: the step time (median of the
timed steps after the warm-up), tokens/s, the peak; then the difference per step. The lent
machine has one GPU: the collectives of several ranks stay the planner's estimate.
"""

from __future__ import annotations

import gc
import itertools
from typing import Any

from .batches import synthetic_batch
from .measure import empty_cache, peak_window, step_clock, timing
from .profile import at_profile_length
from .recorder import Phase, time_left


def run_zero_cost(phase: Phase, deadline: float) -> None:
    import torch

    from memtune.config.decisions import with_sections
    from memtune.config.deepspeed import build_ds_config
    from memtune.rank.build import build_engine, loss_module
    from memtune.rank.loop import TrainResult, loss_units, train
    from memtune.rank.optim import build_optimizer, param_groups
    from memtune.rank.telemetry import NullLogger

    from .memtune_runner import memtune_model

    mode, method = phase.mode, phase.method
    device, seq_len, cfg, d, _ = at_profile_length(phase)
    ds_config = build_ds_config(cfg, d)
    built = memtune_model(cfg, d, ds_config, device)
    model = built.model
    vocab = int(cfg.model.architecture["vocab_size"])
    batch = synthetic_batch(vocab, seq_len, seq_len)
    n_steps = mode.warmup + mode.timed
    result: dict[str, Any] = {
        "method": method,
        "seq_len": seq_len,
        "zero_stage": d.zero_stage,
        "checkpointed_layers": d.checkpointing.recomputed,
        "layers": len(d.checkpointing.layers),
        "accumulation": d.batch.accumulation,
    }
    phase.data["zero_cost"] = result

    # plain: the loss module, backward, clipping and memtune's optimizer, no DeepSpeed
    bf16 = bool(ds_config.get("bf16", {}).get("enabled"))
    trainable = [q for q in model.parameters() if q.requires_grad]
    for q in trainable:  # deepspeed.initialize trains them in the run's precision
        q.data = q.data.to(torch.bfloat16 if bf16 else q.dtype)
    start = [q.detach().clone() for q in trainable]  # both sides step from this state
    module = loss_module(cfg, d, model, device)
    optimizer, note = build_optimizer(cfg, d.optimizer, param_groups(cfg, model), device)
    clip = float(cfg.trainer.max_grad_norm or 0.0)
    inputs = {k: v.to(device) for k, v in batch.items() if k != "real_tokens"}
    plain: dict[str, Any] = {"optimizer": note, "lora_dtype": str(trainable[0].dtype)}
    result["plain"] = plain
    try:
        clock = step_clock(device)
        losses = []
        with peak_window(device, plain):
            for step in range(1, n_steps + 1):
                micro = [inputs] * d.batch.accumulation
                units = sum(loss_units(b) for b in micro)
                total = torch.zeros((), device=device)
                for b in micro:
                    loss = module(**b)
                    (loss / units).backward()
                    total += loss.detach().float()
                if clip > 0:
                    torch.nn.utils.clip_grad_norm_(trainable, clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                losses.append(float(total) / units)
                clock.after_step(step, None)
        plain.update(timing(clock.marks, mode.warmup, seq_len), losses=losses)
    except Exception as err:
        plain["error"] = repr(err)[-2000:]
        phase.error("plain step", err)
    finally:
        del optimizer
        with torch.no_grad():
            for q, was in zip(trainable, start, strict=True):
                q.grad = None
                q.copy_(was)  # the engine starts where the plain side did: equal first losses
        del start
        gc.collect()
        empty_cache(device)
    phase.save()
    if not time_left(deadline, 20):
        phase.data["errors"].append({"where": "engine", "error": "skipped: out of time"})
        phase.save()
        return

    # engine: the same model in DeepSpeed's engine, as build_rank wraps it, memtune's loop
    engine_rec: dict[str, Any] = {}
    result["engine"] = engine_rec
    try:
        engine, engine_rec["optimizer"] = build_engine(cfg, d, model, device, ds_config)
        clock = step_clock(device)
        run_cfg = with_sections(cfg, trainer={"max_steps": n_steps})
        batches = itertools.repeat(batch)
        with peak_window(device, engine_rec):
            done = train(engine, batches, run_cfg, d, device, NullLogger(), TrainResult(), clock)
        engine_rec.update(timing(clock.marks, mode.warmup, seq_len), losses=done.losses)
    except Exception as err:
        engine_rec["error"] = repr(err)[-2000:]
        phase.error("engine step", err)
    if plain.get("step_s_median") and engine_rec.get("step_s_median"):
        result["zero_ms_per_step"] = 1000 * (engine_rec["step_s_median"] - plain["step_s_median"])
        result["zero_share"] = 1 - plain["step_s_median"] / engine_rec["step_s_median"]
        if "peak_allocated_gib" in plain and "peak_allocated_gib" in engine_rec:
            result["zero_gib"] = engine_rec["peak_allocated_gib"] - plain["peak_allocated_gib"]
    phase.save()
    ms = result.get("zero_ms_per_step")
    print(
        f"gpu_check: {phase.name}: "
        + (
            f"DeepSpeed's ZeRO-{d.zero_stage} adds {ms:+.1f} ms a step"
            if ms is not None
            else "no timing"
        ),
        flush=True,
    )


def zero_cost_markdown(z: dict[str, Any] | None) -> list[str]:
    """The ``zero-cost`` section: both sides' step, tokens/s and peak, and the difference."""
    from .report import _f

    if not z:
        return []
    lines = [
        "",
        f"#### ZeRO's own cost on one card (LoRA, {z['seq_len']:,} tokens, "
        f"{z['checkpointed_layers']} of {z['layers']} layers recomputed)",
        "",
        "| step | ms (median) | tokens/s | peak allocated GiB | first → last loss |",
        "|---|---:|---:|---:|---|",
    ]
    for key, label in (
        ("plain", "plain: backward, clipping, torch's AdamW"),
        ("engine", f"DeepSpeed ZeRO-{z['zero_stage']} engine, memtune's loop"),
    ):
        r = z.get(key) or {}
        if r.get("error"):
            lines.append(f"| {label} | failed: {r['error'][:200]} | | | |")
            continue
        step_ms = r["step_s_median"] * 1000 if r.get("step_s_median") else None
        loss = r.get("losses") or []
        trend = f"{loss[0]:.4f} → {loss[-1]:.4f}" if loss else ""
        lines.append(
            f"| {label} | {_f(step_ms, '.1f')} | {_f(r.get('tokens_per_s'), ',.0f')} "
            f"| {_f(r.get('peak_allocated_gib'), '.2f')} | {trend} |"
        )
    if z.get("zero_ms_per_step") is not None:
        gib = z.get("zero_gib")
        lines += [
            "",
            f"DeepSpeed adds {z['zero_ms_per_step']:+.1f} ms a step "
            f"({z['zero_share']:.1%} of the engine's step)"
            + (f" and {gib:+.2f} GiB at the peak" if gib is not None else "")
            + " on one rank: its hooks and buckets, the fp32 master weights and their copies.",
        ]
    return lines
