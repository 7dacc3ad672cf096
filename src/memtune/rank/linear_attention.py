"""Packed rows through linear-attention layers (Qwen3.5's Gated DeltaNet) without leaks.

A Gated DeltaNet layer mixes tokens in two ways that carry state along the sequence: a depthwise
causal conv1d (kernel 4) over the q/k/v channels, and the gated delta-rule recurrence per value
head. Restarting ``position_ids`` at a sample boundary stops neither (positions only reach the
full-attention layers' rotary embedding), so in a packed row every sample after the first would
read the end of the one before it — measured on the tiny Qwen3.5: logits up to 8.3 away from the
same sample alone. transformers' torch fallback refuses ``cu_seq_lens`` for the recurrence
and its conv ignores them.

memtune's path reads the same boundaries ``sdpa_varlen`` does (the packed batch's
``cu_seq_lens``, over the flattened ``batch × n`` tokens). The conv runs on each sample alone
(its first tokens see zeros before them). The recurrence runs once over the whole row, with the
log decay of every sample's first token set to :data:`BOUNDARY_DECAY`: the state carried into
it is multiplied by ~1e-13, so each sample starts from an empty state, as alone, and the row
costs what one sequence of its width costs (the chunked recurrence pads each call to a multiple
of 64 tokens: a call per sample would pad every sample). Everything else in the layer is
token-wise (projections, gates, the gated norm). Right-padded rows (no packing) need nothing:
padding comes after the real tokens of a causal layer.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import torch
import torch.nn.functional as F

from memtune.linear_kernels import kernels
from memtune.rank.attention import row_segments

PATH_PER_SAMPLE = "per sample (memtune: the conv and the recurrence restart at each sample)"

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
    return f"{PATH_PER_SAMPLE}, {kernels(layers[0])}" if layers else None


BOUNDARY_DECAY = -30.0
"""The log decay given to the first token of every sample but a row's first: the recurrent
state reaching it is multiplied by exp(-30) ≈ 1e-13, i.e. the sample starts from an empty
state, as alone. (A first token's own decay multiplies the zero state of a sample alone, so its
gradient is zero either way: nothing is lost by replacing it.)"""


def _per_sample(whole_row: Any) -> Any:
    """The layer's forward for training on packed rows: transformers' own steps and functions
    (its modeling module's conv and chunked delta rule), with samples kept apart. The conv runs
    on each sample; the recurrence runs on the whole row once, its state emptied at every sample
    start (:data:`BOUNDARY_DECAY`), so a row costs what one sequence of its width costs instead of
    one chunk-padded call per sample. Each projection is called once for the whole batch, as in
    transformers' forward: under ZeRO-3 every call of a submodule gathers its weights, and ranks
    whose rows hold different numbers of samples must still make the same collective calls."""

    def forward(
        self: Any,
        hidden_states: torch.Tensor,
        cache: Any = None,
        attention_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        cu = kwargs.get("cu_seq_lens_q")
        split: Split | None = getattr(self, "_memtune_split", None)
        if (cu is None and split is None) or cache is not None:  # as transformers runs it
            rest = {k: v for k, v in kwargs.items() if k not in _VARLEN_KWARGS}
            return whole_row(hidden_states, cache=cache, attention_mask=attention_mask, **rest)
        hf = sys.modules[type(self).__module__]
        hidden_states = hf.apply_mask_to_padding_states(hidden_states, attention_mask)
        batch, local, _ = hidden_states.shape
        width = local * (split.sp if split else 1)
        # Without boundaries (sequence parallelism over padded rows) each row is one sample.
        segments = row_segments(batch, width, cu, None) or [[(0, width)]] * batch
        mixed_qkv = self.in_proj_qkv(hidden_states)
        z = self.in_proj_z(hidden_states)
        b, a = self.in_proj_b(hidden_states), self.in_proj_a(hidden_states)
        keys, values = self.num_k_heads, self.num_v_heads
        A_log, dt_bias = self.A_log, self.dt_bias
        conv_weight, conv_bias = self.conv1d.weight.squeeze(1), self.conv1d.bias
        if split is not None:  # this rank's heads over the whole sequence (Ulysses)
            q, k, v = torch.split(mixed_qkv, [self.key_dim, self.key_dim, self.value_dim], -1)
            mixed_qkv = torch.cat([split.heads(q), split.heads(k), split.heads(v)], dim=-1)
            z, b, a = split.heads(z), split.heads(b), split.heads(a)
            keys, values = keys // split.sp, values // split.sp
            A_log, dt_bias = split.mine(A_log), split.mine(dt_bias)
            conv_weight = split.conv_channels(conv_weight, self.key_dim, self.value_dim)
            if conv_bias is not None:
                conv_bias = split.conv_channels(conv_bias, self.key_dim, self.value_dim)
        beta = b.sigmoid()
        g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
        starts = torch.zeros(batch, width, 1, dtype=torch.bool, device=g.device)
        for r, segs in enumerate(segments):
            for start, _ in segs[1:]:
                starts[r, start] = True
        g = torch.where(starts, torch.full_like(g, BOUNDARY_DECAY), g)
        qkv = _conv_per_sample(
            hf, self, mixed_qkv.transpose(1, 2), segments, conv_weight, conv_bias
        )
        key_dim, value_dim = keys * self.head_k_dim, values * self.head_v_dim
        q, k, v = torch.split(qkv.transpose(1, 2), [key_dim, key_dim, value_dim], dim=-1)
        core, _ = hf.torch_chunk_gated_delta_rule(
            q.reshape(batch, width, keys, self.head_k_dim),
            k.reshape(batch, width, keys, self.head_k_dim),
            v.reshape(batch, width, values, self.head_v_dim),
            g=g,
            beta=beta,
            initial_state=None,
            output_final_state=False,
            use_qk_l2norm_in_kernel=True,
        )
        core = self.norm(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        core = core.reshape(batch, width, -1)
        if split is not None:  # back to this rank's tokens, every head
            core = split.tokens(core)
        return self.out_proj(core)

    return forward


class Split:
    """Ulysses for a linear-attention layer: the projections run on this rank's shard of the
    sequence; an all-to-all then gives each rank of the sequence-parallel group the whole
    sequence for 1/sp of the heads (key heads and the value heads that read them stay
    together: GVA maps consecutive value heads to one key head), over which the conv (per
    channel) and the recurrence (per value head) run; a second all-to-all brings the output
    back to the shard, for out_proj."""

    def __init__(self, group: Any, sp: int, rank: int) -> None:
        from deepspeed.sequence.layer import _dim_zero_all_to_all, register_all_to_all_group

        register_all_to_all_group(group)
        self.group, self.sp, self.rank = group, sp, rank
        self._exchange = _dim_zero_all_to_all

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, local tokens, channels of every head) → (batch, all tokens, this rank's)."""
        batch, local, channels = x.shape
        parts = x.reshape(batch, local, self.sp, channels // self.sp).permute(2, 1, 0, 3)
        out = self._exchange(self.group, parts.contiguous())  # [source rank] = its tokens
        return out.reshape(self.sp * local, batch, -1).transpose(0, 1)

    def tokens(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, all tokens, this rank's channels) → (batch, local tokens, every head's)."""
        batch, width, channels = x.shape
        local = width // self.sp
        parts = x.reshape(batch, self.sp, local, channels).permute(1, 2, 0, 3)
        out = self._exchange(self.group, parts.contiguous())  # [source rank] = its heads
        return out.permute(2, 1, 0, 3).reshape(batch, local, self.sp * channels)

    def mine(self, per_head: torch.Tensor) -> torch.Tensor:
        n = per_head.shape[0] // self.sp
        return per_head[self.rank * n : (self.rank + 1) * n]

    def conv_channels(self, weight: torch.Tensor, key_dim: int, value_dim: int) -> torch.Tensor:
        """The conv weights of this rank's q, k and v channels, in the exchanged order."""
        q, k, v = torch.split(weight, [key_dim, key_dim, value_dim], dim=0)
        return torch.cat([self.mine(q), self.mine(k), self.mine(v)], dim=0)


def split_over_ranks(model: Any, group: Any, sp: int, rank: int) -> int:
    """Sequence parallelism for every linear-attention layer (:class:`Split`); returns how many
    layers it covers. Called once the sequence-parallel groups exist."""
    layers = linear_attention_layers(model)
    split = Split(group, sp, rank)
    for layer in layers:
        layer._memtune_split = split
    return len(layers)


def _conv_per_sample(
    hf: Any,
    layer: Any,
    mixed_qkv: torch.Tensor,
    segments: list[list[tuple[int, int]]],
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """The depthwise causal conv (kernel 4) of ``mixed_qkv`` (batch, channels, width), each
    sample on its own: its first tokens see zeros before them, not the previous sample."""
    rows = []
    for r, segs in enumerate(segments):
        parts = [
            hf.causal_conv1d_fn(
                mixed_qkv[r : r + 1, :, a:b], weight, bias, activation=layer.activation
            )
            for a, b in segs
        ]
        covered = segs[-1][1] if segs else 0
        if covered < mixed_qkv.shape[-1]:  # the row's padding: nothing learns from it
            parts.append(
                mixed_qkv.new_zeros((1, mixed_qkv.shape[1], mixed_qkv.shape[-1] - covered))
            )
        rows.append(torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0])
    return torch.cat(rows, dim=0)
