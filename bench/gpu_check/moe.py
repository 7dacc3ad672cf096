"""The MoE block phase (``moe-block``): one Qwen3-MoE sparse block, memtune's LoRA on the routed
experts against peft's over transformers' ``grouped_mm``, and the variants without adapters
or over quantized stacks."""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any

from .measure import empty_cache, is_oom, sync
from .modes import MOE_SHAPE
from .recorder import Phase, device_and_env, time_left

MOE_VARIANTS = (
    "memtune",
    "peft-grouped_mm",
    "frozen-memtune",
    "frozen-grouped_mm",
    "memtune-nf4",
    "memtune-int8",
    "memtune-loop",
)
"""In order of importance (a deadline loses the last ones): memtune's LoRA on the experts
against peft's over transformers' one-kernel grouped_mm, then the same without adapters (what
``peft.target=all-linear-but-experts`` runs), then memtune over quantized stacks, then
memtune's loop over the experts (the forward where torch has no grouped_mm)."""
MOE_R, MOE_SCALING = 16, 2.0  # LoRA r=16, alpha 32, as bench/moe_bench.py
MOE_TIMED = 5
"""Timed steps a variant on the GPU (after ``mode.warmup``): a step is tens of milliseconds
there, so more than the model phases' 3 for a steadier median; the dry run times one (a step
of the reduced block takes seconds on a CPU, and its numbers mean nothing)."""
MOE_VARIANT_S = 8.0
"""Time a variant needs at the least (build, quantize, warm-up, steps); a variant starts only
with that (or 1.5× the slowest so far) left before the phase's deadline."""
MIB = 1024**2


def moe_block(shape: dict[str, int], impl: str, device: Any, dtype: Any) -> Any:
    """transformers' ``Qwen3MoeSparseMoeBlock`` (router + fused expert stacks) of ``shape``,
    built on ``device`` in ``dtype`` (no fp32 copy on the way: 2.4 GB at full width), random
    weights (normal, std 0.02), frozen; ``impl``: its experts implementation."""
    import torch
    from transformers import AutoConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config: Any = AutoConfig.for_model(
        "qwen3_moe",
        **shape,
        num_hidden_layers=1,
        num_attention_heads=8,
        num_key_value_heads=2,
        intermediate_size=3072,
    )
    config._experts_implementation = impl
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            block = Qwen3MoeSparseMoeBlock(config)
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(std=0.02)
    return block.requires_grad_(False)


def moe_variant(variant: str, shape: dict[str, int], device: Any, dtype: Any) -> tuple[Any, str]:
    """The block of one :data:`MOE_VARIANTS` entry, ready to step, and a note on what it holds.

    memtune's adapters are made in the block's dtype (DeepSpeed's bf16 leaves them so), peft's
    too (``autocast_adapter_dtype=False``; its default would keep them fp32): the variants
    differ in how the experts compute, not in the adapters' precision."""
    import torch

    from memtune.expert_stacks import EXPERT_PARAMETERS, experts_state
    from memtune.rank.experts import add_expert_lora, quantize_experts, use_routed_forward

    frozen = variant.startswith("frozen-")
    impl = "grouped_mm" if variant.endswith("grouped_mm") else "eager"  # memtune: its own forward
    block = moe_block(shape, impl, device, dtype)
    notes = []
    if "memtune" in variant:
        quant = variant.split("-")[1] if variant.startswith("memtune-") else None
        quant = quant if quant in ("nf4", "fp4", "int8") else None
        if quant:
            stacks = quantize_experts(block, quant, dtype)
            if stacks != len(EXPERT_PARAMETERS):
                raise RuntimeError(f"quantize_experts found {stacks} stacks in the block")
            for name in EXPERT_PARAMETERS:  # a stack left off the device would be a bug
                param = getattr(block.experts, name)
                if param.device != device:
                    notes.append(f"{name} left on {param.device}")
                    param.data = param.data.to(device)  # the same Parameter: its layout stays
            if notes:
                notes = [f"quantize_experts: {', '.join(notes)}; moved to {device}"]
        if frozen:
            use_routed_forward(block)
        else:
            add_expert_lora(block, MOE_R, MOE_SCALING, dtype=dtype)
        if variant == "memtune-loop":
            experts_state(block.experts).grouped = False
    elif not frozen:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(
            r=MOE_R,
            lora_alpha=int(MOE_R * MOE_SCALING),
            target_modules=[],
            target_parameters=[f"mlp.experts.{p}" for p in EXPERT_PARAMETERS],
            lora_dropout=0.0,
        )
        wrapper = torch.nn.ModuleDict({"mlp": block})  # peft's names: mlp.experts.<stack>
        peft_model: Any = get_peft_model(wrapper, lora, autocast_adapter_dtype=False)
        block = peft_model.base_model.model["mlp"]
    weights = sum(p.numel() * p.element_size() for p in block.parameters()) / MIB
    notes.append(f"weights {weights:,.0f} MiB")
    return block, "; ".join(notes)


