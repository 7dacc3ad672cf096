"""The decoder layers and the per-layer choices applied to them.

A leaf of the rank side: rank.model (LoRA, compiled layers) and rank.long_context (tiled MLPs,
offloaded and compiled checkpoints) both reach the layers through it, so neither imports the
other for them. rank.build.apply_layer_decisions applies every per-layer decision (this
module's checkpointing, long_context's tiles and offload) in one call.

A layer recomputes in one of two ways (config.decisions.Recompute): ``full`` runs transformers'
checkpoint, which keeps the layer's input and runs its whole forward again in backward;
``selective`` runs torch's selective activation checkpointing (``create_selective_checkpoint_
contexts``, non-reentrant): the forward keeps the outputs of the layer's matmuls and attention
(:func:`keeps_output`) beside its input, and the backward's recompute runs only the ops between
them — norms, activations, rotary, dropout (with the forward's RNG state, so the same masks) —
reading the kept outputs instead of multiplying again; but for the matmuls that are cheap to
redo for the memory their output holds (LoRA's B, r deep and as wide as its module's output:
memory.selective.keeps_matmul_output, which the planner counts by), which it runs again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from memtune.memory.selective import keeps_matmul_output

if TYPE_CHECKING:
    from memtune.config.decisions import Checkpointing


def decoder_layers(model: Any) -> list[Any]:
    """The decoder layers in order: the modules transformers can checkpoint, but a vision
    tower's blocks (``.visual.``: rank.vision decides those)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [
        m
        for name, m in model.named_modules()
        if isinstance(m, GradientCheckpointingLayer) and ".visual." not in f".{name}."
    ]


MATMULS = (
    "aten.mm.",
    "aten.addmm.",
    "aten.bmm.",
    "aten._grouped_mm.",
    "bitsandbytes.gemm_4bit.",
    "bitsandbytes.int8_scaled_mm.",
    "bitsandbytes.int8_mixed_scaled_mm.",
)
"""The operators whose outputs a selective layer keeps, by name (the op's ``str``) — torch's
matmuls and bitsandbytes' 4-bit and 8-bit ones (a QLoRA or lora-int8 base projection: one op
that dequantizes and multiplies) — unless :func:`matmul_dims` says the output is cheap to make
again..."""
ATTENTION = ("attention", "flash_attn", "torch_attn.")
"""... and those of attention: SDPA's kernels (``_scaled_dot_product_*``),
flash-attn's custom operators and torch's variable-length attention (``torch_attn._varlen_attn``:
model.attn_implementation=torch_varlen, one operator to a dispatch mode)."""


def keeps_output(op: Any, args: tuple[Any, ...] = ()) -> bool:
    """Whether a selective layer keeps this operator's outputs (else recomputes it); ``args``:
    the operator's, whose shapes say a matmul's inner dimension and output width."""
    name = str(op)
    if any(a in name for a in ATTENTION):
        return True
    if not name.startswith(MATMULS):
        return False
    dims = matmul_dims(name, args)
    return dims is None or keeps_matmul_output(*dims)


def matmul_dims(name: str, args: tuple[Any, ...]) -> tuple[int, int] | None:
    """(inner dimension, output width) of a matmul operator, from its arguments; None for a
    grouped expert matmul (kept)."""
    if name.startswith(("aten.mm.", "aten.bmm.")):
        return int(args[0].shape[-1]), int(args[1].shape[-1])
    if name.startswith("aten.addmm."):  # (bias, input, weight.T)
        return int(args[1].shape[-1]), int(args[2].shape[-1])
    if name.startswith("bitsandbytes.gemm_4bit."):  # (input, packed, [out, in], ...)
        return int(args[0].shape[-1]), int(args[2][0])
    if name.startswith("bitsandbytes.int8_scaled_mm."):  # (int8 input, int8 weight [out, in])
        return int(args[0].shape[-1]), int(args[1].shape[0])
    if name.startswith("bitsandbytes.int8_mixed_scaled_mm."):  # (input, int8 input, weight)
        return int(args[0].shape[-1]), int(args[2].shape[0])
    return None


