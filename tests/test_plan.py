"""The memory planner: real parameter counts, an activation model checked against autograd,
and a run that cannot fit refused before anything starts."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer

from memtune.config import to_run_config
from memtune.config.decisions import CPU_RANKS, Choices, RankMachine
from memtune.config.deepspeed import build_ds_config, reduce_temporaries_bytes
from memtune.memory.counts import count_params
from memtune.memory.estimate import activation_bytes, plan
from memtune.memory.expert_parallel import expert_parallel
from memtune.rank import attention
from memtune.rank.kernels import use_fused_kernels
from memtune.rank.linear_attention import keep_samples_apart
from memtune.rank.long_context import offload_checkpoints, tile_mlps
from memtune.rank.loss import CausalLMLoss
from memtune.rank.model import add_lora, count_parameters, load_base_model, torch_dtype
from memtune.tools.tiny import synthesize
from tests.conftest import compose_cfg, decided, run_train_py

QWEN7B = "experiment=qwen2.5-7b-4x4090-lora"


@pytest.mark.parametrize("peft", ["lora", "lora-all-linear"])
def test_meta_counts_equal_the_loaded_model(peft: str) -> None:
    cfg = to_run_config(compose_cfg([f"peft={peft}", "trainer.precision=fp32"]))
    synthesize(cfg.model.name_or_path, cfg.model.architecture)
    d = decided(cfg, attention="sdpa")
    trainable, total = count_parameters(add_lora(load_base_model(cfg, d), cfg, d))
    counts = count_params(cfg)
    assert counts.lora == trainable
    assert counts.base + counts.lora == total


def _lora_params(arch: dict, r: int, modules: list[str]) -> int:
    """r × (in + out) per adapted linear layer, from the config's dimensions."""
    h, i = arch["hidden_size"], arch["intermediate_size"]
    kv = arch["num_key_value_heads"] * h // arch["num_attention_heads"]
    shapes = {"q": (h, h), "k": (h, kv), "v": (h, kv), "o": (h, h)}
    shapes |= {"gate": (h, i), "up": (h, i), "down": (i, h)}
    return arch["num_hidden_layers"] * sum(r * sum(shapes[m]) for m in modules)


def test_qwen25_7b_counts_from_the_architecture() -> None:
    cfg = to_run_config(compose_cfg([QWEN7B]))
    counts = count_params(cfg)
    assert counts.base == 7_615_616_512  # Qwen2.5-7B's published size (7.61B)
    arch = cfg.model.architecture
    assert counts.lora == _lora_params(arch, 16, ["q", "k", "v", "o"]) == 10_092_544
    cfg_all = to_run_config(compose_cfg([QWEN7B, "peft=lora-all-linear"]))
    all_linear = ["q", "k", "v", "o", "gate", "up", "down"]
    assert count_params(cfg_all).lora == _lora_params(arch, 16, all_linear) == 40_370_176


def _saved_bytes(cfg, d) -> int:
    """What autograd really keeps for one forward of 4 × 128 tokens (parameters excluded), as
    the ranks run it: the decided attention (sdpa_varlen) over packed rows (two samples a row:
    one call a sample, their outputs concatenated) where the data is packed, one call per KV
    head where decided."""
    attention.register()
    model = add_lora(load_base_model(cfg, d), cfg, d).train()
    use_fused_kernels(model, d.kernels, torch.device("cpu"))  # the lean RMSNorm, as decided
    attention.split_by_kv_head(model.get_base_model(), d.attention_by_kv_head)
    keep_samples_apart(model.get_base_model())  # a hybrid's linear attention, a sample at a time
    if d.tiled_mlp:
        tile_mlps(model.get_base_model(), 4 * 128)
    if d.offload_activations:
        offload_checkpoints(model.get_base_model(), torch.device("cpu"))
    packed: dict[str, torch.Tensor] = {}
    if cfg.data.packing:
        packed = {
            "position_ids": torch.arange(64).repeat(4, 2),
            "cu_seq_lens": torch.arange(0, 4 * 128 + 1, 64, dtype=torch.int32),
            "max_length": torch.tensor(64),
        }
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(0, cfg.model.architecture["vocab_size"], (4, 128))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        CausalLMLoss(model, "chunked", 512)(input_ids=ids, labels=ids, **packed)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in storages.items() if ptr not in params)


