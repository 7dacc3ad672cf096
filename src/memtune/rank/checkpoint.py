"""Adapter export in PEFT's own format, so any tool that loads PEFT adapters can use it."""

from __future__ import annotations

import enum
import json
import pickle
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from memtune.checkpoints import (
    GATHERED,
    GATHERED_META,
    LATEST,
    SAVING,
    older_to_remove,
    seal,
    step_dir_name,
)
from memtune.config import RunConfig
from memtune.config.architecture import LANGUAGE_MODEL_PREFIX, is_multimodal
from memtune.config.decisions import Decisions
from memtune.filesystem import follow_umask, replace_dir, write_atomic
from memtune.integrity import list_files
from memtune.rank.expert_parallel import gathered_expert_adapters, own_experts, whole_experts
from memtune.rank.experts import to_peft_names, write_expert_adapters
from memtune.rank.model import rewriting_start
from memtune.rundir import RunDir, TrainState


class NonFiniteWeights(RuntimeError):
    """Raised instead of writing an adapter or checkpoint with inf / NaN in it."""


def trainable_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """Full (gathered) copies of the trainable tensors. A collective under ZeRO-3 and expert
    parallelism: every rank must call it; all ranks get the result."""
    import deepspeed

    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    zero3 = any(hasattr(p, "ds_id") for p in params)
    # expert parallelism: each expert's adapter from the rank holding it, the layer's whole
    # (under ZeRO-3 gathered first over the ranks sharing those experts)
    if zero3:
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            state = {n: p.detach().cpu().clone() for n, p in named}
            return state | gathered_expert_adapters(model)
    return {n: p.detach().cpu().clone() for n, p in named} | gathered_expert_adapters(model)


def export_adapter(model: Any, out_dir: Path, is_writer: bool) -> int:
    """Write ``adapter_config.json`` + ``adapter_model.safetensors``; returns the tensor count.

    ``model`` is the PEFT model (``engine.module.model``). All ranks call this; the writer
    saves.
    """
    state = trainable_state_dict(model)
    if not state:
        raise RuntimeError("no trainable parameters to export: LoRA was not applied")
    broken = [name for name, t in state.items() if not torch.isfinite(t).all()]
    if broken:
        raise NonFiniteWeights(
            f"{len(broken)} adapter tensors hold inf/NaN (first: {broken[0]}); not saved, so "
            "the last checkpoint stays the one to resume from"
        )
    start = rewriting_start(model)
    if start is not None:
        state = for_original_base(state, start.adapter)
    if is_writer:
        rest, experts = to_peft_names(state)
        model.save_pretrained(str(out_dir), state_dict=rest, safe_serialization=True)
        if experts:
            write_expert_adapters(out_dir, experts)
        if start is not None:
            _doubled_rank_config(out_dir / "adapter_config.json")
    return len(state)


