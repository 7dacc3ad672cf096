"""Images in conversations: where they come from, how they are resized, how many tokens each is.

memtune builds the token layout of a conversation with images itself, from the model's own
image processor (transformers' ``Qwen2VLImageProcessorPil``) and the chat template, instead of
calling the model's processor class. The processor classes (``Qwen3VLProcessor``, which
Qwen3.5 / 3.6 load too, and ``Qwen2_5_VLProcessor``) cannot be constructed without torchvision,
even for images alone: their ``__init__`` checks the video processor's class, which exists only
with torchvision. torchvision has to match the installed torch build exactly (CPU or the user's
CUDA wheel), so adding it would make every install pick a matching pair for an input memtune
does not take (video). What the processor does for an image is small and is the image
processor's: :func:`resize` (transformers' own ``smart_resize`` and PIL resampling, through the
PIL image processor's methods), then one ``<|image_pad|>`` per ``merge_size²`` patches between
``<|vision_start|>`` and ``<|vision_end|>``. tests/test_vision_data.py checks the result token
for token, and pixel for pixel, against the processor class itself (constructed without its
video processor) on Qwen's tokenizer files.

The cache keeps each image **resized, as uint8** (``3 × H × W``): a 1280 × 720 screenshot is
3 × 704 × 1280 = 2.7 MB there with Qwen3-VL's / Qwen3.5's settings (880 image tokens), where
the float32 patches the model takes are 8 times that (4 bytes a value, and each image is its
own temporal pair): 21.6 MB (Qwen2.5-VL: 2.8 MB resized to 728 × 1288, 1,196 tokens, 22.5 MB of
patches). The rank turns them into patches with :func:`pixel_values` (rescale, normalize,
patchify: the processor's own steps).
"""

from __future__ import annotations

import copy
import io
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
IMAGE_PLACEHOLDER = VISION_START + IMAGE_PAD + VISION_END
"""What the Qwen VL chat templates write for an image part; the processor then repeats
``<|image_pad|>`` once per merged patch. A record's text holds one per image, in order."""
VISION_TOKENS = (VISION_START, IMAGE_PAD, VISION_END, "<|video_pad|>", "<|vision_pad|>")
SHAREGPT_PLACEHOLDER = "<image>"
"""An image's place in ShareGPT-shaped records (LLaMA-Factory's convention), beside an
``images`` list."""

MM_TEXT, MM_IMAGE = 0, 1
"""``mm_token_type_ids``: 0 for text, 1 for an image's ``<|image_pad|>`` tokens (transformers'
ProcessorMixin.create_mm_token_type_ids; 2 would be video)."""

PREPROCESSOR_CONFIG = "preprocessor_config.json"
PROCESSOR_CONFIG = "processor_config.json"
"""Where a checkpoint keeps its image processor's settings: preprocessor_config.json (the
released checkpoints', and ImageProcessingMixin.save_pretrained's), or nested under
``image_processor`` in processor_config.json, the one file ProcessorMixin.save_pretrained
writes (transformers 5): a processor saved whole has no preprocessor_config.json."""
# Qwen2VLImageProcessorPil's class defaults, for a preprocessor_config.json that leaves a field out
DEFAULT_MIN_PIXELS, DEFAULT_MAX_PIXELS = 56 * 56, 28 * 28 * 1280
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
BICUBIC = 3
IMAGENET_STANDARD = (0.5, 0.5, 0.5)
"""transformers' IMAGENET_STANDARD_MEAN and _STD: Qwen3-VL's image_mean and image_std."""

