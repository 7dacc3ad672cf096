"""Images on the rank: the vision-language class with its vision tower, and a step through it.

When the data has images (decisions.json ``vision``) a rank loads the checkpoint's released
class (``AutoModelForImageTextToText``: Qwen3_5ForConditionalGeneration,
Qwen3VLForConditionalGeneration, Qwen2_5_VLForConditionalGeneration) instead of its text
model. The tower and its merger load in the compute dtype and are never quantized
(:func:`load_kwargs`), ZeRO-3 shards them with the other weights, and peft leaves them frozen
unless ``peft.target`` ends in ``-and-vision`` (config.derive.lora_target_pattern).

A step (:func:`multimodal_hidden`) runs the model's own parts, in the model's order, with
memtune's boundaries:

* the tower on every image of the micro batch at once, through the model's
  ``get_image_features``: the tower's own ``cu_seqlens`` (one per image, from
  ``image_grid_thw``) keep each image's attention within it (Qwen2.5-VL's windows too);
* the 3-D rotary positions (mRoPE; interleaved for Qwen3-VL and Qwen3.5) by the model's own
  ``get_rope_index``, called on each sample of a packed row alone with that sample's images, so
  every sample's positions start afresh as when it is alone; row 0 of the 4-row
  ``position_ids`` is the text position, restarting per sample, as the language model reads it;
* the language model with the image features scattered in (``mm_encoder_outputs``), and the
  same ``cu_seq_lens`` a text batch carries, so ``sdpa_varlen`` / FlashAttention-2 (and
  Qwen3.5's per-sample linear attention) keep every sample to itself.

The tower is called directly rather than through the model's forward with ``pixel_values``:
the model hands its keyword arguments (the text's ``cu_seq_lens_q`` among them) down to the
tower's attention, where they would mark the text's boundaries on the image patches. And the
tower's attention is never ``sdpa_varlen`` (which is causal): it gets ``sdpa``, or
FlashAttention-2 when the text has it.

Every forward runs the tower, on a blank one-token image when the micro batch has none, added
to the result times zero: under ZeRO-3 each call of a module gathers its weights, and ranks
whose micro batches differ in images must still make the same collective calls (the same for
the gradients of an adapted tower).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from memtune.config.decisions import AttentionKernel, Vision
from memtune.rank.attention import row_segments

TOWER = "visual"
"""Where the released classes keep their vision tower and merger: ``model.visual``."""

MM_IMAGE = 1  # mm_token_type_ids of an image token (memtune.data.vision.MM_IMAGE)


def is_tower_module(name: str) -> bool:
    """A module (or parameter) name inside the vision tower."""
    return f".{TOWER}." in f".{name}."


def tower_attention(kernel: AttentionKernel) -> str:
    """The tower's attention kernel for the decided text kernel: FlashAttention-2 with it,
    else PyTorch's SDPA (bidirectional within each image, by the tower's own cu_seqlens)."""
    return "flash_attention_2" if kernel == "flash_attention_2" else "sdpa"


def attention_per_part(kernel: AttentionKernel) -> dict[str, str]:
    """``from_pretrained``'s ``attn_implementation`` for the vision-language class: the decided
    kernel for the language model, :func:`tower_attention` for the tower."""
    return {"": kernel, "text_config": kernel, "vision_config": tower_attention(kernel)}


NOT_QUANTIZED = ["lm_head", f"model.{TOWER}"]
"""bitsandbytes' skip list for a quantized vision-language base (``llm_int8_skip_modules``,
which replaces its default list, the LM head): the tower and the merger stay in the compute
dtype under QLoRA and LLM.int8, as the LM head does."""


def has_tower(model: Any) -> bool:
    """The loaded base has a vision tower (the vision-language class)."""
    inner = getattr(model, "model", None)
    return inner is not None and getattr(inner, TOWER, None) is not None


def tower_blocks(model: Any) -> list[Any]:
    """The tower's blocks (transformers' checkpointable layers inside ``model.visual``)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [
        m
        for name, m in model.named_modules()
        if isinstance(m, GradientCheckpointingLayer) and is_tower_module(name)
    ]


def set_tower_recompute(model: Any, vision: Vision) -> None:
    """Every tower block recomputed in backward or none (decisions.json ``vision.recompute``),
    with torch's non-reentrant checkpoint: the blocks' input (the patch embedding of frozen
    weights) needs no gradient, which the reentrant one would need to pass the adapters'."""
    from torch.utils.checkpoint import checkpoint

    for block in tower_blocks(model):
        block.gradient_checkpointing = vision.recompute
        if vision.recompute:
            block._gradient_checkpointing_func = partial(checkpoint, use_reentrant=False)


REQUIRE_GRAD_HOOKS = ("make_inputs_require_grads", "make_inputs_require_grad")
"""transformers' ``enable_input_require_grads`` hook (peft's prepare_model_for_kbit_training
has its own, one letter shorter)."""


def tower_inputs_need_no_grad(model: Any) -> int:
    """Drop the hooks that make the tower's patch embedding output require a gradient; the
    number dropped. peft calls transformers' ``enable_input_require_grads`` on a model with
    gradient checkpointing, which hooks the input embeddings of every pretrained model inside,
    Qwen2.5-VL's tower's patch embedding too: a frozen tower would then keep every block's
    activations for a backward that computes nothing (20 GB a rank for Qwen2.5-VL-7B on 3
    screenshots; found by tools.step_trace). Nothing in the tower needs it: its blocks recompute
    non-reentrantly (:func:`set_tower_recompute`) and an adapted block's LoRA weights get their
    gradients from its output's."""
    unwrap = getattr(model, "get_base_model", None)
    base = unwrap() if unwrap is not None else model
    if not has_tower(base):
        return 0
    dropped = 0
    for module in getattr(base.model, TOWER).modules():
        for key, hook in list(module._forward_hooks.items()):
            if getattr(hook, "__name__", "") in REQUIRE_GRAD_HOOKS:
                del module._forward_hooks[key]
                dropped += 1
    return dropped


