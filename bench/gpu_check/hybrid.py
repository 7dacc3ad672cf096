"""The Qwen3.5 phases (``qwen35-torch``, ``qwen35-fla``): the hybrid model on packed rows through
memtune's per-sample path, on transformers' torch code or flash-linear-attention's kernels,
and the packed = alone check."""

from __future__ import annotations

import contextlib
import gc
import itertools
import sys
import time
from collections.abc import Sequence
from typing import Any

from .bases import build_base
from .configs import compose_cfg, decided_at, plan_record
from .measure import add_plan_error, empty_cache, memory_now, peak_window, step_clock, timing
from .recorder import Phase, device_and_env, init_one_rank, time_left
from .report import short_kernel

SAMPLE_SHARES = (0.33, 0.25, 0.2, 0.13)
"""A timed packed row of the Qwen3.5 phases: samples taking these shares of the row and one more
with the rest (4096 tokens: 1352, 1024, 819, 532 and 369), so four samples start mid-chunk of
the recurrence's 64-token chunks."""
CHECK_LENGTHS = (300, 77, 450, 190)
"""The packed = alone check: one row of these samples against each sample alone (boundaries
inside chunks, a sample shorter than a chunk, 1,017 tokens: quick even on the torch path)."""
LOSS_TOL = 0.01
LOGIT_TOL = 0.5
"""packed = alone holds when every sample's mean token loss (nats) in the packed row is within
LOSS_TOL of the same sample's alone and no logit is further than LOGIT_TOL from it. bf16 calls
of other shapes differ by rounding only; a leak from the previous sample shows in the logits
most (random weights leave the loss near ln(vocab) either way). Measured on CPU in bf16 on
the torch path: the tiny Qwen3.5 0.001 nats and 0.11, the random Qwen3.5-2B (24 layers)
0.0014 and 0.16; the same rows without their boundaries 0.040 and 7.4, 0.028 and 6.5 (the
check runs that control too and reports it: what a leak looks like on the model at hand)."""
NOT_INSTALLED_HERE = ("fla", "causal_conv1d")
"""The torch phase's process: transformers falls back to its own torch code for the conv and
the recurrence (it resolves these packages when its Qwen3.5 module is imported)."""


def block_imports(names: Sequence[str]) -> None:
    """Make ``names`` look not installed in this process: a ``None`` entry in ``sys.modules``
    makes ``import name`` (and of any submodule) raise ModuleNotFoundError and
    ``importlib.util.find_spec(name)`` return None, which is what transformers (at import) and
    ``memtune.linear_kernels.kernels`` reads. Must run before transformers is imported."""
    import importlib.util

    if "transformers" in sys.modules:
        raise RuntimeError("block_imports after transformers was imported: too late")
    for name in names:
        if any(m == name or m.startswith(f"{name}.") for m in sys.modules):
            raise RuntimeError(f"{name} is already imported")
        sys.modules[name] = None  # type: ignore[assignment]
        try:
            __import__(name)
        except ModuleNotFoundError:
            pass
        else:
            raise RuntimeError(f"import {name} still works")
        assert importlib.util.find_spec(name) is None, name


def kernel_packages(blocked: bool) -> dict[str, Any]:
    """The Gated DeltaNet kernel packages' versions, and whether ``fla`` imports here (before
    transformers does it: an error in flash-linear-attention's own imports is recorded instead of
    being swallowed by transformers' fallback)."""
    import importlib.metadata as md

    info: dict[str, Any] = {}
    for dist in ("flash-linear-attention", "fla-core", "causal-conv1d", "triton"):
        try:
            info[dist] = md.version(dist)
        except md.PackageNotFoundError:
            info[dist] = None
    if blocked:
        info["fla_import"] = "blocked in this process"
        return info
    try:
        t0 = time.time()
        import fla.ops.gated_delta_rule  # noqa: F401  (fla, then its layers and models)

        info["fla_import"] = "ok"
        info["fla_import_s"] = round(time.time() - t0, 2)
    except ModuleNotFoundError as err:
        info["fla_import"] = f"not installed ({err})"
    except Exception as err:
        info["fla_import"] = f"failed: {type(err).__name__}: {err}"[:500]
    return info