def time_moe(block: Any, x: Any, steps: int, device: Any) -> list[float]:
    """``steps`` forward + backward passes (the input's gradient and the adapters'), each timed
    between device syncs."""
    marks = []
    for _ in range(steps):
        sync(device)
        t0 = time.perf_counter()
        out = block(x)
        out = out[0] if isinstance(out, tuple) else out
        out.square().mean().backward()
        sync(device)
        marks.append(time.perf_counter() - t0)
    return marks


def run_moe(phase: Phase, deadline: float) -> None:
    """One Qwen3-MoE sparse block, forward + backward on 1 × ``mode.moe_tokens`` tokens, for
    each of :data:`MOE_VARIANTS` in turn in this process (each built, timed and freed before
    the next, so the phase stays short): memtune runs every expert on its routed rows through
    torch's grouped_mm where torch allows (the dtype, the adapters' rank), a Python loop over
    the experts otherwise (``memtune-loop`` forces the loop: on a GPU it is bound by kernel
    launches); on the GPU this is where the two forwards meet peft's. A variant that fails is
    recorded and the next runs; the fragment is saved after each (what survives a timeout)."""
    import torch

    mode = phase.mode
    device = device_and_env(phase)
    if mode.dry_run:
        from moe_bench import SHAPE

        shape = dict(SHAPE)
    else:
        shape = dict(MOE_SHAPE)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    tokens = mode.moe_tokens
    timed = 1 if mode.dry_run else MOE_TIMED  # the dry run: code paths, on a shared CPU
    info: dict[str, Any] = {
        "shape": dict(shape),
        "tokens": tokens,
        "dtype": str(dtype).removeprefix("torch."),
        "device": str(device),
        "warmup": mode.warmup,
        "timed": timed,
        "lora": f"r={MOE_R}, scaling {MOE_SCALING}",
        "rows": [],
    }
    phase.data["moe"] = info
    phase.save()
    slowest = 0.0
    for variant in MOE_VARIANTS:
        row: dict[str, Any] = {
            "variant": variant,
            "tokens": tokens,
            "step_ms": None,
            "tokens_per_s": None,
            "peak_mib": None,
            "trainable": None,
            "error": None,
        }
        if not time_left(deadline, max(MOE_VARIANT_S, 1.5 * slowest)):
            row["error"] = "skipped: out of time"
            info["rows"].append(row)
            phase.data["errors"].append({"where": f"moe {variant}", "error": row["error"]})
            phase.save()
            continue
        t0 = time.time()
        block = x = None
        try:
            block, row["note"] = moe_variant(variant, shape, device, dtype)
            row["trainable"] = sum(p.numel() for p in block.parameters() if p.requires_grad)
            torch.manual_seed(1)
            x = torch.randn(1, tokens, shape["hidden_size"], device=device, dtype=dtype)
            x.requires_grad_(True)  # the layers below need the input's gradient
            before = 0
            if device.type == "cuda":
                sync(device)
                gc.collect()
                empty_cache(device)
                torch.cuda.reset_peak_memory_stats(device)
                before = torch.cuda.memory_allocated(device)
            steps = time_moe(block, x, mode.warmup + timed, device)
            if device.type == "cuda":
                row["peak_mib"] = (torch.cuda.max_memory_allocated(device) - before) / MIB
            median = statistics.median(steps[mode.warmup :] or steps[-1:])
            row.update(
                step_ms=1000 * median,
                tokens_per_s=tokens / median,
                steps_ms=[round(1000 * s, 2) for s in steps],
            )
        except Exception as err:
            row["error"] = repr(err)[-2000:]
            row["oom"] = is_oom(err)
            info["rows"].append(row)
            phase.error(f"moe {variant}", err)
        else:
            info["rows"].append(row)
        finally:
            del block, x
            gc.collect()
            empty_cache(device)
        row["seconds"] = round(time.time() - t0, 1)
        slowest = max(slowest, row["seconds"])
        phase.save()
        tps, peak = row["tokens_per_s"], row["peak_mib"]
        print(
            f"gpu_check: {phase.name} {variant}: "
            + (f"{tps:,.0f} tokens/s, {row['step_ms']:.1f} ms" if tps else "no timing")
            + (f", peak {peak:,.0f} MiB" if peak is not None else "")
            + f" ({row['seconds']:.1f} s)",
            flush=True,
        )