def _blank_image(visual: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest image the tower takes: one merged patch (merge × merge patches) of zeros."""
    config = visual.config
    m = int(config.spatial_merge_size)
    width = int(config.in_channels) * int(config.temporal_patch_size) * int(config.patch_size) ** 2
    pixels = torch.zeros(m * m, width, device=device)
    grid = torch.tensor([[1, m, m]], device=device)
    return pixels, grid


def _features_sum(features: Any) -> torch.Tensor:
    """Every output of the tower summed (pooled features and, Qwen3-VL, deepstack features)."""
    parts = list(features.pooler_output)
    for level in getattr(features, "deepstack_features", None) or []:
        parts += list(level)
    return torch.stack([p.sum() for p in parts]).sum()


def rope_positions(
    model: Any,
    input_ids: torch.Tensor,
    mm_token_type_ids: torch.Tensor | None,
    image_grid_thw: torch.Tensor | None,
    cu_seq_lens: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
) -> torch.Tensor:
    """``position_ids`` (4, rows, width) for the vision-language model (``model``: its inner
    model, which has ``get_rope_index``): row 0 the text position, rows 1-3 the 3-D rotary
    position, each restarting at every sample (``cu_seq_lens``: a packed row's samples;
    ``attention_mask``: right-padded rows) and computed by the model on the sample alone, with
    its own images (``image_grid_thw`` in the order of their tokens).

    Computed on the host from host copies of the ids, types and grids, and moved to the
    batch's device once: on a GPU each sample's image count and get_rope_index's own
    ``.item()`` calls would be a host sync apiece, several per packed sample."""
    rows, width = input_ids.shape
    target = input_ids.device
    input_ids = input_ids.cpu()
    device = input_ids.device
    if image_grid_thw is not None:
        image_grid_thw = image_grid_thw.cpu()
    if cu_seq_lens is not None:
        cu_seq_lens = cu_seq_lens.cpu()
    if attention_mask is not None:
        attention_mask = attention_mask.cpu()
    positions = torch.zeros(4, rows, width, dtype=torch.long, device=device)
    segments = row_segments(rows, width, cu_seq_lens, attention_mask)
    if segments is None:
        segments = [[(0, width)]] * rows
    types = mm_token_type_ids.cpu() if mm_token_type_ids is not None else None
    if types is None:
        types = torch.zeros_like(input_ids)
    starts = types == MM_IMAGE
    starts[:, 1:] &= types[:, :-1] != MM_IMAGE  # an image's first token
    used = 0
    for r, segs in enumerate(segments):
        for a, b in segs:
            n = int(starts[r, a:b].sum())
            grids = None
            if n:
                assert image_grid_thw is not None, "image tokens without image_grid_thw"
                grids = image_grid_thw[used : used + n]
                used += n
            mrope, _ = model.get_rope_index(
                input_ids[r : r + 1, a:b], types[r : r + 1, a:b], image_grid_thw=grids
            )
            positions[0, r, a:b] = torch.arange(b - a, device=device)
            positions[1:, r, a:b] = mrope[:, 0]
    if image_grid_thw is not None and used != len(image_grid_thw):
        raise ValueError(
            f"{len(image_grid_thw)} images in the batch and {used} images' tokens in its "
            "samples (an image's tokens outside any sample?)"
        )
    return positions.to(target)


def multimodal_hidden(
    base: Any,
    inputs: dict[str, Any],
    pixel_values: torch.Tensor | None,
    image_grid_thw: torch.Tensor | None,
    mm_token_type_ids: torch.Tensor | None,
) -> torch.Tensor:
    """The language model's last hidden states for a micro batch with (or without) images
    (``inputs``: rank.loss.model_inputs of the batch; the images patchified by
    memtune.data.vision.pixel_values). See the module docstring."""
    vl = base.model  # Qwen3VLModel, Qwen2_5_VLModel, Qwen3_5Model
    input_ids = inputs["input_ids"]
    blank = pixel_values is None
    if blank:
        pixel_values, grid = _blank_image(vl.visual, input_ids.device)
    else:
        assert image_grid_thw is not None, "pixel_values without image_grid_thw"
        grid = image_grid_thw
    features = vl.get_image_features(pixel_values, grid, return_dict=True)
    positions = rope_positions(
        vl,
        input_ids,
        mm_token_type_ids,
        None if blank else grid,
        inputs.get("cu_seq_lens_q"),
        inputs.get("attention_mask"),
    )
    rest = {k: v for k, v in inputs.items() if k not in ("input_ids", "position_ids")}
    out = vl(
        input_ids=input_ids,
        position_ids=positions,
        mm_encoder_outputs=None if blank else {"image": features},
        use_cache=False,
        **rest,
    )
    hidden: torch.Tensor = out.last_hidden_state
    if blank:  # the tower ran on every rank; its output counts for nothing
        hidden = hidden + 0.0 * _features_sum(features).to(hidden.dtype)
    return hidden