def resolved_kernels(model: Any) -> dict[str, str]:
    """What transformers' Qwen3.5 module resolved its ``causal_conv1d_fn`` and
    ``torch_chunk_gated_delta_rule`` to at import (the ``implementation`` its fallback wrapper
    closes over): the package's function or its own torch code, by full name (the start-up
    line's ``memtune.linear_kernels.kernels`` names only the package)."""
    from memtune.linear_kernels import KERNEL_FUNCTIONS, resolved
    from memtune.rank.linear_attention import linear_attention_layers

    layers = linear_attention_layers(model)
    if not layers:
        return {"conv": "no linear-attention layer", "recurrence": "no linear-attention layer"}
    hf = sys.modules[type(layers[0]).__module__]
    out = {}
    for what, name in KERNEL_FUNCTIONS:
        impl = resolved(getattr(hf, name))
        out[what] = f"{impl.__module__}.{impl.__qualname__}"
    return out


def random_samples(vocab: int, lengths: Sequence[int], seed: int) -> list[Any]:
    """Samples of random tokens, every one labelled (the collate unlabels each first token)."""
    import torch

    from memtune.data.encode import Sample

    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(5, vocab, (n,), generator=g).tolist()
        out.append(Sample(ids, list(ids)))
    return out


def packed_batch(vocab: int, seq_len: int, seed: int) -> tuple[dict[str, Any], list[int]]:
    """One packed row of ``seq_len`` tokens (:data:`SAMPLE_SHARES`), as the training loader
    gives it: ``PackedDataset`` over the samples, then ``collate_packed`` (``cu_seq_lens``,
    ``max_length``, restarting ``position_ids``, ``real_tokens``)."""
    from memtune.data.batching import PackedDataset, TokenizedDataset, collate_packed

    lengths = [round(seq_len * s) for s in SAMPLE_SHARES]
    lengths.append(seq_len - sum(lengths))
    rows = PackedDataset(
        TokenizedDataset.from_samples(random_samples(vocab, lengths, seed)), seq_len
    )
    assert len(rows) == 1, rows.bins
    return collate_packed([rows[0]], pad_token_id=0), [len(s.input_ids) for s in rows[0]]


