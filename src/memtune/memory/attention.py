"""What a decoder layer's attention holds: the tensors it keeps for backward
(:func:`attention_bytes`), and what the flash kernel's backward allocates on top of them
(:func:`attention_backward_bytes`)."""

from __future__ import annotations

from memtune.config import RunConfig, compute_bytes
from memtune.config.architecture import head_dim, rank_kv_heads
from memtune.config.decisions import Decisions
from memtune.memory.norms import norm_saved_bytes

GATED_ATTENTION = ("qwen3_5_text", "qwen3_5_moe_text")
"""Model types whose attention output is gated, ``out * sigmoid(gate)`` (gate: a second half of
q_proj's output), before o_proj: Qwen3.5's full-attention layers."""


QK_NORMED = ("qwen3", "qwen3_moe", "qwen3_vl_text", "qwen3_vl_moe_text", *GATED_ATTENTION)
"""Model types whose attention normalizes q and k per head (RMSNorm, fp32 inputs kept): Qwen3,
its mixture, Qwen3-VL's language models (Qwen3's layers; a full-size trace showed the plan
10.7% under without them) and Qwen3.5's full-attention layers."""

FLASH_BACKWARD = ("sdpa_varlen", "torch_varlen", "flash_attention_2")
"""The attention kernels whose backward on CUDA is FlashAttention-2's: the flash-attn package,
torch's varlen attention (its own copy of that kernel), and SDPA called with no mask and
``is_causal`` (sdpa_varlen always calls it so; transformers' sdpa does when it builds no mask,
below; torch dispatches that call to the same kernel for 16-bit inputs)."""


def _heads(cfg: RunConfig, d: Decisions) -> tuple[int, int, int]:
    """(query heads, KV heads as attention reads them, head dim): sdpa and FA2 read grouped
    heads, eager repeats them; Ulysses repeats KV heads up to sp when there are fewer. Per
    rank, Ulysses attends heads / sp of them over sp × the tokens: the same bytes as all
    heads over the rank's tokens, which is how these count."""
    a = cfg.model.architecture
    heads, kv = int(a["num_attention_heads"]), int(a["num_key_value_heads"])
    kv_heads = heads if d.attention == "eager" else max(kv, d.sequence_parallel)
    return heads, kv_heads, head_dim(a)


def attention_bytes(cfg: RunConfig, d: Decisions, n: int) -> tuple[int, int]:
    """(attention's saved bytes, what its per-head q / k norms keep) for ``n`` tokens."""
    a = cfg.model.architecture
    heads, kv_heads, hd = _heads(cfg, d)
    b = compute_bytes(cfg)
    norms = 0
    if a.get("model_type") in QK_NORMED:
        kv = int(a["num_key_value_heads"])
        norms = norm_saved_bytes(d, n * (heads + kv), hd, b)  # Qwen3's q_norm, k_norm per head
    # q, output, and k, v at their KV heads, + the fp32 logsumexp
    attention = n * hd * (2 * heads + 2 * kv_heads) * b + n * heads * 4
    if a.get("model_type") in GATED_ATTENTION:
        attention += n * heads * hd * b  # sigmoid(gate), kept by the product and the sigmoid
        if d.sequence_parallel == 1 and output_concatenated(cfg, d):
            attention += n * heads * hd * b  # the product keeps the concatenated output too
    return attention, norms


def attention_mask_bytes(cfg: RunConfig, d: Decisions) -> int:
    """The dense mask transformers' own ``sdpa`` / ``eager`` build for packed or padded rows:
    (micro, 1, n, n), bool for sdpa, the compute dtype for eager, alive from the forward to
    the last recompute. ``auto`` (sdpa_varlen, FlashAttention-2) builds none, nor does a lone
    unpadded row (is_causal)."""
    impl, micro = d.attention, d.batch.micro_batch
    if impl not in ("sdpa", "eager") or (not cfg.data.packing and micro == 1):
        return 0
    n = d.batch.row_tokens
    return micro * n * n * (1 if impl == "sdpa" else compute_bytes(cfg))


