"""The reference model's log-probabilities, computed once before training (DPO, IPO).

The reference is the base model: the policy with its adapter switched off, so it costs no
second model in memory (or, with peft.init_from, the policy as loaded, before the first step:
the SFT adapter a preference stage starts from). With preference.reference=precomputed (the
default) every rank runs it over its share of the pairs the run will read — the sampler's
global order says which, for the steps of ``trainer.max_steps`` — packed best-fit into rows of
``data.max_seq_len`` (its own rows: only the values per pair matter), and the ranks exchange
their results; each training step then runs the policy
alone (live, every step runs one more forward, the reference's, next to the policy's forward
and backward). Validation pairs are computed likewise, all of them.

The tables are saved in ``RUN_DIR/reference/`` under a key of everything they depend on (the
base model's fingerprint and architecture, its quantization, the adapter it starts from, the
tokenized data, the precision, the attention and loss code, the library versions, the steps and
order that choose the pairs); a resumed run with the same key reads them back, any other
recomputes them. A step that meets a pair without a reference value stops with an error instead
of training against a wrong one.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from memtune.config import RunConfig, preference_loss_kind
from memtune.config.architecture import adapter_fingerprint
from memtune.config.decisions import BatchShape, Decisions
from memtune.data.batching import GlobalOrderSampler, PackedDataset, TokenizedDataset
from memtune.data.batching import collate_packed as _collate
from memtune.data.cache import load_split
from memtune.data.loaders import blank_sample
from memtune.data.packing import pack_bins
from memtune.filesystem import follow_umask, owned_temp_dir, remove_left_by_dead
from memtune.integrity import MANIFEST, Store
from memtune.rank.loop import MODEL_INPUTS
from memtune.rank.sequence_parallel import SequenceGroups, shard_batch
from memtune.rundir import RunDir

FORMAT = 1
"""Bumped when what a table holds, or how it is computed, changes."""


def reference_key(cfg: RunConfig, d: Decisions, rd: RunDir, data_dir: str) -> str:
    """A digest of everything the tables depend on (the attention, loss and layer kernels,
    the quantization and the batch as decided)."""
    from importlib.metadata import version

    base = json.loads(rd.base.read_text()) if rd.base.is_file() else {}
    t, p = cfg.trainer, cfg.peft
    parts = {
        "format": FORMAT,
        "base": base.get("fingerprint") or cfg.model.name_or_path,
        "revision": cfg.model.revision,
        "architecture": dict(cfg.model.architecture),
        "rope_scaling": dict(cfg.model.rope_scaling or {}),  # YaRN changes every log-prob
        "quantization": [d.peft_method, p.quant_type, p.double_quant],
        "data": Path(data_dir).name,  # the tokenized cache's own fingerprint
        "precision": t.precision,
        "attention": d.attention,
        "loss": [preference_loss_kind(d.loss), t.loss_chunk_tokens],
        "versions": [version(name) for name in ("torch", "transformers", "peft")],
        "order": [t.seed, d.batch.global_batch, t.max_steps, cfg.data.packing],
        "grouped": cfg.data.group_by_length,
        "max_seq_len": cfg.data.max_seq_len,
        # the launcher's digest in base.json (read once there); computed where absent
        "init_from": base.get("init_from_fingerprint") or adapter_fingerprint(cfg.peft.init_from),
    }
    if d.kernels.fused():  # (absent when all torch: the tables of earlier runs keep their key)
        parts["kernels"] = d.kernels.fused()
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]


Items = TokenizedDataset | PackedDataset
"""What a loader deals: pairs, or packed rows of them (data.loaders.train_order)."""


def pairs_of(dataset: Items) -> TokenizedDataset:
    return dataset.base if isinstance(dataset, PackedDataset) else dataset


def train_items(dataset: Items, sampler: Any, cfg: RunConfig, batch: BatchShape) -> list[int]:
    """The train pairs the run's steps read, on every rank: those of the rows (or pairs) the
    loader's global order deals in ``max_steps`` steps (``dataset`` and ``sampler``: the
    loader's own, from data.loaders.train_order; any rank's, the order is global); every one
    with length-grouped batches."""
    if not isinstance(sampler, GlobalOrderSampler):
        return list(range(len(pairs_of(dataset))))
    seen = sampler.visited(cfg.trainer.max_steps, batch.global_batch)
    if isinstance(dataset, PackedDataset):
        return sorted(i for r in seen for i in dataset.bins[r])
    return sorted(seen)


def _rows(data: TokenizedDataset, items: list[int], batch: BatchShape) -> list[list[list[int]]]:
    """``items`` packed into rows of max_seq_len, grouped a micro batch's rows per forward."""
    lengths = [data.lengths[i] for i in items]
    rows = [[items[j] for j in b] for b in pack_bins(lengths, batch.row_tokens)]
    micro = batch.micro_batch
    return [rows[a : a + micro] for a in range(0, len(rows), micro)]


