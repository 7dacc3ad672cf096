"""Values derived from a validated config, each computed in this one place."""

from __future__ import annotations

import copy

from memtune.config.schema import RunConfig

# The linear layers each peft.target preset adapts, by their name in a Qwen2 decoder layer.
LORA_TARGETS = {
    "attention": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "all-linear": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}


def one_rank_zero(cfg: RunConfig) -> RunConfig:
    """``cfg``, or a copy on ZeRO-2 when ZeRO-3 would run on one rank (see one_rank_stage2;
    launcher.prepare.decide says so)."""
    z = cfg.zero
    if not (cfg.launcher.num_ranks == 1 and z.stage == 3 and z.template is None):
        return cfg
    if not z.one_rank_stage2:
        return cfg
    out = copy.deepcopy(cfg)
    out.zero.stage = 2
    return out


def checkpointed_layers(cfg: RunConfig) -> int:
    """Decoder layers that recompute their forward (the first ones): 0 .. num_hidden_layers."""
    layers = int(cfg.model.architecture.get("num_hidden_layers") or 0)
    if not cfg.trainer.activation_checkpointing:
        return 0
    value = str(cfg.trainer.checkpoint_layers)
    return layers if value in ("all", "auto") else min(int(value), layers)


def grad_accumulation_steps(cfg: RunConfig) -> int:
    t = cfg.trainer
    return t.global_batch_size // (t.micro_batch_size * cfg.launcher.num_ranks)
