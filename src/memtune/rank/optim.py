"""The optimizer choices: torch AdamW, bitsandbytes 8-bit AdamW, DeepSpeed CPU Adam (offload).

* ``adamw`` — torch's AdamW: fp32 moments, 8 bytes of state per trainable parameter.
* ``adamw_8bit`` — bitsandbytes' block-wise 8-bit AdamW: 2 bytes of state per parameter. On
  CUDA the paged variant (state pages out to host memory under pressure instead of an OOM);
  paging does not exist on CPU and is off there, which the log says. Tensors smaller than
  ``trainer.optim_8bit_min_size`` elements keep fp32 state (bitsandbytes' own rule; 4096 by
  default), so a tiny model would silently train with 32-bit state unless it is lowered.
* ``cpu_adam`` — optimizer state and step on the host (ZeRO-Offload). DeepSpeed only uses its
  fast ``DeepSpeedCPUAdam`` when it builds the optimizer from its own config, so this choice
  writes ``optimizer`` and ``zero_optimization.offload_optimizer`` into the DeepSpeed JSON
  (see config/deepspeed.py) and passes no optimizer object.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from memtune.config import RunConfig
from memtune.config.schema import Optimizer


def param_groups(cfg: RunConfig, model: torch.nn.Module) -> list[dict[str, Any]]:
    """The trainable parameters as the optimizer's groups: one, or with LoRA+
    (peft.loraplus_lr_ratio) two: the A matrices at trainer.lr, the B matrices (and DoRA's
    magnitudes, one number per output row, as peft's LoRA+ groups them) at trainer.lr × the
    ratio. Each group carries its ``lr_ratio``, which the schedule multiplies (the first group,
    whose rate the logs show, is always the base rate)."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    ratio = cfg.peft.loraplus_lr_ratio
    if ratio is None:
        return [{"params": [p for _, p in trainable], "lr_ratio": 1.0}]
    fast_names = ("lora_B", "lora_magnitude_vector")
    fast = [p for n, p in trainable if any(f in n for f in fast_names)]
    slow = [p for n, p in trainable if not any(f in n for f in fast_names)]
    return [{"params": slow, "lr_ratio": 1.0}, {"params": fast, "lr_ratio": float(ratio)}]


def with_rates(groups: list[dict[str, Any]], lr: float) -> list[dict[str, Any]]:
    return [{**g, "lr": lr * g["lr_ratio"]} for g in groups]


def build_optimizer(
    cfg: RunConfig, optimizer: Optimizer, params: list[dict[str, Any]], device: torch.device
) -> tuple[Any, str]:
    """The client optimizer for ``deepspeed.initialize`` (None for cpu_adam) and a log line;
    ``optimizer``: the decided one (decisions.json); ``params``: :func:`param_groups`."""
    t = cfg.trainer
    params = with_rates(params, t.lr)
    if optimizer == "cpu_adam":
        return None, "optimizer DeepSpeed CPU Adam (state and step on the host)"
    if optimizer == "adamw_8bit":
        import bitsandbytes as bnb

        paged = device.type == "cuda"
        cls = bnb.optim.PagedAdamW8bit if paged else bnb.optim.AdamW8bit
        opt = cls(params, lr=t.lr, weight_decay=t.weight_decay, min_8bit_size=t.optim_8bit_min_size)
        note = "paged" if paged else "not paged: paging needs CUDA"
        return opt, f"optimizer bitsandbytes 8-bit AdamW ({note})"
    return torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay), "optimizer AdamW"


def scheduler_factory(cfg: RunConfig) -> Callable[[torch.optim.Optimizer], Any]:
    """DeepSpeed calls this with whichever optimizer it ends up using."""
    from memtune.rank.loop import lr_factor

    return lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(cfg))
