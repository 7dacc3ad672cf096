"""Sequence parallelism (Ulysses): every sequence is cut into ``sp`` equal shards, one per rank
of a sequence-parallel group, and attention exchanges sequence for heads.

Outside attention each rank computes its shard alone (embeddings, MLP, norms, the loss: linear
in tokens). Inside, DeepSpeed's ``UlyssesSPAttentionHF`` all-to-alls q/k/v so that each rank
holds the *whole* sequence for heads/sp of the heads, runs the core attention (``sdpa_varlen``
or FlashAttention-2) on it, and all-to-alls the output back to the shard. Activation memory per
rank is that of seq/sp tokens; the cost is four all-to-alls per layer (q, k, v, out) in forward
and again in backward.

What memtune adds around DeepSpeed's attention:

- The data: the ranks of one group read the *same* micro batch (the sampler runs over
  data-parallel ranks, rank // sp) and each keeps its slice — no exchange of batches.
  DeepSpeed's ``UlyssesSPDataLoaderAdapter`` instead all-gathers every rank's batch and runs
  each in turn (sp micro steps per batch, a different accumulation arithmetic), and it cuts
  every tensor on dim 1, which would cut ``cu_seq_lens`` (1-D) wrongly.
- Labels are shifted *before* the cut (``shift_labels``), so the last position of a shard keeps
  its target, which lives in the next shard.
- Sample boundaries survive the cut: the model gets its shard's ``position_ids`` (Ulysses
  all-gathers them) and the *whole* row's ``cu_seq_lens``, which the core attention reads
  over the gathered sequence. No mask is passed (Ulysses would drop it anyway): rows are
  right-padded and attention is causal, so padding never reaches a real token.
- The width of a batch is padded to a multiple of ``sp`` (label-free, in the row's last
  segment) so the shards are equal.
- Preference pairs (rank/preference.py): ``sequence_index`` is shifted with the labels and cut
  with them; ``pair_index`` and the precomputed ``reference_logps`` stay whole on every rank of
  the group, which sums its shards' log-probabilities per sequence before the objective, and
  the group's pairs are counted once (``loss_pairs``, on its first rank).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from memtune.data.encode import IGNORE_INDEX
from memtune.rank.loss import next_token_targets


@dataclass(frozen=True)
class SequenceGroups:
    """Where this rank sits: ``sp`` ranks per sequence, ``dp`` groups reading different data.
    DeepSpeed's groups are consecutive ranks (parallel_state_sp), so rank = dp_rank·sp + sp_rank."""

    sp: int
    sp_rank: int
    dp: int
    dp_rank: int

    @classmethod
    def of(cls, rank: int, world: int, sp: int) -> SequenceGroups:
        return cls(sp=sp, sp_rank=rank % sp, dp=world // sp, dp_rank=rank // sp)


def gradient_averaging_ranks(zero_stage: int, world: int, sp: int) -> int:
    """What DeepSpeed (0.19) divides the summed gradients by, which the loop's loss scale undoes.

    Without sequence parallelism: the ranks. With it, ZeRO-2 divides by the data-parallel
    ranks (world / sp: the ranks of a group hold parts of the same sequences' gradient, to be
    summed), but ZeRO-3's reduce-scatter (``reduce_scatter: true``, its default, which memtune
    requires under sp) divides by all ranks (``reduce_scatter_coalesced`` pre-divides by the
    group size; only its contiguous all-reduce path corrects for sp; DeepSpeed issue #6841).
    Measured: the 2-rank sp=2 gradient norm was half the 1-rank one under ZeRO-3 and equal
    under ZeRO-2 before this; tests/test_sequence_parallel.py holds both to the 1-rank run."""
    if sp == 1 or zero_stage == 3:
        return world
    return world // sp


def pad_width(batch: dict[str, torch.Tensor], multiple: int, pad_token_id: int) -> dict:
    """The batch with its width padded to a multiple of ``multiple``: label-free tokens at the
    end of every row, positions counting on, inside each row's last segment of ``cu_seq_lens``
    (causal attention: real tokens never see them)."""
    width = batch["input_ids"].shape[1]
    extra = -width % multiple
    if not extra:
        return batch
    out = dict(batch)
    fills = {"input_ids": pad_token_id, "labels": IGNORE_INDEX, "attention_mask": 0}
    fills["sequence_index"] = -1
    for key, fill in fills.items():
        if key in out:
            out[key] = F.pad(out[key], (0, extra), value=fill)
    if "position_ids" in out:
        pos = out["position_ids"]
        more = pos[:, -1:] + torch.arange(1, extra + 1, dtype=pos.dtype)
        out["position_ids"] = torch.cat([pos, more], dim=1)
    if "cu_seq_lens" in out:
        cu = out["cu_seq_lens"].long()
        rows, at = cu.div(width, rounding_mode="floor"), cu.remainder(width)
        moved = (rows * (width + extra) + at).to(out["cu_seq_lens"].dtype)
        out["cu_seq_lens"] = moved
        out["max_length"] = moved.diff().max()
    return out


def shard_batch(
    batch: dict[str, torch.Tensor], groups: SequenceGroups, pad_token_id: int
) -> dict[str, torch.Tensor]:
    """This rank's shard of a collated micro batch (the same batch on every rank of the group):
    ``input_ids``/``position_ids``/``shift_labels`` cut to this rank's equal slice,
    ``cu_seq_lens``/``max_length`` of the whole rows kept, the mask turned into this shard's
    ``real_tokens`` (the loop's throughput count) and dropped. Preference pairs: their
    ``sequence_index`` shifted and cut as the labels are (``shift_sequence_index``), their
    ``pair_index``/``reference_logps`` whole, their count in ``loss_pairs`` on the first rank
    of the group only (the loop's loss units)."""
    batch = pad_width(batch, groups.sp, pad_token_id)
    rows, width = batch["input_ids"].shape
    if "position_ids" not in batch:
        batch["position_ids"] = torch.arange(width).expand(rows, width)
    shift = next_token_targets(batch["labels"])
    n = width // groups.sp
    cut = slice(groups.sp_rank * n, (groups.sp_rank + 1) * n)
    out = {
        "input_ids": batch["input_ids"][:, cut].contiguous(),
        "position_ids": batch["position_ids"][:, cut].contiguous(),
        "shift_labels": shift[:, cut].contiguous(),
    }
    if "cu_seq_lens" in batch:
        out["cu_seq_lens"], out["max_length"] = batch["cu_seq_lens"], batch["max_length"]
    if "sequence_index" in batch:
        shifted = F.pad(batch["sequence_index"][:, 1:], (0, 1), value=-1)
        out["shift_sequence_index"] = shifted[:, cut].contiguous()
        out["pair_index"] = batch["pair_index"]
        pairs = (batch["pair_index"] >= 0).sum()
        out["loss_pairs"] = pairs if groups.sp_rank == 0 else torch.zeros_like(pairs)
        if "reference_logps" in batch:
            out["reference_logps"] = batch["reference_logps"]
    if "attention_mask" in batch:
        out["real_tokens"] = batch["attention_mask"][:, cut].sum()
    elif "real_tokens" in batch:  # packed: counted once per group
        keep = groups.sp_rank == 0
        out["real_tokens"] = (
            batch["real_tokens"] if keep else torch.zeros_like(batch["real_tokens"])
        )
    else:
        out["real_tokens"] = torch.tensor(rows * n)
    return out


def register_attention(model: Any, attn_implementation: str, sp: int, micro_batch: int) -> Any:
    """Wrap ``attn_implementation`` with DeepSpeed's Ulysses attention for this process and
    create the sequence-parallel groups; returns DeepSpeed's ``mpu`` (groups), which
    ``deepspeed.initialize`` takes so that ZeRO shards and reduces over all ranks and averages
    gradients over the data-parallel ones."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    return UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model,
        core_attn_implementation=attn_implementation,
        sequence_parallel_size=sp,
        micro_batch_size=micro_batch,
        seq_length_is_variable=True,
    )
