"""memtune's side (phases ``lora-memtune``, ``qlora-memtune``, ``long-*``, ``dpo-memtune``):
memtune's model, loss, optimizer, DeepSpeed engine and training loop on a base built in
memory, and the search for the longest sequence under a 24 GB cap.

Every call into memtune's build and per-length rewiring is in two functions at the top:
:func:`build_memtune` (``build_rank`` on the base built here) and :func:`memtune_at_length`
(``checkpoint_layers=auto`` resolved for the length, ``set_checkpointed_layers``, and for the
long phases ``tile_mlps`` and ``offload_checkpoints``)."""

from __future__ import annotations

import contextlib
import copy
import gc
import itertools
from typing import Any

from .bases import build_base, quantize_decoder
from .batches import pair_batch, synthetic_batch
from .configs import at_length, compose_cfg, plan_record
from .measure import (
    add_mfu,
    add_plan_error,
    empty_cache,
    flops_per_step,
    is_oom,
    memory_now,
    peak_census,
    peak_window,
    step_clock,
    timing,
)
from .modes import CAP_GIB, LONG_OVERRIDES
from .recorder import Phase, device_and_env, init_one_rank, time_left


def build_memtune(cfg: Any, ds_config: Any, device: Any) -> tuple[Any, bool]:
    """The rank's parts exactly as memtune.worker builds them (``build_rank``); only the base
    differs, and whether it was built under ``zero.Init``."""
    from memtune.rank.build import build_rank
    from memtune.rank.model import quantization_config

    quant = quantization_config(cfg)

    built: dict[str, bool] = {}

    def load_base(c: Any, attn: str) -> Any:
        """The real architecture with random weights, in memory (nothing to download)."""
        base = build_base(c, device, attn)
        built["zero_init"] = any(hasattr(q, "ds_id") for q in base.parameters())
        return base if quant is None else quantize_decoder(base, quant, device)

    # The rank's parts exactly as memtune.worker builds them; only the base differs. A 4-bit
    # base is quantized here in memory, outside zero.Init (from_pretrained does that itself).
    parts = build_rank(
        cfg, ds_config, device, load_base=load_base, zero_init=quant is None and cfg.zero.stage == 3
    )
    return parts, built["zero_init"]


def memtune_at_length(
    engine: Any, cfg0: Any, counts: Any, seq_len: int, device: Any, rec: dict[str, Any], long: bool
) -> Any:
    """The engine's model rewired for ``seq_len``, and the run's config at that length:
    ``cfg0`` with ``checkpoint_layers=auto`` resolved for it, the checkpointed layers set as
    ``add_lora`` sets them; for a long phase the MLP re-tiled and the checkpointed layers'
    inputs offloaded again. Records what it set in ``rec``."""
    from memtune.config.derive import checkpointed_layers
    from memtune.rank.long_context import offload_checkpoints, tile_mlps
    from memtune.rank.model import set_checkpointed_layers

    run_cfg = at_length(cfg0, seq_len, counts)
    k = checkpointed_layers(run_cfg)  # "all" under LONG_OVERRIDES
    set_checkpointed_layers(engine.module.model, k)  # as add_lora does
    if long:
        base = engine.module.model.get_base_model()
        rec["mlp_tiles"] = tile_mlps(base, seq_len)
        rec["offloaded_layers"] = offload_checkpoints(base, device)
    rec["checkpointed_layers"] = k
    return run_cfg


