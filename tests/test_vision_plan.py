"""The planner counts a run on images (issue #49 item 5): the tower's weights, the images'
patches, an adapted tower's activations (memory.vision), checked against a traced step of a
tiny Qwen3.5 with its vision tower; the vision decision made by the planner and kept by the
data read (launcher.prepare.planned_for_data)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from memtune.config import ConfigError, RunConfig, to_run_config
from memtune.config.architecture import resolve_architecture
from memtune.config.decisions import Vision
from memtune.memory.estimate import GIB, plan
from memtune.memory.vision import resized
from memtune.tools.step_trace import planned_step, trace_step
from memtune.tools.tiny import TINY_VISION_LANGUAGE, build_vision_language
from tests.conftest import TESTS, compose_cfg, decided


def tiny_vl(*overrides: str) -> RunConfig:
    """tiny-qwen3.5 with its tower, two 128 × 96 images a sample (4 × 3 merged patches of 32
    pixels: 12 tokens, 48 patches each), unpacked, 2 × 256 tokens a micro batch."""
    args = [
        f"model={TINY_VISION_LANGUAGE['qwen3_5']}",
        "trainer.precision=fp32",
        "data.max_seq_len=128",
        "data.packing=false",
        "trainer.micro_batch_size=2",
        "plan.images=2",
        "plan.image_width=128",
        "plan.image_height=96",
        *overrides,
    ]
    return to_run_config(compose_cfg(args))


@pytest.mark.parametrize(
    ("overrides", "vision"),
    [
        (["peft.target=attention"], Vision(False, False)),
        (
            ["peft.target=attention-and-vision", "trainer.activation_checkpointing=false"],
            Vision(True, False),
        ),
        (["peft.target=all-linear-and-vision", "data.packing=true"], Vision(True, True)),
    ],
)
def test_the_plan_matches_a_traced_step_with_images(overrides: list[str], vision: Vision) -> None:
    """A frozen tower (its weights and the patches only), an adapted one keeping everything
    (the measured blocks and merger), an adapted one recomputed with the language model's
    layers, packed (a row planned with as many images as it holds: 9): the plan's step rows
    within 3% of the traced step on real tensors, the images' rows among them; and the same
    step on fake tensors holds the same bytes, to the byte, at every moment that matters."""
    cfg = tiny_vl(*overrides)
    d = decided(cfg)
    assert d.vision == vision
    rows = plan(cfg, d).gib()
    per_row = 128 // (12 + 2) if cfg.data.packing else 2
    # float32 patches of 3 channels × 2 frames × 16² pixels
    assert rows["image inputs"] * GIB == 2 * per_row * 48 * 3 * 2 * 16**2 * 4
    assert ("vision activations" in rows) == vision.adapted
    assert rows["vision tower weights"] > 0
    traced = trace_step(cfg, d, fake=False)
    assert traced.at_peak["LoRA weights"] > 0
    assert planned_step(cfg, d) == pytest.approx(traced.step, rel=0.03), traced
    # fake tensors (the full-size trace's: tests/test_trace.py) hold what real ones hold
    fake = trace_step(cfg, d)
    assert (fake.peak, fake.at_peak) == (traced.peak, traced.at_peak)
    assert fake.saved_after_forward == traced.saved_after_forward


def test_the_vision_decision_is_the_planners() -> None:
    """decisions_for decides the tower with the rest: loaded when the plan is told of images
    (or the tower is adapted) and the model has one, recomputed when adapted and the language
    model recomputes; a row too short for the images is refused naming plan.images."""
    from memtune.launcher.prepare import vision_for_images

    assert decided(tiny_vl("plan.images=0")).vision is None
    text = to_run_config(compose_cfg(["model=tiny-qwen3.5", "plan.images=2"]))
    assert decided(text).vision is None  # no model.vision: nothing to load
    adapted = tiny_vl("peft.target=attention-and-vision")
    d = decided(adapted)
    assert d.vision == Vision(True, True)
    assert d.with_recompute(0).vision == Vision(True, False)
    assert decided(tiny_vl("plan.images=0", "peft.target=attention-and-vision")).vision
    # data without images: the text model, whatever the plan was told
    from memtune.data.cache import Prepared
    from memtune.data.encode import DataStats

    text_data = Prepared(Path("."), DataStats(), None, reused=False)
    frozen = decided(tiny_vl())
    assert vision_for_images(tiny_vl(), frozen, text_data).vision is None
    from memtune.config import validate

    with pytest.raises(ConfigError, match=r"plan\.images must be >= 0 \(got -1\)"):
        validate(tiny_vl("plan.images=-1"), inputs=False)
    short = tiny_vl("data.max_seq_len=64", "plan.images=9")
    with pytest.raises(ConfigError, match=r"plan\.images=9 images of 128×96 are 126 tokens"):
        plan(short, decided(short))


def test_an_images_tokens_are_the_processors() -> None:
    """Qwen3.5-9B's tower (conf/model/qwen3.5-9b.yaml): a 1280 × 720 screenshot is resized
    to 1280 × 704, 3,520 patches, 880 tokens, as the image processor itself resizes it
    (memtune.data.vision.resize on a real picture)."""
    from memtune.data.vision import ImageSettings, resize

    cfg = to_run_config(compose_cfg(["experiment=qwen3.5-9b-4x4090-vl"]))
    assert resized(cfg, 1280, 720) == (704, 1280, 3520, 880)
    v = cfg.model.vision
    settings = ImageSettings.from_config(
        {"patch_size": v["patch_size"], "merge_size": v["spatial_merge_size"]}
    )
    out = resize(Image.new("RGB", (1280, 720)), settings)
    assert out.shape == (3, 704, 1280) and settings.tokens(704, 1280) == 880


@pytest.mark.parametrize(
    ("model", "released"),
    [("qwen3.5-9b", "qwen3_vl"), ("qwen3-vl-8b", "qwen3_vl"), ("qwen2.5-vl-7b", "qwen2_5_vl")],
)
def test_a_checkpoint_not_on_disk_is_planned_with_its_familys_image_settings(
    model: str, released: str
) -> None:
    """Before a download (no checkpoint on disk), an image is planned as the family's released
    processor resizes it (its preprocessor_config.json in tests/data: Qwen3.5's is Qwen3-VL's),
    not with the image processor class's defaults (Qwen2-VL's: at most 1,003,520 pixels, 943
    tokens for 2560 × 1440 where Qwen3.5 reads 3,600); data.max_pixels over it."""
    from transformers.image_utils import IMAGENET_STANDARD_MEAN, OPENAI_CLIP_MEAN
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    from memtune.data.vision import ImageSettings, model_image_settings
    from memtune.memory.vision import image_settings

    cfg = to_run_config(compose_cfg([f"model={model}", "data.path=x.jsonl"]))
    assert model_image_settings(cfg.model.name_or_path, None, None, None) is None  # not on disk
    shipped = json.loads((TESTS / "data" / f"{released}_preprocessor_config.json").read_text())
    want = ImageSettings.from_config(shipped)
    assert image_settings(cfg) == want
    assert want.image_mean == tuple(
        IMAGENET_STANDARD_MEAN if released == "qwen3_vl" else OPENAI_CLIP_MEAN
    )
    for width, height in [(2560, 1440), (1920, 1080), (100, 100)]:
        h, w = smart_resize(height, width, want.factor, want.min_pixels, want.max_pixels)
        assert resized(cfg, width, height)[3] == want.tokens(h, w)
    if released == "qwen3_vl":
        assert resized(cfg, 2560, 1440)[3] == 3600 and resized(cfg, 100, 100)[3] == 64
    capped = to_run_config(compose_cfg([f"model={model}", "data.max_pixels=1003520"]))
    assert image_settings(capped) == ImageSettings.from_config(shipped, max_pixels=1003520)


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen2_5_vl"])
def test_a_tiny_model_is_planned_with_the_settings_it_is_built_with(
    kind: str, tmp_path: Path
) -> None:
    """A tiny model planned before its build (the launch builds it) is planned with the image
    settings its build writes (tiny pixel limits, the family's mean and std)."""
    from memtune.data.vision import model_image_settings
    from memtune.memory.vision import image_settings

    cfg = to_run_config(
        compose_cfg(
            [f"model={TINY_VISION_LANGUAGE[kind]}", f"model.name_or_path={tmp_path / 'tiny'}"]
        )
    )
    planned = image_settings(cfg)
    built = build_vision_language(tmp_path / "tiny", kind)
    assert planned == model_image_settings(str(built), None, None, None)
    assert (planned.min_pixels, planned.max_pixels) == (64 * 64, 128 * 128)


def picture(path: Path, width: int, height: int) -> str:
    rng = np.random.default_rng(width)
    Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8)).save(path)
    return path.name


