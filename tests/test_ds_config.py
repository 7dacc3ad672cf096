"""DeepSpeed JSON filling: derived values, nothing left "auto", contradictions refused."""

from __future__ import annotations

import json

import pytest

from memtune.config import ConfigError, to_run_config
from memtune.config.deepspeed import (
    DS_CONFIG_DIR,
    build_ds_config,
    fill_ds_config,
    gradient_bucket_bytes,
)
from memtune.memory.counts import count_params
from tests.conftest import compose_cfg, decided


def _cfg(*overrides: str):
    return to_run_config(compose_cfg(list(overrides)))


def _ds(cfg) -> dict:
    return build_ds_config(cfg, decided(cfg))


def _fill(template, cfg, **kw) -> dict:
    return fill_ds_config(template, cfg, decided(cfg), **kw)


def _has_auto(node) -> bool:
    if isinstance(node, dict):
        return any(_has_auto(v) for v in node.values())
    return node == "auto"


def test_zero3_7b_values() -> None:
    cfg = _cfg("experiment=qwen2.5-7b-4x4090-lora", "zero=zero3")
    ds = _ds(cfg)
    h = 3584
    assert ds["train_batch_size"] == 32
    assert ds["train_micro_batch_size_per_gpu"] == 1
    assert ds["gradient_accumulation_steps"] == 8  # 32 / (1 × 4 ranks)
    assert ds["gradient_clipping"] == 1.0
    assert ds["bf16"] == {"enabled": True, "check_grad_overflow": True}
    z = ds["zero_optimization"]
    assert z["stage"] == 3
    assert z["reduce_bucket_size"] == h * h == 12_845_056
    assert z["stage3_prefetch_bucket_size"] == int(0.9 * h * h) == 11_560_550
    assert z["stage3_param_persistence_threshold"] == 10 * h == 35_840
    assert z["stage3_gather_16bit_weights_on_model_save"] is True
    assert not _has_auto(ds)


def test_zero2_values_and_overrides() -> None:
    cfg = _cfg("zero=zero2", "zero.reduce_bucket_size=1000", "trainer.precision=fp32")
    ds = _ds(cfg)
    z = ds["zero_optimization"]
    assert z["stage"] == 2
    assert z["reduce_bucket_size"] == z["allgather_bucket_size"] == 1000
    assert not any(k.startswith("stage3_") for k in z)
    assert ds["bf16"]["enabled"] is False
    assert ds["train_batch_size"] == 16 and ds["gradient_accumulation_steps"] == 2
    assert not _has_auto(ds)


def test_a_split_sequence_reduces_zero2_gradients_in_fp32() -> None:
    """Qwen2.5-7B's LoRA on ZeRO-2, bf16: beside its two hidden² buckets, a reduce flattens the
    bucket into a bf16 copy; DeepSpeed 0.19 (stage_1_and_2.py, allreduce_bucket) communicates
    that copy in fp32 whenever the sequence is split, one more fp32 copy of the bucket, where
    unsplit only one adapter tensor's slice (at most 16 × 3584) is upcast at a time."""
    lora = ["experiment=qwen2.5-7b-4x4090-lora", "zero=zero2"]
    h, largest = 3584, 16 * 3584
    buckets = 2 * h * h * 2
    for sp, upcast in ((1, largest * 4), (2, h * h * 4)):
        cfg = _cfg(*lora, f"trainer.sequence_parallel={sp}")
        d = decided(cfg)
        assert d.sequence_parallel == sp and count_params(cfg).largest_lora_tensor() == largest
        held, how = gradient_bucket_bytes(cfg, d, largest)
        assert held == buckets + h * h * 2 + upcast
        assert how.startswith("2 gradient reduce buffers (bf16) + ")


