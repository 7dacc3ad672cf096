"""What a launch decides, once, from the plan: the one place a run's choices are made.

From the user's settings it makes a :class:`memtune.config.decisions.Decisions`: one rank's
ZeRO stage, the long-context choices left to auto (sequence parallel, tiled MLP, offloaded
inputs), how many layers recompute (checkpoint_layers=auto), the kernels on auto, whether the
run fits plan.device_gib and, with plan.auto_fit, the variant to run instead (the fastest that
fits, the base's precision kept whenever a variant that keeps it fits); the "Try:"
list of a run that does not fit. It returns decisions and notes; the caller prints them.

Candidates are the user's settings varied (config.decisions.with_sections: new sections, the
rest shared, nothing mutated) with :class:`Choices` for what they leave to auto; each is
turned into decisions by config.decisions.decisions_for and planned. A decided run's own
settings (:func:`settings_of`) are where its alternatives start.

plan.auto_fit's variants change only what trades speed for memory: the global batch, the
data, the LoRA rank and the schedule stay (QLoRA, the dearest, also trades the base's
precision). Each change has a rough cost in step time (the chunked loss computes the same
loss without full-sequence logits: free; activation checkpointing recomputes the forward, ~1/3 more
compute; ZeRO-3 gathers weights in every forward and backward; NF4 dequantizes on the fly;
the 8-bit optimizer's step is dearer but tiny next to the forward; a smaller micro batch uses
the GPU less well). The cheapest combination whose plan fits wins; ties keep the user's own
choices.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

from memtune.config import ConfigError, RunConfig, one_rank_stage, validate
from memtune.config.architecture import routed_experts
from memtune.config.decisions import (
    Checkpointing,
    Choices,
    Decisions,
    RankMachine,
    decisions_for,
    loss_kernel,
    rank_machine,
    requested_recompute,
    with_sections,
)
from memtune.config.validate import check_sequence_parallel
from memtune.memory.counts import ParamCounts, count_params, quantized_shape_problems
from memtune.memory.estimate import Plan, plan
from memtune.memory.long_context_choice import (
    long_context_label,
    long_context_on_auto,
    resolve_long_context,
)
from memtune.memory.plan_text import format_plan
from memtune.memory.recompute import (
    AUTO_CHECKPOINT_SPARE_GIB,
    _full_asked,
    fits_with_spare,
    pinned,
    resolve_checkpoint_layers,
    settings_of,
    unresolved_layers,
)
from memtune.memory.step_time import format_step_time, step_time

# Relative step time of each change (1.0: free). Rough, on purpose: they only order variants.
COST_CHUNKED_LOSS = 1.0  # no slower than the plain loss (make bench: faster on CPU)
COST_CHECKPOINTING = 1.33
COST_ZERO3 = 1.10
COST_QLORA = 1.30
COST_8BIT_OPTIMIZER = 1.01
COST_HALF_MICRO_BATCH = 1.05


Apply = Callable[[RunConfig], RunConfig]
"""A change as a function from settings to new ones (with_sections: fields replaced, the
settings never copied deep or mutated)."""


def admitted(cfg: RunConfig, choices: Choices, machine: RankMachine) -> Decisions:
    """Decisions to plan a variant by before its layers are chosen: a variant that turns
    checkpointing on is planned with every layer recomputed in full (the most it needs); the
    launch then takes the fewest that fit (:func:`resolve_checkpoint_layers`)."""
    if unresolved_layers(cfg, choices):
        layers = int(cfg.model.architecture["num_hidden_layers"])
        full = _full_asked(cfg, choices)
        choices = dataclasses.replace(
            choices,
            recompute=layers if full is None else full,
            selective=0 if full is None else layers - full,
        )
    return decisions_for(cfg, machine, choices)


@dataclass
class Fit:
    """A variant plan.auto_fit considered: its settings, choices, admission decisions and plan."""

    cfg: RunConfig
    choices: Choices
    decisions: Decisions
    plan: Plan
    changes: list[str]
    cost: float


def _zero3(v: RunConfig) -> RunConfig:
    return with_sections(v, zero={"stage": 3, "template": None})


def memory_changes(cfg: RunConfig) -> list[tuple[str, str, float, Apply]]:
    """Each change that lowers the per-rank peak and keeps the batch, data, LoRA rank and
    schedule, not already made: (override, why, relative step time, how to apply it to the
    settings). All but QLoRA compute the same step; QLoRA trains over a 4-bit base (the
    dearest). ``cfg``: the decided run's settings (:func:`settings_of`)."""
    t, z, p = cfg.trainer, cfg.zero, cfg.peft
    out: list[tuple[str, str, float, Apply]] = []
    if t.loss == "plain":
        out.append(
            (
                "trainer.loss=auto",
                "chunked loss: no full-sequence logits",
                COST_CHUNKED_LOSS,
                lambda v: with_sections(v, trainer={"loss": "auto"}),
            )
        )
    if not t.activation_checkpointing:
        out.append(
            (
                "trainer.activation_checkpointing=true",
                "recompute layers in backward",
                COST_CHECKPOINTING,
                lambda v: with_sections(v, trainer={"activation_checkpointing": True}),
            )
        )
    if z.stage != 3:
        out.append(("zero=zero3", "shard the base weights over the ranks", COST_ZERO3, _zero3))
    if p.method == "lora" and (z.stage == 3 or not routed_experts(dict(cfg.model.architecture))):
        # (a mixture's 4-bit stacks load on ZeRO-3 only: config.validate)
        out.append(
            (
                "peft=qlora-nf4",
                "4-bit base",
                COST_QLORA,
                lambda v: with_sections(v, peft={"method": "qlora"}),
            )
        )
    if t.optimizer == "adamw":
        out.append(
            (
                "trainer.optimizer=adamw_8bit",
                "8-bit moments",
                COST_8BIT_OPTIMIZER,
                lambda v: with_sections(v, trainer={"optimizer": "adamw_8bit"}),
            )
        )
    return out