def for_original_base(
    state: dict[str, torch.Tensor], initial: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """An adapter trained from a PiSSA or OLoRA start (which left the base W − B0·A0, scaled)
    as a plain LoRA adapter of twice the rank for the original base W, the conversion peft
    documents: W − B0A0 + BA = W + [B | −B0]·[A ; A0]. Exact; plain peft, merge and serving
    load it onto the checkpoint as released."""
    out = {}
    for name, t in state.items():
        if name not in initial:  # trained in full, not rewritten (a mixture's routers)
            out[name] = t
            continue
        start = initial[name].to(t.device, t.dtype)
        if "lora_A" in name:
            out[name] = torch.cat([t, start], dim=0)
        elif "lora_B" in name:
            out[name] = torch.cat([t, -start], dim=1)
        else:
            raise ValueError(f"{name}: only LoRA's A and B convert to the original base")
    return out


def _doubled_rank_config(path: Path) -> None:
    """adapter_config.json for :func:`for_original_base`: rank and per-module ranks doubled,
    alphas doubled (× √2 with rsLoRA) so the scaling stays, and no initialisation to redo."""
    config = json.loads(path.read_text())
    grow = 2**0.5 if config.get("use_rslora") else 2  # alpha / √(2r) or alpha / (2r) kept
    config["r"] *= 2
    config["lora_alpha"] *= grow
    config["rank_pattern"] = {k: 2 * v for k, v in (config.get("rank_pattern") or {}).items()}
    config["alpha_pattern"] = {k: grow * v for k, v in (config.get("alpha_pattern") or {}).items()}
    config["init_lora_weights"] = True
    write_atomic(path, json.dumps(config, indent=2, sort_keys=True) + "\n")


def name_for_multimodal_class(out_dir: Path) -> None:
    """Rename an exported adapter's tensors from the text class the ranks trained
    (``...model.layers.N...``) to the multimodal class of the checkpoint they came from
    (``...model.language_model.layers.N...``): peft matches an adapter's tensors to a model by
    name, and serving loads a released Qwen3.5 checkpoint with its own class, where an adapter
    under the text class's names would load nothing — silently (peft only warns)."""
    from safetensors.torch import load_file, save_file

    path = out_dir / "adapter_model.safetensors"
    text, multimodal = LANGUAGE_MODEL_PREFIX
    src, dst = f"base_model.model.{text}", f"base_model.model.{multimodal}"
    state = load_file(path)
    renamed = {(dst + k[len(src) :] if k.startswith(src) else k): t for k, t in state.items()}
    save_file(renamed, path, metadata={"format": "pt"})


def renames_for_multimodal_class(cfg: RunConfig, decisions: Decisions) -> bool:
    """Whether the run's adapter is renamed for the checkpoint's multimodal class on export
    (:func:`name_for_multimodal_class`): a text model trained from a multimodal checkpoint. The
    released class itself, loaded with its tower for images, has the released names already
    (its vision blocks' too, when adapted)."""
    m = cfg.model
    return is_multimodal(m.name_or_path, m.revision) and decisions.vision is None


def names_multimodal_class(adapter_dir: Path) -> bool:
    """Whether an exported adapter is named for a multimodal class
    (:func:`name_for_multimodal_class`): the base must then be loaded with that class."""
    from safetensors import safe_open

    path = adapter_dir / "adapter_model.safetensors"
    if not path.is_file():
        return False
    prefix = f"base_model.model.{LANGUAGE_MODEL_PREFIX[1]}"
    with safe_open(str(path), "pt") as f:
        return any(key.startswith(prefix) for key in f.keys())  # noqa: SIM118 (not a dict)


def export_final(
    model: Any, tokenizer: Any, rd: RunDir, is_writer: bool, multimodal: bool = False
) -> tuple[int, dict[str, list[Any]]]:
    """The run's adapter and tokenizer, written whole or not at all: into a temporary folder,
    fsynced, then renamed to ``adapter/`` (an earlier export of this run is set aside first and
    removed last). ``multimodal``: the base checkpoint is a multimodal one; the adapter is named
    for its class (:func:`name_for_multimodal_class`). Collective (the adapter is gathered).
    Returns the tensor count and, on the
    writer, the files written ({"adapter/NAME": [size, sha256]}) for summary.json, which the
    job verifies before it calls the run finished."""
    final = rd.adapter
    if not is_writer:  # the gather is collective; only the writer has a folder to fill
        return export_adapter(model, final, is_writer=False), {}
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}.", dir=rd.path))  # made here: ours
    try:
        n_tensors = export_adapter(model, tmp, is_writer=True)
        if multimodal:
            name_for_multimodal_class(tmp)
        tokenizer.save_pretrained(str(tmp))
        follow_umask(tmp)  # safetensors writes 0600: the user's umask decides, as for any file
        files = {f"{final.name}/{name}": v for name, v in list_files(tmp).items()}
        replace_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return n_tensors, files


# ---------------------------------------------------------------- resumable checkpoints
#
# What a checkpoint holds, and when it counts as complete: memtune.checkpoints (the job reads
# it there). A checkpoint is written under .tmp-step-N and renamed into place only when every
# rank has finished, so a crash during a save leaves the previous checkpoint as the one to
# resume.


