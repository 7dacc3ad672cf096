"""The packed-attention phase (``attention-packed``, issue #47 item 4): causal attention at
Qwen2.5-7B's shape (28 query heads, 4 KV heads of 128, bf16) over one row of 4,096 tokens
packed with samples of 256, 1,024 and 4,096 tokens, forward and backward, as memtune's
attention functions run it inside a layer:

* ``sdpa_varlen`` (rank.attention; ``auto`` without flash-attn): one SDPA call a sample;
* ``torch_varlen`` (rank.attention; opt-in): one call a row to torch's variable-length flash
  kernel (CUDA only);
* ``flash_attention_2``: transformers' FlashAttention-2 varlen path, where flash-attn is
  installed.

Each row gives the median milliseconds of a forward and backward, and the largest difference
of its output from sdpa_varlen's: what ``model.attn_implementation=auto`` should pick for packed
data. The dry run runs a reduced shape on CPU, where only sdpa_varlen runs (the others need
CUDA: recorded as such).

Then each kernel's backward over one sequence of 65,536 tokens at that shape, its memory: what
the backward allocates at its peak beyond the inputs, the output and its gradient, against what
the planner counts for it (memory.attention.flash_backward_bytes: at long context it is a
recomputed layer's peak). Measured on CUDA only (the dry run records it as not measured)."""

from __future__ import annotations

import importlib.util
import statistics
import time
from typing import Any

from .measure import sync
from .recorder import Phase, device_and_env, time_left

SHAPE = {"heads": 28, "kv_heads": 4, "head_dim": 128}
"""Qwen2.5-7B's attention."""
BACKWARD_TOKENS, DRY_BACKWARD_TOKENS = 65_536, 512
ROW_TOKENS = 4096
SAMPLE_TOKENS = (256, 1024, 4096)
DRY_SHAPE, DRY_ROW, DRY_SAMPLES = {"heads": 4, "kv_heads": 2, "head_dim": 16}, 256, (32, 256)
KERNELS = ("sdpa_varlen", "torch_varlen", "flash_attention_2")
WARMUP, TIMED = 2, 5


def unavailable(kernel: str, device: Any) -> str | None:
    """Why ``kernel`` cannot run on ``device``; None when it can."""
    if kernel == "torch_varlen" and device.type != "cuda":
        return "needs CUDA (torch's variable-length attention is FlashAttention's CUDA kernel)"
    if kernel == "flash_attention_2":
        if device.type != "cuda":
            return "needs CUDA"
        if importlib.util.find_spec("flash_attn") is None:
            return "flash-attn is not installed"
    return None


def forward_of(kernel: str) -> Any:
    """The attention function transformers calls for ``kernel`` (its registry, as a rank
    registers memtune's: its two functions, and FlashAttention-2's wrapped to split)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from memtune.rank import attention

    attention.register()
    return ALL_ATTENTION_FUNCTIONS[kernel]


def attention_module(heads: int, kv_heads: int, by_kv_head: bool = False) -> Any:
    """A stand-in for the attention module transformers passes: what the functions read of it
    (its query heads per KV head, causal, whether it runs one call per KV head, and the
    config's attention, which transformers' FlashAttention-2 function hands on to pick the
    flash-attn package's kernels)."""
    import types

    import torch

    from memtune.rank.attention import FLASH_NAME, SPLIT_FLAG

    module = torch.nn.Module()
    module.num_key_value_groups = heads // kv_heads
    module.is_causal = True
    module.config = types.SimpleNamespace(_attn_implementation=FLASH_NAME)
    setattr(module, SPLIT_FLAG, by_kv_head)
    return module


def run_attention(phase: Phase, deadline: float) -> None:
    import torch

    device = device_and_env(phase)
    dry = phase.mode.dry_run
    shape = DRY_SHAPE if dry else SHAPE
    row, samples = (DRY_ROW, DRY_SAMPLES) if dry else (ROW_TOKENS, SAMPLE_TOKENS)
    dtype = torch.float32 if dry else torch.bfloat16
    heads, kv, dim = shape["heads"], shape["kv_heads"], shape["head_dim"]
    out: dict[str, Any] = {
        "shape": shape,
        "row_tokens": row,
        "dtype": str(dtype).removeprefix("torch."),
        "device": str(device),
        "timed": TIMED,
        "rows": [],
    }
    phase.data["attention"] = out
    module = attention_module(heads, kv)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, row, dim, generator=g).to(device, dtype) for h in (heads, kv, kv))
    grad = torch.randn(1, row, heads, dim, generator=g).to(device, dtype)
    for sample in samples:
        cu = torch.arange(0, row + 1, sample, dtype=torch.int32, device=device)
        kwargs = {
            "cu_seq_lens_q": cu,
            "cu_seq_lens_k": cu,
            "max_length_q": sample,
            "max_length_k": sample,
        }
        reference = None
        for kernel in KERNELS:
            rec: dict[str, Any] = {"kernel": kernel, "sample_tokens": sample}
            out["rows"].append(rec)
            why = unavailable(kernel, device)
            if why is not None:
                rec["error"] = f"not run: {why}"
                continue
            if not time_left(deadline, 5):
                rec["error"] = "skipped: out of time"
                where = f"attention {kernel}"
                phase.data["errors"].append({"where": where, "error": "out of time"})
                continue
            try:
                forward = forward_of(kernel)
                leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
                times = []
                for i in range(WARMUP + TIMED):
                    sync(device)
                    t0 = time.perf_counter()
                    o, _ = forward(module, *leaves, None, **kwargs)
                    o.backward(grad)
                    sync(device)
                    if i >= WARMUP:
                        times.append(1e3 * (time.perf_counter() - t0))
                    for t in leaves:
                        t.grad = None
                rec["ms"] = statistics.median(times)
                if reference is None:
                    reference = o.detach().float()
                else:
                    rec["max_abs_diff"] = float((o.detach().float() - reference).abs().max())
            except Exception as err:
                rec["error"] = repr(err)[-1000:]
                phase.error(f"attention {kernel} at {sample}", err)
            phase.save()
            print(f"gpu_check: {phase.name} {kernel} {sample}: {rec}", flush=True)
        first = next((r for r in out["rows"] if r["sample_tokens"] == sample and "ms" in r), None)
        for r in out["rows"]:
            if first is not None and r["sample_tokens"] == sample and "ms" in r:
                r["speedup"] = first["ms"] / r["ms"]
    out["backward"] = []
    from memtune.config.decisions import SPLITTING_KERNELS

    for kernel, split in [(k, False) for k in KERNELS] + [(k, True) for k in SPLITTING_KERNELS]:
        rec = backward_memory(phase, deadline, kernel, split, shape, dtype)
        out["backward"].append(rec)
        phase.save()
    phase.save()