def _variants(cfg: RunConfig) -> list[tuple[RunConfig, list[str], float]]:
    """Every combination of memory_changes with every halving of the micro batch, cheapest
    first."""
    t = cfg.trainer
    changes = memory_changes(cfg)
    micro_batches = [t.micro_batch_size]
    while micro_batches[-1] > 1:
        micro_batches.append(micro_batches[-1] // 2)
    out = []
    for chosen in itertools.product([False, True], repeat=len(changes)):
        for micro in micro_batches:
            v = cfg
            names, cost = [], 1.0
            for on, (override, _, change_cost, apply) in zip(chosen, changes, strict=True):
                if on:
                    v = apply(v)
                    names.append(override)
                    cost *= change_cost
            if micro != t.micro_batch_size:
                v = with_sections(v, trainer={"micro_batch_size": micro})
                names.append(f"trainer.micro_batch_size={micro}")
                cost *= COST_HALF_MICRO_BATCH ** math.log2(t.micro_batch_size / micro)
            out.append((v, names, cost))
    return sorted(out, key=lambda item: (item[2], len(item[1])))


def device_need_gib(p: Plan) -> float:
    """What a plan needs of the device per rank: its step's peak, or its loading peak where
    that is larger (a quantized base read whole before ZeRO-3 shards it: memory.loading)."""
    return max(p.total_gib, p.loading.device_gib if p.loading is not None else 0.0)


def _loading_tips(cfg: RunConfig, d: Decisions, host: bool) -> list[tuple[str, str, Apply]]:
    """Changes that lower the loading peak, which memory_changes (the step's) leave alone: a
    base in the compute dtype loads already sharded under ZeRO-3 (zero.Init), where a
    quantized one is read whole first (on the device: not offered where the host's loading
    is what does not fit, ``host``, since a sharded load still reads the checkpoint through
    it); and a mixture split over more ranks reads only its own experts."""
    tips: list[tuple[str, str, Apply]] = []
    if d.zero_stage == 3 and d.peft_method != "lora" and not host:  # a quantized base
        tips.append(
            (
                "peft=lora",
                f"a {cfg.trainer.precision} base loads already sharded under ZeRO-3",
                lambda v: with_sections(v, peft={"method": "lora"}),
            )
        )
    split = d.experts.parallel if d.experts is not None else 0
    if split and d.batch.ranks % (2 * split) == 0:
        tips.append(
            (
                f"trainer.expert_parallel={2 * split}",
                "each rank reads and keeps fewer experts",
                lambda v: with_sections(v, trainer={"expert_parallel": str(2 * split)}),
            )
        )
    return tips


def suggestions(
    cfg: RunConfig, d: Decisions, counts: ParamCounts, machine: RankMachine
) -> list[str]:
    """Changes that lower the per-rank peak of ``cfg`` run as ``d``, each alone with what it
    saves by the plan, largest first; changes that would save less than 0.05 GiB are left out.
    Besides memory_changes: half the micro batch, and half the sequence length (which does
    change the data). The device's need is the step's peak or the loading peak, the larger
    (:func:`device_need_gib`); a run whose loading alone does not fit also gets the changes
    that lower loading (:func:`_loading_tips`). A run whose device fits and whose pinned host
    rows do not (offloaded layer inputs over plan.host_gib) is scored by what a change saves
    there, among the changes that keep the device fitting, and offloading nothing is one of
    them; one whose loading's host memory does not fit, by what a change saves of that."""
    settings, choices = settings_of(cfg, d), pinned(d)
    tips = [(override, why, apply) for override, why, _, apply in memory_changes(settings)]
    given = plan(cfg, d, counts)
    loading_host_bound = given.device_fits and not given.loading_fits_host
    host_bound = given.device_fits and given.loading_fits_host and not given.fits
    if host_bound and d.offload_activations:
        tips.append(
            (
                "trainer.offload_activations=off",
                "checkpointed layers' inputs kept on the device",
                lambda v: with_sections(v, trainer={"offload_activations": "off"}),
            )
        )
    loading_bound = given.loading is not None and device_need_gib(given) > given.total_gib
    if loading_bound or loading_host_bound:
        tips += _loading_tips(settings, d, host=loading_host_bound)
    half = d.batch.micro_batch // 2
    if half >= 1:
        tips.append(
            (
                f"trainer.micro_batch_size={half}",
                "accumulation makes up the global batch",
                lambda v: with_sections(v, trainer={"micro_batch_size": half}),
            )
        )
    half_len = cfg.data.max_seq_len // 2
    tips.append(
        (
            f"data.max_seq_len={half_len}",
            "shorter samples",
            lambda v: with_sections(v, data={"max_seq_len": half_len}),
        )
    )

    def need(p: Plan) -> float:
        if loading_host_bound:
            return p.loading.host_gib if p.loading is not None else 0.0
        return p.host_total_gib if host_bound else device_need_gib(p)

    scored = []
    for override, why, apply in tips:
        trial = apply(settings)
        if quantized_shape_problems(trial, trial.peft.method, counts):
            continue  # a 4-bit base bitsandbytes cannot pack for this architecture
        try:
            validate(trial, inputs=False)  # e.g. ZeRO-3 with trainer.expert_parallel > 1
        except ConfigError:
            continue
        kept = choices
        if trial.trainer.offload_activations == "off":
            kept = dataclasses.replace(choices, offload_activations=None)
        planned = plan(trial, admitted(trial, kept, machine), counts)
        if (host_bound or loading_host_bound) and not planned.device_fits:
            continue  # it moves the problem to the device
        saved = need(given) - need(planned)
        if saved >= 0.05:
            scored.append((saved, f"{override} ({why}): -{saved:.2f} GiB"))
    return [tip for _, tip in sorted(scored, key=lambda item: -item[0])]


def format_suggestions(
    cfg: RunConfig, d: Decisions, counts: ParamCounts, machine: RankMachine
) -> str:
    """The "Try:" list of a run that does not fit."""
    tips = suggestions(cfg, d, counts, machine)
    if not tips:
        given, need = plan(cfg, d, counts), ""
        if given.device_gib is not None and device_need_gib(given) > given.device_gib:
            need = (
                f"; it needs a device of {device_need_gib(given):.2f} GiB per rank "
                f"(plan.device_gib={given.device_gib:g})"
            )
        return f"Try: no single change memtune knows lowers it by 0.05 GiB or more{need}"
    return "Try (each alone, per rank):\n" + "\n".join(f"  - {tip}" for tip in tips)


ESTIMATE_TIE = 0.005
"""plan.auto_fit: variants whose estimated steps are this close (relative) are tied, and the
cheapest of them is taken (e.g. the 8-bit optimizer for a selective layer's 1 ms: no)."""


def auto_fit(
    cfg: RunConfig,
    d: Decisions,
    machine: RankMachine,
    known: ParamCounts | None = None,
) -> Fit | None:
    """The cheapest fitting variant of ``cfg`` run as ``d`` (the run itself if it fits), or
    None.

    A variant must leave the same spare as checkpoint_layers=auto (AUTO_CHECKPOINT_SPARE_GIB:
    what the plan may miss on a real GPU); only when none does is the cheapest one that fits
    at all taken. ``known``: the counts of ``cfg`` itself when already computed (one
    meta-device build of a 7B model takes seconds; the variants never change what LoRA adapts,
    so they share it).
    """
    settings, kept = settings_of(cfg, d), pinned(d)
    # What the user left to auto is decided again for each variant: ``d`` does not fit, so
    # its layers are all of them and its long-context choice the smallest plan's (a split
    # sequence, offloaded inputs), which a variant that fits would only keep for nothing
    # (ZeRO-3 at sp=4 with every layer recomputed, where sp=1 with 11 of them fits). The
    # variants keep the user's layer settings, so that the long-context search below plans
    # the layers the variant will recompute.
    t = cfg.trainer
    if d.checkpointing.enabled:
        layers = {"checkpoint_layers": t.checkpoint_layers, "selective_layers": t.selective_layers}
        settings = with_sections(settings, trainer=layers)
    if requested_recompute(cfg) is None or str(t.selective_layers) == "auto":
        # the layer counts follow the variant's settings: a selective_layers the user set
        # with checkpoint_layers=auto is asked again of each variant, not ``d``'s count (0
        # beside all layers recomputed in full, which the variant's own request contradicts)
        kept = dataclasses.replace(kept, recompute=None, selective=None)
    long_auto = long_context_on_auto(cfg)
    p = settings.peft
    counts: dict[tuple[str, int], ParamCounts] = {}
    if known is not None:
        counts[(p.target, p.r)] = known
    planned = []
    for variant, changes, cost in _variants(settings):
        try:
            validate(variant, inputs=False)  # only trainer, zero and peft vary
            if not long_auto:
                check_sequence_parallel(variant, d.sequence_parallel)
        except ConfigError:
            continue  # e.g. a micro batch the global batch no longer divides evenly
        key = (variant.peft.target, variant.peft.r)  # what the counts depend on
        if key not in counts:
            counts[key] = count_params(variant)
        if quantized_shape_problems(variant, variant.peft.method, counts[key]):
            continue  # QLoRA cannot quantize this architecture's layers
        choices = as_launched(variant, kept, counts[key], machine)  # kept where nothing is auto
        decided = admitted(variant, choices, machine)
        planned.append(
            Fit(variant, choices, decided, plan(variant, decided, counts[key]), changes, cost)
        )
    device = cfg.plan.device_gib
    for spare in (AUTO_CHECKPOINT_SPARE_GIB, 0.0):
        # The whole plan fits (the host's pinned rows and the loading peak too, not only the
        # step's device total), with the spare on the device.
        fitting = [
            f
            for f in planned
            if f.plan.fits and (device is None or f.plan.total_gib <= device - spare)
        ]
        # The base's precision is kept whenever a variant that keeps it fits: QLoRA is taken
        # for memory, never for speed alone (with few layers recomputed, the estimate can
        # price a 4-bit base faster than a bf16 one that recomputes more).
        precise = [f for f in fitting if f.decisions.peft_method == d.peft_method]
        fitting = precise or fitting
        if fitting and cfg.plan.device_tflops:
            # With a step-time estimate (memory/step_time.py), the fastest by that estimate,
            # its checkpointed layers chosen as the launch would; ties (within ESTIMATE_TIE)
            # keep the cheapest: a change is made for speed, never for a rounding of it.
            steps = [_estimated_step_s(f, counts, machine) for f in fitting]
            fastest = min(steps)
            return next(
                f for f, s in zip(fitting, steps, strict=True) if s <= fastest * (1 + ESTIMATE_TIE)
            )
        if fitting:
            return fitting[0]  # cheapest first
    return None


def _estimated_step_s(
    fit: Fit, counts: dict[tuple[str, int], ParamCounts], machine: RankMachine
) -> float:
    c = counts[(fit.cfg.peft.target, fit.cfg.peft.r)]
    resolved, _ = resolve_checkpoint_layers(fit.cfg, fit.choices, c, machine)
    estimate = step_time(fit.cfg, resolved, c)
    return estimate.step_s if estimate else math.inf


def as_launched(
    settings: RunConfig, choices: Choices, counts: ParamCounts, machine: RankMachine
) -> Choices:
    """``choices`` with the long-context choices ``settings`` leaves to auto decided again,
    as a launch of ``settings`` would (resolve_long_context)."""
    if not long_context_on_auto(settings):
        return choices
    lc, _ = resolve_long_context(settings, counts, machine)
    return dataclasses.replace(
        choices,
        sequence_parallel=lc.sequence_parallel,
        tiled_mlp=lc.tiled_mlp,
        offload_activations=lc.offload_activations,
    )


def other_zero_stage(cfg: RunConfig, d: Decisions) -> tuple[RunConfig, Choices]:
    """The decided run on the other ZeRO stage, its checkpointed layers left to choose."""
    stage = 2 if d.zero_stage == 3 else 3
    settings = with_sections(settings_of(cfg, d), zero={"stage": stage, "template": None})
    return settings, dataclasses.replace(pinned(d), recompute=None, selective=None)


def larger_micro_batch_under_split(
    cfg: RunConfig, d: Decisions
) -> tuple[RunConfig, Choices] | None:
    """Under ZeRO-3 with a split sequence: the decided run with k× the micro batch (the
    largest k ≤ sp that divides the accumulation steps; its checkpointed layers left to
    choose), or None. ZeRO-3 gathers the weights once per micro step, and a group of sp ranks
    runs every one of its sequences together, so at the micro batch of sp=1 a split sequence
    takes sp× the micro steps — and sp× the gathers — for the same global batch. k× the micro
    batch holds k× the tokens per rank (at k = sp, as many as sp=1 did) in 1/k of the micro
    steps."""
    sp = d.sequence_parallel
    if d.zero_stage != 3 or sp == 1:
        return None
    gas = d.batch.accumulation
    k = max((k for k in range(2, sp + 1) if gas % k == 0), default=None)
    if k is None:
        return None
    micro = d.batch.micro_batch * k
    settings = with_sections(settings_of(cfg, d), trainer={"micro_batch_size": micro})
    return settings, dataclasses.replace(pinned(d), recompute=None, selective=None)


def format_step_estimates(
    cfg: RunConfig, d: Decisions, counts: ParamCounts, machine: RankMachine
) -> str | None:
    """The step-time estimate of ``cfg`` run as ``d`` and, for comparison, of the other ZeRO
    stage (its long-context choices and checkpointed layers decided again, as its launch
    would) and, under ZeRO-3 with a split sequence, of a larger micro batch (the decided split
    kept, its checkpointed layers chosen again); None without plan.device_tflops."""
    estimate = step_time(cfg, d, counts)
    if estimate is None:
        return None
    lines = [format_step_time(cfg, estimate)]
    alternatives = []
    from memtune.memory.layouts import expert_layouts, format_layouts

    layouts = expert_layouts(cfg, d, counts, machine)
    if layouts:  # a mixture: its ZeRO stages are among its layouts
        lines += format_layouts(layouts, d)
    elif d.batch.ranks > 1:
        stage = 2 if d.zero_stage == 3 else 3
        # its long-context choices decided again, as its launch would (the split the
        # decided stage needed may not be the other's)
        settings, choices = other_zero_stage(cfg, d)
        choices = as_launched(settings, choices, counts, machine)
        alternatives.append(((settings, choices), f"zero=zero{stage}"))
    larger = larger_micro_batch_under_split(cfg, d)
    if larger is not None:
        m = larger[0].trainer.micro_batch_size
        alternatives.append((larger, f"trainer.micro_batch_size={m}"))
    for (variant, choices), label in alternatives:
        try:  # a stage the run's settings are refused under (DoRA on a 4-bit base: ZeRO-2 only)
            validate(variant, inputs=False)
        except ConfigError as err:
            lines.append(f"  {label} instead: refused ({str(err).split(': ', 1)[0]})")
            continue
        other, _ = resolve_checkpoint_layers(variant, choices, counts, machine)
        other_plan = plan(variant, other, counts)
        other_estimate = step_time(variant, other, counts)
        assert other_estimate is not None
        fits = "fits" if other_plan.fits else "does not fit"
        if other_plan.fits and not fits_with_spare(other_plan) and other_plan.device_gib:
            # as the layouts of a mixture say it: auto would not take it (the shipped VL's ZeRO-2)
            room = other_plan.device_gib - other_plan.total_gib
            fits = f"fits, {room:.2f} GiB spare (auto wants {AUTO_CHECKPOINT_SPARE_GIB:g})"
        # its long-context choices named where they are not the run's (decided again above)
        long = long_context_label(other)
        long = f", {long}" if long != long_context_label(d) else ""
        lines.append(
            f"  {label} instead: {other_estimate.seconds()} per step"
            + (f" (communication {other_estimate.comm_share:.0%})" if other_estimate.priced else "")
            + f", {other_plan.total_gib:.2f} GiB "
            f"per rank ({fits}, checkpointing {other.checkpointing.label()}{long})"
        )
    return "\n".join(lines)


@dataclass
class Fitted:
    """What fit_to_device decided: the decisions to run and their plan, and the settings'
    own decisions (before plan.auto_fit replaced them) with theirs."""

    cfg: RunConfig
    """The user's settings, as given (what config.yaml records)."""
    decisions: Decisions
    plan: Plan
    given: Decisions
    given_plan: Plan
    changes: list[str]  # auto_fit's overrides, [] when it changed nothing
    notes: list[str]  # what was decided and why, for the caller to say
    machine: RankMachine

    @classmethod
    def as_decided(cls, cfg: RunConfig, d: Decisions, machine: RankMachine) -> Fitted:
        """Decisions made already (an out-of-memory restart's variant of the run's), with
        their plan: deciding again could pick another variant (auto_fit), which the run's
        checkpoint would not continue."""
        planned = plan(cfg, d)
        return cls(cfg, d, planned, d, planned, [], [], machine)


ONE_RANK_NOTE = (
    "one rank: ZeRO-2 instead of ZeRO-3 (nothing to shard; ZeRO-3's gather hooks only cost "
    "time). zero.one_rank_stage2=false keeps ZeRO-3."
)


def fit_to_device(
    cfg: RunConfig, refuse: bool = True, machine: RankMachine | None = None
) -> Fitted:
    """Decide everything ``cfg`` leaves to memtune: one rank's ZeRO stage, the long-context
    choices, the number of checkpointed layers, the kernels on ``machine`` (default: this
    machine, where the ranks start: config.decisions.rank_machine) and, with plan.auto_fit, a
    variant that fits. With ``refuse`` (and plan.enforce) a run that cannot fit raises
    ConfigError with the breakdown and suggestions; plan_only passes False to show the same
    decisions without refusing."""
    machine = machine or rank_machine()
    notes = []
    staged = cfg
    if one_rank_stage(cfg) != cfg.zero.stage:
        staged = with_sections(cfg, zero={"stage": one_rank_stage(cfg)})
        notes.append(ONE_RANK_NOTE)
    counts = count_params(staged)
    problems = quantized_shape_problems(staged, staged.peft.method, counts)
    if problems:
        raise ConfigError(
            "peft.method=qlora cannot quantize these layers of model.architecture:\n  "
            + "\n  ".join(problems)
        )
    choices, long_note = resolve_long_context(staged, counts, machine)
    d, note = resolve_checkpoint_layers(staged, choices, counts, machine)
    notes += [n for n in (long_note, note) if n]
    if str(cfg.trainer.expert_parallel) == "auto":
        d, note = _expert_layout(staged, d, counts, machine)
        notes += [note] if note else []
    result = plan(cfg, d, counts)
    fit = (
        auto_fit(cfg, d, machine, result.counts) if not result.fits and cfg.plan.auto_fit else None
    )
    if fit is not None:
        # Variants never change what LoRA adapts: the counts stay valid (see auto_fit).
        chosen, note = resolve_checkpoint_layers(fit.cfg, fit.choices, counts, machine)
        chosen_plan = plan(cfg, chosen, counts)
        if chosen_plan.fits:
            notes += [note] if note else []
            how = _fit_note(result, chosen_plan)
            if long_context_label(chosen) != long_context_label(d):
                how += f"; long context: {long_context_label(chosen)}"
            notes.append(f"auto_fit: {' '.join(fit.changes)} ({how})")
            return Fitted(cfg, chosen, chosen_plan, d, result, fit.changes, notes, machine)
    if not result.fits and cfg.plan.enforce and refuse:
        decided = "".join(f"{note}\n" for note in notes)
        text = format_plan(cfg, d, result)
        tail = (
            f"{format_suggestions(cfg, d, counts, machine)}\n(plan.auto_fit=true picks the "
            "fastest variant that fits, keeping the base's precision whenever a variant that "
            "keeps it fits: QLoRA only for memory; plan.enforce=false launches anyway)"
        )
        if result.device_fits:  # the host: pinned inputs, or the loading peak
            raise ConfigError(
                f"{decided}this run's host memory per rank does not fit plan.host_gib (its "
                f"lines below):\n{text}\n{tail}"
            )
        device = result.device_gib or 0.0  # set: the device is what does not fit
        if result.loading is not None and result.total_gib <= device:
            raise ConfigError(
                f"{decided}this run's loading needs {result.loading.device_gib:.2f} GiB per "
                f"rank on the device (its loading: line below) but the device has "
                f"{device:.2f} GiB (plan.device_gib):\n{text}\n{tail}"
            )
        raise ConfigError(
            f"{decided}this run needs {result.total_gib:.2f} GiB per rank but the device has "
            f"{result.device_gib:.2f} GiB (plan.device_gib):\n{text}\n{tail}"
        )
    return Fitted(cfg, d, result, d, result, [], notes, machine)


def _fit_note(given: Plan, chosen: Plan) -> str:
    """What auto_fit's change did: the device's GiB per rank, or the host's where the run as
    given did not fit there (plan.device_gib may be unset)."""
    if given.device_fits:
        return (
            f"host memory per rank: {chosen.host_total_gib:.2f} GiB pinned, as given "
            f"{given.host_total_gib:.2f}; plan.host_gib over the ranks of a node"
        )
    return (
        f"planned {chosen.total_gib:.2f} of {given.device_gib:.2f} GiB per rank; as given it "
        f"needed {given.total_gib:.2f}"
    )


def _expert_layout(
    cfg: RunConfig, d: Decisions, counts: ParamCounts, machine: RankMachine
) -> tuple[Decisions, str | None]:
    """trainer.expert_parallel=auto: the decisions of the layout memory.layouts chooses (the
    ZeRO stage with it), and a note naming it; ``d`` as it is for a dense model or one rank."""
    from memtune.memory.layouts import choose_layout, expert_layouts, layout_setting

    chosen = choose_layout(expert_layouts(cfg, d, counts, machine))
    if chosen is None:
        return d, None
    step = f"{chosen.step.seconds()} a step, " if chosen.step is not None else ""
    return chosen.decisions, (
        f"trainer.expert_parallel=auto: {layout_setting(chosen)} ({chosen.label}; {step}"
        f"{chosen.plan.total_gib:.2f} GiB per rank; the layouts side by side under the step time)"
    )


def out_of_memory_variant(
    cfg: RunConfig, d: Decisions, machine: RankMachine
) -> tuple[Decisions, list[str]] | None:
    """After a rank ran out of memory: the cheapest change that saves memory and can still
    continue from the run's checkpoint (the optimizer state, the data position in micro
    batches and the ZeRO partitions stay as they are, so only what the step recomputes may
    change: the chunked loss, then activation checkpointing of every layer). None when there
    is nothing left of that kind."""
    if d.loss == "plain":
        return dataclasses.replace(d, loss=loss_kernel("auto", machine)), ["trainer.loss=auto"]
    if not d.checkpointing.enabled:
        every = ["trainer.activation_checkpointing=true", "trainer.checkpoint_layers=all"]
        return _every_layer_recomputed(cfg, d), every
    if d.checkpointing.recomputed < len(d.checkpointing.layers):
        return _every_layer_recomputed(cfg, d), ["trainer.checkpoint_layers=all"]
    return None


def _every_layer_recomputed(cfg: RunConfig, d: Decisions) -> Decisions:
    layers = len(d.checkpointing.layers)
    if not d.checkpointing.enabled:
        return d.with_checkpointing(
            Checkpointing.first(layers, layers, cfg.trainer.checkpointing_reentrant)
        )
    return d.with_recompute(layers)


def as_restarted(
    cfg: RunConfig, d: Decisions, machine: RankMachine, changes: list[str]
) -> Decisions:
    """The decisions of a later start of a run that plan.auto_fit restarted after an
    out-of-memory stop (oom_restart.json's ``changes``, one of :func:`out_of_memory_variant`'s):
    that change again, so a requeue or a rerun of the same command does not decide the step
    that ran out of memory once more (and stop there, its one restart spent)."""
    if "trainer.loss=auto" in changes and d.loss == "plain":
        d = dataclasses.replace(d, loss=loss_kernel("auto", machine))
    if "trainer.checkpoint_layers=all" in changes:
        d = _every_layer_recomputed(cfg, d)
    return d
