"""Out the other end for a run on images (issue #49 item 6): the adapter of the released
vision-language class, exported as the worker exports it, loads with plain peft on that class
and computes memtune's logits on an image conversation; ``memtune merge`` keeps the tower.

The models are the tiny ones of tests/test_vision_train.py (the real classes, saved and loaded
through the real loading code); the adapter's LoRA B is drawn at random instead of trained
(rank.vision's step is tested there), so every adapted module changes the logits.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file

from memtune.config import ConfigError, RunConfig
from memtune.data.batching import collate_padded
from memtune.data.encode import IGNORE_INDEX
from memtune.rank.checkpoint import export_final, renames_for_multimodal_class
from memtune.rank.loss import model_inputs
from memtune.rank.vision import multimodal_hidden
from memtune.rundir import RunDir
from memtune.tools.generate import answer, image_settings, load, main, prompt_inputs
from memtune.tools.merge import main as merge_main
from memtune.tools.merge import merge
from memtune.tools.tiny import build_vision_language
from tests.test_vision_train import adapted_model, encoded, picture, reply, user, vl_cfg, with_tower


@pytest.fixture(scope="module")
def conversation(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One conversation with two images of other sizes (one wider than Qwen2.5-VL's windows)."""
    root = tmp_path_factory.mktemp("vl-export-records")
    (root / "img").mkdir()
    a = picture(root / "img" / "a.png", 96, 64, (220, 30, 30), 0)
    b = picture(root / "img" / "b.png", 150, 70, (30, 40, 220), 1)
    rows = [{"messages": [user("compare", a, b, "please"), reply("the first is red")]}]
    path = root / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def released(path: Path | str) -> Any:
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()


PROCESSOR_KEYS = (
    "input_ids",
    "attention_mask",
    "pixel_values",
    "image_grid_thw",
    "mm_token_type_ids",
)
"""What the model's processor gives for a conversation with images, and its forward takes."""


def trained_run(cfg: RunConfig, adapted_tower: bool, run_dir: Path) -> tuple[Any, Path]:
    """The rank's peft model of ``cfg`` (LoRA B at random), its adapter exported into
    ``run_dir/adapter`` by the worker's own export."""
    from transformers import AutoTokenizer

    d = with_tower(cfg, adapted_tower)
    model = adapted_model(cfg, d).eval()
    run_dir.mkdir()
    rd = RunDir(run_dir)
    rd.config.write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))  # as launcher.prepare
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.name_or_path)
    multimodal = renames_for_multimodal_class(cfg, d)
    assert not multimodal  # the released class: named as released already
    export_final(model, tokenizer, rd, True, multimodal)
    return model, run_dir / "adapter"


