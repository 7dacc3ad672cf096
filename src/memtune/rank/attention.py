"""``sdpa_varlen``: PyTorch SDPA over each sample of a batch, with no dense mask.

transformers' own ``sdpa`` turns packed rows (restarting ``position_ids``) and padded rows into
a dense ``(batch, 1, n, n)`` mask: O(n²) memory (16 GiB at 131,072 tokens) and, on CUDA, a mask
rules out SDPA's flash kernel. ``sdpa_varlen`` reads the sample boundaries instead — the
``cu_seq_lens`` a packed batch carries (the same kwargs FlashAttention-2's varlen path takes,
over the flattened ``batch × n`` tokens) or the lengths of right-padded rows — and runs causal
SDPA on each sample separately, so no token attends across samples and nothing quadratic is
materialized outside the kernel. A batch without either (one sequence per row, no padding) is
one causal SDPA call, as with ``sdpa``.

Registered under that name in transformers' attention and mask interfaces by
:func:`register`, so ``from_pretrained(attn_implementation="sdpa_varlen")`` picks it.

``torch_varlen``: the same boundaries given to torch's own variable-length attention
(``torch.nn.attention.varlen.varlen_attn``, FlashAttention's kernel inside torch, CUDA only) in
one call over the flattened ``batch × n`` tokens — no Python loop over samples, no flash-attn
package. Right padding is a segment of its own, as in a packed row; its outputs feed no label.

Both run as one call per KV head where the decisions say so (``attention_by_kv_head``,
:func:`split_by_kv_head`): each KV head with its group of query heads, the outputs concatenated
over the heads. The outputs and gradients are the same; FlashAttention-2's backward then holds
one group's fp32 dQ accumulator and expanded dK / dV at a time instead of every head's
(memory.attention counts both). So does transformers' own ``flash_attention_2`` (the flash-attn
package), which :func:`register` replaces with itself wrapped by :func:`splitting`: the
attention ``auto`` decides where flash-attn is installed splits as memtune's own do.
"""

from __future__ import annotations

import functools
import inspect
import itertools
from typing import Any

import torch

NAME = "sdpa_varlen"
SPLIT_FLAG = "memtune_by_kv_head"
"""The attention module's attribute (set by :func:`split_by_kv_head`) the functions read."""

_bounds_cache: dict[str, Any] = {"key": None, "value": None}


def _once(t: torch.Tensor, read: Any, cache: dict[str, Any] = _bounds_cache) -> Any:
    """``read(t)`` once per batch: every layer (and every recompute) gets the same tensor
    object, so one device→host copy serves them all."""
    if cache["key"] is not t:
        cache["key"], cache["value"] = t, read(t)
    return cache["value"]


def _padded_lengths(mask: torch.Tensor) -> list[int] | None:
    """Real tokens per row of a 2D mask; None when no row has padding."""
    lengths = mask.sum(-1)
    if bool(lengths.eq(mask.shape[1]).all()):
        return None
    if not bool((mask.long().cumprod(-1).sum(-1) == lengths).all()):
        raise ValueError(
            "sdpa_varlen needs right-padded rows (real tokens first); use "
            "model.attn_implementation=sdpa for left padding"
        )
    return [int(n) for n in lengths.tolist()]


def row_segments(
    batch: int, width: int, cu_seq_lens: torch.Tensor | None, mask: torch.Tensor | None
) -> list[list[tuple[int, int]]] | None:
    """Each row's (start, end) segments, attended separately; None when the whole row is one
    causal sequence. Segments of a row cover it from 0 to ``width`` except right padding."""
    if cu_seq_lens is not None:
        cu = _once(cu_seq_lens, lambda t: [int(x) for x in t.tolist()])
        rows: list[list[tuple[int, int]]] = [[] for _ in range(batch)]
        for a, b in itertools.pairwise(cu):
            r = a // width
            if b > (r + 1) * width:
                raise ValueError(
                    f"cu_seq_lens: a sample spans rows {r} and {r + 1} ({a}..{b}, row width "
                    f"{width}); packed samples must stay inside their row"
                )
            rows[r].append((a - r * width, b - r * width))
        return rows
    if mask is None:
        return None
    if mask.dim() != 2:
        raise ValueError(f"sdpa_varlen takes a 2D padding mask, got shape {tuple(mask.shape)}")
    lengths = _once(mask, _padded_lengths)
    if lengths is None:
        return None
    return [[(0, n)] if n else [] for n in lengths]


