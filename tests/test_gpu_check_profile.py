"""The GPU check's profile phases put each operator in one kind by what it is and where it
runs (bench/gpu_check/profile.py); the phases themselves run in .ci/run's dry run."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import ROOT


@pytest.fixture(scope="module")
def profile():
    import sys

    sys.path.insert(0, str(ROOT))
    from bench.gpu_check import profile as module

    return module


def test_each_operator_has_one_kind_by_shape_and_scope(profile) -> None:
    kind, r, vocab = profile.kind_of, 16, 152064
    assert kind("aten::mm", [[2048, 3584], [3584, 18944]], set(), r, vocab) == "base GEMMs"
    assert kind("aten::mm", [[2048, 3584], [3584, 16]], set(), r, vocab) == "LoRA GEMMs"
    assert kind("aten::mm", [[512, 3584], [3584, 152064]], set(), r, vocab) == "loss head"
    assert kind("aten::_log_softmax", [], set(), r, vocab) == "loss head"
    assert kind("aten::bernoulli_", [[2048, 3584]], set(), r, vocab) == "LoRA dropout"
    assert kind("aten::_flash_attention_forward", [], set(), r, vocab) == "attention"
    assert kind("aten::rsqrt", [], set(), r, vocab) == "norms and elementwise"
    assert kind("aten::copy_", [], set(), r, vocab) == "copies"
    assert kind("nccl:all_reduce", [], set(), r, vocab) == "communication"
    # the scope decides first: a GEMM in the recompute, anything in the optimizer step
    recompute = {"autograd::engine::evaluate_function: X", profile.SCOPE_RECOMPUTE}
    assert kind("aten::mm", [[2048, 3584], [3584, 16]], recompute, r, vocab).startswith("recompute")
    optimizer = {profile.SCOPE_OPTIMIZER}
    assert kind("aten::_foreach_mul_", [], optimizer, r, vocab) == "optimizer and ZeRO"
    assert kind("dequantize_4bit", [], set(), r, vocab) == "4-bit dequantization"


def test_bench_readme_lists_every_phase_in_order_with_its_budget(profile) -> None:
    """bench/README.md's phase table and its list of the plain run's phases are PHASES, in
    priority order, with each phase's need and cap (bench/gpu_check/phases.py)."""
    import re

    from bench.gpu_check import phases

    text = (ROOT / "bench" / "README.md").read_text()
    table = re.findall(r"^\| `([\w-]+)`[^|]*\| (\d+) \| (\d+) \|$", text, re.M)
    assert table == [(p.name, str(p.need_s), str(p.cap_s)) for p in phases.PHASES]
    listed = re.search(r"Each of the (\w+) phases \(([^;]*);", text, re.S)
    assert listed is not None
    plain = [p.name for p in phases.select(None)]
    assert re.findall(r"`([\w-]+)`", listed.group(2)) == plain
    assert listed.group(1) == "sixteen" and len(plain) == 16


def test_zero_costs_table_gives_both_steps_and_the_difference(profile) -> None:
    from bench.gpu_check.zero_cost import zero_cost_markdown

    z = {
        "method": "lora",
        "seq_len": 2048,
        "zero_stage": 2,
        "checkpointed_layers": 20,
        "layers": 28,
        "plain": {
            "step_s_median": 0.30,
            "tokens_per_s": 6826.7,
            "peak_allocated_gib": 18.9,
            "losses": [12.6, 12.5],
        },
        "engine": {
            "step_s_median": 0.34,
            "tokens_per_s": 6023.5,
            "peak_allocated_gib": 19.9,
            "losses": [12.5, 12.4],
        },
        "zero_ms_per_step": 40.0,
        "zero_share": 0.04 / 0.34,
        "zero_gib": 1.0,
    }
    text = "\n".join(zero_cost_markdown(z))
    assert "(LoRA, 2,048 tokens, 20 of 28 layers recomputed)" in text
    assert (
        "| plain: backward, clipping, torch's AdamW | 300.0 | 6,827 | 18.90 | 12.6000 → 12.5000 |"
        in text
    )
    assert "| DeepSpeed ZeRO-2 engine, memtune's loop | 340.0 | 6,024 | 19.90 |" in text
    assert "DeepSpeed adds +40.0 ms a step (11.8% of the engine's step) and +1.00 GiB" in text
    z["engine"] = {"error": "RuntimeError('out of memory')"}
    del z["zero_ms_per_step"]
    text = "\n".join(zero_cost_markdown(z))
    assert (
        "| DeepSpeed ZeRO-2 engine, memtune's loop | failed: RuntimeError('out of memory')" in text
    )
    assert "DeepSpeed adds" not in text


