"""The baseline side: ``transformers.Trainer`` + peft LoRA as ``bench/baseline.py`` sets them
up (phases ``lora-baseline``, ``qlora-baseline``), with the allocator uncapped: each record
says whether its peak fits the 24 GB card (``fits_cap``)."""

from __future__ import annotations

import gc
import tempfile
import time
from pathlib import Path
from typing import Any

from .bases import build_base, quantize_decoder, user_qlora_config
from .batches import synthetic_batch
from .configs import baseline_plan, compose_cfg, decided_at
from .measure import (
    add_mfu,
    add_plan_error,
    empty_cache,
    flops_per_step,
    is_oom_text,
    memory_now,
    peak_window,
    sync,
    timing,
)
from .recorder import Phase, device_and_env, time_left


def recipe_model(cfg: Any, method: str, device: Any) -> Any:
    """The usual recipe's model, as ``bench/baseline.py`` sets it up, on a base built in
    memory: transformers' default attention (sdpa), for QLoRA a 4-bit base prepared by peft
    (frozen, every weight that is not quantized upcast to fp32), peft's LoRA."""
    from peft import get_peft_model, prepare_model_for_kbit_training

    from memtune.config.derive import lora_config

    base = build_base(cfg, device, "sdpa")
    if method == "qlora":
        base = quantize_decoder(base, user_qlora_config(cfg), device)
        base = prepare_model_for_kbit_training(
            base,
            use_gradient_checkpointing=True,
            gradient_checkpointing_kwargs={"use_reentrant": False},
        )
    return get_peft_model(base, lora_config(cfg))


def run_baseline(phase: Phase, deadline: float) -> None:
    """Trainer + peft, as ``bench/baseline.py`` sets them up, on a base built in memory."""
    from baseline import CountingTrainer, training_args
    from transformers import TrainerCallback, default_data_collator

    from memtune.config.decisions import with_sections
    from memtune.memory.counts import count_params

    mode, method = phase.mode, phase.method
    device = device_and_env(phase)
    cfg = compose_cfg(mode, method, mode.lengths[0])
    counts = count_params(cfg)
    leftover = memory_now(device).get("allocated_gib", 0.0)
    model = recipe_model(cfg, method, device)
    phase.data["notes"].append(
        f"attention {model.config._attn_implementation}; base built in memory ({method})"
    )

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.marks: list[float] = []
            self.losses: list[float] = []

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if not self.marks:
                sync(device)
                self.marks.append(time.perf_counter())

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            sync(device)
            self.marks.append(time.perf_counter())

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            if logs and "loss" in logs:
                self.losses.append(float(logs["loss"]))

    for seq_len in mode.lengths:
        if not time_left(deadline, 20):
            phase.data["errors"].append({"where": f"{seq_len}", "error": "skipped: out of time"})
            phase.save()
            continue
        rec: dict[str, Any] = {"side": "baseline", "method": method, "seq_len": seq_len}
        rec["leftover_gib"] = leftover
        # uncapped, so that its speed is measured at all (its LoRA 4,096 row had 25.53 GiB of
        # the H200 in use at its peak, 2026-12-04): ``fits_cap`` (add_plan_error) says whether
        # its peak fits the 24 GB card memtune's and Unsloth's rows are capped at
        rec["cap_gib"] = None
        try:
            steps = mode.warmup + mode.timed
            at, d = decided_at(cfg, seq_len, counts)
            run_cfg = with_sections(at, trainer={"max_steps": steps})
            batch = synthetic_batch(int(cfg.model.architecture["vocab_size"]), seq_len, seq_len)
            rows = [{k: v[0] for k, v in batch.items()} for _ in range(steps)]
            clock = StepClock()
            with tempfile.TemporaryDirectory() as tmp:
                trainer = CountingTrainer(
                    model=model,
                    args=training_args(run_cfg, d, Path(tmp)),
                    train_dataset=rows,
                    data_collator=default_data_collator,
                    callbacks=[clock],
                )
                with peak_window(device, rec):
                    trainer.train()
            rec.update(timing(clock.marks, mode.warmup, seq_len))
            rec["real_tokens"] = trainer.counts["real_tokens"]
            rec["losses"] = clock.losses
            rec["checkpointed_layers"] = int(cfg.model.architecture["num_hidden_layers"])
            rec["loss_kind"] = "model's own (full logits)"
            rec["zero_stage"] = None
            add_mfu(rec, flops_per_step(counts, cfg.model.architecture, seq_len), device)
            rec["plan"] = baseline_plan(at, d, counts)
            rec["plan_note"] = "approximate: ZeRO-2, all layers checkpointed, plain loss"
            add_plan_error(rec)
            del trainer
        except Exception as err:
            rec["error"] = repr(err)[-2000:]
            phase.error(f"baseline {seq_len}", err)
        finally:
            gc.collect()
            empty_cache(device)
        phase.add(rec)
        if "error" in rec and is_oom_text(rec["error"]):
            break
    del model
    gc.collect()
    empty_cache(device)
