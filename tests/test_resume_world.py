"""Resume on another number of ranks (and ZeRO stage): a checkpoint's gathered trainable state
(checkpoints.GATHERED) loads on any world size, and the sample order is one global sequence,
so steps 11-20 after a resume on 1 rank are the steps an uninterrupted 2-rank run takes."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import FAST, ROOT, run_train_py

pytestmark = pytest.mark.slow

STEPS = ["trainer.max_steps=20", "trainer.save_every=10", "trainer.global_batch_size=16"]
MOE = ["peft.target=all-linear", "peft.dropout=0"]
VISION = ["data=demo-vl", "data.template=chatml", "peft.dropout=0"]


def _losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


def _train(run_dir: Path, *args: str):
    proc = run_train_py([*FAST, *STEPS, f"run_dir={run_dir}", *args], cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def _back_to_step_10(full: Path, into: Path) -> Path:
    """A copy of a finished run as it stood after its step-10 checkpoint."""
    shutil.copytree(full, into)
    ckpts = into / "checkpoints"
    shutil.rmtree(ckpts / "step-0000020")
    (ckpts / "latest").write_text("step-0000010\n")
    shutil.rmtree(into / "adapter")
    (into / "summary.json").unlink()
    return into


@pytest.mark.faults
@pytest.mark.parametrize(
    ("zero", "ranks_before", "ranks_after", "extra"),
    # Each stage both ways, each stage padded and packed (the demo packs by default).
    [
        ("zero2", 2, 1, ["data.packing=false"]),
        ("zero2", 1, 2, ["data.packing=true", "data.max_seq_len=128"]),
        ("zero3", 1, 2, ["data.packing=false"]),
        ("zero3", 2, 1, ["data.packing=true", "data.max_seq_len=128"]),
        # The LoRA variants: an OLoRA start (the residual base rebuilt the same way), LoRA+'s
        # two parameter groups, DoRA's magnitudes, a per-module rank. OLoRA's adapters start
        # with the weights' top directions: at the demo's lr (5e-3) its steps are chaotic
        # (grad norms of 200), and 1e-7 of reduction order grows to 1e-3 within ten steps.
        ("zero3", 2, 1, ["peft.init=olora", "peft.loraplus_lr_ratio=2", "trainer.lr=5e-4"]),
        (
            "zero2",
            1,
            2,
            ["peft.dora=true", "peft.rank_pattern={down_proj: 4}", "peft.loraplus_lr_ratio=2"],
        ),
        # Mixtures of experts: the routed experts' adapters (rank.experts), with LoRA+ over
        # them, on the hybrid Qwen3.5-MoE over int8 expert stacks (LLM.int8 for its linear
        # layers); a Qwen3-MoE over 4-bit expert stacks. (Trained
        # routers, or their balance loss added, are left out: a top-k pick then flips on 1e-7
        # of reduction order, and the runs part by ~1e-4 within five steps, measured.)
        (
            "zero2",
            2,
            1,
            [
                *MOE,
                "model=tiny-qwen3.5-moe",
                "data.template=qwen3_5",
                "peft=lora-int8",  # the routed-expert stacks int8 too (rank.experts)
                "peft.loraplus_lr_ratio=2",
            ],
        ),
        ("zero3", 1, 2, [*MOE, "model=tiny-qwen3-moe", "peft=qlora-nf4"]),
        # Images (#49): a tiny Qwen3-VL on the bundled image demo set, packed, LoRA on the
        # language model and on the tower (its gathered state resumed with the rest).
        ("zero3", 2, 1, [*VISION, "model=tiny-qwen3-vl", "peft.target=all-linear-and-vision"]),
    ],
    ids=[
        "zero2-padded-2to1",
        "zero2-packed-1to2",
        "zero3-padded-1to2",
        "zero3-packed-2to1",
        "zero3-olora-loraplus-2to1",
        "zero2-dora-pattern-1to2",
        "zero2-moe-hybrid-int8-loraplus-2to1",
        "zero3-moe-qlora-1to2",
        "zero3-images-2to1",
    ],
)
def test_resume_on_another_world_size_continues_the_same_run(
    tmp_path: Path, zero: str, ranks_before: int, ranks_after: int, extra: list[str]
) -> None:
    args = [f"zero={zero}", *extra]
    full = tmp_path / "full"
    _train(full, *args, f"launcher.num_ranks={ranks_before}")
    resumed = _back_to_step_10(full, tmp_path / "resumed")
    proc = _train(resumed, *args, f"launcher.num_ranks={ranks_after}")
    assert "resuming across a change of ranks or ZeRO stage" in proc.stdout
    changed = json.loads((resumed / "resume.json").read_text())["changed"]
    assert changed["launcher.num_ranks"] == [ranks_before, ranks_after]
    want, got = _losses(full), _losses(resumed)
    assert sorted(got) == list(range(1, 21))
    # Same samples in every step; only the reduction order (ranks, accumulation) differs:
    # fp32 sums agree to ~1e-6 relative. LLM.int8 layers round their inputs to 1/127 of each
    # row's range, so that order's noise flips some roundings: the int8 run parted by 1.6e-4
    # at step 19 with the grouped experts forward (< 1e-4 with the loop; with float stacks and
    # layers the grouped run stays within 1e-4), measured 2026-12-04.
    rel = 1e-3 if "peft=lora-int8" in extra else 1e-4
    for step in range(11, 21):
        assert got[step] == pytest.approx(want[step], rel=rel, abs=1e-5), step
    a = load_file(str(full / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(resumed / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys()
    # the int8 run's adapters: 45 of 8,192 weights of one tensor 1e-5..8.6e-5 apart (2026-12-04);
    # 2.5e-4 is 5% of one Adam step at the demo's lr
    atol = 2.5e-4 if "peft=lora-int8" in extra else 1e-5
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-3, atol=atol)
    if "peft.init=olora" in extra:
        _the_export_is_memtunes_model_on_the_released_base(full)


def _the_export_is_memtunes_model_on_the_released_base(run_dir: Path) -> None:
    """An OLoRA start trained on 2 ranks: plain peft on the released base + the exported
    (converted) adapter computes what memtune's own model computes — the residual base its
    ranks build (the same decomposition, rank.model.add_lora) with the trained weights of the
    last checkpoint (its gathered fp32 state)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from memtune.config import load_run_config
    from memtune.rank.model import add_lora, load_base_model
    from memtune.rundir import RunDir

    cfg = load_run_config(run_dir / "config.yaml")
    d = dataclasses.replace(RunDir(run_dir).read_decisions(), attention="sdpa")
    ours = add_lora(load_base_model(cfg, d), cfg, d).eval()
    state = load_file(str(run_dir / "checkpoints" / "step-0000020" / "gathered_state.safetensors"))
    with torch.no_grad():
        for name, param in ours.named_parameters():
            if param.requires_grad:
                param.copy_(state[f"{name}::fp32"].view_as(param))
    base = AutoModelForCausalLM.from_pretrained(cfg.model.name_or_path, dtype=torch.float32)
    plain = PeftModel.from_pretrained(base, str(run_dir / "adapter")).eval()
    ids = torch.randint(5, 1000, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, ours(ids).logits, rtol=1e-4, atol=1e-4)


def test_a_changed_global_batch_is_refused_before_launch(zero2_run, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(zero2_run.dir, run_dir)
    proc = run_train_py(
        [
            *FAST,
            f"run_dir={run_dir}",
            "zero=zero2",
            "launcher.num_ranks=1",
            "trainer.global_batch_size=32",
        ],
        cwd=ROOT,
    )
    assert proc.returncode == 2
    assert "trainer.global_batch_size: checkpoint 16, now 32" in proc.stderr


def test_8bit_adamw_keeps_the_world_size_and_says_why(adamw8bit_run, tmp_path: Path) -> None:
    """bitsandbytes' 8-bit state is not gathered: another number of ranks is refused by name."""
    run_dir = tmp_path / "run"
    shutil.copytree(adamw8bit_run.dir, run_dir)
    ckpt = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    assert not (ckpt / "gathered_state.safetensors").exists()
    proc = run_train_py(
        [
            *FAST,
            f"run_dir={run_dir}",
            "trainer.optimizer=adamw_8bit",
            "trainer.optim_8bit_min_size=0",
            "launcher.num_ranks=1",
            "zero=zero2",
        ],
        cwd=ROOT,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "optimizer state is saved per rank only (8-bit AdamW" in proc.stderr