class SelectiveCheckpoint:
    """What a selective layer calls in place of transformers' checkpoint function
    (``_gradient_checkpointing_func``): torch's non-reentrant checkpoint with the selective
    policy; ``replaces``, the function it replaced (a layer switched back to ``full``)."""

    def __init__(self, replaces: Callable[..., Any]):
        self.replaces = replaces

    def __call__(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        from functools import partial

        from torch.utils.checkpoint import (
            CheckpointPolicy,
            checkpoint,
            create_selective_checkpoint_contexts,
        )

        def policy(ctx: Any, op: Any, *a: Any, **k: Any) -> CheckpointPolicy:
            if keeps_output(op, a):
                return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE

        contexts = partial(create_selective_checkpoint_contexts, policy)
        return checkpoint(function, *args, use_reentrant=False, context_fn=contexts, **kwargs)


def set_checkpointed_layers(model: Any, checkpointing: Checkpointing) -> None:
    """Each decoder layer as decided (decisions.json ``checkpointing.layers``): recompute its
    whole forward in backward ("full"), its elementwise ops only ("selective"), or keep its
    activations ("keep")."""
    from memtune.config import ConfigError

    layers = decoder_layers(model)
    if len(layers) != len(checkpointing.layers):
        raise ConfigError(
            f"checkpointing.layers (decisions.json) has {len(checkpointing.layers)} entries, the "
            f"model {len(layers)} decoder layers"
        )
    for layer, kind in zip(layers, checkpointing.layers, strict=True):
        layer.gradient_checkpointing = kind != "keep"
        current = getattr(layer, "_gradient_checkpointing_func", None)
        if current is None:
            continue  # checkpointing not installed (enabled: false): every layer keeps
        plain = current.replaces if isinstance(current, SelectiveCheckpoint) else current
        layer._gradient_checkpointing_func = (
            SelectiveCheckpoint(plain) if kind == "selective" else plain
        )
    embedding_grad_as_decided(model, checkpointing)


def embedding_grad_as_decided(model: Any, checkpointing: Checkpointing) -> None:
    """With nothing recomputed (the first layer keeps: the layers that recompute come first)
    and the non-reentrant checkpoint, the input embedding's output needs no gradient
    (:func:`embedding_output_needs_no_grad`), as with checkpointing off. Called wherever the
    layers are decided and after peft wraps the model (peft hooks it again when checkpointing
    is installed). A layer that recomputes keeps the hook, as the planner and the step-time
    estimate count that step (layer 0's input gradient computed): one that was dropped for
    an earlier decision on the same model (the GPU check decides again at each length) is put
    back."""
    if checkpointing.embedding_output_grad_free:
        embedding_output_needs_no_grad(model)
    elif checkpointing.enabled and not _require_grad_hooks(model):
        model.enable_input_require_grads()


REQUIRE_GRAD_HOOKS = ("make_inputs_require_grads", "make_inputs_require_grad")
"""transformers' ``enable_input_require_grads`` hook, and peft's own fallback's name."""


def embedding_output_needs_no_grad(model: Any) -> int:
    """Drop the hooks that make the input embedding's output require a gradient; the number
    dropped. transformers 5 adds one whenever it installs activation checkpointing, even when
    no layer recomputes (and peft another); the first layer's norm and its q, k and v dropouts
    then keep their inputs for a gradient nothing reads (the frozen embedding takes none).
    Without them a step with nothing recomputed keeps what it keeps with checkpointing off, as
    the planner counts it (memory.estimate.saved_bytes)."""
    embeddings = getattr(model, "get_input_embeddings", lambda: None)()
    if embeddings is None:
        return 0
    found = _require_grad_hooks(model)
    for key in found:
        del embeddings._forward_hooks[key]
    return len(found)


def _require_grad_hooks(model: Any) -> list[int]:
    """The keys of the input embedding's hooks that make its output require a gradient."""
    embeddings = getattr(model, "get_input_embeddings", lambda: None)()
    if embeddings is None:
        return []
    hooks = embeddings._forward_hooks
    return [k for k, h in hooks.items() if getattr(h, "__name__", "") in REQUIRE_GRAD_HOOKS]