@pytest.mark.parametrize(
    "overrides",
    [
        # LoRA dropout regenerated in backward (auto): the adapters keep what dropout 0 keeps;
        # and peft's, each adapter's dropped copy and mask kept (rank.lora_dropout).
        ["trainer.precision=fp32", "peft.dropout=0.05"],
        ["trainer.precision=bf16", "peft.dropout=0.05"],
        ["trainer.precision=bf16", "peft.dropout=0.05", "trainer.lora_dropout_kernel=peft"],
        ["trainer.precision=fp32", "peft.dropout=0.05", "trainer.lora_dropout_kernel=peft"],
        ["trainer.precision=bf16", "peft.dropout=0"],
        ["trainer.precision=bf16", "peft.dropout=0", "peft=lora"],
        # transformers' RMSNorm, its fp32 inputs kept (auto: the lean one, rank.lean_norm)
        ["trainer.precision=bf16", "peft.dropout=0", "trainer.rms_norm_kernel=torch"],
        # Qwen3: per-head q/k norms, head_dim 128 over a 256 hidden state, tied embeddings.
        ["model=tiny-qwen3", "trainer.precision=bf16", "peft.dropout=0"],
        ["model=tiny-qwen3", "trainer.precision=bf16", "trainer.rms_norm_kernel=torch"],
        ["model=tiny-qwen3", "trainer.precision=fp32", "peft.dropout=0.05"],
        # Qwen3.5's hybrid: three Gated DeltaNet layers (their mixer measured on the meta device,
        # memory.counts.linear_mixer_bytes) and a gated full-attention layer.
        ["model=tiny-qwen3.5", "trainer.precision=fp32", "peft.dropout=0.05"],
        [
            "model=tiny-qwen3.5",
            "trainer.precision=fp32",
            "peft.dropout=0.05",
            "trainer.lora_dropout_kernel=peft",
        ],
        ["model=tiny-qwen3.5", "trainer.precision=bf16", "peft.dropout=0"],
        [
            "model=tiny-qwen3.5",
            "trainer.precision=bf16",
            "peft.dropout=0",
            "trainer.activation_checkpointing=true",
            "trainer.checkpoint_layers=2",
        ],
        # Selective: layer 0 keeps only its input, layer 1 everything (2 layers in all).
        [
            "trainer.precision=bf16",
            "peft.dropout=0",
            "trainer.activation_checkpointing=true",
            "trainer.checkpoint_layers=1",
        ],
        # Long context: the tiled MLP keeps its input only (2 tiles of 256 tokens); an
        # offloaded layer 0 keeps nothing on the device (the model allows one input back).
        ["trainer.precision=bf16", "peft.dropout=0", "trainer.tiled_mlp=on"],
        ["trainer.precision=fp32", "peft.dropout=0.05", "trainer.tiled_mlp=on"],
        [
            "trainer.precision=fp32",
            "peft.dropout=0.05",
            "trainer.tiled_mlp=on",
            "trainer.lora_dropout_kernel=peft",
        ],
        [
            "trainer.precision=bf16",
            "peft.dropout=0",
            "trainer.activation_checkpointing=true",
            "trainer.checkpoint_layers=1",
            "trainer.offload_activations=on",
            "trainer.tiled_mlp=on",
        ],
    ],
)
def test_activation_model_matches_what_autograd_saves(overrides: list[str]) -> None:
    no_ckpt = ["peft=lora-all-linear", "trainer.activation_checkpointing=false"]
    cfg = to_run_config(compose_cfg([*no_ckpt, *overrides]))
    synthesize(cfg.model.name_or_path, cfg.model.architecture)
    d = decided(cfg)
    measured = _saved_bytes(cfg, d)
    tokens, h = 4 * 128, cfg.model.architecture["hidden_size"]
    b = 2 if cfg.trainer.precision == "bf16" else 4
    predicted = activation_bytes(cfg, d, tokens, count_params(cfg), cuda=False)
    predicted += tokens * h * b  # the chunked loss keeps the hidden-state gradient
    if d.offload_activations:
        predicted -= tokens * h * b  # the plan's allowance for an input fetched back
    # The model counts the big tensors per layer and leaves out small ones (rotary tables,
    # norm scales) and the dropout masks of the first layer's q/k/v, which autograd does not
    # keep because the embedding's output needs no gradient: -1% to +5% here.
    assert predicted == pytest.approx(measured, rel=0.06), (predicted, measured)


def test_4x4090_experiments_fit_and_a_plain_recipe_does_not() -> None:
    for exp in ("qwen2.5-7b-4x4090-lora", "qwen2.5-7b-4x4090-qlora"):
        cfg = to_run_config(compose_cfg([f"experiment={exp}"]))
        result = plan(cfg, decided(cfg))
        assert result.device_gib == 23.99 and result.fits, (exp, result.total_gib)
    seeds_like = [QWEN7B, "zero=zero2", "trainer.activation_checkpointing=false"]
    cfg = to_run_config(compose_cfg([*seeds_like, "trainer.loss=plain"]))
    result = plan(cfg, decided(cfg))
    assert not result.fits
    rows = result.gib()
    assert rows["base weights"] == pytest.approx(7_615_616_512 * 2 / 1024**3, rel=1e-3)
    # Checkpointing alone takes activations from tens of GiB to about two.
    cfg = to_run_config(compose_cfg([QWEN7B, "trainer.activation_checkpointing=true"]))
    ckpt = plan(cfg, decided(cfg))
    assert ckpt.gib()["activations"] < rows["activations"] / 10


