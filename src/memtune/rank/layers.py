"""The decoder layers and the per-layer choices applied to them.

A leaf of the rank side: rank.model (LoRA, compiled layers) and rank.long_context (tiled MLPs,
offloaded and compiled checkpoints) both reach the layers through it, so neither imports the
other for them.
"""

from __future__ import annotations

from typing import Any


def decoder_layers(model: Any) -> list[Any]:
    """The decoder layers in order: the modules transformers can checkpoint."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def set_checkpointed_layers(model: Any, k: int) -> None:
    """Recompute the first ``k`` decoder layers in backward, keep the others' activations."""
    for i, layer in enumerate(decoder_layers(model)):
        layer.gradient_checkpointing = i < k
