"""plan.auto_fit: when a run does not fit, pick the fastest variant of it that does.

The variants change only what trades speed for memory, never what is learned per step: the
global batch, the data, the LoRA rank and the schedule stay. Each change has a rough cost in
step time (the chunked loss computes the same loss without full-sequence logits: free;
activation checkpointing recomputes the forward, ~1/3 more compute; ZeRO-3 gathers
weights in every forward and backward; NF4 dequantizes on the fly; the 8-bit optimizer's step
is dearer but tiny next to the forward; a smaller micro batch uses the GPU less well). The
cheapest combination whose plan fits wins; ties keep the user's own choices.
"""

from __future__ import annotations

import copy
import itertools
import math
from dataclasses import dataclass

from memtune.config import ConfigError, RunConfig, validate
from memtune.plan import AUTO_CHECKPOINT_SPARE_GIB, ParamCounts, Plan, count_params, plan

# Relative step time of each change (1.0: free). Rough, on purpose: they only order variants.
COST_CHUNKED_LOSS = 1.0  # no slower than the plain loss (make bench: faster on CPU)
COST_CHECKPOINTING = 1.33
COST_ZERO3 = 1.10
COST_QLORA = 1.30
COST_8BIT_OPTIMIZER = 1.01
COST_HALF_MICRO_BATCH = 1.05


@dataclass
class Fit:
    cfg: RunConfig
    plan: Plan
    changes: list[str]
    cost: float


def _variants(cfg: RunConfig) -> list[tuple[RunConfig, list[str], float]]:
    t = cfg.trainer
    micro_batches = [t.micro_batch_size]
    while micro_batches[-1] > 1:
        micro_batches.append(micro_batches[-1] // 2)
    options = itertools.product(
        [False, True] if t.loss == "plain" else [False],
        [False, True] if not t.activation_checkpointing else [False],
        [False, True] if cfg.zero.stage != 3 else [False],
        [False, True] if cfg.peft.method == "lora" else [False],
        [False, True] if t.optimizer == "adamw" else [False],
        micro_batches,
    )
    out = []
    for chunked, ckpt, zero3, qlora, opt8, micro in options:
        v = copy.deepcopy(cfg)
        changes, cost = [], 1.0
        if chunked:
            v.trainer.loss = "auto"  # the same loss and gradients, computed in chunks
            changes.append("trainer.loss=auto")
            cost *= COST_CHUNKED_LOSS
        if ckpt:
            v.trainer.activation_checkpointing = True
            changes.append("trainer.activation_checkpointing=true")
            cost *= COST_CHECKPOINTING
        if zero3:
            v.zero.stage, v.zero.template = 3, None
            changes.append("zero=zero3")
            cost *= COST_ZERO3
        if qlora:
            v.peft.method = "qlora"
            changes.append("peft=qlora-nf4")
            cost *= COST_QLORA
        if opt8:
            v.trainer.optimizer = "adamw_8bit"
            changes.append("trainer.optimizer=adamw_8bit")
            cost *= COST_8BIT_OPTIMIZER
        if micro != t.micro_batch_size:
            v.trainer.micro_batch_size = micro
            changes.append(f"trainer.micro_batch_size={micro}")
            cost *= COST_HALF_MICRO_BATCH ** math.log2(t.micro_batch_size / micro)
        out.append((v, changes, cost))
    return sorted(out, key=lambda item: (item[2], len(item[1])))


def auto_fit(cfg: RunConfig, known: ParamCounts | None = None) -> Fit | None:
    """The cheapest fitting variant of ``cfg`` (``cfg`` itself if it fits), or None.

    A variant must leave the same spare as checkpoint_layers=auto (AUTO_CHECKPOINT_SPARE_GIB:
    what the plan may miss on a real GPU); only when none does is the cheapest one that fits
    at all taken. ``known``: the counts of ``cfg`` itself when already computed (one
    meta-device build of a 7B model takes seconds; the variants never change what LoRA adapts,
    so they share it).
    """
    p = cfg.peft
    counts: dict[tuple[str, int], ParamCounts] = {}
    if known is not None:
        counts[(p.target, p.r)] = known
    planned = []
    for variant, changes, cost in _variants(cfg):
        try:
            validate(variant, inputs=False)  # only trainer, zero and peft vary
        except ConfigError:
            continue  # e.g. a micro batch the global batch no longer divides evenly
        key = (variant.peft.target, variant.peft.r)  # what the counts depend on
        if key not in counts:
            counts[key] = count_params(variant)
        planned.append(Fit(variant, plan(variant, counts[key]), changes, cost))
    device = cfg.plan.device_gib
    for spare in (AUTO_CHECKPOINT_SPARE_GIB, 0.0):
        for fit in planned:  # cheapest first
            if device is None or fit.plan.total_gib <= device - spare:
                return fit
    return None