def backward_memory(
    phase: Phase, deadline: float, kernel: str, split: bool, shape: dict[str, int], dtype: Any
) -> dict[str, Any]:
    """One attention backward over a whole sequence, as one call or one per KV head
    (``split``): the allocator's peak during it above what was allocated before it (inputs,
    output, its gradient), and the planner's count."""
    import torch

    from memtune.memory.attention import flash_backward_bytes

    device = torch.device(phase.data["attention"]["device"])
    tokens = DRY_BACKWARD_TOKENS if phase.mode.dry_run else BACKWARD_TOKENS
    heads, kv, dim = shape["heads"], shape["kv_heads"], shape["head_dim"]
    b, groups = torch.finfo(dtype).bits // 8, kv if split else 1
    planned = flash_backward_bytes(tokens, heads, kv, dim, b, groups)
    rec: dict[str, Any] = {
        "kernel": kernel,
        "by_kv_head": split,
        "tokens": tokens,
        "planned_mib": planned / 2**20,
    }
    module = attention_module(heads, kv, split)
    why = unavailable(kernel, device)
    if why is None and device.type != "cuda":
        why = "the allocator's peak is measured on CUDA"
    if why is None and not time_left(deadline, 5):
        why = "out of time"
    if why is not None:
        rec["error"] = f"not measured: {why}"
        return rec
    try:
        g = torch.Generator().manual_seed(1)
        q, k, v = (
            torch.randn(1, h, tokens, dim, generator=g).to(device, dtype).requires_grad_()
            for h in (heads, kv, kv)
        )
        forward = forward_of(kernel)
        for _ in range(2):  # the first call's workspaces (cuBLAS, the kernel's) are not its own
            o, _ = forward(module, q, k, v, None)
            grad = torch.ones_like(o)
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            o.backward(grad)
            torch.cuda.synchronize(device)
            rec["measured_mib"] = (torch.cuda.max_memory_allocated(device) - before) / 2**20
            q.grad = k.grad = v.grad = None
            del o, grad
        rec["error_pct"] = 100 * (rec["planned_mib"] / rec["measured_mib"] - 1)
    except Exception as err:
        rec["error"] = repr(err)[-1000:]
        phase.error(f"attention backward memory {kernel}", err)
    print(f"gpu_check: {phase.name} backward memory {kernel}: {rec}", flush=True)
    return rec


def attention_markdown(att: dict[str, Any] | None) -> list[str]:
    """The packed-attention phase: a row a kernel and sample length."""
    if not att:
        return []
    s = att["shape"]
    lines = [
        "",
        "#### Attention over a packed row",
        "",
        f"Causal attention over one row of {att['row_tokens']:,} tokens packed with equal "
        f"samples, {s['heads']} query heads and {s['kv_heads']} KV heads of {s['head_dim']}, "
        f"{att['dtype']} on {att['device']}; median of {att['timed']} forward + backward "
        "after the warm-up; each output against sdpa_varlen's:",
        "",
        "| sample tokens | kernel | ms | × sdpa_varlen | max abs diff |",
        "|---:|---|---:|---:|---:|",
    ]
    for r in att["rows"]:
        if "ms" in r:
            diff = f"{r['max_abs_diff']:.2e}" if "max_abs_diff" in r else "—"
            cells = f"{r['ms']:,.2f} | {r.get('speedup', 1.0):.2f} | {diff}"
        else:
            cells = f"{r.get('error', '?')} | | "
        lines.append(f"| {r['sample_tokens']:,} | {r['kernel']} | {cells} |")
    back = att.get("backward") or []
    if back:
        lines += [
            "",
            f"One backward over a sequence of {back[0]['tokens']:,} tokens: the allocator's peak "
            "above the inputs, the output and its gradient, against the planner's count "
            "(memory.attention.flash_backward_bytes):",
            "",
            "| kernel | calls | measured MiB | planned MiB | plan err |",
            "|---|---|---:|---:|---:|",
        ]
    for r in back:
        if "measured_mib" in r and "error_pct" in r:
            cells = f"{r['measured_mib']:,.0f} | {r['planned_mib']:,.0f} | {r['error_pct']:+.1f}%"
        else:
            cells = f"{r.get('error', '?')} | {r['planned_mib']:,.1f} | "
        calls = "one per KV head" if r.get("by_kv_head") else "one"
        lines.append(f"| {r['kernel']} | {calls} | {cells} |")
    return lines
