"""Preference data (format preference): reading every record shape, the pair's tokens and
labels (golden, real Qwen tokenizer), the pair's length policy, bad records, the cache's
splits, config validation and the bundled demo set."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from memtune.config import ConfigError, DataConfig, DataSource, to_run_config, validate
from memtune.data.cache import load_split, preprocess
from memtune.data.encode import (
    IGNORE_INDEX,
    DataStats,
    Sample,
    apply_length_policy,
    encode_records,
    load_tokenizer,
    n_labels,
    pair_halves,
    pair_lengths,
)
from memtune.data.readers import Record, read_source
from memtune.paths import ASSETS_DIR
from memtune.tools.tiny import synthesize
from tests.conftest import ROOT, compose_cfg
from tests.test_data import _label_spans, _write

HISTORY = [
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "hello"},
    {"role": "user", "content": "2+2?"},
]
CHOSEN = {"role": "assistant", "content": "4"}
REJECTED = {"role": "assistant", "content": "22"}


@pytest.fixture(scope="module")
def tokenizer():
    cfg = to_run_config(compose_cfg())
    synthesize(cfg.model.name_or_path, cfg.model.architecture)
    return load_tokenizer(cfg)


def _pairs(path: Path | str) -> list[Record]:
    out = list(read_source(str(path), "preference"))
    assert all(isinstance(r, Record) and r.pair for r in out), out
    return out  # type: ignore[return-value]


def _halves(tokenizer, sample: Sample) -> list[tuple[str, list[str]]]:
    """(text, label spans) of the chosen sequence, then of the rejected one."""
    return [
        (tokenizer.decode(s.input_ids), _label_spans(tokenizer, s)) for s in pair_halves(sample)
    ]


# ---------------------------------------------------------------- reading


def test_every_record_shape_reads_into_the_same_pair(tmp_path: Path) -> None:
    def sharegpt(messages: list[dict[str, str]]) -> list[dict[str, str]]:
        names = {"user": "human", "assistant": "gpt"}
        return [{"from": names[m["role"]], "value": m["content"]} for m in messages]

    rows = [
        # implicit prompt: two whole conversations
        {"chosen": [*HISTORY, CHOSEN], "rejected": [*HISTORY, REJECTED]},
        # ... in ShareGPT's keys
        {"chosen": sharegpt([*HISTORY, CHOSEN]), "rejected": sharegpt([*HISTORY, REJECTED])},
        # explicit prompt: a message list, and the replies as message lists or strings
        {"prompt": HISTORY, "chosen": [CHOSEN], "rejected": [REJECTED]},
        {"prompt": sharegpt(HISTORY), "chosen": "4", "rejected": "22"},
        # a string prompt next to whole conversations (ultrafeedback_binarized): not read
        {"prompt": "2+2?", "chosen": [*HISTORY, CHOSEN], "rejected": [*HISTORY, REJECTED]},
        # LLaMA-Factory's ShareGPT preference shape: the prompt's turns, then one reply each
        {
            "conversations": sharegpt(HISTORY),
            "chosen": sharegpt([CHOSEN])[0],
            "rejected": sharegpt([REJECTED])[0],
        },
        # ... and its alpaca one (history as [user, assistant] pairs)
        {
            "instruction": "2+2?",
            "history": [["hi", "hello"]],
            "chosen": "4",
            "rejected": "22",
        },
    ]
    path = _write(tmp_path / "p.jsonl", rows)
    pairs = [r.pair for r in _pairs(path)]
    assert pairs == [(HISTORY, CHOSEN, REJECTED)] * len(rows)


def test_string_pair_with_system_and_reasoning(tmp_path: Path) -> None:
    thought = {**CHOSEN, "reasoning_content": "two and two"}
    rows = [
        {"prompt": "2+2?", "chosen": "4", "rejected": "22", "system": "Be terse."},
        {"prompt": [HISTORY[2]], "chosen": [thought], "rejected": "22"},
    ]
    first, second = _pairs(_write(tmp_path / "p.jsonl", rows))
    system = {"role": "system", "content": "Be terse."}
    assert first.pair == ([system, HISTORY[2]], CHOSEN, REJECTED)
    assert second.pair == ([HISTORY[2]], thought, REJECTED)
    assert first.conversations() == ([system, HISTORY[2], CHOSEN], [system, HISTORY[2], REJECTED])


def test_parquet_and_dataset_dir_pairs(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets import Dataset

    rows = [{"chosen": [*HISTORY, CHOSEN], "rejected": [*HISTORY, REJECTED]}] * 2
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    for source in ("p.parquet", "ds"):
        assert [r.pair for r in _pairs(tmp_path / source)] == [(HISTORY, CHOSEN, REJECTED)] * 2


# ---------------------------------------------------------------- tokens and labels


def _encode_pair(tokenizer, prompt, chosen, rejected, **data) -> Sample:
    cfg = DataConfig(path="unused", format="preference", **data)
    (sample,) = encode_records([Record("t", pair=(prompt, chosen, rejected))], tokenizer, cfg)
    return sample


def test_string_pair_golden(tokenizer) -> None:
    system = {"role": "system", "content": "Be terse."}
    s = _encode_pair(tokenizer, [system, HISTORY[2]], CHOSEN, REJECTED)
    prompt = "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
    assert _halves(tokenizer, s) == [
        (prompt + "<|im_start|>assistant\n4<|im_end|>\n", ["4<|im_end|>"]),
        (prompt + "<|im_start|>assistant\n22<|im_end|>\n", ["22<|im_end|>"]),
    ]
    chosen, rejected = pair_halves(s)
    assert s.split == len(chosen.input_ids) and s.input_ids == chosen.input_ids + rejected.input_ids
    assert s.labels == chosen.labels + rejected.labels
    # A reply's first token comes after the same prompt tokens in both sequences.
    first = chosen.labels.index(next(t for t in chosen.labels if t != IGNORE_INDEX))
    assert chosen.input_ids[:first] == rejected.input_ids[:first]
    assert rejected.labels[first] != IGNORE_INDEX and rejected.labels[first - 1] == IGNORE_INDEX


def test_conversational_pair_labels_its_last_reply_only(tokenizer) -> None:
    s = _encode_pair(tokenizer, HISTORY, CHOSEN, REJECTED, system_prompt="Be kind.")
    prompt = (
        "<|im_start|>system\nBe kind.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    # The earlier reply "hello" is the same in both: not a label.
    assert _halves(tokenizer, s) == [
        (prompt + "4<|im_end|>\n", ["4<|im_end|>"]),
        (prompt + "22<|im_end|>\n", ["22<|im_end|>"]),
    ]


@pytest.mark.parametrize("template", ["chatml", "plain", "qwen3", "qwen3_5"])
def test_the_chosen_sequence_is_the_sft_sample_of_its_conversation(tokenizer, template) -> None:
    """Token for token, label for label, but for the earlier reply (no label in a pair). (Both
    replies think, or neither: a pair of one of each shares a shorter prompt, and learns the
    think-block tokens in which they differ; tests/test_qwen_tokenizer.py and
    tests/test_qwen35_template.py check that against Qwen's templates.)"""
    thought = {**CHOSEN, "reasoning_content": "two and two"}
    rethought = {**REJECTED, "reasoning_content": "two and three"}
    for chosen, rejected in ((CHOSEN, REJECTED), (thought, rethought)):
        pair = _encode_pair(tokenizer, HISTORY, chosen, rejected, template=template)
        cfg = DataConfig(path="unused", template=template)
        (sft,) = encode_records([Record("t", messages=[*HISTORY, chosen])], tokenizer, cfg)
        half, _ = pair_halves(pair)
        assert half.input_ids == sft.input_ids
        spans = _label_spans(tokenizer, sft)
        assert len(spans) == 2 and spans[0].startswith("hello")
        assert _label_spans(tokenizer, half) == spans[1:]
        earlier = [
            i for i, (a, b) in enumerate(zip(half.labels, sft.labels, strict=True)) if a != b
        ]
        assert tokenizer.decode([sft.labels[i] for i in earlier]) == spans[0]


def test_train_on_prompt_does_not_reach_pairs(tokenizer) -> None:
    plain = _encode_pair(tokenizer, HISTORY, CHOSEN, REJECTED)
    assert _encode_pair(tokenizer, HISTORY, CHOSEN, REJECTED, train_on_prompt=True) == plain


# ---------------------------------------------------------------- length policy


def test_pair_lengths() -> None:
    assert pair_lengths(4, 4, 8) == (4, 4)  # fits
    assert pair_lengths(10, 3, 8) == (5, 3)  # the longer one alone
    assert pair_lengths(3, 10, 8) == (3, 5)
    assert pair_lengths(6, 5, 8) == (4, 4)  # down to equal, then both
    assert pair_lengths(10, 10, 9) == (5, 4)  # chosen keeps the odd token


def _policy(samples: list[Sample], **data) -> tuple[list[Sample], DataStats]:
    stats = DataStats(preference=True)
    kept = apply_length_policy(samples, DataConfig(path="x", format="preference", **data), stats)
    return kept, stats


def test_truncation_cuts_replies_and_keeps_the_pair_in_max_seq_len(tokenizer) -> None:
    prompt = [HISTORY[2]]
    long_reply = {"role": "assistant", "content": "one two three four five six seven eight"}
    s = _encode_pair(tokenizer, prompt, long_reply, REJECTED)
    chosen, rejected = (len(h.input_ids) for h in pair_halves(s))
    n = chosen + rejected - 6  # the long chosen reply loses 6 tokens; rejected is whole
    (kept,), stats = _policy([s], max_seq_len=n)
    assert len(kept.input_ids) == n and kept.split == chosen - 6
    prompt_text = "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert _halves(tokenizer, kept) == [
        (prompt_text + "one two three four five six se", ["one two three four five six se"]),
        (prompt_text + "22<|im_end|>\n", ["22<|im_end|>"]),
    ]
    assert (stats.samples, stats.truncated, stats.tokens) == (1, 1, n)
    assert stats.label_tokens == sum(n_labels(h.labels) for h in pair_halves(kept))

    # Both long: each keeps half of the row, and a label.
    both = _encode_pair(tokenizer, prompt, long_reply, {**long_reply, "content": "uno " * 8})
    (kept,), stats = _policy([both], max_seq_len=2 * (chosen - 6))
    assert kept.split == len(kept.input_ids) - kept.split == chosen - 6
    assert all(n_labels(h.labels) > 0 for h in pair_halves(kept))
    assert stats.truncated == 1 and "1 pairs from 0 records" in stats.line()


