"""Instruction data: read alpaca records, render ChatML, mask prompt tokens, batch.

A sample is tokenized as three pieces: the prompt (system and user turns plus the assistant
header), the reply followed by ``<|im_end|>``, and the trailing newline. Only the reply and
its ``<|im_end|>`` carry labels: a model that never sees ``<|im_end|>`` as a target never
learns to stop.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from memtune.config import ConfigError, DataConfig

IGNORE_INDEX = -100


@dataclass
class Sample:
    input_ids: list[int]
    labels: list[int]


@dataclass
class DataStats:
    records: int = 0
    samples: int = 0
    truncated: int = 0
    dropped_no_labels: int = 0
    tokens: int = 0
    label_tokens: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


def read_alpaca(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield (line number, record) from a .jsonl file or a .json array of alpaca records."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"data.path={path}: cannot read ({err})") from err
    if path.suffix == ".json":
        try:
            records = json.loads(text)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path}:{err.lineno}: invalid JSON ({err.msg})") from err
        if not isinstance(records, list):
            raise ConfigError(f"{path}: expected a JSON array of records")
        for i, rec in enumerate(records, 1):
            yield i, _check_alpaca(rec, path, i, what="record")
        return
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path}:{lineno}: invalid JSON ({err.msg})") from err
        yield lineno, _check_alpaca(rec, path, lineno, what="line")


def _check_alpaca(rec: Any, path: Path, n: int, what: str) -> dict[str, Any]:
    where = f"{path}:{n}" if what == "line" else f"{path} record {n}"
    if not isinstance(rec, dict):
        raise ConfigError(f"{where}: expected an object with instruction / input / output")
    for key in ("instruction", "output"):
        if not isinstance(rec.get(key), str):
            raise ConfigError(f"{where}: field {key!r} is missing or not a string")
    if not isinstance(rec.get("input", ""), str):
        raise ConfigError(f"{where}: field 'input' is not a string")
    if not rec["output"].strip():
        raise ConfigError(f"{where}: field 'output' is empty (nothing to learn)")
    return rec


def alpaca_messages(rec: dict[str, Any], system_prompt: str | None) -> list[dict[str, str]]:
    user = rec["instruction"]
    if rec.get("input"):
        user = f"{user}\n\n{rec['input']}"
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages += [{"role": "user", "content": user}, {"role": "assistant", "content": rec["output"]}]
    return messages


def render_prompt(messages: list[dict[str, str]]) -> str:
    """ChatML for every message, then the assistant header (what generation is given)."""
    turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return turns + "<|im_start|>assistant\n"


def encode(messages: list[dict[str, str]], tokenizer: Any) -> Sample:
    """Tokenize a conversation whose last message is the assistant reply to learn."""
    *context, reply = messages
    prompt_ids = tokenizer.encode(render_prompt(context), add_special_tokens=False)
    reply_ids = tokenizer.encode(reply["content"] + "<|im_end|>", add_special_tokens=False)
    tail_ids = tokenizer.encode("\n", add_special_tokens=False)
    input_ids = prompt_ids + reply_ids + tail_ids
    labels = [IGNORE_INDEX] * len(prompt_ids) + reply_ids + [IGNORE_INDEX] * len(tail_ids)
    return Sample(input_ids, labels)


def load_samples(cfg: DataConfig, tokenizer: Any) -> tuple[list[Sample], DataStats]:
    stats = DataStats()
    samples = []
    for _, rec in read_alpaca(cfg.path):
        stats.records += 1
        sample = encode(alpaca_messages(rec, cfg.system_prompt), tokenizer)
        if len(sample.input_ids) > cfg.max_seq_len:
            stats.truncated += 1
            sample = Sample(sample.input_ids[: cfg.max_seq_len], sample.labels[: cfg.max_seq_len])
        # The first token is never a target (labels shift by one), so count from index 1.
        n_labels = sum(1 for t in sample.labels[1:] if t != IGNORE_INDEX)
        if n_labels == 0:
            stats.dropped_no_labels += 1
            continue
        stats.samples += 1
        stats.tokens += len(sample.input_ids)
        stats.label_tokens += n_labels
        samples.append(sample)
    if not samples:
        raise ConfigError(f"data.path={cfg.path}: no usable samples ({stats.as_dict()})")
    return samples, stats


class SampleDataset(torch.utils.data.Dataset):
    def __init__(self, samples: list[Sample]):
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> Sample:
        return self.samples[i]


def collate(batch: list[Sample], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sample in the micro batch."""
    width = max(len(s.input_ids) for s in batch)
    input_ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(batch), width), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, s in enumerate(batch):
        n = len(s.input_ids)
        input_ids[row, :n] = torch.tensor(s.input_ids)
        labels[row, :n] = torch.tensor(s.labels)
        attention_mask[row, :n] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}
