"""Templates and labels (golden), readers, length policy, bad input, cache, mixing, splits."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections import Counter
from pathlib import Path

import pytest

from memtune.config import ConfigError, DataConfig, DataSource, to_run_config
from memtune.data.cache import TokenizerFiles, load_split, preprocess, tokenizer_files_digest
from memtune.data.encode import (
    IGNORE_INDEX,
    DataStats,
    apply_length_policy,
    encode_records,
    load_tokenizer,
)
from memtune.data.readers import Record, read_source
from memtune.data.templates import render_prompt
from memtune.tools.tiny import synthesize
from tests.conftest import compose_cfg

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "你好"},
    {"role": "assistant", "content": "你好！"},
]


@pytest.fixture(scope="module")
def tokenizer():
    cfg = to_run_config(compose_cfg())
    synthesize(cfg.model.name_or_path, cfg.model.architecture)
    return load_tokenizer(cfg)


def _encode(tokenizer, messages, **data):
    cfg = DataConfig(path="unused", **data)
    return encode_records([Record("t", messages=messages)], tokenizer, cfg)[0]


def _label_spans(tokenizer, sample) -> list[str]:
    spans, current = [], []
    for t in sample.labels:
        if t == IGNORE_INDEX:
            if current:
                spans.append(tokenizer.decode(current))
            current = []
        else:
            current.append(t)
    if current:
        spans.append(tokenizer.decode(current))
    return spans


def test_chatml_multi_turn_golden(tokenizer) -> None:
    s = _encode(tokenizer, CONVERSATION)
    assert tokenizer.decode(s.input_ids) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>user\n你好<|im_end|>\n"
        "<|im_start|>assistant\n你好！<|im_end|>\n"
    )
    # Every assistant reply and the <|im_end|> closing it; nothing else.
    assert _label_spans(tokenizer, s) == ["4<|im_end|>", "你好！<|im_end|>"]
    im_start, im_end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert s.input_ids.count(im_start) == 5 and s.input_ids.count(im_end) == 5
    labelled_ends = [t for t in s.labels if t == im_end]
    assert len(labelled_ends) == 2
    # The token after each labelled <|im_end|> is the unlabelled "\n".
    ends = [i for i, t in enumerate(s.labels) if t == im_end]
    assert all(s.labels[i + 1] == IGNORE_INDEX for i in ends)
    assert tokenizer.pad_token_id not in s.input_ids


def test_plain_template_multi_turn_golden(tokenizer) -> None:
    s = _encode(tokenizer, CONVERSATION, template="plain")
    eos = tokenizer.eos_token
    assert tokenizer.decode(s.input_ids) == (
        "You are terse.\n\n"
        f"### 指令:\n2+2?\n\n### 回答:\n4{eos}\n\n"
        f"### 指令:\n你好\n\n### 回答:\n你好！{eos}"
    )
    assert _label_spans(tokenizer, s) == [f"4{eos}", f"你好！{eos}"]
    assert s.labels[-1] == tokenizer.eos_token_id


def test_train_on_prompt_labels_everything(tokenizer) -> None:
    s = _encode(tokenizer, CONVERSATION, train_on_prompt=True)
    assert s.labels == s.input_ids
    assert s.input_ids == _encode(tokenizer, CONVERSATION).input_ids


def test_system_prompt_is_explicit(tokenizer) -> None:
    no_system = CONVERSATION[1:3]
    plain = tokenizer.decode(_encode(tokenizer, no_system).input_ids)
    assert "system" not in plain  # nothing injected by default
    given = tokenizer.decode(_encode(tokenizer, no_system, system_prompt="Be kind.").input_ids)
    assert given.startswith("<|im_start|>system\nBe kind.<|im_end|>\n<|im_start|>user")
    # A record's own system message wins over the config's.
    own = tokenizer.decode(_encode(tokenizer, CONVERSATION, system_prompt="Be kind.").input_ids)
    assert "Be kind." not in own and "You are terse." in own


@pytest.mark.parametrize("template", ["chatml", "plain"])
def test_generation_prompt_matches_training_tokens(tokenizer, template: str) -> None:
    s = _encode(tokenizer, CONVERSATION, template=template)
    prompt = render_prompt(CONVERSATION[:-1], template, tokenizer.eos_token)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    assert s.input_ids[: len(prompt_ids)] == prompt_ids
    assert s.labels[len(prompt_ids) - 1] == IGNORE_INDEX
    assert s.labels[len(prompt_ids)] != IGNORE_INDEX


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return path


def _records(path: Path | str, fmt: str) -> list[Record]:
    out = list(read_source(str(path), fmt))
    assert all(isinstance(r, Record) for r in out), out
    return out  # type: ignore[return-value]


def test_alpaca_with_system_and_history(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "a.jsonl",
        [
            {
                "instruction": "and 3+3?",
                "input": "",
                "output": "6",
                "system": "math",
                "history": [["2+2?", "4"]],
            }
        ],
    )
    (rec,) = _records(path, "alpaca")
    assert [m["role"] for m in rec.messages or []] == [
        "system",
        "user",
        "assistant",
        "user",
        "assistant",
    ]
    assert (rec.messages or [])[3]["content"] == "and 3+3?"


def test_messages_and_sharegpt_read_the_same(tmp_path: Path) -> None:
    openai = _write(
        tmp_path / "m.jsonl",
        [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}],
    )
    sharegpt = _write(
        tmp_path / "s.jsonl",
        [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}],
    )
    assert _records(openai, "messages")[0].messages == _records(sharegpt, "messages")[0].messages


def test_either_key_style_under_either_field_name(tmp_path: Path) -> None:
    """The key style is each message list's own (its first turn's keys), as the preference
    reader reads it: "conversations" with role / content keys was refused with "field
    'conversations[0].from' is None; expected one of ...", and "messages" with from / value."""
    openai = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    sharegpt = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]
    rows = [{"conversations": openai}, {"messages": sharegpt}, {"messages": openai}]
    got = [r.messages for r in _records(_write(tmp_path / "m.jsonl", rows), "messages")]
    assert got == [openai, openai, openai]