def cuda_rng_to_save(
    device: torch.device, state_of: Callable[[torch.device], torch.Tensor]
) -> dict[str, Any]:
    """What a rank's RNG file holds of CUDA's generators: its own device's state only (saved
    with ``state_of``, torch.cuda.get_rng_state), nothing on a CPU rank. Every rank sees every
    card of its node (launcher.spawn.node_env), so the states of all of them (what was saved
    before) would not fit a resume on fewer cards, and would not be the rank's own on more."""
    if device.type != "cuda":
        return {}
    return {"cuda": state_of(device)}


def cuda_rng_to_restore(
    saved: dict[str, Any], saved_by: int, device: torch.device
) -> torch.Tensor | None:
    """The CUDA generator state a rank restores onto its own ``device`` from the RNG file rank
    ``saved_by`` wrote (its own, or rank 0's after a resume on more ranks); None on a CPU rank
    or from a file without one. The file holds the saving rank's own device's state, or, saved
    before, a list of the states of every card its node showed it: the entry of the device that
    rank used (its local rank: its rank modulo the cards listed, one per rank of its node; the
    first where there are fewer)."""
    if device.type != "cuda" or saved.get("cuda") is None:
        return None
    cuda = saved["cuda"]
    if isinstance(cuda, torch.Tensor):
        return cuda
    states = list(cuda)
    if not states:
        return None
    return states[saved_by % len(states)]


def _rng_state(device: torch.device) -> dict[str, Any]:
    import random

    import numpy as np

    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": [x.tolist() if hasattr(x, "tolist") else x for x in np.random.get_state()],
        "torch": torch.get_rng_state(),
    }
    state.update(cuda_rng_to_save(device, torch.cuda.get_rng_state))
    return state


def _set_rng_state(state: dict[str, Any], saved_by: int, device: torch.device) -> None:
    import random

    import numpy as np

    python = state["python"]
    random.setstate((python[0], tuple(python[1]), python[2]))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    cuda = cuda_rng_to_restore(state, saved_by, device)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


