"""Real DeepSpeed launches on CPU (gloo): 2 ranks under ZeRO-2 and ZeRO-3, and 1 rank.

Each launch runs once per session (conftest fixtures) and is shared by the tests here.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from memtune.launcher.spawn import visible_devices

pytestmark = pytest.mark.slow


def _falls(losses: list[float]) -> bool:
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    return last < first - 0.5


@pytest.mark.parametrize("run_name", ["zero3_run", "zero2_run"])
def test_two_ranks_train(run_name: str, request: pytest.FixtureRequest) -> None:
    run = request.getfixturevalue(run_name)
    losses = run.losses()
    assert len(losses) == run.cfg.trainer.max_steps
    assert _falls(losses), losses
    summary = run.summary()
    assert summary["world_size"] == 2
    assert summary["steps"] == run.cfg.trainer.max_steps
    assert len(summary["peak_memory_gib"]) == 2 and min(summary["peak_memory_gib"]) > 0
    for probe in run.probes():
        assert probe["world_size"] == 2
        # Frozen base weights are bit-identical to the checkpoint on disk.
        assert probe["base_tensors_checked"] > 20
        assert probe["base_changed"] == []
        assert probe["lora_b_tensors"] == 2 * 7 and probe["lora_b_all_zero"] == []


def test_zero3_partitions_parameters(zero3_run, zero2_run) -> None:
    for probe in zero3_run.probes():
        assert probe["zero3"]
        # Each of 2 ranks holds about half (ZeRO-3 pads every tensor to an even split).
        assert 0.49 < probe["held_params"] / probe["total_params"] < 0.52
    for probe in zero2_run.probes():
        assert not probe["zero3"] and probe["held_params"] == probe["total_params"]


@pytest.mark.parametrize("run_name", ["zero3_run", "zero2_run"])
def test_saved_adapter_reproduces_trained_logits(run_name: str, request) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run = request.getfixturevalue(run_name)
    adapter = run.dir / "adapter"
    assert (adapter / "adapter_config.json").is_file()
    tensors = load_file(adapter / "adapter_model.safetensors")
    assert len(tensors) == 2 * 7 * 2  # 2 layers × 7 projections × (A, B)
    assert all(t.numel() > 0 for t in tensors.values())
    assert all(torch.any(t != 0) for k, t in tensors.items() if "lora_B" in k)
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == run.cfg.peft.r
    assert (adapter / "tokenizer.json").is_file()

    base = AutoModelForCausalLM.from_pretrained(run.cfg.model.name_or_path, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter).eval()
    probe = torch.load(run.dir / "probe_logits.pt", weights_only=True)
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"]).logits
    # fp32 on CPU, same kernels: only reduction order differs (ZeRO gathers, gloo sums).
    torch.testing.assert_close(logits, probe["logits"], rtol=1e-4, atol=1e-4)


def test_adapter_changes_the_model(zero3_run) -> None:
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(zero3_run.cfg.model.name_or_path)
    probe = torch.load(zero3_run.dir / "probe_logits.pt", weights_only=True)
    with torch.no_grad():
        base_logits = base(input_ids=probe["input_ids"]).logits
    assert (base_logits - probe["logits"]).abs().max() > 0.1


def test_bf16_zero3_trains_and_exports(bf16_run) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    assert _falls(bf16_run.losses()), bf16_run.losses()
    assert json.loads((bf16_run.dir / "ds_config.json").read_text())["bf16"]["enabled"] is True
    for probe in bf16_run.probes():
        assert probe["base_changed"] == [] and probe["lora_b_all_zero"] == []
    tensors = load_file(bf16_run.dir / "adapter" / "adapter_model.safetensors")
    # Adapters train in the compute dtype (model.cast_adapters; fp32 masters stay in the
    # optimizer); the export keeps the dtype they trained in.
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    # Reload as trained: bf16 base, adapter in its saved dtype.
    base = AutoModelForCausalLM.from_pretrained(
        bf16_run.cfg.model.name_or_path, dtype=torch.bfloat16
    )
    model = PeftModel.from_pretrained(
        base, bf16_run.dir / "adapter", autocast_adapter_dtype=False
    ).eval()
    probe = torch.load(bf16_run.dir / "probe_logits.pt", weights_only=True)
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"]).logits.float()
    # bf16 has 8 mantissa bits: logits of magnitude ~10 are exact to ~0.05.
    torch.testing.assert_close(logits, probe["logits"], rtol=2e-2, atol=1e-1)


def test_one_rank_matches_two_ranks(zero3_run, one_rank_run) -> None:
    """Same global batch and data order: 2 ranks × micro 4 × accum 2 == 1 rank × accum 4."""
    two, one = zero3_run.losses(), one_rank_run.losses()
    assert one_rank_run.summary()["world_size"] == 1
    assert len(one) == len(two)
    # fp32; gloo's all-reduce and the per-rank partial sums reorder additions, ~1e-6 relative
    # per step, compounding a little over 12 Adam steps.
    torch.testing.assert_close(torch.tensor(one), torch.tensor(two), rtol=1e-4, atol=1e-4)


def test_metrics_and_run_dir_contents(zero3_run) -> None:
    rows = zero3_run.metrics()
    assert [r["step"] for r in rows] == list(range(1, zero3_run.cfg.trainer.max_steps + 1))
    first = rows[0]
    assert set(first["memory"]) == {"rank0", "rank1"}
    assert first["train/label_tokens"] > 0 and first["perf/tokens_per_s"] > 0
    # Warmup then cosine: lr rises for warmup_steps, then falls.
    lrs = [r["train/lr"] for r in rows]
    assert lrs[0] < lrs[1] < lrs[2] and lrs[-1] < lrs[3]
    for name in ("config.yaml", "ds_config.json", "metrics.jsonl", "summary.json", "launch.txt"):
        assert (zero3_run.dir / name).is_file(), name
    # One line per rank: its environment, then the command (a shell can run each).
    lines = (zero3_run.dir / "launch.txt").read_text().splitlines()
    devices = visible_devices(2)
    for rank, line in enumerate(lines):
        words = line.split()
        assert f"RANK={rank}" in words and "WORLD_SIZE=2" in words
        assert f"CUDA_VISIBLE_DEVICES={devices}" in words  # two ranks, on this node
        assert words[-4:] == ["-u", "-m", "rank_probe", str(zero3_run.dir)]
    assert len(lines) == 2
