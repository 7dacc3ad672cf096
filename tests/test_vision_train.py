"""Training on images (issue #49 items 3 and 4): the vision-language class with its tower, a
packed row of samples with images trained as each sample alone, the tower frozen and never
quantized unless asked. Whole runs on 2 ranks: tests/test_vision_runs.py.

The models are tiny ones of the real classes (memtune.tools.tiny.build_vision_language, from
conf/model/tiny-*-vl.yaml: Qwen3-VL with deepstack, Qwen2.5-VL with windowed attention, Qwen3.5
with its linear attention), saved with save_pretrained and loaded through memtune's own
loading code.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from memtune.config import ConfigError, RunConfig, to_run_config
from memtune.config.architecture import resolve_architecture
from memtune.config.decisions import Decisions, Kernels, Vision
from memtune.data.batching import collate_packed
from memtune.data.encode import IGNORE_INDEX, Sample, encode_records, resize_record_images
from memtune.data.readers import read_source
from memtune.data.vision import ImageSettings, model_image_settings
from memtune.rank.linear_attention import keep_samples_apart
from memtune.rank.loop import MODEL_INPUTS
from memtune.rank.loss import CausalLMLoss
from memtune.rank.model import add_lora, load_base_model
from memtune.tools.tiny import build_vision_language
from tests.conftest import compose_cfg, decided

FAMILIES = ("qwen3_vl", "qwen2_5_vl", "qwen3_5")


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vl-models")
    return {kind: build_vision_language(root / kind, kind) for kind in FAMILIES}


def picture(path: Path, width: int, height: int, colour: tuple[int, int, int], seed: int) -> str:
    """A small real image: one colour with noise."""
    rng = np.random.default_rng(seed)
    pixels = np.array(colour)[None, None] + rng.normal(0, 20, (height, width, 3))
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(path)
    return path.name


def user(*parts: Any) -> dict[str, Any]:
    content = [
        {"type": "image", "image": f"img/{p}"}
        if p.endswith(".png")
        else {"type": "text", "text": p}
        for p in parts
    ]
    return {"role": "user", "content": content}


def reply(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three conversations for one packed row: an image, none, two images of other sizes (one
    wider than Qwen2.5-VL's 112-pixel attention windows)."""
    root = tmp_path_factory.mktemp("vl-records")
    (root / "img").mkdir()
    a = picture(root / "img" / "a.png", 64, 64, (220, 30, 30), 0)
    b = picture(root / "img" / "b.png", 96, 160, (30, 200, 40), 1)
    c = picture(root / "img" / "c.png", 150, 70, (30, 40, 220), 2)
    rows = [
        {"messages": [user(a, "colour?"), reply("red, mostly")]},
        {"messages": [user("no image here"), reply("fine then")]},
        {"messages": [user("two:", b, c), reply("the second is wide")]},
    ]
    path = root / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def vl_cfg(base: Path, *overrides: str) -> RunConfig:
    template = "qwen3_5" if base.name == "qwen3_5" else "chatml"
    cfg = to_run_config(
        compose_cfg(
            [
                "model=local",
                f"model.name_or_path={base}",
                f"data.template={template}",
                "peft.dropout=0",  # the same masks alone and packed
                "trainer.precision=fp32",
                "trainer.activation_checkpointing=false",
                *overrides,
            ]
        )
    )
    return resolve_architecture(cfg)[0]


def with_tower(cfg: RunConfig, adapted: bool) -> Decisions:
    return dataclasses.replace(decided(cfg), vision=Vision(adapted=adapted, recompute=False))


def encoded(cfg: RunConfig, path: Path) -> tuple[list[Sample], ImageSettings, int]:
    from transformers import AutoTokenizer

    settings = model_image_settings(cfg.model.name_or_path, None, None, None)
    assert settings is not None
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.name_or_path)
    recs = list(read_source(str(path), "messages"))
    resized = [resize_record_images(r, settings) if r.images else [] for r in recs]
    return encode_records(recs, tokenizer, cfg.data, resized), settings, tokenizer.pad_token_id


def adapted_model(cfg: RunConfig, d: Decisions) -> Any:
    torch.manual_seed(0)
    model = add_lora(load_base_model(cfg, d), cfg, d)
    keep_samples_apart(model)  # Qwen3.5's linear attention (build_rank does this)
    for name, p in model.named_parameters():  # LoRA's B starts at 0: give the A's gradients
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    return model.train()


