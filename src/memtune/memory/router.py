"""What a mixture's routers hold beyond their weights: the load-balancing loss's logits
(trainer.router_aux_loss_coef), a row of the plan of their own."""

from __future__ import annotations

from collections.abc import Callable

from memtune.config import RunConfig, compute_bytes
from memtune.config.architecture import moe_layers, routed_experts

BALANCE_ROW = "balance-loss router logits"


def balance_loss_bytes(cfg: RunConfig, tokens: int) -> int:
    """What a mixture's load-balancing loss holds (rank.experts.RouterStats with capture, when
    trainer.router_aux_loss_coef > 0): each routed layer's logits (tokens × experts, compute
    dtype) from that layer's forward to the loss, and at the loss their fp32 copies and the
    fp32 concatenation of them (take_aux_loss), at once; 0 without the loss."""
    a = dict(cfg.model.architecture)
    experts = routed_experts(a)
    if not experts or cfg.trainer.router_aux_loss_coef <= 0:
        return 0
    return sum(moe_layers(a)) * tokens * experts * (compute_bytes(cfg) + 4 + 4)


def add_balance_row(add: Callable[..., None], cfg: RunConfig, tokens: int) -> None:
    """The plan's row for :func:`balance_loss_bytes`, where the run has the loss."""
    balance = balance_loss_bytes(cfg, tokens)
    if balance:
        add(
            BALANCE_ROW,
            balance,
            f"trainer.router_aux_loss_coef={cfg.trainer.router_aux_loss_coef:g}: every mixture "
            "layer's router logits kept from its forward to the balance loss (recomputed "
            "layers' too), and their fp32 copies while the loss is computed",
            per_token=True,
        )