def test_a_prompt_that_leaves_no_room_drops_the_pair(tokenizer) -> None:
    prompt = [{"role": "user", "content": "word " * 20}]
    s = _encode_pair(tokenizer, prompt, CHOSEN, REJECTED)
    chosen, _ = pair_halves(s)
    prompt_len = chosen.labels.index(next(t for t in chosen.labels if t != IGNORE_INDEX))
    # One token past the prompt in each sequence: the first reply token, a label.
    (kept,), _ = _policy([s], max_seq_len=2 * (prompt_len + 1))
    assert [_label_spans(tokenizer, h) for h in pair_halves(kept)] == [["4"], ["2"]]
    kept, stats = _policy([s], max_seq_len=2 * prompt_len + 1)
    counts = (stats.truncated_no_labels, stats.dropped_no_labels, stats.truncated, stats.samples)
    assert kept == [] and counts == (1, 0, 0, 0)
    n = 2 * prompt_len + 1
    assert stats.line().endswith(
        f"truncated 0, dropped 0 over-long + 0 without labels + 1 truncated to "
        f"data.max_seq_len={n} with no label left"
    )
    assert stats.length_hint() == (
        f": 1 pairs are longer than data.max_seq_len={n} (1 with the prompt, held in both "
        "sequences, alone filling it); raise data.max_seq_len"
    )


