"""Conversations with images: the two record shapes and bad records (issue #49 item 1)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from memtune.data.readers import Record, read_source
from memtune.data.vision import IMAGE_PLACEHOLDER


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
    ]
