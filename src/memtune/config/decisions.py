"""What the planner decides for a run, as one frozen value.

The user's config leaves some choices to memtune (``checkpoint_layers=auto``, the long-context
switches on ``auto``, ``plan.auto_fit``'s variants, one rank's ZeRO stage). memory.fit tries
candidates by replacing fields of a :class:`Decisions` value and applying it to the config,
which replaces only the sections that change and shares the rest: no candidate is a deep copy,
and none is mutated after it is made. The chosen one reaches ``config.yaml`` when the run dir is
written (launcher.prepare), so the ranks read the decisions as plain settings.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from memtune.config.schema import Loss, Optimizer, PeftMethod, RunConfig, Switch, ZeroStage


@dataclass(frozen=True)
class Decisions:
    zero_stage: ZeroStage
    zero_template: str | None
    micro_batch_size: int
    loss: Loss
    activation_checkpointing: bool
    checkpoint_layers: str
    """all | auto | a number of layers"""
    sequence_parallel: str
    """auto | a number of ranks"""
    tiled_mlp: Switch
    offload_activations: Switch
    optimizer: Optimizer
    peft_method: PeftMethod

    @classmethod
    def of(cls, cfg: RunConfig) -> Decisions:
        t = cfg.trainer
        return cls(
            zero_stage=cfg.zero.stage,
            zero_template=cfg.zero.template,
            micro_batch_size=t.micro_batch_size,
            loss=t.loss,
            activation_checkpointing=t.activation_checkpointing,
            checkpoint_layers=str(t.checkpoint_layers),
            sequence_parallel=str(t.sequence_parallel),
            tiled_mlp=t.tiled_mlp,
            offload_activations=t.offload_activations,
            optimizer=t.optimizer,
            peft_method=cfg.peft.method,
        )

    def applied_to(self, cfg: RunConfig) -> RunConfig:
        """``cfg`` with these decisions; ``cfg`` itself when they are already its own."""
        if self == Decisions.of(cfg):
            return cfg
        return with_sections(
            cfg,
            zero={"stage": self.zero_stage, "template": self.zero_template},
            trainer={
                "micro_batch_size": self.micro_batch_size,
                "loss": self.loss,
                "activation_checkpointing": self.activation_checkpointing,
                "checkpoint_layers": self.checkpoint_layers,
                "sequence_parallel": self.sequence_parallel,
                "tiled_mlp": self.tiled_mlp,
                "offload_activations": self.offload_activations,
                "optimizer": self.optimizer,
            },
            peft={"method": self.peft_method},
        )


def decided(cfg: RunConfig, **changes: Any) -> RunConfig:
    """``cfg`` with some decisions changed (``decided(cfg, zero_stage=3)``)."""
    return dataclasses.replace(Decisions.of(cfg), **changes).applied_to(cfg)


def with_sections(cfg: RunConfig, **sections: dict[str, Any]) -> RunConfig:
    """``cfg`` with fields of some sections replaced (``with_sections(cfg, data={"max_seq_len":
    512})``): new objects for those sections and the top level, the rest shared."""
    return dataclasses.replace(
        cfg,
        **{
            name: dataclasses.replace(getattr(cfg, name), **fields)
            for name, fields in sections.items()
        },
    )