def test_drop_counts_over_long_pairs(tokenizer) -> None:
    short = _encode_pair(tokenizer, [HISTORY[2]], CHOSEN, REJECTED)
    long = _encode_pair(tokenizer, HISTORY, CHOSEN, REJECTED)
    kept, stats = _policy([short, long], max_seq_len=len(short.input_ids), overlong="drop")
    assert kept == [short]
    assert (stats.dropped_overlong, stats.dropped_no_labels, stats.truncated) == (1, 0, 0)
    assert stats.line() == (
        f"1 pairs from 0 records, {len(short.input_ids)} tokens ({stats.label_tokens} labels); "
        "truncated 0, dropped 1 over-long + 0 without labels"
    )


# ---------------------------------------------------------------- bad records

GOOD = {"prompt": "q", "chosen": "a", "rejected": "b"}
CONV_C = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
CONV_R = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "b"}]


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"prompt": "q", "rejected": "b"}, r"field 'chosen' is missing"),
        (
            {**GOOD, "chosen": 3},
            r"field 'chosen' is a int, not a string, a message or a list of messages",
        ),
        ({**GOOD, "rejected": " "}, r"field 'rejected' is empty"),
        ({**GOOD, "rejected": []}, r"field 'rejected' must be a non-empty list"),
        ({"chosen": "a", "rejected": "b"}, r"field 'prompt' is missing and field 'chosen' holds"),
        ({**GOOD, "rejected": "a"}, r"fields 'chosen' and 'rejected' are the same reply"),
        (
            {"chosen": CONV_C, "rejected": CONV_R},
            r"fields 'chosen' and 'rejected' differ at turn 0 \(user\), before their last reply",
        ),
        (
            {"chosen": CONV_C, "rejected": [*CONV_C, *CONV_R]},
            r"field 'chosen' has 2 turns and field 'rejected' 4: a pair shares every turn",
        ),
        (
            {"chosen": [*CONV_C, CONV_C[0]], "rejected": CONV_R},
            r"field 'chosen': the last turn is not an assistant reply",
        ),
        (
            {"prompt": [CONV_C[0], CONV_C[0]], "chosen": "a", "rejected": "b"},
            r"field 'chosen': turn 1 is 'user', expected 'assistant'",
        ),
        (
            {"prompt": [{"role": "system", "content": "s"}], "chosen": "a", "rejected": "b"},
            r"field 'prompt' has no user turn and field 'chosen' holds no user turn",
        ),
        (
            {**GOOD, "prompt": [{"role": "system", "content": "s"}, CONV_C[0]], "system": "t"},
            r"field 'system' is set and field 'chosen' has a system message too",
        ),
        (
            {"prompt": [{"role": "robot", "content": "q"}], "chosen": "a", "rejected": "b"},
            r"field 'prompt\[0\]\.role' is 'robot'",
        ),
    ],
)
def test_bad_pairs_stop_with_file_line_field_or_are_counted(
    tokenizer, tmp_path: Path, row: dict, message: str
) -> None:
    path = _write(tmp_path / "d.jsonl", [GOOD, row])
    cfg = DataConfig(path=str(path), format="preference", cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ConfigError, match=r"d\.jsonl:2: " + message):
        preprocess(cfg, tokenizer, seed=0)
    cfg.on_bad_record = "skip"
    stats = preprocess(cfg, tokenizer, seed=0).train
    assert (stats.records, stats.samples, stats.skipped_bad) == (1, 1, 1)
    assert stats.bad_examples[0].startswith(f"{path}:2: ")
    identical = "same reply" in message
    assert stats.identical_pairs == identical
    assert ("1 with identical replies; first:" in stats.line()) == identical


