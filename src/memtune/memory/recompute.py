"""Which layers recompute (trainer.checkpoint_layers / selective_layers on auto): the fewest
full recomputes, then the fewest selective layers, whose plan fits the device with
:data:`AUTO_CHECKPOINT_SPARE_GIB` to spare; and the decided run's own settings
(:func:`settings_of`, :func:`pinned`) that its variants start from. Below memory.fit (which
decides the rest of a run) and memory.layouts (the experts' layouts), which both choose
checkpointed layers for the variants they plan."""

from __future__ import annotations

import dataclasses
from typing import Any

from memtune.config import RunConfig
from memtune.config.decisions import (
    Choices,
    Decisions,
    RankMachine,
    decisions_for,
    requested_recompute,
    requested_selective,
    with_sections,
)
from memtune.config.validate import selective_unbuilt
from memtune.memory.counts import ParamCounts
from memtune.memory.estimate import Plan, plan


def settings_of(cfg: RunConfig, d: Decisions) -> RunConfig:
    """The settings that ask for ``d``'s own choices directly: its ZeRO stage, method,
    optimizer, micro batch, kernels, experts' split and checkpointing on or off (the number of
    recomputed layers left to auto, for :func:`pinned` to give, and LoRA's dropout as the user
    set it: auto decides it with the layers). A decided run's alternatives
    start here: plan.auto_fit's variants, the "Try:" list, the other ZeRO stage. Never handed
    to a rank."""
    trainer: dict[str, Any] = {
        "optimizer": d.optimizer,
        "micro_batch_size": d.batch.micro_batch,
        "loss": d.loss,
        "rms_norm_kernel": d.kernels.rms_norm,
        "swiglu_kernel": d.kernels.swiglu,
        "rope_kernel": d.kernels.rope,
        "activation_checkpointing": d.checkpointing.enabled,
    }
    if d.checkpointing.enabled:
        trainer["checkpoint_layers"] = "auto"
        trainer["selective_layers"] = "auto"
    if d.experts is not None:  # trainer.expert_parallel=auto's choice kept (memory.layouts)
        trainer["expert_parallel"] = str(d.experts.parallel)
    return with_sections(
        cfg,
        zero={"stage": d.zero_stage, "template": d.zero_template},
        peft={"method": d.peft_method},
        model={"attn_implementation": d.attention},
        trainer=trainer,
    )


def pinned(d: Decisions) -> Choices:
    """``d``'s long-context choices and, with checkpointing, its recomputed layers: what a
    variant of the decided run keeps unless it changes them (a variant that turns
    checkpointing on offloads nothing, as the run did)."""
    on = d.checkpointing.enabled
    return Choices(
        recompute=d.checkpointing.recomputed if on else None,
        sequence_parallel=d.sequence_parallel,
        tiled_mlp=d.tiled_mlp,
        offload_activations=d.offload_activations,
        selective=d.checkpointing.selective if on else None,
    )


def _full_asked(cfg: RunConfig, choices: Choices) -> int | None:
    """How many layers recompute in full, by the settings or the choices; None: not yet."""
    return choices.recompute if choices.recompute is not None else requested_recompute(cfg)


def _selective_asked(cfg: RunConfig, choices: Choices, full: int) -> int | None:
    """How many layers recompute selectively, by the settings or the choices; None: not yet."""
    if choices.selective is not None:
        return choices.selective
    return requested_selective(cfg, full)


def unresolved_layers(cfg: RunConfig, choices: Choices) -> bool:
    """Checkpointing is on and the settings and choices leave the recomputed layers open: how
    many in full, or how many selectively."""
    if not cfg.trainer.activation_checkpointing:
        return False
    full = _full_asked(cfg, choices)
    return full is None or _selective_asked(cfg, choices, full) is None


AUTO_CHECKPOINT_SPARE_GIB = 2.0
"""checkpoint_layers=auto keeps this much of plan.device_gib free for what the plan misses."""


