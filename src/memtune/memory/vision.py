"""A vision-language run's images in the plan: how many patches and tokens, and what the vision
tower keeps for backward (issue #49 item 5).

The tower (``model.vision``: the fields of a checkpoint's ``vision_config``) is the released
class's own, built from transformers' config class. What it costs a rank:

* its weights and its merger's, in the compute dtype (never quantized, rank.vision), counted
  on the meta device with the language model (memory.counts), sharded by ZeRO-3 with the rest;
* the images' patches as the rank feeds them (``pixel_values``, float32:
  ``channels × temporal_patch × patch²`` values a patch; memtune.data.vision.pixel_values);
* when peft.target adapts the tower (``*-and-vision``), what its blocks and merger keep for
  backward, from the tower's forward until its backward, which comes last: every tensor
  autograd saves, **measured** by running the tower at the architecture's widths on CPU
  tensors of no particular value (:func:`tower_line`; attention as a CUDA rank runs it: a
  kernel that keeps the output and a logsumexp per image, not the scores), or with
  Decisions.vision.recompute only each block's input. A frozen tower keeps nothing: no
  tensor in it needs a gradient.

An image's size in patches and tokens is the image processor's (transformers' ``smart_resize``
with the model's patch, merge and pixel limits: memtune.data.vision.ImageSettings). Its tokens
are ordinary tokens of the language model's row (data.max_seq_len counts them), planned with
the rest of the row.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from memtune.config import ConfigError, RunConfig, cache_dir, compute_bytes
from memtune.config.decisions import Decisions, keeps_dropout_copies
from memtune.memory.counts import (
    COUNTS_CACHE,
    COUNTS_CACHE_FORMAT,
    VISION_LANGUAGE_OF,
    built_with,
    cached,
    tower_config,
    tower_lora_config,
)

PLACEHOLDER_TOKENS = 2
"""An image's tokens in a row beside its patches' (memtune.data.vision.IMAGE_PLACEHOLDER):
``<|vision_start|>`` and ``<|vision_end|>``."""

PIXEL_BYTES = 4
"""pixel_values are float32 (the image processor's output; the patch embedding casts them)."""


def image_settings(cfg: RunConfig) -> Any:
    """The image processor's settings: the checkpoint's when it is on disk, else its family's
    as released (memtune.data.vision.family_image_processor: Qwen3.5's and Qwen3-VL's 65,536
    to 16,777,216 pixels, Qwen2.5-VL's 3,136 to 12,845,056; a tiny model's own, built at the
    launch) with the tower's patch, temporal patch and merge sizes; data.min_pixels /
    data.max_pixels over either."""
    from memtune.data.vision import ImageSettings, family_image_processor, model_image_settings

    m, data = cfg.model, cfg.data
    on_disk = model_image_settings(m.name_or_path, m.revision, data.min_pixels, data.max_pixels)
    if on_disk is not None:
        return on_disk
    kind = VISION_LANGUAGE_OF.get(str(m.architecture.get("model_type")))
    fields = family_image_processor(kind, dict(m.vision), tiny=m.synthesize)
    return ImageSettings.from_config(fields, data.min_pixels, data.max_pixels)


@dataclass(frozen=True)
class ImageLoad:
    """The images of one micro batch as planned, and their sizes once resized."""

    images: int
    """Images in the micro batch (every row's)."""
    height: int
    width: int
    """One image's size after resizing (the largest planned)."""
    patches: int
    """Patches of one image (the tower's sequence for it)."""
    tokens: int
    """Its tokens in the language model's row (patches / merge²)."""
    per_row: int
    """Images in one row."""

    def line(self) -> str:
        return (
            f"{self.per_row} image(s) a row of {self.width}×{self.height} resized: "
            f"{self.tokens:,} tokens, {self.patches:,} patches each"
        )


def resized(cfg: RunConfig, width: int, height: int) -> tuple[int, int, int, int]:
    """(height, width, patches, tokens) of a ``width × height`` image as the processor resizes
    it (transformers' smart_resize)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    s = image_settings(cfg)
    try:
        h, w = smart_resize(height, width, s.factor, s.min_pixels, s.max_pixels)
    except ValueError as err:  # an aspect ratio the processor refuses
        raise ConfigError(f"plan.image_width × plan.image_height: {err}") from None
    patches = (h // s.patch_size) * (w // s.patch_size)
    return h, w, patches, s.tokens(h, w)


def row_image_tokens(cfg: RunConfig) -> int:
    """The row tokens plan.images take (each image's tokens, start and end); 0 when the run is
    not planned with images (config.decisions.vision_of)."""
    from memtune.config.decisions import Checkpointing, vision_of

    if cfg.plan.images <= 0 or vision_of(cfg, Checkpointing.off(1)) is None:
        return 0
    tokens = resized(cfg, cfg.plan.image_width, cfg.plan.image_height)[3]
    return cfg.plan.images * (tokens + PLACEHOLDER_TOKENS)


def image_load(cfg: RunConfig, d: Decisions) -> ImageLoad | None:
    """What a micro batch holds of images (plan.images of plan.image_width × image_height each
    a row); None without a tower or images. A packed row can hold several samples' images: it
    is planned with as many as its tokens can hold, if more than plan.images."""
    if d.vision is None or cfg.plan.images <= 0:
        return None
    p = cfg.plan
    h, w, patches, tokens = resized(cfg, p.image_width, p.image_height)
    row, each = d.batch.row_tokens, tokens + PLACEHOLDER_TOKENS
    if p.images * each > row:
        raise ConfigError(
            f"plan.images={p.images} images of {p.image_width}×{p.image_height} are "
            f"{p.images * each:,} tokens ({tokens:,} each, resized to {w}×{h}, + its start and "
            f"end), more than a row holds (data.max_seq_len={row:,}): raise data.max_seq_len, "
            "or lower data.max_pixels"
        )
    per_row = max(p.images, row // each) if cfg.data.packing else p.images
    return ImageLoad(per_row * d.batch.micro_batch, h, w, patches, tokens, per_row)


def pixel_bytes(cfg: RunConfig, load: ImageLoad) -> int:
    """The micro batch's pixel_values: float32 patches (channels × temporal × patch²)."""
    t = tower_config(cfg)
    width = int(t.in_channels) * int(t.temporal_patch_size) * int(t.patch_size) ** 2
    return load.images * load.patches * width * PIXEL_BYTES


IMAGE_ROWS = ("image inputs", "vision activations")
"""The plan rows of a micro batch's images, added by memory.estimate: their patches, and what an
adapted tower keeps for backward (tools.step_trace checks both against a traced step)."""


def add_image_rows(add: Callable[..., None], cfg: RunConfig, d: Decisions, cuda: bool) -> None:
    """The images' rows: their float32 patches, and an adapted tower's saved activations,
    alive from the tower's forward (the step's first) to its backward (its last), so beside
    every moment of the language model's step. ``add``: the plan's Plan.add."""
    load = image_load(cfg, d)
    if load is None:
        return
    add(IMAGE_ROWS[0], pixel_bytes(cfg, load), f"float32 patches: {load.line()}", per_token=True)
    assert d.vision is not None  # image_load: none without a tower
    saved = tower_saved_bytes(cfg, d, load, cuda)
    if saved:
        how = (
            "each tower block's input (recomputed), the merger's as measured"
            if d.vision.recompute
            else "what the adapted tower's blocks and merger keep, as measured"
        )
        add(IMAGE_ROWS[1], saved, f"{load.images} image(s) a micro batch: {how}", per_token=True)


def tower_saved_bytes(cfg: RunConfig, d: Decisions, load: ImageLoad, cuda: bool) -> int:
    """What the tower keeps for backward over the micro batch's images: nothing when frozen;
    when adapted, :func:`tower_line`'s measured bytes, or with its blocks recomputed each
    block's input (the compute dtype) plus what the rest of the tower keeps."""
    if d.vision is None or not d.vision.adapted:
        return 0
    if not keeps_dropout_copies(cfg, d):  # the tower's adapters keep what dropout 0 keeps
        cfg = dataclasses.replace(cfg, peft=dataclasses.replace(cfg.peft, dropout=0.0))
    per_block, rest, per_image, per_deepstack = tower_line(cfg, cuda)
    t = tower_config(cfg)
    depth, hidden = int(t.depth), int(t.hidden_size)
    patches = load.images * load.patches
    kept = patches * hidden * compute_bytes(cfg)  # a recomputed block's input
    block = kept if d.vision.recompute else per_block * patches
    # Qwen3-VL's deepstack mergers run in the tower's loop, outside the (recomputed) blocks.
    deepstack = len(deepstack_blocks(t)) * per_deepstack * patches
    return round(depth * block + rest * patches + per_image * load.images + deepstack)


def deepstack_blocks(config: Any) -> list[int]:
    """The tower's blocks whose output a deepstack merger also takes (Qwen3-VL; none in
    Qwen3.5's and Qwen2.5-VL's towers)."""
    depth = int(config.depth)
    return [i for i in getattr(config, "deepstack_visual_indexes", None) or [] if i < depth]


TOWER_LINE_FORMAT = 2  # 2: the deepstack mergers apart

_TOWER_LINES: dict[str, tuple[float, float, float, float]] = {}


def tower_line(cfg: RunConfig, cuda: bool) -> tuple[float, float, float, float]:
    """(saved bytes per patch of one adapted block, per patch of the rest — patch embedding,
    position embeddings, merger —, per image, per patch of one deepstack merger) of the tower
    run forward with LoRA on the modules peft.target adapts there
    (config.derive.VISION_TARGETS), measured: the tower is built at its real widths with 1
    and 2 blocks (no deepstack) and run on images of two sizes on CPU tensors (uninitialised;
    only the bytes are read), and every tensor autograd saves is counted; a deepstack merger
    (Qwen3-VL's: a block's output to the language model's first layers) is the difference it
    makes on one block. Kept in the counts cache (memory.counts) like the linear mixer's
    line."""
    p = cfg.peft
    key = json.dumps(
        {
            "what": "vision tower saved bytes",
            "format": TOWER_LINE_FORMAT,
            # the store's own format too: an entry of another memtune's counts cache (8 beside
            # 9) has another file, not this one's, which its manifest called damaged
            "store": COUNTS_CACHE_FORMAT,
            "vision": dict(cfg.model.vision),
            "text": str(cfg.model.architecture.get("model_type")),
            "hidden": int(cfg.model.architecture["hidden_size"]),
            "bytes": compute_bytes(cfg),
            "lora": [p.r, p.dropout > 0, p.dora, cuda],
            "versions": built_with("transformers", "torch", "peft"),
        },
        sort_keys=True,
        default=str,
    )
    if key in _TOWER_LINES:
        return _TOWER_LINES[key]
    path = cache_dir() / "counts" / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"
    saved = cached(path, "the vision tower measured")
    if saved is not None:
        _TOWER_LINES[key] = (float(saved[0]), float(saved[1]), float(saved[2]), float(saved[3]))
        return _TOWER_LINES[key]
    m = int(cfg.model.vision.get("spatial_merge_size", 2))
    # Images of (2m)² and (4m)² patches (2 and 4 merged patches a side), towers of 1 and 2
    # blocks: the block's slope from the depths, the rest's from the sizes.
    small, large = (2 * m) ** 2, (4 * m) ** 2
    one_small, one_large = (_tower_saved(cfg, 1, side, cuda) for side in (2, 4))
    two_small = _tower_saved(cfg, 2, 2, cuda)
    block = (two_small - one_small) / small
    per_patch = (one_large - one_small) / (large - small)
    rest = per_patch - block
    per_image = one_small - per_patch * small
    deepstack = 0.0
    if deepstack_blocks(tower_config(cfg)):
        deepstack = (_tower_saved(cfg, 1, 2, cuda, deepstack=True) - one_small) / small
    line = (block, rest, per_image, deepstack)
    _TOWER_LINES[key] = line
    with contextlib.suppress(OSError):
        COUNTS_CACHE.write_value(path, list(line))
    return line


def native_dropout(p: float) -> Any:
    """LoRA's dropout as CUDA runs it: ``native_dropout`` keeps a bool mask (1 byte an element)
    for backward, where CPU's ``dropout`` keeps a noise tensor in the input's dtype. Measuring
    (and tracing, tools.step_trace) a GPU rank on a CPU swaps it in (:func:`as_on_cuda`)."""
    import torch

    class NativeDropout(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if not self.training or p == 0:
                return x
            return torch.native_dropout(x, p, True)[0]

    return NativeDropout()


def as_on_cuda(model: Any) -> None:
    """Every LoRA dropout of ``model`` as CUDA runs it (:func:`native_dropout`), and every
    regenerated one (rank.lora_dropout, marked by its ``memtune_dropout_p``) drawing its mask
    again as CUDA does (a bool, not CPU's noise in the input's dtype)."""
    import torch

    for m in model.modules():
        drop = getattr(m, "lora_dropout", None)
        if isinstance(drop, torch.nn.ModuleDict):
            for key, dropout in list(drop.items()):
                if isinstance(dropout, torch.nn.Dropout):
                    drop[key] = native_dropout(dropout.p)
        if "memtune_dropout_p" in vars(m):
            vars(m)["memtune_native_dropout"] = True


def _tower_saved(cfg: RunConfig, depth: int, side: int, cuda: bool, deepstack: bool = False) -> int:
    """Bytes autograd saves in an adapted tower of ``depth`` blocks over one image of
    ``side × side`` merged patches (see :func:`tower_line`); ``deepstack``: a deepstack merger
    on the first block's output, else none."""
    import torch
    from peft import inject_adapter_in_model
    from transformers import AutoModel

    dtype = torch.bfloat16 if compute_bytes(cfg) == 2 else torch.float32
    config = tower_config(cfg, depth=depth, deepstack_visual_indexes=[0] if deepstack else [])
    config._attn_implementation = "sdpa"  # as rank.vision.tower_attention (flash: the same bytes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.device("meta"):
            tower = AutoModel.from_config(config)
            inject_adapter_in_model(tower_lora_config(cfg), tower)
        tower.to_empty(device="cpu")
        tower.to(dtype)
    for name, q in tower.named_parameters():
        q.requires_grad_("lora_" in name)
    if cuda:
        as_on_cuda(tower)
    tower.train()
    m = int(config.spatial_merge_size)
    width = int(config.in_channels) * int(config.temporal_patch_size) * int(config.patch_size) ** 2
    pixels = torch.zeros(side * m * side * m, width)
    grid = torch.tensor([[1, side * m, side * m]])
    saved: dict[int, int] = {}

    def pack(t: Any) -> Any:
        storage = t.untyped_storage()
        saved[storage._cdata] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        tower(pixels, grid_thw=grid)
    own = {q.untyped_storage()._cdata for q in tower.parameters()}
    own |= {b.untyped_storage()._cdata for b in tower.buffers()}
    own.add(pixels.untyped_storage()._cdata)  # the pixel_values: their own plan row
    return sum(n for ptr, n in saved.items() if ptr not in own)