def step(
    loss: CausalLMLoss, batch: dict[str, torch.Tensor]
) -> tuple[float, dict[str, torch.Tensor]]:
    model = loss.model
    model.zero_grad(set_to_none=True)
    value = loss(**{k: batch[k] for k in MODEL_INPUTS if k in batch})
    value.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return float(value.detach()), grads


def each_sample(
    loss: CausalLMLoss, batch: dict[str, torch.Tensor], n: int, bounds: bool = True
) -> list[float]:
    """Each sample's loss inside the packed row (the others' labels masked); ``bounds``: the
    model is told where the samples are (``cu_seq_lens``), else it runs the row as one."""
    cu = batch["cu_seq_lens"].tolist()
    out = []
    with torch.no_grad():
        for i in range(n):
            labels = batch["labels"].clone()
            for j in range(n):
                if j != i:
                    labels[0, cu[j] : cu[j + 1]] = IGNORE_INDEX
            only = dict(batch, labels=labels)
            if not bounds:
                only = {k: v for k, v in only.items() if k not in ("cu_seq_lens", "max_length")}
            out.append(float(loss(**{k: only[k] for k in MODEL_INPUTS if k in only})))
    return out


@pytest.mark.parametrize(
    ("kind", "target"),
    [
        ("qwen3_vl", "all-linear-and-vision"),
        ("qwen2_5_vl", "all-linear-and-vision"),
        ("qwen3_5", "attention-and-vision"),
    ],
)
def test_a_packed_row_with_images_trains_each_sample_as_if_alone(
    bases: dict[str, Path], records: Path, kind: str, target: str
) -> None:
    """Three samples (one image, none, two) in one packed row: each sample's loss and the LoRA
    gradients (language model and tower) equal the samples run alone. The row crosses every
    boundary there is: the 3-D rotary positions restart per sample, attention (and Qwen3.5's
    linear attention) stays within each sample, the tower's attention within each image
    (Qwen2.5-VL's within its windows), Qwen3-VL's deepstack features land on their own
    sample's image tokens."""
    cfg = vl_cfg(bases[kind], f"peft.target={target}")
    samples, settings, pad = encoded(cfg, records)
    assert [len(s.images) for s in samples] == [1, 0, 2]
    loss = CausalLMLoss(adapted_model(cfg, with_tower(cfg, adapted=True)), "chunked")
    packed = collate_packed([samples], pad, settings)
    assert packed["image_grid_thw"].shape == (3, 3)
    packed_loss, packed_grads = step(loss, packed)
    alone = [step(loss, collate_packed([[s]], pad, settings)) for s in samples]
    assert packed_loss == pytest.approx(sum(value for value, _ in alone), rel=1e-5)
    assert each_sample(loss, packed, 3) == pytest.approx([v for v, _ in alone], rel=1e-5)
    tower = [n for n in packed_grads if ".visual." in n]
    assert tower and len(packed_grads) > len(tower)
    for name, grad in packed_grads.items():
        want = sum(g[name] for _, g in alone)
        # fp32 sums in another order; Qwen3.5's linear attention empties its state at a
        # sample's start by a decay of e^-30, not exactly (rank.linear_attention)
        atol = max(1e-6, 1e-4 * float(want.abs().max()))
        torch.testing.assert_close(grad, want, rtol=1e-4, atol=atol, msg=name)