def test_a_mixtures_expert_adapter_stack_is_the_largest_upcast() -> None:
    """A mixture's routed-expert adapters are one parameter a stack (experts × r × in, experts ×
    out × r: rank.experts), so unsplit bf16 ZeRO-2 upcasts the whole stack's slice to fp32
    when it reaches the partition (stage_1_and_2.py, _add_to_grad_partition_buffer), not an
    attention adapter's r × 512: the tiny Qwen3-MoE's gate_up A, 16 experts × r × 256, or its
    8 local experts' under trainer.expert_parallel=2. The plan's bucket row counts it."""
    from memtune.memory.estimate import plan

    moe = ["model=tiny-qwen3-moe", "zero=zero2", "launcher.num_ranks=2", "peft.dropout=0"]
    moe.append("trainer.precision=bf16")
    h = 256
    for ep, target in ((1, "all-linear"), (2, "all-linear"), (2, "all-linear-but-experts")):
        cfg = _cfg(*moe, f"peft.target={target}", f"trainer.expert_parallel={ep}")
        d = decided(cfg)
        r = cfg.peft.r
        assert d.experts.parallel == ep and d.sequence_parallel == 1
        ds = _ds(cfg)
        assert ds["bf16"]["enabled"] and ds["zero_optimization"]["reduce_bucket_size"] == h * h
        largest = 16 // ep * r * h if target == "all-linear" else r * 4 * 128  # q_proj's B
        assert count_params(cfg).largest_lora_tensor(ep) == largest, (ep, target)
        held = 2 * h * h * 2 + h * h * 2 + largest * 4  # two bf16 buffers, a copy, the upcast
        row = plan(cfg, d).gib()["DeepSpeed buckets"]
        assert row * 1024**3 == pytest.approx(held, rel=1e-12), (ep, target)


def test_zero2_without_contiguous_gradients_counts_the_flattened_bucket(tmp_path) -> None:
    """A ZeRO-2 template with contiguous_gradients (and reduce_scatter) false holds no bucket
    buffer, but every reduce takes DeepSpeed 0.19's fallback (stage_1_and_2.py,
    reduce_ipg_grads: allreduce_bucket), which flattens the bucket into one bf16 copy and
    upcasts one adapter tensor's slice at a time: the row counts them, not 0 bytes."""
    template = json.loads((DS_CONFIG_DIR / "zero2.json").read_text())
    h, largest = 3584, 16 * 3584
    for scatter in (True, False):
        template["zero_optimization"].update(contiguous_gradients=False, reduce_scatter=scatter)
        path = tmp_path / f"scatter-{scatter}.json"
        path.write_text(json.dumps(template))
        cfg = _cfg("experiment=qwen2.5-7b-4x4090-lora", f"zero.template={path}")
        held, how = gradient_bucket_bytes(cfg, decided(cfg), largest)
        assert held == h * h * 2 + largest * 4, (scatter, how)
        assert how == "0 gradient reduce buffers (bf16) + 25 MiB while one reduces"


def test_persistence_threshold_zero_is_kept() -> None:
    ds = _ds(_cfg("zero.param_persistence_threshold=0"))
    assert ds["zero_optimization"]["stage3_param_persistence_threshold"] == 0


def test_every_template_fills() -> None:
    for path in sorted(DS_CONFIG_DIR.glob("*.json")):
        stage = 2 if "zero2" in path.name else 3
        cfg = _cfg(f"zero.stage={stage}", f"zero.template={path.stem}")
        assert not _has_auto(_ds(cfg)), path


def test_hard_value_that_contradicts_is_refused() -> None:
    template = json.loads((DS_CONFIG_DIR / "zero3.json").read_text())
    template["train_micro_batch_size_per_gpu"] = 2
    with pytest.raises(ConfigError, match=r"train_micro_batch_size_per_gpu is 2 but the config"):
        _fill(template, _cfg(), source="my.json")


def test_hard_value_that_agrees_is_accepted() -> None:
    template = json.loads((DS_CONFIG_DIR / "zero3.json").read_text())
    template["zero_optimization"]["stage"] = 3
    assert _fill(template, _cfg())["zero_optimization"]["stage"] == 3


