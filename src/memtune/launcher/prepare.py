"""The launcher side of a run: validate, derive, and lay out the run dir the ranks read."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NoReturn

from omegaconf import DictConfig, OmegaConf

from memtune.checkpoints import (
    checkpoint_problem,
    find_latest,
    has_gathered_state,
    is_complete,
    remove_cut_short_saves,
    step_dir_name,
)
from memtune.config import (
    ConfigError,
    RunConfig,
    cache_dir,
    get_field,
    load_run_config,
)
from memtune.config.architecture import (
    adapter_fingerprint,
    base_fingerprint,
)
from memtune.config.decisions import Decisions, with_sections
from memtune.config.deepspeed import build_ds_config
from memtune.config.derive import beta_of, needs_reference
from memtune.config.given import given_config
from memtune.data.cache import (
    Prepared,
    TokenizerFiles,
    load_lengths,
    no_space_is_an_error,
    preprocess,
    tokenizer_files_digest,
)
from memtune.data.packing import StepShape, step_shape
from memtune.filesystem import cannot_write, write_atomic
from memtune.integrity import check_files
from memtune.launcher.oom import restart_changes, with_restart
from memtune.launcher.room import check_run_dir_room
from memtune.machine import versions_line
from memtune.memory.fit import Fitted, fit_to_device, format_step_estimates
from memtune.memory.plan_text import format_plan
from memtune.rundir import (
    DECISIONS,
    BaseRecord,
    DataRecord,
    RecordError,
    RunDir,
    TrainState,
    read_decisions,
)


def decide(
    cfg: RunConfig, refuse: bool = True, link_gb_s: float | None = None, say: bool = True
) -> Fitted:
    """What a launch and ``plan_only`` both decide for a validated config, once
    (memory.fit.fit_to_device): one rank's ZeRO stage, the long-context choices, the number
    of checkpointed layers, the kernels and, with plan.auto_fit, a variant that fits. With
    ``refuse``, a run that cannot fit raises ConfigError with the breakdown. ``link_gb_s``:
    the bandwidth the GPU preflight measured, in place of plan.link_gb_s before any choice
    that orders variants by step time, so the choice and the printed estimate use one figure.
    ``say``: print the decisions (:func:`announce`)."""
    if link_gb_s is not None:
        cfg = replace(cfg, plan=replace(cfg.plan, link_gb_s=link_gb_s))
    fitted = fit_to_device(cfg, refuse)
    if say:
        announce(fitted)
    return fitted


def announce(fitted: Fitted) -> None:
    for note in fitted.notes:
        print(f"memtune: {note}", flush=True)


def lay_out(cfg_node: DictConfig, run_dir: Path) -> tuple[RunConfig, Decisions]:
    """What a launch does before its ranks start, in one call (the tests and the benchmarks
    start ranks on what it lays out): validate, decide, :func:`prepare_run_dir`."""
    return prepare_run_dir(decide(given_config(cfg_node)), run_dir)


def refuse_files_not_ours(rd: RunDir, taken: list[Path]) -> NoReturn:
    """The refusal of a start over the user's files under memtune's names (``taken``:
    :meth:`RunDir.not_ours`), naming them."""
    names = ", ".join(p.name for p in taken[:4]) + (", ..." if len(taken) > 4 else "")
    whose = (
        "which memtune did not write (not its lock or its record of the composition)"
        if rd.held_a_run()
        else "which no memtune run left there (it has no base.json or resume.json)"
    )
    raise ConfigError(
        f"run_dir {rd.path} holds {names}, {whose}: a run writes and replaces those names, so "
        "it is not started over them, and nothing was written there; give the run a dir of "
        "its own (run_dir=...)"
    )


class RunFinished(Exception):
    """The checkpoint a start would continue from already ends the run (:func:`already_finished`
    says why): nothing to train, and nothing of the run dir was written."""


def prepare_run_dir(
    fitted: Fitted, run_dir: Path, finished_stops: bool = False, restart: list[str] | None = None
) -> tuple[RunConfig, Decisions]:
    """Lay out ``run_dir`` for the decided run (``fitted``: what :func:`decide` made of the
    settings; config.yaml records the settings, decisions.json what was decided) and return
    both, as the ranks will read them. ``finished_stops``: a finished run raises RunFinished
    before its records are touched (config.yaml, resume.json, ... stay the ones it trained
    with, not this start's settings).

    ``restart``: the changes of the out-of-memory restart this lays the run out for.

    Everything that can still fail before a rank starts fails here: the DeepSpeed template, the
    disk's room, the data, the checkpoint to resume. A synthesized demo model is built here
    too, once, rather than by every rank at the same time.
    """
    memory_plan, d = fitted.plan, fitted.decisions
    assert memory_plan.counts is not None
    cfg = replace(fitted.cfg, run_dir=str(run_dir))
    rd = RunDir(run_dir)
    taken = rd.run_names_taken()
    if taken:
        refuse_files_not_ours(rd, taken)
    if rd.refused_here():  # memtune's records of a refused start: this start replaces them
        for record in rd.refusal_records():
            record.unlink()
    ds_config = build_ds_config(cfg, d)
    check_run_dir_room(cfg, d.optimizer, memory_plan.counts, rd)
    if cfg.model.synthesize:
        from memtune.tools.tiny import synthesize  # imports torch: only for the demo model

        with no_space_is_an_error(cache_dir(), "MEMTUNE_CACHE_DIR"):
            try:
                synthesize(cfg.model.name_or_path, cfg.model.architecture, vision=cfg.model.vision)
            except OSError:
                unwritable = cannot_write(Path(cfg.model.name_or_path))
                if unwritable is None:
                    raise  # a full disk: said by no_space_is_an_error
                raise ConfigError(
                    f"the demo model cannot be built in {cache_dir()}: {unwritable}; set "
                    "MEMTUNE_CACHE_DIR to a folder memtune can write"
                ) from None
    elif Path(cfg.model.name_or_path).expanduser().is_dir():
        from memtune.model_files import check_checkpoint  # imports torch and transformers

        folder = Path(cfg.model.name_or_path).expanduser()
        check_checkpoint(folder, cfg.model.trust_remote_code, weights=not cfg.preprocess_only)
    prepared = prepare_data(cfg)
    check_token_ids(cfg, prepared)
    again = planned_for_data(fitted, prepared)
    if again is not fitted:
        # Planned anew from the settings for the data: an out-of-memory restart's change
        # (``restart``: the one being made; else this run dir's oom_restart.json) is kept.
        carried = restart if restart is not None else restart_changes(run_dir, cfg.resume)
        fitted = with_restart(again, carried) if carried else again
    memory_plan, d = fitted.plan, fitted.decisions
    cfg = replace(fitted.cfg, run_dir=str(run_dir))
    ds_config = build_ds_config(cfg, d)  # as decided for the data (the same unless planned again)
    shape = train_step_shape(cfg, d, prepared)
    print(f"memtune: {shape.line()}", flush=True)
    base = _base_record(cfg)
    resume = resolve_resume(cfg, d, rd, prepared.dir, base, finished_stops)
    remove_cut_short_saves(rd.checkpoints)
    if cfg.resume == "never":
        start_over(rd)
    # after start_over, which moves an earlier run's entries aside; the OSError is said in one
    # line by launcher.job (before: a rank's traceback at the first save or after the last step,
    # the trained adapter lost; a folder at exit.json, the job's traceback at the very end)
    wrong = rd.wrong_kind(("wandb",) if cfg.logger.backend == "wandb" else ())
    if wrong is not None:
        raise wrong
    with no_space_is_an_error(run_dir, "run_dir"):
        _write_run_dir(cfg, rd, fitted, ds_config, prepared, shape, base, resume)
    return cfg, d


def _base_record(cfg: RunConfig) -> BaseRecord:
    """This run's base model (and the adapter it starts from), by content."""
    name, revision = cfg.model.name_or_path, cfg.model.revision
    start = cfg.peft.init_from
    started = None if start is None else adapter_fingerprint(start)
    return BaseRecord(name, base_fingerprint(name, revision), start, started)


def stop_if_finished(fitted: Fitted, run_dir: Path) -> None:
    """RunFinished when a start of a run dir whose run ended well (exit.json says 0) would
    continue from a checkpoint that ends the run: said before the GPU preflight and the data,
    which a finished run's start ran for nothing (tokenizing again, preflight.json rewritten).
    Decided on the settings alone: a contradiction with the checkpoint (or one the data's plan
    may make) is left to :func:`prepare_run_dir`, which says it with the data in hand."""
    rd = RunDir(run_dir)
    if fitted.cfg.resume == "never" or not rd.exit.is_file():
        return
    try:
        if rd.read_exit().code != 0:
            return
    except RecordError:
        return
    # Only a checkpoint of trainer.max_steps or later can end the run: by its name first, so
    # a finished run continued with more steps hashes its checkpoint once (prepare_run_dir).
    last = step_dir_name(fitted.cfg.trainer.max_steps)
    if fitted.cfg.resume == "auto":
        names = [p.name.removeprefix(".old-") for p in rd.checkpoints.glob("*step-*")]
    else:
        names = [Path(fitted.cfg.resume).expanduser().name]
    if not any(name.startswith("step-") and name >= last for name in names):
        return
    cfg = replace(fitted.cfg, run_dir=str(run_dir))
    resolve_resume(cfg, fitted.decisions, rd, None, _base_record(cfg), finished_stops=True)


def start_over(rd: RunDir) -> None:
    """resume=never in a used run dir: the earlier run moves to previous/ first, so nothing of
    it is read as this run's (its checkpoints counted against keep_last, its latest, its
    metrics, its adapter taken for this run's by a later resume=auto). Done last before the
    run dir is written, once nothing can stop this start any more."""
    moved = rd.set_aside_earlier_run()
    if moved is not None:
        print(
            f"memtune: resume=never: the earlier run in this dir moved to {moved} (kept whole: "
            "its checkpoints, adapter and metrics)",
            flush=True,
        )


def _write_run_dir(
    cfg: RunConfig,
    rd: RunDir,
    fitted: Fitted,
    ds_config: dict[str, Any],
    prepared: Prepared,
    shape: StepShape,
    base: BaseRecord,
    resume: Path | None,
) -> None:
    """The job's half of the run dir: what the ranks read."""
    memory_plan, d = fitted.plan, fitted.decisions
    assert memory_plan.counts is not None
    rd.path.mkdir(parents=True, exist_ok=True)
    rd.write_base(base)
    write_atomic(rd.config, OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    rd.write_decisions(d)
    write_atomic(rd.ds_config, json.dumps(ds_config, indent=2) + "\n")
    estimate = format_step_estimates(cfg, d, memory_plan.counts, fitted.machine)
    write_atomic(
        rd.plan,
        f"{format_plan(cfg, d, memory_plan)}\n{estimate + chr(10) if estimate else ''}"
        f"versions: {versions_line()}\n",
    )
    rd.write_plan(memory_plan.record())
    device = f" of {memory_plan.device_gib:.2f}" if memory_plan.device_gib else ""
    print(
        f"memtune: memory plan {memory_plan.total_gib:.2f}{device} GiB per rank "
        f"(breakdown: {rd.plan})",
        flush=True,
    )
    rd.write_data(
        DataRecord(
            dir=str(prepared.dir),
            reused=prepared.reused,
            train=prepared.train.as_dict(),
            step=shape.as_dict(),
            val=None if prepared.val is None else prepared.val.as_dict(),
        )
    )
    rd.write_resume(resume, resume_changes(cfg, d, resume))


def prepare_data(cfg: RunConfig) -> Prepared:
    """Tokenize into the cache (or find it there) and say what was kept, cut and dropped."""
    from memtune.data.encode import load_tokenizer
    from memtune.data.vision import model_image_settings

    digest = tokenizer_files_digest(cfg.model.name_or_path, cfg.model.revision)
    tokenizer = (
        TokenizerFiles(digest, lambda: load_tokenizer(cfg)) if digest else load_tokenizer(cfg)
    )
    m = cfg.model
    images = model_image_settings(
        m.name_or_path, m.revision, cfg.data.min_pixels, cfg.data.max_pixels
    )
    prepared = preprocess(cfg.data, tokenizer, cfg.trainer.seed, images)
    if prepared.set_aside is not None:
        print(prepared.set_aside, flush=True)
    how = "reused cache" if prepared.reused else "tokenized into"
    print(f"memtune: data {how} {prepared.dir}", flush=True)
    print(f"memtune: train: {prepared.train.line()}", flush=True)
    if prepared.val is not None:
        print(f"memtune: val: {prepared.val.line()}", flush=True)
    for example in prepared.train.bad_examples[1:]:
        print(f"memtune:   also skipped: {example}", flush=True)
    return prepared


TOKEN_CHUNK = 1 << 24
"""Token ids read at a time when the cache's are checked against the vocabulary (64 MiB of
int32): the check's memory does not grow with the data."""


def check_token_ids(cfg: RunConfig, prepared: Prepared) -> None:
    """Every token id of the prepared data has a row in the model's embedding (vocab_size,
    from the architecture the ranks will load). A tokenizer with a token the model has none
    for (a special token added to the tokenizer, the embeddings never resized) otherwise
    fails in every rank's first forward with "IndexError: index out of range in self"; here it
    is one line naming the id, the vocabulary and the model. The ids are read from the cache
    in chunks: a fraction of what one rank loads."""
    from safetensors import safe_open

    vocab = int((cfg.model.architecture or {}).get("vocab_size") or 0)
    if not vocab:
        return  # no architecture to check against: validate() names what is missing
    for split in ("train", "val"):
        path = Path(prepared.dir) / f"{split}.safetensors"
        if not path.is_file():
            continue
        top = -1
        with safe_open(str(path), framework="np") as f:
            ids = f.get_slice("input_ids")
            n = ids.get_shape()[0]
            for start in range(0, n, TOKEN_CHUNK):
                chunk = ids[start : min(n, start + TOKEN_CHUNK)]
                top = max(top, int(chunk.max()))
        if top >= vocab:
            m = cfg.model
            source, text = _vocab_source(cfg, top)
            raise ConfigError(
                f"data: the tokenized {split} split holds token id {top}{text}, and the model "
                f"{m.name_or_path} has vocab_size {vocab} ({source}): it has no embedding for "
                f"ids from {vocab} on, and every rank would fail on it; the tokenizer has tokens "
                "the model has no embedding for (added special tokens?): train with the model's "
                "own tokenizer, or with a checkpoint whose embeddings were resized to this "
                "tokenizer"
            )


def _vocab_source(cfg: RunConfig, token: int) -> tuple[str, str]:
    """For the refusal of a token id past the vocabulary: where vocab_size was read (the
    checkpoint's config.json, else model.architecture) and the token's text, `` ('<|x|>')``,
    where the tokenizer's tokenizer.json names it among its added tokens ("" where not)."""
    from memtune.config.architecture import checkpoint_config_file

    m = cfg.model
    found = None if m.synthesize else checkpoint_config_file(m.name_or_path, m.revision)
    folder = found.parent if found is not None else Path(m.name_or_path)
    try:
        added = json.loads((folder / "tokenizer.json").read_text()).get("added_tokens") or []
        text = next(f" ({t['content']!r})" for t in added if t.get("id") == token)
    except (OSError, ValueError, AttributeError, TypeError, KeyError, StopIteration):
        text = ""
    return (str(found) if found is not None else "model.architecture"), text


def vision_for_images(cfg: RunConfig, d: Decisions, prepared: Prepared) -> Decisions:
    """``d`` with decisions.json ``vision`` for the data read: data with images loads the
    checkpoint's vision-language class, its tower frozen unless peft.target adapts it (#49
    items 3-4, rank.vision); text data keeps the text model. What is not built is refused
    here, by name, before the ranks (they would otherwise read each image's tokens as text):
    images with a model that has no vision tower or is not one of
    config.architecture.VISION_LANGUAGE_TYPES, with a preference objective, sequence
    parallelism or trainer.compile; a ``-and-vision`` target without images.
    ``preprocess_only`` only builds and checks the cache: nothing is refused then."""
    from memtune.config.architecture import VISION_LANGUAGE_TYPES, vision_model_type
    from memtune.config.decisions import vision_of
    from memtune.config.derive import adapts_vision

    images = prepared.train.images + (prepared.val.images if prepared.val else 0)
    if cfg.preprocess_only:
        return d
    adapted = adapts_vision(cfg)
    if not images:
        if adapted:
            raise ConfigError(
                f"peft.target={cfg.peft.target} adapts a vision tower, and the data has no "
                "images (the tower is loaded for data with images only): use "
                f"peft.target={cfg.peft.target.removesuffix('-and-vision')}"
            )
        return d if d.vision is None else replace(d, vision=None)
    m = cfg.model
    kind = vision_model_type(m.name_or_path, m.revision)
    if kind is None:
        raise ConfigError(
            f"data: the records hold {images:,} images, and {m.name_or_path} has no vision "
            "tower (no vision_config in its config.json): train images with a vision-language "
            "checkpoint (Qwen3.5 / 3.6, Qwen3-VL, Qwen2.5-VL)"
        )
    if kind not in VISION_LANGUAGE_TYPES:
        raise ConfigError(
            f"data: the records hold {images:,} images, and {m.name_or_path} is a {kind} model: "
            "training on images is built for "
            f"{', '.join(VISION_LANGUAGE_TYPES)} (Qwen3.5 / 3.6, Qwen3-VL, Qwen2.5-VL) only"
        )
    unbuilt = [
        (cfg.trainer.objective != "sft", f"trainer.objective={cfg.trainer.objective}"),
        (d.sequence_parallel > 1, f"sequence parallelism ({d.sequence_parallel} ranks a sample)"),
        (cfg.trainer.compile, "trainer.compile=true"),
        (bool(d.kernels.fused()), f"trainer.{(d.kernels.fused() or [''])[0]}_kernel=liger"),
    ]
    for on, what in unbuilt:
        if on:
            raise ConfigError(
                f"data: the records hold {images:,} images, and training on images with {what} "
                "is not built yet: images train with trainer.objective=sft, each sample on one "
                "rank (trainer.sequence_parallel=1), without trainer.compile or Liger's layer "
                "kernels"
            )
    return replace(d, vision=vision_of(cfg, d.checkpointing, images=True))


def images_of(prepared: Prepared) -> tuple[int, int, int]:
    """(the most images one sample holds, the largest image's width and height as resized) in
    the prepared data, train and val; (0, 0, 0) without images."""
    from safetensors import safe_open

    most = width = height = 0
    for split in ("train", "val"):
        path = Path(prepared.dir) / f"{split}.safetensors"
        if not path.is_file():
            continue
        with safe_open(str(path), framework="np") as f:
            if "image_offsets" not in set(f.keys()):
                continue
            offsets = f.get_tensor("image_offsets")
            sizes = f.get_tensor("image_sizes")
        most = max(most, int((offsets[1:] - offsets[:-1]).max(initial=0)))
        for h, w in sizes.tolist():
            if h * w > height * width:
                height, width = int(h), int(w)
    return most, width, height


def planned_for_data(fitted: Fitted, prepared: Prepared) -> Fitted:
    """``fitted`` as the data read says: the vision decision for its images
    (:func:`vision_for_images`, with its refusals), and the plan made again when the data
    holds more images a sample than plan.images, or a larger one than plan.image_width ×
    image_height resized, or none where the plan counted some: a launch is planned for the
    images it will train on (memory.vision)."""
    cfg = fitted.cfg
    d = vision_for_images(cfg, fitted.decisions, prepared)
    if cfg.preprocess_only:
        return fitted
    p = cfg.plan
    if d.vision is None:
        wanted = {"images": 0} if p.images else {}
    else:
        from memtune.memory.vision import resized

        most, width, height = images_of(prepared)
        planned = resized(cfg, p.image_width, p.image_height)
        wanted = {}
        if most > p.images:
            wanted["images"] = most
        if width and width * height > planned[0] * planned[1]:
            wanted |= {"image_width": width, "image_height": height}
    if not wanted and d == fitted.decisions:
        return fitted
    if wanted:
        told = " ".join(f"plan.{k}={v}" for k, v in wanted.items())
        print(f"memtune: the data's images: planned again with {told}", flush=True)
    again = decide(with_sections(cfg, plan=wanted))
    # the planner's rule (config.decisions.vision_of) and the data's agree
    assert again.decisions.vision == vision_for_images(again.cfg, again.decisions, prepared).vision
    return again


def train_step_shape(cfg: RunConfig, d: Decisions, prepared: Prepared) -> StepShape:
    t = cfg.trainer
    lengths = load_lengths(prepared.dir, "train")
    unit = "samples" if t.objective == "sft" else "pairs"
    return step_shape(lengths, cfg.data.packing, d.batch, t.max_steps, unit)


# What a checkpoint's state depends on: resuming with any of these changed cannot continue the
# same run (shapes, partitions or the data order would differ).
RESUME_MUST_MATCH = {
    "peft.method": "the adapter type (and the base's quantization)",
    "peft.r": "the LoRA rank",
    "peft.alpha": "the LoRA alpha",
    "peft.target": "the LoRA target modules",
    "peft.rslora": "the adapter's scaling (rsLoRA)",
    "peft.dora": "the adapter type (DoRA's magnitudes)",
    "peft.init": "the adapters' initialisation (pissa and olora rewrite the base)",
    "peft.rank_pattern": "the per-module LoRA ranks",
    "peft.alpha_pattern": "the per-module LoRA alphas",
    "peft.loraplus_lr_ratio": "the optimizer's parameter groups (LoRA+)",
    "peft.train_router": "the trained weights (a mixture's routers)",
    "trainer.micro_batch_size": "the micro batch size (the data position is in micro batches)",
    "trainer.global_batch_size": "the global batch size (the data position is in micro batches)",
    "trainer.precision": "the precision",
    "trainer.seed": "the seed (the data order)",
    "data.packing": "packing (the data position counts rows when packed, samples when not)",
    "data.group_by_length": "length grouping (the data order)",
    "trainer.optimizer": "the optimizer (its saved state is the optimizer's own)",
    "trainer.objective": "the training objective",
    "preference.beta": "the preference objective's beta",
    "preference.label_smoothing": "the preference objective's label smoothing",
    "preference.simpo_gamma": "SimPO's target margin",
    "peft.init_from": "the adapter the stage started from (dpo and ipo: the reference)",
}
QLORA_MUST_MATCH = {
    "peft.quant_type": "the 4-bit data type of the base weights",
    "peft.double_quant": "the quantization of the 4-bit scales",
}
"""A QLoRA adapter is trained against the base as quantized: another quantization is another
base (compared only when the checkpoint's run is QLoRA)."""
ADAMW_8BIT_MUST_MATCH = {
    "trainer.optim_8bit_min_size": "which tensors' saved moments are 8-bit (adamw_8bit)",
}
"""adamw_8bit keeps 8-bit moments for tensors of at least this many elements, fp32 for the
rest: the saved state is laid out by it (compared only when the checkpoint's run is adamw_8bit)."""
BASE_BY_NAME = {
    "model.name_or_path": "the base model",
    "model.revision": "the base model's revision",
    "model.architecture": "the base model's architecture",
}
"""Compared when the base cannot be identified by content (a checkpoint written before
base.json, or a hub name not on disk)."""


def resolve_resume(
    cfg: RunConfig,
    d: Decisions,
    rd: RunDir,
    data_dir: Path | None,
    base: BaseRecord | None = None,
    finished_stops: bool = False,
) -> Path | None:
    """The checkpoint to continue from, verified (its manifest) and checked against the config
    and the base model (``base``: this run's, by content) before any rank starts.
    ``finished_stops``: RunFinished when that checkpoint already ends the run, before the
    resume is announced (there is no step after it). ``data_dir`` None: before the data
    (:func:`stop_if_finished`): RunFinished, saying nothing else (a resume=PATH that is no
    checkpoint, or a damaged one, is the same ConfigError as after the data, only earlier);
    None otherwise."""
    before_data = data_dir is None
    if cfg.resume == "never":
        return None
    if cfg.resume == "auto":
        # skips damaged ones, with a warning each
        ckpt, warnings = find_latest(rd.checkpoints)
        for w in [] if before_data else warnings:
            print(f"memtune: warning: {w}", flush=True)
        if ckpt is None:
            return None
    else:
        # realpath: a symlink loop was Path.resolve's RuntimeError (Python < 3.13)
        ckpt = Path(os.path.realpath(Path(cfg.resume).expanduser()))
        if not is_complete(ckpt) and RunDir(ckpt).checkpoints.is_dir():
            newest, _ = find_latest(RunDir(ckpt).checkpoints)
            raise ConfigError(
                f"resume={cfg.resume}: a run dir, not a checkpoint: give one of its checkpoints"
                + (f" (its newest: resume={newest})" if newest is not None else " (it has none)")
                + f", or continue that run in place with run_dir={cfg.resume} (resume=auto)"
            )
        if not is_complete(ckpt):
            raise ConfigError(
                f"resume={cfg.resume}: not a complete memtune checkpoint (a "
                "RUN_DIR/checkpoints/step-N folder whose save finished)"
            )
        problem = checkpoint_problem(ckpt)
        if problem is not None:
            raise ConfigError(f"resume={cfg.resume}: the checkpoint is damaged: {problem}")
    saved = checkpoint_run(ckpt)
    must_match = dict(RESUME_MUST_MATCH)
    if saved.value("peft.method") == "qlora":
        must_match |= QLORA_MUST_MATCH
    if saved.value("trainer.optimizer") == "adamw_8bit":
        must_match |= ADAMW_8BIT_MUST_MATCH
    diffs = _base_differences(cfg, ckpt, base)
    if diffs is None:
        diffs = []
        must_match |= BASE_BY_NAME
    if not needs_reference(cfg):
        # the adapter a stage started from shapes only its first step: a resume restores the
        # checkpoint's weights (a replaced stage-1 adapter does not matter to stage 2)
        del must_match["peft.init_from"]
    else:
        started = _start_differences(ckpt, base)  # the reference: by content, not by path
        if started is not None:
            diffs += started
            del must_match["peft.init_from"]
    now = RunValues(cfg, d)
    for key, what in must_match.items():
        old, new = saved.value(key), now.value(key)
        if old != new:
            diffs.append(f"  {key}: checkpoint {old!r}, now {new!r} ({what})")
    state = _train_state(ckpt)
    ranks = cfg.launcher.num_ranks
    old_stage, stage = saved.value("zero.stage"), d.zero_stage
    old_ep, ep = saved.value("trainer.expert_parallel"), now.value("trainer.expert_parallel")
    if state.world_size != ranks or old_stage != stage or str(old_ep) != str(ep):
        why = world_change_problem(cfg, ckpt)
        changed = f"{state.world_size} rank(s), ZeRO-{old_stage} → {ranks}, ZeRO-{stage}"
        if str(old_ep) != str(ep):
            changed += f"; trainer.expert_parallel {old_ep} → {ep}"
        if saved.cfg.launcher.nnodes != cfg.launcher.nnodes:
            changed += f"; {saved.cfg.launcher.nnodes} → {cfg.launcher.nnodes} node(s)"
        if why:
            diffs.append(f"  launcher.num_ranks / zero.stage: checkpoint {changed} ({why})")
        elif not before_data:
            print(
                f"memtune: resuming across a change of ranks or ZeRO stage ({changed}): same "
                f"global batch {d.batch.global_batch}, accumulation now "
                f"{d.batch.accumulation}",
                flush=True,
            )
    if data_dir is not None and state.data_dir and Path(state.data_dir).name != data_dir.name:
        diffs.append("  data: the tokenized data differs from the checkpoint's (files or settings)")
    if diffs and before_data:
        return None  # said by the start that goes on, on the decisions made for the data
    if diffs:
        raise ConfigError(
            f"cannot resume from {ckpt}: the config contradicts it\n"
            + "\n".join(diffs)
            + "\nRestore those values, or start fresh: resume=never (or a new run_dir). "
            "The adapter of that checkpoint is in its adapter/ folder."
        )
    if (
        finished_stops
        and (finished := already_finished(cfg, rd.path, ckpt, say=not before_data)) is not None
    ):
        raise RunFinished(finished)
    if before_data:
        return None
    print(f"memtune: resuming from {ckpt} (step {state.step})", flush=True)
    schedule = [
        f"{k} {saved.value(k)} → {now.value(k)}"
        for k in SCHEDULE_KEYS
        if saved.value(k) != now.value(k)
    ]
    if schedule:
        print(
            f"memtune: {', '.join(schedule)}: the learning-rate schedule is this run's from "
            f"step {state.step + 1} on (recorded in resume.json)",
            flush=True,
        )
    for k in OPTIMIZER_KEYS:
        if saved.value(k) != now.value(k):
            print(
                f"memtune: {k} {saved.value(k)} → {now.value(k)}: the optimizer steps with this "
                f"run's from step {state.step + 1} on (recorded in resume.json)",
                flush=True,
            )
    return ckpt


def _base_differences(cfg: RunConfig, ckpt: Path, base: BaseRecord | None) -> list[str] | None:
    """The base model compared by content: [] when it is the checkpoint's (wherever it now
    is), a difference line when it is not, None when either side has no fingerprint (then
    the name and the architecture are compared instead)."""
    saved = RunDir(ckpt)  # a checkpoint keeps the run dir's base.json under its name
    if base is None or base.fingerprint is None or not saved.base.is_file():
        return None
    then = saved.read_base()
    if then.fingerprint is None:
        return None
    if then.fingerprint != base.fingerprint:
        same = "the same path" if then.name_or_path == base.name_or_path else "another path"
        return [
            f"  model: the base at {base.name_or_path} is not the checkpoint's base "
            f"({then.name_or_path}, {same}): its config.json or weight files differ"
        ]
    if then.name_or_path != base.name_or_path:
        print(
            f"memtune: the base model moved ({then.name_or_path} → {base.name_or_path}); "
            "the same config and weights, by content",
            flush=True,
        )
    return []


def _start_differences(ckpt: Path, base: BaseRecord | None) -> list[str] | None:
    """The adapter the stage started from (peft.init_from) compared by content: [] when it is
    the checkpoint's (wherever it now is), a difference line when it is not, None when either
    side has no fingerprint (a checkpoint from before base.json held one, or no init_from on
    either side: the path is compared instead)."""
    saved = RunDir(ckpt)
    if base is None or base.init_from_fingerprint is None or not saved.base.is_file():
        return None
    then = saved.read_base()
    if then.init_from_fingerprint is None:
        return None
    if then.init_from_fingerprint != base.init_from_fingerprint:
        same = "the same path" if then.init_from == base.init_from else f"then {then.init_from}"
        return [
            f"  peft.init_from: the adapter at {base.init_from} is not the one the checkpoint "
            f"started from ({same}): its weights differ (the reference the pairs are scored "
            "against)"
        ]
    if then.init_from != base.init_from:
        print(
            f"memtune: the adapter of peft.init_from moved ({then.init_from} → "
            f"{base.init_from}); the same adapter, by content",
            flush=True,
        )
    return []


SCHEDULE_KEYS = (
    "trainer.max_steps",
    "trainer.lr",
    "trainer.warmup_steps",
    "trainer.min_lr_ratio",
)
"""Settings of the learning-rate schedule a resume may change: the schedule is then this run's
from the next step on (rank.checkpoint.follow_schedule), never the saving run's."""

OPTIMIZER_KEYS = ("trainer.weight_decay",)
"""Settings of the optimizer's steps a resume may change: this run's from the next step on
(rank.checkpoint.follow_schedule sets them on the restored parameter groups)."""


def resume_changes(cfg: RunConfig, d: Decisions, ckpt: Path | None) -> dict[str, list[Any]]:
    """What a resume changes that it may: the number of ranks, nodes, the ZeRO stage, the
    expert-parallel size (a mixture's experts split otherwise over the ranks: the engine files
    hold the old split, the gathered state every expert), the learning-rate schedule."""
    if ckpt is None:
        return {}
    saved, now = checkpoint_run(ckpt), RunValues(cfg, d)
    keys = (
        "launcher.num_ranks",
        "launcher.nnodes",
        "zero.stage",
        "trainer.expert_parallel",
        *SCHEDULE_KEYS,
        *OPTIMIZER_KEYS,
    )
    return {k: [saved.value(k), now.value(k)] for k in keys if saved.value(k) != now.value(k)}


DECIDED_KEYS: dict[str, Callable[[Decisions], Any]] = {
    "peft.method": lambda d: d.peft_method,
    "zero.stage": lambda d: d.zero_stage,
    "trainer.optimizer": lambda d: d.optimizer,
    "trainer.micro_batch_size": lambda d: d.batch.micro_batch,
    "trainer.global_batch_size": lambda d: d.batch.global_batch,
    "trainer.expert_parallel": lambda d: 1 if d.experts is None else d.experts.parallel,
}
"""The settings a resume compares whose value in the run is decided (plan.auto_fit, one
rank's ZeRO stage may change them): compared as decided."""


@dataclass(frozen=True)
class RunValues:
    """A run's value of a setting as it ran: decided (DECIDED_KEYS) from its decisions, the
    rest from its settings. ``d`` None: a checkpoint from before decisions.json, whose
    config.yaml held the decided values themselves."""

    cfg: RunConfig
    d: Decisions | None

    def value(self, key: str) -> Any:
        if self.d is not None and key in DECIDED_KEYS:
            return DECIDED_KEYS[key](self.d)
        if key == "preference.beta":  # the beta it trained with: unset is the objective's own
            return beta_of(self.cfg)
        return get_field(self.cfg, key)


def checkpoint_run(ckpt: Path) -> RunValues:
    """The settings and decisions a checkpoint was saved with; ConfigError naming the file
    when they cannot be read."""
    saved = load_run_config(ckpt / "config.yaml")
    path = ckpt / DECISIONS
    if not path.is_file():
        return RunValues(saved, None)  # written before decisions.json: decided values inline
    try:
        return RunValues(saved, read_decisions(path))
    except RecordError as err:
        raise ConfigError(f"cannot resume: {err}") from None


def world_change_problem(cfg: RunConfig, ckpt: Path) -> str | None:
    """Why this checkpoint cannot continue on another number of ranks (or ZeRO stage), or
    None when it can:
    it keeps its trainable state gathered (checkpoints.GATHERED, Adam optimizers), and the
    sample order does not depend on the ranks (not so for length grouping)."""
    if not has_gathered_state(ckpt):
        return (
            "its optimizer state is saved per rank only (8-bit AdamW, or a checkpoint of an "
            "older memtune): resume on the same number of ranks, or start a new run from its "
            "adapter/"
        )
    if cfg.data.group_by_length:
        return "data.group_by_length deals batches to ranks: the sample order depends on them"
    return None


def _train_state(ckpt: Path) -> TrainState:
    """The checkpoint's state, or a ConfigError naming the file (an old or foreign format)."""
    try:
        return TrainState.read(ckpt)
    except RecordError as err:
        raise ConfigError(f"cannot resume: {err}") from None


def already_finished(
    cfg: RunConfig, run_dir: Path, ckpt: Path | None = None, say: bool = True
) -> str | None:
    """Why there is nothing to run: the checkpoint being resumed (``ckpt``, else the one
    resume.json records) reached trainer.max_steps, the job's final record says exit 0, and
    the final files summary.json lists verify (sizes and hashes). A run whose end was cut short
    (a full disk while writing the tokenizer, the summary or exit.json) is not finished: its
    ranks start again from the last checkpoint and export anew."""
    rd = RunDir(run_dir)
    if ckpt is None:
        recorded = rd.read_resume().checkpoint
        if not recorded:
            return None
        ckpt = Path(recorded)
    step = _train_state(ckpt).step
    if step < cfg.trainer.max_steps:
        return None
    problem = _final_outputs_problem(rd, step)
    if problem is not None and say:
        print(
            f"memtune: {ckpt.name} is the last step, but the run's end did not complete "
            f"({problem}): exporting again from it",
            flush=True,
        )
    if problem is not None:
        return None
    return (
        f"already finished: {ckpt.name} is step {step} of trainer.max_steps="
        f"{cfg.trainer.max_steps}, the adapter is in {rd.adapter} (raise trainer.max_steps "
        "to train on, or resume=never to start over)"
    )


def _final_outputs_problem(rd: RunDir, step: int) -> str | None:
    """What keeps a run that reached ``step`` from counting as finished; None when its end
    verifies. The summary must be this step's: an earlier end's exit 0 and summary (a run
    finished at 100 steps, then continued to 200 and killed before its export) still verify
    as files, but describe the older adapter."""
    try:
        if rd.read_exit().code != 0:
            return f"{rd.exit} does not say exit 0"
        summary = rd.read_summary()
    except RecordError as err:
        return str(err)
    if summary.steps != step:
        return f"{rd.summary} is the end of step {summary.steps}, not of step {step}"
    if not summary.outputs:  # written before summaries listed their files
        adapter = rd.adapter / "adapter_model.safetensors"
        return None if adapter.is_file() else f"{adapter} is missing"
    return check_files(rd.path, summary.outputs)