def save_checkpoint(
    engine: Any,
    rd: RunDir,
    state: TrainState,
    keep_last: int,
    multimodal: bool = False,
    *,
    device: torch.device,
) -> Path:
    """Collective: every rank calls it. Returns the checkpoint directory. ``device``: the
    rank's own (its CUDA generator is saved, no other card's). ``multimodal``: the
    base checkpoint is a multimodal one; the checkpoint's adapter is named for its class, as
    the final export is (:func:`name_for_multimodal_class`), so merge, generate and plain peft
    load a checkpoint's adapter/ onto the released class as they load RUN_DIR/adapter."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    root = rd.checkpoints
    final = root / step_dir_name(state.step)
    tmp = root / f"{SAVING}{final.name}"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    engine.save_checkpoint(
        str(tmp), tag="engine", exclude_frozen_parameters=True, save_latest=False
    )
    export_adapter(engine.module.model, tmp / "adapter", is_writer=rank == 0)
    if multimodal and rank == 0:
        name_for_multimodal_class(tmp / "adapter")
    save_gathered_state(engine, tmp, is_writer=rank == 0)
    torch.save(_rng_state(device), tmp / f"rng_rank{rank}.pt")
    _barrier()
    if rank == 0:
        shutil.copy(rd.config, tmp / "config.yaml")
        shutil.copy(rd.decisions, tmp / rd.decisions.name)
        if rd.base.is_file():
            shutil.copy(rd.base, tmp / rd.base.name)
        state.write(tmp)
        follow_umask(tmp)
        seal(tmp, state.step)  # the manifest, then complete.json
        # The same step saved again (a resumed run's last step) replaces it whole.
        replace_dir(
            tmp, final, before_removal=lambda: write_atomic(root / LATEST, final.name + "\n")
        )
        for old in older_to_remove(root, final, keep_last):
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


class UnsafeCheckpoint(RuntimeError):
    """A checkpoint file holds something other than tensors and plain data."""


def _deepspeed_safe_types() -> list[Any]:
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScaler, fragment_address, (enum_member, "builtins.getattr")]


def enum_member(cls: Any, name: str) -> Any:
    """``getattr`` as a checkpoint may use it, and no further: some Python versions (Debian's
    3.11.2, not 3.11.7) pickle an Enum member as ``getattr(EnumClass, "name")``, so DeepSpeed's
    ZeroStageEnum in every optimizer file reads ``GLOBAL builtins.getattr``, which the
    weights-only unpickler refuses (every resume was refused there). Only a member of an Enum
    class the unpickler already allows is handed out; any other getattr is refused."""
    if isinstance(cls, type) and issubclass(cls, enum.Enum) and name in cls.__members__:
        return cls[name]
    raise pickle.UnpicklingError(f"getattr({cls!r}, {name!r}) is not an Enum member")


def verify_checkpoint_files(path: Path) -> int:
    """Unpickle every engine file with ``weights_only=True`` (tensors, plain data and three
    DeepSpeed bookkeeping types) before DeepSpeed loads them its own way (a full unpickle):
    a tampered file fails here, before any code in it can run. Returns the files checked."""
    files = sorted((path / "engine").glob("*.pt"))
    with torch.serialization.safe_globals(_deepspeed_safe_types()):
        for f in files:
            try:
                torch.load(f, map_location="cpu", weights_only=True)
            except Exception as err:
                # from None, and only the unpickler's reason: torch's own text advises
                # weights_only=False, which must never be the way out of a refused checkpoint
                raise UnsafeCheckpoint(f"{f}: refusing to load ({_reason(err)})") from None
    return len(files)


def _reason(err: Exception) -> str:
    """What the weights-only unpickler refused, without torch's advice around it (its text:
    advice, "WeightsUnpickler error:", the reason, a pointer to the docs)."""
    text = str(err)
    _, marker, after = text.partition("WeightsUnpickler error:")
    if marker:
        reason = next((line.strip() for line in after.splitlines() if line.strip()), "")
        if reason and not reason.startswith("Check the documentation"):
            return reason
    named = next((line.strip() for line in text.splitlines() if "GLOBAL" in line), None)
    return named or f"{type(err).__name__}: not tensors and plain data only"


def load_checkpoint(engine: Any, path: Path, rank: int, device: torch.device) -> TrainState:
    """Restore engine, optimizer, scheduler and this rank's RNG (its CUDA generator onto
    ``device``, the rank's own); returns the trainer state."""
    verify_checkpoint_files(path)
    loaded, _ = engine.load_checkpoint(
        str(path),
        tag="engine",
        load_module_strict=False,  # frozen base weights are not in it: they come from the base
        load_optimizer_states=True,
        load_lr_scheduler_states=True,
    )
    if loaded is None:
        raise RuntimeError(f"{path}: DeepSpeed found no engine state to load")
    _set_rng_state(torch.load(path / f"rng_rank{rank}.pt", weights_only=True), rank, device)
    return TrainState.read(path)


def follow_schedule(engine: Any, lr: float, weight_decay: float | None = None) -> None:
    """After a resume: the learning rate of the next step is this run's schedule at the
    restored position (``lr`` × the schedule's factor, the factor built from this run's
    config). The restored optimizer holds the rate the saving run set for that step, which is
    another one when trainer.max_steps (or trainer.lr) changed: the first step after such a
    resume ran at the old schedule's rate and the next jumped to the new one. ``weight_decay``
    (trainer.weight_decay) likewise: DeepSpeed's engine files restore each group's settings as
    saved, so a changed weight decay was dropped on a resume on the same ranks (and taken on
    another number of ranks, whose gathered state holds no settings)."""
    scheduler = engine.lr_scheduler
    basic = getattr(engine.optimizer, "optimizer", engine.optimizer)
    # Each group's own base rate: LoRA+ runs the B matrices at lr × their group's ratio, as
    # the restored groups carry it (a resume cannot change the ratio: RESUME_MUST_MATCH).
    bases = [lr * group.get("lr_ratio", 1.0) for group in basic.param_groups]
    rates = [
        base * factor(scheduler.last_epoch)
        for base, factor in zip(bases, scheduler.lr_lambdas, strict=True)
    ]
    scheduler.base_lrs = bases
    scheduler._last_lr = rates
    for group, rate in zip(basic.param_groups, rates, strict=True):
        group["lr"] = rate
        if weight_decay is not None:
            group["weight_decay"] = weight_decay


