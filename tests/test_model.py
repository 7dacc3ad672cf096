"""Architecture facts from the real model classes; the tiny model; LoRA; checkpointing."""

from __future__ import annotations

import pytest
import torch

from memtune.config import to_run_config
from memtune.config.derive import LINEAR_ATTENTION_TARGETS, LORA_TARGETS, lora_targets
from memtune.data.encode import load_tokenizer
from memtune.rank.model import (
    add_lora,
    count_parameters,
    load_base_model,
)
from memtune.tools.tiny import IM_END, IM_START, PAD_TOKEN, synthesize
from tests.conftest import compose_cfg, decided


def _meta_model(model_name: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    arch = dict(to_run_config(compose_cfg([f"model={model_name}"])).model.architecture)
    config = AutoConfig.for_model(arch.pop("model_type"), **arch)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize(
    ("model_name", "params"),
    [
        ("qwen2.5-7b", 7_615_616_512),
        ("qwen2.5-7b-instruct", 7_615_616_512),
        ("qwen2.5-1.5b", 1_543_714_304),
        ("qwen2.5-0.5b", 494_032_768),
    ],
)
def test_shipped_architectures_have_the_published_size(model_name: str, params: int) -> None:
    model = _meta_model(model_name)
    assert sum(p.numel() for p in model.parameters()) == params


def test_lora_parameter_count_of_7b_comes_from_the_model() -> None:
    from peft import LoraConfig, get_peft_model

    model = _meta_model("qwen2.5-7b")
    peft_model = get_peft_model(
        model, LoraConfig(r=64, lora_alpha=16, target_modules=LORA_TARGETS["attention"])
    )
    trainable, _ = count_parameters(peft_model)
    # Per layer: r·(in+out) for q (3584→3584), k and v (3584→512, GQA), o (3584→3584).
    per_layer = 64 * ((3584 + 3584) + 2 * (3584 + 512) + (3584 + 3584))
    assert trainable == 28 * per_layer == 40_370_176
    # The seeds print 8,519,680 for this setting; the real GQA architecture gives 40.4M.
    assert trainable != 8_519_680


@pytest.fixture(scope="module")
def tiny_cfg():
    cfg = to_run_config(compose_cfg(["trainer.precision=fp32"]))
    synthesize(cfg.model.name_or_path, cfg.model.architecture)
    return cfg


def test_tiny_model_is_deterministic_and_cached(tiny_cfg, tmp_path) -> None:
    other = synthesize(tmp_path / "tiny", tiny_cfg.model.architecture)
    a = load_base_model(tiny_cfg, decided(tiny_cfg, attention="sdpa")).state_dict()
    from transformers import AutoModelForCausalLM

    b = AutoModelForCausalLM.from_pretrained(other).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    marker = other / "memtune_synth.json"
    mtime = marker.stat().st_mtime_ns
    synthesize(other, tiny_cfg.model.architecture)  # identical build present: kept
    assert marker.stat().st_mtime_ns == mtime


def test_tiny_model_loads_through_from_pretrained(tiny_cfg) -> None:
    model = load_base_model(tiny_cfg, decided(tiny_cfg, attention="sdpa"))
    assert type(model).__name__ == "Qwen2ForCausalLM"
    c = model.config
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (256, 1408, 2)
    assert (c.num_attention_heads, c.num_key_value_heads) == (4, 2)
    assert c.use_cache is False
    assert model.dtype == torch.float32
    assert model.config._attn_implementation == "sdpa"


def test_rope_scaling_is_laid_over_the_checkpoints_rope(tiny_cfg) -> None:
    """model.rope_scaling (YaRN, as the long experiment sets it) is applied over the
    checkpoint's RoPE parameters, its rope_theta kept. Before: transformers 5 took the
    rope_scaling given to from_pretrained for all of rope_parameters, and the first forward
    was a TypeError (rope_theta None): no run with model.rope_scaling could start."""
    import copy

    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = copy.deepcopy(tiny_cfg)
    scaling = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}
    cfg.model.rope_scaling = scaling
    model = load_base_model(cfg, decided(cfg, attention="sdpa"))
    yarn = {
        "rope_theta": 1000000.0,  # tiny-qwen2's own
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 512,
    }
    assert model.config.rope_parameters == yarn
    # The same model as transformers builds it from those parameters, given whole.
    config = AutoConfig.from_pretrained(cfg.model.name_or_path)
    config.rope_parameters = dict(yarn)
    want = AutoModelForCausalLM.from_pretrained(cfg.model.name_or_path, config=config)
    plain = AutoModelForCausalLM.from_pretrained(cfg.model.name_or_path)
    ids = torch.arange(3, 603).unsqueeze(0)  # past original_max_position_embeddings
    with torch.no_grad():
        got = model(input_ids=ids).logits
        torch.testing.assert_close(got, want.eval()(input_ids=ids).logits)
        assert (got - plain.eval()(input_ids=ids).logits)[0, 512:].abs().max() > 1e-2


