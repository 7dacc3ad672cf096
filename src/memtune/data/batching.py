"""Samples → batches: padded per micro batch, length-grouped, or packed into rows.

Data with images: a sample's resized uint8 images are read from the cache with the sample
(:class:`memtune.data.cache.CachedImages`), and a batch carries them patchified
(``pixel_values``, ``image_grid_thw``: :func:`memtune.data.vision.pixel_values`, the image
processor's own steps, here on the rank) in the order of their tokens, with each token's
``mm_token_type_ids``. Packing places samples whole, so an image's tokens and its patches stay
with their sample.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import torch

from memtune.data.encode import IGNORE_INDEX, Sample
from memtune.data.packing import pack_bins
from memtune.data.vision import ImageSettings, pixel_values


class SampleImages(Protocol):
    """Each sample's images by its index (a list of lists, or the cache's reader)."""

    def __getitem__(self, index: int) -> list[Any]: ...


class TokenizedDataset(torch.utils.data.Dataset):
    """Samples stored as flat int32 arrays + offsets (what the preprocessing cache holds)."""

    def __init__(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        offsets: torch.Tensor,
        splits: torch.Tensor | None = None,
        mm_token_type_ids: torch.Tensor | None = None,
        images: SampleImages | None = None,
    ):
        self.input_ids, self.labels, self.offsets = input_ids, labels, offsets
        self.splits = splits
        """Preference data: each item's chosen length (items are chosen ++ rejected)."""
        self.mm_token_type_ids = mm_token_type_ids
        """Data with images: each token's type (1 on an image's tokens), flat as input_ids."""
        self.images = images
        """Data with images: ``images[i]``, sample i's resized images (3 × H × W uint8)."""
        self.lengths = (offsets[1:] - offsets[:-1]).tolist()

    @classmethod
    def from_samples(cls, samples: Sequence[Sample]) -> TokenizedDataset:
        lengths = torch.tensor([0] + [len(s.input_ids) for s in samples], dtype=torch.int64)
        flat_ids = [t for s in samples for t in s.input_ids]
        flat_labels = [t for s in samples for t in s.labels]
        pairs = any(s.split for s in samples)
        with_images = any(s.mm_token_type_ids is not None for s in samples)
        types = [t for s in samples for t in (s.mm_token_type_ids or [0] * len(s.input_ids))]
        return cls(
            torch.tensor(flat_ids, dtype=torch.int32),
            torch.tensor(flat_labels, dtype=torch.int32),
            torch.cumsum(lengths, 0),
            torch.tensor([s.split for s in samples], dtype=torch.int64) if pairs else None,
            torch.tensor(types, dtype=torch.uint8) if with_images else None,
            [list(s.images) for s in samples] if with_images else None,
        )

    @property
    def pairs(self) -> bool:
        return self.splits is not None

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> Sample:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        split = int(self.splits[i]) if self.splits is not None else 0
        s = Sample(self.input_ids[a:b].tolist(), self.labels[a:b].tolist(), split, i)
        if self.mm_token_type_ids is not None:
            s.mm_token_type_ids = self.mm_token_type_ids[a:b].tolist()
        if self.images is not None:
            s.images = list(self.images[i])
        return s


def image_batch(
    rows: list[list[Sample]], width: int, images: ImageSettings | None
) -> dict[str, torch.Tensor]:
    """A batch's image keys (none when ``images`` is None: the data has no images):
    ``mm_token_type_ids`` (rows × width, each row's samples back to back), and when any
    sample has an image, ``pixel_values`` and ``image_grid_thw`` of all of them in the order
    of their tokens (row by row, sample by sample)."""
    if images is None:
        return {}
    types = torch.zeros((len(rows), width), dtype=torch.long)
    pictures = []
    for r, row in enumerate(rows):
        at = 0
        for s in row:
            n = len(s.input_ids)
            if s.mm_token_type_ids is not None:
                types[r, at : at + n] = torch.tensor(s.mm_token_type_ids)
            pictures += s.images
            at += n
    out = {"mm_token_type_ids": types}
    if pictures:
        patches = pixel_values(pictures, images)
        out["pixel_values"] = torch.from_numpy(patches["pixel_values"])
        out["image_grid_thw"] = torch.from_numpy(patches["image_grid_thw"]).long()
    return out


