"""Answer a prompt with a trained adapter (or a merged model), rendered exactly as in training.

    memtune generate RUN_DIR "What is the capital of France?"
    memtune generate RUN_DIR --model MERGED_DIR "..."

The run's config gives the template and system prompt, so the prompt is the same text the
model was trained on (qwen3, qwen3_5: with the empty think block, unless ``--thinking``). Generation
stops at the turn's end marker (``<|im_end|>`` in ChatML) or the tokenizer's eos.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from memtune.config import ConfigError, load_run_config
from memtune.config.architecture import is_multimodal
from memtune.data.templates import IM_END, render_prompt, with_system
from memtune.rundir import RunDir


def stop_token_ids(tokenizer: Any) -> list[int]:
    """Every id that ends an answer: eos, and <|im_end|> when the vocabulary has it."""
    ids = {tokenizer.eos_token_id}
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        ids.add(im_end)
    return sorted(i for i in ids if i is not None)


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


def load(run_dir: Path, model_dir: Path | None = None) -> tuple[Any, Any]:
    from peft import PeftModel
    from transformers import AutoTokenizer

    rd = RunDir(run_dir)
    adapter = rd.adapter
    model: Any
    if model_dir is not None:
        model = base_class(model_dir).from_pretrained(model_dir)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    else:
        cfg = load_run_config(rd.config)
        m = cfg.model
        base = base_class(m.name_or_path, m.revision, adapter).from_pretrained(
            m.name_or_path, revision=m.revision
        )
        model = PeftModel.from_pretrained(base, str(adapter))
        tokenizer = AutoTokenizer.from_pretrained(adapter)
    return model.eval(), tokenizer


def prompt_text(run_dir: Path, prompt: str, tokenizer: Any, thinking: bool = False) -> str:
    """The text the model is given for one user turn: the run's template and system prompt."""
    cfg = load_run_config(RunDir(run_dir).config)
    messages = with_system([{"role": "user", "content": prompt}], cfg.data.system_prompt)
    return render_prompt(messages, cfg.data.template, tokenizer.eos_token, thinking)


def answer(
    model: Any,
    tokenizer: Any,
    run_dir: Path,
    prompt: str,
    max_new_tokens: int = 128,
    thinking: bool = False,
) -> tuple[str, list[int]]:
    """Greedy answer to one user turn; returns (text, generated ids). ``thinking`` (the qwen3
    and qwen3_5 templates): the model writes its own think block instead of the empty one."""
    # Inside the function: torch takes seconds to import, and a refused command needs none of it.
    import torch

    text = prompt_text(run_dir, prompt, tokenizer, thinking)
    ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
    stops = stop_token_ids(tokenizer)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=stops,
            pad_token_id=tokenizer.pad_token_id,
        )
    new = out[0, ids.shape[1] :].tolist()
    return tokenizer.decode(new, skip_special_tokens=True), new


def check_paths(run_dir: Path, model_dir: Path | None = None) -> None:
    """ConfigError unless ``run_dir`` is a run dir with its config (and its adapter, without
    ``model_dir``) and ``model_dir``, when given, holds a model."""
    rd = RunDir(run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir}: no such directory (give a run dir: config.yaml, adapter/)")
    if not rd.config.is_file():
        raise ConfigError(f"{run_dir} has no config.yaml: not a run dir")
    if model_dir is not None:
        if not (model_dir / "config.json").is_file():
            raise ConfigError(f"{model_dir} has no config.json: not a model dir (memtune merge)")
    elif not (rd.adapter / "adapter_config.json").is_file():
        raise ConfigError(
            f"{rd.adapter} has no adapter_config.json: the run saved no adapter (not finished?)"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="memtune generate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run_dir", type=Path, help="a finished run dir (config.yaml, adapter/)")
    parser.add_argument("prompt")
    parser.add_argument("--model", type=Path, help="a merged model dir instead of base+adapter")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument(
        "--thinking",
        action="store_true",
        help="qwen3, qwen3_5 templates: let the model think (no empty think block in the prompt)",
    )
    args = parser.parse_args(argv)
    check_paths(args.run_dir, args.model)
    try:
        model, tokenizer = load(args.run_dir, args.model)
    except OSError as err:  # transformers: neither a local model dir nor one on the Hub
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"cannot load the model: {first}") from None
    text, new = answer(
        model, tokenizer, args.run_dir, args.prompt, args.max_new_tokens, args.thinking
    )
    if text.strip():
        print(text)
    else:
        print(f"(empty answer: the model ended its turn after {len(new)} token(s))")


if __name__ == "__main__":
    main()
