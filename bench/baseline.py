"""The recipe users follow today, as the baseline of ``make bench``.

    python bench/baseline.py RUN_DIR

Hugging Face ``transformers.Trainer`` + peft ``LoraConfig`` + ``gradient_checkpointing=True``,
each micro batch padded to its longest sample (``DataCollatorForSeq2Seq``: labels -100 on the
prompt and on padding), the model's own cross-entropy, one process, the dtype memtune's config
names (fp32 on CPU). Written the way a user writes it: no memtune code in the training path.

``RUN_DIR`` is a run dir laid out by :func:`memtune.launcher.prepare.prepare_run_dir` (``bench.py``
makes one). Only its inputs are read, so both sides train the same model on the same samples
with the same hyperparameters: ``config.yaml`` (model path, LoRA r / alpha / dropout /
targets, micro and global batch, steps, learning-rate schedule, seed) and ``data.json``
(where memtune's preprocessing cached the tokenized samples, which are read as they are).

Writes ``RUN_DIR/baseline.json``: real (non-padding) tokens, padded tokens, label tokens,
training wall time and real tokens/s, the loss of every step, and the process's peak RSS
read the way :mod:`memtune.rank.telemetry` reads it on CPU (``getrusage`` ``ru_maxrss``).
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from peft import get_peft_model
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from memtune.config import RunConfig, load_run_config
from memtune.config.decisions import Decisions
from memtune.data.cache import load_split
from memtune.rank.model import lora_config
from memtune.rank.telemetry import memory_snapshot
from memtune.rundir import RunDir


def load_samples(prepared_dir: str) -> list[dict[str, list[int]]]:
    """memtune's tokenized training samples, as the plain dicts a HF dataset would hold."""
    data = load_split(prepared_dir, "train")
    samples = []
    for i in range(len(data)):
        s = data[i]
        mask = [1] * len(s.input_ids)
        samples.append({"input_ids": s.input_ids, "attention_mask": mask, "labels": s.labels})
    return samples


def build_model(cfg: RunConfig) -> Any:
    """The base in the config's dtype, LoRA on the same modules with the same r / alpha /
    dropout. The attention kernel is left to transformers' default, as users leave it."""
    dtype = torch.bfloat16 if cfg.trainer.precision == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(cfg.model.name_or_path, dtype=dtype)
    model.config.use_cache = False
    return get_peft_model(model, lora_config(cfg))


def training_args(cfg: RunConfig, d: Decisions, out: Path) -> TrainingArguments:
    """memtune's schedule in Trainer terms: warmup, cosine to lr·min_lr_ratio, clipping."""
    t = cfg.trainer
    return TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=d.batch.micro_batch,
        gradient_accumulation_steps=d.batch.accumulation,
        max_steps=t.max_steps,
        learning_rate=t.lr,
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": t.min_lr_ratio},
        warmup_steps=t.warmup_steps,
        weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm,
        optim="adamw_torch",
        bf16=t.precision == "bf16",
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=t.seed,
        use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=0,
    )


class CountingTrainer(Trainer):
    """The stock Trainer; it only counts what each micro batch holds before training on it."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.counts = {"real_tokens": 0, "padded_tokens": 0, "label_tokens": 0}

    def training_step(self, model: Any, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        self.counts["real_tokens"] += int(inputs["attention_mask"].sum())
        self.counts["padded_tokens"] += int(inputs["input_ids"].numel())
        self.counts["label_tokens"] += int((inputs["labels"][:, 1:] != -100).sum())
        return super().training_step(model, inputs, *args, **kwargs)


class StepClock(TrainerCallback):
    """Times the training loop (first step's start to the last step's end, as memtune's
    ``wall_s``) and keeps the logged loss of every step."""

    def __init__(self) -> None:
        self.start = self.end = 0.0
        self.losses: list[float] = []

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.start = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.end = time.perf_counter()

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))


def run(run_dir: Path) -> dict[str, Any]:
    rd = RunDir(run_dir)
    cfg = load_run_config(rd.config)
    d = rd.read_decisions()  # the batch memtune's side runs with
    data_dir = rd.read_data().dir
    torch.manual_seed(cfg.trainer.seed)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.name_or_path)
    model = build_model(cfg)
    clock = StepClock()
    args = training_args(cfg, d, run_dir / "hf")
    trainer = CountingTrainer(
        model=model,
        args=args,
        train_dataset=load_samples(data_dir),
        data_collator=DataCollatorForSeq2Seq(tokenizer, padding="longest", label_pad_token_id=-100),
        callbacks=[clock],
    )
    trainer.train()
    wall = clock.end - clock.start
    counts = trainer.counts
    return {
        "steps": trainer.state.global_step,
        **counts,
        "padding_efficiency": counts["real_tokens"] / max(1, counts["padded_tokens"]),
        "wall_s": wall,
        "tokens_per_s": counts["real_tokens"] / max(wall, 1e-9),
        "loss_first": clock.losses[0],
        "loss_last": clock.losses[-1],
        "losses": clock.losses,
        "attention": model.config._attn_implementation,
        "peak_rss_gib": memory_snapshot(torch.device("cpu"))["peak_rss_gib"],
        "memory": memory_snapshot(torch.device("cpu")),
        "lora": model.peft_config["default"].to_dict(),
        "training_args": json.loads(args.to_json_string()),
    }


def _plain(obj: Any) -> Any:
    """JSON for what configs hold besides JSON types (peft keeps target modules in a set)."""
    return sorted(obj) if isinstance(obj, set) else str(obj)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python bench/baseline.py RUN_DIR")
    warnings.filterwarnings("ignore", category=FutureWarning)
    run_dir = Path(args[0])
    result = run(run_dir)
    (run_dir / "baseline.json").write_text(json.dumps(result, indent=2, default=_plain) + "\n")
    print(
        f"baseline: {result['steps']} steps · {result['real_tokens']:,} real tokens "
        f"({100 * result['padding_efficiency']:.1f}% of {result['padded_tokens']:,} processed) "
        f"· {result['tokens_per_s']:,.1f} tokens/s · loss {result['loss_first']:.4f} → "
        f"{result['loss_last']:.4f} · peak RSS {result['peak_rss_gib']:.2f} GiB",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