def test_tiny_tokenizer_has_qwen_specials_and_chatml(tiny_cfg) -> None:
    tok = load_tokenizer(tiny_cfg)
    assert tok.pad_token == PAD_TOKEN and tok.eos_token == IM_END
    assert len({tok.convert_tokens_to_ids(t) for t in (PAD_TOKEN, IM_START, IM_END)}) == 3
    assert tok.pad_token_id != tok.eos_token_id
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode("<|im_start|>user\n你好<|im_end|>", add_special_tokens=False)
    assert ids[0] == tok.convert_tokens_to_ids(IM_START)
    assert ids[-1] == tok.convert_tokens_to_ids(IM_END)
    assert tok.decode(ids) == "<|im_start|>user\n你好<|im_end|>"


@pytest.mark.parametrize("target", ["attention", "all-linear"])
def test_lora_presets_and_checkpointing_scope(tiny_cfg, target: str) -> None:
    tiny_cfg.peft.target = target
    tiny_cfg.trainer.activation_checkpointing = True
    d = decided(tiny_cfg, attention="sdpa")
    model = add_lora(load_base_model(tiny_cfg, d), tiny_cfg, d)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    wrapped = {n.split(".")[-4] for n in trainable}  # ...q_proj.lora_A.default.weight
    # Qwen2 has no linear-attention layers: their names in the preset match nothing here.
    assert (
        wrapped
        == set(lora_targets(tiny_cfg))
        == set(LORA_TARGETS[target]) - set(LINEAR_ATTENTION_TARGETS)
    )
    r, h, kv = tiny_cfg.peft.r, 256, 2 * 64  # 2 KV heads × head_dim 64
    per_layer = r * ((h + h) + 2 * (h + kv) + (h + h))
    if target == "all-linear":
        per_layer += r * 3 * (h + 1408)
    assert count_parameters(model)[0] == 2 * per_layer
    # Checkpointing is on for the decoder layers and nothing else.
    from transformers.modeling_layers import GradientCheckpointingLayer

    recomputed = {
        n
        for n, m in model.named_modules()
        if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing
    }
    assert recomputed == {f"base_model.model.model.layers.{i}" for i in range(2)}


def test_attention_choice() -> None:
    """The job decides the kernel from the ranks' machine; a rank refuses what it cannot run."""
    from memtune.config import ConfigError
    from memtune.config.decisions import CPU_RANKS, RankMachine, attention_kernel, loss_kernel
    from memtune.rank.model import use_attention

    assert attention_kernel("auto", CPU_RANKS) == "sdpa_varlen"
    assert attention_kernel("auto", RankMachine(cuda=True)) == "sdpa_varlen"
    assert attention_kernel("auto", RankMachine(cuda=True, flash_attn=True)) == "flash_attention_2"
    # flash-attn has no fp32 kernels: an fp32 run on a GPU with it installed takes SDPA
    with_flash = RankMachine(cuda=True, flash_attn=True)
    assert attention_kernel("auto", with_flash, "fp32") == "sdpa_varlen"
    assert attention_kernel("auto", with_flash, "fp16") == "flash_attention_2"
    assert attention_kernel("sdpa", RankMachine(cuda=True, flash_attn=True)) == "sdpa"
    # The loss head: Liger's only by name, never auto's (not measured faster yet, #47).
    with_liger = RankMachine(cuda=True, liger=True)
    assert [loss_kernel(x, with_liger) for x in ("auto", "liger", "plain")] == [
        "chunked",
        "liger",
        "plain",
    ]
    assert use_attention("sdpa", "cpu") == "sdpa"
    assert use_attention("eager", "cpu") == "eager"
    with pytest.raises(ConfigError, match=r"flash_attention_2 .* needs a CUDA GPU"):
        use_attention("flash_attention_2", "cpu")
    with pytest.raises(ConfigError, match=r"torch_varlen .* needs a CUDA GPU"):
        use_attention("torch_varlen", "cpu")
    assert attention_kernel("torch_varlen", RankMachine(cuda=True)) == "torch_varlen"