def memtune_logits(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The logits the rank computes (trainer.loss=plain with images: rank.loss)."""
    base = model.get_base_model()
    inputs = model_inputs(batch["input_ids"], batch["attention_mask"])
    images = {k: batch[k] for k in ("pixel_values", "image_grid_thw", "mm_token_type_ids")}
    with torch.no_grad():
        return base.get_output_embeddings()(multimodal_hidden(base, inputs, **images))


@pytest.mark.parametrize(
    ("kind", "target"),
    [
        ("qwen3_vl", "all-linear-and-vision"),
        ("qwen2_5_vl", "all-linear"),  # its tower has gate / up / down projections too
        ("qwen3_5", "attention-and-vision"),
    ],
)
def test_an_image_runs_adapter_gives_memtunes_logits_on_the_released_class_and_merges(
    conversation: Path,
    tmp_path: Path,
    kind: str,
    target: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Plain peft on the checkpoint's released class (AutoModelForImageTextToText), given the
    processor's inputs for a conversation with two images and run through the class's own
    forward, computes the rank's logits; the adapter changes them; its tower tensors (when
    adapted) load as trained. ``memtune merge`` writes a checkpoint of that class with its
    tower (merged where adapted), its image settings beside it, and the same logits. The
    commands (merge, and generate on the run) print memtune's lines only: transformers'
    loading bars and (Qwen3.5) its decoding kernels' fall-back lines were printed too."""
    from peft import PeftModel, get_peft_model_state_dict
    from safetensors import safe_open

    base_dir = build_vision_language(tmp_path / kind, kind)
    cfg = vl_cfg(base_dir, f"peft.target={target}")
    adapted_tower = target.endswith("-and-vision")
    model, adapter = trained_run(cfg, adapted_tower, tmp_path / "run")
    samples, settings, pad = encoded(cfg, conversation)
    batch = collate_padded(samples, pad, settings)
    assert batch["image_grid_thw"].shape == (2, 3)
    want = memtune_logits(model, batch)

    with safe_open(str(adapter / "adapter_model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert any(n.startswith("base_model.model.model.language_model.layers.") for n in names)
    assert any(".visual." in n for n in names) == adapted_tower

    served = PeftModel.from_pretrained(released(base_dir), adapter).eval()
    assert type(served.get_base_model()).__name__ == type(model.get_base_model()).__name__
    loaded = get_peft_model_state_dict(served)
    trained = get_peft_model_state_dict(model)
    assert loaded.keys() == trained.keys()
    for name, t in trained.items():
        torch.testing.assert_close(loaded[name], t, msg=name)
    inputs = {k: batch[k] for k in PROCESSOR_KEYS}
    with torch.no_grad():
        got = served(**inputs).logits
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        with served.disable_adapter():
            assert (got - served(**inputs).logits).abs().max() > 1e-3

    capsys.readouterr()
    merged_dir = tmp_path / "merged"
    with _transformers_log() as said:
        merge_main([str(adapter), str(merged_dir), "--dtype", "fp32"])  # memtune merge
        if kind == "qwen3_5":  # its decoding kernels' fall-backs (one kind: 1 s a generate)
            main([str(adapter.parent), "hi", "--max-new-tokens", "2"])  # memtune generate
    out, err = capsys.readouterr()
    assert out.startswith(f"memtune: merged model (fp32) written to {merged_dir}\n")
    # (generate's line for an answer cut at --max-new-tokens, when it was: stderr's one line)
    cut = (
        "memtune generate: the answer stopped at --max-new-tokens 2, before the model ended "
        "its turn; give a larger --max-new-tokens for the rest\n"
    )
    err = err.replace(cut, "", 1) if kind == "qwen3_5" else err
    assert err == "" and said == [], (err, said)  # the bars and the fall-backs: stderr
    merged = released(merged_dir)
    assert type(merged).__name__ == type(served.get_base_model()).__name__
    original = released(base_dir).state_dict()
    weights = merged.state_dict()
    assert weights.keys() == original.keys()
    tower = [n for n in weights if ".visual." in f".{n}" and n.endswith(".weight")]
    changed = [n for n in tower if not torch.equal(weights[n], original[n])]
    assert bool(changed) == adapted_tower
    assert image_settings(adapter.parent, merged_dir) == image_settings(adapter.parent)
    with torch.no_grad():
        torch.testing.assert_close(merged(**inputs).logits, got, rtol=1e-4, atol=1e-4)


@contextlib.contextmanager
def _transformers_log() -> Iterator[list[str]]:
    """What transformers logs in the block (its warnings once more, as in a new process)."""
    import logging

    from transformers.utils import logging as hf_logging

    hf_logging.warning_once.cache_clear()
    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    keep = Keep(logging.WARNING)
    logging.getLogger("transformers").addHandler(keep)
    try:
        yield said
    finally:
        logging.getLogger("transformers").removeHandler(keep)


def greedy(model: Any, inputs: dict[str, torch.Tensor], steps: int, stops: list[int]) -> list[int]:
    """Greedy decoding by hand: the model's whole forward on the sequence so far, each step."""
    ids, types = inputs["input_ids"], inputs["mm_token_type_ids"]
    images = {k: inputs[k] for k in ("pixel_values", "image_grid_thw")}
    new: list[int] = []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                mm_token_type_ids=types,
                **images,
            ).logits
            token = int(logits[0, -1].argmax())
            new.append(token)
            if token in stops:
                break
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
            types = torch.cat([types, torch.zeros((1, 1), dtype=types.dtype)], dim=1)
    return new


def test_generate_with_an_image_answers_as_plain_peft_decodes_greedily(
    conversation: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``memtune generate RUN_DIR --image PATH``: the prompt's tokens, image tokens and pixels
    are the run's encoding of that turn (the training sample up to its reply); the answer, by
    the model's own generate, is greedy decoding by plain transformers + peft on the released
    class, and the command prints it. An unreadable image and a model without image settings
    are refused by name. (A merged model's image settings and logits: the test above.)"""
    from peft import PeftModel

    from memtune.rank.vision import MM_IMAGE
    from memtune.tools.generate import stop_token_ids

    base_dir = build_vision_language(tmp_path / "qwen3_vl", "qwen3_vl")
    cfg = vl_cfg(base_dir, "peft.target=all-linear-and-vision")
    _, adapter = trained_run(cfg, True, tmp_path / "run")
    run_dir = adapter.parent
    image = conversation.parent / "img" / "b.png"
    question = "what colour?"

    model, tokenizer = load(run_dir)
    settings = image_settings(run_dir)
    inputs = prompt_inputs(run_dir, question, tokenizer, images=[image], settings=settings)
    record = conversation.parent / "one.jsonl"
    turn = [user("b.png", question), reply("blue")]
    record.write_text(json.dumps({"messages": turn}) + "\n")
    [sample], _, _ = encoded(cfg, record)
    n = next(i for i, label in enumerate(sample.labels) if label != IGNORE_INDEX)
    assert inputs["input_ids"][0].tolist() == sample.input_ids[:n]
    assert inputs["mm_token_type_ids"][0].tolist() == sample.mm_token_type_ids[:n]
    patches = int(inputs["image_grid_thw"].prod())
    assert int((inputs["mm_token_type_ids"] == MM_IMAGE).sum()) == patches // settings.merge_size**2
    trained = collate_padded([sample], 0, settings)
    torch.testing.assert_close(inputs["pixel_values"], trained["pixel_values"])

    with pytest.raises(ConfigError, match=r"--image: image 1 \(.*nothing.png\): cannot read"):
        prompt_inputs(
            run_dir, question, tokenizer, images=[tmp_path / "nothing.png"], settings=settings
        )
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    with pytest.raises(ConfigError, match="has no image processor settings"):
        image_settings(run_dir, tmp_path / "text")

    steps = 4
    _, new = answer(model, tokenizer, run_dir, question, steps, images=[image], settings=settings)
    served = PeftModel.from_pretrained(released(base_dir), adapter).eval()
    stops = stop_token_ids(tokenizer)
    assert new and new == greedy(served, inputs, steps, stops)

    # The checkpoint's serving settings (a released one's generation_config.json: sampling,
    # a repetition penalty, here one that forbids the greedy first token) are not applied.
    serving = {"do_sample": True, "repetition_penalty": 1.05, "suppress_tokens": [new[0]]}
    (base_dir / "generation_config.json").write_text(json.dumps(serving))
    argv = [str(run_dir), "--image", str(image), question]
    main([*argv, "--max-new-tokens", str(steps)])  # memtune generate
    printed = capsys.readouterr().out  # the answer as decoded, after any import warning
    text = tokenizer.decode(new, skip_special_tokens=True)
    empty = f"(empty answer: the model ended its turn after {len(new)} token(s))"
    assert printed.endswith((text if text.strip() else empty) + "\n")

    # An adapter of another base (its tensors as a text class names them, or of another
    # width) is refused naming it, by generate and merge: peft only warned and answered with
    # the bare base where no name matched, and stopped with a state-dict traceback where a
    # shape differed.
    other = tmp_path / "other"
    shutil.copytree(run_dir, other)
    weights = other / "adapter" / "adapter_model.safetensors"
    tensors = load_file(weights)
    save_file({k.replace("language_model.", ""): v for k, v in tensors.items()}, weights)
    names = r"no tensor in the adapter for base_model\.model\.model\.language_model\.layers\.0\."
    with pytest.raises(ConfigError, match=rf"^{other}/adapter: the adapter does not fit .*{names}"):
        main([str(other), question])
    key = next(k for k in tensors if k.endswith("q_proj.lora_A.weight"))
    save_file(tensors | {key: torch.zeros(tensors[key].shape[0], 3)}, weights)
    with pytest.raises(ConfigError, match=r"\(size mismatch for .*q_proj.*\): it was trained on"):
        merge(other / "adapter", tmp_path / "merged-other")
    assert not (tmp_path / "merged-other").exists()


def test_a_qlora_adapter_merges_into_the_quantized_base_with_its_tower_as_trained(
    tmp_path: Path,
) -> None:
    """An image run under QLoRA kept the tower out of bitsandbytes (rank.vision.NOT_QUANTIZED):
    ``memtune merge`` (into the base quantized as in training, then dequantized) leaves the
    tower's weights as released, while the language model's carry the NF4 round trip."""
    base_dir = build_vision_language(tmp_path / "qwen2_5_vl", "qwen2_5_vl")
    cfg = vl_cfg(base_dir, "peft=qlora-nf4", "trainer.precision=bf16", "peft.target=all-linear")
    _, adapter = trained_run(cfg, False, tmp_path / "run")
    merged = released(merge(adapter, tmp_path / "merged", dtype="fp32")).state_dict()
    original = released(base_dir).state_dict()
    tower = [n for n in original if ".visual." in f".{n}" and n.endswith(".weight")]
    for name in tower:
        torch.testing.assert_close(merged[name], original[name].bfloat16().float(), msg=name)
    q = "model.language_model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged[q], original[q].bfloat16().float())


@pytest.mark.parametrize("kept_in", ["preprocessor_config", "older_keys", "processor_config"])
def test_the_merged_models_processor_sizes_images_as_training_did(
    tmp_path: Path, kept_in: str
) -> None:
    """A run trained with data.min_pixels / data.max_pixels: the merged model's image processor
    (AutoImageProcessor on OUT, what AutoProcessor and vLLM build theirs from) gives the tokens
    training gave, image for image, where the base's settings, copied as they were, gave
    others. The base keeps them in preprocessor_config.json's ``size`` (as released), in its
    older top-level min_pixels / max_pixels (Qwen2.5-VL's release), or nested in
    processor_config.json alone (a processor saved whole by transformers 5)."""
    from PIL import Image
    from transformers import AutoImageProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    base_dir = build_vision_language(tmp_path / "qwen3_5", "qwen3_5")
    pre = base_dir / "preprocessor_config.json"
    fields = json.loads(pre.read_text())
    if kept_in == "older_keys":
        size = fields.pop("size")
        fields |= {"min_pixels": size["shortest_edge"], "max_pixels": size["longest_edge"]}
        pre.write_text(json.dumps(fields))
    elif kept_in == "processor_config":
        whole = {"image_processor": fields, "processor_class": "Qwen3VLProcessor"}
        (base_dir / "processor_config.json").write_text(json.dumps(whole))
        pre.unlink()
    cfg = vl_cfg(base_dir, "peft.target=attention", "data.min_pixels=1024", "data.max_pixels=8192")
    _, adapter = trained_run(cfg, False, tmp_path / "run")
    out = merge(adapter, tmp_path / "merged", dtype="fp32")
    trained = image_settings(adapter.parent)  # the run's: the base's under its data limits
    assert (trained.min_pixels, trained.max_pixels) == (1024, 8192)
    base, served = (
        AutoImageProcessor.from_pretrained(base_dir),
        AutoImageProcessor.from_pretrained(out),
    )
    moved = 0
    for width, height in [(20, 20), (300, 200), (140, 100), (1920, 1080)]:
        h, w = smart_resize(height, width, trained.factor, trained.min_pixels, trained.max_pixels)
        want = trained.tokens(h, w)
        tokens = served.get_number_of_image_patches(height, width, {}) // served.merge_size**2
        assert tokens == want, (width, height)
        copied = base.get_number_of_image_patches(height, width, {}) // base.merge_size**2
        moved += copied != want
        grid = served(images=Image.new("RGB", (width, height)), return_tensors="np")
        assert int(grid["image_grid_thw"].prod()) // served.merge_size**2 == want
    assert moved == 4  # the base's settings, as copied before, gave other counts for each
