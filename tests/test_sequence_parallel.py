"""Sequence parallelism on real CPU ranks: DeepSpeed's Ulysses attention over gloo's
all-to-all, each sequence split over 2 ranks, against the same global batch on 1 rank."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from memtune.config import ConfigError, compose, to_run_config, validate
from memtune.config.deepspeed import build_ds_config
from memtune.data.batching import collate_packed, collate_padded
from memtune.data.encode import IGNORE_INDEX, Sample
from memtune.rank.loss import next_token_targets
from memtune.rank.sequence_parallel import SequenceGroups, pad_width, shard_batch
from tests.conftest import FAST, ROOT, Run, _finished, decided, run_train_py, start_run


def _samples() -> list[Sample]:
    """Three samples of 5, 7 and 6 tokens, labels on their second half."""
    out = []
    for start, n in ((10, 5), (20, 7), (40, 6)):
        ids = list(range(start, start + n))
        out.append(Sample(ids, [IGNORE_INDEX] * (n // 2) + ids[n // 2 :]))
    return out


def _shards(batch: dict, sp: int) -> list[dict]:
    return [shard_batch(dict(batch), SequenceGroups.of(r, sp, sp), 0) for r in range(sp)]


@pytest.mark.parametrize("sp", [2, 4])
def test_shards_put_every_target_once_and_keep_the_rows_boundaries(sp: int) -> None:
    a, b, c = _samples()
    batch = collate_packed([[a, b], [c]], pad_token_id=0)  # width 12: rows of 12 and 6 tokens
    shards = _shards(batch, sp)
    width = 12 + (-12 % sp)
    assert all(s["input_ids"].shape == (2, width // sp) for s in shards)
    # The targets, shifted before the cut, are the whole rows' targets in order: a shard
    # boundary neither loses nor duplicates one (the sample b crosses the boundary at 6).
    whole = next_token_targets(pad_width(batch, sp, 0)["labels"])
    torch.testing.assert_close(torch.cat([s["shift_labels"] for s in shards], dim=1), whole)
    positions = torch.cat([s["position_ids"] for s in shards], dim=1)
    assert positions[0, :12].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]
    # The rows' sample boundaries are kept whole, moved to the padded width.
    row2 = width
    assert shards[0]["cu_seq_lens"].tolist() == [0, 5, row2, row2 + 6, 2 * width]
    assert all(s["cu_seq_lens"] is shards[0]["cu_seq_lens"] for s in shards)
    assert sum(int(s["real_tokens"]) for s in shards) == 18
    assert "attention_mask" not in shards[0] and "labels" not in shards[0]


def test_shards_of_pairs_give_each_sequence_its_targets_once_and_count_the_pairs_once() -> None:
    """Two pairs (chosen, rejected) in one row of 13 tokens, cut in 2 (width 14): the shards'
    (target, sequence) positions are the whole row's, so the two ranks' per-sequence sums add
    up to the sequence's; the pairs and their reference values travel whole, counted once."""
    one = Sample([1, 2, 3, 4, 5, 6, 7], [-100, -100, 3, 4, -100, 6, 7], split=4, index=5)
    two = Sample([8, 9, 10, 11, 12, 13], [-100, 9, 10, -100, 12, 13], split=3, index=2)
    batch = collate_packed([[one, two]], pad_token_id=0)
    batch["reference_logps"] = torch.tensor([[-1.0, -2.0], [-3.0, -4.0]])
    shards = _shards(batch, 2)
    whole = pad_width(batch, 2, 0)
    assert whole["sequence_index"].shape == (1, 14) and whole["sequence_index"][0, -1] == -1
    targets = torch.cat([s["shift_labels"] for s in shards], dim=1)
    sequence = torch.cat([s["shift_sequence_index"] for s in shards], dim=1)
    torch.testing.assert_close(targets, next_token_targets(whole["labels"]))
    # Each target position belongs to the sequence of the token it predicts.
    kept = targets[0] != IGNORE_INDEX
    assert targets[0][kept].tolist() == [3, 4, 6, 7, 9, 10, 12, 13]
    assert sequence[0][kept].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert all(s["pair_index"].tolist() == [5, 2] for s in shards)
    assert all(s["reference_logps"] is batch["reference_logps"] for s in shards)
    assert [int(s["loss_pairs"]) for s in shards] == [2, 0]