def test_the_compiled_row_is_read_beside_the_eager_one(profile) -> None:
    from bench.gpu_check.report import compiled_lines

    eager = {
        "method": "lora",
        "seq_len": 2048,
        "side": "memtune",
        "tokens_per_s": 6000.0,
        "losses": [12.61, 12.60],
    }
    compiled = {
        **eager,
        "side": "memtune-compiled",
        "tokens_per_s": 6900.0,
        "step_s": [48.2, 0.31, 0.30],
        "compiled_layers": 28,
        "checkpointed_layers": 20,
        "dynamo": {"graphs": 3, "graph_breaks": 4},
        "losses": [12.6102, 12.6],
    }
    (line,) = [x for x in compiled_lines([eager, compiled]) if x]
    assert "6,900 tokens/s, 1.15× eager's 6,000; the first step (the compile) 48.2 s" in line
    assert "28 layers compiled, 20 of them inside the checkpoint" in line
    assert "3 graphs, 4 breaks; first loss 12.6102 (eager 12.6100)" in line
    failed = {**compiled, "tokens_per_s": None, "error": "BackendCompilerFailed(...)"}
    assert compiled_lines([eager, failed])[-1].endswith("BackendCompilerFailed(...)")


def test_a_kernel_is_counted_once_under_the_operator_that_launched_it(profile) -> None:
    """On CUDA torch.profiler lists each kernel twice: attached to the operator that launched
    it and as an event of its own on the device. Built here as torch's _parse_kineto_results
    builds them (the real FunctionEvent and EventList): a base GEMM of 0.8 ms, a LoRA GEMM of
    0.1 ms recomputed in backward, a Triton kernel of 0.05 ms launched inside the optimizer's
    label, and the label's own span on the device's timeline, in a 1.2 ms step."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import EventList, FunctionEvent

    def op(i: int, name: str, start: float, end: float, shapes: list | None = None):
        return FunctionEvent(i, name, 1, start, end, input_shapes=shapes, use_device="cuda")

    def kernel(i: int, name: str, launcher: Any, us: float):
        launcher.append_kernel(name, 0, us)
        return FunctionEvent(
            100 + i,
            name,
            7,
            10.0,
            10.0 + us,
            use_device="cuda",
            device_type=DeviceType.CUDA,
            linked_correlation_id=launcher.id,
        )

    base = op(1, "aten::mm", 0, 50, [[2048, 3584], [3584, 18944]])
    recompute = op(2, profile.SCOPE_RECOMPUTE, 100, 300)
    lora = op(3, "aten::mm", 110, 150, [[2048, 3584], [3584, 16]])
    optimizer = op(4, profile.SCOPE_OPTIMIZER, 400, 500)
    events = [base, recompute, lora, optimizer]
    events += [
        kernel(1, "sm90_xmma_gemm_bf16", base, 800.0),
        kernel(3, "sm90_xmma_gemm_bf16", lora, 100.0),
        kernel(4, "_fused_adam_triton", optimizer, 50.0),
    ]
    events.append(  # the label's span on the device: no work of its own
        FunctionEvent(
            200,
            profile.SCOPE_OPTIMIZER,
            7,
            0.0,
            60.0,
            use_device="cuda",
            device_type=DeviceType.CUDA,
            is_user_annotation=True,
        )
    )
    listed = EventList(events, use_device="cuda")
    listed._build_tree()
    assert lora.cpu_parent is recompute  # as the profiler nests them
    prof = SimpleNamespace(events=lambda: listed)
    s = profile.summarize(prof, 1, 1.2e-3, True, 16, 152064)
    ms = s["kinds_ms"]
    assert ms["base GEMMs"] == pytest.approx(0.8)
    assert ms["recompute (forward again in backward)"] == pytest.approx(0.1)
    assert ms["optimizer and ZeRO"] == pytest.approx(0.05)
    assert ms["norms and elementwise"] == 0.0
    assert ms["device idle (host syncs, launch gaps)"] == pytest.approx(0.25)
    assert s["kernels_outside_ops_ms"] == pytest.approx(0.0)
    assert sum(ms.values()) == pytest.approx(s["step_ms"])


def test_a_dpo_rows_attention_flops_are_its_two_sequences(profile) -> None:
    """A DPO row holds one pair: two sequences of half the row, each attending only to
    itself, so the MFU's attention term is 6·L·h·(2·(T/2)²), half a single T-token row's."""
    from bench.gpu_check.configs import compose_cfg
    from bench.gpu_check.measure import flops_per_step
    from bench.gpu_check.modes import GPU
    from memtune.memory.counts import count_params

    cfg = compose_cfg(GPU, "dpo", 4096)
    counts, arch = count_params(cfg), cfg.model.architecture
    one = flops_per_step(counts, arch, 4096)
    pair = flops_per_step(counts, arch, 4096, (2048, 2048))
    linear = (4 * one["n_matmul"] + 6 * one["n_lora"]) * 4096
    assert one["lora"] - linear == 6 * 28 * 4096**2 * 3584  # Qwen2.5-7B: L 28, h 28 × 128
    assert pair["lora"] - linear == 3 * 28 * 4096**2 * 3584
    assert pair["six_n"] - 6 * one["n_matmul"] * 4096 == 3 * 28 * 4096**2 * 3584


def test_a_run_of_the_profile_phases_alone_has_measured_something(profile, tmp_path) -> None:
    """`--phases profile-memtune,profile-baseline` (the profile first, issue #47) that profiled
    both steps exits 0: the exit status counts the profile (and ZeRO's cost) as measurements."""
    import json

    from bench.gpu_check.modes import DRY
    from bench.gpu_check.orchestrate import measured_anything
    from bench.gpu_check.report import collect

    def fragment(name: str, side: str, **more: Any) -> None:
        data = {"phase": name, "method": "lora", "side": side, "records": [], "search": []}
        (tmp_path / f"{name}.json").write_text(json.dumps({**data, "errors": [], **more}))

    fragment("profile-memtune", "profile", notes=[])
    assert not measured_anything(collect(DRY, tmp_path))
    fragment("profile-memtune", "profile", notes=[], profile={"side": "memtune", "step_ms": 512.0})
    assert measured_anything(collect(DRY, tmp_path))
    (tmp_path / "profile-memtune.json").unlink()
    fragment("zero-cost", "zero-cost", notes=[], zero_cost={"plain": {"tokens_per_s": 6826.7}})
    assert measured_anything(collect(DRY, tmp_path))


def test_a_second_check_on_the_same_parts_dir_is_refused_naming_the_first(tmp_path) -> None:
    """Two checks with one parts dir (bench/gpu_check.sh always names /tmp/gpu_check_parts;
    two sessions' dry runs on one machine): the second cleared the first's fragments and wrote
    its statuses over them, unsaid. Now it is refused while the first (a real process) holds
    the dir, and runs once that process has ended."""
    import subprocess
    import sys

    from bench.gpu_check.work_lock import holding

    hold = (
        "import sys, time; from pathlib import Path; "
        "from bench.gpu_check.work_lock import holding\n"
        "with holding(Path(sys.argv[1])) as busy:\n"
        "    print(busy, flush=True); time.sleep(60)"
    )
    first = subprocess.Popen(
        [sys.executable, "-c", hold, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert first.stdout is not None and first.stdout.readline() == "None\n"
        with holding(tmp_path) as busy:
            assert busy == (
                f"another GPU check (pid {first.pid}) is running with its parts in {tmp_path}: "
                "wait for it to end, or give this one --work and --out of its own"
            )
    finally:
        first.kill()
        first.wait()
    with holding(tmp_path) as busy:  # the kernel's lock went with the killed process
        assert busy is None


def test_a_length_runs_its_own_lora_dropout_decision(monkeypatch: pytest.MonkeyPatch) -> None:
    """The decider chooses LoRA's dropout with the layers, so per length (on the 24 GB card the
    lora phase is built at 4,096 tokens with peft's and searches 8,192 and up regenerated):
    memtune_at_length applies a length's choice to the engine as build_rank would, not only
    its layers, or the search measures peft's copies against a plan without them."""
    import dataclasses
    import sys

    import torch

    sys.path.insert(0, str(ROOT))
    from bench.gpu_check.configs import compose_cfg, decided_at
    from bench.gpu_check.memtune_runner import memtune_at_length, memtune_model
    from bench.gpu_check.modes import DRY
    from memtune.config.deepspeed import build_ds_config
    from memtune.memory.counts import count_params
    from memtune.memory.estimate import plan
    from memtune.memory.recompute import AUTO_CHECKPOINT_SPARE_GIB
    from memtune.rank.build import loss_module
    from memtune.rank.lora_dropout import regenerated_dropouts

    cpu = torch.device("cpu")
    cfg0 = compose_cfg(DRY, "lora", 64)
    counts = count_params(cfg0)
    cfg, d0 = decided_at(cfg0, 64, counts)
    assert cfg.peft.dropout > 0 and d0.kernels.lora_dropout == "peft"
    # a card on which 512 tokens fit with the spare regenerated, and not with peft's copies
    at, d = decided_at(cfg0, 512, counts)
    totals = [
        plan(at, dataclasses.replace(d, kernels=dataclasses.replace(d.kernels, lora_dropout=k)))
        for k in ("regenerate", "peft")
    ]
    assert totals[0].total_gib < totals[1].total_gib
    card = AUTO_CHECKPOINT_SPARE_GIB + sum(p.total_gib for p in totals) / 2
    built = memtune_model(cfg, d0, build_ds_config(cfg, d0), cpu)
    assert regenerated_dropouts(built.model) == 0
    engine = type("Engine", (), {"module": loss_module(cfg, d0, built.model, cpu)})
    rec: dict[str, Any] = {}
    _, at512 = memtune_at_length(engine, cfg0, counts, 512, cpu, rec, card)
    assert at512.kernels.lora_dropout == "regenerate"
    assert regenerated_dropouts(built.model) == len(counts.lora_inputs) * 2  # 2 layers
    assert rec["lora_dropout"] == "regenerate"  # the row says which ran


def test_tables_that_cannot_be_rendered_keep_the_readings(profile, tmp_path) -> None:
    """A reading the tables cannot render (here a profile cut short: no length, no kinds):
    gpu_check.json keeps it and lists the failure, gpu_check.md says so. Before, the raise
    ended the phase that saved it, then the orchestrator, and every phase after it."""
    import json

    from bench.gpu_check.modes import DRY
    from bench.gpu_check.report import write_outputs

    work, out = tmp_path / "parts", tmp_path / "out"
    work.mkdir()
    data = {"phase": "profile-memtune", "method": "lora", "side": "profile", "records": []}
    cut = {"side": "memtune", "step_ms": 512.0}
    (work / "profile-memtune.json").write_text(
        json.dumps({**data, "search": [], "errors": [], "notes": [], "profile": cut})
    )
    result = write_outputs(DRY, work, out)
    saved = json.loads((out / "gpu_check.json").read_text())
    assert saved["profile"] == [cut] and result["profile"] == [cut]
    [error] = saved["errors"]
    assert (error["phase"], error["where"]) == ("report", "markdown")
    assert error["error"].startswith("KeyError: ")
    assert (
        (out / "gpu_check.md")
        .read_text()
        .startswith("# GPU check\n\nThe tables could not be rendered (KeyError: ")
    )