# ---------------------------------------------------------------- cache


def test_the_cache_keeps_each_pairs_split(tokenizer, tmp_path: Path) -> None:
    rows = [{"prompt": f"q{i}", "chosen": "yes" * (i + 1), "rejected": "no"} for i in range(3)] + [
        {"chosen": [*HISTORY, CHOSEN], "rejected": [*HISTORY, REJECTED]}
    ]
    path = _write(tmp_path / "p.jsonl", rows)
    cfg = DataConfig(path=str(path), format="preference", cache_dir=str(tmp_path / "cache"))
    expected = encode_records(_pairs(path), tokenizer, cfg)
    built = preprocess(cfg, tokenizer, seed=0)
    ds = load_split(built.dir)
    assert ds.pairs and ds.splits is not None and ds.splits.dtype == torch.int64
    assert ds.splits.tolist() == [s.split for s in expected]
    for i, want in enumerate(expected):
        got = ds[i]
        assert (got.input_ids, got.labels, got.split, got.index) == (
            want.input_ids,
            want.labels,
            want.split,
            i,
        )
    assert built.train.line().startswith("4 pairs from 4 records")
    reused = preprocess(cfg, tokenizer, seed=0)  # DataStats read back from stats.json
    assert reused.reused and reused.train == built.train and reused.train.preference


def test_sft_data_is_stored_as_before(tokenizer, tmp_path: Path) -> None:
    """No splits array, no pair wording: the SFT layout (and CACHE_VERSION) did not move."""
    from safetensors import safe_open

    path = _write(tmp_path / "a.jsonl", [{"instruction": "q", "output": "a"}])
    built = preprocess(DataConfig(path=str(path), cache_dir=str(tmp_path / "c")), tokenizer, 0)
    with safe_open(str(built.dir / "train.safetensors"), framework="np") as f:
        assert set(f.keys()) == {"input_ids", "labels", "offsets"}
    assert load_split(built.dir).splits is None
    assert built.train.line().startswith("1 samples from 1 records")
    assert json.loads(json.dumps(built.train.as_dict())) == built.train.as_dict()


