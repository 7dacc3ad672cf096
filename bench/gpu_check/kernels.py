"""The fused kernels, one by one (phase ``kernels``, issue #47 item 4): memtune's LoRA step on
Qwen2.5-7B's shapes at 2,048 tokens (the profile's row) with every layer kernel torch, the
chunked loss head and peft's LoRA dropout; each of Liger's RMSNorm, SwiGLU and rotary alone;
all three; Liger's fused linear cross-entropy (trainer.loss=liger) against the chunked head;
all of it together; LoRA dropout's masks regenerated in backward (rank.lora_dropout); and
memtune's lean RMSNorm and SwiGLU (rank.lean_norm, rank.lean_swiglu).

One rank is built as ranks build themselves (``memtune_runner.build_memtune``: build_rank from
the all-torch variant's decisions); each variant's settings are then decided as a launch
decides them (``configs.decided_at``) and applied to that engine as build_rank applies them
(``rank.build.apply_kernel_decisions``: the loss kernel and rank.kernels' layer kernels), the
way ``memtune_at_length`` applies a length's decisions. The planner does not count the kernels'
activations, so every variant recomputes the same layers (recorded).

**Equal loss.** Every variant starts from the same trainable state — after one priming step,
memtune's gathered checkpoint of the LoRA weights, the optimizer's fp32 masters and moments,
its step and the schedule (rank.checkpoint.save_gathered_state), restored before each variant
— with the same RNG seed (LoRA dropout's masks) and the same rows, and trains the same steps:
its loss at every step is compared with the all-torch variant's (|Δ| ≤ ``EQUAL_LOSS`` nats),
and so is its gradient norm (``EQUAL_GRAD_NORM``, relative), so no speed-up is bought with a
different computation. With random weights the loss sits near ln(vocabulary) and moves little;
the gradient norm is the more sensitive of the two (the CPU tests and the GPU-marked test in
tests/test_kernels.py check the kernels' math itself).

liger-kernel travels to the GPU machine as an opt-in wheel (``.whl/opt``, installed apart into
``$GPU_CHECK_OPT_SITE``) and only this phase puts it on its path: the other phases run what a
default install runs, as the 2026-12-04 rows did. In the dry
run (CPU, no Triton) Liger's functions are stood in by the same math in torch
(rank.kernels.REFERENCE) and Liger's loss by the plain one; the table says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib
import itertools
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from .batches import synthetic_batch
from .configs import compose_cfg, decided_at
from .measure import empty_cache, peak_window, step_clock, timing
from .recorder import Phase, device_and_env, init_one_rank, time_left

THREE = {"rms_norm_kernel": "liger", "swiglu_kernel": "liger", "rope_kernel": "liger"}
VARIANTS: tuple[tuple[str, dict[str, str]], ...] = (
    ("torch", {}),
    ("RMSNorm", {"rms_norm_kernel": "liger"}),
    ("SwiGLU", {"swiglu_kernel": "liger"}),
    ("rotary", {"rope_kernel": "liger"}),
    ("all three", THREE),
    ("loss liger", {"loss": "liger"}),
    ("all three + loss liger", {**THREE, "loss": "liger"}),
    # LoRA dropout's masks regenerated in backward (rank.lora_dropout): no copies kept, one
    # more dropout pass; the engine keeps the first variant's recomputed layers, so this is
    # the pass's cost, and the peak what the copies held.
    ("dropout regenerated", {"lora_dropout_kernel": "regenerate"}),
    # memtune's lean RMSNorm (rank.lean_norm): transformers' ops, the input kept instead of
    # its fp32 copy, the backward block by block; the same recomputed layers, so this is its
    # cost (one more cast), and the peak what the copies held.
    ("RMSNorm lean", {"rms_norm_kernel": "lean"}),
    # memtune's lean SwiGLU (rank.lean_swiglu): SiLU's output made again in backward instead
    # of kept; the same recomputed layers, so this is its cost, and the peak what it held.
    ("SwiGLU lean", {"swiglu_kernel": "lean"}),
)
"""Each variant's trainer settings over BASE; the first is what the others are compared with."""
BASE = {
    "loss": "chunked",
    "rms_norm_kernel": "torch",
    "swiglu_kernel": "torch",
    "rope_kernel": "torch",
    "lora_dropout_kernel": "peft",
}
"""Every kernel named, none left to auto (auto's meaning depends on what is installed)."""
EQUAL_LOSS = 0.01
"""nats: a variant's loss at every step within this of all-torch's counts as equal."""
EQUAL_GRAD_NORM = 0.05
"""relative: its gradient norm at every step within this of all-torch's."""
OPT_SITE = "GPU_CHECK_OPT_SITE"
"""Where gpu_check.sh installed the opt-in wheels (liger-kernel); only this phase reads it."""


