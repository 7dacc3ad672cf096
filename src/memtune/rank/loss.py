"""The training loss without full-sequence logits: a frozen-head cross-entropy, chunk by chunk.

One 4096-token sequence of Qwen2.5 (vocabulary 152,064) has 2.49 GB of fp32 logits, more than
a LoRA step's whole activation budget. Since LoRA never trains the LM head, the loss only needs
the gradient with respect to the hidden states, dL/dh = (softmax(hW^T) - onehot(y)) W, and that
can be computed chunk by chunk in the forward pass, the way Liger's fused linear cross-entropy
does: peak memory is one chunk of logits, and the head is multiplied twice per token instead of
three times (forward, recompute, backward). Only labelled positions enter the head at all.

Under ZeRO-3 the head weight is partitioned. It is gathered once per forward — the same single
collective on every rank, however many label tokens each rank has — instead of calling the head
module per chunk, which would make the number of all-gathers depend on each rank's data and
deadlock.

:class:`CausalLMLoss` is the module DeepSpeed wraps: PEFT model plus loss, so the loss is part
of the engine's forward. It returns the *sum* of token losses (see rank/loop.py for the scaling).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from memtune.data.encode import IGNORE_INDEX


def token_loss_sum(
    logits_BTV: torch.Tensor, labels_BT: torch.Tensor, shifted: bool = False
) -> torch.Tensor:
    """Plain next-token cross-entropy summed over labelled positions, from full logits (fp32);
    ``shifted``: ``labels_BT`` are already next-token targets (:func:`next_token_targets`)."""
    targets = labels_BT if shifted else next_token_targets(labels_BT)
    return F.cross_entropy(
        logits_BTV.float().reshape(-1, logits_BTV.shape[-1]),
        targets.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def head_log_probs(
    hidden_NH: torch.Tensor, weight_VH: torch.Tensor, y_N: torch.Tensor, chunk: int, grad: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(y_i | h_i) = (h_i W^T)[y_i] − logsumexp(h_i W^T) for a frozen W at every position
    (fp32), and with ``grad`` its gradient with respect to h_i, (onehot(y_i) − softmax) W,
    computed here chunk by chunk, so that no more than one chunk of logits ever exists."""
    grad_NH = torch.empty_like(hidden_NH) if grad else None
    out = torch.empty(hidden_NH.shape[0], dtype=torch.float32, device=hidden_NH.device)
    for s in range(0, hidden_NH.shape[0], chunk):
        h, y = hidden_NH[s : s + chunk], y_N[s : s + chunk]
        logits = (h.to(weight_VH.dtype) @ weight_VH.T).float()  # chunk × V, the only big buffer
        picked = logits.gather(1, y[:, None]).squeeze(1)
        # logsumexp by hand, in place: torch.logsumexp would allocate a second chunk × V
        # fp32 buffer (tools.step_trace measured it), exp_ reuses this one.
        top = logits.amax(dim=-1, keepdim=True)
        sums = logits.sub_(top).exp_().sum(dim=-1, keepdim=True)
        out[s : s + chunk] = picked - (top + sums.log()).squeeze(1)
        if grad_NH is not None:
            probs = logits.div_(sums).neg_()  # −softmax, in place
            probs[torch.arange(y.shape[0], device=y.device), y] += 1.0
            grad_NH[s : s + chunk] = (probs.to(weight_VH.dtype) @ weight_VH).to(h.dtype)
            del probs
        # Free this chunk's logits before the next chunk's exist (a rebound name would keep
        # both alive at once: 1.5× the loss's peak, as tools.step_trace showed).
        del logits
    return out, grad_NH


