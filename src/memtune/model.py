"""Load the base model, pick the attention kernel, add LoRA, turn on activation checkpointing."""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

import torch

from memtune.config import ConfigError, RunConfig

log = logging.getLogger("memtune")

LORA_TARGETS = {
    "attention": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "all-linear": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}


def torch_dtype(cfg: RunConfig) -> torch.dtype:
    return torch.bfloat16 if cfg.trainer.precision == "bf16" else torch.float32


def choose_attention(requested: str, device_type: str) -> str:
    """flash_attention_2 when asked for (or 'auto') and usable, else sdpa."""
    has_flash = importlib.util.find_spec("flash_attn") is not None
    if requested == "auto":
        return "flash_attention_2" if device_type == "cuda" and has_flash else "sdpa"
    if requested == "flash_attention_2" and not (device_type == "cuda" and has_flash):
        raise ConfigError(
            "model.attn_implementation=flash_attention_2 needs a CUDA GPU and the flash-attn "
            "package (pip install -e '.[flash]'); use auto to fall back to sdpa"
        )
    return requested


def load_tokenizer(cfg: RunConfig) -> Any:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(
        cfg.model.name_or_path, trust_remote_code=cfg.model.trust_remote_code
    )
    if tok.pad_token_id is None:
        raise ConfigError(f"{cfg.model.name_or_path}: the tokenizer has no pad token")
    return tok


def load_base_model(cfg: RunConfig, attn_implementation: str) -> Any:
    """``from_pretrained`` in the training dtype. Under ZeRO-3 the caller keeps a live
    ``HfDeepSpeedConfig`` so weights load already partitioned across ranks."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        cfg.model.name_or_path,
        dtype=torch_dtype(cfg),
        attn_implementation=attn_implementation,
        trust_remote_code=cfg.model.trust_remote_code,
    )
    model.config.use_cache = False  # a KV cache is useless in training and defeats recompute
    return model


def add_lora(model: Any, cfg: RunConfig) -> Any:
    from peft import LoraConfig, get_peft_model

    p = cfg.peft
    if cfg.trainer.activation_checkpointing:
        # On decoder layers only (transformers wraps its GradientCheckpointingLayer modules);
        # embeddings and the LM head keep their activations.
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": cfg.trainer.checkpointing_reentrant}
        )
    lora = LoraConfig(
        r=p.r,
        lora_alpha=p.alpha,
        lora_dropout=p.dropout,
        target_modules=LORA_TARGETS[p.target],
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, lora)
    if cfg.trainer.activation_checkpointing and cfg.trainer.checkpointing_reentrant:
        # Reentrant checkpointing drops gradients unless the layer inputs require grad.
        model.enable_input_require_grads()
    return model


def count_parameters(model: Any) -> tuple[int, int]:
    """(trainable, total), using ZeRO-3's full sizes when parameters are partitioned."""
    trainable = total = 0
    for p in model.parameters():
        n = int(getattr(p, "ds_numel", p.numel()))
        total += n
        if p.requires_grad:
            trainable += n
    return trainable, total