def liger_on_path() -> str | None:
    """liger-kernel from the opt-in site, when gpu_check.sh installed one; its version."""
    site = os.environ.get(OPT_SITE)
    if site and Path(site).is_dir() and site not in sys.path:
        sys.path.insert(0, site)
        importlib.invalidate_caches()
    try:
        from importlib.metadata import version

        return version("liger-kernel")
    except Exception:
        return None


class GradNorms:
    """The loop's logger, keeping each step's gradient norm (memtune.rank.loop logs it)."""

    def __init__(self) -> None:
        from memtune.rank.telemetry import NullLogger

        self.null = NullLogger()
        self.grad_norms: list[float | None] = []

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self.grad_norms.append(metrics.get("train/grad_norm"))

    def __getattr__(self, name: str) -> Any:  # progress, info, ...: nothing
        return getattr(self.null, name)


def apply_variant(engine: Any, d: Any, device: Any, stand_in: bool) -> tuple[Any, str]:
    """``d``'s kernels on the engine, as build_rank applies them; with ``stand_in`` (a machine
    without Triton: the dry run) Liger's functions replaced by their torch math and its loss
    by the plain one. Returns what was reached and a note."""
    from memtune.config.decisions import LEAN_KERNELS, Kernels
    from memtune.rank.build import apply_kernel_decisions
    from memtune.rank.kernels import REFERENCE, chosen, use_kernels

    if not stand_in:
        return apply_kernel_decisions(engine.module, d, device), ""
    lean = {k: "lean" if k in d.kernels.lean() else "torch" for k in LEAN_KERNELS}
    torch_only = dataclasses.replace(
        d,
        kernels=Kernels(**lean, lora_dropout=d.kernels.lora_dropout),  # torch, runs here
        loss="plain" if d.loss == "liger" else d.loss,
    )
    wired = apply_kernel_decisions(engine.module, torch_only, device)
    if d.kernels.fused():
        wired = use_kernels(engine.module.model, chosen(d.kernels, REFERENCE))
    stood = [*d.kernels.fused(), *(["loss by plain"] if d.loss == "liger" else [])]
    return wired, ", ".join(stood)