def packed_equals_alone(model: Any, device: Any, vocab: int, seed: int = 7) -> dict[str, Any]:
    """tests/test_linear_attention.py's check, at the phase's precision and kernels: a row of
    :data:`CHECK_LENGTHS` samples packed as the loader packs them gives each sample the mean
    token loss and logits it has alone (within :data:`LOSS_TOL`, :data:`LOGIT_TOL`); and the
    same row without its boundaries
    (positions restarting only: what a leak looks like on this model), for comparison.
    Forward only, no dropout (eval mode)."""
    import torch

    from memtune.data.batching import collate_packed
    from memtune.rank.loss import model_inputs, token_loss_sum

    batch = collate_packed([random_samples(vocab, CHECK_LENGTHS, seed)], pad_token_id=0)
    ids = batch["input_ids"].to(device)
    positions = batch["position_ids"].to(device)
    cu = batch["cu_seq_lens"].to(device)
    spans = list(itertools.pairwise(batch["cu_seq_lens"].tolist()))

    def mean_loss(logits: Any, a: int, b: int) -> float:
        """Sample ``ids[a:b]``'s mean next-token loss from its ``b - a`` logits."""
        return float(token_loss_sum(logits, ids[:, a:b])) / (b - a - 1)

    def max_diff(x: Any, y: Any) -> float:
        return float((x.float() - y.float()).abs().max())

    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            inputs = model_inputs(ids, None, positions, cu, batch["max_length"].to(device))
            packed = model(**inputs).logits
            leak = model(**model_inputs(ids, None, positions)).logits
            samples = []
            for a, b in spans:
                alone = model(**model_inputs(ids[:, a:b], None, positions[:, a:b])).logits
                samples.append(
                    {
                        "tokens": b - a,
                        "alone": mean_loss(alone, a, b),
                        "packed": mean_loss(packed[:, a:b], a, b),
                        "no_bounds": mean_loss(leak[:, a:b], a, b),
                        "packed_max_logit_diff": max_diff(packed[:, a:b], alone),
                        "no_bounds_max_logit_diff": max_diff(leak[:, a:b], alone),
                    }
                )
                del alone
    finally:
        model.train(training)
    worst = max(abs(s["packed"] - s["alone"]) for s in samples)
    worst_logit = max(s["packed_max_logit_diff"] for s in samples)
    control = max(abs(s["no_bounds"] - s["alone"]) for s in samples[1:])
    control_logit = max(s["no_bounds_max_logit_diff"] for s in samples[1:])
    ok = worst <= LOSS_TOL and worst_logit <= LOGIT_TOL
    return {
        "ok": ok,
        "lengths": list(CHECK_LENGTHS),
        "tolerance": {"loss": LOSS_TOL, "logit": LOGIT_TOL},
        "max_loss_diff": worst,
        "max_logit_diff": worst_logit,
        "no_bounds_max_loss_diff": control,
        "no_bounds_max_logit_diff": control_logit,
        "control_sees_leak": control_logit > LOGIT_TOL,
        "samples": samples,
        "dtype": str(packed.dtype),
        "summary": (
            f"packed = alone {'holds' if ok else 'FAILS'}: max |Δ mean loss| {worst:.4f} nats, "
            f"max |Δ logit| {worst_logit:.3f} (tolerances {LOSS_TOL}, {LOGIT_TOL}); without the "
            f"boundaries {control:.4f} and {control_logit:.3f}"
        ),
    }


