"""The plan as `make plan` and a launch print it: the rows per rank, the host's and the
loading's lines, and the verdict against the device (memory.estimate computes them)."""

from __future__ import annotations

from memtune.config import RunConfig, live_reference, needs_reference
from memtune.config.decisions import Decisions
from memtune.memory.estimate import Plan
from memtune.memory.recompute import AUTO_CHECKPOINT_SPARE_GIB


def _objective_note(cfg: RunConfig) -> str:
    """The plan header's word on a preference objective (nothing for SFT)."""
    objective = cfg.trainer.objective
    if objective == "sft":
        return ""
    note = f" · {objective}: a pair's chosen and rejected share a row"
    if live_reference(cfg):
        return note + ", the reference's forward in every step"
    return note + (", the reference precomputed" if needs_reference(cfg) else "")


def format_plan(cfg: RunConfig, d: Decisions, result: Plan) -> str:
    ranks, batch = d.batch.ranks, d.batch
    unit, scale = ("GiB", 1.0) if result.total_gib >= 1 else ("MiB", 1024.0)  # tiny demos
    lines = [
        f"memtune plan: {cfg.experiment} · {cfg.model.name_or_path} · {ranks} rank(s) · "
        f"ZeRO-{d.zero_stage} · {d.peft_method} r={cfg.peft.r} on {cfg.peft.target} · micro batch "
        f"{batch.micro_batch} × {batch.row_tokens:,} tokens · accum {batch.accumulation}"
        + (
            f" · sequence split over {batch.sequence_parallel} ranks"
            if batch.sequence_parallel > 1
            else ""
        )
        + _objective_note(cfg),
    ]
    if result.counts is not None:
        c = result.counts
        every = c.base + c.lora + (c.vision if d.vision is not None else 0)
        lines.append(
            f"parameters: trainable {c.lora:,} of {every:,} "
            f"({100 * c.lora / every:.3f}%; peft's print_trainable_parameters counts the same)"
        )
    lines.append(f"{'per rank':<28}{unit:>8}  how")
    for r in result.rows:
        lines.append(f"  {r.what:<26}{r.gib * scale:>8.2f}  {r.how}")
    lines.append(f"  {'total':<26}{result.total_gib * scale:>8.2f}")
    for r in result.host_rows:
        lines.append(f"  host: {r.what:<20}{r.gib * scale:>8.2f}  {r.how}")
    if result.host_rows:
        if result.host_gib is None:
            lines.append("  host memory per rank not checked (plan.host_gib=null)")
        else:
            ok = "fits" if result.host_total_gib <= result.host_gib else "DOES NOT FIT"
            lines.append(
                f"  host {result.host_gib:.2f} GiB per rank (plan.host_gib / ranks per node): "
                f"{ok} ({result.host_gib - result.host_total_gib:+.2f} GiB)"
            )
    if result.loading is not None:
        lo = result.loading
        lines.append(
            f"  loading: device {lo.device_gib * scale:.2f} {unit}, host {lo.host_gib * scale:.2f} "
            f"{unit} at the peak ({lo.how})"
        )
        budget = result.loading_host_budget_gib
        if budget is None:
            lines.append("  loading's host memory not checked (plan.host_gib=null)")
        else:
            ok = "fits" if result.loading_fits_host else "DOES NOT FIT"
            lines.append(
                f"  loading: host {budget * scale:.2f} {unit} per rank (plan.host_gib / ranks per "
                f"node, all reading at once): {ok} ({(budget - lo.host_gib) * scale:+.2f} {unit})"
            )
    if result.device_gib is None:
        lines.append("  (no device memory set: plan.device_gib=null, nothing to check against)")
    else:
        verdict = "fits" if result.device_fits else "DOES NOT FIT"
        spare = result.device_gib - result.total_gib
        spare_text = f"{spare:+.2f} GiB"
        if result.loading is not None and spare >= 0 and not result.device_fits:
            # the step fits; its loading does not (memory.loading)
            verdict += " while loading"
            load = result.device_gib - result.loading.device_gib
            spare_text = f"{load:+.2f} GiB; the step {spare:+.2f}"
        elif result.device_fits and spare < AUTO_CHECKPOINT_SPARE_GIB:
            # it launches; what checkpoint_layers=auto and the long-context choices aimed for
            # (their lines say "less than 2 GiB ... spare") is the margin for what the plan
            # may miss on a GPU
            spare_text += f", under the {AUTO_CHECKPOINT_SPARE_GIB:g} GiB spare auto aims for"
        lines.append(f"  device {result.device_gib:.2f} GiB per rank: {verdict} ({spare_text})")
    return "\n".join(lines)