# ---------------------------------------------------------------- any world size
#
# DeepSpeed's engine files hold each rank's partition of the optimizer, so they load only on
# the world size that wrote them. A LoRA run's whole trainable state is small (tens of MB for
# Qwen2.5-7B), so every checkpoint also keeps it gathered, in one file that any number of ranks
# can load: each trainable parameter's fp32 master weight and Adam moments, the optimizer's step
# count and the LR schedule. DeepSpeed's universal checkpoints do the same through a separate
# conversion (ds_to_universal) of the engine files; this is written as part of every save,
# through DeepSpeed's own accessors (deepspeed.utils.safe_get/set_full_*), for ZeRO-2 and -3.

ADAM_STATES = ("exp_avg", "exp_avg_sq")


def _trainable(engine: Any) -> list[tuple[str, Any]]:
    return [(n, p) for n, p in engine.module.model.named_parameters() if p.requires_grad]


def _optimizer_step(engine: Any) -> int | None:
    """The base optimizer's step count (every flat group steps together), or None when its
    state is not Adam's exp_avg / exp_avg_sq (bitsandbytes' 8-bit AdamW keeps state1/state2)."""
    basic = getattr(engine.optimizer, "optimizer", engine.optimizer)
    for state in basic.state.values():
        if "step" in state and all(key in state for key in ADAM_STATES):
            return int(state["step"])
    return None