_QWEN3_VL_IMAGES: dict[str, Any] = {
    "size": {"shortest_edge": 64 * 32 * 32, "longest_edge": 16384 * 32 * 32},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": list(IMAGENET_STANDARD),
    "image_std": list(IMAGENET_STANDARD),
}
RELEASED_IMAGE_PROCESSORS: dict[str, dict[str, Any]] = {
    "qwen3_5": _QWEN3_VL_IMAGES,
    "qwen3_vl": _QWEN3_VL_IMAGES,
    "qwen2_5_vl": {
        "size": {"shortest_edge": 56 * 56, "longest_edge": 16384 * 28 * 28},
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": list(CLIP_MEAN),
        "image_std": list(CLIP_STD),
    },
}
"""The image processor settings each family's released checkpoints ship (their
preprocessor_config.json, by vision-language model_type; copies in tests/data): 65,536 to
16,777,216 pixels (64 to 16,384 tokens) and mean / std 0.5 for Qwen3.5 / 3.6 and Qwen3-VL,
3,136 to 12,845,056 (4 to 16,384 tokens) and CLIP's for Qwen2.5-VL. transformers (5.24) reads
all three with Qwen2VLImageProcessorPil, whose class defaults are Qwen2-VL's (3,136 to
1,003,520 pixels, patch 14): what a checkpoint leaves out, never what a family ships. Used
where no checkpoint is on disk (the planner before a download, :func:`family_image_processor`)
and by the tiny models (memtune.tools.tiny)."""

TINY_VISION_PIXELS = (64 * 64, 128 * 128)
"""The tiny models' min_pixels and max_pixels (memtune.tools.tiny): 4 to 16 image tokens with a
32-pixel merged patch, 5 to 20 with Qwen2.5-VL's 28 (the released settings would give 64 to
16,384)."""


@dataclass(frozen=True)
class ImageRef:
    """One image of a record, not yet read: a file, or bytes that came in a column."""

    label: str
    """How a message names it: ``image 2 (/data/img/a.png)``."""
    path: Path | None = None
    data: bytes | None = None