def test_each_sample_gets_the_positions_it_has_alone_and_a_leak_shows(
    bases: dict[str, Path], records: Path
) -> None:
    """The packed row's 3-D positions are each sample's own, as the model's get_rope_index
    gives them for the sample alone (text row restarting too); trainer.loss=plain gives the
    chunked loss's value. And the comparison above can tell a leak: the same row without its
    sample boundaries (what transformers' forward does with a packed row it is not told
    about) gives the later samples other losses."""
    from memtune.rank.vision import rope_positions

    cfg = vl_cfg(bases["qwen3_vl"], "peft.target=all-linear")
    samples, settings, pad = encoded(cfg, records)
    loss = CausalLMLoss(adapted_model(cfg, with_tower(cfg, adapted=False)), "chunked")
    vl = loss.model.get_base_model().model
    packed = collate_packed([samples], pad, settings)
    args = (packed["input_ids"], packed["mm_token_type_ids"], packed["image_grid_thw"])
    positions = rope_positions(vl, *args, packed["cu_seq_lens"], None)
    alone = []
    for s in samples:
        one = collate_packed([[s]], pad, settings)
        grid = one.get("image_grid_thw")
        mrope, _ = vl.get_rope_index(one["input_ids"], one["mm_token_type_ids"], grid)
        alone.append(torch.cat([torch.arange(len(s.input_ids))[None, None], mrope]))
    assert torch.equal(positions, torch.cat(alone, dim=2))
    assert int(positions[1:, 0, len(samples[0].input_ids)].max()) == 0  # the second starts at 0

    losses = [step(loss, collate_packed([[s]], pad, settings))[0] for s in samples]
    plain = CausalLMLoss(loss.model, "plain")  # trainer.loss=plain: the whole logits
    assert step(plain, packed)[0] == pytest.approx(sum(losses), rel=1e-5)
    leaked = each_sample(loss, packed, 3, bounds=False)
    assert leaked[0] == pytest.approx(losses[0], rel=1e-5)
    assert abs(leaked[2] - losses[2]) > 1e-2 * losses[2]


def test_the_tower_is_frozen_unquantized_and_adapted_only_when_asked(
    bases: dict[str, Path],
) -> None:
    """peft.target=all-linear adapts the language model only (Qwen2.5-VL's tower has gate /
    up / down projections of its own); all-linear-and-vision adds exactly the tower's blocks'
    and mergers' linear layers. Under QLoRA the tower stays in the compute dtype while the
    language model's linear layers are 4-bit."""
    base = bases["qwen2_5_vl"]
    for target, tower_adapted in (("all-linear", False), ("all-linear-and-vision", True)):
        cfg = vl_cfg(base, f"peft.target={target}")
        d = with_tower(cfg, tower_adapted)
        model = add_lora(load_base_model(cfg, d), cfg, d)
        adapted = {n.split(".lora_A")[0] for n, _ in model.named_parameters() if ".lora_A." in n}
        tower = {n for n in adapted if ".visual." in n}
        linear = {
            n
            for n, m in model.named_modules()
            if ".visual." in n and type(m) is torch.nn.Linear and "lora_" not in n
        }
        if tower_adapted:
            assert {n.replace(".base_layer", "") for n in linear} == tower, target
            assert any(".merger.mlp.0" in n for n in tower)
        else:
            assert not tower and all(".language_model." in n for n in adapted), target
        assert not any(p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)

    cfg = vl_cfg(base, "peft=qlora-nf4", "trainer.precision=bf16")
    d = with_tower(cfg, adapted=False)
    model = add_lora(load_base_model(cfg, d), cfg, d)  # check_all_quantized passes
    kinds = {
        n: type(m).__name__
        for n, m in model.get_base_model().named_modules()
        if n.endswith(("q_proj", "qkv", "linear_fc1", "mlp.0", "down_proj"))
    }
    assert kinds and all((k == "Linear") == (".visual." in n) for n, k in kinds.items()), kinds
    weights = [p for n, p in model.named_parameters() if ".visual." in n]
    assert {p.dtype for p in weights} == {torch.bfloat16}


def test_the_plan_counts_the_language_model_of_the_released_class(bases: dict[str, Path]) -> None:
    """Qwen3-VL's and Qwen2.5-VL's language models have no causal-LM class of their own: the
    planner counts them as Qwen3's and Qwen2's (memory.counts.TEXT_STAND_INS). The counts are
    those of the released class without its tower."""
    from transformers import AutoModelForImageTextToText

    from memtune.memory.counts import count_params

    for kind in ("qwen3_vl", "qwen2_5_vl"):
        cfg = vl_cfg(bases[kind])
        model = AutoModelForImageTextToText.from_pretrained(bases[kind])
        text = sum(p.numel() for n, p in model.named_parameters() if ".visual." not in f".{n}")
        assert count_params(cfg).base == text, kind