def test_sharegpt_system_field_is_the_system_prompt(tokenizer, tmp_path: Path) -> None:
    """ShareGPT's (LLaMA-Factory's) top-level ``system`` is the record's system prompt, as the
    alpaca reader's is: it was dropped without a word. The record's wins over data.system_prompt."""
    turns = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]
    path = _write(tmp_path / "s.jsonl", [{"system": "You are a pirate.", "conversations": turns}])
    (rec,) = _records(path, "messages")
    assert rec.messages == [
        {"role": "system", "content": "You are a pirate."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
    ]
    text = tokenizer.decode(_encode(tokenizer, rec.messages, system_prompt="Be kind.").input_ids)
    assert text.startswith("<|im_start|>system\nYou are a pirate.<|im_end|>\n<|im_start|>user")
    assert "Be kind." not in text


def test_parquet_json_array_and_dataset_dir(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets import Dataset

    rows = [{"instruction": f"q{i}", "input": "", "output": f"a{i}"} for i in range(3)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    (tmp_path / "d.json").write_text(json.dumps(rows))
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    expected = _records(_write(tmp_path / "d.jsonl", rows), "alpaca")
    for source in ("d.parquet", "d.json", "ds"):
        got = _records(tmp_path / source, "alpaca")
        assert [r.messages for r in got] == [r.messages for r in expected], source


def test_text_format_labels_every_token(tokenizer, tmp_path: Path) -> None:
    path = _write(tmp_path / "t.jsonl", [{"text": "Once upon a time."}])
    (rec,) = _records(path, "text")
    s = encode_records([rec], tokenizer, DataConfig(path=str(path), format="text"))[0]
    assert s.labels == s.input_ids
    assert tokenizer.decode(s.input_ids) == "Once upon a time." + tokenizer.eos_token


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("lines", "fmt", "message"),
    [
        (
            ['{"instruction": "a", "output": "b"}', '{"instruction": "a", "output"'],
            "alpaca",
            r"d\.jsonl:2: invalid JSON \(Expecting .:. delimiter, column 30\)",  # where it was cut
        ),
        (['{"instruction": "a"}'], "alpaca", r"d\.jsonl:1: field 'output' is missing"),
        (
            ['{"instruction": 3, "output": "b"}'],
            "alpaca",
            r"d\.jsonl:1: field 'instruction' is a int, not a string",
        ),
        (
            ['{"instruction": "a", "output": "  "}'],
            "alpaca",
            r"d\.jsonl:1: assistant reply 0 is empty",
        ),
        (['["a", "b"]'], "alpaca", r"d\.jsonl:1: expected an object, got a list"),
        (
            ['{"messages": [{"role": "user", "content": "hi"}]}'],
            "messages",
            r"d\.jsonl:1: the last turn is not an assistant reply",
        ),
        (
            ['{"messages": [{"role": "robot", "content": "hi"}]}'],
            "messages",
            r"d\.jsonl:1: field 'messages\[0\]\.role' is 'robot'",
        ),
        (
            ['{"conversations": [{"from": "gpt", "value": "x"}]}'],
            "messages",
            r"d\.jsonl:1: turn 0 is 'assistant', expected 'user'",
        ),
        (
            [
                '{"system": "s", "conversations": [{"from": "system", "value": "t"}, '
                '{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}'
            ],
            "messages",
            r"d\.jsonl:1: field 'system' is set and field 'conversations' has a system turn too",
        ),
        (
            ['{"messages": [{"role": "user", "content": "hi"}, {"from": "gpt", "value": "yo"}]}'],
            "messages",
            r"d\.jsonl:1: field 'messages\[1\]' has ShareGPT's from / value keys and field "
            r"'messages\[0\]' OpenAI's role / content: a message list keeps one key style",
        ),
        (
            ['{"messages": [{"speaker": "user", "content": "hi"}]}'],
            "messages",
            r"d\.jsonl:1: field 'messages\[0\]\.role' is missing: a turn has OpenAI's role / "
            "content keys or ShareGPT's from / value",
        ),
        (
            [
                '{"conversations": [{"from": "human", "value": "2+2?"}, {"from": "function_call", '
                '"value": "{}"}, {"from": "observation", "value": "4"}, {"from": "gpt", '
                '"value": "4"}]}'
            ],
            "messages",
            r"d\.jsonl:1: field 'conversations\[1\]\.value\.name' is missing or not a "
            "non-empty string",
        ),
        (
            [
                '{"messages": [{"role": "user", "content": "2+2?"}, {"role": "tool", "content": '
                '"4"}, {"role": "assistant", "content": "4"}]}'
            ],
            "messages",
            r"d\.jsonl:1: turn 1 is 'user' \(tool results\), expected 'assistant' \(turns "
            r"alternate user / assistant after an optional system message; a tool's results "
            "follow its call",
        ),
        (['{"text": ""}'], "text", r"d\.jsonl:1: field 'text' is empty"),
        (  # another format's record: named, and no advice to skip (it would skip them all)
            ['{"conversations": [{"from": "human", "value": "hi"}]}'],
            "alpaca",
            r"d\.jsonl:1: a messages record \(it has 'conversations'\), read as "
            r"data\.format=alpaca: set data\.format=messages$",
        ),
        (
            ['{"prompt": "p", "chosen": "a", "rejected": "b"}'],
            "messages",
            r"d\.jsonl:1: a preference record \(it has 'chosen', 'rejected'\), read as "
            r"data\.format=messages: set data\.format=preference$",
        ),
        (  # LLaMA-Factory's preference records carry 'conversations' too: preference first
            ['{"conversations": [{"from": "human", "value": "hi"}], "chosen": {}, "rejected": {}}'],
            "alpaca",
            r"d\.jsonl:1: a preference record \(it has 'chosen', 'rejected'\)",
        ),
        (  # after a record read well, one of another shape is a stray: skipping it is advised
            ['{"instruction": "a", "output": "b"}', '{"text": "x"}'],
            "alpaca",
            r"d\.jsonl:2: field 'instruction' is missing \(the record has text's 'text'\) "
            r"\(data\.on_bad_record=skip would skip",
        ),
    ],
)
def test_bad_records_stop_with_file_line_field(
    tokenizer, tmp_path: Path, lines: list[str], fmt: str, message: str
) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(lines) + "\n")
    cfg = DataConfig(path=str(path), format=fmt, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ConfigError, match=message):
        preprocess(cfg, tokenizer, seed=0)


def test_undecodable_bytes_name_the_line(tokenizer, tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_bytes(
        b'{"instruction": "a", "output": "b"}\n{"instruction": "\xff", "output": "b"}\n'
    )
    cfg = DataConfig(path=str(path), cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ConfigError, match=r"d\.jsonl:2: not UTF-8"):
        preprocess(cfg, tokenizer, seed=0)


def test_unreadable_file(tokenizer, tmp_path: Path) -> None:
    (tmp_path / "dangling.jsonl").symlink_to(tmp_path / "nowhere.jsonl")
    cfg = DataConfig(path=str(tmp_path / "dangling.jsonl"), cache_dir=str(tmp_path / "c"))
    with pytest.raises(ConfigError, match=r"dangling\.jsonl: cannot read"):
        preprocess(cfg, tokenizer, seed=0)


def _refusal(tokenizer, tmp_path: Path, path: Path, fmt: str = "alpaca") -> str:
    """The ConfigError's line for data.path=``path`` (train.py prints it after "memtune: config
    error: ")."""
    cfg = DataConfig(path=str(path), format=fmt, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ConfigError) as err:
        preprocess(cfg, tokenizer, seed=0)
    return str(err.value)


def test_names_of_hub_datasets() -> None:
    """What reads as a Hugging Face dataset (OWNER/NAME[:SPLIT]) and what as a file not there."""
    from memtune.paths import hub_dataset

    assert hub_dataset("HuggingFaceH4/ultrafeedback_binarized:train_prefs") == (
        "HuggingFaceH4/ultrafeedback_binarized",
        "train_prefs",
    )
    assert hub_dataset("owner/data.v2") == ("owner/data.v2", "train")
    assert hub_dataset("imdb") == ("imdb", "train")
    for a_file in ["data/train.jsonl", "train.json", "a/b/c", "x.jsonl.gz", "./x", "/x", "~/x"]:
        assert hub_dataset(a_file) is None, a_file
    from memtune.data.readers import COMPRESSED
    from memtune.paths import COMPRESSED_SUFFIXES

    assert {suffix for _, suffix, _ in COMPRESSED.values()} == set(COMPRESSED_SUFFIXES)


def test_a_name_whose_first_folder_is_here_is_a_path(tmp_path: Path, monkeypatch) -> None:
    """data/trian (a save_to_disk folder's typo) with a folder data/ here is a file not there,
    not the hub dataset data/trian; data.val_path reads hub names as data.path does."""
    from memtune.config import ConfigError, compose, to_run_config, validate
    from memtune.paths import hub_dataset

    monkeypatch.chdir(tmp_path)
    assert hub_dataset("data/trian") == ("data/trian", "train")
    (tmp_path / "data").mkdir()
    assert hub_dataset("data/trian") is None
    cfg = to_run_config(compose(["data.path=data/trian"]))
    with pytest.raises(ConfigError, match=r"^data\.path='data/trian': no such file or folder$"):
        validate(cfg)
    (tmp_path / "train.jsonl").write_text('{"instruction": "q", "output": "a"}\n')
    hub_val = ["data.path=train.jsonl", "data.val_path=someone/pairs:test_prefs"]
    validate(to_run_config(compose(hub_val)))  # a hub split as the validation data: no refusal


def test_a_cached_hub_dataset_is_left_to_datasets(monkeypatch, tmp_path: Path) -> None:
    """Where the hub cannot be reached, a dataset in datasets' caches is not refused: datasets
    reads its copy (after its retries), as it did before the hub was probed."""
    import datasets.config
    import huggingface_hub.constants

    from memtune.data.cache import _dataset_cached

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")
    assert not _dataset_cached("someone/data:train_prefs")
    (tmp_path / "hub" / "datasets--someone--data").mkdir(parents=True)
    assert _dataset_cached("someone/data:train_prefs")
    assert not _dataset_cached("other/data")
    (tmp_path / "datasets" / "other___data").mkdir(parents=True)
    assert _dataset_cached("other/data")


@pytest.mark.parametrize("offline", [False, True])
def test_a_hub_dataset_that_cannot_be_loaded_is_one_line(tmp_path: Path, offline: bool) -> None:
    """A hub name where the hub cannot be reached (HF_ENDPOINT at a closed port: the same on
    every machine), and with HF_HUB_OFFLINE set and nothing cached: exit 2 and one line, at
    once. Before: datasets' retries (~30 s), then its ConnectionError as a traceback (exit 1)."""
    import os

    from tests.conftest import run_train_py

    env = {**os.environ, "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf")}
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HTTPS_PROXY", "HTTP_PROXY"):
        for var in (name, name.lower()):  # a proxy would be asked, not the closed port
            env.pop(var, None)
    env.pop("ALL_PROXY", None)
    env.pop("all_proxy", None)
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    args = ["preprocess_only=true", "data.path=someone/no-such-data:train_prefs"]
    args += [f"data.cache_dir={tmp_path / 'cache'}", f"run_dir={tmp_path / 'run'}"]
    proc = run_train_py(args, cwd=tmp_path, timeout=300, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    error = proc.stderr.strip().splitlines()[-1]
    start = "memtune: config error: someone/no-such-data:train_prefs: no such file or folder "
    if offline:
        assert error.startswith(
            start + "on this machine, and datasets could not load it as a Hugging Face "
            "dataset, split 'train_prefs' (ConnectionError: "
        ), error
    else:
        assert error == (
            start + "on this machine, and it cannot be loaded as a Hugging Face dataset: "
            "http://127.0.0.1:9 cannot be reached from this machine ([Errno 111] Connection "
            "refused); give a file's path, or, where the dataset is in datasets' cache, set "
            "HF_HUB_OFFLINE=1 to read it from there"
        )
    cache = tmp_path / "cache"
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == []  # no entry


def test_a_damaged_parquet_file_is_one_line(tokenizer, tmp_path: Path) -> None:
    """Before: pyarrow's ArrowInvalid traceback ("Parquet magic bytes not found in footer")."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"instruction": f"q{i}", "input": "", "output": f"a{i}"} for i in range(20)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "whole.parquet")
    cut = tmp_path / "cut.parquet"
    cut.write_bytes((tmp_path / "whole.parquet").read_bytes()[:-100])
    assert _refusal(tokenizer, tmp_path, cut) == (
        f"{cut}: cannot be read as parquet (Parquet magic bytes not found in footer. Either the "
        "file is corrupted or this is not a parquet file): it is cut short or not a parquet "
        "file; write it again (or copy it whole), or give a .jsonl or .json file"
    )
    text = _write(tmp_path / "text.parquet", rows[:1])  # JSON Lines under a parquet name
    assert _refusal(tokenizer, tmp_path, text).startswith(
        f"{text}: cannot be read as parquet (Parquet magic bytes not found in footer"
    )


def test_a_folder_that_is_not_a_whole_dataset_is_one_line(tokenizer, tmp_path: Path) -> None:
    """Before: FileNotFoundError tracebacks from datasets' load_from_disk."""
    from datasets import Dataset

    rows = [{"instruction": f"q{i}", "input": "", "output": f"a{i}"} for i in range(3)]
    ds = tmp_path / "ds"
    Dataset.from_list(rows).save_to_disk(str(ds))
    (arrow,) = ds.glob("*.arrow")
    arrow.unlink()
    assert _refusal(tokenizer, tmp_path, ds) == (
        f"{ds}: the datasets folder is incomplete: {arrow} is missing; save it again with "
        "save_to_disk, or copy the folder whole"
    )
    emptied = tmp_path / "emptied"  # a state.json without what datasets reads (KeyError)
    emptied.mkdir()
    (emptied / "state.json").write_text("{}\n")
    (emptied / "dataset_info.json").write_text("{}\n")
    assert _refusal(tokenizer, tmp_path, emptied) == (
        f"{emptied}: the datasets folder cannot be read (KeyError: '_data_files'); save it "
        "again with save_to_disk"
    )
    named_like_a_file = tmp_path / "x.jsonl"
    named_like_a_file.mkdir()
    assert _refusal(tokenizer, tmp_path, named_like_a_file) == (
        f"{named_like_a_file}: a folder, and not one written by datasets' save_to_disk (it is "
        "empty; no state.json or dataset_dict.json): give a .jsonl, .json or .parquet file, or "
        "such a folder (several files: data.sources)"
    )
    files = tmp_path / "files"
    files.mkdir()
    _write(files / "a.jsonl", rows)
    _write(files / "b.jsonl", rows)
    assert (
        f"{files}: a folder, and not one written by datasets' save_to_disk (it holds "
        "a.jsonl, b.jsonl; no state.json" in _refusal(tokenizer, tmp_path, files)
    )


def test_a_compressed_file_is_named_as_compressed(tokenizer, tmp_path: Path) -> None:
    """Before: a .jsonl.gz was "d.jsonl.gz:1: not UTF-8 (byte 1)"."""
    import gzip

    rows = [{"instruction": "q", "input": "", "output": "a"}]
    gz = tmp_path / "d.jsonl.gz"
    gz.write_bytes(gzip.compress(_write(tmp_path / "d.jsonl", rows).read_bytes()))
    assert _refusal(tokenizer, tmp_path, gz) == (
        f"{gz}: the file is gzip-compressed, and memtune reads .jsonl and .json files "
        "uncompressed: decompress it (gzip -dc d.jsonl.gz > d.jsonl) and give that file"
    )
    array = tmp_path / "d.json"  # a .json array, compressed under its plain name
    array.write_bytes(gzip.compress(json.dumps(rows).encode()))
    assert _refusal(tokenizer, tmp_path, array).startswith(
        f"{array}: the file is gzip-compressed, and memtune reads .jsonl and .json files "
        "uncompressed: decompress it (gzip -dc d.json > d.uncompressed.json)"
    )


def test_a_bad_source_of_records_with_images_is_one_line(tokenizer, tmp_path: Path) -> None:
    """The cache key parses a source that mentions images for their files: a source that cannot
    be read as a whole is left to the build's line, not raised from the key (a traceback)."""
    path = tmp_path / "d.json"
    path.write_text(json.dumps({"messages": [], "images": ["image.png"]}))
    assert _refusal(tokenizer, tmp_path, path, "messages") == (
        f"{path}: expected a JSON array of records (or use .jsonl)"
    )


def test_skip_counts_and_reports_bad_records(tokenizer, tmp_path: Path) -> None:
    good = {"instruction": "q", "input": "", "output": "a"}
    path = tmp_path / "d.jsonl"
    path.write_text(
        "\n".join([json.dumps(good), "{oops", json.dumps({"instruction": "q"}), json.dumps(good)])
        + "\n"
    )
    cfg = DataConfig(path=str(path), on_bad_record="skip", cache_dir=str(tmp_path / "cache"))
    prepared = preprocess(cfg, tokenizer, seed=0)
    assert prepared.train.skipped_bad == 2 and prepared.train.samples == 2
    assert prepared.train.bad_examples[0].startswith(f"{path}:2: invalid JSON")
    assert prepared.train.bad_examples[1].startswith(f"{path}:3: field 'output'")
    assert f"; skipped 2 bad records (first: {path}:2: invalid JSON" in prepared.train.line()
    one = dataclasses.replace(prepared.train, skipped_bad=1)
    assert "; skipped 1 bad record (first: " in one.line()


def test_empty_after_filtering_is_an_error(tokenizer, tmp_path: Path) -> None:
    """Before: "... truncated 0, dropped 0 over-long + 3 without labels)": the records cut to
    max_seq_len were counted as if they had no labels to begin with, and the line never named
    data.max_seq_len."""
    path = _write(tmp_path / "d.jsonl", [{"instruction": "long " * 50, "output": "a"}] * 3)
    cfg = DataConfig(path=str(path), max_seq_len=16, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ConfigError) as err:
        preprocess(cfg, tokenizer, seed=0)
    assert str(err.value) == (
        "data: no usable training samples left (0 samples from 3 records, 0 tokens (0 labels); "
        "truncated 0, dropped 0 over-long + 0 without labels + 3 truncated to "
        "data.max_seq_len=16 with no label left): 3 samples are longer than "
        "data.max_seq_len=16 (3 with the prompt alone filling it); raise data.max_seq_len"
    )
    cfg = dataclasses.replace(cfg, overlong="drop")
    with pytest.raises(ConfigError) as err:
        preprocess(cfg, tokenizer, seed=0)
    assert str(err.value).endswith(
        "truncated 0, dropped 3 over-long + 0 without labels): 3 samples are longer than "
        "data.max_seq_len=16 (3 dropped by data.overlong=drop); raise data.max_seq_len"
    )


def test_a_split_cut_to_no_labels_is_counted_as_cut(tokenizer, tmp_path: Path) -> None:
    """Some records cut to no labels, some kept: the line and data.json's counts (as_dict) put
    the cut ones in their own bucket, named with data.max_seq_len."""
    rows = [{"instruction": "long " * 50, "output": "a"}] * 2 + [
        {"instruction": "q", "output": "a"}
    ]
    cfg = DataConfig(
        path=str(_write(tmp_path / "d.jsonl", rows)),
        max_seq_len=16,
        cache_dir=str(tmp_path / "cache"),
    )
    stats = preprocess(cfg, tokenizer, seed=0).train
    assert stats.line().endswith(
        "truncated 0, dropped 0 over-long + 0 without labels + 2 truncated to "
        "data.max_seq_len=16 with no label left"
    )
    counts = stats.as_dict()
    assert (counts["truncated_no_labels"], counts["dropped_no_labels"], counts["samples"]) == (
        2,
        0,
        1,
    )
    assert counts["max_seq_len"] == 16
    assert preprocess(cfg, tokenizer, seed=0).train == stats  # reused: the same counts


def test_bad_data_stops_train_py_before_launch(tmp_path: Path) -> None:
    from tests.conftest import run_train_py

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"instruction": "a", "output": "b"}\n{"instruction": "a"}\n')
    proc = run_train_py([f"data.path={bad}", f"run_dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert proc.returncode == 2
    assert f"{bad}:2: field 'output' is missing" in proc.stderr
    assert not (tmp_path / "run" / "launch.txt").exists()


# ---------------------------------------------------------------- length, cache, mixing, split


def test_truncate_and_drop_are_counted(tokenizer) -> None:
    short = Record(
        "s", messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    )
    long_reply = Record(
        "l",
        messages=[
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "word " * 40},
        ],
    )
    long_prompt = Record(
        "p",
        messages=[
            {"role": "user", "content": "word " * 40},
            {"role": "assistant", "content": "ok"},
        ],
    )
    for overlong, expected in (("truncate", (1, 0, 1, 0, 2)), ("drop", (0, 2, 0, 0, 1))):
        cfg = DataConfig(path="x", max_seq_len=24, overlong=overlong)
        stats = DataStats()
        kept = apply_length_policy(
            encode_records([short, long_reply, long_prompt], tokenizer, cfg), cfg, stats
        )
        got = (
            stats.truncated,
            stats.dropped_overlong,
            stats.truncated_no_labels,
            stats.dropped_no_labels,
            len(kept),
        )
        assert got == expected, overlong
        assert all(len(s.input_ids) <= 24 for s in kept)


def test_cache_is_reused_and_invalidated(tokenizer, tmp_path: Path) -> None:
    rows = [{"instruction": f"q{i}", "input": "", "output": f"a{i}"} for i in range(10)]
    path = _write(tmp_path / "d.jsonl", rows)
    cfg = DataConfig(path=str(path), cache_dir=str(tmp_path / "cache"))
    first = preprocess(cfg, tokenizer, seed=0)
    assert not first.reused and first.train.samples == 10
    second = preprocess(cfg, tokenizer, seed=0)
    assert second.reused and second.dir == first.dir
    assert load_split(second.dir).input_ids.equal(load_split(first.dir).input_ids)

    _write(path, rows[:9])  # a changed file
    third = preprocess(cfg, tokenizer, seed=0)
    assert not third.reused and third.dir != first.dir and third.train.samples == 9
    cfg.max_seq_len = 64  # a changed setting
    assert preprocess(cfg, tokenizer, seed=0).dir not in (first.dir, third.dir)


def test_a_cached_launch_knows_the_tokenizer_by_its_files(tokenizer, tmp_path: Path) -> None:
    """The launcher keys the cache on the tokenizer's files and loads it only to build: the
    second launch reuses the cache without loading it; a changed tokenizer file is a new key,
    the weights are not part of it, and a hub name that is not downloaded has no digest."""
    model_dir = tmp_path / "model"
    shutil.copytree(Path(tokenizer.name_or_path), model_dir)
    rows = [{"instruction": f"q{i}", "input": "", "output": f"a{i}"} for i in range(10)]
    cfg = DataConfig(path=str(_write(tmp_path / "d.jsonl", rows)), cache_dir=str(tmp_path / "c"))
    loads = []

    def files() -> TokenizerFiles:
        digest = tokenizer_files_digest(str(model_dir))
        assert digest is not None
        return TokenizerFiles(digest, lambda: loads.append(1) or tokenizer)

    first = preprocess(cfg, files(), seed=0)
    assert not first.reused and loads == [1] and first.train.samples == 10
    again = preprocess(cfg, files(), seed=0)
    assert again.reused and again.dir == first.dir and loads == [1]  # not loaded

    digest = tokenizer_files_digest(str(model_dir))
    (model_dir / "model.safetensors").write_bytes(b"other weights")
    assert tokenizer_files_digest(str(model_dir)) == digest
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (model_dir / "tokenizer_config.json").write_text(json.dumps({**config, "x": 1}))
    assert tokenizer_files_digest(str(model_dir)) != digest
    assert preprocess(cfg, files(), seed=0).dir != first.dir and loads == [1, 1]
    assert tokenizer_files_digest("nobody/not-downloaded-model") is None


def test_sources_mix_by_weight(tokenizer, tmp_path: Path) -> None:
    a = _write(tmp_path / "a.jsonl", [{"instruction": f"a{i}", "output": "x"} for i in range(10)])
    b = _write(tmp_path / "b.jsonl", [{"instruction": f"b{i}", "output": "y"} for i in range(40)])
    cfg = DataConfig(
        sources=[DataSource(str(a), weight=2.0), DataSource(str(b), weight=0.5)],
        cache_dir=str(tmp_path / "cache"),
    )
    prepared = preprocess(cfg, tokenizer, seed=0)
    assert prepared.train.samples == 20 + 20
    texts = [tokenizer.decode(s.input_ids) for s in load_split(prepared.dir)]
    assert sum("user\na" in t for t in texts) == 20 and sum("user\nb" in t for t in texts) == 20
    # 2.0 repeats every record of a twice; 0.5 keeps 20 distinct records of b. (The counts alone
    # held with a's 20 and b's 20 drawn with replacement: some records 3 times, some never.)
    seen = Counter(t.split("user\n", 1)[1].split("<|im_end|>", 1)[0] for t in texts)
    assert {k: n for k, n in seen.items() if k[0] == "a"} == {f"a{i}": 2 for i in range(10)}
    assert [n for k, n in seen.items() if k[0] == "b"] == [1] * 20


def test_validation_split_by_fraction_and_by_file(tokenizer, tmp_path: Path) -> None:
    rows = [{"instruction": f"q{i}", "output": f"a{i}"} for i in range(20)]
    path = _write(tmp_path / "d.jsonl", rows)
    cfg = DataConfig(path=str(path), val_fraction=0.25, cache_dir=str(tmp_path / "cache"))
    prepared = preprocess(cfg, tokenizer, seed=0)
    assert prepared.val is not None
    assert (prepared.train.samples, prepared.val.samples) == (15, 5)
    train_text = {tokenizer.decode(s.input_ids) for s in load_split(prepared.dir, "train")}
    val_text = {tokenizer.decode(s.input_ids) for s in load_split(prepared.dir, "val")}
    assert not train_text & val_text

    val_file = _write(tmp_path / "v.jsonl", rows[:3])
    cfg = DataConfig(path=str(path), val_path=str(val_file), cache_dir=str(tmp_path / "cache"))
    prepared = preprocess(cfg, tokenizer, seed=0)
    assert prepared.val is not None and (prepared.train.samples, prepared.val.samples) == (20, 3)


def test_validation_split_is_taken_before_the_weights(tokenizer, tmp_path: Path) -> None:
    """A weight of 2.0 repeats each record; the split came after the repeating, so copies of
    one record landed on both sides (6 of 8 validation records were also trained on)."""
    a = _write(tmp_path / "a.jsonl", [{"instruction": f"a{i}", "output": "x"} for i in range(20)])
    b = _write(tmp_path / "b.jsonl", [{"instruction": f"b{i}", "output": "y"} for i in range(8)])
    for weights in ((2.0, 1.0), (1.5, 0.5)):
        sources = [DataSource(str(a), weight=weights[0]), DataSource(str(b), weight=weights[1])]
        cfg = DataConfig(sources=sources, val_fraction=0.25, cache_dir=str(tmp_path / "cache"))
        prepared = preprocess(cfg, tokenizer, seed=0)
        assert prepared.val is not None and prepared.val.samples == 7  # 25% of the 28 read
        train = [tokenizer.decode(s.input_ids) for s in load_split(prepared.dir, "train")]
        val = [tokenizer.decode(s.input_ids) for s in load_split(prepared.dir, "val")]
        assert len(set(val)) == 7 and not set(train) & set(val), weights
        # The weights apply to what is left: each remaining record of a, twice (or 1.5×).
        left_a = 20 - sum("user\na" in t for t in val)
        repeated = left_a * int(weights[0]) + round((weights[0] % 1) * left_a)
        assert sum("user\na" in t for t in train) == repeated, weights


def test_the_seed_is_in_the_cache_key_only_where_it_draws(tokenizer, tmp_path: Path) -> None:
    """trainer.seed changes the stored data only through the validation split and fractional
    weights: another seed rebuilt an identical entry; and memtune's own rendering code is in
    the key, so an upgrade that renders differently does not reuse what it would not write."""
    from memtune.data.cache import CODE_FILES, code_digest, fingerprint

    path = _write(tmp_path / "d.jsonl", [{"instruction": "q", "output": "a"}] * 4)
    plain = DataConfig(path=str(path))
    assert fingerprint(plain, tokenizer, 0) == fingerprint(plain, tokenizer, 1)
    split = DataConfig(path=str(path), val_fraction=0.25)
    assert fingerprint(split, tokenizer, 0) != fingerprint(split, tokenizer, 1)
    thinned = DataConfig(sources=[DataSource(str(path), weight=0.5)])
    assert fingerprint(thinned, tokenizer, 0) != fingerprint(thinned, tokenizer, 1)
    doubled = DataConfig(sources=[DataSource(str(path), weight=2.0)])
    assert fingerprint(doubled, tokenizer, 0) == fingerprint(doubled, tokenizer, 1)
    import memtune.data.cache as cache_module

    here = Path(cache_module.__file__).parent
    assert all((here / name).is_file() for name in CODE_FILES) and len(code_digest()) == 16


def test_eos_stays_a_label_when_pad_equals_eos(tokenizer) -> None:
    """The classic bug: masking every pad-id token also masks eos when they share an id."""
    import copy

    from memtune.data.batching import collate_padded

    tok = copy.deepcopy(tokenizer)
    tok.pad_token = tok.eos_token
    assert tok.pad_token_id == tok.eos_token_id
    short = _encode(tok, CONVERSATION[1:3], template="plain")
    long = _encode(tok, CONVERSATION, template="plain")
    batch = collate_padded([short, long], pad_token_id=tok.pad_token_id)
    n = len(short.input_ids)
    assert batch["labels"][0, n - 1] == tok.eos_token_id  # the reply's eos: a target
    assert (batch["labels"][0, n:] == IGNORE_INDEX).all()  # the padding after it: not


def test_skipped_records_examples_show_every_kind_as_room_allows() -> None:
    """data.on_bad_record=skip prints five examples: they were the first five, so when the
    parser's complaints came first (seven records without messages), the images that could
    not be decoded later were counted and never shown."""
    from memtune.data.cache import MAX_BAD_EXAMPLES, _bad_record
    from memtune.data.encode import DataStats
    from memtune.data.readers import RecordError

    cfg, stats = DataConfig(on_bad_record="skip"), DataStats()
    for line in range(1, 8):
        _bad_record(RecordError(f"d.jsonl:{line}", "no 'messages' list"), cfg, stats)
    for line in (8, 9):
        _bad_record(RecordError(f"d.jsonl:{line}", f"image 'im{line}.png': truncated"), cfg, stats)
    _bad_record(RecordError("d.jsonl:10", "role 'bot' is not one of user, assistant"), cfg, stats)
    assert stats.skipped_bad == 10 and len(stats.bad_examples) == MAX_BAD_EXAMPLES
    assert stats.bad_examples[:3] == [f"d.jsonl:{n}: no 'messages' list" for n in (1, 2, 3)]
    assert stats.bad_examples[3:] == [
        "d.jsonl:8: image 'im8.png': truncated",  # the second image is the same kind: not shown
        "d.jsonl:10: role 'bot' is not one of user, assistant",
    ]
