"""A rank's data: the DataLoader over the tokenized cache (padded, length-grouped or packed)
and its validation micro batches."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from memtune.config import RunConfig
from memtune.config.decisions import BatchShape
from memtune.data.batching import (
    GlobalOrderSampler,
    LengthGroupedSampler,
    PackedDataset,
    TokenizedDataset,
    collate_packed,
    collate_padded,
    collate_pairs,
)
from memtune.data.cache import load_image_settings, load_split
from memtune.data.encode import IGNORE_INDEX, Sample


def eval_batches(
    cfg: RunConfig,
    batch: BatchShape,
    prepared_dir: str,
    pad_token_id: int,
    rank: int,
    world: int,
    full_rows: bool = False,
) -> list[dict[str, torch.Tensor]]:
    """This rank's validation micro batches, collated once (the split is small).
    ``full_rows``: every batch has the micro batch's rows (label-free rows fill the last one),
    as sequence-parallel attention needs."""
    val = load_split(prepared_dir, "val")
    images = load_image_settings(prepared_dir)
    samples = []
    for i in eval_shard(len(val), rank, world):
        s = val[max(i, 0)]
        samples.append(s if i >= 0 else blank_sample(s))
    micro = batch.micro_batch
    if full_rows and len(samples) % micro:
        samples += [blank_sample(samples[0])] * (-len(samples) % micro)
    if val.pairs:
        return [
            collate_pairs(samples[a : a + micro], pad_token_id)
            for a in range(0, len(samples), micro)
        ]
    return [
        collate_padded(samples[a : a + micro], pad_token_id, images)
        for a in range(0, len(samples), micro)
    ]


def blank_sample(s: Sample) -> Sample:
    """A label-free copy that fills a rank's shard (every rank runs as many forwards)."""
    return Sample(
        s.input_ids,
        [IGNORE_INDEX] * len(s.labels),
        s.split,
        images=s.images,
        mm_token_type_ids=s.mm_token_type_ids,
    )


def train_order(
    cfg: RunConfig, batch: BatchShape, base: TokenizedDataset, rank: int, world: int
) -> tuple[TokenizedDataset | PackedDataset, GlobalOrderSampler | LengthGroupedSampler]:
    """What the loader's items are (samples or pairs; packed rows) and the sampler that deals
    them to this rank: the one place both are made (the reference precompute asks it which
    items the steps read, rank.reference.train_items)."""
    micro, seed = batch.micro_batch, cfg.trainer.seed
    dataset: TokenizedDataset | PackedDataset = base
    if cfg.data.packing:
        dataset = PackedDataset(base, batch.row_tokens)
    if cfg.data.group_by_length:
        return dataset, LengthGroupedSampler(base.lengths, micro, world, rank, seed)
    return dataset, GlobalOrderSampler(len(dataset), world, rank, seed, batch.global_batch)


def make_loader(
    cfg: RunConfig, batch: BatchShape, prepared_dir: str, pad_token_id: int, rank: int, world: int
) -> tuple[Any, Any]:
    """The rank's DataLoader over the preprocessed cache: padded, length-grouped or packed,
    ``batch.micro_batch`` rows at a time; data with images patchified here, on the rank, batch
    by batch (data.batching.image_batch)."""
    from torch.utils.data import DataLoader

    base = load_split(prepared_dir, "train")
    images = load_image_settings(prepared_dir)  # None: the data has no images
    micro = batch.micro_batch
    dataset, sampler = train_order(cfg, batch, base, rank, world)
    collate_fn: Any = partial(collate_padded, pad_token_id=pad_token_id, images=images)
    if base.pairs:
        collate_fn = partial(collate_pairs, pad_token_id=pad_token_id)
    if cfg.data.packing:
        collate_fn = partial(collate_packed, pad_token_id=pad_token_id, images=images)
    if len(sampler) < micro:
        raise RuntimeError(
            f"rank {rank} gets {len(sampler)} items per epoch, fewer than one micro batch "
            f"({micro}); use more data or a smaller trainer.global_batch_size (the job checks "
            "this before launch: data.packing.check_one_step)"
        )
    loader = DataLoader(
        dataset,
        batch_size=micro,
        sampler=sampler,
        collate_fn=collate_fn,
        num_workers=cfg.data.num_workers,
        drop_last=True,
        # Its own generator: without one, every iter(loader) (each epoch, and a resumed run's
        # first) draws the workers' base seed from torch's global generator, the one LoRA
        # dropout draws its masks from, so a resume mid-epoch drew once more than the run it
        # continues and every mask after it differed.
        generator=torch.Generator().manual_seed(cfg.trainer.seed),
    )
    return loader, sampler


def eval_shard(n_samples: int, rank: int, world: int) -> list[int]:
    """This rank's validation indices; -1 pads shards to equal length (weight 0)."""
    per_rank = -(-n_samples // world)
    padded = list(range(n_samples)) + [-1] * (per_rank * world - n_samples)
    return padded[rank::world]
