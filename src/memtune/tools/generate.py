"""Answer a prompt with a trained adapter (or a merged model), rendered exactly as in training.

    memtune generate RUN_DIR "What is the capital of France?"
    memtune generate RUN_DIR --model MERGED_DIR "..."

    memtune generate RUN_DIR --image receipt.png "What is the total?"

The run's config gives the template and system prompt, so the prompt is the same text the
model was trained on (qwen3, qwen3_5: with the empty think block, unless ``--thinking``).
``--system TEXT`` puts TEXT in place of the run's data.system_prompt: a run trained on records
with their own system prompts learned its answers under those. Generation stops at the turn's
end marker (``<|im_end|>`` in ChatML) or the tokenizer's eos. The base is held as ``memtune
merge``'s default holds it (memtune.tools.merge.load_base): in the training precision, its RoPE
under the run's ``model.rope_scaling`` (YaRN), and a QLoRA / LLM.int8 run's quantized as in
training, then dequantized.

``--tools FILE`` offers functions (a JSON list of function schemas, as a record's ``tools``):
the prompt's system turn holds them as training wrote them, and the answer is the model's text,
a call as the run's template writes one.

``--image PATH`` (once per image) puts images in the user turn, before its text, encoded as the
run's data encodes them: resized by the model's image processor with the run's
``data.min_pixels`` / ``data.max_pixels``, one ``<|image_pad|>`` per merged patch. The model
(a vision-language checkpoint's released class, or a merged one) generates with its own
``generate``.

An answer cut at ``--max-new-tokens`` (default 128) before the model ended its turn is followed by
one line on stderr that says so.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memtune.adapter_check import adapter_problem
from memtune.arguments import VerbParser, positive_int
from memtune.config import ConfigError, DataConfig, ModelConfig, load_run_config
from memtune.data.templates import IM_END, render_prompt, with_system
from memtune.data.vision import IMAGE_PLACEHOLDER, ImageSettings
from memtune.quiet import no_progress_bars
from memtune.rundir import RunDir
from memtune.safetensors_check import model_weights_problem

if TYPE_CHECKING:
    from memtune.tools.merge import TrainedAs


def stop_token_ids(tokenizer: Any) -> list[int]:
    """Every id that ends an answer: eos, and <|im_end|> when the vocabulary has it."""
    ids = {tokenizer.eos_token_id}
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        ids.add(im_end)
    return sorted(i for i in ids if i is not None)


def cut_short(new: Sequence[int], max_new_tokens: int, stops: Sequence[int]) -> bool:
    """Generation stopped at ``max_new_tokens`` without an end of turn: the answer goes on.
    (An answer whose stop token is the limit's last token ended.)"""
    return len(new) >= max_new_tokens and not (new and new[-1] in stops)


BASE_HINT = (
    "the run's config.yaml names that base (model.name_or_path): put the model the run trained "
    "on there, or give its merged model with --model"
)


def base_of_run(run_dir: Path) -> tuple[TrainedAs | None, ModelConfig]:
    """How the run that wrote RUN_DIR/adapter held its base (memtune merge's
    :func:`~memtune.tools.merge.trained_as`), and the base: its run's model settings."""
    from memtune.tools.merge import trained_as

    trained = trained_as(RunDir(run_dir).adapter)
    if trained is not None:
        return trained, trained.cfg.model
    return None, load_run_config(RunDir(run_dir).config).model


def load(run_dir: Path, model_dir: Path | None = None) -> tuple[Any, Any]:
    from transformers import AutoTokenizer

    rd = RunDir(run_dir)
    adapter = rd.adapter
    model: Any
    if model_dir is not None:
        from memtune.tools.merge import base_class

        model = base_class(model_dir).from_pretrained(model_dir)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    else:
        from memtune.tools.merge import load_base, merged_dtype, with_adapter

        # The base as memtune merge's default holds it: a QLoRA / LLM.int8 run's quantized
        # as in training (then dequantized), in the training precision, so the answer is the
        # trained model's (the original weights would put the quantization error back).
        trained, m = base_of_run(run_dir)
        dtype = merged_dtype(trained, None)
        base = load_base(
            m.name_or_path, m.revision, adapter, trained, dtype, rope_scaling=m.rope_scaling
        )
        model = with_adapter(base, adapter, m.name_or_path, BASE_HINT)
        tokenizer = AutoTokenizer.from_pretrained(adapter)
    return model.eval(), tokenizer


def on_documents(data: DataConfig) -> bool:
    """The run trained on plain documents only: every source of format text (data.format, or
    each of data.sources), none rendered with a template. A run that mixed documents with
    conversations (any source of another format) learned to answer a user turn through its
    template: its prompt is rendered as one."""
    return all(source.format == "text" for source in data.all_sources())


def prompt_text(
    run_dir: Path,
    prompt: str,
    tokenizer: Any,
    thinking: bool = False,
    system: str | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The text the model is given for one user turn: the run's template and system prompt
    (``system``, when given, in place of data.system_prompt: a record's own, as training put
    it; "" for none), with ``tools`` offered as a record offers them; for a run on plain
    documents only (:func:`on_documents`, trained with no template), the prompt itself, which
    the model continues."""
    cfg = load_run_config(RunDir(run_dir).config)
    if on_documents(cfg.data):
        return prompt
    given = cfg.data.system_prompt if system is None else system
    messages = with_system([{"role": "user", "content": prompt}], given)
    return render_prompt(messages, cfg.data.template, tokenizer.eos_token, thinking, tools)


def read_tools(path: Path, run_dir: Path) -> list[dict[str, Any]] | None:
    """``--tools``: the functions in a JSON file, checked as a record's tools are; ConfigError
    naming the file, or the run, where its template has no tool format."""
    from memtune.data.tool_calls import TOOL_TEMPLATES, BadField, parse_tools

    data = load_run_config(RunDir(run_dir).config).data
    if on_documents(data) or data.template not in TOOL_TEMPLATES:
        why = "plain documents, no template" if on_documents(data) else data.template
        raise ConfigError(f"--tools: {run_dir} trained with no tool format ({why})")
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise ConfigError(f"--tools: cannot read {path}: {err.strerror or err}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        where = f"{path}:{err.lineno}" if isinstance(err, json.JSONDecodeError) else str(path)
        raise ConfigError(f"--tools: {where} is not JSON ({err})") from None
    try:
        return parse_tools(value, "--tools")
    except BadField:  # the value is JSON: not a list of objects
        what = type(value).__name__
        raise ConfigError(
            f"--tools: {path} holds a {what}, not a list of function schemas (objects)"
        ) from None


def image_settings(run_dir: Path, model_dir: Path | None = None) -> ImageSettings:
    """The image processor's settings the run read its images with: the model's
    preprocessor_config.json or processor_config.json (the merged model's, which memtune merge
    copies from the base, when ``model_dir`` is given) under the run's data.min_pixels /
    data.max_pixels."""
    from memtune.data.vision import model_image_settings

    cfg = load_run_config(RunDir(run_dir).config)
    name, revision = cfg.model.name_or_path, cfg.model.revision
    if model_dir is not None:
        name, revision = str(model_dir), None
    settings = model_image_settings(name, revision, cfg.data.min_pixels, cfg.data.max_pixels)
    if settings is None:
        raise ConfigError(
            f"--image: {name} has no image processor settings (preprocessor_config.json, or "
            "processor_config.json's image_processor, beside its config.json): images need a "
            "vision-language model (Qwen3.5, Qwen3-VL, Qwen2.5-VL)"
        )
    return settings


def prompt_inputs(
    run_dir: Path,
    prompt: str,
    tokenizer: Any,
    thinking: bool = False,
    images: Sequence[Path] = (),
    settings: ImageSettings | None = None,
    system: str | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The model's inputs for one user turn, as the run's data encodes a turn: the text of
    :func:`prompt_text` (``system``: its system prompt), and with ``images`` (each before the
    text, in order; ``settings``: :func:`image_settings`) each image's tokens,
    ``mm_token_type_ids``, ``pixel_values`` and ``image_grid_thw``. An unreadable image:
    ConfigError naming it."""
    import torch

    from memtune.data.encode import (
        IGNORE_INDEX,
        Sample,
        expand_images,
        image_pad_id,
        resize_record_images,
    )
    from memtune.data.readers import Record, RecordError
    from memtune.data.vision import IMAGE_PAD, ImageRef, pixel_values

    turn = IMAGE_PLACEHOLDER * len(images) + prompt
    text = prompt_text(run_dir, turn, tokenizer, thinking, system, tools)
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not images:
        input_ids = torch.tensor([ids])
        return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
    if settings is None:
        raise ValueError("images without the image processor's settings")
    refs = [ImageRef(f"image {i + 1} ({p})", path=Path(p)) for i, p in enumerate(images)]
    try:
        resized = resize_record_images(Record("--image", images=refs), settings)
    except RecordError as err:
        raise ConfigError(str(err)) from None
    pad = image_pad_id(tokenizer.encode(IMAGE_PAD, add_special_tokens=False), tokenizer)
    sample = expand_images(Sample(ids, [IGNORE_INDEX] * len(ids)), resized, pad, "the prompt")
    patches = pixel_values(sample.images, settings)
    input_ids = torch.tensor([sample.input_ids])
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "mm_token_type_ids": torch.tensor([sample.mm_token_type_ids]),
        "pixel_values": torch.from_numpy(patches["pixel_values"]),
        "image_grid_thw": torch.from_numpy(patches["image_grid_thw"]).long(),
    }


def answer(
    model: Any,
    tokenizer: Any,
    run_dir: Path,
    prompt: str,
    max_new_tokens: int = 128,
    thinking: bool = False,
    images: Sequence[Path] = (),
    settings: ImageSettings | None = None,
    system: str | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> tuple[str, list[int]]:
    """Greedy answer to one user turn; returns (text, generated ids). ``thinking`` (the qwen3
    and qwen3_5 templates): the model writes its own think block instead of the empty one.
    ``images``: in the turn, before its text (:func:`prompt_inputs`). ``system``: the system
    prompt in place of the run's data.system_prompt. ``tools``: the functions offered."""
    # Inside the function: torch takes seconds to import, and a refused command needs none of it.
    import torch
    from transformers import GenerationConfig

    inputs = prompt_inputs(run_dir, prompt, tokenizer, thinking, images, settings, system, tools)
    stops = stop_token_ids(tokenizer)
    # Greedy, whatever the checkpoint's generation_config.json asks for serving (Qwen's
    # instruct models: sampling, repetition_penalty 1.05): generate fills every setting not
    # given here from the model's own config, so that is replaced, not only overridden.
    greedy = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=stops,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.generation_config = greedy
    with torch.no_grad():
        out = model.generate(**inputs, generation_config=greedy)
    new = out[0, inputs["input_ids"].shape[1] :].tolist()
    return tokenizer.decode(new, skip_special_tokens=True), new


def check_paths(run_dir: Path, model_dir: Path | None = None) -> None:
    """ConfigError unless ``run_dir`` is a run dir with its config (and without ``model_dir``
    its adapter, whole, and the base its config names, there and whole: memtune merge's
    check) and ``model_dir``, when given, holds a model whose safetensors files are whole (read
    from their headers: memtune.safetensors_check)."""
    rd = RunDir(run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir}: no such directory (give a run dir: config.yaml, adapter/)")
    if not rd.config.is_file():
        raise ConfigError(f"{run_dir} has no config.yaml: not a run dir")
    if model_dir is not None:
        if not (model_dir / "config.json").is_file():
            raise ConfigError(f"{model_dir} has no config.json: not a model dir (memtune merge)")
        problem = model_weights_problem(model_dir)
        if problem:
            raise ConfigError(f"{problem}; copy the model again, or merge it again (memtune merge)")
    elif not (rd.adapter / "adapter_config.json").is_file():
        raise ConfigError(
            f"{rd.adapter} has no adapter_config.json: the run saved no adapter (not finished?)"
        )
    elif problem := adapter_problem(rd.adapter):
        raise ConfigError(
            f"{problem}; copy the run dir again, or merge one of its checkpoints' adapter/ "
            "(memtune merge) and give the merged model with --model"
        )
    else:
        from memtune.tools.merge import base_problem

        if problem := base_problem(base_of_run(run_dir)[1].name_or_path):
            raise ConfigError(f"base model {problem}; {BASE_HINT}")


def main(argv: list[str] | None = None) -> None:
    parser = VerbParser(
        prog="memtune generate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run_dir", type=Path, help="a finished run dir (config.yaml, adapter/)")
    parser.add_argument("prompt")
    parser.add_argument("--model", type=Path, help="a merged model dir instead of base+adapter")
    parser.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=128,
        help="the most tokens an answer may have (default 128); an answer cut there is said so",
    )
    parser.add_argument(
        "--thinking",
        action="store_true",
        help="qwen3, qwen3_5 templates: let the model think (no empty think block in the prompt)",
    )
    parser.add_argument(
        "--image",
        type=Path,
        action="append",
        default=[],
        metavar="PATH",
        help="an image in the user turn, before the prompt (once per image; a vision-language "
        "model)",
    )
    parser.add_argument(
        "--system",
        metavar="TEXT",
        help='the system prompt, in place of the run\'s data.system_prompt ("": none); a run '
        "trained on records with their own system prompts answers best under one of those",
    )
    parser.add_argument(
        "--tools",
        type=Path,
        metavar="JSON",
        help="a JSON file with the functions to offer (a list of function schemas, as a "
        "record's tools): the prompt holds them as training did; the answer is the model's "
        "text, a call as the template writes one",
    )
    args = parser.parse_args(argv)
    check_paths(args.run_dir, args.model)
    tools = read_tools(args.tools, args.run_dir) if args.tools is not None else None
    if args.system is not None and on_documents(load_run_config(RunDir(args.run_dir).config).data):
        raise ConfigError(
            f"--system: {args.run_dir} trained on plain documents only (every data source of "
            "format text), with no template and so no system turn: give the prompt alone, "
            "which the model continues"
        )
    settings = image_settings(args.run_dir, args.model) if args.image else None
    try:
        with no_progress_bars():  # transformers' "Loading weights": the answer is the output
            model, tokenizer = load(args.run_dir, args.model)
    except OSError as err:  # transformers: neither a local model dir nor one on the Hub
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"cannot load the model: {first}") from None
    text, new = answer(
        model,
        tokenizer,
        args.run_dir,
        args.prompt,
        args.max_new_tokens,
        args.thinking,
        args.image,
        settings,
        args.system,
        tools,
    )
    if text.strip():
        print(text)
    else:
        print(f"(empty answer: the model ended its turn after {len(new)} token(s))")
    if cut_short(new, args.max_new_tokens, stop_token_ids(tokenizer)):
        # on stderr: stdout is the answer alone
        print(
            f"memtune generate: the answer stopped at --max-new-tokens {args.max_new_tokens}, "
            "before the model ended its turn; give a larger --max-new-tokens for the rest",
            file=sys.stderr,
        )


if __name__ == "__main__":
    main()
