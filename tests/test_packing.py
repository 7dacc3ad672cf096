"""Packing is exact: no attention across samples, positions restart, same loss as one by one."""

from __future__ import annotations

import random

import pytest
import torch

from memtune.config import to_run_config
from memtune.data.batching import (
    LengthGroupedSampler,
    PackedDataset,
    collate_packed,
    collate_padded,
    pack_bins,
)
from memtune.data.cache import load_split, preprocess
from memtune.data.encode import TokenizedDataset
from memtune.rank.loss import token_loss_sum
from memtune.rank.model import load_base_model, load_tokenizer
from memtune.tools.tiny import synthesize
from tests.conftest import compose_cfg


def test_first_fit_decreasing_bins() -> None:
    rng = random.Random(0)
    lengths = [min(2048, int(rng.paretovariate(1.2) * 60)) for _ in range(2000)]
    bins = pack_bins(lengths, 2048)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 2048 for b in bins)
    efficiency = sum(lengths) / (len(bins) * 2048)
    assert efficiency > 0.95, efficiency


@pytest.fixture(scope="module")
def tiny():
    cfg = to_run_config(compose_cfg(["trainer.precision=fp32"]))
    synthesize(cfg.model.name_or_path, cfg.model.architecture)
    tokenizer = load_tokenizer(cfg)
    prepared = preprocess(cfg.data, tokenizer, seed=0)
    return cfg, tokenizer, load_split(prepared.dir)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_loss_equals_one_by_one(tiny, attn: str) -> None:
    cfg, tokenizer, dataset = tiny
    model = load_base_model(cfg, attn).eval()
    subset = TokenizedDataset.from_samples([dataset[i] for i in range(24)])
    packed = PackedDataset(subset, capacity=128)
    assert len(packed) < len(subset)  # several samples per row
    batch = collate_packed([packed[i] for i in range(len(packed))], tokenizer.pad_token_id)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        packed_sum = token_loss_sum(logits, batch["labels"])
        packed_count = int((batch["labels"][:, 1:] != -100).sum())

        single_sum, single_count = torch.zeros(()), 0
        for i in range(len(subset)):
            s = collate_padded([subset[i]], tokenizer.pad_token_id)
            out = model(input_ids=s["input_ids"]).logits
            single_sum += token_loss_sum(out, s["labels"])
            single_count += int((s["labels"][:, 1:] != -100).sum())
            # The sample's logits inside its packed row equal its logits alone.
            row, at = _locate(packed, i)
            n = s["input_ids"].shape[1]
            torch.testing.assert_close(logits[row, at : at + n], out[0], rtol=1e-5, atol=1e-5)
    assert packed_count == single_count
    torch.testing.assert_close(
        packed_sum / packed_count, single_sum / single_count, rtol=1e-5, atol=1e-5
    )
    assert batch["real_tokens"] == sum(subset.lengths)


def _locate(packed: PackedDataset, sample: int) -> tuple[int, int]:
    for row, members in enumerate(packed.bins):
        at = 0
        for j in members:
            if j == sample:
                return row, at
            at += packed.base.lengths[j]
    raise KeyError(sample)


def test_packed_rows_restart_positions_and_mask_boundaries(tiny) -> None:
    _, tokenizer, dataset = tiny
    packed = PackedDataset(TokenizedDataset.from_samples([dataset[i] for i in range(8)]), 64)
    row = packed[0]
    batch = collate_packed([row], tokenizer.pad_token_id)
    starts = [0]
    for s in row[:-1]:
        starts.append(starts[-1] + len(s.input_ids))
    pos = batch["position_ids"][0].tolist()
    assert [pos[a] for a in starts] == [0] * len(starts)
    # The first token of every sample is never a target of the previous one.
    assert all(batch["labels"][0, a] == -100 for a in starts)


def test_length_grouped_sampler() -> None:
    rng = random.Random(1)
    lengths = [rng.randint(5, 500) for _ in range(1000)]
    samplers = [LengthGroupedSampler(lengths, micro=4, world=2, rank=r, seed=3) for r in range(2)]
    per_rank = [list(s) for s in samplers]
    assert len(per_rank[0]) == len(per_rank[1]) == len(samplers[0])
    assert not set(per_rank[0]) & set(per_rank[1])
    batches = [per_rank[0][i : i + 4] for i in range(0, len(per_rank[0]), 4)]
    padded = sum(4 * max(lengths[i] for i in b) for b in batches)
    real = sum(lengths[i] for b in batches for i in b)
    assert real / padded > 0.9  # random batching of this distribution gives ~0.6
    samplers[0].set_epoch(1)
    assert list(samplers[0]) != per_rank[0]