def test_validation_file_is_read_as_pairs(tokenizer, tmp_path: Path) -> None:
    train = _write(tmp_path / "t.jsonl", [GOOD] * 3)
    val = _write(tmp_path / "v.jsonl", [{**GOOD, "chosen": "c"}])
    cfg = DataConfig(
        path=str(train), format="preference", val_path=str(val), cache_dir=str(tmp_path / "c")
    )
    built = preprocess(cfg, tokenizer, seed=0)
    assert built.val is not None and built.val.preference and built.val.samples == 1
    assert load_split(built.dir, "val").splits is not None


# ---------------------------------------------------------------- config


def _cfg(*overrides: str):
    return to_run_config(compose_cfg(list(overrides)))


def test_the_demo_preference_group_validates_with_a_preference_objective() -> None:
    cfg = _cfg("data=demo-preference", "trainer.objective=dpo")
    validate(cfg)
    assert cfg.data.format == "preference" and cfg.data.max_seq_len == 256
    assert Path(cfg.data.path) == ASSETS_DIR / "demo_preference.jsonl"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["trainer.objective=dpo"],
            r"trainer\.objective=dpo trains on preference pairs, and data\.format is alpaca: "
            r".* data\.format=preference, or set trainer\.objective=sft",
        ),
        (
            ["data=demo-preference"],
            r"data\.format=preference holds prompt / chosen / rejected pairs, which "
            r"trainer\.objective=sft does not train on: set trainer\.objective=dpo",
        ),
        (
            ["data=demo-preference", "trainer.objective=simpo", "data.train_on_prompt=true"],
            r"data\.train_on_prompt=true does not apply to trainer\.objective=simpo: .*"
            r"set data\.train_on_prompt=false",
        ),
        (
            ["data=demo-preference", "trainer.objective=orpo", "data.overlong=split"],
            r"data\.overlong=split cuts long documents \(format text\); a preference pair is "
            r"never cut apart",
        ),
    ],
)
def test_objective_and_format_go_together(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        validate(_cfg(*overrides))


def test_every_source_must_be_pairs_for_a_preference_objective() -> None:
    cfg = _cfg("trainer.objective=ipo")
    cfg.data.path = None
    cfg.data.sources = [
        DataSource(str(ASSETS_DIR / "demo_preference.jsonl"), "preference"),
        DataSource(str(ASSETS_DIR / "demo_alpaca.jsonl"), "alpaca"),
    ]
    with pytest.raises(ConfigError, match=r"and data\.sources\[1\]\.format is alpaca"):
        validate(cfg)
    cfg.data.sources.pop()
    validate(cfg)


# ---------------------------------------------------------------- the demo set


def test_the_demo_set_is_what_its_script_makes(tokenizer, tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location(
        "make_demo_preference", ROOT / "scripts" / "make_demo_preference.py"
    )
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "demo_preference.jsonl"
    assert script.main(["make_demo_preference.py", str(out)]) == 0
    shipped = ASSETS_DIR / "demo_preference.jsonl"
    assert out.read_bytes() == shipped.read_bytes()

    rows = [json.loads(line) for line in shipped.read_text().splitlines()]
    alpaca = [json.loads(line) for line in (ASSETS_DIR / "demo_alpaca.jsonl").open()]
    assert len(rows) == len(alpaca) == 320
    for row, rec in zip(rows, alpaca, strict=True):
        assert row["chosen"] == rec["output"] and row["rejected"] != row["chosen"]
        asked_in_chinese = script.is_chinese(rec["instruction"])
        others = [
            r["output"] for r in alpaca if script.is_chinese(r["instruction"]) != asked_in_chinese
        ]
        assert row["rejected"] in others
    cfg = _cfg("data=demo-preference", "trainer.objective=dpo").data
    cfg.cache_dir = str(tmp_path / "cache")
    stats = preprocess(cfg, tokenizer, seed=0).train
    assert stats.line().startswith("320 pairs from 320 records")
    assert (stats.truncated, stats.dropped_overlong, stats.dropped_no_labels) == (0, 0, 0)