def _collated(
    data: TokenizedDataset, rows: list[list[int]], pad_id: int, min_rows: int = 0
) -> dict[str, torch.Tensor]:
    """``rows`` of items collated; ``min_rows``: label-free rows fill it up to that many
    (sequence-parallel attention takes micro_batch_size rows, no fewer)."""
    samples = [[data[i] for i in row] for row in rows]
    samples += [[blank_sample(samples[0][0])]] * (min_rows - len(samples))
    return _collate(samples, pad_id)


def compute(
    engine: Any,
    data: TokenizedDataset,
    items: list[int],
    batch: BatchShape,
    pad_id: int,
    device: torch.device,
    groups: SequenceGroups | None = None,
) -> torch.Tensor:
    """``[len(data), 2]`` (chosen, rejected) reference log-probabilities, NaN for items not in
    ``items``. A collective: every data-parallel group takes its share and runs as many
    forwards as the busiest one (ZeRO-3 gathers parameters in each); under sequence
    parallelism (``groups``) the ranks of a group run the same rows, each its shard, and the
    group's first rank keeps the values."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if groups is None:
        groups = SequenceGroups.of(dist.get_rank() if world > 1 else 0, world, 1)
    batches = _rows(data, items[groups.dp_rank :: groups.dp], batch)  # collated one at a time
    n = torch.tensor([len(batches)], device=device)
    if world > 1:
        dist.all_reduce(n, op=dist.ReduceOp.MAX)
    filler = batches[0] if batches else [[0]]  # a forward whose values are not kept
    table = torch.zeros(len(data), 2, dtype=torch.float64, device=device)
    filled = torch.zeros(len(data), dtype=torch.float64, device=device)
    was_training = engine.training
    engine.eval()
    with torch.no_grad():
        for k in range(int(n.item())):
            rows = batches[k] if k < len(batches) else filler
            full = batch.micro_batch if groups.sp > 1 else 0
            collated = _collated(data, rows, pad_id, full)
            if groups.sp > 1:
                collated = shard_batch(collated, groups, pad_id)
            inputs = {key: v.to(device) for key, v in collated.items() if key in MODEL_INPUTS}
            logps = engine(**inputs, reference_pass=True).double()
            if k < len(batches) and groups.sp_rank == 0:
                index = inputs["pair_index"]
                real = index >= 0
                table[index[real]] = logps[real]
                filled[index[real]] = 1.0
    if was_training:
        engine.train()
    if world > 1:
        dist.all_reduce(table)
        dist.all_reduce(filled)
    table[filled == 0] = float("nan")
    return table.cpu()


class References:
    """The run's reference tables (``train``, ``val``) and the batches they complete."""

    def __init__(self, tables: dict[str, torch.Tensor]):
        self.tables = tables

    def attach(self, batch: dict[str, torch.Tensor], split: str = "train") -> dict[str, Any]:
        """``batch`` with ``reference_logps`` ([pairs, 2]; zeros for fillers)."""
        table = self.tables[split]
        index = batch["pair_index"]
        real = (index >= 0)[:, None]
        values = torch.where(real, table[index.clamp(min=0)], 0.0)
        missing = index[(index >= 0) & values.isnan().any(dim=1)]
        if missing.numel():
            raise RuntimeError(
                f"{split} pair {int(missing[0])} has no precomputed reference log-probability: "
                "the table does not cover the pairs this step reads, which is a memtune bug "
                "(please report it); preference.reference=live computes the reference in each "
                "step instead"
            )
        return batch | {"reference_logps": values}

    def attached(
        self, batches: Iterator[dict[str, torch.Tensor]], split: str = "train"
    ) -> Iterator[dict[str, Any]]:
        return (self.attach(b, split) for b in batches)