def test_an_image_run_starts_from_an_image_runs_adapter(
    bases: dict[str, Path], tmp_path: Path
) -> None:
    """peft.init_from with the adapter of a run on images: its target pattern is this run's
    (checked before launch), and its weights, language model and tower, load as saved."""
    from memtune.config.validate import _check_init_from

    cfg = vl_cfg(bases["qwen3_vl"], "peft.target=all-linear-and-vision")
    d = with_tower(cfg, adapted=True)
    trained = adapted_model(cfg, d)
    trained.save_pretrained(tmp_path / "adapter")
    again = vl_cfg(
        bases["qwen3_vl"], "peft.target=all-linear-and-vision", f"peft.init_from={tmp_path}/adapter"
    )
    _check_init_from(again)
    loaded = add_lora(load_base_model(again, d), again, d)
    want = {n: p for n, p in trained.named_parameters() if p.requires_grad}
    got = {n: p for n, p in loaded.named_parameters() if p.requires_grad}
    assert want.keys() == got.keys() and any(".visual." in n for n in got)
    for name, p in got.items():
        torch.testing.assert_close(p, want[name], msg=name)
    text_only = vl_cfg(
        bases["qwen3_vl"], "peft.target=all-linear", f"peft.init_from={tmp_path}/adapter"
    )
    with pytest.raises(ConfigError, match="the adapter has target_modules="):
        _check_init_from(text_only)


def test_what_is_not_built_is_refused_by_name(bases: dict[str, Path], tmp_path: Path) -> None:
    """Before the ranks: images with a model type memtune does not train on images, a
    preference objective, sequence parallelism or compile; a -and-vision target on text."""
    from transformers import AutoConfig

    from memtune.data.cache import Prepared
    from memtune.data.encode import DataStats
    from memtune.launcher.prepare import vision_for_images

    with_images = Prepared(tmp_path, DataStats(images=3), DataStats(images=1), reused=False)
    text = Prepared(tmp_path, DataStats(), None, reused=False)
    cfg = vl_cfg(bases["qwen3_vl"])
    d = decided(cfg)
    assert vision_for_images(cfg, d, text) is d
    assert vision_for_images(cfg, d, with_images).vision == Vision(False, False)
    both = vl_cfg(bases["qwen3_vl"], "peft.target=attention-and-vision")
    assert vision_for_images(both, d, with_images).vision == Vision(True, False)
    with pytest.raises(ConfigError, match="adapts a vision tower, and the data has no images"):
        vision_for_images(both, d, text)
    for change, words in (
        (["trainer.objective=dpo"], "trainer.objective=dpo"),
        (["trainer.compile=true"], "trainer.compile=true"),
    ):
        with pytest.raises(
            ConfigError, match=f"hold 4 images, and training on images with {words} is not built"
        ):
            vision_for_images(vl_cfg(bases["qwen3_vl"], *change), d, with_images)
    fused = dataclasses.replace(d, kernels=Kernels(swiglu="liger"))
    with pytest.raises(ConfigError, match=r"with trainer\.swiglu_kernel=liger is not built"):
        vision_for_images(cfg, fused, with_images)
    split = dataclasses.replace(d, batch=dataclasses.replace(d.batch, sequence_parallel=2))
    with pytest.raises(ConfigError, match="with sequence parallelism"):
        vision_for_images(cfg, split, with_images)
    only = vl_cfg(bases["qwen3_vl"], "preprocess_only=true", "trainer.objective=dpo")
    assert vision_for_images(only, d, with_images) is d  # builds the cache, trains nothing

    moe = tmp_path / "moe"
    config = json.loads((bases["qwen3_5"] / "config.json").read_text())
    AutoConfig.for_model("qwen3_5_moe", vision_config=config["vision_config"]).save_pretrained(moe)
    other = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, name_or_path=str(moe)))
    with pytest.raises(ConfigError, match="is a qwen3_5_moe model: training on images is built"):
        vision_for_images(other, d, with_images)
    tiny = dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, name_or_path=str(tmp_path))
    )
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    with pytest.raises(ConfigError, match="has no vision tower"):
        vision_for_images(tiny, d, with_images)


def test_a_tower_on_another_model_type_is_refused_by_name(tmp_path: Path) -> None:
    """A synthesized model group with a tower (model.vision) is built as the released
    vision-language class of its language model's type; another type is refused naming the
    fields, and nothing is left behind."""
    from memtune.tools.tiny import synthesize

    arch = {"model_type": "qwen3", "vocab_size": 1024}
    with pytest.raises(ConfigError, match=r"model\.vision is set, and model\.architecture's"):
        synthesize(tmp_path / "tiny", arch, vision={"depth": 1})
    assert [p.name for p in tmp_path.iterdir()] == [".tiny.lock"]
