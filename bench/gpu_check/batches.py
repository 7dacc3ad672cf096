"""The rows the model phases train on: random tokens, or one preference pair (DPO)."""

from __future__ import annotations

import time
from typing import Any

from .measure import sync


def synthetic_batch(vocab: int, seq_len: int, seed: int) -> dict[str, Any]:
    """One row of ``seq_len`` random tokens, every one labelled; micro batch 1, so neither side
    pads (padding's cost depends on the data: ``make bench-data`` measures it)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, seq_len), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def pair_batch(
    engine: Any, d: Any, vocab: int, seq_len: int, device: Any, rec: dict[str, Any]
) -> dict[str, Any]:
    """One row holding one preference pair of ``seq_len`` tokens (each sequence a prompt of a
    quarter of the row, then a reply of a quarter), its reference log-probabilities computed
    by memtune's own precompute (rank.reference.compute), whose time is recorded."""
    import torch

    from memtune.data.batching import TokenizedDataset, collate_packed
    from memtune.data.encode import IGNORE_INDEX, Sample
    from memtune.rank.reference import References, compute

    g = torch.Generator().manual_seed(seq_len)
    half, prompt = seq_len // 2, seq_len // 4
    ids = torch.randint(0, vocab, (seq_len,), generator=g).tolist()
    ids[half : half + prompt] = ids[:prompt]  # both sequences share the prompt
    labels = [IGNORE_INDEX] * prompt + ids[prompt:half]
    labels += [IGNORE_INDEX] * prompt + ids[half + prompt :]
    pair = Sample(ids, labels, split=half, index=0)
    sync(device)
    t0 = time.perf_counter()
    table = compute(engine, TokenizedDataset.from_samples([pair]), [0], d.batch, 0, device)
    sync(device)
    rec["reference_pass_s"] = round(time.perf_counter() - t0, 4)
    return References({"train": table}).attach(collate_packed([[pair]], 0))