def _training_shape(
    name: str,
    query: torch.Tensor,
    key: torch.Tensor,
    kwargs: dict[str, Any],
    module: torch.nn.Module | None = None,
) -> tuple[int, int]:
    """(batch, row width) of a training step's attention; what neither function runs refused:
    sliding windows, keys longer than the queries (a KV cache), and attention that is not
    causal (a vision tower's: both attend causally, whatever they are asked)."""
    if kwargs.get("sliding_window") is not None:
        raise ValueError(f"{name} does not implement sliding-window attention")
    if kwargs.get("is_causal", getattr(module, "is_causal", True)) is False:
        raise ValueError(f"{name} attends causally only (asked for bidirectional attention)")
    batch, _, width, _ = query.shape
    if key.shape[2] != width:
        raise ValueError(f"{name} is for training: queries and keys must have one length")
    return batch, width


@torch.compiler.disable
def sdpa_varlen_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``query`` (b, heads, n, d), ``key``/``value`` (b, kv heads, n, d) → (b, n, heads, d)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch, width = _training_shape(NAME, query, key, kwargs, module)
    segments = row_segments(batch, width, kwargs.get("cu_seq_lens_q"), attention_mask)

    def causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out, _ = sdpa_attention_forward(
            module, q, k, v, None, dropout=dropout, scaling=scaling, is_causal=True
        )
        return out

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if segments is None:
            return causal(q, k, v)
        rows = []
        for r, segs in enumerate(segments):
            parts = [causal(*(t[r : r + 1, :, a:b] for t in (q, k, v))) for a, b in segs]
            covered = segs[-1][1] if segs else 0
            if covered < width:  # right padding: no output needed, nothing learns from it
                parts.append(q.new_zeros((1, width - covered, q.shape[1], v.shape[-1])))
            rows.append(torch.cat(parts, dim=1) if len(parts) > 1 else parts[0])
        return torch.cat(rows, dim=0) if len(rows) > 1 else rows[0]  # a lone call: no copy

    return by_kv_head(attend, module, query, key, value), None