def test_a_run_that_cannot_fit_is_refused_before_launch(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = [QWEN7B, "data=demo", "zero=zero2", "trainer.activation_checkpointing=false"]
    # Without these pinned, auto splits the sequence and tiles the MLP until it fits.
    args += ["trainer.sequence_parallel=1", "trainer.tiled_mlp=off"]
    args.append(f"run_dir={run_dir}")
    proc = run_train_py(args, cwd=tmp_path, timeout=300)
    assert proc.returncode == 2, proc.stderr
    # Refused for memory before the GPU preflight (which would refuse this CPU machine too).
    assert "GiB per rank but the device has 23.99 GiB" in proc.stderr
    assert "preflight" not in proc.stderr
    assert "activations" in proc.stderr and "trainer.activation_checkpointing=true" in proc.stderr
    assert not (run_dir / "config.yaml").exists() and not (run_dir / "launch.txt").exists()


def test_plan_only_prints_the_breakdown_and_starts_nothing(tmp_path: Path) -> None:
    proc = run_train_py(
        [QWEN7B, "plan_only=true", f"hydra.run.dir={tmp_path / 'p'}"], cwd=tmp_path, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    for row in ("base weights", "LoRA weights", "optimizer state", "activations"):
        assert row in proc.stdout
    assert "(the step's peak: " in proc.stdout  # the loss's row or the backward's says where
    assert "device 23.99 GiB per rank: fits" in proc.stdout
    assert not (tmp_path / "p" / "config.yaml").exists()


def test_suggestions_say_what_each_change_saves_and_skip_what_does_not_help() -> None:
    from memtune.memory.fit import suggestions

    cfg = to_run_config(
        compose_cfg([QWEN7B, "zero=zero2", "trainer.activation_checkpointing=false"])
    )
    tips = suggestions(cfg, decided(cfg), count_params(cfg), CPU_RANKS)
    saved = [float(t.rsplit(": -", 1)[1].split()[0]) for t in tips]
    assert saved == sorted(saved, reverse=True) and min(saved) >= 0.05
    assert tips[0].startswith("trainer.activation_checkpointing=true")
    # 10M LoRA parameters: 8-bit moments would save ~0.02 GiB, not worth a line.
    assert not any("adamw_8bit" in t for t in tips)
    total = plan(cfg, decided(cfg)).total_gib
    zero3 = to_run_config(
        compose_cfg([QWEN7B, "zero=zero3", "trainer.activation_checkpointing=false"])
    )
    expected = total - plan(zero3, decided(zero3)).total_gib
    assert any(t.startswith("zero=zero3") and f"-{expected:.2f} GiB" in t for t in tips)


def test_auto_fit_picks_the_cheapest_variant_that_fits() -> None:
    from memtune.memory.fit import auto_fit
    from memtune.memory.recompute import AUTO_CHECKPOINT_SPARE_GIB

    # The usual recipe on 4 × 24 GB, its sequence whole: does not fit as it is (with the
    # long-context choices on auto, auto_fit splits the sequence instead, as the launch does).
    whole = ["trainer.sequence_parallel=1", "trainer.tiled_mlp=off"]
    cfg = to_run_config(
        compose_cfg(
            [
                QWEN7B,
                "zero=zero2",
                "trainer.activation_checkpointing=false",
                "plan.auto_fit=true",
                *whole,
            ]
        )
    )
    assert not plan(cfg, decided(cfg)).fits
    fit = auto_fit(cfg, decided(cfg), CPU_RANKS)
    assert fit is not None and fit.plan.fits
    # Checkpointing is what it needs; nothing slower is added on top.
    assert fit.changes == ["trainer.activation_checkpointing=true"]
    assert fit.cfg.trainer.global_batch_size == cfg.trainer.global_batch_size
    # With the plain loss too: the chunked loss (free) joins, and the choice keeps the spare
    # that checkpoint_layers=auto keeps (what the plan may miss on a GPU).
    plain = to_run_config(
        compose_cfg(
            [
                QWEN7B,
                "zero=zero2",
                "trainer.activation_checkpointing=false",
                "trainer.loss=plain",
                "plan.auto_fit=true",
                *whole,
            ]
        )
    )
    fit = auto_fit(plain, decided(plain), CPU_RANKS)
    assert fit is not None and "trainer.loss=auto" in fit.changes
    assert fit.plan.total_gib <= 23.99 - AUTO_CHECKPOINT_SPARE_GIB
    # A config that already fits is returned unchanged.
    fitting = to_run_config(compose_cfg([QWEN7B]))
    same = auto_fit(fitting, decided(fitting), CPU_RANKS)
    assert same is not None and same.changes == [] and same.cost == 1.0


def test_auto_fit_takes_only_a_variant_whose_whole_plan_fits() -> None:
    """auto_fit judged its variants by the device's total alone: a run whose offloaded inputs
    did not fit plan.host_gib was taken as it was ("auto_fit:  (planned 17.91 of 23.99 GiB")
    and launched, where without auto_fit it is refused; without plan.device_gib its note
    crashed formatting None (TypeError). The refusal's "Try" list named device savings
    (peft=qlora-nf4) for host memory."""
    from memtune.config import ConfigError
    from memtune.memory.fit import fit_to_device

    host_bound = [
        "experiment=qwen2.5-7b-4x4090-long",
        "trainer.offload_activations=on",
        "plan.host_gib=4",  # 1 GiB a rank; 27 layers × 32,768 tokens pin 5.91
        "plan.auto_fit=true",
    ]
    with pytest.raises(ConfigError) as err:
        fit_to_device(to_run_config(compose_cfg(host_bound)), machine=CPU_RANKS)
    said = str(err.value)
    assert "this run's host memory per rank does not fit plan.host_gib" in said
    tips = said.split("Try (each alone, per rank):\n")[1].split("\n(")[0].splitlines()
    assert tips == [
        "  - trainer.offload_activations=off (checkpointed layers' inputs kept on the device): "
        "-5.91 GiB",
        "  - data.max_seq_len=65536 (shorter samples): -2.95 GiB",
    ]
    # The closing line says what auto_fit takes: QLoRA only for memory (memory.fit keeps the
    # base's precision whenever a variant that keeps it fits), not simply the fastest.
    assert said.endswith(
        "(plan.auto_fit=true picks the fastest variant that fits, keeping the base's precision "
        "whenever a variant that keeps it fits: QLoRA only for memory; plan.enforce=false "
        "launches anyway)"
    )
    # No plan.device_gib (the CPU demo), the host too small for micro batches of 4: half fits.
    demo = to_run_config(
        compose_cfg(
            [
                "trainer.activation_checkpointing=true",
                "trainer.checkpoint_layers=all",
                "trainer.offload_activations=on",
                "plan.host_gib=0.0006",  # 0.31 MiB a rank: 0.50 pinned at 4, 0.25 at 2
                "plan.auto_fit=true",
            ]
        )
    )
    fitted = fit_to_device(demo, machine=CPU_RANKS)
    assert not fitted.given_plan.fits and fitted.plan.fits
    assert fitted.changes == ["trainer.micro_batch_size=2"]
    assert fitted.notes[-1].startswith("auto_fit: trainer.micro_batch_size=2 (host memory")


def test_auto_fit_decides_again_what_the_run_left_to_auto() -> None:
    """The 7B recipe on 16.5 GiB does not fit, so its own long-context choice was the
    smallest plan's (the sequence split over 4 ranks) with all 28 layers recomputed; auto_fit
    kept both for its variants and ran ZeRO-3 so (under half of the 16.5 GiB used, over 100 s
    a step by the estimate) where zero=zero3 as given fits unsplit with 12 + 13 layers (under
    40 s)."""
    from memtune.memory.fit import fit_to_device
    from memtune.memory.step_time import step_time

    at = [QWEN7B, "plan.device_gib=16.5"]
    fitted = fit_to_device(
        to_run_config(compose_cfg([*at, "plan.auto_fit=true"])), machine=CPU_RANKS
    )
    assert fitted.given.sequence_parallel == 4 and not fitted.given_plan.fits
    zero3 = to_run_config(compose_cfg([*at, "zero=zero3"]))
    asked = fit_to_device(zero3, machine=CPU_RANKS)
    assert fitted.changes == ["zero=zero3"]
    assert fitted.decisions == asked.decisions and fitted.decisions.sequence_parallel == 1
    c = fitted.decisions.checkpointing
    assert (c.recomputed, c.selective) == (12, 13)
    assert "long context: sequence_parallel=1 tiled_mlp=off" in fitted.notes[-1]
    ours = step_time(zero3, fitted.decisions, fitted.plan.counts)
    assert ours is not None and ours.step_s < 40
    # trainer.selective_layers set with checkpoint_layers=auto: each variant asks for it anew
    # (it was pinned at the failing plan's 0 beside all 28 in full, and decisions_for raised)
    mixed = [*at, "plan.auto_fit=true", "trainer.selective_layers=4"]
    fitted = fit_to_device(to_run_config(compose_cfg(mixed)), machine=CPU_RANKS)
    assert fitted.changes == ["zero=zero3"] and fitted.decisions.checkpointing.selective == 4


def test_auto_fit_is_applied_before_launch_and_recorded(tmp_path: Path, capsys) -> None:
    from memtune.launcher.prepare import lay_out

    # Qwen2.5-7B's config.json next to the tiny model's tokenizer (the launcher side reads no
    # weights): the planner sees the 7B, the data is tokenized as for the tiny one.
    tiny = to_run_config(compose_cfg())
    synthesize(tiny.model.name_or_path, tiny.model.architecture)
    qwen = to_run_config(compose_cfg([QWEN7B]))
    stand_in = tmp_path / "qwen7b-config"
    AutoTokenizer.from_pretrained(tiny.model.name_or_path).save_pretrained(stand_in)
    arch = dict(qwen.model.architecture)
    AutoConfig.for_model(arch.pop("model_type"), **arch).save_pretrained(stand_in)
    overrides = [
        QWEN7B,
        "zero=zero2",
        "trainer.activation_checkpointing=false",
        "trainer.sequence_parallel=1",  # else auto splits the sequence until it fits
        "trainer.tiled_mlp=off",
        "plan.auto_fit=true",
        "data=demo",
        "data.packing=false",  # packed at 4,096 tokens the 320 demo samples are 2 rows: no step
        "preprocess_only=true",  # the stand-in has no weights: laid out, not launched
        f"model.name_or_path={stand_in}",
    ]
    cfg, d = lay_out(compose_cfg(overrides), tmp_path / "run")
    assert "auto_fit: trainer.activation_checkpointing=true" in capsys.readouterr().out
    assert d.checkpointing.enabled and d.zero_stage == 2
    # config.yaml keeps what was asked; decisions.json records what auto_fit decided.
    assert not cfg.trainer.activation_checkpointing
    assert "activation_checkpointing: false" in (tmp_path / "run" / "config.yaml").read_text()
    saved = json.loads((tmp_path / "run" / "decisions.json").read_text())
    assert saved["checkpointing"]["enabled"] is True and saved["zero_stage"] == 2
    assert "fits" in (tmp_path / "run" / "plan.txt").read_text()


@pytest.mark.parametrize(
    "fixture",
    [
        "zero2_run",
        "zero3_run",
        "bf16_run",
        "adamw8bit_run",
        "qlora_zero2_run",
        "qlora_zero3_run",
        "int8_zero3_run",
    ],
)
def test_planned_weights_and_optimizer_state_match_what_each_rank_holds(fixture, request) -> None:
    """Per rank, after real 2-rank runs: the bytes of parameters (ZeRO-3: the rank's shards),
    of optimizer state (fp32 master partition + moments) and of DeepSpeed's gradient reduce
    buffers against the plan's rows."""
    run = request.getfixturevalue(fixture)
    rows = {what: gib * 1024**3 for what, gib in plan(run.cfg, run.decisions).gib().items()}
    ds = build_ds_config(run.cfg, run.decisions)
    bucket, ranks = ds["zero_optimization"]["reduce_bucket_size"], run.decisions.batch.ranks
    largest = count_params(run.cfg).largest_lora_tensor(expert_parallel(run.decisions))
    for probe in run.probes():
        # Adapters in the compute dtype whatever the stage and base (model.cast_adapters).
        assert probe["lora_dtypes"] == [str(torch_dtype(run.cfg))]
        assert probe["grad_accum_dtype"] == "torch.float32"  # the "LoRA gradients" row
        held = probe["held_bytes"]
        # bitsandbytes' block scales live outside the parameters: the plan counts them (~3%).
        assert held["base"] == pytest.approx(rows["base weights"], rel=0.05), held
        # ZeRO-3 pads each rank's shard of every small LoRA tensor to an even split.
        assert held["lora"] == pytest.approx(rows["LoRA weights"], rel=0.05), held
        assert probe["optimizer_bytes"] == pytest.approx(rows["optimizer state"], rel=0.05)
        # DeepSpeed's gradient reduce buffers: ZeRO-2 two in the adapters' dtype, ZeRO-3 one;
        # and what its reduces made and freed again, as planned for as many gradients (the
        # row counts a full bucket's)
        elements, made = probe["reduce_temporaries"]
        assert made == reduce_temporaries_bytes(ds, elements, ranks, 1, largest), (elements, made)
        full = reduce_temporaries_bytes(ds, bucket, ranks, 1, largest)
        assert probe["bucket_bytes"] + full == pytest.approx(rows["DeepSpeed buckets"], rel=1e-9)


def test_int8_linears_are_planned_whole_on_every_zero3_rank() -> None:
    """Qwen2.5-7B, lora-int8 on 4 ranks: ZeRO-3's shard of every weight, and beside it the
    int8 linear weights whole (bitsandbytes' state.CB, measured by the int8_zero3_run case
    above); ZeRO-2 holds them once."""
    rows = {}
    for zero in ("zero2", "zero3"):
        cfg = to_run_config(compose_cfg([QWEN7B, "peft=lora-int8", f"zero={zero}"]))
        d = decided(cfg)
        assert d.batch.ranks == 4
        rows[zero] = next(r for r in plan(cfg, d).rows if r.what == "base weights")
    c = count_params(cfg)
    scales = c.linear_rows * 4 + c.small * 2
    sharded = (c.linear + (c.embedding + c.head) * 2) / 4
    assert rows["zero2"].gib * 1024**3 == pytest.approx(4 * sharded + scales, rel=1e-12)
    assert rows["zero3"].gib * 1024**3 == pytest.approx(c.linear + sharded + scales, rel=1e-12)
    assert 8.1 < rows["zero3"].gib < 8.2  # 2.03 GiB when they were planned sharded
    assert "also whole on each rank" in rows["zero3"].how
    assert "whole" not in rows["zero2"].how


@pytest.mark.parametrize(
    ("dropout_kernel", "norm_kernel"), [("regenerate", "lean"), ("peft", "torch")]
)
def test_selective_checkpointing_keeps_what_the_model_says(
    dropout_kernel: str, norm_kernel: str
) -> None:
    cfg = to_run_config(
        compose_cfg(
            [
                QWEN7B,
                f"trainer.lora_dropout_kernel={dropout_kernel}",
                f"trainer.rms_norm_kernel={norm_kernel}",
            ]
        )
    )
    counts = count_params(cfg)
    layers, n, h = 28, 4096, 3584
    d = decided(cfg)
    assert cfg.peft.dropout > 0 and d.kernels.lora_dropout == dropout_kernel
    acts = [activation_bytes(cfg, d.with_recompute(k), n, counts) for k in range(layers + 1)]
    # the final norm's input: in fp32 (transformers'), or bf16 and a fp32 inverse RMS a token
    tail = n * h * 4 if norm_kernel == "torch" else n * h * 2 + n * 4
    # k = 0: the first norm keeps nothing (the embedding needs no gradient), nor do the
    # dropouts before its q/k/v adapters keep their masks (1 byte a value on a GPU).
    first = tail + (3 * n * h if dropout_kernel == "peft" else 0)
    per_layer = (acts[0] - tail + first) // layers  # k = 0: every layer's activations
    assert acts[0] == layers * per_layer + tail - first
    # The first k layers keep only their bf16 input; backward recomputes them after the others
    # are freed, so for k < L nothing else is added, and for k = L one recomputed layer is.
    for k in (1, 12, 27):
        assert acts[k] == k * n * h * 2 + (layers - k) * per_layer + tail
    assert acts[layers] == layers * n * h * 2 + per_layer + tail
    assert all(a > b for a, b in itertools.pairwise(acts[:-1]))
    # Recomputing the last layer too saves nothing: it is the one live layer either way.
    assert acts[layers] > acts[layers - 1]


def test_checkpoint_layers_auto_is_the_fewest_that_fit_with_the_spare() -> None:
    from memtune.memory.fit import fit_to_device
    from memtune.memory.recompute import (
        AUTO_CHECKPOINT_SPARE_GIB,
        checkpoint_budget,
        choose_checkpoint_layers,
    )

    # full recomputes only (selective ones: the test below)
    cfg = to_run_config(compose_cfg([QWEN7B, "trainer.selective_layers=0"]))
    assert cfg.trainer.checkpoint_layers == "auto"
    counts = count_params(cfg)
    pinned = Choices(None, 1, False, False)  # the long-context choices, as the launch makes them
    k, none = choose_checkpoint_layers(cfg, pinned, counts, CPU_RANKS)
    assert none == 0
    budget = 23.99 - AUTO_CHECKPOINT_SPARE_GIB

    def total(layers: int) -> float:
        trial = to_run_config(compose_cfg([QWEN7B, f"trainer.checkpoint_layers={layers}"]))
        return plan(trial, decided(trial, selective=0), counts).total_gib

    assert 0 < k < 28 and total(k) <= budget < total(k - 1)
    fitted = fit_to_device(cfg, machine=CPU_RANKS)
    chosen, result = fitted.decisions, fitted.plan
    assert chosen.checkpointing.recomputed == k and fitted.cfg.trainer.checkpoint_layers == "auto"
    assert (
        result.fits
        and f"{k} of 28 layers checkpointed" in {r.what: r.how for r in result.rows}["activations"]
    )
    # CPU ranks without plan.device_gib fit the host's available RAM: the tiny demo (0.05 GiB
    # per rank) needs no recompute; GPU ranks without it recompute every layer.
    cpu = to_run_config(compose_cfg([]))
    assert cpu.trainer.checkpoint_layers == "auto" and cpu.plan.device_gib is None
    assert checkpoint_budget(cpu, RankMachine(cuda=True)) is None
    gpu = choose_checkpoint_layers(cpu, pinned, count_params(cpu), RankMachine(cuda=True))
    assert gpu == (2, 0)
    budget = checkpoint_budget(cpu, CPU_RANKS)
    assert budget is not None and "available per CPU rank" in budget[1]
    assert choose_checkpoint_layers(cpu, pinned, count_params(cpu), CPU_RANKS) == (0, 0)
    assert fit_to_device(cpu, machine=CPU_RANKS).decisions.checkpointing.recomputed == 0


def test_only_the_first_layers_recompute_and_the_gradients_do_not_change() -> None:
    from memtune.rank.layers import decoder_layers

    grads = {}
    for layers in ("all", "1", "0"):
        cfg = to_run_config(
            compose_cfg(
                ["trainer.precision=fp32", "peft.dropout=0", f"trainer.checkpoint_layers={layers}"]
            )
        )
        synthesize(cfg.model.name_or_path, cfg.model.architecture)
        torch.manual_seed(0)
        d = decided(cfg, attention="sdpa")
        model = add_lora(load_base_model(cfg, d), cfg, d).train()
        flags = [layer.gradient_checkpointing for layer in decoder_layers(model)]
        assert flags == {"all": [True, True], "1": [True, False], "0": [False, False]}[layers]
        for name, p in model.named_parameters():  # lora_B starts at 0: give it values
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.02, generator=torch.Generator().manual_seed(1))
        ids = torch.randint(0, 1024, (2, 64), generator=torch.Generator().manual_seed(2))
        CausalLMLoss(model, "chunked", 512)(input_ids=ids, labels=ids).backward()
        grads[layers] = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    for layers in ("1", "0"):
        for name, g in grads["all"].items():
            torch.testing.assert_close(grads[layers][name], g, rtol=1e-5, atol=1e-7)


def test_qlora_is_not_offered_for_layers_bitsandbytes_cannot_pack() -> None:
    from memtune.memory.fit import auto_fit, suggestions

    arch = "model.architecture"
    # 2 heads of 1791, one KV head: k_proj / v_proj are 3582 -> 1791 (odd packed bytes in bf16).
    odd = [f"{arch}.hidden_size=3582", f"{arch}.num_attention_heads=2"]
    odd += [f"{arch}.num_key_value_heads=1"]
    for overrides, offered in (([], True), (odd, False)):
        cfg = to_run_config(compose_cfg([QWEN7B, "plan.device_gib=12", *overrides]))
        counts = count_params(cfg)
        tips = suggestions(cfg, decided(cfg), counts, CPU_RANKS)
        assert any(t.startswith("peft=qlora-nf4") for t in tips) is offered, tips
        if not offered:
            fit = auto_fit(cfg, decided(cfg), CPU_RANKS, counts)
            assert fit is None or "peft=qlora-nf4" not in fit.changes


def test_the_measured_bandwidth_is_the_one_the_choices_and_the_estimate_use() -> None:
    """The job decides again once the GPU preflight has measured the bus bandwidth: at 32k
    tokens the long-context choice turns on it (sequence parallelism pays at 50 GB/s, not at
    0.05). It used to choose with the configured figure and print the measured one."""
    from dataclasses import replace

    from memtune.launcher.prepare import decide
    from memtune.memory.fit import format_step_estimates

    given = to_run_config(
        compose_cfg(
            [
                "experiment=qwen2.5-7b-4x4090-long",
                "plan.device_tflops=165",
                "plan.link_gb_s=0.05",
                "data.max_seq_len=32768",
                # the scenario as written for peft's dropout and transformers' RMSNorm and
                # SwiGLU (regenerated, or the lean kernels, sp=1 fits both ways)
                "trainer.lora_dropout_kernel=peft",
                "trainer.rms_norm_kernel=torch",
                "trainer.swiglu_kernel=torch",
            ]
        )
    )
    configured = decide(given, say=False)
    measured = decide(given, link_gb_s=50.0, say=False)
    as_if_set = decide(replace(given, plan=replace(given.plan, link_gb_s=50.0)), say=False)
    assert configured.decisions.sequence_parallel == 1
    assert measured.decisions.sequence_parallel == 4
    assert measured.decisions == as_if_set.decisions and measured.notes == as_if_set.notes
    assert measured.cfg.plan.link_gb_s == 50.0 and given.plan.link_gb_s == 0.05
    assert measured.plan.counts is not None
    estimate = format_step_estimates(
        measured.cfg, measured.decisions, measured.plan.counts, measured.machine
    )
    assert "at 50 GB/s bus bandwidth" in estimate


def test_lora_dropouts_copies_have_a_row_of_their_own() -> None:
    """The plan's "LoRA dropout copies" row is what autograd keeps with peft.dropout > 0 beyond
    the same step without it (measured on the tiny model, no checkpointing), and the rows add
    up to the same total as before the split."""
    from memtune.memory.estimate import DROPOUT_ROW, step_peak

    base = ["peft=lora-all-linear", "trainer.activation_checkpointing=false"]
    peft = ["trainer.precision=bf16", "peft.dropout=0.1", "trainer.lora_dropout_kernel=peft"]
    with_dropout = to_run_config(compose_cfg([*base, *peft]))
    without = to_run_config(compose_cfg([*base, "trainer.precision=bf16", "peft.dropout=0"]))
    synthesize(with_dropout.model.name_or_path, with_dropout.model.architecture)
    d, counts = decided(with_dropout), count_params(with_dropout)
    rows = plan(with_dropout, d, counts).gib()
    assert DROPOUT_ROW not in plan(without, decided(without), counts).gib()
    tokens = 4 * 128
    peak = step_peak(with_dropout, d.with_recompute(0), tokens, counts, cuda=False)
    assert (rows["activations"] + rows[DROPOUT_ROW]) * 1024**3 == pytest.approx(peak.activations)
    measured = _saved_bytes(with_dropout, decided(with_dropout)) - _saved_bytes(
        without, decided(without)
    )
    # plan.device_gib is unset here (CPU): the mask counts in the compute dtype, as on CPU
    assert rows[DROPOUT_ROW] * 1024**3 == pytest.approx(measured, rel=0.06), measured


@pytest.mark.parametrize("dropout", ["0", "0.1"])
def test_selective_layers_give_the_gradients_of_no_checkpointing(dropout: str) -> None:
    """torch's selective checkpointing (rank.layers): the layers keep their matmuls' and
    attention's outputs and recompute the rest in backward (dropout with the forward's masks):
    the same LoRA gradients as keeping everything, in fp32, with the kept outputs read, not
    computed again."""
    from memtune.rank.layers import SelectiveCheckpoint, decoder_layers

    cfg = to_run_config(
        compose_cfg(["trainer.precision=fp32", "peft=lora-all-linear", f"peft.dropout={dropout}"])
    )
    synthesize(cfg.model.name_or_path, cfg.model.architecture)
    grads = {}
    for mix in ((0, 0), (0, 2), (1, 1)):
        torch.manual_seed(0)
        d = decided(cfg, recompute=mix[0], selective=mix[1], attention="sdpa")
        model = add_lora(load_base_model(cfg, d), cfg, d).train()
        kinds = [
            "selective"
            if isinstance(layer._gradient_checkpointing_func, SelectiveCheckpoint)
            else "full"
            if layer.gradient_checkpointing
            else "keep"
            for layer in decoder_layers(model)
        ]
        assert kinds == list(d.checkpointing.layers)
        for name, p in model.named_parameters():  # lora_B starts at 0: give it values
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.02, generator=torch.Generator().manual_seed(1))
        ids = torch.randint(0, 1024, (2, 64), generator=torch.Generator().manual_seed(2))
        torch.manual_seed(3)  # the dropout masks
        CausalLMLoss(model, "chunked", 512)(input_ids=ids, labels=ids).backward()
        grads[mix] = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    for mix in ((0, 2), (1, 1)):
        for name, g in grads[(0, 0)].items():
            torch.testing.assert_close(grads[mix][name], g, rtol=1e-5, atol=1e-7)