def collate_padded(
    batch: list[Sample], pad_token_id: int, images: ImageSettings | None = None
) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sample of the micro batch (``images``: the cache's image
    settings, for data with images: :func:`image_batch`)."""
    width = max(len(s.input_ids) for s in batch)
    input_ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(batch), width), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, s in enumerate(batch):
        n = len(s.input_ids)
        input_ids[row, :n] = torch.tensor(s.input_ids)
        labels[row, :n] = torch.tensor(s.labels)
        attention_mask[row, :n] = 1
    out = {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}
    return out | image_batch([[s] for s in batch], width, images)


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


def collate_packed(
    batch: list[list[Sample]], pad_token_id: int, images: ImageSettings | None = None
) -> dict[str, torch.Tensor]:
    """Concatenate each row's samples; ``position_ids`` restart at 0 for every sample.

    No attention mask is passed: ``cu_seq_lens`` (each sample's start in the flattened
    ``rows × width`` tokens, then the total; int32, as FlashAttention-2's varlen kernel takes
    them) and ``max_length`` mark the samples for ``sdpa_varlen`` and FlashAttention-2, which
    attend within each sample without a dense mask; transformers' ``sdpa``/``eager`` read the
    same boundaries from the restarting positions (a dense block-diagonal mask). No token
    attends across samples. Row padding forms its own segment with no labels.

    A preference pair (``Sample.split``) is two sequences of the same row, chosen then
    rejected, each its own segment. Its batch also holds ``pair_index`` (each pair's index in
    its split, in batch order; -1 for a label-free filler) and ``sequence_index`` (per token:
    2k for the k-th pair's chosen tokens, 2k + 1 for its rejected ones, -1 elsewhere), from
    which the preference loss sums each sequence's log-probabilities.

    ``images``: the cache's image settings, for data with images (:func:`image_batch`; a
    vision-language model computes each sample's 3-D rotary positions from its tokens' types
    and its images, rank.vision).
    """
    width = max(sum(len(s.input_ids) for s in row) for row in batch)
    input_ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(batch), width), IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.zeros((len(batch), width), dtype=torch.long)
    pairs = any(s.split for row in batch for s in row)
    sequence = torch.full((len(batch), width), -1, dtype=torch.long) if pairs else None
    pair_index: list[int] = []
    starts: list[int] = []
    real = 0
    for r, row in enumerate(batch):
        at = 0
        for s in row:
            n = len(s.input_ids)
            parts = [(0, s.split), (s.split, n)] if s.split else [(0, n)]
            labelled = any(t != IGNORE_INDEX for t in s.labels)
            if s.split:
                pair_index.append(s.index if labelled else -1)
            for k, (a, b) in enumerate(parts):
                starts.append(r * width + at + a)
                input_ids[r, at + a : at + b] = torch.tensor(s.input_ids[a:b])
                lab = list(s.labels[a:b])
                lab[0] = IGNORE_INDEX  # the previous sample's last token must not predict this one
                labels[r, at + a : at + b] = torch.tensor(lab)
                position_ids[r, at + a : at + b] = torch.arange(b - a)
                if sequence is not None and s.split and labelled:
                    sequence[r, at + a : at + b] = 2 * (len(pair_index) - 1) + k
            at += n
        real += at
        position_ids[r, at:] = torch.arange(width - at)
        if at < width:
            starts.append(r * width + at)
    bounds = torch.tensor([*starts, len(batch) * width], dtype=torch.int32)
    out = {
        "input_ids": input_ids,
        "labels": labels,
        "position_ids": position_ids,
        "cu_seq_lens": bounds,
        "max_length": bounds.diff().max(),
        "real_tokens": torch.tensor(real),
    }
    if sequence is not None:
        out |= {"sequence_index": sequence, "pair_index": torch.tensor(pair_index)}
    return out | image_batch(batch, width, images)


def collate_pairs(batch: list[Sample], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Unpacked preference pairs: one pair per row, its two sequences side by side (the pair is
    one item; the row is as wide as the widest pair)."""
    return collate_packed([[s] for s in batch], pad_token_id)


class GlobalOrderSampler(torch.utils.data.Sampler[int]):
    """One shuffled order of the whole epoch, dealt round-robin to the ranks, so that every
    optimizer step consumes the next ``global_batch`` items of it whatever the number of ranks
    (rank r's k-th item is item r + k·world of the order; a step takes the next
    global_batch / world of each rank's). The order is DistributedSampler's (randperm seeded
    with seed + epoch), cut to a multiple of the global batch rather than of the ranks, so a
    run resumed on another number of ranks continues with the same samples (the few left over
    at an epoch's end are reshuffled into the next)."""

    def __init__(self, n: int, world: int, rank: int, seed: int, global_batch: int):
        self.n, self.world, self.rank, self.seed = n, world, rank, seed
        self.usable = n // global_batch * global_batch
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """The next iteration is of ``epoch``, from this rank's item ``start`` on (a resumed
        run's first epoch: the items before it are not read at all)."""
        self.epoch, self.start = epoch, start

    def epoch_order(self, epoch: int) -> list[int]:
        """The items of ``epoch`` in the order every step takes them, over all ranks."""
        g = torch.Generator()
        g.manual_seed(self.seed + epoch)
        return torch.randperm(self.n, generator=g).tolist()[: self.usable]

    def __iter__(self) -> Iterator[int]:
        return iter(self.epoch_order(self.epoch)[self.rank :: self.world][self.start :])

    def visited(self, steps: int, global_batch: int) -> set[int]:
        """The items ``steps`` optimizer steps take, over every epoch they reach."""
        seen: set[int] = set()
        need, epoch = steps * global_batch, 0
        # The rows one epoch leaves out (n - usable), a later one may take.
        while need > 0 and self.usable and len(seen) < self.n:
            order = self.epoch_order(epoch)
            seen.update(order[:need])
            need, epoch = need - len(order), epoch + 1
        return seen

    def __len__(self) -> int:
        return self.usable // self.world


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
        self.seed, self.chunk, self.epoch, self.start = seed, chunk, 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """As :meth:`GlobalOrderSampler.set_epoch`."""
        self.epoch, self.start = epoch, start

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
        items = (i for batch in self._batches() for i in batch)
        return itertools.islice(items, self.start, None)

    def __len__(self) -> int:
        return len(self._batches()) * self.micro