def by_kv_head(
    attend: Any,
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
) -> torch.Tensor:
    """``attend(q, k, v)`` (b, heads, n, d) → (b, n, heads, d): once, or once per KV head with
    its query heads when ``module`` says so (:data:`SPLIT_FLAG`)."""
    kv = key.shape[1]
    if kv == 1 or not getattr(module, SPLIT_FLAG, False):
        return attend(query, key, value)
    groups = zip(
        query.split(query.shape[1] // kv, dim=1),
        key.split(1, dim=1),
        value.split(1, dim=1),
        strict=True,
    )
    return torch.cat([attend(q, k, v) for q, k, v in groups], dim=2)


def splitting(forward: Any) -> Any:
    """``forward``, an attention function of transformers' interface (module, query, key, value,
    mask, **kwargs) → (b, n, heads, d), run through :func:`by_kv_head`: once, or once per KV
    head where the module says so. Left eager under compiled layers (trainer.compile), as
    memtune's own attention functions are: transformers' FlashAttention-2 path reads a packed
    batch's boundaries on the host."""

    @torch.compiler.disable
    @functools.wraps(forward)
    def split_forward(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        if kwargs.get("s_aux") is not None and getattr(module, SPLIT_FLAG, False):
            raise ValueError("attention by KV head does not split attention sinks (s_aux)")

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = forward(module, q, k, v, attention_mask, **kwargs)[0]
            return out

        return by_kv_head(attend, module, query, key, value), None

    return split_forward


def split_by_kv_head(model: Any, on: bool) -> int:
    """Every decoder layer's attention module runs :func:`by_kv_head` (``on``) or as one call;
    returns how many split."""
    from memtune.rank.layers import decoder_layers

    modules = [layer.self_attn for layer in decoder_layers(model) if hasattr(layer, "self_attn")]
    for m in modules:
        setattr(m, SPLIT_FLAG, on)
    return len(modules) if on else 0


VARLEN_NAME = "torch_varlen"


def varlen_kernel() -> Any:
    """torch's variable-length attention (CUDA only; tests give a reference in its place)."""
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn


def cumulative_bounds(
    batch: int,
    width: int,
    cu_seq_lens: torch.Tensor | None,
    mask: torch.Tensor | None,
    device: torch.device,
) -> tuple[torch.Tensor, int]:
    """(each segment's start in the flattened ``batch × width`` tokens, then the total, int32
    on ``device``; the longest segment): a packed batch's own ``cu_seq_lens``, else each row
    one segment and its right padding another (:func:`row_segments`)."""

    def bounds(_: torch.Tensor | None) -> tuple[torch.Tensor, int]:
        segments = row_segments(batch, width, cu_seq_lens, mask)
        if segments is None:
            starts = [r * width for r in range(batch)]
        else:
            starts = []
            for r, segs in enumerate(segments):
                covered = segs[-1][1] if segs else 0
                starts += [r * width + a for a, _ in segs]
                if covered < width:
                    starts.append(r * width + covered)
        edges = [*starts, batch * width]
        longest = max(b - a for a, b in itertools.pairwise(edges))
        return torch.tensor(edges, dtype=torch.int32, device=device), longest

    key = cu_seq_lens if cu_seq_lens is not None else mask
    return bounds(None) if key is None else _once(key, bounds, _cumulative_cache)


_cumulative_cache: dict[str, Any] = {"key": None, "value": None}


@torch.compiler.disable
def torch_varlen_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``query`` (b, heads, n, d), ``key``/``value`` (b, kv heads, n, d) → (b, n, heads, d):
    causal attention within each segment, one varlen call for the batch."""
    if dropout:
        raise ValueError(f"torch_varlen runs no attention dropout (asked {dropout})")
    batch, width = _training_shape(VARLEN_NAME, query, key, kwargs, module)
    cu, longest = cumulative_bounds(
        batch, width, kwargs.get("cu_seq_lens_q"), attention_mask, query.device
    )

    def flat(t: torch.Tensor) -> torch.Tensor:
        return t.transpose(1, 2).reshape(batch * width, t.shape[1], t.shape[-1])

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        heads = q.shape[1]
        kernel, grouped = varlen_kernel(), {}
        if k.shape[1] != heads:
            if "enable_gqa" in inspect.signature(kernel).parameters:
                grouped["enable_gqa"] = True
            else:  # torch 2.10-2.11: no enable_gqa (2.12 added it); each query head its KV copy
                k, v = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))
        out = kernel(
            flat(q),
            flat(k),
            flat(v),
            cu,
            cu,
            longest,
            longest,
            scale=scaling,
            window_size=(-1, 0),  # causal
            **grouped,
        )
        return out.reshape(batch, width, heads, v.shape[-1])

    return by_kv_head(attend, module, query, key, value), None


def _mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """No 4D mask: the 2D padding mask when a row has padding, else None (as for FA2)."""
    if attention_mask is None or bool(attention_mask.all()):
        return None
    return attention_mask[:, -kv_length:].bool()


FLASH_NAME = "flash_attention_2"


def register() -> None:
    """memtune's two attention functions, under their names, and transformers' FlashAttention-2
    function wrapped by :func:`splitting` under its own (its masks and kwargs are transformers'
    as before; the wrapper is one call unless the module is split)."""
    from transformers import AttentionInterface
    from transformers.integrations.flash_attention import flash_attention_forward
    from transformers.masking_utils import AttentionMaskInterface

    for name, forward in ((NAME, sdpa_varlen_forward), (VARLEN_NAME, torch_varlen_forward)):
        AttentionInterface.register(name, forward)
        AttentionMaskInterface.register(name, _mask)
    AttentionInterface.register(FLASH_NAME, splitting(flash_attention_forward))