def prepare(
    engine: Any,
    cfg: RunConfig,
    d: Decisions,
    rd: RunDir,
    data_dir: str,
    loader: tuple[Items, Any],
    pad_id: int,
    device: torch.device,
    with_val: bool,
    say: Callable[[str], None],
    groups: SequenceGroups | None = None,
) -> References:
    """The tables of this run: read from ``RUN_DIR/reference`` when their key matches, else
    computed (and saved by rank 0). ``loader``: the rank's train dataset and sampler, whose
    order says which pairs the steps read."""
    key = reference_key(cfg, d, rd, data_dir)
    folder = rd.reference
    rank = dist.get_rank() if dist.is_initialized() else 0
    saved = _read(folder, key, say if rank == 0 else None)
    usable = saved is not None and ("val" in saved) == with_val
    # Every rank computes, or none: compute() is a collective, and a rank that cannot read the
    # saved tables (a filesystem's cache, a damaged file) must not leave the others in it.
    agreed = torch.tensor([float(usable)], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    if saved is not None and agreed.item() == 1.0:
        say(f"memtune: reference log-probabilities read from {folder} (key {key})")
        return References(saved)
    start = time.perf_counter()
    train = pairs_of(loader[0])
    items = train_items(*loader, cfg, d.batch)
    tables = {"train": compute(engine, train, items, d.batch, pad_id, device, groups)}
    counted = f"{len(items):,} train pairs"
    val = load_split(data_dir, "val") if with_val else None
    if val is not None and len(val):
        every = list(range(len(val)))
        tables["val"] = compute(engine, val, every, d.batch, pad_id, device, groups)
        counted += f" and {len(val):,} validation pairs"
    if rank == 0:
        _write(folder, key, tables)
    which = (
        "the adapter of peft.init_from as loaded"
        if cfg.peft.init_from
        else "the base without the adapter"
    )
    say(
        f"memtune: reference log-probabilities of {counted} computed in "
        f"{time.perf_counter() - start:.1f} s ({which}; saved in {folder})"
    )
    return References(tables)


TABLES = "logps.safetensors"

REFERENCE_TABLES = Store("reference folder", FORMAT, required=(TABLES,))
"""``RUN_DIR/reference/``: the tables and their manifest (memtune.integrity). A damaged one is
set aside as ``RUN_DIR/.damaged-reference.XXXX`` and computed again."""


def _read(
    folder: Path, key: str, say: Callable[[str], None] | None = None
) -> dict[str, torch.Tensor] | None:
    """The saved tables when they verify and were computed under ``key`` (kept in the file's
    metadata). Damaged ones: None, and with ``say`` (rank 0) set aside with one line."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    path = folder / TABLES
    if not path.is_file():
        return None
    problem = REFERENCE_TABLES.problem(folder)
    if problem is None:
        try:
            with safe_open(str(path), framework="pt") as f:
                if (f.metadata() or {}).get("key") != key:
                    return None  # another computation's: recomputed and replaced, not damaged
            return dict(load_file(str(path)))
        except (OSError, SafetensorError) as err:  # a file written wrong, listed as written
            problem = f"{path} cannot be read ({err})"
    if say is not None:
        try:
            aside = REFERENCE_TABLES.set_aside(folder)
        except OSError as err:
            say(
                f"memtune: {REFERENCE_TABLES.name} {folder} was damaged ({problem}) and cannot "
                f"be set aside ({err.strerror}); computing them again"
            )
        else:
            say(REFERENCE_TABLES.damaged_line(folder, problem, aside, "computing them again"))
    return None


def _write(folder: Path, key: str, tables: dict[str, torch.Tensor]) -> None:
    """The tables and their key in one file, through a temporary name renamed into place, then
    the folder's manifest: a reader sees complete tables, or none (a folder whose manifest is
    missing or does not list these bytes is never read).

    The file is written in a directory of its own beside the folder,
    ``.reference.tmp-<host>-<pid>-XXXXXXXX`` (:func:`owned_temp_dir`), and renamed out of it:
    safetensors writes through a temporary file of its own (``.tmpXXXXXX``), so a kill during
    the write (kill -9, the OOM killer) left that file in the folder, as large as the tables,
    under a name no writer can tell from a user's, and every later manifest listed it (hashed
    at every read). Now a kill leaves only that directory, outside what the manifest lists,
    which the next write removes with a line (:func:`remove_left_by_dead`)."""
    from safetensors.torch import save_file

    folder.mkdir(exist_ok=True)
    prefix = f".{folder.name}.tmp-"
    remove_left_by_dead(folder.parent, prefix, "a write of the reference tables")
    staging = owned_temp_dir(folder.parent, prefix)
    try:
        tmp = staging / TABLES
        # one entry (FORMAT is in the key): safetensors orders several at random
        meta = {"key": key}
        save_file({k: v.contiguous() for k, v in tables.items()}, str(tmp), metadata=meta)
        (folder / MANIFEST).unlink(missing_ok=True)  # the old tables' list goes first
        follow_umask(tmp)  # safetensors writes 0600: the user's umask decides, as for any file
        tmp.replace(folder / TABLES)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    REFERENCE_TABLES.seal(folder)