def run_memtune(phase: Phase, deadline: float, long: bool = False) -> None:
    """memtune's model, loss, optimizer, DeepSpeed engine and training loop, as
    ``memtune.rank.build.build_rank`` assembles them, on a base built in memory. ``long``:
    the long-context phase (LONG_OVERRIDES; the MLP re-tiled and the checkpointed layers'
    offload set again for every length)."""
    from memtune.config.deepspeed import build_ds_config
    from memtune.memory.counts import count_params
    from memtune.rank.loop import TrainResult, train
    from memtune.rank.telemetry import NullLogger

    mode, method = phase.mode, phase.method
    device = device_and_env(phase)
    init_one_rank(device)
    lengths = mode.long_lengths if long else mode.lengths
    extra = LONG_OVERRIDES if long else ()
    if method == "dpo":  # a preference objective trains without LoRA dropout
        extra = ("peft.dropout=0.0",)
    first = (lengths or mode.long_search)[0]  # built for the first length it will run
    cfg0 = compose_cfg(mode, method, first, extra)
    counts = count_params(cfg0)
    cfg = at_length(cfg0, first, counts)
    ds_config = build_ds_config(cfg)
    leftover = memory_now(device).get("allocated_gib", 0.0)

    parts, zero_init = build_memtune(cfg, ds_config, device)
    engine, attn, loss_kind = parts.engine, parts.attention, parts.loss_kind
    model = parts.model
    params = [q for q in model.parameters() if q.requires_grad]
    phase.data["notes"].append(
        f"attention {attn}; loss {loss_kind}; ZeRO-{cfg.zero.stage} on 1 rank; "
        f"{parts.optimizer_note}; base built under zero.Init: {zero_init}; LoRA weights "
        f"{params[0].dtype} after deepspeed.initialize; {len(params)} trainable tensors"
    )

    censused: list[bool] = []  # truthy once a census is taken

    def steps_at(seq_len: int, n_steps: int, rec: dict[str, Any]) -> Any:
        run_cfg = memtune_at_length(engine, cfg0, counts, seq_len, device, rec, long)
        run_cfg.trainer.max_steps = n_steps
        rec["plan"] = plan_record(run_cfg, counts)
        vocab = int(cfg.model.architecture["vocab_size"])
        if method == "dpo":
            batches = itertools.repeat(pair_batch(engine, run_cfg, vocab, seq_len, device, rec))
        else:
            batches = itertools.repeat(synthetic_batch(vocab, seq_len, seq_len))
        if mode.fake_oom_above is not None and seq_len > mode.fake_oom_above and rec.get("cap"):
            import torch

            raise torch.OutOfMemoryError(f"simulated OOM at {seq_len} tokens (dry run)")
        clock = step_clock(device)
        # the first one-step run of a long phase (its first length past the timed one) also
        # takes the allocator's census at its peak
        look = long and n_steps == 1 and not any(censused)
        censused.append(look)
        with (
            peak_window(device, rec),
            peak_census(device, rec) if look else contextlib.nullcontext(),
        ):
            result = train(engine, batches, run_cfg, device, NullLogger(), TrainResult(), clock)
        rec["losses"] = result.losses
        rec["real_tokens"] = result.input_tokens
        return clock

    for seq_len in lengths:
        if not time_left(deadline, 20):
            phase.data["errors"].append({"where": f"{seq_len}", "error": "skipped: out of time"})
            phase.save()
            continue
        rec: dict[str, Any] = {"side": "memtune", "method": method, "seq_len": seq_len}
        rec.update(leftover_gib=leftover, loss_kind=loss_kind, zero_stage=cfg.zero.stage)
        try:
            clock = steps_at(seq_len, mode.warmup + mode.timed, rec)
            rec.update(timing(clock.marks, mode.warmup, seq_len))
            add_mfu(rec, flops_per_step(counts, cfg.model.architecture, seq_len), device)
            add_plan_error(rec)
        except Exception as err:
            rec["error"] = repr(err)[-2000:]
            phase.error(f"memtune {seq_len}", err)
        finally:
            gc.collect()
            empty_cache(device)
        phase.add(rec)

    if long:
        search_cap(phase, deadline, device, steps_at, cfg0, counts, long=True)
    elif method == "qlora":
        search_cap(phase, deadline, device, steps_at, cfg0, counts)
    with contextlib.suppress(Exception):
        import torch.distributed as dist

        dist.destroy_process_group()


def search_cap(
    phase: Phase,
    deadline: float,
    device: Any,
    steps_at: Any,
    cfg0: Any,
    counts: Any,
    long: bool = False,
) -> None:
    """Longer and longer sequences under a 24 GB cap, one step each, until one fails.

    Ascending, stopping at the first OOM: an OOM inside a ZeRO-3 step can leave the engine's
    parameter state inconsistent, so nothing runs on it after one. The cap is applied to the
    allocator (``set_per_process_memory_fraction``) after the engine exists, and is 23.99 GiB
    less what lies outside the allocator (CUDA context, kernels), so the whole device use
    stays under a 24 GB card's memory.
    """
    import torch

    mode = phase.mode
    info: dict[str, Any] = {"cap_gib": CAP_GIB}
    if device.type == "cuda":
        gc.collect()
        empty_cache(device)
        now = memory_now(device)
        allocator_cap = CAP_GIB - now["outside_allocator_gib"]
        info.update(allocator_cap_gib=allocator_cap, before=now)
        torch.cuda.set_per_process_memory_fraction(allocator_cap / now["total_gib"], device)
    # What the planner says fits, for every length tried and beyond.
    planned = []
    lengths = mode.long_search if long else mode.search
    key = "long_" if long else ""
    for seq_len in lengths:
        p = plan_record(at_length(cfg0, seq_len, counts), counts)
        planned.append({"seq_len": seq_len, "total_gib": p["total_gib"], "fits": p["fits"]})
    info["planned"] = planned
    if long:
        from memtune.memory.fit import longest_sequence

        one = copy.deepcopy(cfg0)
        one.trainer.sequence_parallel = "1"
        n, how = longest_sequence(one, counts)
        info["planned_longest"], info["planned_longest_how"] = n, how
    phase.data[f"{key}search_info"] = info
    phase.data[f"{key}search"] = []
    phase.save()
    for seq_len in lengths:
        if not time_left(deadline, 15):
            phase.data["errors"].append({"where": f"search {seq_len}", "error": "out of time"})
            phase.save()
            break
        rec: dict[str, Any] = {"seq_len": seq_len, "cap": True}
        try:
            clock = steps_at(seq_len, 1, rec)
            rec["ok"] = True
            rec["step_s"] = clock.marks[-1] - clock.marks[0]
            rec.pop("plan", None)
        except Exception as err:
            rec.pop("plan", None)
            rec["ok"] = False
            rec["error"] = repr(err)[-500:]
            rec["oom"] = is_oom(err)
            print(f"gpu_check: search {seq_len}: {'OOM' if rec['oom'] else 'error'}", flush=True)
        phase.data[f"{key}search"].append(rec)
        phase.save()
        if not rec["ok"]:
            break
    if device.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(1.0, device)