def test_padded_rows_get_positions_and_count_only_real_tokens() -> None:
    a, b, _ = _samples()
    shards = _shards(collate_padded([a, b], pad_token_id=0), 2)  # width 7 → 8
    positions = torch.cat([s["position_ids"] for s in shards], dim=1)
    assert positions.tolist() == [list(range(8))] * 2
    assert sum(int(s["real_tokens"]) for s in shards) == 12
    assert "cu_seq_lens" not in shards[0]


@pytest.mark.slow
def test_a_packed_demo_row_has_a_sample_across_the_shard_boundary(zero3_run: Run) -> None:
    """The runs below would not test the boundary if no sample crossed it."""
    from memtune.data.loaders import make_loader

    cfg, d = zero3_run.cfg, zero3_run.decisions
    assert d is not None
    data_dir = json.loads((zero3_run.dir / "data.json").read_text())["dir"]
    loader, _ = make_loader(cfg, d.batch, data_dir, 0, 0, 1)
    batch = next(iter(loader))
    width = batch["input_ids"].shape[1]
    cu = batch["cu_seq_lens"].tolist()
    middles = [r * width + width // 2 for r in range(batch["input_ids"].shape[0])]
    assert any(a < m < b for a, b in itertools.pairwise(cu) for m in middles)


def _cfg(*overrides: str):
    return to_run_config(compose(list(overrides)))


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["launcher.num_ranks=4", "trainer.sequence_parallel=3"], "does not divide launcher"),
        (
            ["launcher.num_ranks=3", "trainer.sequence_parallel=3", "trainer.global_batch_size=12"],
            "must divide the model's 4 attention heads",
        ),
        (
            ["launcher.num_ranks=2", "trainer.sequence_parallel=2", "data.max_seq_len=127"],
            "must divide data.max_seq_len=127",
        ),
        (
            [
                "launcher.num_ranks=2",
                "trainer.sequence_parallel=2",
                "model.attn_implementation=eager",
            ],
            "model.attn_implementation=eager",
        ),
        (["launcher.num_ranks=2", "trainer.sequence_parallel=two"], "choose auto | 1 | 2"),
        (
            ["launcher.num_ranks=4", "trainer.sequence_parallel=2", "trainer.global_batch_size=4"],
            "micro_batch_size × data-parallel ranks",
        ),
    ],
    ids=["ranks", "heads", "length", "eager", "word", "batch"],
)
def test_a_bad_split_is_refused_naming_the_rule(overrides: list[str], says: str) -> None:
    with pytest.raises(ConfigError, match=r"trainer\.sequence_parallel|global_batch") as err:
        validate(_cfg(*overrides), inputs=False)
    assert says in str(err.value)


def test_qwen25_7b_can_split_over_1_2_4_ranks() -> None:
    for sp in (1, 2, 4):
        split = [f"launcher.num_ranks={sp}", f"trainer.sequence_parallel={sp}"]
        validate(_cfg("model=qwen2.5-7b", *split), inputs=False)
    seven = ["launcher.num_ranks=7", "trainer.sequence_parallel=7", "trainer.global_batch_size=28"]
    with pytest.raises(ConfigError, match=r"4 KV heads .* choose one of 1, 2, 4, 28"):
        validate(_cfg("model=qwen2.5-7b", *seven), inputs=False)


def test_the_deepspeed_json_counts_data_parallel_ranks() -> None:
    cfg = _cfg("launcher.num_ranks=4", "trainer.sequence_parallel=2", "zero=zero3")
    ds = build_ds_config(cfg, decided(cfg))
    assert ds["sequence_parallel_size"] == 2
    assert ds["zero_optimization"]["reduce_scatter"] is True
    # global 16 = micro 4 × accumulation 2 × 2 data-parallel groups
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (4, 2)


# --- real ranks -------------------------------------------------------------------------------

SP2 = ["launcher.num_ranks=2", "trainer.sequence_parallel=2"]


def _trained(root: Path, name: str, *overrides: str) -> Run:
    """A finished run of memtune.worker itself (the test probe's extra forward passes on a
    1-row batch are not sharded)."""
    run = start_run(root / name, [*FAST, *overrides], probe=False)
    assert run.code == 0, f"{name}: the ranks exited with {run.code}"
    return run


