"""Packed rows through linear-attention layers (Qwen3.5's Gated DeltaNet) without leaks.

A Gated DeltaNet layer mixes tokens in two ways that carry state along the sequence: a depthwise
causal conv1d (kernel 4) over the q/k/v channels, and the gated delta-rule recurrence per value
head. Restarting ``position_ids`` at a sample boundary stops neither (positions only reach the
full-attention layers' rotary embedding), so in a packed row every sample after the first would
read the end of the one before it — measured on the tiny Qwen3.5: logits up to 0.64 away from
the same sample alone. transformers' torch fallback refuses ``cu_seq_lens`` for the recurrence
and its conv ignores them.

memtune's per-sample path reads the same boundaries ``sdpa_varlen`` does (the packed batch's
``cu_seq_lens``, over the flattened ``batch × n`` tokens) and runs the layer's own forward on
each sample separately, so the conv and the recurrence start from zero at every sample, as if
it were alone. Everything else in the layer is token-wise (projections, gates, the gated norm),
so per-sample is exact, at the cost of one smaller call per sample. Right-padded rows (no
packing) need nothing: padding comes after the real tokens of a causal layer.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import torch
import torch.nn.functional as F

from memtune.rank.attention import row_segments

PATH_PER_SAMPLE = "per sample (memtune; the conv and the recurrence restart at each sample)"

_VARLEN_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def is_linear_attention(module: Any) -> bool:
    """A Gated DeltaNet token mixer (Qwen3.5 and the Qwen3-Next family name theirs so)."""
    return type(module).__name__.endswith("GatedDeltaNet")


def linear_attention_layers(model: Any) -> list[Any]:
    return [m for m in model.modules() if is_linear_attention(m)]


def keep_samples_apart(model: Any) -> str | None:
    """Route packed rows through every linear-attention layer one sample at a time. Returns
    the path for the start-up line; None when the model has no linear-attention layer."""
    layers = linear_attention_layers(model)
    for layer in layers:
        if getattr(layer, "_memtune_per_sample", False):
            continue
        layer.forward = types.MethodType(_per_sample(layer.forward), layer)
        layer._memtune_per_sample = True
    return PATH_PER_SAMPLE if layers else None


def _per_sample(whole_row: Any) -> Any:
    """The layer's forward for training on packed rows: transformers' own steps and functions
    (its modeling module's conv and chunked delta rule), with the conv and the recurrence run
    per sample. Each projection is called once for the whole batch, as in transformers'
    forward: under ZeRO-3 every call of a submodule gathers its weights, and ranks whose rows
    hold different numbers of samples must still make the same collective calls."""

    def forward(
        self: Any,
        hidden_states: torch.Tensor,
        cache: Any = None,
        attention_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        cu = kwargs.get("cu_seq_lens_q")
        if cu is None or cache is not None:  # one sample per row (or generation): as it is
            rest = {k: v for k, v in kwargs.items() if k not in _VARLEN_KWARGS}
            return whole_row(hidden_states, cache=cache, attention_mask=attention_mask, **rest)
        hf = sys.modules[type(self).__module__]
        hidden_states = hf.apply_mask_to_padding_states(hidden_states, attention_mask)
        batch, width, _ = hidden_states.shape
        mixed_qkv = self.in_proj_qkv(hidden_states)
        z = self.in_proj_z(hidden_states).reshape(batch, width, -1, self.head_v_dim)
        beta = self.in_proj_b(hidden_states).sigmoid()
        a = self.in_proj_a(hidden_states)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        conv_weight = self.conv1d.weight.squeeze(1)
        segments = row_segments(batch, width, cu, None)
        assert segments is not None  # cu_seq_lens given
        rows = []
        for r, segs in enumerate(segments):
            parts = []
            for start, end in segs:
                n = end - start
                qkv = hf.causal_conv1d_fn(
                    mixed_qkv[r : r + 1, start:end].transpose(1, 2),
                    conv_weight,
                    self.conv1d.bias,
                    activation=self.activation,
                ).transpose(1, 2)
                q, k, v = torch.split(qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
                out, _ = hf.torch_chunk_gated_delta_rule(
                    q.reshape(1, n, -1, self.head_k_dim),
                    k.reshape(1, n, -1, self.head_k_dim),
                    v.reshape(1, n, -1, self.head_v_dim),
                    g=g[r : r + 1, start:end],
                    beta=beta[r : r + 1, start:end],
                    initial_state=None,
                    output_final_state=False,
                    use_qk_l2norm_in_kernel=True,
                )
                parts.append(out)
            covered = segs[-1][1] if segs else 0
            if covered < width:  # the row's padding: nothing learns from it
                parts.append(z.new_zeros((1, width - covered, *z.shape[2:])))
            rows.append(torch.cat(parts, dim=1) if len(parts) > 1 else parts[0])
        core = torch.cat(rows, dim=0).reshape(-1, self.head_v_dim)
        core = self.norm(core, z.reshape(-1, self.head_v_dim)).reshape(batch, width, -1)
        return self.out_proj(core)

    return forward
