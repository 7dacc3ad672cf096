"""Preference objectives (DPO, IPO, SimPO, ORPO) from sequence log-probabilities, without a
whole ``[tokens × vocabulary]`` logits tensor.

A micro batch of pairs holds each pair's chosen and rejected sequences side by side in one row
(data.batching.collate_packed: two segments, positions restarting, no attention across them).
``sequence_index`` numbers every token of the k-th pair's chosen sequence 2k and of its rejected
one 2k + 1. The policy's log-probability of each sequence is the sum, over its label tokens, of
log p(token), read from the frozen LM head chunk by chunk as the SFT loss reads it
(:class:`memtune.rank.loss.FrozenHeadLogProbs`), then summed per sequence with one ``index_add``.

The objectives, per pair (c: chosen, r: rejected; ``logp`` a sequence's summed
log-probability, ``avg`` that sum over its label tokens, ``ref`` the reference model's ``logp``):

- ``dpo`` (Rafailov et al. 2023, eq. 7; label smoothing ε as conservative DPO, Mitchell 2023):
  h = (logp_c − ref_c) − (logp_r − ref_r);  loss = −(1−ε)·log σ(βh) − ε·log σ(−βh)
- ``ipo`` (Azar et al. 2023, eq. 17, on length-averaged log-probabilities as TRL computes it):
  h = (avg_c − ref_c/n_c) − (avg_r − ref_r/n_r);  loss = (h − 1/(2β))²
- ``simpo`` (Meng et al. 2024, eq. 6; reference-free):
  loss = −(1−ε)·log σ(β(avg_c − avg_r) − γ) − ε·log σ(−(β(avg_c − avg_r) − γ))
- ``orpo`` (Hong et al. 2024, eq. 6–7; reference-free):
  log odds(y) = avg − log(1 − exp(avg));  loss = −avg_c − β·log σ(log odds_c − log odds_r)
  (the SFT term is each chosen reply's mean token loss, averaged over pairs; TRL averages it
  over the batch's tokens instead, which weighs long replies more).

Rewards, as TRL logs them: β·(logp − ref) for dpo and ipo (ipo on averages), β·avg for simpo
and orpo; ``logps/*`` are the sums (dpo) or the averages (the others) the objective reads.

The module returns the *sum* of the pairs' losses; rank.loop divides by the pairs of the global
batch, as it divides the SFT loss by its label tokens.

Under sequence parallelism (rank/sequence_parallel.py) each rank of a group holds a shard of
every row: it sums its shard's log-probabilities per sequence, the group adds the partial sums
(:class:`SumOverGroup`), and every rank of the group then computes the same objective. Each
backpropagates it through its own shard only, so the group's gradients add up to the
objective's once; its value counts once, on the group's first rank (the others return
``L − L.detach()``: 0, with the gradient of L).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from memtune.config.derive import REFERENCE_OBJECTIVES
from memtune.data.encode import IGNORE_INDEX
from memtune.rank.experts import experts_off
from memtune.rank.loss import (
    CausalLMLoss,
    FrozenHeadLogProbs,
    model_inputs,
    next_token_targets,
)

STATS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
)
"""What a step reports besides the loss, TRL's names; each a mean over the step's pairs."""


class SumOverGroup(torch.autograd.Function):
    """The sum of a tensor over the ranks of a sequence-parallel group, on each of them; the
    gradient passes through unchanged. Every rank computes the objective from the same sums
    S = Σ s_r and backpropagates dL/dS into its own part s_r: the group's gradients then add
    up to dL/dS · Σ ds_r/dθ, the objective's gradient counted once."""

    @staticmethod
    def forward(ctx: Any, part: torch.Tensor, group: Any) -> torch.Tensor:
        total = part.clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def sequence_logps(
    per_token: torch.Tensor, sequence_N: torch.Tensor, n_sequences: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-probability, label tokens) of every sequence from the per-position values."""
    sums = per_token.new_zeros(n_sequences).index_add(0, sequence_N, per_token)
    counts = torch.bincount(sequence_N, minlength=n_sequences).to(per_token.dtype)
    return sums, counts


def objective_losses(
    objective: str,
    logps: torch.Tensor,
    counts: torch.Tensor,
    reference: torch.Tensor | None,
    beta: float,
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-pair losses and the rewards TRL reports, from ``[pairs, 2]`` (chosen, rejected)
    summed log-probabilities, label-token counts and (dpo, ipo) the reference's sums."""
    pc, pr = logps[:, 0], logps[:, 1]
    avg = logps / counts.clamp(min=1)
    eps = label_smoothing
    if objective in REFERENCE_OBJECTIVES:
        assert reference is not None
        if objective == "dpo":
            reward = beta * (logps - reference)
            h = (pc - reference[:, 0]) - (pr - reference[:, 1])
            losses = -(1 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)
            shown = logps
        else:  # ipo
            ref_avg = reference / counts.clamp(min=1)
            reward = beta * (avg - ref_avg)
            h = (avg[:, 0] - ref_avg[:, 0]) - (avg[:, 1] - ref_avg[:, 1])
            losses = (h - 1 / (2 * beta)) ** 2
            shown = avg
    elif objective == "simpo":
        reward = beta * avg
        z = beta * (avg[:, 0] - avg[:, 1]) - simpo_gamma
        losses = -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)
        shown = avg
    elif objective == "orpo":
        reward = beta * avg
        # log(1 − p) from log p, without the cancellation of log1p(−exp(x)) near p = 1
        log_odds = avg - torch.log(-torch.expm1(avg.clamp(max=-1e-7)))
        losses = -avg[:, 0] - beta * F.logsigmoid(log_odds[:, 0] - log_odds[:, 1])
        shown = avg
    else:
        raise ValueError(f"trainer.objective={objective!r} is not a preference objective")
    stats = {
        "rewards/chosen": reward[:, 0],
        "rewards/rejected": reward[:, 1],
        "rewards/margins": reward[:, 0] - reward[:, 1],
        "rewards/accuracies": (reward[:, 0] > reward[:, 1]).to(reward.dtype),
        "logps/chosen": shown[:, 0],
        "logps/rejected": shown[:, 1],
    }
    return losses, {k: v.detach() for k, v in stats.items()}