def attention_backward_bytes(cfg: RunConfig, d: Decisions, n: int, cuda: bool = True) -> int:
    """What one attention layer's backward allocates at once over ``n`` tokens, beyond what
    the layer kept, when the kernel is FlashAttention-2's (:data:`FLASH_BACKWARD` on CUDA, in
    a 16-bit dtype); 0 for the others, whose workspaces are not counted.

    FA2's backward (``mha_bwd``, in the flash-attn package and in torch's copy of it) writes
    the query gradient through an fp32 accumulator of the same shape, and with grouped-query
    attention (fewer KV heads than query heads) it writes the key and value gradients at every
    query head first, then sums them per KV head: dq, its fp32 accumulator, dk and dv at the
    KV heads, the two expanded ones and an fp32 value per head and token (``softmax_d``), all
    alive together until the kernel returns. On Qwen2.5-7B that is 5.3 × tokens × hidden in
    bf16, more than anything else a recomputed layer's backward holds once its MLP is tiled.
    Neither a CPU step nor a fake-tensor trace (tools.step_trace) allocates these: they are
    the kernel's own, read from its source.

    One call per KV head (``attention_by_kv_head``, rank.attention) holds one call's at a
    time (and a contiguous copy of its slice of the output's gradient), beside the dQ, dK and
    dV the calls before it returned, whose saved outputs their backward has freed; at the end
    the split's backward concatenates the dQs into one, next to them."""
    b = compute_bytes(cfg)
    flash = d.attention in FLASH_BACKWARD or (
        d.attention == "sdpa" and not attention_mask_bytes(cfg, d)
    )
    if not cuda or b == 4 or not flash:
        return 0
    return flash_backward_bytes(n, *_heads(cfg, d), b, kv_head_groups(cfg, d))


def output_copied(cfg: RunConfig, d: Decisions) -> bool:
    """Whether the attention output o_proj reads (and its adapter keeps) is a tensor of its
    own rather than the storage the kernel keeps for its backward (flash and SDPA kernels
    write their output token-major, so a lone call's reshape for o_proj is a view of it): the
    all-to-all's output under Ulysses, Qwen3.5's gated product, or a concatenation of calls
    (:func:`output_concatenated`)."""
    a = cfg.model.architecture
    gated = a.get("model_type") in GATED_ATTENTION
    return d.sequence_parallel > 1 or gated or output_concatenated(cfg, d)


def output_concatenated(cfg: RunConfig, d: Decisions) -> bool:
    """Whether attention's output is the concatenation of several kernel calls' outputs: one
    call per KV head, or sdpa_varlen's per-sample calls over packed rows (counted whenever the
    data is packed: a row holding one sample is one call) and its rows over a micro batch of
    several (padded, each row its own call)."""
    per_sample = d.attention == "sdpa_varlen" and (cfg.data.packing or d.batch.micro_batch > 1)
    return kv_head_groups(cfg, d) > 1 or per_sample


def kv_head_groups(cfg: RunConfig, d: Decisions) -> int:
    """The calls attention runs as on a rank: one per KV head it holds (config.architecture.
    rank_kv_heads) with ``attention_by_kv_head``, else 1."""
    if not d.attention_by_kv_head:
        return 1
    return rank_kv_heads(dict(cfg.model.architecture), d.sequence_parallel)


def flash_backward_bytes(
    tokens: int, heads: int, kv_heads: int, head_dim: int, b: int, groups: int = 1
) -> int:
    """FlashAttention-2's backward allocations over ``tokens`` (:func:`attention_backward_bytes`
    says which): dQ, its fp32 accumulator, dK and dV, the expanded dK and dV under grouped-query
    attention, and ``softmax_d``; over ``groups`` calls (one per KV head), the largest moment
    of them. The GPU check's attention phase measures them."""
    if groups > 1:
        q, kv = heads // groups, kv_heads // groups
        # one call's dQ, dK, dV, less its output and logsumexp, freed once it has run
        left = tokens * (q + 2 * kv) * head_dim * b - tokens * q * (head_dim * b + 4)
        grad_copy = tokens * q * head_dim * b  # its slice of the output's gradient, contiguous
        last = (groups - 1) * left + flash_backward_bytes(tokens, q, kv, head_dim, b) + grad_copy
        return max(last, groups * left + tokens * heads * head_dim * b)
    dq = tokens * heads * head_dim * b
    accumulator = tokens * heads * head_dim * 4
    dk_dv = 2 * tokens * kv_heads * head_dim * b
    expanded = 2 * tokens * heads * head_dim * b if kv_heads < heads else 0
    return dq + accumulator + dk_dv + expanded + tokens * heads * 4
