"""Records → token ids and labels → batches (padded, length-grouped, or packed).

Tokenization happens once, on the launcher side (:mod:`memtune.preprocess`); ranks read
the flat arrays this module produces and only batch them.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from memtune.config import DataConfig
from memtune.readers import Record
from memtune.templates import segments, with_system

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
    """Truncate or drop over-long samples, drop samples left without labels; count each
    (``truncated`` counts kept samples only: one cut down to no labels is a drop)."""
    kept = []
    for s in samples:
        cut = len(s.input_ids) > cfg.max_seq_len
        if cut:
            if cfg.overlong == "drop":
                stats.dropped_overlong += 1
                continue
            s = Sample(s.input_ids[: cfg.max_seq_len], s.labels[: cfg.max_seq_len])
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


def collate_padded(batch: list[Sample], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sample of the micro batch."""
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


# ---------------------------------------------------------------- packing


def pack_bins(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Best-fit-decreasing: sample indices grouped into bins of at most ``capacity`` tokens.

    Longest first, each into the open bin it fills most tightly (a sorted list of free space
    keeps that a binary search), so hundreds of thousands of samples pack in seconds.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (free tokens, bin index), sorted
    for i in order:
        n = lengths[i]
        at = bisect.bisect_left(free, (n, -1))
        if at < len(free):
            room, b = free.pop(at)
            bins[b].append(i)
            bisect.insort(free, (room - n, b))
        else:
            bins.append([i])
            bisect.insort(free, (capacity - n, len(bins) - 1))
    return bins


class PackedDataset(torch.utils.data.Dataset):
    """Each item is one packed row: several samples back to back."""

    def __init__(self, base: TokenizedDataset, capacity: int):
        self.base = base
        self.bins = pack_bins(base.lengths, capacity)
        self.lengths = [sum(base.lengths[i] for i in b) for b in self.bins]

    def __len__(self) -> int:
        return len(self.bins)

    def __getitem__(self, i: int) -> list[Sample]:
        return [self.base[j] for j in self.bins[i]]


def collate_packed(batch: list[list[Sample]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Concatenate each row's samples; ``position_ids`` restart at 0 for every sample.

    No attention mask is passed: transformers then reads sample boundaries from the
    restarting positions (block-diagonal causal mask on SDPA/eager, varlen kernels on
    FlashAttention-2), so no token attends across samples. Row padding forms its own
    segment with no labels.
    """
    width = max(sum(len(s.input_ids) for s in row) for row in batch)
    input_ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(batch), width), IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.zeros((len(batch), width), dtype=torch.long)
    real = 0
    for r, row in enumerate(batch):
        at = 0
        for s in row:
            n = len(s.input_ids)
            input_ids[r, at : at + n] = torch.tensor(s.input_ids)
            lab = list(s.labels)
            lab[0] = IGNORE_INDEX  # the previous sample's last token must not predict this one
            labels[r, at : at + n] = torch.tensor(lab)
            position_ids[r, at : at + n] = torch.arange(n)
            at += n
        real += at
        position_ids[r, at:] = torch.arange(width - at)
    return {
        "input_ids": input_ids,
        "labels": labels,
        "position_ids": position_ids,
        "real_tokens": torch.tensor(real),
    }


# ---------------------------------------------------------------- length grouping


class LengthGroupedSampler(torch.utils.data.Sampler[int]):
    """Shuffled, but each micro batch holds samples of similar length.

    Indices are shuffled (same seed on every rank), cut into mega-chunks, sorted by length
    inside each chunk, split into micro batches, and the batches shuffled again and dealt
    round-robin to the ranks. Every rank yields the same number of batches.
    """

    def __init__(
        self, lengths: Sequence[int], micro: int, world: int, rank: int, seed: int, chunk: int = 64
    ):
        self.lengths, self.micro, self.world, self.rank = list(lengths), micro, world, rank
        self.seed, self.chunk, self.epoch = seed, chunk, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _batches(self) -> list[list[int]]:
        rng = random.Random(self.seed + self.epoch)
        idx = list(range(len(self.lengths)))
        rng.shuffle(idx)
        size = self.micro * self.world * self.chunk
        batches = []
        for c in range(0, len(idx), size):
            part = sorted(idx[c : c + size], key=lambda i: self.lengths[i], reverse=True)
            batches += [part[b : b + self.micro] for b in range(0, len(part), self.micro)]
        batches = [b for b in batches if len(b) == self.micro]
        rng.shuffle(batches)
        usable = len(batches) - len(batches) % self.world
        return batches[self.rank : usable : self.world]

    def __iter__(self) -> Iterator[int]:
        for batch in self._batches():
            yield from batch

    def __len__(self) -> int:
        return len(self._batches()) * self.micro