def test_a_launch_is_planned_for_the_images_its_data_holds(tmp_path: Path) -> None:
    """A checkpoint on disk gives model.vision its vision_config; planned before the data with
    no images (plan.images=0: the text model), the launch reads 2 images a sample, the larger
    160 × 96, and plans again for them: the tower decided and counted."""
    from memtune.launcher.prepare import decide, planned_for_data, prepare_data

    base = build_vision_language(tmp_path / "qwen3_5", "qwen3_5")
    (tmp_path / "img").mkdir()
    a, b = picture(tmp_path / "img" / "a.png", 64, 64), picture(tmp_path / "img" / "b.png", 160, 96)
    record = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": f"img/{a}"},
                    {"type": "image", "image": f"img/{b}"},
                    {"type": "text", "text": "which is wider?"},
                ],
            },
            {"role": "assistant", "content": "the second"},
        ]
    }
    data = tmp_path / "records.jsonl"
    data.write_text(json.dumps(record) + "\n")
    cfg, _ = resolve_architecture(
        to_run_config(
            compose_cfg(
                [
                    "model=local",
                    f"model.name_or_path={base}",
                    "data=messages",
                    f"data.path={data}",
                    "data.template=qwen3_5",
                    "data.max_seq_len=128",
                    "trainer.precision=fp32",
                    "plan.image_width=64",  # smaller than the data's largest
                    "plan.image_height=64",
                    "launcher.num_ranks=1",  # one record: one step of one row
                    "trainer.micro_batch_size=1",
                    "trainer.global_batch_size=1",
                ]
            )
        )
    )
    assert cfg.model.vision["depth"] == 2 and cfg.plan.images == 0
    fitted = decide(cfg, say=False)
    assert fitted.decisions.vision is None and "vision tower weights" not in fitted.plan.gib()
    again = planned_for_data(fitted, prepare_data(cfg))
    p = again.cfg.plan
    assert (p.images, p.image_width, p.image_height) == (2, 160, 96)
    assert again.decisions.vision == Vision(False, False)
    rows = again.plan.gib()
    assert rows["vision tower weights"] > 0 and rows["image inputs"] > 0
    assert again.decisions.batch == fitted.decisions.batch
    # A run dir whose run plan.auto_fit restarted after an out-of-memory stop: planned anew
    # from the settings for these images, the run keeps the restart's change (a requeue lost
    # it, and ran out of memory where it had, its one restart spent)
    from memtune.launcher.prepare import prepare_run_dir
    from memtune.rundir import OomRestart, RunDir

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    changes = ["trainer.activation_checkpointing=true", "trainer.checkpoint_layers=all"]
    RunDir(run_dir).write_resume(None)  # a run was laid out there
    RunDir(run_dir).write_oom_restart(OomRestart([], changes, None))
    _, d = prepare_run_dir(fitted, run_dir)
    assert d.vision == Vision(False, False)
    c = d.checkpointing
    assert c.enabled and c.recomputed == len(c.layers) and again.decisions.checkpointing != c


