"""ChatML rendering, label masking (the closing <|im_end|> is a target), batching, bad records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memtune.config import ConfigError, DataConfig, to_run_config
from memtune.data import (
    IGNORE_INDEX,
    alpaca_messages,
    collate,
    encode,
    load_samples,
    read_alpaca,
    render_prompt,
)
from memtune.model import load_tokenizer
from memtune.tiny import synthesize
from tests.conftest import compose_cfg


@pytest.fixture(scope="module")
def tokenizer():
    cfg = to_run_config(compose_cfg())
    synthesize(cfg.model.name_or_path, cfg.model.architecture)
    return load_tokenizer(cfg)


def test_prompt_rendering_is_chatml_without_implicit_system() -> None:
    rec = {"instruction": "Translate", "input": "red", "output": "红色"}
    assert render_prompt(alpaca_messages(rec, None)[:-1]) == (
        "<|im_start|>user\nTranslate\n\nred<|im_end|>\n<|im_start|>assistant\n"
    )
    with_system = render_prompt(alpaca_messages(rec, "Be brief.")[:-1])
    assert with_system.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")


def test_only_the_reply_and_its_im_end_are_labelled(tokenizer) -> None:
    rec = {"instruction": "What is 2 + 3?", "input": "", "output": "5"}
    sample = encode(alpaca_messages(rec, None), tokenizer)
    assert len(sample.input_ids) == len(sample.labels)
    text = tokenizer.decode(sample.input_ids)
    assert text == (
        "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n5<|im_end|>\n"
    )
    labelled = [t for t in sample.labels if t != IGNORE_INDEX]
    assert tokenizer.decode(labelled) == "5<|im_end|>"
    assert labelled[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    # The labelled span is contiguous and ends right before the trailing newline.
    first = next(i for i, t in enumerate(sample.labels) if t != IGNORE_INDEX)
    assert sample.labels[first:-1] == sample.input_ids[first:-1]
    assert sample.labels[-1] == IGNORE_INDEX


def test_demo_data_loads_with_counts(tokenizer) -> None:
    cfg = to_run_config(compose_cfg()).data
    samples, stats = load_samples(cfg, tokenizer)
    assert stats.records == stats.samples == len(samples) == 320
    assert stats.truncated == 0 and stats.dropped_no_labels == 0
    assert stats.label_tokens == sum(
        sum(1 for t in s.labels[1:] if t != IGNORE_INDEX) for s in samples
    )


def test_truncation_and_drops_are_counted(tokenizer, tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    rows = [
        {"instruction": "short", "input": "", "output": "ok"},
        {"instruction": "long " * 40, "input": "", "output": "answer"},  # prompt alone > 16
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    samples, stats = load_samples(DataConfig(path=str(path), max_seq_len=16), tokenizer)
    assert stats.records == 2 and stats.truncated == 1 and stats.dropped_no_labels == 1
    assert len(samples) == 1 and len(samples[0].input_ids) <= 16


def test_collate_pads_right_and_masks(tokenizer) -> None:
    cfg = to_run_config(compose_cfg()).data
    samples, _ = load_samples(cfg, tokenizer)
    a, b = samples[0], max(samples[:20], key=lambda s: len(s.input_ids))
    batch = collate([a, b], pad_token_id=tokenizer.pad_token_id)
    width = len(b.input_ids)
    assert batch["input_ids"].shape == (2, width)
    n = len(a.input_ids)
    assert batch["attention_mask"][0].tolist() == [1] * n + [0] * (width - n)
    assert batch["input_ids"][0, n:].eq(tokenizer.pad_token_id).all()
    assert batch["labels"][0, n:].eq(IGNORE_INDEX).all()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (
            '{"instruction": "a", "output": "b"}\n{"instruction": "a", "output"\n',
            r"d\.jsonl:2: invalid JSON",
        ),
        ('{"instruction": "a"}\n', r"d\.jsonl:1: field 'output' is missing"),
        ('{"instruction": 3, "output": "b"}\n', r"d\.jsonl:1: field 'instruction'"),
        ('{"instruction": "a", "output": "  "}\n', r"d\.jsonl:1: field 'output' is empty"),
        ('["a", "b"]\n', r"d\.jsonl:1: expected an object"),
    ],
)
def test_bad_records_name_file_and_line(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(content)
    with pytest.raises(ConfigError, match=message):
        list(read_alpaca(path))


def test_json_array_and_undecodable_file(tmp_path: Path) -> None:
    good = tmp_path / "d.json"
    good.write_text(json.dumps([{"instruction": "a", "input": "", "output": "b"}]))
    assert [n for n, _ in read_alpaca(good)] == [1]
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"instruction": "\xff\xfe", "output": "b"}\n')
    with pytest.raises(ConfigError, match=r"bad\.jsonl: cannot read"):
        list(read_alpaca(bad))