def run_kernels(phase: Phase, deadline: float) -> None:
    import torch

    from memtune.config.decisions import with_sections
    from memtune.config.deepspeed import build_ds_config
    from memtune.memory.counts import count_params
    from memtune.rank.checkpoint import follow_schedule, load_gathered_state, save_gathered_state
    from memtune.rank.kernels import liger_available
    from memtune.rank.loop import TrainResult, train

    from .memtune_runner import build_memtune
    from .profile import profile_length

    liger = liger_on_path()
    mode = phase.mode
    device = device_and_env(phase)
    init_one_rank(device)
    stand_in = mode.dry_run and not liger_available(device)
    seq_len = profile_length(phase)
    base_settings = tuple(f"trainer.{k}={v}" for k, v in BASE.items())
    cfg0 = compose_cfg(mode, "lora", seq_len, base_settings)
    counts = count_params(cfg0)
    cfg, d0 = decided_at(cfg0, seq_len, counts)
    parts, _ = build_memtune(cfg, d0, build_ds_config(cfg, d0), device)
    engine = parts.engine
    vocab = int(cfg.model.architecture["vocab_size"])
    batches = itertools.repeat(synthetic_batch(vocab, seq_len, seq_len))
    out: dict[str, Any] = {
        "seq_len": seq_len,
        "liger_kernel": liger,
        "stand_in": stand_in,
        "checkpointed_layers": d0.checkpointing.recomputed,
        "selective_layers": d0.checkpointing.selective,
        "attention": parts.attention,
        "steps": mode.warmup + mode.timed,
        "tolerance": {"loss_nats": EQUAL_LOSS, "grad_norm_rel": EQUAL_GRAD_NORM},
        "variants": [],
    }
    phase.data["kernels"] = out

    def steps(at: Any, d: Any, n: int, logger: Any) -> tuple[Any, Any]:
        clock = step_clock(device)
        run_cfg = with_sections(at, trainer={"max_steps": n, "log_every": 1})
        result = train(engine, batches, run_cfg, d, device, logger, TrainResult(), clock)
        return clock, result

    # One priming step (it gives the optimizer its state), then that state is the start of
    # every variant.
    steps(cfg, d0, 1, GradNorms())
    snapshot = Path(tempfile.mkdtemp(prefix="gpu_check_kernels_"))
    save_gathered_state(engine, snapshot, True)
    phase.save()
    for name, settings in VARIANTS:
        rec: dict[str, Any] = {"variant": name, "settings": settings}
        if not time_left(deadline, 15):
            phase.data["errors"].append({"where": f"kernels {name}", "error": "out of time"})
            rec["error"] = "skipped: out of time"
            out["variants"].append(rec)
            phase.save()
            continue
        try:
            at, d = decided_at(with_sections(cfg0, trainer=settings), seq_len, counts)
            rec["kernels"], rec["loss_kind"] = d.kernels.label(), d.loss
            if d.kernels.lora_dropout == "regenerate":
                rec["kernels"] += ", LoRA dropout regenerated"
            rec["same_recompute"] = d.checkpointing == d0.checkpointing
            wired, rec["note"] = apply_variant(engine, d, device, stand_in)
            rec["reached"] = dataclasses.asdict(wired)
            missed = wired.missing(d.kernels)
            if missed:
                raise RuntimeError(f"{name}: {'; '.join(missed)}")
            load_gathered_state(engine, snapshot)
            follow_schedule(engine, cfg.trainer.lr)
            torch.manual_seed(cfg.trainer.seed)
            logger = GradNorms()
            with peak_window(device, rec):
                clock, result = steps(at, d, mode.warmup + mode.timed, logger)
            rec.update(timing(clock.marks, mode.warmup, seq_len))
            rec["losses"], rec["grad_norms"] = result.losses, logger.grad_norms
        except Exception as err:
            rec["error"] = repr(err)[-2000:]
            phase.error(f"kernels {name}", err)
        finally:
            gc.collect()
            empty_cache(device)
        out["variants"].append(rec)
        compare_to_first(out)
        phase.save()
        print(f"gpu_check: {phase.name} {name}: {variant_line(rec)}", flush=True)
    import shutil

    shutil.rmtree(snapshot, ignore_errors=True)
    with contextlib.suppress(Exception):
        import torch.distributed as dist

        dist.destroy_process_group()


def compare_to_first(out: dict[str, Any]) -> None:
    """Each variant against the first (all torch): speed, peak, and equal loss."""
    variants = out["variants"]
    first = variants[0] if variants and variants[0].get("losses") else None
    for v in variants[1:] if first else []:
        if not v.get("losses") or len(v["losses"]) != len(first["losses"]):
            continue
        if v.get("tokens_per_s") and first.get("tokens_per_s"):
            v["speedup"] = v["tokens_per_s"] / first["tokens_per_s"]
        if v.get("peak_allocated_gib") is not None and first.get("peak_allocated_gib"):
            v["peak_delta_gib"] = v["peak_allocated_gib"] - first["peak_allocated_gib"]
        dl = [abs(a - b) for a, b in zip(v["losses"], first["losses"], strict=True)]
        v["max_loss_diff"] = max(dl)
        pairs = [
            (a, b)
            for a, b in zip(v.get("grad_norms", []), first.get("grad_norms", []), strict=False)
            if a is not None and b
        ]
        v["max_grad_norm_rel_diff"] = max((abs(a - b) / b for a, b in pairs), default=None)
        grads_ok = v["max_grad_norm_rel_diff"] is None or (
            v["max_grad_norm_rel_diff"] <= out["tolerance"]["grad_norm_rel"]
        )
        v["equal"] = v["max_loss_diff"] <= out["tolerance"]["loss_nats"] and grads_ok