def save_gathered_state(engine: Any, out: Path, is_writer: bool) -> None:
    """Collective. Writes GATHERED (+ GATHERED_META) when the optimizer keeps Adam moments:
    each trainable tensor whole (a split expert adapter gathered from its group's ranks)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    from safetensors.torch import save_file

    step = _optimizer_step(engine)
    if step is None:  # no Adam moments by these names (8-bit AdamW): engine files only
        return
    _link_optimizer_state(engine.optimizer)
    tensors: dict[str, torch.Tensor] = {}
    for name, param in _trainable(engine):
        # expert parallelism: every expert's, from the ranks holding them (whole_experts)
        value = whole_experts(param, safe_get_full_fp32_param(param).detach())
        tensors[f"{name}::fp32"] = value.cpu().clone()
        for key in ADAM_STATES:
            value = whole_experts(param, safe_get_full_optimizer_state(param, key).detach())
            tensors[f"{name}::{key}"] = value.cpu().clone()
    if is_writer:
        save_file(tensors, str(out / GATHERED))
        meta = {"optimizer_step": step, "lr_scheduler": engine.lr_scheduler.state_dict()}
        (out / GATHERED_META).write_text(json.dumps(meta, indent=2) + "\n")


def load_gathered_state(engine: Any, checkpoint: Path) -> None:
    """Collective. Restore the trainable state on any number of ranks: the compute-dtype
    weights each rank's model uses, the optimizer's fp32 masters and moments and its step,
    and the LR schedule."""
    import deepspeed
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state
    from safetensors.torch import load_file

    meta = json.loads((checkpoint / GATHERED_META).read_text())
    _materialize_optimizer_state(engine)
    named = _trainable(engine)
    # expert parallelism: each layer's experts saved whole, this rank's kept (own_experts)
    tensors = {
        key: own_experts(param, value)
        for key, value in load_file(str(checkpoint / GATHERED)).items()
        for param in [dict(named).get(key.partition("::")[0])]
    }
    missing = [n for n, _ in named if f"{n}::fp32" not in tensors]
    if missing:
        raise RuntimeError(f"{checkpoint / GATHERED}: no state for {missing[0]} (and others?)")
    params = [p for _, p in named]
    zero3 = any(hasattr(p, "ds_id") for p in params)
    with torch.no_grad():
        if zero3:
            with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
                for name, p in named:
                    p.data.copy_(tensors[f"{name}::fp32"].to(p.dtype).view_as(p))
        else:
            for name, p in named:
                p.data.copy_(tensors[f"{name}::fp32"].to(p.device, p.dtype).view_as(p))
        for name, p in named:
            device = p.device if not zero3 else torch.device("cpu")
            safe_set_full_fp32_param(p, tensors[f"{name}::fp32"].to(device))
            for key in ADAM_STATES:
                safe_set_full_optimizer_state(p, tensors[f"{name}::{key}"].to(device), key)
    basic = getattr(engine.optimizer, "optimizer", engine.optimizer)
    for state in basic.state.values():
        if "step" in state:
            step = state["step"]
            state["step"] = (
                torch.full_like(step, meta["optimizer_step"])
                if torch.is_tensor(step)
                else meta["optimizer_step"]
            )
    # The schedule's position; the rate of the next step is set from it by follow_schedule,
    # which every resume calls (rank.worker).
    engine.lr_scheduler.load_state_dict(meta["lr_scheduler"])


def _materialize_optimizer_state(engine: Any) -> None:
    """Give the base optimizer its (lazily created) Adam state now, so DeepSpeed's accessors
    have moments to write into: one step with zero gradients over its fp32 partitions. What it
    does to them (AdamW's decoupled decay) is overwritten with the saved values right after.

    ZeRO-3 keeps its fp32 partitions out of the base optimizer's param groups between steps
    and steps them one sub-group at a time (its ``_optimizer_step``, DeepSpeed 0.19); ZeRO-1/2
    keep them in the groups and map each parameter's fragment of the state lazily
    (``_lazy_init_hp_params_optimizer_state``)."""
    zero = engine.optimizer
    basic = getattr(zero, "optimizer", zero)
    flats = getattr(zero, "fp32_partitioned_groups_flat", None)
    if flats is not None:  # ZeRO-3
        for i, flat in enumerate(flats):
            if not basic.state.get(flat):
                flat.grad = torch.zeros_like(flat)
                zero._optimizer_step(i)
                flat.grad = None
        return
    fresh = [p for g in basic.param_groups for p in g["params"] if not basic.state.get(p)]
    if not fresh:
        return
    for p in fresh:
        p.grad = torch.zeros_like(p)
    basic.step()
    for p in fresh:
        p.grad = None
    _link_optimizer_state(zero)


def _link_optimizer_state(zero: Any) -> None:
    """ZeRO-1/2: map each parameter's fragment of the Adam state (DeepSpeed's accessors read
    through it), for every parameter group. DeepSpeed (0.19) links lazily, once, right after
    the *first* group's first step, when the other groups have no state yet; with LoRA+'s two
    groups the second group's fragments stayed empty ("exp_avg not found in optimizer state
    fragment"). Linking again once every group has stepped fixes them; ZeRO-3 needs nothing."""
    link = getattr(zero, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None:
        zero._hp_optimizer_states_linked = False
        link()


def rng_file_for(path: Path, rank: int) -> int:
    """Whose RNG file of checkpoint ``path`` rank ``rank`` restores after a resume on another
    world size: its own if it was a rank then, rank 0's otherwise."""
    return rank if (path / f"rng_rank{rank}.pt").is_file() else 0


def load_checkpoint_any_world(
    engine: Any, path: Path, rank: int, device: torch.device
) -> TrainState:
    """Resume on another world size: the gathered state, this rank's RNG if it was a rank
    then (rank 0's otherwise; the CUDA generator onto ``device``, the rank's own); returns the
    trainer state."""
    load_gathered_state(engine, path)
    saved_by = rng_file_for(path, rank)
    state = torch.load(path / f"rng_rank{saved_by}.pt", weights_only=True)
    _set_rng_state(state, saved_by, device)
    return TrainState.read(path)


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
