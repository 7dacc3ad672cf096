"""Where a mixture's routed experts live across the ranks, planned side by side, and
``trainer.expert_parallel=auto``'s choice among them (issue #48 item 3):

* **ZeRO-3, experts sharded** (expert_parallel=1): every weight sharded over the ranks and
  all-gathered in each micro step's forward and backward — the least memory, the most bytes;
* **ZeRO-2, experts replicated** (expert_parallel=1): every rank holds every expert (where it
  fits: quantized stacks), nothing gathered;
* **ZeRO-2, expert parallelism** (expert_parallel=N, each N dividing the ranks and the
  experts): a rank holds 1/N of the experts and sends tokens to them by all-to-all
  (memory.expert_parallel);
* **ZeRO-3, expert parallelism** (the same N): as under ZeRO-2, the rest of the model sharded
  over all the ranks and gathered in each micro step, a rank's experts over the ranks holding
  the same experts (ranks / N; at N = ranks never gathered).

Each is planned with its checkpointed layers chosen as a launch would (the fewest that fit);
``auto`` takes the fastest by the step-time estimate (memory.step_time, no overlap) among those
that fit with checkpoint_layers=auto's spare, else among those that fit at all (plan.auto_fit's
rule), else ZeRO-3. Without plan.device_tflops (no estimate) it takes the first that fits in the
order above.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from memtune.config import ConfigError, RunConfig, validate
from memtune.config.decisions import Decisions, RankMachine, with_sections
from memtune.memory.counts import ParamCounts
from memtune.memory.estimate import Plan, plan
from memtune.memory.recompute import (
    AUTO_CHECKPOINT_SPARE_GIB,
    fits_with_spare,
    pinned,
    resolve_checkpoint_layers,
    settings_of,
)
from memtune.memory.step_time import StepTime, step_time


@dataclass
class Layout:
    """One placement of the experts, planned: its settings, decisions, plan and step time."""

    label: str
    cfg: RunConfig
    decisions: Decisions
    plan: Plan
    step: StepTime | None

    @property
    def step_s(self) -> float:
        return self.step.step_s if self.step is not None else math.inf


def expert_parallel_sizes(ranks: int, experts: int) -> list[int]:
    """The expert-parallel sizes > 1 the ranks and the experts allow (config.validate)."""
    return [n for n in range(2, ranks + 1) if ranks % n == 0 and experts % n == 0]


def expert_layouts(
    cfg: RunConfig, d: Decisions, counts: ParamCounts, machine: RankMachine
) -> list[Layout]:
    """The layouts of ``cfg`` run as ``d`` (module docstring); [] for a dense model or one
    rank. ``cfg``'s other settings are kept; the ones a layout cannot run with (an optimizer
    not built with expert parallelism) leave it out."""
    if d.experts is None or d.batch.ranks <= 1:
        return []
    settings = settings_of(cfg, d)
    choices = dataclasses.replace(pinned(d), recompute=None, selective=None)
    candidates = [(3, 1, "ZeRO-3, experts sharded"), (2, 1, "ZeRO-2, experts replicated")]
    sizes = expert_parallel_sizes(d.batch.ranks, d.experts.routed)
    candidates += [(2, n, f"ZeRO-2, experts split over {n} ranks") for n in sizes]
    candidates += [(3, n, f"ZeRO-3, experts split over {n} ranks") for n in sizes]
    out = []
    for stage, ep, label in candidates:
        variant = with_sections(
            settings,
            zero={"stage": stage, "template": None},
            trainer={"expert_parallel": str(ep)},
        )
        try:
            validate(variant, inputs=False)
        except ConfigError:
            continue
        decided, _ = resolve_checkpoint_layers(variant, choices, counts, machine)
        planned = plan(variant, decided, counts)
        out.append(Layout(label, variant, decided, planned, step_time(variant, decided, counts)))
    return out


def choose_layout(layouts: list[Layout]) -> Layout | None:
    """``auto``'s choice (module docstring); None when there is nothing to choose from."""
    for fits in (fits_with_spare, lambda p: p.fits):
        fitting = [lay for lay in layouts if fits(lay.plan)]
        if fitting:
            return min(fitting, key=lambda lay: lay.step_s)  # ties: the first listed
    return layouts[0] if layouts else None


def layout_setting(layout: Layout) -> str:
    """The settings that ask for ``layout``: zero=zeroS trainer.expert_parallel=N."""
    d = layout.decisions
    ep = d.experts.parallel if d.experts is not None else 1
    return f"zero=zero{d.zero_stage} trainer.expert_parallel={ep}"


def format_layouts(layouts: list[Layout], current: Decisions) -> list[str]:
    """The layouts, one line each (GiB per rank, step s without and with overlap, fits), the
    run's own and auto's choice marked."""
    chosen = choose_layout(layouts)
    spare = any(fits_with_spare(lay.plan) for lay in layouts)  # else auto takes what fits
    rule = f" with {AUTO_CHECKPOINT_SPARE_GIB:g} GiB to spare" if spare else ""
    lines = [
        "  where the routed experts live (trainer.expert_parallel=auto takes the fastest "
        f"that fits{rule}):"
    ]
    for lay in layouts:
        d = lay.decisions
        ep = d.experts.parallel if d.experts is not None else 1
        mine = current.experts is not None and (d.zero_stage, ep) == (
            current.zero_stage,
            current.experts.parallel,
        )
        marks = [m for m, on in (("this run", mine), ("auto", lay is chosen)) if on]
        lines.append(
            f"    {lay.label:<34}{lay.plan.total_gib:6.2f} GiB  {_step(lay)}  "
            f"{_fits(lay.plan, spare)}, "
            f"checkpointing {d.checkpointing.label()}  [{layout_setting(lay)}]"
            + (f"  ← {', '.join(marks)}" if marks else "")
        )
    return lines


def _fits(planned: Plan, spare: bool) -> str:
    """Whether a layout fits, and where not why: the device (while loading, where the step
    fits), or the host while loading; where it fits without checkpoint_layers=auto's spare,
    that, if ``spare`` (another layout has it, so auto passes this one over)."""
    if not planned.device_fits:
        step_fits = planned.device_gib is not None and planned.total_gib <= planned.device_gib
        return "does not fit the device while loading" if step_fits else "does not fit"
    if not planned.fits:
        return "does not fit the host" + ("" if planned.loading_fits_host else " while loading")
    if spare and not fits_with_spare(planned) and planned.device_gib is not None:
        room = planned.device_gib - planned.total_gib
        return f"fits, {room:.2f} GiB spare (auto wants {AUTO_CHECKPOINT_SPARE_GIB:g})"
    return "fits"


def _step(lay: Layout) -> str:
    if lay.step is None:
        return "no step estimate (plan.device_tflops)"
    if not lay.step.priced:
        return f"{lay.step.seconds()} a step"
    return f"{lay.step.step_s:6.2f} s a step ({lay.step.overlapped_s:.2f} s overlapped)"
