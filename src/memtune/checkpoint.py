"""Adapter export in PEFT's own format, so any tool that loads PEFT adapters can use it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def trainable_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """Full (gathered) copies of the trainable tensors. A collective under ZeRO-3: every rank
    must call it; all ranks get the result."""
    import deepspeed

    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    zero3 = any(hasattr(p, "ds_id") for p in params)
    if zero3:
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            return {n: p.detach().cpu().clone() for n, p in named}
    return {n: p.detach().cpu().clone() for n, p in named}


def export_adapter(model: Any, out_dir: Path, is_writer: bool) -> int:
    """Write ``adapter_config.json`` + ``adapter_model.safetensors``; returns the tensor count.

    ``model`` is the PEFT model (``engine.module``). All ranks call this; only the writer saves.
    """
    state = trainable_state_dict(model)
    if not state:
        raise RuntimeError("no trainable parameters to export: LoRA was not applied")
    if is_writer:
        model.save_pretrained(str(out_dir), state_dict=state, safe_serialization=True)
    return len(state)
