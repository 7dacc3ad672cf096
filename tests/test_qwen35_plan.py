"""Qwen3.5 on the job side: model groups checked against published counts, the hybrid's layer
layout, its multimodal config.json, and what the planner does not do for it yet (said, refused)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memtune.config import ConfigError, to_run_config, validate
from memtune.config.architecture import layer_types, linear_attention_layers, read_architecture
from memtune.memory.counts import count_params
from memtune.memory.estimate import plan
from tests.conftest import compose_cfg, decided

# Text parameters (embeddings, decoder, untied head; no vision tower, no MTP head) of the
# released checkpoints: keras-hub's qwen3_5 presets (text + vision, keras_hub/src/models/
# qwen3_5/qwen3_5_presets.py @ 71453d08) less each vision tower, as the model groups cite.
TEXT_PARAMETERS = {
    "qwen3.5-2b": 1_881_825_088,
    "qwen3.5-4b": 4_205_751_296,
    "qwen3.5-9b": 8_953_803_264,
    "qwen3.5-27b": 26_895_998_464,
}


@pytest.mark.parametrize("group", sorted(TEXT_PARAMETERS))
def test_the_model_groups_count_the_released_text_parameters(group: str) -> None:
    assert (
        count_params(to_run_config(compose_cfg([f"model={group}"]))).base
        == (TEXT_PARAMETERS[group])
    )


@pytest.mark.parametrize("group", ["tiny-qwen3.5", "qwen3.5-9b", "qwen3.5-27b", "qwen2.5-7b"])
def test_the_layer_layout_is_transformers_own(group: str) -> None:
    from transformers import AutoConfig

    arch = dict(to_run_config(compose_cfg([f"model={group}"])).model.architecture)
    config = AutoConfig.for_model(
        arch["model_type"], **{k: v for k, v in arch.items() if k != "model_type"}
    )
    assert layer_types(arch) == list(config.layer_types)
    expected = arch["num_hidden_layers"] * 3 // 4 if "qwen3.5" in group else 0
    assert linear_attention_layers(arch) == expected


def test_a_multimodal_config_json_is_planned_as_its_language_model(tmp_path: Path) -> None:
    from transformers import Qwen3_5Config

    text = dict(to_run_config(compose_cfg(["model=tiny-qwen3.5"])).model.architecture)
    text.pop("model_type")
    vision = {"depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2}
    Qwen3_5Config(text_config=text, vision_config=vision).save_pretrained(tmp_path)
    assert "text_config" in json.loads((tmp_path / "config.json").read_text())
    arch = read_architecture(tmp_path / "config.json")
    assert arch["model_type"] == "qwen3_5_text"
    assert (arch["hidden_size"], arch["linear_num_value_heads"]) == (256, 4)
    assert arch["tie_word_embeddings"] is False
    assert linear_attention_layers(arch) == 3


def test_sequence_parallel_must_divide_the_linear_attention_heads() -> None:
    """Each rank of a group runs the recurrence for 1/sp of the linear-attention heads: the
    tiny hybrid's 2 key heads split over 2 ranks, not over 4."""
    two = ["model=tiny-qwen3.5", "launcher.num_ranks=2", "trainer.sequence_parallel=2"]
    validate(to_run_config(compose_cfg(two)), inputs=False)
    four = ["model=tiny-qwen3.5", "launcher.num_ranks=4", "trainer.sequence_parallel=4"]
    with pytest.raises(
        ConfigError, match=r"sequence_parallel=4 must divide .*linear_num_key_heads=2"
    ):
        validate(to_run_config(compose_cfg(four)), inputs=False)
    from memtune.memory.long_context_choice import sequence_parallel_choices

    auto = to_run_config(compose_cfg(["model=qwen3.5-9b", "launcher.num_ranks=4"]))
    assert sequence_parallel_choices(auto) == [1, 2, 4]


def test_the_linear_mixer_grows_by_the_chunk_as_measured() -> None:
    """linear_mixer_bytes measures 2 and 4 chunks and extends the line: a 9B mixer over 64
    chunks (4,096 tokens) is what the meta device measures there, to the byte."""
    from memtune.memory.counts import _mixer_saved_on_meta, linear_mixer_bytes

    cfg = to_run_config(compose_cfg(["model=qwen3.5-9b", "trainer.precision=bf16"]))
    assert linear_mixer_bytes(cfg, 4096) == _mixer_saved_on_meta(cfg, 4096)
    assert linear_mixer_bytes(cfg, 4040) == linear_mixer_bytes(cfg, 4096)  # padded to a chunk
    assert 1.3e9 < linear_mixer_bytes(cfg, 4096) < 1.5e9  # fp32 chunk states: ~345 kB a token


def test_the_plan_names_the_measured_linear_attention_layers() -> None:
    cfg = to_run_config(compose_cfg(["model=qwen3.5-9b", "trainer.activation_checkpointing=false"]))
    row = next(r for r in plan(cfg, decided(cfg)).rows if r.what == "activations")
    assert "24 linear-attention layers as measured on transformers' torch code" in row.how
    qwen3 = to_run_config(compose_cfg(["model=qwen3-8b"]))
    assert (
        "linear-attention"
        not in next(r for r in plan(qwen3, decided(qwen3)).rows if r.what == "activations").how
    )


@pytest.mark.parametrize("sp", [2, 4])
def test_a_split_linear_layer_keeps_what_the_plan_counts(sp: int) -> None:
    """Under sequence parallelism a rank runs the conv and the recurrence over the whole
    sequence for 1/sp of the linear-attention heads (rank.linear_attention.Split); the plan
    counts the mixer over 1/sp of the tokens with every head. Measured on the meta device:
    the 9B's mixer with 1/sp of its heads over 4,096 tokens keeps what it keeps with all of
    them over 4,096/sp (measured: 4e-5 at sp=2, 1.1e-4 at sp=4; both are per token and per
    head)."""
    from memtune.memory.counts import _mixer_saved_on_meta

    bf16 = ["model=qwen3.5-9b", "trainer.precision=bf16"]
    heads = [
        f"model.architecture.linear_num_key_heads={16 // sp}",
        f"model.architecture.linear_num_value_heads={32 // sp}",
    ]
    on_a_rank = _mixer_saved_on_meta(to_run_config(compose_cfg([*bf16, *heads])), 4096)
    planned = _mixer_saved_on_meta(to_run_config(compose_cfg(bf16)), 4096 // sp)
    assert on_a_rank == pytest.approx(planned, rel=2e-4)


def test_the_sequence_parallel_buffers_are_the_linear_layers_exchange() -> None:
    """A 9B linear-attention layer exchanges q, k (16 × 128 each), v, z (32 × 128 each) and
    a, b (32 each), more than a full-attention layer's q, k, v: the plan's buffer row is the
    larger, at a rank's 2,048 tokens (sp=2), an input copy and an output each, in bf16."""
    cfg = to_run_config(
        compose_cfg(
            [
                "model=qwen3.5-9b",
                "trainer.precision=bf16",
                "launcher.num_ranks=2",
                "trainer.sequence_parallel=2",
                "data.max_seq_len=4096",
                "trainer.micro_batch_size=1",
            ]
        )
    )
    row = next(r for r in plan(cfg, decided(cfg)).rows if r.what == "sequence-parallel buffers")
    assert row.gib * 2**30 == 2 * 2048 * (2 * 16 * 128 + 2 * 32 * 128 + 2 * 32) * 2
    assert "linear-attention layer's q, k, v, z, a, b" in row.how