def test_the_towers_flops_are_torchs_count() -> None:
    """The step-time estimate's tower (memory.step_time.tower_flops): a frozen tower's forward
    on the planned images, against torch's FLOP counter on the tiny Qwen3.5's tower run on
    them (its patch embedding, blocks, per-image attention and merger), within 1% (the
    estimate counts the norms and biases as weights too)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModel

    from memtune.memory.counts import count_params, tower_config
    from memtune.memory.step_time import tower_flops
    from memtune.memory.vision import image_load

    cfg = tiny_vl()
    d = decided(cfg)
    load = image_load(cfg, d)
    assert load is not None and load.images == 4
    # eager attention: its matmuls are in torch's count (CPU flash attention's are not)
    tower = AutoModel.from_config(tower_config(cfg), attn_implementation="eager").eval()
    p = int(tower.config.patch_size)
    grid = torch.tensor([[1, load.height // p, load.width // p]] * load.images)
    pixels = torch.zeros(load.images * load.patches, 3 * 2 * p * p)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        tower(pixels, grid_thw=grid)
    planned = tower_flops(cfg, d, count_params(cfg))
    assert planned == pytest.approx(counter.get_total_flops(), rel=0.01)


@pytest.mark.parametrize("cuda", [False, True])
def test_the_towers_measured_line_predicts_another_tower(cuda: bool) -> None:
    """memory.vision.tower_line measures towers of 1 and 2 blocks on images of 4² and 8²
    patches; its line gives, to the byte, what a 3-block tower saves on an image of 10² patches
    (all-linear adapters with dropout, CPU's noise or CUDA's bool masks)."""
    from memtune.memory.vision import _tower_saved, tower_line

    cfg = tiny_vl("peft.target=all-linear-and-vision", "peft.dropout=0.1")
    block, rest, image, deepstack = tower_line(cfg, cuda)
    assert block > 0 and rest > 0 and deepstack == 0  # Qwen3.5's tower has no deepstack
    assert _tower_saved(cfg, 3, 5, cuda) == 3 * block * 100 + rest * 100 + image


def test_a_tower_line_of_another_counts_cache_format_is_not_called_damaged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two memtunes sharing one cache (an upgrade, two checkouts) whose counts caches differ in
    format: each keeps its own tower line. Its key named the line's format only, so the other
    one's entry sat at the same file and was set aside as damaged ("format 8, not 9") and
    measured again, back and forth."""
    import dataclasses

    from memtune.memory import counts, vision

    monkeypatch.setenv("MEMTUNE_CACHE_DIR", str(tmp_path))
    cfg = tiny_vl("peft.target=all-linear-and-vision")
    older = counts.COUNTS_CACHE_FORMAT - 1
    with monkeypatch.context() as m:  # the older memtune
        m.setattr(counts, "COUNTS_CACHE", dataclasses.replace(counts.COUNTS_CACHE, format=older))
        m.setattr(vision, "COUNTS_CACHE", counts.COUNTS_CACHE)
        m.setattr(vision, "COUNTS_CACHE_FORMAT", older)
        m.setattr(vision, "_TOWER_LINES", {})
        theirs = vision.tower_line(cfg, False)
    monkeypatch.setattr(vision, "_TOWER_LINES", {})
    assert vision.tower_line(cfg, False) == theirs
    assert "damaged" not in capsys.readouterr().out
    assert len(list((tmp_path / "counts").glob("*.json"))) == 2
