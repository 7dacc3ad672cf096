"""Records → token ids and labels (the template's label mask), and the length policy.

Tokenization happens once, on the launcher side (:mod:`memtune.data.cache`); ranks read
the flat arrays this module produces and only batch them (:mod:`memtune.data.batching`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from memtune.config import DataConfig
from memtune.data.readers import Record
from memtune.data.templates import segments, with_system

IGNORE_INDEX = -100


@dataclass
class Sample:
    input_ids: list[int]
    labels: list[int]


@dataclass
class DataStats:
    records: int = 0
    skipped_bad: int = 0
    bad_examples: list[str] = field(default_factory=list)
    truncated: int = 0
    split: int = 0  # over-long documents cut into max_seq_len pieces (data.overlong=split)
    split_pieces: int = 0
    dropped_overlong: int = 0
    dropped_no_labels: int = 0
    samples: int = 0
    tokens: int = 0
    label_tokens: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def line(self) -> str:
        out = (
            f"{self.samples} samples from {self.records} records, {self.tokens:,} tokens "
            f"({self.label_tokens:,} labels); truncated {self.truncated}, dropped "
            f"{self.dropped_overlong} over-long + {self.dropped_no_labels} without labels"
        )
        if self.split:
            out += f"; split {self.split} over-long documents into {self.split_pieces} pieces"
        if self.skipped_bad:
            out += f"; skipped {self.skipped_bad} bad records (first: {self.bad_examples[0]})"
        return out


def encode_records(records: Sequence[Record], tokenizer: Any, cfg: DataConfig) -> list[Sample]:
    """Tokenize rendered segments in one batch call (the fast tokenizer runs it in parallel)."""
    eos = tokenizer.eos_token
    rendered: list[list[tuple[str, bool]]] = []
    for rec in records:
        if rec.text is not None:
            rendered.append([(rec.text + eos, True)])
        else:
            assert rec.messages is not None
            msgs = with_system(rec.messages, cfg.system_prompt)
            rendered.append(segments(msgs, cfg.template, eos))
    flat = [text for segs in rendered for text, _ in segs]
    ids = tokenizer(flat, add_special_tokens=False)["input_ids"] if flat else []
    samples, k = [], 0
    for segs in rendered:
        input_ids: list[int] = []
        labels: list[int] = []
        for _, is_label in segs:
            piece = ids[k]
            k += 1
            input_ids += piece
            labels += piece if (is_label or cfg.train_on_prompt) else [IGNORE_INDEX] * len(piece)
        samples.append(Sample(input_ids, labels))
    return samples


def n_labels(labels: Sequence[int]) -> int:
    """Label tokens that are targets: the first position never is (labels shift by one)."""
    return sum(1 for t in labels[1:] if t != IGNORE_INDEX)


def apply_length_policy(samples: list[Sample], cfg: DataConfig, stats: DataStats) -> list[Sample]:
    """Truncate, split (long documents) or drop over-long samples, drop samples left without
    labels; count each (``truncated`` counts kept samples only: one cut down to no labels is
    a drop)."""
    kept = []
    n = cfg.max_seq_len
    pieces: list[tuple[Sample, bool]] = []
    for s in samples:
        if len(s.input_ids) > n and cfg.overlong == "split":
            # A long document becomes consecutive max_seq_len pieces, each its own sample
            # (each piece's first token is a target of nothing: labels shift by one).
            parts = [
                Sample(s.input_ids[a : a + n], s.labels[a : a + n])
                for a in range(0, len(s.input_ids), n)
            ]
            stats.split += 1
            stats.split_pieces += len(parts)
            pieces += [(part, False) for part in parts]
        else:
            pieces.append((s, len(s.input_ids) > n))
    for s, cut in pieces:
        if cut:
            if cfg.overlong == "drop":
                stats.dropped_overlong += 1
                continue
            s = Sample(s.input_ids[:n], s.labels[:n])
        count = n_labels(s.labels)
        if count == 0:
            stats.dropped_no_labels += 1
            continue
        stats.truncated += cut
        stats.samples += 1
        stats.tokens += len(s.input_ids)
        stats.label_tokens += count
        kept.append(s)
    return kept


class TokenizedDataset(torch.utils.data.Dataset):
    """Samples stored as flat int32 arrays + offsets (what the preprocessing cache holds)."""

    def __init__(self, input_ids: torch.Tensor, labels: torch.Tensor, offsets: torch.Tensor):
        self.input_ids, self.labels, self.offsets = input_ids, labels, offsets
        self.lengths = (offsets[1:] - offsets[:-1]).tolist()

    @classmethod
    def from_samples(cls, samples: Sequence[Sample]) -> TokenizedDataset:
        lengths = torch.tensor([0] + [len(s.input_ids) for s in samples], dtype=torch.int64)
        flat_ids = [t for s in samples for t in s.input_ids]
        flat_labels = [t for s in samples for t in s.labels]
        return cls(
            torch.tensor(flat_ids, dtype=torch.int32),
            torch.tensor(flat_labels, dtype=torch.int32),
            torch.cumsum(lengths, 0),
        )

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> Sample:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return Sample(self.input_ids[a:b].tolist(), self.labels[a:b].tolist())