@dataclass(frozen=True)
class ImageSettings:
    """The image processor's settings that decide an image's size and tokens (the model's
    preprocessor_config.json, min_pixels / max_pixels overridden by data.min_pixels /
    data.max_pixels). All of it is in the cache key."""

    min_pixels: int
    max_pixels: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    rescale_factor: float
    resample: int

    @classmethod
    def from_config(
        cls, config: dict[str, Any], min_pixels: int | None = None, max_pixels: int | None = None
    ) -> ImageSettings:
        """From a preprocessor_config.json's fields, read as ``Qwen2VLImageProcessorPil`` reads
        them (``size``, or the older top-level ``min_pixels`` / ``max_pixels``; its class
        defaults for what is absent), without importing transformers: a launch whose data is
        cached imports neither it nor torch (tests/test_vision_data.py checks the two readings
        agree)."""
        size = dict(config.get("size") or {})
        if config.get("min_pixels") is not None:
            size["shortest_edge"] = config["min_pixels"]
        if config.get("max_pixels") is not None:
            size["longest_edge"] = config["max_pixels"]
        return cls(
            min_pixels=int(min_pixels or size.get("shortest_edge", DEFAULT_MIN_PIXELS)),
            max_pixels=int(max_pixels or size.get("longest_edge", DEFAULT_MAX_PIXELS)),
            patch_size=int(config.get("patch_size", 14)),
            temporal_patch_size=int(config.get("temporal_patch_size", 2)),
            merge_size=int(config.get("merge_size", 2)),
            image_mean=tuple(float(x) for x in config.get("image_mean", CLIP_MEAN)),
            image_std=tuple(float(x) for x in config.get("image_std", CLIP_STD)),
            rescale_factor=float(config.get("rescale_factor", 1 / 255)),
            resample=int(config.get("resample", BICUBIC)),
        )

    def processor(self) -> Any:
        """transformers' PIL image processor with these settings."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil,
        )

        return Qwen2VLImageProcessorPil(
            size={"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels},
            patch_size=self.patch_size,
            temporal_patch_size=self.temporal_patch_size,
            merge_size=self.merge_size,
            image_mean=list(self.image_mean),
            image_std=list(self.image_std),
            rescale_factor=self.rescale_factor,
            resample=self.resample,
        )

    @property
    def factor(self) -> int:
        """Both sides of a resized image are multiples of this (a merged patch's side)."""
        return self.patch_size * self.merge_size

    def tokens(self, height: int, width: int) -> int:
        """``<|image_pad|>`` tokens of an image resized to ``height × width``."""
        return (height // self.factor) * (width // self.factor)

    def as_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


@dataclass(frozen=True)
class Resized:
    """An image as the cache keeps it: resized (:func:`resize`), and its token count."""

    pixels: np.ndarray
    """``3 × H × W`` uint8."""
    tokens: int


def model_image_settings(
    name_or_path: str, revision: str | None, min_pixels: int | None, max_pixels: int | None
) -> ImageSettings | None:
    """The model's image settings from the files next to its config.json (a local dir, or the
    Hugging Face cache: :func:`image_processor_fields`); None when the model has none (a
    text-only model)."""
    from memtune.config.architecture import checkpoint_config_file

    config = checkpoint_config_file(name_or_path, revision)
    fields = None if config is None else image_processor_fields(config.parent)
    if fields is None:
        return None
    return ImageSettings.from_config(fields, min_pixels, max_pixels)


def image_processor_fields(folder: Path) -> dict[str, Any] | None:
    """The image processor's fields of the checkpoint in ``folder``, found as transformers'
    ImageProcessingMixin.get_image_processor_dict finds them: processor_config.json's nested
    ``image_processor`` when it has one (a processor saved whole by transformers 5 writes only
    that file), else preprocessor_config.json; None when neither has them."""
    nested = folder / PROCESSOR_CONFIG
    if nested.is_file():
        fields = json.loads(nested.read_text(encoding="utf-8")).get("image_processor")
        if isinstance(fields, dict):
            return fields
    if (folder / PREPROCESSOR_CONFIG).is_file():
        return dict(json.loads((folder / PREPROCESSOR_CONFIG).read_text(encoding="utf-8")))
    return None


def family_image_processor(
    model_type: str | None, vision: Mapping[str, Any], tiny: bool = False
) -> dict[str, Any]:
    """The preprocessor_config.json fields of a ``model_type`` checkpoint (vision-language:
    qwen3_5, qwen3_vl, qwen2_5_vl) whose tower is ``vision`` (a vision_config: model.vision),
    as its family ships them (:data:`RELEASED_IMAGE_PROCESSORS`; nothing for another type:
    the image processor's class defaults), the patch, temporal patch and merge sizes the
    tower's; ``tiny``: a tiny model's (:data:`TINY_VISION_PIXELS`)."""
    fields = copy.deepcopy(RELEASED_IMAGE_PROCESSORS.get(model_type or "", {}))
    if tiny:
        low, high = TINY_VISION_PIXELS
        fields["size"] = {"shortest_edge": low, "longest_edge": high}
    for key, name in (
        ("patch_size", "patch_size"),
        ("temporal_patch_size", "temporal_patch_size"),
        ("merge_size", "spatial_merge_size"),
    ):
        if vision.get(name) is not None:
            fields[key] = int(vision[name])
    return fields


def open_image(ref: ImageRef) -> Any:
    """The image decoded whole (PIL), or an OSError / ValueError saying why it cannot be: a
    missing file, bytes that are not an image, a truncated file (PIL's ``load`` reads to the
    end, where ``open`` reads only the header)."""
    from PIL import Image

    source: Any = io.BytesIO(ref.data) if ref.data is not None else ref.path
    image = Image.open(source)
    image.load()
    return image


def resize(image: Any, settings: ImageSettings, processor: Any | None = None) -> np.ndarray:
    """``image`` (PIL) as the image processor resizes it, before it rescales: RGB, uint8,
    ``3 × H × W`` with H and W multiples of ``settings.factor``, their product within
    [min_pixels, max_pixels] (``smart_resize``), resampled by PIL as the processor resamples."""
    from transformers.image_utils import SizeDict

    proc = processor if processor is not None else settings.processor()
    chw = proc.process_image(image, do_convert_rgb=True)
    size = SizeDict(shortest_edge=settings.min_pixels, longest_edge=settings.max_pixels)
    return proc.resize(chw, size=size, resample=proc.resample, factor=settings.factor)


def pixel_values(images: Sequence[np.ndarray], settings: ImageSettings) -> dict[str, Any]:
    """The model's inputs for resized images (as :func:`resize` gives them and the cache keeps
    them): ``pixel_values`` (patches × channels·temporal·patch², float32) and
    ``image_grid_thw``, by the image processor's own rescale, normalize and patchify."""
    out = settings.processor().preprocess(
        list(images), do_resize=False, input_data_format="channels_first", return_tensors="np"
    )
    return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