def variant_line(rec: dict[str, Any]) -> str:
    if rec.get("error"):
        return f"error {rec['error'][:120]}"
    tps, peak = rec.get("tokens_per_s"), rec.get("peak_allocated_gib")
    return (
        f"{tps:,.0f} tokens/s"
        + (f", peak {peak:.2f} GiB" if peak is not None else "")
        + (f", {rec['speedup']:.3f}× torch" if "speedup" in rec else "")
        + (f", max |Δ loss| {rec['max_loss_diff']:.4f}" if "max_loss_diff" in rec else "")
    )


def kernels_markdown(k: dict[str, Any] | None) -> list[str]:
    """The kernels phase: one row a variant, against the first (all torch, chunked head)."""
    from .report import _f

    if not k:
        return []
    tol = k["tolerance"]
    lines = [
        "",
        "#### Fused kernels, one by one",
        "",
        f"memtune's LoRA step, {k['seq_len']:,} tokens, one engine: every variant decided from "
        "its settings and applied to it as build_rank applies them, from the same trainable "
        f"state (restored), seed and rows, {k['steps']} steps (timed: the last ones); "
        f"layers recomputed in every variant: {_f(k.get('checkpointed_layers'), 'd')} in full, "
        f"{_f(k.get('selective_layers'), 'd')} selectively; attention "
        f"{k.get('attention', '?')}; liger-kernel {k.get('liger_kernel') or 'not installed'}"
        + (
            " (**dry run: Liger's functions stood in by the same math in torch, its loss by "
            "the plain one**)"
            if k.get("stand_in")
            else ""
        )
        + f". *peak GiB*: `max_memory_allocated` over the variant's steps, the model's weights "
        f"included. *equal*: the loss within {tol['loss_nats']} nats and the gradient norm "
        f"within {tol['grad_norm_rel']:.0%} of the first row's at every step.",
        "",
        "| variant | layer kernels | loss | reached (norms / MLPs / attn) | tokens/s | × torch "
        "| step s | peak GiB | Δ peak GiB | last loss | max Δ loss | max Δ grad norm | equal |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for v in k["variants"]:
        reached = v.get("reached") or {}
        cells = "/".join(str(reached.get(x, "—")) for x in ("norms", "mlps", "attentions"))
        last = (v.get("losses") or [None])[-1]
        equal = {True: "yes", False: "**NO**"}.get(v.get("equal"), "—")
        if v.get("error"):
            lines.append(
                f"| {v['variant']} | {v.get('kernels', '—')} | {v.get('loss_kind', '—')} "
                f"| error: {v['error'][:100]} |||||||||"
            )
            continue
        lines.append(
            f"| {v['variant']} | {v.get('kernels', '—')} | {v.get('loss_kind', '—')} | {cells} "
            f"| {_f(v.get('tokens_per_s'), ',.0f')} | {_f(v.get('speedup'), '.3f')} "
            f"| {_f(v.get('step_s_median'), '.3f')} | {_f(v.get('peak_allocated_gib'), '.2f')} "
            f"| {_f(v.get('peak_delta_gib'), '+.2f')} | {_f(last, '.4f')} "
            f"| {_f(v.get('max_loss_diff'), '.4f')} "
            f"| {_f(v.get('max_grad_norm_rel_diff'), '.2%')} | {equal} |"
        )
    notes = [f"{v['variant']} ({v['note']})" for v in k["variants"] if v.get("note")]
    if notes:
        lines += ["", "Stood in by the same math in torch (no Triton here): " + "; ".join(notes)]
    if any(v.get("same_recompute") is False for v in k["variants"]):
        lines += ["", "**Not every variant recomputed the same layers** (see the JSON)."]
    return lines
