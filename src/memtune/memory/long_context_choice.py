"""The long-context choices left to auto (trainer.sequence_parallel, tiled_mlp,
offload_activations), decided from the plan, and the longest sequence a run's box can train
(make plan's line): memory.fit's launch decides the rest.

Each combination is planned with its checkpointed layers chosen as the launch would
(memory.recompute) and priced by memory.step_time where plan.device_tflops is set, else by
the fixed relative costs below.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

from memtune.config import ConfigError, RunConfig, rope_positions
from memtune.config.architecture import routed_experts
from memtune.config.decisions import (
    Checkpointing,
    Choices,
    Decisions,
    RankMachine,
    vision_of,
    with_sections,
)
from memtune.config.validate import check_sequence_parallel
from memtune.memory.counts import ParamCounts
from memtune.memory.estimate import Plan, plan
from memtune.memory.recompute import (
    AUTO_CHECKPOINT_SPARE_GIB,
    fits_with_spare,
    resolve_checkpoint_layers,
    settings_of,
)
from memtune.memory.step_time import step_time
from memtune.memory.vision import row_image_tokens


def long_context_on_auto(cfg: RunConfig) -> bool:
    """Any of trainer.sequence_parallel, tiled_mlp and offload_activations left to the planner."""
    t = cfg.trainer
    return "auto" in (str(t.sequence_parallel), t.tiled_mlp, t.offload_activations)


# Relative step time of each long-context choice, used only without plan.device_tflops
# (with it, memory.step_time prices recompute, all-to-alls and host copies).
COST_OFFLOAD = 1.03
COST_TILED_MLP = 1.08
COST_SEQUENCE_PARALLEL = 1.10  # per doubling of sp


def sequence_parallel_choices(cfg: RunConfig) -> list[int]:
    """The split sizes trainer.sequence_parallel=auto may take: divisors of the ranks that
    the heads, the KV heads and data.max_seq_len allow (config.validate's rules)."""
    out = []
    for sp in range(1, cfg.launcher.num_ranks + 1):
        try:
            check_sequence_parallel(cfg, sp)
        except ConfigError:
            continue
        out.append(sp)
    return out


def long_context_variants(cfg: RunConfig) -> list[tuple[Choices, float]]:
    """Every combination of the long-context choices left to auto (sequence_parallel,
    tiled_mlp, offload_activations), with its fixed relative cost; the settings' own value
    where one is set."""
    t = cfg.trainer
    value = str(t.sequence_parallel)
    sps = [int(value)] if value != "auto" else sequence_parallel_choices(cfg) or [1]
    if value == "auto" and vision_of(cfg, Checkpointing.off(1)) is not None:
        sps = [1]  # images train each sample on one rank (launcher.prepare.vision_for_images)
    tiles = [False, True] if t.tiled_mlp == "auto" else [t.tiled_mlp == "on"]
    offloads = [False, True] if t.offload_activations == "auto" else [t.offload_activations == "on"]
    if not t.activation_checkpointing:
        offloads = [False]
    selective = str(t.selective_layers) not in ("auto", "0")
    if t.compile or selective or routed_experts(dict(cfg.model.architecture)):
        # not built together (compile, selective layers asked for), not built for routed
        # experts: config.validate refuses them when set to on
        tiles = offloads = [False]
    out = []
    for sp, tile, offload in itertools.product(sps, tiles, offloads):
        choices = Choices(None, sp, tile, offload if t.activation_checkpointing else None)
        cost = COST_SEQUENCE_PARALLEL ** math.log2(sp)
        cost *= COST_TILED_MLP if tile else 1.0
        cost *= COST_OFFLOAD if offload else 1.0
        out.append((choices, cost))
    return sorted(out, key=lambda item: item[1])


def _unloaded(planned: Plan) -> Plan:
    """``planned`` without its loading peak: the step's memory alone."""
    return dataclasses.replace(planned, loading=None)


def _loading_fails(planned: Plan) -> bool:
    """The loading peak alone does not fit: the device's or the host's."""
    return not (planned.loading_fits_device and planned.loading_fits_host)


def long_context_label(d: Decisions) -> str:
    on = {True: "on", False: "off"}
    return (
        f"sequence_parallel={d.sequence_parallel} tiled_mlp={on[d.tiled_mlp]} "
        f"offload_activations={on[d.offload_activations]}"
    )


def _long_context_trial(
    cfg: RunConfig, choices: Choices, counts: ParamCounts, machine: RankMachine
) -> tuple[Decisions, Plan, bool]:
    """One combination of the long-context choices with its checkpointed layers chosen as the
    launch would: (its decisions, their plan, whether it fits with the spare)."""
    resolved, _ = resolve_checkpoint_layers(cfg, choices, counts, machine)
    planned = plan(cfg, resolved, counts)
    return resolved, planned, fits_with_spare(planned)


def resolve_long_context(
    cfg: RunConfig, counts: ParamCounts, machine: RankMachine
) -> tuple[Choices, str | None]:
    """The long-context choices ``cfg`` leaves to auto, decided. A run that fits without
    any (sp=1, MLP untiled, nothing offloaded) keeps it that way, even where the estimate
    prices a split sequence with fewer recomputed layers faster: the estimate knows the
    all-to-alls' bytes, not their latency, and none of the three is measured on a GPU yet.
    Otherwise, of the combinations whose plan fits (device and host, with
    AUTO_CHECKPOINT_SPARE_GIB to spare on the device; their checkpointed layers chosen as the
    launch would), the fastest by memory.step_time when plan.device_tflops is set, else the
    cheapest by the fixed costs above. When none fits, the one with the smallest plan (the
    refusal then shows its breakdown). The checkpointed layers are not chosen here (that
    comes next, for the chosen combination)."""
    if not long_context_on_auto(cfg):
        return Choices(), None
    variants = long_context_variants(cfg)
    cheapest = _long_context_trial(cfg, variants[0][0], counts, machine)
    if cheapest[2] or (_loading_fails(cheapest[1]) and fits_with_spare(_unloaded(cheapest[1]))):
        # The cheapest (none of them beyond what was set) fits: take it, and say nothing at
        # every launch — they stay unmeasured on GPUs. So where it fits but for its loading,
        # which no combination changes (the refusal names the loading).
        return variants[0][0], None
    trials = [cheapest, *(_long_context_trial(cfg, c, counts, machine) for c, _ in variants[1:])]
    scored = []
    for (choices, cost), (resolved, planned, fits) in zip(variants, trials, strict=True):
        speed = step_time(cfg, resolved, counts) if fits and cfg.plan.device_tflops else None
        scored.append((choices, resolved, cost, planned, fits, speed))
    fitting = [s for s in scored if s[4]]
    # Where the loading peak alone does not fit (the same for every combination), they are
    # chosen for the step as if it did (the refusal names the loading), not for the smallest
    # step, which only costs time. None with the spare: the fastest that leaves half of it
    # (the smallest plan cost 3.4 times the step for 0.2 GiB more: a split sequence at 256
    # tokens under ZeRO-3, four times the gathers), else the smallest plan (what the spare is
    # for: the plan's misses on a GPU).
    for_the_step = not fitting and _loading_fails(cheapest[1])
    step_of = _unloaded if for_the_step else (lambda planned: planned)
    half = AUTO_CHECKPOINT_SPARE_GIB / 2
    at_half = False
    if not fitting:
        fitting = [s for s in scored if fits_with_spare(step_of(s[3]))]
        if not fitting:
            fitting = [s for s in scored if fits_with_spare(step_of(s[3]), half)]
            at_half = bool(fitting)
        if cfg.plan.device_tflops:
            fitting = [(*s[:5], step_time(cfg, s[1], counts)) for s in fitting]
    if fitting:
        if cfg.plan.device_tflops:
            best = min(fitting, key=lambda s: s[5].step_s if s[5] else math.inf)
        else:
            best = fitting[0]
        kind = "the fastest" if cfg.plan.device_tflops else "the cheapest"
        what = " for the step" if for_the_step else "" if at_half else " that fits"
        if at_half:
            what += f" with {half:g} GiB to spare"
        why = f"{kind}{what} of {len(scored)} combinations"
        if at_half:
            why = f"none fits with {AUTO_CHECKPOINT_SPARE_GIB:g} GiB to spare: {why}"
        if for_the_step:
            why += "; its loading does not fit"
    else:
        best = min(scored, key=lambda s: step_of(s[3]).total_gib)
        short = f" with {AUTO_CHECKPOINT_SPARE_GIB:g} GiB to spare" if best[3].fits else ""
        why = f"none fits{short}: the smallest plan"
    return best[0], f"long context (auto): {long_context_label(best[1])} ({why})"


def longest_sequence(
    cfg: RunConfig, d: Decisions, counts: ParamCounts, machine: RankMachine, step: int = 1024
) -> tuple[int, str]:
    """The longest data.max_seq_len (a multiple of ``step``) whose plan fits ``cfg`` run as
    ``d``, with the long-context choices and checkpointed layers left to auto, and what they
    chose there. Memory only: positions beyond the model's max_position_embeddings need rope
    scaling."""
    auto = {"sequence_parallel": "auto", "tiled_mlp": "auto", "offload_activations": "auto"}
    base = with_sections(settings_of(cfg, d), trainer=auto)
    # Positions are checked against the rope limits by the caller, not here.
    architecture = {**cfg.model.architecture, "max_position_embeddings": 1 << 40}
    base = with_sections(base, model={"architecture": architecture})

    def at(n: int) -> RunConfig:
        return with_sections(base, data={"max_seq_len": n})

    def fits(n: int) -> bool:
        """Some combination fits: what resolve_long_context would find, without ranking
        them. The costliest first (it saves the most, so at the lengths this search probes it
        is the one most likely to fit), stopping at the first that fits."""
        trial = at(n)
        variants = long_context_variants(trial)[::-1]
        return any(
            fits_with_spare(_unloaded(_long_context_trial(trial, c, counts, machine)[1]))
            for c, _ in variants
        )  # the step's: no length changes the loading (format_longest_sequence says so)

    def how(n: int) -> str:
        """What the launch would choose at n: the combination and its checkpointed layers."""
        trial = at(n)
        choices, _ = resolve_long_context(trial, counts, machine)
        chosen, _ = resolve_checkpoint_layers(trial, choices, counts, machine)
        layers = trial.model.architecture["num_hidden_layers"]
        k = chosen.checkpointing.recomputed
        return f"{long_context_label(chosen)}, {k} of {layers} layers checkpointed"

    first = max(1, -(-row_image_tokens(cfg) // step))  # a row that holds plan.images
    if not fits(first * step):
        return 0, how(first * step)
    lo, hi = first, 2 * first
    while fits(hi * step) and hi < (1 << 14):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid * step):
            lo = mid
        else:
            hi = mid
    return lo * step, how(lo * step)


def _short_of_spare(planned: Plan) -> bool:
    """The plan fits (host and device), but not with the spare the searches keep."""
    return planned.fits and not fits_with_spare(planned)


def format_longest_sequence(
    cfg: RunConfig, d: Decisions, counts: ParamCounts, machine: RankMachine
) -> str:
    """make plan's line: the longest sequence this experiment's box can train, and how."""
    if _loading_fails(plan(cfg, d, counts)):
        # loading does not depend on the length: no search would find one
        return (
            f"longest sequence that fits ({AUTO_CHECKPOINT_SPARE_GIB:g} GiB spare): none, at any "
            "length: this run's loading does not fit (its loading: line), and the length does "
            "not change it"
        )
    n, how = longest_sequence(cfg, d, counts, machine)
    if not n:
        least = max(1, -(-row_image_tokens(cfg) // 1024)) * 1024  # longest_sequence's first
        short = ""
        if _short_of_spare(plan(cfg, d, counts)):  # the run fits, just not with the spare
            short = (
                f"; this run's {cfg.data.max_seq_len:,} leaves less than "
                f"{AUTO_CHECKPOINT_SPARE_GIB:g} GiB spare"
            )
        return (
            f"longest sequence that fits ({AUTO_CHECKPOINT_SPARE_GIB:g} GiB spare): none, "
            f"not even {least:,} tokens ({how}){short}"
        )
    limit = rope_positions(cfg)
    note = ""
    if n > limit and cfg.model.rope_scaling:
        note = f"; beyond the {limit:,} positions of its rope scaling: a larger factor"
    elif n > limit:
        note = f"; beyond the model's {limit:,} positions it needs model.rope_scaling (YaRN)"
    elif n < cfg.data.max_seq_len and _short_of_spare(plan(cfg, d, counts)):
        note = (
            f"; this run's {cfg.data.max_seq_len:,} leaves less than "
            f"{AUTO_CHECKPOINT_SPARE_GIB:g} GiB spare"
        )
    # A preference pair's two sequences share the row (either may be nearly all of it).
    unit = "sample" if cfg.trainer.objective == "sft" else "pair (chosen + rejected)"
    if row_image_tokens(cfg):
        p = cfg.plan
        size = f"{p.image_width}×{p.image_height}"
        unit += (
            f" packed with as many {size} images as it holds (at least {p.images})"
            if cfg.data.packing
            else f" with {p.images} image(s) of {size} in it"
        )
    return (
        f"longest sequence that fits (plan.max_seq_len_search, {AUTO_CHECKPOINT_SPARE_GIB:g} "
        f"GiB spare, long-context choices on auto): {n:,} tokens per {unit} with {how}{note}"
    )