class PreferenceLoss(CausalLMLoss):
    """The module DeepSpeed trains for a preference objective: the PEFT model and the summed
    pair losses. The reference model is the same weights with the adapter switched off (or,
    with peft.init_from, the adapter as loaded). Its log-probabilities come in the batch
    (``reference_logps``, precomputed before training) or, with preference.reference=live, from
    a forward without grad inside this one.

    After each forward :attr:`stats` holds the micro batch's sums of :data:`STATS` and its pair
    count (a side channel: DeepSpeed's engine returns the loss alone to the loop)."""

    def __init__(
        self,
        model: torch.nn.Module,
        kind: str,
        chunk_tokens: int,
        objective: str,
        beta: float,
        label_smoothing: float = 0.0,
        simpo_gamma: float = 0.5,
        reference_adapter: bool = False,
    ):
        super().__init__(model, kind, chunk_tokens)
        self.objective, self.beta = objective, beta
        self.label_smoothing, self.simpo_gamma = label_smoothing, simpo_gamma
        self.reference_adapter = reference_adapter
        """The reference is the adapter as loaded (peft.init_from), not the bare base: its
        log-probabilities are taken with the adapter on, before the first step."""
        self.stats: torch.Tensor | None = None
        self.sequence_group: Any = None
        """The sequence-parallel group this rank's shards belong to (None: whole rows)."""
        self.sequence_rank = 0

    def split_over(self, group: Any, rank: int) -> None:
        """Rows come in shards, this rank's the ``rank``-th of ``group``
        (rank/sequence_parallel.py)."""
        self.sequence_group, self.sequence_rank = group, rank

    def sequence_logps(
        self, inputs: dict[str, Any], targets_BT: torch.Tensor, sequence_BT: torch.Tensor, n: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed log-probabilities and label counts of the batch's ``n`` sequences."""
        keep = (targets_BT != IGNORE_INDEX) & (sequence_BT >= 0)
        y, seq = targets_BT[keep], sequence_BT[keep]
        if self.kind == "plain":
            logits = self.model(**inputs).logits
            per_token = logits.float().log_softmax(-1)[keep].gather(1, y[:, None]).squeeze(1)
        else:
            hidden, weight = self.hidden_and_head(inputs)
            per_token = FrozenHeadLogProbs.apply(hidden[keep], weight, y, self.chunk_tokens)
        sums, counts = sequence_logps(per_token, seq, n)
        if self.sequence_group is not None:  # this shard's part of every sequence
            sums = SumOverGroup.apply(sums, self.sequence_group)
            dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=self.sequence_group)
        return sums, counts

    def reference_logps(
        self, inputs: dict[str, Any], targets_BT: torch.Tensor, sequence_BT: torch.Tensor, n: int
    ) -> torch.Tensor:
        """The reference's summed log-probabilities, without grad: the adapter off, or (an
        adapter to start from) as it is before the first step."""
        with torch.no_grad():
            if self.reference_adapter:
                return self.sequence_logps(inputs, targets_BT, sequence_BT, n)[0]
            # peft's adapters off, and a mixture's routed-expert adapters (rank.experts)
            with self.model.disable_adapter(), experts_off(self.model):  # type: ignore[operator]
                return self.sequence_logps(inputs, targets_BT, sequence_BT, n)[0]

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        sequence_index: torch.Tensor | None = None,
        pair_index: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cu_seq_lens: torch.Tensor | None = None,
        max_length: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        reference_logps: torch.Tensor | None = None,
        reference_pass: bool = False,
        shift_labels: torch.Tensor | None = None,
        shift_sequence_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The summed loss of the batch's pairs (pairs whose ``pair_index`` is -1, fillers,
        count nothing). ``reference_logps``: ``[pairs, 2]``, precomputed. ``reference_pass``:
        return the reference's ``[pairs, 2]`` log-probabilities instead (the precompute).
        ``labels``/``sequence_index`` of whole rows, or ``shift_labels``/``shift_sequence_index``
        of this rank's shard, shifted before the cut (rank/sequence_parallel.py)."""
        if pair_index is None:
            raise ValueError("PreferenceLoss needs pair_index (data.batching.collate_packed)")
        inputs = model_inputs(input_ids, attention_mask, position_ids, cu_seq_lens, max_length)
        if shift_labels is not None and shift_sequence_index is not None:
            targets, sequence = shift_labels, shift_sequence_index
        elif labels is not None and sequence_index is not None:
            targets = next_token_targets(labels)
            sequence = F.pad(sequence_index[:, 1:], (0, 1), value=-1)  # aligned with targets
        else:
            raise ValueError("PreferenceLoss needs labels and sequence_index, or their shifts")
        n = 2 * pair_index.shape[0]
        if reference_pass:
            return self.reference_logps(inputs, targets, sequence, n).view(-1, 2)
        logps, counts = self.sequence_logps(inputs, targets, sequence, n)
        reference = None
        if self.objective in REFERENCE_OBJECTIVES:
            if reference_logps is None:  # preference.reference=live
                reference = self.reference_logps(inputs, targets, sequence, n).view(-1, 2)
            else:
                reference = reference_logps.to(logps.dtype)
        real = pair_index >= 0
        losses, stats = objective_losses(
            self.objective,
            logps.view(-1, 2),
            counts.view(-1, 2),
            reference,
            self.beta,
            self.label_smoothing,
            self.simpo_gamma,
        )
        # torch.where, not a product: a filler's value may be anything, NaN included (0 × NaN
        # is NaN, and its gradient too).
        sums = [torch.where(real, stats[k], 0.0).sum() for k in STATS]
        self.stats = torch.stack([*sums, real.sum().to(losses.dtype)]).detach().double()
        total = torch.where(real, losses, 0.0).sum()
        if self.sequence_rank:  # the group's first rank reports the pairs, once
            self.stats.zero_()
            return total - total.detach()
        return total
