"""The plan next to what each rank measured: per-rank ratios, and what to suspect when a rank
held more than it was planned to. The rank's judgement, on the rank side: it reads the plan as
the job wrote it (rundir.PlanRecord, each row saying what a measurement can see of it).

The plan's total includes what a CUDA allocator's statistics never see (the CUDA context and
library workspaces) and what only its reserved pool holds (fragmentation), so each measure is
compared with the part of the plan it can see: ``max_memory_allocated`` with the live tensors'
rows, ``max_memory_reserved`` with those plus fragmentation, and what the device held beyond
the allocator (the most seen at the run's memory snapshots) with the rows only it holds. On
CPU a rank's RSS is mostly the Python/torch runtime, so the CPU figure is the RSS growth from
just before the model was built to the run's peak, and it is reported but never judged (it says
nothing about the plan).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from memtune.rundir import PlanRecord, PlanRow

OVER = 0.05
"""A rank whose measured peak exceeds its plan by more than this says so at the end."""

OUTSIDE = "outside the allocator"
"""The measure of what the device held beyond torch's allocator (rank.telemetry)."""

UNDER = 0.5
"""The offloaded inputs' host memory below this share of its row: the offload did not happen
as planned (rows this short of their plan are read as not done, not as saved)."""

HOST = "host offload"
"""The measure of the host memory a rank held for offloaded layer inputs (rank.long_context's
buffers), against the plan's host rows: exact on a GPU and on CPU ranks alike."""


@dataclass
class RankCheck:
    rank: int
    measure: str  # what was measured, e.g. "peak allocated"
    planned_gib: float
    measured_gib: float

    @property
    def ratio(self) -> float:
        return self.measured_gib / self.planned_gib if self.planned_gib else float("inf")

    def as_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "measure": self.measure,
            "planned_gib": round(self.planned_gib, 4),
            "measured_gib": round(self.measured_gib, 4),
            "measured_over_planned": round(self.ratio, 4),
        }


def _planned(record: PlanRecord, seen: Callable[[PlanRow], bool]) -> float:
    return sum(r.gib for r in record.rows if seen(r))


def check(
    record: PlanRecord,
    measured: list[dict[str, float]],
    device_type: str,
    cpu_start_rss_gib: list[float] | None = None,
) -> list[RankCheck]:
    """One comparison per rank and measure (CUDA: allocated and reserved; CPU: RSS growth)."""
    out = []
    for rank, m in enumerate(measured):
        if device_type == "cuda":
            allocated = _planned(record, lambda r: r.allocated and r.live)
            reserved = _planned(record, lambda r: r.allocated)
            out.append(RankCheck(rank, "peak allocated", allocated, m["peak_allocated_gib"]))
            if "peak_reserved_gib" in m:
                out.append(RankCheck(rank, "peak reserved", reserved, m["peak_reserved_gib"]))
            outside = _planned(record, lambda r: not r.allocated)
            if "peak_outside_allocator_gib" in m and outside > 0:
                # (a plan without plan.device_gib has no such row: nothing to judge it by)
                measured_outside = m["peak_outside_allocator_gib"]
                out.append(RankCheck(rank, OUTSIDE, outside, measured_outside))
        else:
            start = (cpu_start_rss_gib or [0.0] * len(measured))[rank]
            growth = max(m["peak_rss_gib"] - start, 0.0)
            out.append(RankCheck(rank, "RSS growth", _planned(record, lambda r: r.live), growth))
        host = sum(r.gib for r in record.host_rows)
        if host > 0 and "peak_host_offload_gib" in m:
            out.append(RankCheck(rank, HOST, host, m["peak_host_offload_gib"]))
    return out


def verdict(record: PlanRecord, checks: list[RankCheck], device_type: str) -> list[str]:
    """Lines for the closing summary: planned vs measured, and for a GPU rank more than 5%
    over its plan, the rows most likely responsible; the offloaded inputs' host memory against
    its rows on either device."""
    host = [c for c in checks if c.measure == HOST]
    checks = [c for c in checks if c.measure != HOST]
    return _device_verdict(record, checks, device_type) + _host_verdict(host)


def _host_verdict(host: list[RankCheck]) -> list[str]:
    if not host:
        return []
    per_rank = ", ".join(
        f"rank{c.rank} {c.measured_gib:.2f} of {c.planned_gib:.2f} planned" for c in host
    )
    lines = [f"offloaded layer inputs in host memory per rank, GiB: {per_rank}"]
    worst = max(host, key=lambda c: c.ratio)
    if worst.ratio > 1 + OVER:
        lines.append(
            f"WARNING: rank{worst.rank} held {worst.measured_gib:.2f} GiB of host memory for "
            f"offloaded layer inputs against {worst.planned_gib:.2f} planned (a micro batch "
            "wider than planned?); please report it with plan.json and memory.json."
        )
    least = min(host, key=lambda c: c.ratio)
    if least.ratio < UNDER:  # planned, and not (or hardly) done: the plan's device rows too
        lines.append(
            f"WARNING: rank{least.rank} held {least.measured_gib:.2f} GiB of host memory for "
            f"offloaded layer inputs against {least.planned_gib:.2f} planned: the layers' "
            "inputs were not offloaded as planned (their device memory with them); please "
            "report it with plan.json and memory.json."
        )
    return lines


def _device_verdict(record: PlanRecord, checks: list[RankCheck], device_type: str) -> list[str]:
    if device_type != "cuda":
        per_rank = ", ".join(
            f"rank{c.rank} {c.measured_gib:.2f} (planned {c.planned_gib:.2f})" for c in checks
        )
        return [
            f"RSS growth per rank, GiB: {per_rank} — on CPU it includes the Python/torch "
            "runtime and is not judged (memtune trace checks the plan)"
        ]
    lines = []
    for rank in sorted({c.rank for c in checks}):
        lines.append(
            f"rank{rank}: "
            + ", ".join(
                f"{c.measure} {c.measured_gib:.2f} of {c.planned_gib:.2f} GiB planned "
                f"({c.ratio:.2f}×)"
                for c in checks
                if c.rank == rank
            )
        )
    over = [c for c in checks if c.ratio > 1 + OVER and c.measure != OUTSIDE]
    outside_over = [c for c in checks if c.ratio > 1 + OVER and c.measure == OUTSIDE]
    if outside_over:
        worst = max(outside_over, key=lambda c: c.ratio)
        lines.append(
            f"WARNING: rank{worst.rank} held {worst.measured_gib:.2f} GiB outside torch's "
            f"allocator against {worst.planned_gib:.2f} planned (the CUDA context, kernels, "
            "library workspaces, NCCL's buffers, or another process on the same GPU): that much "
            "less was left for the steps; please report it with memory.json and the GPU's name."
        )
    if over:
        rows = sorted(
            (r for r in record.rows if r.allocated and r.live),
            key=lambda r: (not r.per_token, -r.gib),  # what grows with the batch first
        )
        suspects = ", ".join(f"{r.what} {r.gib:.2f} GiB ({r.how})" for r in rows[:3])
        worst = max(over, key=lambda c: c.ratio)
        lines.append(
            f"WARNING: rank{worst.rank}'s {worst.measure} is {worst.ratio - 1:.0%} over its plan "
            f"(more than {OVER:.0%}; {len(over)} measure(s) over in all). Most likely: "
            f"{suspects}. The longest micro batch decides the activations: check "
            "data.max_seq_len and the packing; please report it with plan.json and memory.json."
        )
    return lines
