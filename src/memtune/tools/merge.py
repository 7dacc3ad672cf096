"""Merge a LoRA adapter into its base model: ``memtune merge ADAPTER OUT``.

Loads the base (in the precision the adapter was trained in, unless ``--dtype`` says
otherwise), applies the adapter, folds it into the weights with
``merge_and_unload`` and saves a plain model + tokenizer that
``AutoModelForCausalLM.from_pretrained(OUT)`` loads with no peft installed. A vision-language
base (Qwen3-VL, Qwen2.5-VL, Qwen3.5) merges into its own class, vision tower and merger kept
(merged too where the adapter has LoRA on them), with its image processor's settings
(``preprocessor_config.json``, ``processor_config.json``) copied beside it, the run's
data.min_pixels / data.max_pixels written into them: ``AutoModelForImageTextToText`` loads OUT,
and its processor sizes an image as training did.

An adapter trained over a quantized base (QLoRA NF4, LLM.int8) learned to correct the
*quantized* weights, so by default it is merged into the base quantized exactly as in training
and then dequantized (``--into dequantized``): that model behaves like the one you trained.
``--into original`` merges into the original full-precision weights instead, which keeps their
precision but adds the quantization error back under the adapter's correction. The run's
``config.yaml`` next to the adapter says how the base was quantized; an adapter without one
(copied out of its run dir, or trained elsewhere) is merged only with ``--into original``: how
its base was held in training is unknown, and merged into the original weights a QLoRA adapter
would answer otherwise than the model it trained.

The base is loaded with the run's ``model.rope_scaling`` (YaRN) as in training, so the merged
model's ``config.json`` carries it and the merged model reads long prompts as the trained one.

OUT must not exist yet (or be an empty directory): memtune never writes into a directory it did
not create. The model is saved into a temporary sibling (``.OUT.tmp-<host>-<pid>-XXXX``) that
is renamed to OUT once complete, and removed if the merge fails (or, left by a merge that was
killed, by the next merge into OUT).
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memtune.adapter_check import adapter_problem
from memtune.arguments import VerbParser
from memtune.config import ConfigError, RunConfig, load_run_config
from memtune.config.architecture import is_multimodal
from memtune.config.decisions import experts_of
from memtune.config.schema import PeftMethod
from memtune.filesystem import (
    FULL_DISK,
    follow_umask,
    owned_temp_dir,
    remove_left_by_dead,
    safetensors_write_errors,
)
from memtune.paths import is_local_source
from memtune.quiet import no_progress_bars
from memtune.rundir import DECISIONS, RecordError, read_decisions
from memtune.safetensors_check import model_weights_problem

# torch's names: torch is imported by merge() only, so a refused merge answers at once.
DTYPES = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}


def base_of(adapter_dir: Path) -> str:
    """The base model the adapter names (its adapter_config.json's base_model_name_or_path)."""
    config_file = adapter_dir / "adapter_config.json"
    base = json.loads(config_file.read_text()).get("base_model_name_or_path")
    if not base:
        raise ConfigError(
            f"{config_file} names no base model (base_model_name_or_path): give --base"
        )
    return str(base)


def base_problem(base: str) -> str | None:
    """What keeps a base model on this machine from loading, in words naming it: a path that
    does not exist, or a damaged safetensors file in it; None for one that looks whole, and
    for a hub name (transformers' to find)."""
    if not is_local_source(base):
        return None
    path = Path(base).expanduser()
    if not path.exists():
        return f"{base}: no such directory"
    if not path.is_dir():
        return f"{base} is a file, not a model directory"
    if not (path / "config.json").is_file():
        return f"{base} has no config.json: not a model saved with save_pretrained"
    return model_weights_problem(path)


@dataclass(frozen=True)
class TrainedAs:
    """How the run that wrote an adapter held its base: its settings, and the peft method and
    expert-stack storage it ran with (decided: plan.auto_fit may have chosen QLoRA)."""

    cfg: RunConfig
    method: PeftMethod
    expert_storage: str | None


def trained_as(adapter_dir: Path) -> TrainedAs | None:
    """Of the run that wrote the adapter (RUN_DIR/adapter or a checkpoint's): its
    config.yaml, read with the decisions.json beside it; a run from before decisions.json
    held the decided values in its config.yaml itself. Only where a run puts them: beside the
    adapter (RUN_DIR/, a checkpoint's step-N/), or RUN_DIR/ for a checkpoint that holds none;
    an adapter copied elsewhere is not merged with whatever config.yaml lies above it."""
    # checkpoints/step-N/adapter given from checkpoints/; realpath, not Path.resolve: a
    # symlink loop was resolve's RuntimeError (Python < 3.13), before check_paths named it
    adapter_dir = Path(os.path.realpath(adapter_dir))
    places = [adapter_dir.parent]
    if adapter_dir.parent.parent.name == "checkpoints":
        places.append(adapter_dir.parent.parent.parent)
    for parent in places:
        if (parent / "config.yaml").is_file():
            cfg = load_run_config(parent / "config.yaml")
            if (parent / DECISIONS).is_file():
                try:
                    d = read_decisions(parent / DECISIONS)
                except RecordError as err:
                    raise ConfigError(str(err)) from None
                storage = d.experts.storage if d.experts else None
                return TrainedAs(cfg, d.peft_method, storage)
            experts = experts_of(cfg)
            return TrainedAs(cfg, cfg.peft.method, experts.storage if experts else None)
    return None


def check_paths(adapter_dir: Path, out_dir: Path) -> None:
    """ConfigError unless ``adapter_dir`` holds a whole adapter (memtune.adapter_check) and
    ``out_dir`` is free: absent, or an empty directory."""
    if not adapter_dir.is_dir():
        raise ConfigError(f"{adapter_dir}: no such directory (give RUN_DIR/adapter)")
    if not (adapter_dir / "adapter_config.json").is_file():
        raise ConfigError(
            f"{adapter_dir} has no adapter_config.json: not an adapter (give RUN_DIR/adapter "
            "or a checkpoint's adapter/)"
        )
    if os.path.lexists(out_dir) and (
        out_dir.is_symlink() or not out_dir.is_dir() or any(out_dir.iterdir())
    ):
        raise ConfigError(
            f"{out_dir} already exists and is not an empty directory; merge writes only a new "
            "one: give another OUT, or move that one away yourself"
        )
    problem = adapter_problem(adapter_dir)
    if problem:
        raise ConfigError(
            f"{problem}; give an adapter saved whole (a run's RUN_DIR/adapter, or a "
            "checkpoint's adapter/)"
        )


def merged_dtype(trained: TrainedAs | None, asked: str | None) -> str:
    """The merged weights' dtype: ``asked``, else the precision the adapter was trained in
    (``trained``: :func:`trained_as`; bf16 for an adapter of no memtune run): a merge in
    another dtype answers a prompt differently from the adapter it merges (the fp32 CPU demo,
    merged in bf16)."""
    if asked is not None:
        return asked
    return trained.cfg.trainer.precision if trained is not None else "bf16"


def merge(
    adapter_dir: Path,
    out_dir: Path,
    base: str | None = None,
    dtype: str | None = None,
    into: str | None = None,
) -> Path:
    """Write the merged model and tokenizer to ``out_dir`` (absent or empty: ConfigError
    otherwise), through a temporary sibling renamed into place at the end; in ``dtype``, by
    default the training's (:func:`merged_dtype`). ``into``: dequantized (None: the default)
    or original; an adapter of no known run (:func:`trained_as`) is refused unless original."""
    out_dir = Path(os.path.abspath(out_dir))
    check_paths(adapter_dir, out_dir)
    trained = trained_as(adapter_dir)
    if trained is None and into != "original":
        beside = Path(os.path.realpath(adapter_dir)).parent  # where trained_as looked first
        raise ConfigError(
            f"{adapter_dir}: no run's config.yaml beside it, so how its training held the base "
            f"(unquantized, QLoRA or LLM.int8) is unknown: copy the run's config.yaml and "
            f"decisions.json (what ran: plan.auto_fit may have chosen QLoRA) into {beside} to "
            "merge as trained, or give --into original to merge into the base's weights as "
            "stored (right for an adapter trained without quantization)"
        )
    into = into or "dequantized"
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        # A merge into OUT killed before its rename left a whole model beside it: removed here.
        prefix = f".{out_dir.name}.tmp-"
        remove_left_by_dead(out_dir.parent, prefix, f"a merge into {out_dir.name}")
        staging = owned_temp_dir(out_dir.parent, prefix)
    except OSError as err:
        raise ConfigError(f"{out_dir.parent}: cannot write there ({err.strerror or err})") from None
    try:
        try:
            with safetensors_write_errors(out_dir):
                _merge_into(staging, adapter_dir, trained, base, merged_dtype(trained, dtype), into)
        except OSError as err:
            if err.errno not in FULL_DISK:
                raise
            # the weights' SafetensorError (or the tokenizer's OSError) was a traceback
            raise ConfigError(
                f"{out_dir}: cannot write the merged model there ({err.strerror}); nothing was "
                "kept: free space, or give an OUT on a filesystem with room"
            ) from None
        follow_umask(staging)  # mkdtemp's 0700 dir, safetensors' 0600 files: the user's modes
        try:
            # Onto an absent or empty OUT only: one filled in the meantime is not replaced.
            staging.rename(out_dir)
        except OSError as err:
            if err.errno in (errno.ENOTEMPTY, errno.EEXIST) and out_dir.is_dir():
                # (its error named the staging dir, removed by then)
                raise ConfigError(
                    f"{out_dir}: filled while this merge ran (another merge into it?): kept as it "
                    "is, and this merge's model not kept; give another OUT"
                ) from None
            raise ConfigError(
                f"{out_dir}: cannot put the merged model there ({err.strerror or err})"
            ) from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def _merge_into(
    out_dir: Path,
    adapter_dir: Path,
    trained: TrainedAs | None,
    base: str | None,
    dtype: str,
    into: str,
) -> None:
    cfg = trained.cfg if trained is not None else None
    # The revision the run trained on, unless another base is given (its own main).
    revision = cfg.model.revision if cfg is not None and base is None else None
    given = base is not None
    base = base or base_of(adapter_dir)
    problem = base_problem(base)
    if problem:
        where = "give --base" if given else "the adapter names it; give --base"
        raise ConfigError(
            f"base model {problem}; {where} a model directory saved with save_pretrained, or a "
            "hub name (Qwen/Qwen2.5-7B-Instruct)"
        )
    # Inside the function: torch, transformers and peft take seconds to import.
    from transformers import AutoTokenizer

    try:
        rope = cfg.model.rope_scaling if cfg is not None else None  # over --base's too
        model = load_base(base, revision, adapter_dir, trained, dtype, into, rope)
    except OSError as err:  # transformers: neither a local model dir nor one on the Hub
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"base model {base}: cannot load it ({first}); give --base") from None
    merged = with_adapter(model, adapter_dir, base, "give --base the model it was trained on")
    merged = merged.merge_and_unload()
    merged.save_pretrained(str(out_dir))
    if (adapter_dir / "tokenizer_config.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(str(adapter_dir))
    else:
        tokenizer = AutoTokenizer.from_pretrained(base, revision=revision)
    tokenizer.save_pretrained(str(out_dir))
    copy_processor_files(base, revision, out_dir)
    if cfg is not None:
        write_pixel_limits(out_dir, cfg.data.min_pixels, cfg.data.max_pixels)


def base_class(
    name_or_path: str | Path, revision: str | None = None, adapter_dir: Path | None = None
) -> Any:
    """The checkpoint's own model class (its config.json's ``architectures``) when it is a
    multimodal one — on disk, or as the adapter's names say (a hub name not downloaded yet):
    for a released Qwen3.5 ``Qwen3_5ForConditionalGeneration``, whose module names memtune's
    adapters carry (rank.checkpoint.name_for_multimodal_class); ``AutoModelForCausalLM``
    otherwise. (peft matches an adapter by name: on the text class it would load nothing.)"""
    import transformers

    from memtune.rank.checkpoint import names_multimodal_class

    named = adapter_dir is not None and names_multimodal_class(adapter_dir)
    if named or is_multimodal(str(name_or_path), revision):
        config = transformers.AutoConfig.from_pretrained(name_or_path, revision=revision)
        for name in config.architectures or []:
            if hasattr(transformers, name):
                return getattr(transformers, name)
    return transformers.AutoModelForCausalLM


def with_adapter(model: Any, adapter_dir: Path, base: str, hint: str) -> Any:
    """``model`` (the base, :func:`load_base`) with the adapter at ``adapter_dir`` loaded by
    peft. An adapter trained on another base model is refused, naming the adapter, the base
    and one tensor that does not fit (``hint``: what to give instead): peft stops with a
    state-dict traceback where shapes differ, and where no name matches (a text model's
    adapter on a vision-language class) it only warns and leaves the base's weights, whose
    answers would pass for the adapter's."""
    import warnings

    from peft import PeftModel

    def refused(detail: str) -> ConfigError:
        return ConfigError(
            f"{adapter_dir}: the adapter does not fit the base model {base} ({detail}): it was "
            f"trained on another base; {hint}"
        )

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            loaded = PeftModel.from_pretrained(model, str(adapter_dir))
        except RuntimeError as err:
            lines = [line.strip() for line in str(err).splitlines()]
            mismatch = next((line for line in lines if line.startswith("size mismatch")), None)
            if mismatch is None:
                raise
            raise refused(mismatch.replace("torch.Size(", "(").rstrip(".")) from None
    for w in caught:
        text = str(w.message)
        if "missing adapter keys" in text and "lora_" in text:
            missing = text.split("[", 1)[-1].split(",")[0].strip(" '\"]")
            raise refused(f"no tensor in the adapter for {missing}")
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return loaded


def load_base(
    base: str,
    revision: str | None,
    adapter_dir: Path,
    trained: TrainedAs | None,
    dtype: str,
    into: str = "dequantized",
    rope_scaling: dict[str, Any] | None = None,
) -> Any:
    """The base model the adapter applies to, in ``dtype``, in its own class (a multimodal
    checkpoint's, vision tower and all: its adapter is named for that class), its RoPE under
    the run's ``rope_scaling`` (model.rope_scaling: YaRN) as in training, so the merged
    model's config.json carries it. A base trained
    quantized (``trained``'s decided method: QLoRA, LLM.int8) is quantized exactly as in
    training, from the training dtype, and dequantized (``into="dequantized"``): the weights
    the adapter learned to correct; ``into="original"``: the checkpoint's weights as stored.
    ``memtune merge`` and ``memtune generate`` load the base here, so a generated answer is
    the merged model's."""
    import torch
    from transformers import AutoModelForCausalLM

    from memtune.rank.model import quantization_config, torch_dtype, with_rope_scaling
    from memtune.rank.vision import NOT_QUANTIZED

    model_class = base_class(base, revision, adapter_dir)
    quant = None
    if trained is not None and into == "dequantized":
        # A run on images kept the tower out of bitsandbytes (and a text run never loaded it):
        # quantizing it here would put a rounding into it that training never saw.
        keep = NOT_QUANTIZED if model_class is not AutoModelForCausalLM else None
        quant = quantization_config(trained.cfg, trained.method, keep)
    config = with_rope_scaling(base, revision, rope_scaling)
    extra = {"config": config} if config is not None else {}
    if quant is None or trained is None:
        return model_class.from_pretrained(
            base, dtype=getattr(torch, DTYPES[dtype]), revision=revision, **extra
        )
    trained_dtype = torch_dtype(trained.cfg)
    quantized = model_class.from_pretrained(
        base, dtype=trained_dtype, quantization_config=quant, revision=revision, **extra
    )
    model = quantized.dequantize()
    # a mixture's expert stacks, which memtune quantized itself (none in a dense model)
    from memtune.rank.experts import round_trip_experts

    if trained.expert_storage not in (None, "compute"):
        round_trip_experts(model, trained.expert_storage, trained_dtype)
    return model.to(getattr(torch, DTYPES[dtype]))


PROCESSOR_FILES = (
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "processor_config.json",
    "chat_template.json",
)
"""A vision-language checkpoint's processor settings beside its weights: the image processor's
(patch size, merge size, min / max pixels) that the merged model needs to read an image as the
base did. The tokenizer's files are written by the tokenizer itself."""


def copy_processor_files(base: str, revision: str | None, out_dir: Path) -> list[str]:
    """Copy the base's :data:`PROCESSOR_FILES` it has (a local dir, or the Hub) into ``out_dir``
    where the tokenizer wrote none of the same name; returns the names copied."""
    from transformers.utils import cached_file

    copied = []
    for name in PROCESSOR_FILES:
        if (out_dir / name).exists():
            continue
        found = cached_file(
            base,
            name,
            revision=revision,
            _raise_exceptions_for_missing_entries=False,
            _raise_exceptions_for_connection_errors=False,
        )
        if found is not None:
            shutil.copyfile(found, out_dir / name)
            copied.append(name)
    return copied


def write_pixel_limits(out_dir: Path, min_pixels: int | None, max_pixels: int | None) -> list[str]:
    """Write the run's data.min_pixels / data.max_pixels (None: the base's kept) into the image
    processor settings copied into ``out_dir``, so that the merged model's processor
    (AutoProcessor, AutoImageProcessor, vLLM) resizes an image as training did: the base's,
    copied as they are, sized a 1920 × 1080 image trained at data.max_pixels=1003520 (943
    tokens) to 2,040 tokens. Both files transformers reads them from (preprocessor_config.json,
    and processor_config.json's ``image_processor``, which it reads first), each where it is:
    ``size``'s shortest_edge / longest_edge, and the older top-level min_pixels / max_pixels
    where the file has them (Qwen2VLImageProcessor reads those over ``size``). Returns the
    names written."""
    from memtune.data.vision import PREPROCESSOR_CONFIG, PROCESSOR_CONFIG, ImageSettings

    if min_pixels is None and max_pixels is None:
        return []
    written = []
    for name in (PREPROCESSOR_CONFIG, PROCESSOR_CONFIG):
        path = out_dir / name
        if not path.is_file():
            continue
        whole = json.loads(path.read_text(encoding="utf-8"))
        fields = whole.get("image_processor") if name == PROCESSOR_CONFIG else whole
        if not isinstance(fields, dict):
            continue  # a processor_config.json without an image processor in it
        limits = ImageSettings.from_config(fields, min_pixels, max_pixels)
        size = dict(fields.get("size") or {})
        size.update(shortest_edge=limits.min_pixels, longest_edge=limits.max_pixels)
        fields["size"] = size
        for key, value in (("min_pixels", limits.min_pixels), ("max_pixels", limits.max_pixels)):
            if key in fields:
                fields[key] = value
        path.write_text(json.dumps(whole, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        written.append(name)
    return written


def main(argv: list[str] | None = None) -> None:
    parser = VerbParser(
        prog="memtune merge",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("adapter", type=Path, help="an adapter/ folder (run dir or checkpoint)")
    parser.add_argument("out", type=Path, help="a new directory for the merged model")
    parser.add_argument("--base", help="base model (default: the one the adapter names)")
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        help="the merged weights' dtype (default: the precision the adapter was trained in)",
    )
    parser.add_argument(
        "--into",
        choices=["dequantized", "original"],
        help="for an adapter trained over a quantized base: merge into that base dequantized "
        "(default, behaves like the trained model) or into the original weights; an adapter "
        "without its run's config.yaml beside it needs original",
    )
    args = parser.parse_args(argv)
    dtype = merged_dtype(trained_as(args.adapter), args.dtype)  # for the line below
    with no_progress_bars():  # transformers' loading and writing bars: the line below says it
        out = merge(args.adapter, args.out, args.base, dtype, args.into)
    print(f"memtune: merged model ({dtype}) written to {out}")


if __name__ == "__main__":
    main()
