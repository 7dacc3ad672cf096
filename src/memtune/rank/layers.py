"""The decoder layers and the per-layer choices applied to them.

A leaf of the rank side: rank.model (LoRA, compiled layers) and rank.long_context (tiled MLPs,
offloaded and compiled checkpoints) both reach the layers through it, so neither imports the
other for them. rank.build.apply_layer_decisions applies every per-layer decision (this
module's checkpointing, long_context's tiles and offload) in one call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from memtune.config.decisions import Checkpointing


def decoder_layers(model: Any) -> list[Any]:
    """The decoder layers in order: the modules transformers can checkpoint."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def set_checkpointed_layers(model: Any, checkpointing: Checkpointing) -> None:
    """Each decoder layer as decided (decisions.json ``checkpointing.layers``): recompute its
    forward in backward ("full") or keep its activations ("keep")."""
    from memtune.config import ConfigError

    layers = decoder_layers(model)
    if len(layers) != len(checkpointing.layers):
        raise ConfigError(
            f"checkpointing.layers (decisions.json) has {len(checkpointing.layers)} entries, the "
            f"model {len(layers)} decoder layers"
        )
    for layer, kind in zip(layers, checkpointing.layers, strict=True):
        layer.gradient_checkpointing = kind == "full"
