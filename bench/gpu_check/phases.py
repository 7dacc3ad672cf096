"""The phases, in priority order, and the one budget they share.

The orchestrator walks :data:`PHASES` in order (the most valuable first) and draws each phase's
time from one :class:`Budget` for the whole run: a phase is given its cap or what is left,
whichever ends first, so the time a phase does not use goes to the phases after it; a phase
that does not fit (less left than it needs) is not started, and is recorded as skipped with
the reason; a phase the budget's end cut short (given less than its cap, and out of time) is
recorded so. What one lent session skipped or cut short, the next runs with ``--phases`` (the
status line names them: ``next session --phases ...``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class PhaseSpec:
    """One phase: what it runs, the least time worth starting it with, the most it is given."""

    name: str
    method: str  # conf experiment (configs.METHODS), or "moe" / "attention" (no experiment)
    side: str  # profile, profile-baseline, memtune, baseline, kernels, attention, long, block,
    # torch, fla, unsloth-model, unsloth, at-unsloth, whole, whole-offload, load
    need_s: float
    """On the GPU: the least time it needs for its first result (what it took on the H200,
    2026-12-04, rounded up); with less left it is skipped, not started to be cut short."""
    cap_s: float
    """On the GPU: the most it is given (its deadline); the tail past its first result (a
    search under the cap, later lengths, later variants) stops at the deadline."""
    group: str = ""
    """A group run only when named (``--phases unsloth``, or the phase's name) and in the dry
    run: ``unsloth`` needs its own carry and its own device call; ``mixture`` its own call
    (a 30B model: minutes of the device's time)."""


# In order of value, the most valuable first: each takes its time before the next is given
# any. The H200's times (2026-12-04, bench/results/2026-12-04-h200*.md): 27, 20, 21, 38 s
# (with the search), long-qlora 128 s (32k timed ~60 s, then the search), long-lora 68 s,
# 24, 20-31, 31 and 78 s (fla: Triton compiles and autotunes in the first step).
PHASES = (
    # Where a step's time goes, memtune's and the recipe's, LoRA at 2,048 tokens under
    # torch.profiler (issue #47: the profile first, so every change is measured the same way).
    PhaseSpec("profile-memtune", "lora", "profile", need_s=40, cap_s=90),
    PhaseSpec("profile-baseline", "lora", "profile-baseline", need_s=35, cap_s=80),
    PhaseSpec("lora-memtune", "lora", "memtune", need_s=30, cap_s=120),
    PhaseSpec("lora-baseline", "lora", "baseline", need_s=25, cap_s=90),
    PhaseSpec("qlora-baseline", "qlora", "baseline", need_s=25, cap_s=100),
    PhaseSpec("qlora-memtune", "qlora", "memtune", need_s=40, cap_s=200),  # + the 24 GB search
    # The fused kernels one by one on memtune's LoRA step at 2,048 tokens (issue #47 item 4):
    # all torch, each of Liger's alone, all three, Liger's loss against the chunked head. Not
    # measured yet: an estimate (the build ~15 s, 7 variants of 5 steps ~25 s, Triton's first
    # compiles ~15 s).
    PhaseSpec("kernels", "lora", "kernels", need_s=35, cap_s=100),
    # Attention over a packed row at Qwen2.5-7B's shape: sdpa_varlen's call a sample against
    # torch_varlen's call a row and FlashAttention-2's (attention.py; no model: seconds).
    PhaseSpec("attention-packed", "attention", "attention", need_s=15, cap_s=40),
    PhaseSpec("long-qlora", "qlora", "long", need_s=60, cap_s=150),  # 32k timed, then longer
    PhaseSpec("long-lora", "lora", "long", need_s=60, cap_s=120),
    # trainer.compile on the GPU (issue #47 item 4; tested on CPU only): memtune's LoRA step at
    # 2,048 tokens with every decoder layer compiled, beside lora-memtune's eager row. Not
    # measured yet: an estimate (the build ~20 s, inductor's compile of a layer's forward and
    # backward, and of the checkpointed layers' recompute, ~40-60 s in the first step).
    PhaseSpec("lora-compiled", "lora", "compiled", need_s=70, cap_s=150),
    # ZeRO's own cost on one card (issue #47 item 7; zero_cost.py): memtune's LoRA step at
    # 2,048 tokens without DeepSpeed, then the same model in its ZeRO engine. Not measured yet:
    # an estimate (the build ~20 s as lora-memtune's, 2 × 5 steps and DeepSpeed's set-up ~15 s).
    PhaseSpec("zero-cost", "lora", "zero-cost", need_s=35, cap_s=90),
    # A DPO step on a row holding one pair (reference precomputed: the pass is timed too).
    PhaseSpec("dpo-memtune", "dpo", "memtune", need_s=30, cap_s=90),
    # One Qwen3-MoE sparse block at Qwen3-30B-A3B's width: memtune's routed experts (torch's
    # grouped_mm where torch allows, the loop otherwise) against transformers' grouped_mm
    # (no experiment: run_phase dispatches on "moe").
    PhaseSpec("moe-block", "moe", "block", need_s=30, cap_s=60),
    # Qwen3.5 (hybrid) on packed rows, transformers' torch code for the Gated DeltaNet layers
    # (flash-linear-attention blocked in that process), then with flash-linear-attention
    # (its Triton kernels compile and autotune in the first step: a longer cap).
    PhaseSpec("qwen35-torch", "qwen35", "torch", need_s=35, cap_s=75),
    PhaseSpec("qwen35-fla", "qwen35", "fla", need_s=80, cap_s=100),
    # Unsloth beside memtune (issue #47 item 5), in its own device call with its own carry
    # (.whl-unsloth/, bench/gpu_check/unsloth.py): the same random-weight model saved with
    # Qwen's tokenizer (bf16, 15 GB), Unsloth's LoRA and QLoRA at the same lengths, then memtune
    # planned and capped at Unsloth's peak. Not run yet: estimates (import ~30 s, loading
    # 15 GB ~30 s, QLoRA quantizing on load, 2 lengths of 5 steps; memtune's build ~20 s).
    PhaseSpec("unsloth-model", "lora", "unsloth-model", need_s=45, cap_s=120, group="unsloth"),
    PhaseSpec("unsloth-lora", "lora", "unsloth", need_s=90, cap_s=150, group="unsloth"),
    PhaseSpec("unsloth-qlora", "qlora", "unsloth", need_s=100, cap_s=180, group="unsloth"),
    PhaseSpec("lora-at-unsloth", "lora", "at-unsloth", need_s=30, cap_s=90, group="unsloth"),
    PhaseSpec("qlora-at-unsloth", "qlora", "at-unsloth", need_s=40, cap_s=100, group="unsloth"),
    # A whole mixture on one card (issue #48 item 6; bench/gpu_check/mixture.py), in its own
    # device call (--phases mixture): Qwen3-30B-A3B QLoRA as the planner fits a 24 GB card,
    # the base quantized a layer at a time; then the streaming loader on a 12-layer
    # Qwen3-30B-A3B written to local disk (mixture_load.py); then LoRA on every expert with
    # the optimizer on the host, if the planner's pick was not that. Not run yet: estimates,
    # from the H200's dense phases and this CPU's dry run, not measured. mixture-qlora: imports
    # ~15 s, the candidates planned ~3 s, 48 layers drawn and quantized on the GPU ~30 s,
    # DeepSpeed ~10 s, 5 steps at 2,048 and 5 at 4,096 tokens ~20 s. mixture-load: 15.6 GB
    # written (~30 s), read and quantized by from_pretrained (~40 s). mixture-qlora-offload:
    # the build again, DeepSpeed's CPU Adam compiled at first use (~60-90 s), 5 steps with
    # 642.5M weights updated on the host (~10 s), 4,096 tokens planned not to fit (its OOM).
    PhaseSpec("mixture-qlora", "mixture", "whole", need_s=90, cap_s=200, group="mixture"),
    PhaseSpec("mixture-load", "mixture", "load", need_s=100, cap_s=200, group="mixture"),
    PhaseSpec(
        "mixture-qlora-offload", "mixture", "whole-offload", need_s=180, cap_s=300, group="mixture"
    ),
)
PHASE_NAMES = tuple(p.name for p in PHASES)
DRY_NEED_S = 20.0
DRY_CAP_S = 180.0
"""The dry run (CPU, tiny models) ignores the GPU's times: a phase needs 20 s and may take
180 (within the budget, ``Mode.budget_s``): the longest takes ~35 s on 2 cores, so a phase
that hangs (one did, on a build lock: orchestrate.py) fails CI's dry run in 3 min, not 10."""
SKIPPED = "skipped (not run)"
"""How the status of a phase that did not fit begins."""
CUT_SHORT = "cut short by the budget"
"""In the status of a phase given less than its cap that ran out of time."""


def spec(name: str) -> PhaseSpec:
    return next(p for p in PHASES if p.name == name)


def select(names: str | None, groups: tuple[str, ...] = ()) -> list[PhaseSpec]:
    """``--phases``' subset (comma-separated names, or a group's name), in priority order;
    without one, every phase outside a group and those of ``groups``."""
    if names:
        wanted = names.split(",")
        return [p for p in PHASES if p.name in wanted or (p.group and p.group in wanted)]
    return [p for p in PHASES if not p.group or p.group in groups]


class Budget:
    """The run's one budget: ``total_s`` from ``start``, drawn on by the phases in turn."""

    def __init__(self, total_s: float, dry_run: bool, start: float | None = None):
        self.start = time.time() if start is None else start
        self.end = self.start + total_s
        self.dry_run = dry_run

    def left(self, now: float | None = None) -> float:
        return self.end - (time.time() if now is None else now)

    def need(self, phase: PhaseSpec) -> float:
        return DRY_NEED_S if self.dry_run else phase.need_s

    def cap(self, phase: PhaseSpec) -> float:
        return DRY_CAP_S if self.dry_run else phase.cap_s

    def grant(self, phase: PhaseSpec, now: float | None = None) -> tuple[float | None, str]:
        """``(deadline, "")`` for ``phase`` starting ``now``: its cap or the budget's end,
        whichever comes first; or ``(None, why)`` when less is left than it needs."""
        now = time.time() if now is None else now
        left, need = self.left(now), self.need(phase)
        if left < need:
            return None, f"{SKIPPED}: needs {need:.0f} s, {max(left, 0):.0f} s left of the budget"
        return now + min(self.cap(phase), left), ""


def next_session(status: dict[str, str]) -> str | None:
    """The ``--phases`` argument that runs what this run skipped or cut short, in priority
    order."""
    again = [
        n
        for n in PHASE_NAMES
        if status.get(n, "").startswith(SKIPPED) or CUT_SHORT in status.get(n, "")
    ]
    return f"--phases {','.join(again)}" if again else None