def run_hybrid(phase: Phase, deadline: float, fla: bool) -> None:
    """Qwen3.5 (``mode.hybrid_model``, random weights) with the LoRA of the qwen3.5-9b
    experiment, trained by memtune's own parts (``build_rank``, ``train``) on packed rows with
    ``cu_seq_lens`` as the loader gives them, through memtune's per-sample path for the Gated
    DeltaNet layers (memtune.rank.linear_attention). ``fla``: with flash-linear-attention's
    kernels, else with transformers' torch code (flash-linear-attention blocked here)."""
    mode = phase.mode
    rec: dict[str, Any] = {
        "phase": phase.name,
        "model": mode.hybrid_model,
        "seq_len": mode.hybrid_len,
        "wanted": "flash-linear-attention" if fla else "torch (fla blocked)",
    }
    phase.data["hybrid"] = rec
    if not fla:
        block_imports(NOT_INSTALLED_HERE)
    rec["packages"] = kernel_packages(blocked=not fla)
    phase.save()
    if fla and rec["packages"]["fla_import"] != "ok":
        note = f"flash-linear-attention: {rec['packages']['fla_import']}"
        rec["skipped"] = note
        phase.data["notes"].append(note)
        if not mode.dry_run:
            phase.save()
            print(f"gpu_check: {phase.name}: {note}; nothing to measure", flush=True)
            return
        phase.data["notes"].append("dry run: the torch path runs in its place (code paths only)")

    from memtune.config.decisions import with_sections
    from memtune.config.deepspeed import build_ds_config
    from memtune.linear_kernels import kernels
    from memtune.memory.counts import count_params
    from memtune.rank.build import build_rank
    from memtune.rank.linear_attention import linear_attention_layers
    from memtune.rank.loop import TrainResult, train
    from memtune.rank.telemetry import NullLogger

    t0 = time.time()
    device = device_and_env(phase)
    init_one_rank(device)
    seq_len = mode.hybrid_len
    cfg0 = compose_cfg(mode, "qwen35", seq_len, model=mode.hybrid_model)
    counts = count_params(cfg0)
    cfg, d = decided_at(cfg0, seq_len, counts)
    leftover = memory_now(device).get("allocated_gib", 0.0)
    parts = build_rank(
        cfg,
        d,
        build_ds_config(cfg, d),
        device,
        load_base=lambda c, decided: build_base(c, device, decided.attention),
        zero_init=d.zero_stage == 3,
    )
    engine, model = parts.engine, parts.model
    rec.update(
        kernels=kernels(linear_attention_layers(model)[0]),
        linear_attention=parts.linear_attention,
        resolved=resolved_kernels(model),
        attention=parts.attention,
        loss_kind=parts.loss_kind,
        zero_stage=d.zero_stage,
        checkpointed_layers=d.checkpointing.recomputed,
        leftover_gib=leftover,
        lora=f"r={cfg.peft.r} on {cfg.peft.target}; {parts.trainable:,} trainable",
        seconds={"build": round(time.time() - t0, 1)},
    )
    phase.data["notes"].append(
        f"{mode.hybrid_model}: {parts.linear_attention}; transformers calls "
        f"{rec['resolved']['recurrence']} and {rec['resolved']['conv']}; attention "
        f"{parts.attention}; ZeRO-{d.zero_stage}; {rec['lora']}"
    )
    phase.save()
    print(f"gpu_check: {phase.name}: {rec['kernels']}; {rec['resolved']}", flush=True)
    uses_fla = short_kernel(rec["resolved"]["recurrence"]) == "fla"
    if fla and not mode.dry_run and not uses_fla:
        raise RuntimeError(f"fla imports but transformers did not pick it up: {rec['resolved']}")
    if not fla and uses_fla:
        raise RuntimeError(f"fla was blocked but transformers calls {rec['resolved']}")

    vocab = int(cfg.model.architecture["vocab_size"])
    t0 = time.time()
    try:
        rec["check"] = packed_equals_alone(model, device, vocab)
        print(f"gpu_check: {phase.name}: {rec['check']['summary']}", flush=True)
        if not rec["check"]["ok"]:
            phase.data["errors"].append(
                {"where": "packed = alone", "error": rec["check"]["summary"]}
            )
    except Exception as err:
        rec["check"] = {"error": repr(err)[-2000:]}
        phase.error("packed = alone", err)
    finally:
        gc.collect()
        empty_cache(device)
    rec["seconds"]["check"] = round(time.time() - t0, 1)
    phase.save()

    if not time_left(deadline, 15):
        phase.data["errors"].append({"where": "steps", "error": "skipped: out of time"})
        phase.save()
        return

    def save_steps(marks: list[float]) -> None:
        """Each step's time saved as it ends (a timeout keeps the first ones, the first with
        Triton's compile and autotune when fla runs)."""
        rec["step_s"] = [round(b - a, 4) for a, b in itertools.pairwise(marks)]
        phase.save()

    try:
        batch, rec["samples"] = packed_batch(vocab, seq_len, seed=seq_len)
        run_cfg = with_sections(cfg, trainer={"max_steps": mode.warmup + mode.timed})
        rec["plan"] = plan_record(run_cfg, d, counts)
        t0 = time.time()
        clock = step_clock(device, save_steps)
        with peak_window(device, rec):
            result = train(
                engine,
                itertools.repeat(batch),
                run_cfg,
                d,
                device,
                NullLogger(),
                TrainResult(),
                clock,
            )
        rec["seconds"]["steps"] = round(time.time() - t0, 1)
        rec["losses"] = result.losses
        rec["real_tokens"] = result.input_tokens
        rec.update(timing(clock.marks, mode.warmup, int(batch["real_tokens"])))
        rec["first_step_s"] = rec["step_s"][0]
        add_plan_error(rec)
    except Exception as err:
        rec["error"] = repr(err)[-2000:]
        phase.error(f"steps {seq_len}", err)
    finally:
        gc.collect()
        empty_cache(device)
    phase.save()
    phase.say(rec, seq_len)
    with contextlib.suppress(Exception):
        import torch.distributed as dist

        dist.destroy_process_group()