def test_the_planner_recomputes_the_fewest_layers_in_full_then_selectively() -> None:
    """Qwen2.5-7B LoRA at 4,096 tokens on a 24 GB card, transformers' SwiGLU (with the lean one
    the fewest full recomputes fit without selective layers): the fewest full recomputes that
    fit with selective layers next to them, then the fewest of those; fewer full ones do not
    fit however many layers are selective, and one selective layer fewer does not fit
    either."""
    from memtune.memory.recompute import AUTO_CHECKPOINT_SPARE_GIB, choose_checkpoint_layers

    cfg = to_run_config(compose_cfg([QWEN7B, "trainer.swiglu_kernel=torch"]))
    counts = count_params(cfg)
    k, s = choose_checkpoint_layers(cfg, Choices(None, 1, False, False), counts, CPU_RANKS)
    room = 23.99 - AUTO_CHECKPOINT_SPARE_GIB

    def total(full: int, selective: int) -> float:
        return plan(cfg, decided(cfg, recompute=full, selective=selective), counts).total_gib

    assert s > 0 and k + s < 28 and total(k, s) <= room
    assert total(k, s - 1) > room and total(k - 1, 28 - (k - 1)) > room
    # fewer full recomputes than with full ones alone: the step recomputes less
    alone = next(j for j in range(28) if total(j, 0) <= room)
    assert k < alone
    d = decided(cfg, recompute=k, selective=s)
    assert d.checkpointing.label() == f"{k} of 28 layers, {s} more selectively"