def _metric(run: Run, key: str) -> list[float]:
    return [m[key] for m in run.metrics() if key in m]


def _same_training(a: Run, b: Run, rel: float = 1e-5) -> None:
    """fp32, same samples per step: only the order of additions differs (the loss summed per
    shard then over ranks, gradients summed over the group): ~1e-7 relative per step."""
    assert len(a.losses()) == len(b.losses())
    for key in ("train/loss", "train/grad_norm", "train/label_tokens", "train/input_tokens"):
        torch.testing.assert_close(
            torch.tensor(_metric(a, key), dtype=torch.float64),
            torch.tensor(_metric(b, key), dtype=torch.float64),
            rtol=rel,
            atol=1e-7,
            msg=key,
        )
    ta = load_file(str(a.dir / "adapter" / "adapter_model.safetensors"))
    tb = load_file(str(b.dir / "adapter" / "adapter_model.safetensors"))
    assert ta.keys() == tb.keys() and any("mlp" in k for k in ta)
    # Per tensor, relative to its norm (Adam divides by √v: an entry whose v is tiny moves
    # elementwise far more than its neighbours for the same 1e-7 difference in its gradient).
    # Measured 1.7e-5 for sp=2 after 12 steps, 1.04e-4 after 6 padded steps with torch's AVX2
    # kernels on an AVX-512 CPU (ATEN_CPU_CAPABILITY=avx2); a missing sp factor in the
    # gradient gives ~1e-1.
    for key in ta:
        drift = float((tb[key] - ta[key]).norm() / ta[key].norm())
        assert drift < 1e-3, (key, drift)


@pytest.fixture(scope="module")
def sp2_zero3(runs_root: Path) -> Run:
    return _trained(
        runs_root,
        "sp2-zero3",
        "zero=zero3",
        *SP2,
        "trainer.loss_chunk_tokens=16",
        "trainer.save_every=6",
    )


@pytest.mark.slow
def test_sp2_on_2_ranks_trains_as_1_rank_packed_zero3(sp2_zero3: Run, one_rank_run: Run) -> None:
    assert sp2_zero3.summary()["world_size"] == 2
    _same_training(sp2_zero3, one_rank_run)


@pytest.mark.slow
def test_sp2_padded_zero2_with_evaluation_trains_as_1_rank(runs_root: Path) -> None:
    padded = ["zero=zero2", "data.packing=false", "data.val_fraction=0.1", "trainer.max_steps=6"]
    one = _finished(runs_root, "padded-1", *padded, "launcher.num_ranks=1")
    two = _trained(runs_root, "padded-sp2", *padded, *SP2)
    _same_training(two, one)
    assert two.summary()["eval_loss"] == pytest.approx(one.summary()["eval_loss"], rel=1e-5)


@pytest.mark.slow
def test_two_data_parallel_groups_of_two_train_as_1_rank(runs_root: Path, one_rank_run: Run):
    """4 ranks: dp 2 × sp 2, micro 4 × accumulation 2 × 2 groups = the 1-rank global 16."""
    run = _trained(
        runs_root, "dp2-sp2", "zero=zero3", "launcher.num_ranks=4", "trainer.sequence_parallel=2"
    )
    _same_training(run, one_rank_run)


@pytest.mark.slow
@pytest.mark.faults
def test_a_resume_with_sp2_is_exact(sp2_zero3: Run, tmp_path: Path) -> None:
    resumed = tmp_path / "resumed"
    shutil.copytree(sp2_zero3.dir, resumed)
    ckpts = resumed / "checkpoints"
    shutil.rmtree(ckpts / "step-0000012")
    (ckpts / "latest").write_text("step-0000006\n")
    shutil.rmtree(resumed / "adapter")
    (resumed / "summary.json").unlink()
    args = [*FAST, "zero=zero3", *SP2, "trainer.loss_chunk_tokens=16", "trainer.save_every=6"]
    proc = run_train_py([*args, f"run_dir={resumed}"], cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "resumed at step 6" in proc.stdout
    again = Run(resumed, sp2_zero3.cfg, 0)
    assert again.losses() == sp2_zero3.losses()  # same ranks, same order: bit for bit
    a = load_file(str(sp2_zero3.dir / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(resumed / "adapter" / "adapter_model.safetensors"))
    for key in a:
        assert torch.equal(a[key], b[key]), key