def checkpoint_budget(cfg: RunConfig, machine: RankMachine) -> tuple[float, str] | None:
    """The memory checkpoint_layers=auto fits into: plan.device_gib; for CPU ranks without it,
    the host's available RAM shared by this node's ranks; None for GPU ranks without
    plan.device_gib (nothing known to fit: every layer)."""
    if cfg.plan.device_gib is not None:
        return cfg.plan.device_gib, f"{cfg.plan.device_gib:.2f} GiB"
    if machine.cuda:
        return None
    from memtune.machine import host_available_gib

    per_node = max(1, cfg.launcher.num_ranks // max(1, cfg.launcher.nnodes))
    per_rank = host_available_gib() / per_node
    return per_rank, f"the host's {per_rank:.1f} GiB available per CPU rank"


def choose_checkpoint_layers(
    cfg: RunConfig, choices: Choices, counts: ParamCounts, machine: RankMachine
) -> tuple[int, int]:
    """(layers recomputed in full, layers recomputed selectively): the fewest full recomputes,
    then the fewest selective layers, whose plan fits the budget (:func:`checkpoint_budget`)
    with the spare (all in full if none does: the refusal then shows the full breakdown)."""
    budget = checkpoint_budget(cfg, machine)
    return _fewest_layers_that_fit(cfg, choices, counts, machine, budget)


def selective_allowed(cfg: RunConfig, d: Decisions) -> bool:
    """Whether selective recompute is built for these settings and decisions (not with a
    tiled MLP or offloaded inputs: config.validate.selective_unbuilt says the rest)."""
    return selective_unbuilt(cfg) is None and not (d.tiled_mlp or d.offload_activations)


def _fewest_layers_that_fit(
    cfg: RunConfig,
    choices: Choices,
    counts: ParamCounts,
    machine: RankMachine,
    budget: tuple[float, str] | None,
) -> tuple[int, int]:
    """By step time within the memory: a full recompute runs a layer's matmuls again, a
    selective one only its cheap ops (elementwise, and LoRA's r-deep B), so the fewest full
    recomputes come first, then the fewest selective layers.

    A selective layer holds less than a layer that keeps everything when its kept outputs are
    fewer bytes than the activations the layer would keep — not always: with the lean kernels
    and LoRA dropout regenerated a kept Qwen2.5-7B layer holds less than a selective one; and
    the last layer's backward, the step's peak in many plans, holds more selective than kept.
    So k full recomputes fit when the rest fit all kept, all selective, or all selective but
    the last (the plan moves one way as selective layers replace kept ones, but for that last
    one); then the fewest selective layers are searched below the fewest of those that fit."""
    layers = int(cfg.model.architecture["num_hidden_layers"])
    asked_full = _full_asked(cfg, choices)
    asked_selective = _selective_asked(cfg, choices, asked_full or 0)
    base = decisions_for(
        cfg,
        machine,
        dataclasses.replace(choices, recompute=asked_full or 0, selective=asked_selective or 0),
    )
    selective_ok = selective_allowed(cfg, base)
    if budget is None:
        return (layers, 0) if asked_full is None else (asked_full, 0)
    room = budget[0] - AUTO_CHECKPOINT_SPARE_GIB

    def fits(k: int, s: int) -> bool:
        return plan(cfg, base.with_recompute(k, s), counts).total_gib <= room

    def selective(k: int) -> int:
        asked = _selective_asked(cfg, choices, k)
        return asked if asked is not None else (layers - k if selective_ok else 0)

    def most_selective(k: int) -> int | None:
        """The fewer of all selective and all but the last that fits with k full (auto)."""
        most = layers - k if selective_ok else 0
        return next((s for s in (most - 1, most) if s > 0 and fits(k, s)), None)

    def fits_some(k: int) -> bool:
        """k full recomputes fit with the rest selective as asked, or (auto) in one of the
        arrangements the docstring names."""
        if _selective_asked(cfg, choices, k) is not None:
            return fits(k, selective(k))
        return fits(k, 0) or most_selective(k) is not None

    # Up to layers - 1: recomputing the last layer as well would only cost (activation_bytes).
    fulls: range | list[int] = range(layers) if asked_full is None else [asked_full]
    top = layers - 1
    if asked_full is None and fits_some(top):
        # The first k that fits, by bisection: with top fitting, a step's peak only falls as
        # k grows (a layer recomputed in full keeps its input, less than anything else keeps;
        # the one moment that grows with k, the inputs beside the recomputed layer, is below
        # the room at top). The same k as trying each from 0, in log2(layers) plans.
        lo, hi = -1, top
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if fits_some(mid):
                hi = mid
            else:
                lo = mid
        fulls = [hi]
    for k in fulls:
        asked = _selective_asked(cfg, choices, k)
        if asked is not None:
            if fits(k, asked):
                return k, asked
            continue
        if fits(k, 0):
            return k, 0
        most = most_selective(k)
        if most is None:
            continue
        lo, hi = 0, most  # fits(hi); the fewest selective layers that fit, by bisection
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if fits(k, mid):
                hi = mid
            else:
                lo = mid
        return k, hi
    if asked_full is None:
        return layers, 0
    asked = _selective_asked(cfg, choices, asked_full)
    return asked_full, (layers - asked_full if selective_ok else 0) if asked is None else asked


def resolve_checkpoint_layers(
    cfg: RunConfig, choices: Choices, counts: ParamCounts, machine: RankMachine
) -> tuple[Decisions, str | None]:
    """The decisions for ``cfg`` with ``choices``: checkpoint_layers=auto decided here (the
    fewest layers that fit) and, with trainer.lora_dropout_kernel=auto, LoRA's dropout with
    them (:func:`peft_dropout_is_better`); and a note saying why (None when there was nothing
    to choose)."""
    d, note = _resolve_layers(cfg, choices, counts, machine)
    auto = cfg.trainer.lora_dropout_kernel == "auto" and choices.lora_dropout is None
    if not auto or d.kernels.lora_dropout != "regenerate":
        return d, note
    alt, alt_note = _resolve_layers(
        cfg, dataclasses.replace(choices, lora_dropout="peft"), counts, machine
    )
    better = peft_dropout_is_better(cfg, d, alt, counts)
    if better is None:
        return d, note
    chosen = f"lora_dropout_kernel=auto: peft's ({better})"
    return alt, "; ".join(n for n in (alt_note, chosen) if n)


def peft_dropout_is_better(
    cfg: RunConfig, regenerated: Decisions, peft: Decisions, counts: ParamCounts
) -> str | None:
    """Why peft's dropout (its copies kept) is the better choice than the masks regenerated
    in backward, each with the layers it recomputes; None when it is not. Regenerating needs
    less memory and one more dropout pass in backward: peft's is better when it fits as
    well (with the spare) and its step is no slower by the step-time estimate — or, unpriced
    (no plan.device_tflops), when regenerating would recompute no fewer layers."""
    from memtune.memory.step_time import step_time

    if not fits_with_spare(plan(cfg, peft, counts)):
        return None
    fast, slow = step_time(cfg, peft, counts), step_time(cfg, regenerated, counts)
    if fast is not None and slow is not None and fast.priced and slow.priced:
        if fast.step_s <= slow.step_s:
            return f"{fast.step_s:.2f} s a step against {slow.step_s:.2f} s regenerated"
        return None
    c, r = peft.checkpointing, regenerated.checkpointing
    if (c.recomputed, c.selective) == (r.recomputed, r.selective):
        return "regenerating would recompute no fewer layers"
    return None


def _resolve_layers(
    cfg: RunConfig, choices: Choices, counts: ParamCounts, machine: RankMachine
) -> tuple[Decisions, str | None]:
    """resolve_checkpoint_layers for the kernels ``choices`` give (LoRA's dropout on auto, not
    chosen yet: regenerated where that is built)."""
    if not unresolved_layers(cfg, choices):
        return decisions_for(cfg, machine, choices), None
    # Read once: the host's available RAM (CPU ranks) moves between reads.
    budget, spare = checkpoint_budget(cfg, machine), AUTO_CHECKPOINT_SPARE_GIB
    k, s = _fewest_layers_that_fit(cfg, choices, counts, machine, budget)
    d = decisions_for(cfg, machine, dataclasses.replace(choices, recompute=k, selective=s))
    layers = cfg.model.architecture["num_hidden_layers"]
    planned = plan(cfg, d, counts)
    if budget is None:
        why = "no plan.device_gib to fit"
    elif planned.total_gib <= budget[0] - spare:
        why = f"the fewest that fit {budget[1]} with {spare:.0f} GiB to spare"
    else:
        why = f"even all of them leave less than {spare:.0f} GiB of {budget[1]} spare"
    lo = planned.loading
    if budget is not None and lo is not None and lo.device_gib > budget[0]:
        # the layers change the step, not the loading (memory.loading): said, not hidden
        why += f"; the step's, for its loading needs {lo.device_gib:.2f} GiB"
    mix = f", {s} more selectively" if s else ""
    # Named for the setting that was left open: with checkpoint_layers given, only
    # selective_layers was decided here (the line said checkpoint_layers=auto).
    setting = "checkpoint_layers" if _full_asked(cfg, choices) is None else "selective_layers"
    return d, f"{setting}=auto: {k} of {layers} layers{mix} ({why})"


def fits_with_spare(planned: Plan, spare: float = AUTO_CHECKPOINT_SPARE_GIB) -> bool:
    """The plan fits the host, and the device with ``spare`` (AUTO_CHECKPOINT_SPARE_GIB)."""
    if not planned.fits:
        return False
    return planned.device_gib is None or planned.total_gib <= planned.device_gib - spare