def _quantized(kind: str) -> Any:
    """A 64 → 128 bitsandbytes layer on the CPU (4-bit NF4 or 8-bit), frozen."""
    import bitsandbytes as bnb

    torch.manual_seed(0)
    weight = torch.randn(128, 64)
    if kind == "4bit":
        layer = bnb.nn.Linear4bit(64, 128, bias=False, compute_dtype=torch.float32)
        layer.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4")
    else:
        layer = bnb.nn.Linear8bitLt(64, 128, bias=False, has_fp16_weights=False)
        layer.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
    return layer.to("cpu")


@pytest.mark.parametrize("kind", ["4bit", "8bit", "bf16"])
def test_a_selective_layer_keeps_the_base_output_and_makes_loras_b_again(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A base projection (bitsandbytes' 4-bit or 8-bit one under QLoRA / lora-int8, a plain
    matmul otherwise) with an r=4 adapter, under a selective layer's checkpoint: the base's
    output and LoRA's A output are kept, LoRA's B (4 deep, 128 wide) is made again in backward
    — memory.selective.keeps_matmul_output, the rule the plan counts by — and the gradients are
    those without checkpointing."""
    from memtune.rank import layers
    from memtune.rank.layers import SelectiveCheckpoint

    torch.manual_seed(1)
    if kind == "bf16":
        base: Any = torch.nn.Linear(64, 128, bias=True).requires_grad_(False)
    else:
        base = _quantized(kind)
    lora_a, lora_b = torch.nn.Linear(64, 4, bias=False), torch.nn.Linear(4, 128, bias=False)
    torch.nn.init.normal_(lora_b.weight, std=0.1)

    def layer(x: torch.Tensor) -> torch.Tensor:
        return base(x) + lora_b(lora_a(x)) * 2.0

    x = torch.randn(2, 5, 64)
    grads = []
    decided: dict[str, bool] = {}
    keeps = layers.keeps_output

    def recorded(op: Any, args: tuple[Any, ...] = ()) -> bool:
        keep = keeps(op, args)
        dims = layers.matmul_dims(str(op), args) if str(op).startswith(layers.MATMULS) else None
        if dims is not None:
            decided[f"{dims[0]}x{dims[1]}"] = keep
        return keep

    monkeypatch.setattr(layers, "keeps_output", recorded)
    for selective in (False, True):
        for p in (lora_a.weight, lora_b.weight):
            p.grad = None
        inp = x.clone().requires_grad_()
        out = SelectiveCheckpoint(None)(layer, inp) if selective else layer(inp)
        (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
        grads.append([inp.grad, lora_a.weight.grad, lora_b.weight.grad])
    # base 64 deep → 128 kept; A 64 → 4 kept; B 4 deep → 128 made again
    assert decided == {"64x128": True, "64x4": True, "4x128": False}, decided
    for ours, theirs in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(ours, theirs)


def test_the_layer_search_finds_the_fewest_full_recomputes_where_the_last_layer_is_kept() -> None:
    """Qwen3-8B LoRA at 7,424 tokens on a 24 GB card, peft's dropout: a selective last layer
    holds more than a kept one (its backward is the peak), so neither all-selective nor
    all-kept fits with 34 full recomputes, but 1 selective and 1 kept do. The search found 35
    (it tried only the two ends); the fewest full, then the fewest selective, checked here
    against every arrangement one full recompute fewer. (At 8,192 tokens until the plan's
    CUDA-context row became the measured 1.30 GiB: with 0.5 GiB less room, 35 full recomputes
    are the fewest that fit there, and 7,424 tokens is where the case is now.)"""
    from memtune.memory.recompute import AUTO_CHECKPOINT_SPARE_GIB, choose_checkpoint_layers

    cfg = to_run_config(
        compose_cfg(
            [
                "experiment=qwen3-8b-4x4090-lora",
                "data.max_seq_len=7424",
                "trainer.lora_dropout_kernel=peft",
            ]
        )
    )
    counts = count_params(cfg)
    k, s = choose_checkpoint_layers(cfg, Choices(None, 1, False, False), counts, CPU_RANKS)
    room = 23.99 - AUTO_CHECKPOINT_SPARE_GIB

    def total(full: int, selective: int) -> float:
        return plan(cfg, decided(cfg, recompute=full, selective=selective), counts).total_gib

    assert (k, s) == (34, 1)
    assert total(k, s) <= room and total(k, 0) > room and total(k, 2) > room
    assert all(total(k - 1, j) > room for j in range(36 - k + 2))