def test_unknown_auto_is_refused() -> None:
    template = json.loads((DS_CONFIG_DIR / "zero3.json").read_text())
    template["optimizer"] = {"type": "AdamW", "params": {"lr": "auto"}}
    with pytest.raises(ConfigError, match=r"cannot fill \"auto\" at optimizer\.params\.lr"):
        _fill(template, _cfg())


def test_stage_mismatch_with_template_is_refused() -> None:
    with pytest.raises(ConfigError, match="stage3_"):
        _ds(_cfg("zero.stage=2", "zero.template=zero3"))


@pytest.mark.parametrize("key", ["reduce_scatter", "contiguous_gradients"])
def test_a_template_that_cannot_reduce_split_experts_is_refused(key: str) -> None:
    """Expert parallelism with the experts adapted: DeepSpeed's ZeRO-2 optimizer asserts
    reduce_scatter and contiguous_gradients for the split experts, once every rank has loaded
    the base (AssertionError from stage_1_and_2.py). A template that turns one off is refused
    by name before launch; frozen experts, or no split, take it."""
    template = json.loads((DS_CONFIG_DIR / "zero2.json").read_text())
    template["zero_optimization"][key] = False
    moe = ["model=tiny-qwen3-moe", "zero=zero2", "launcher.num_ranks=2", "peft.dropout=0"]
    split = _cfg(*moe, "peft.target=all-linear", "trainer.expert_parallel=2")
    assert decided(split).experts.parallel == 2
    with pytest.raises(ConfigError, match=rf"my\.json: zero_optimization\.{key} is false with "):
        _fill(template, split, source="my.json")
    _fill(template, _cfg(*moe, "peft.target=all-linear-but-experts", "trainer.expert_parallel=2"))
    _fill(template, _cfg(*moe, "peft.target=all-linear", "trainer.expert_parallel=1"))


def test_train_py_writes_filled_json(tmp_path) -> None:
    from memtune.launcher.prepare import lay_out

    lay_out(compose_cfg(["trainer.max_steps=3"]), tmp_path)
    ds = json.loads((tmp_path / "ds_config.json").read_text())
    assert not _has_auto(ds)
    assert ds["zero_optimization"]["stage3_param_persistence_threshold"] == 10 * 256  # 10·hidden
    assert "max_steps: 3" in (tmp_path / "config.yaml").read_text()


def test_a_run_dir_entry_of_the_wrong_kind_is_refused_before_launch(tmp_path) -> None:
    """In a dir that held a run, a file where the ranks make a folder, or a folder where the
    job writes a file. Before: a file at adapter/ was the rank's IsADirectoryError after the
    last step (the exported adapter removed with its temporary dir, an empty .old-adapter.XXXX
    left), one at checkpoints/ the first save's, a folder at exit.json the job's traceback
    once the ranks had ended. Now the OSError naming it is raised as the run dir is laid out
    (launcher.job says it in one line, exit 2)."""
    from memtune.launcher.prepare import lay_out
    from memtune.rundir import RunDir

    run = tmp_path / "run"
    overrides = ["logger=wandb", "logger.mode=offline"]
    lay_out(compose_cfg(overrides), run)
    (run / "adapter").write_text("mine\n")
    with pytest.raises(NotADirectoryError) as err:
        lay_out(compose_cfg(overrides), run)
    assert (err.value.filename, err.value.strerror) == (str(run / "adapter"), "Not a directory")
    assert (run / "adapter").read_text() == "mine\n"
    (run / "adapter").unlink()
    rd = RunDir(run)
    assert rd.wrong_kind(("wandb",)) is None
    (run / "wandb").symlink_to(tmp_path / "purged")
    assert rd.wrong_kind() is None  # wandb/ only for a run that logs to wandb
    said = rd.wrong_kind(("wandb",))
    assert isinstance(said, NotADirectoryError)
    assert (said.filename, said.strerror) == (str(run / "wandb"), "a symlink that leads nowhere")
    (run / "wandb").unlink()
    (run / "exit.json").mkdir()
    said = rd.wrong_kind()
    assert isinstance(said, IsADirectoryError) and said.filename == str(run / "exit.json")