class FrozenHeadLogProbs(torch.autograd.Function):
    """log p(y_i | h_i) per position for a frozen W, the gradient with respect to h computed
    during the forward pass: the SFT loss is minus their sum, the preference objectives sum
    them per sequence."""

    @staticmethod
    def forward(
        ctx: Any, hidden_NH: torch.Tensor, weight_VH: torch.Tensor, y_N: torch.Tensor, chunk: int
    ) -> torch.Tensor:
        logp, grad_NH = head_log_probs(hidden_NH, weight_VH, y_N, chunk, ctx.needs_input_grad[0])
        ctx.save_for_backward(grad_NH if grad_NH is not None else hidden_NH.new_empty(0))
        return logp

    @staticmethod
    def backward(ctx: Any, grad_N: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (grad_NH,) = ctx.saved_tensors
        return grad_NH * grad_N[:, None].to(grad_NH.dtype), None, None, None


Select = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""(hidden B×T×H, targets B×T) -> (hidden N×H, targets N) of the positions the loss reads."""


def next_token_targets(labels_BT: torch.Tensor) -> torch.Tensor:
    """``targets[:, t]`` = the label position ``t`` predicts (``labels[:, t + 1]``; the last
    position predicts nothing). Shifting once, before anything splits the sequence, is what
    lets sequence parallelism cut it anywhere: each shard's last position keeps its target,
    which lives in the next shard's labels."""
    return F.pad(labels_BT[:, 1:], (0, 1), value=IGNORE_INDEX)


def label_count(batch: dict[str, torch.Tensor]) -> int:
    """Label tokens of a collated (or sequence-sharded) micro batch: positions with a target."""
    if "shift_labels" in batch:
        return int((batch["shift_labels"] != IGNORE_INDEX).sum())
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


def labelled_positions(
    hidden_BTH: torch.Tensor, targets_BT: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions with a target only: prompts never reach the head."""
    keep = targets_BT != IGNORE_INDEX
    return hidden_BTH[keep], targets_BT[keep]


def chunked_loss_sum(
    hidden_BTH: torch.Tensor,
    weight_VH: torch.Tensor,
    labels_BT: torch.Tensor,
    chunk: int,
    select: Select = labelled_positions,
    shifted: bool = False,
) -> torch.Tensor:
    """Same value and hidden-state gradient as ``token_loss_sum(hidden @ W^T, labels)``;
    ``shifted``: ``labels_BT`` are already next-token targets (:func:`next_token_targets`).
    (``select``: tools.step_trace reads every position — a boolean selection's size depends on
    the data, which fake tensors do not have.)"""
    targets = labels_BT if shifted else next_token_targets(labels_BT)
    hidden, picked = select(hidden_BTH, targets)
    return -FrozenHeadLogProbs.apply(hidden, weight_VH, picked, chunk).sum()


def liger_available(device: torch.device) -> bool:
    return device.type == "cuda" and importlib.util.find_spec("liger_kernel") is not None


def _liger_loss_sum(
    hidden_BTH: torch.Tensor, weight_VH: torch.Tensor, targets_BT: torch.Tensor
) -> torch.Tensor:
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    loss: torch.Tensor = liger_fused_linear_cross_entropy(
        hidden_BTH.reshape(-1, hidden_BTH.shape[-1]),
        weight_VH,
        targets_BT.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    return loss.float()


def model_inputs(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cu_seq_lens: torch.Tensor | None = None,
    max_length: torch.Tensor | None = None,
) -> dict[str, Any]:
    """A collated batch's keys as the transformers model takes them: a packed batch's sample
    boundaries (``cu_seq_lens``, ``max_length``) become the varlen kwargs that
    FlashAttention-2 and ``sdpa_varlen`` (rank/attention.py) read."""
    inputs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask}
    if position_ids is not None:
        inputs["position_ids"] = position_ids
    if cu_seq_lens is not None:
        inputs |= {"cu_seq_lens_q": cu_seq_lens, "cu_seq_lens_k": cu_seq_lens}
        inputs |= {"max_length_q": max_length, "max_length_k": max_length}
    return inputs


def use_loss_kernel(kernel: str, device: torch.device) -> str:
    """The decided loss kernel (decisions.json ``loss``), checked on this rank: Liger's needs
    CUDA and liger-kernel here too (the job decided from its view of the machine)."""
    if kernel == "liger" and not liger_available(device):
        from memtune.config import ConfigError

        raise ConfigError(
            "loss=liger (decisions.json) needs CUDA and the liger-kernel package on every "
            "rank; this rank has neither or one: install it, or run with trainer.loss=chunked"
        )
    return kernel


class CausalLMLoss(nn.Module):
    """The module DeepSpeed trains: ``model`` (PEFT causal LM) and the token-sum loss."""

    def __init__(
        self,
        model: nn.Module,
        kind: str = "chunked",
        chunk_tokens: int = 512,
        select: Select = labelled_positions,
    ):
        super().__init__()
        self.model = model
        self.kind = kind
        self.chunk_tokens = chunk_tokens
        self.select = select
        from memtune.rank.vision import has_tower

        unwrap = getattr(model, "get_base_model", None)
        self.tower = has_tower(unwrap() if unwrap is not None else model)

    def hidden_and_head(
        self, inputs: dict[str, Any], images: dict[str, Any] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder's last hidden states and the LM head's weight, for a loss that applies
        the head itself (chunked, Liger, the preference objectives' log-probs). ``images``:
        a vision-language model's image inputs (rank.vision.multimodal_hidden)."""
        base = self.model.get_base_model()  # type: ignore[operator]
        head = base.get_output_embeddings()
        if head.weight.requires_grad or getattr(head, "bias", None) is not None:
            raise ValueError("the chunked loss needs a frozen, bias-free LM head; use loss=plain")
        if images is not None:
            from memtune.rank.vision import multimodal_hidden

            hidden = multimodal_hidden(base, inputs, **images)
        else:
            hidden = base.get_decoder()(**inputs).last_hidden_state
        # Under ZeRO-3, reading head.weight inside this forward registers it as an external
        # parameter of this module: DeepSpeed all-gathers it here, once, on every rank alike,
        # and releases it when this forward ends.
        return hidden, head.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cu_seq_lens: torch.Tensor | None = None,
        max_length: torch.Tensor | None = None,
        shift_labels: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        mm_token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``labels`` (collated), or ``shift_labels``: next-token targets of this rank's
        shard of the sequence (rank/sequence_parallel.py shifts before it splits). A
        vision-language model (its tower loaded) takes the batch's images, patchified
        (``pixel_values``, ``image_grid_thw``), and ``mm_token_type_ids``; every micro batch
        runs its tower, with images or without (rank.vision)."""
        if shift_labels is not None:
            targets = shift_labels
        elif labels is not None:
            targets = next_token_targets(labels)
        else:
            raise ValueError("CausalLMLoss needs labels or shift_labels")
        inputs = model_inputs(input_ids, attention_mask, position_ids, cu_seq_lens, max_length)
        images = None
        if self.tower:
            images = {
                "pixel_values": pixel_values,
                "image_grid_thw": image_grid_thw,
                "mm_token_type_ids": mm_token_type_ids,
            }
        elif pixel_values is not None:
            raise ValueError("images in the batch, and the model has no vision tower loaded")
        if self.kind == "plain" and images is None:
            return token_loss_sum(self.model(**inputs).logits, targets, shifted=True)
        if self.kind == "plain" and images is not None:
            from memtune.rank.vision import multimodal_hidden

            base = self.model.get_base_model()  # type: ignore[operator]
            logits = base.get_output_embeddings()(multimodal_hidden(base, inputs, **images))
            return token_loss_sum(logits, targets, shifted=True)
        hidden, weight = self.hidden_and_head(inputs, images)
        if self.kind == "liger":
            return _liger_loss_sum(hidden, weight, targets)
        return chunked_loss_sum(
            hidden, weight, targets, self.chunk_tokens, self.select, shifted=True
        )
