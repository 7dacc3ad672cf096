"""memtune's side (phases ``lora-memtune``, ``qlora-memtune``, ``long-*``, ``dpo-memtune``):
memtune's model, loss, optimizer, DeepSpeed engine and training loop on a base built in
memory, and the search for the longest sequence under a 24 GB cap.

memtune's side is built and rewired as a rank builds itself, in two functions at the top:
:func:`build_memtune` (``build_rank`` on the base built here, from the decisions a launch
makes for the first length) and :func:`memtune_at_length` (a length's own decisions, applied to
the engine it already has through ``rank.build.apply_layer_decisions`` and
``apply_kernel_decisions``, the functions ``build_rank`` applies them with: which layers
recompute, the MLP's tiles, the offloaded inputs, LoRA's dropout). No config is mutated and
nothing is wired by hand.

Every row runs under the allocator capped at the card its plan is for (``plan.device_gib``:
the 24 GB card, or Unsloth's peak for ``*-at-unsloth``), as Unsloth's rows run under the same
cap (``measure.cap_allocator``); a row that runs out of memory there is that row's result."""

from __future__ import annotations

import contextlib
import gc
import itertools
from collections.abc import Iterator
from typing import Any

from .bases import build_base, quantize_decoder
from .batches import pair_batch, synthetic_batch
from .configs import compose_cfg, decided_at, plan_record
from .measure import (
    add_mfu,
    add_plan_error,
    cap_allocator,
    empty_cache,
    flops_per_step,
    is_oom,
    memory_now,
    peak_census,
    peak_window,
    step_clock,
    timing,
)
from .modes import CAP_GIB, LONG_OVERRIDES, long_search_of
from .recorder import Phase, device_and_env, init_one_rank, time_left


def _in_memory(cfg: Any, d: Any, device: Any) -> tuple[Any, dict[str, bool], bool]:
    """The base builder the bench hands ``rank.build`` (the real architecture with random
    weights, in memory: nothing to download), where it records whether the base was built
    under ``zero.Init``, and whether to build it so (as a rank would, but a 4-bit base is
    quantized here in memory, outside zero.Init: from_pretrained does that itself)."""
    from memtune.rank.build import built_under_zero_init
    from memtune.rank.model import quantization_config

    quant = quantization_config(cfg, d.peft_method)
    built: dict[str, bool] = {}

    def load_base(c: Any, decided: Any) -> Any:
        base = build_base(c, device, decided.attention)
        built["zero_init"] = any(hasattr(q, "ds_id") for q in base.parameters())
        return base if quant is None else quantize_decoder(base, quant, device)

    return load_base, built, quant is None and built_under_zero_init(d)


def build_memtune(cfg: Any, d: Any, ds_config: Any, device: Any) -> tuple[Any, bool]:
    """The rank's parts exactly as memtune.worker builds them (``build_rank`` from the
    decisions); only the base differs, and whether it was built under ``zero.Init``."""
    from memtune.rank.build import build_rank

    load_base, built, zero_init = _in_memory(cfg, d, device)
    parts = build_rank(cfg, d, ds_config, device, load_base=load_base, zero_init=zero_init)
    return parts, built["zero_init"]


def memtune_model(cfg: Any, d: Any, ds_config: Any, device: Any) -> Any:
    """The rank's model before DeepSpeed wraps it (``build_model``, what ``build_rank``
    wraps), on the same base as :func:`build_memtune`."""
    from memtune.rank.build import build_model

    load_base, _, zero_init = _in_memory(cfg, d, device)
    return build_model(cfg, d, ds_config, device, load_base=load_base, zero_init=zero_init)


def dynamo_counts() -> dict[str, int]:
    """What torch.compile did in this process: graphs compiled, breaks, recompiles."""
    from torch._dynamo.utils import counters

    stats = counters["stats"]
    return {
        "graphs": int(stats["unique_graphs"]),
        "graph_breaks": int(sum(counters["graph_break"].values())),
        "calls_captured": int(stats["calls_captured"]),
    }


def planned_for(cfg: Any, device_gib: float | None) -> Any:
    """``cfg`` planned for a card of ``device_gib`` (None: as composed, the 24 GB card)."""
    from memtune.config.decisions import with_sections

    return cfg if device_gib is None else with_sections(cfg, plan={"device_gib": device_gib})


def memtune_at_length(
    engine: Any,
    cfg0: Any,
    counts: Any,
    seq_len: int,
    device: Any,
    rec: dict[str, Any],
    device_gib: float | None = None,
) -> tuple[Any, Any]:
    """The settings at ``seq_len`` (planned for ``device_gib``) and their decisions
    (configs.decided_at), applied to the engine's model as build_rank applies them
    (``apply_layer_decisions``: recomputed layers, and for a long phase the MLP's tiles and
    the offloaded inputs; ``apply_kernel_decisions``: LoRA's dropout, which the decider
    chooses with the layers and so per length, and the rest of the kernels). Records what it
    set in ``rec``."""
    from memtune.rank.build import apply_kernel_decisions, apply_layer_decisions

    cfg, d = decided_at(planned_for(cfg0, device_gib), seq_len, counts)
    tiles, offloaded = apply_layer_decisions(engine.module.model, d, device)
    apply_kernel_decisions(engine.module, d, device)
    rec["lora_dropout"] = d.kernels.lora_dropout
    if d.tiled_mlp or d.offload_activations:
        rec["mlp_tiles"], rec["offloaded_layers"] = tiles, offloaded
    rec["checkpointed_layers"] = d.checkpointing.recomputed
    rec["selective_layers"] = d.checkpointing.selective
    return cfg, d


def run_memtune(
    phase: Phase,
    deadline: float,
    long: bool = False,
    device_gib_at: dict[int, float] | None = None,
    compiled: bool = False,
) -> None:
    """memtune's model, loss, optimizer, DeepSpeed engine and training loop, as
    ``memtune.rank.build.build_rank`` assembles them, on a base built in memory. ``long``:
    the long-context phase (LONG_OVERRIDES; the MLP re-tiled and the checkpointed layers'
    offload set again for every length). ``device_gib_at``: the lengths to run, each planned
    for a card of that many GiB and capped at it (memtune at Unsloth's peak, unsloth.py).
    ``compiled``: ``trainer.compile=true`` at the profile's length (phase ``lora-compiled``:
    the first step holds the compile; the row beside ``lora-memtune``'s eager one). Each row
    is capped at the card it is planned for (``capped_row``: a failure is the row's result)."""
    from memtune.config.deepspeed import build_ds_config
    from memtune.memory.counts import count_params
    from memtune.rank.loop import TrainResult, train
    from memtune.rank.telemetry import NullLogger

    mode, method = phase.mode, phase.method
    device = device_and_env(phase)
    init_one_rank(device)
    lengths = mode.long_lengths if long else mode.lengths
    if device_gib_at:
        lengths = tuple(sorted(device_gib_at, reverse=True))
    gib_at = device_gib_at or {}
    extra = LONG_OVERRIDES if long else ()
    if method == "dpo":  # a preference objective trains without LoRA dropout
        extra = ("peft.dropout=0.0",)
    if compiled:
        extra, lengths = ("trainer.compile=true",), (min(mode.lengths),)
    first = (lengths or long_search_of(mode, method))[0]  # built for the first length it runs
    cfg0 = compose_cfg(mode, method, first, extra)
    counts = count_params(cfg0)
    cfg, d0 = decided_at(planned_for(cfg0, gib_at.get(first)), first, counts)
    ds_config = build_ds_config(cfg, d0)
    leftover = memory_now(device).get("allocated_gib", 0.0)

    parts, zero_init = build_memtune(cfg, d0, ds_config, device)
    engine, attn, loss_kind = parts.engine, parts.attention, parts.loss_kind
    model = parts.model
    params = [q for q in model.parameters() if q.requires_grad]
    phase.data["notes"].append(
        f"attention {attn}; loss {loss_kind}; ZeRO-{d0.zero_stage} on 1 rank; "
        f"{parts.optimizer_note}; base built under zero.Init: {zero_init}; LoRA weights "
        f"{params[0].dtype} after deepspeed.initialize; {len(params)} trainable tensors"
    )

    censused: list[bool] = []  # truthy once a census is taken

    def steps_at(seq_len: int, n_steps: int, rec: dict[str, Any]) -> Any:
        from memtune.config.decisions import with_sections

        at, d = memtune_at_length(engine, cfg0, counts, seq_len, device, rec, gib_at.get(seq_len))
        run_cfg = with_sections(at, trainer={"max_steps": n_steps})
        rec["plan"] = plan_record(run_cfg, d, counts)
        vocab = int(cfg.model.architecture["vocab_size"])
        if method == "dpo":
            batches = itertools.repeat(pair_batch(engine, d, vocab, seq_len, device, rec))
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
            result = train(engine, batches, run_cfg, d, device, NullLogger(), TrainResult(), clock)
        if d.offload_activations:  # against rec["plan"]["host_gib"]
            from memtune.rank.telemetry import host_offload_gib

            rec["host_offload_gib"] = host_offload_gib()
        rec["losses"] = result.losses
        rec["real_tokens"] = result.input_tokens
        return clock

    for seq_len in lengths:
        if not time_left(deadline, 20):
            phase.data["errors"].append({"where": f"{seq_len}", "error": "skipped: out of time"})
            phase.save()
            continue
        side = "memtune-at-unsloth" if device_gib_at else "memtune"
        side = "memtune-compiled" if compiled else side
        rec: dict[str, Any] = {"side": side, "method": method, "seq_len": seq_len}
        rec.update(leftover_gib=leftover, loss_kind=loss_kind, zero_stage=d0.zero_stage)
        # every row under the allocator capped at the card it is planned for (the 24 GB card,
        # or Unsloth's): Unsloth's rows run under the same cap (unsloth.py), the recipe's none
        card = gib_at.get(seq_len, float(cfg0.plan.device_gib))
        if seq_len in gib_at:
            rec["device_gib"] = card
        with capped_row(phase, device, card, rec):  # after the engine: its libraries outside
            clock = steps_at(seq_len, mode.warmup + mode.timed, rec)
            rec.update(timing(clock.marks, mode.warmup, seq_len))
            if compiled:
                rec["compiled_layers"] = parts.compiled_layers
                rec["dynamo"] = dynamo_counts()
            # a DPO row holds one pair: two sequences of half the row, each attending alone
            pair = (seq_len // 2, seq_len - seq_len // 2) if method == "dpo" else None
            arch = cfg.model.architecture
            add_mfu(rec, flops_per_step(counts, arch, seq_len, pair), device)
            add_plan_error(rec)
        phase.add(rec)
        if rec.get("oom") and not rec.get("as_planned"):
            # out of memory where the plan said it fits can leave ZeRO's engine inconsistent
            # (search_cap): what the rows after it measured would be that, not memtune
            phase.data["notes"].append(
                f"after the unplanned out of memory at {seq_len:,} tokens nothing more of this "
                "phase ran (its engine may be inconsistent)"
            )
            phase.save()
            break
    else:  # every row as planned or measured: the searches past them
        if long:
            search_cap(phase, deadline, device, steps_at, cfg0, counts, long=True)
        elif method == "qlora" and not device_gib_at and not compiled:  # at Unsloth's: its own
            search_cap(phase, deadline, device, steps_at, cfg0, counts)
    with contextlib.suppress(Exception):
        import torch.distributed as dist

        dist.destroy_process_group()


@contextlib.contextmanager
def capped_row(phase: Phase, device: Any, card_gib: float, rec: dict[str, Any]) -> Iterator[None]:
    """One row of memtune's with the allocator capped at ``card_gib`` (``cap_allocator``, as
    Unsloth's rows are) and the cap lifted after. A failure inside is the row's result, not
    the phase's end: ``rec["error"]`` and ``rec["oom"]``; out of memory where the row's plan
    said it does not fit is what was planned (``as_planned``), any other failure (an OOM the
    plan did not foresee included) is also the phase's error. The phase goes on."""
    try:
        cap_allocator(device, card_gib, rec)
        yield
    except Exception as err:
        rec["error"] = repr(err)[-2000:]
        rec["oom"] = is_oom(err)
        if rec["oom"] and not (rec.get("plan") or {}).get("fits", True):
            rec["as_planned"] = True
        else:
            phase.error(f"memtune {rec['seq_len']}", err)
    finally:
        gc.collect()
        empty_cache(device)
        cap_allocator(device, None, rec)


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
    mode = phase.mode
    info: dict[str, Any] = {"cap_gib": CAP_GIB}
    cap_allocator(device, CAP_GIB, info)
    if device.type == "cuda":
        info["before"] = memory_now(device)
    # What the planner says fits, for every length tried and beyond.
    planned = []
    lengths = long_search_of(mode, phase.method) if long else mode.search
    key = "long_" if long else ""
    for seq_len in lengths:
        p = plan_record(*decided_at(cfg0, seq_len, counts), counts)
        planned.append({"seq_len": seq_len, "total_gib": p["total_gib"], "fits": p["fits"]})
    info["planned"] = planned
    if long:
        from memtune.config.decisions import rank_machine
        from memtune.memory.long_context_choice import longest_sequence

        # one rank: the split's only choice is 1, as the phase runs
        at, d = decided_at(cfg0, lengths[0], counts)
        n, how = longest_sequence(at, d, counts, rank_machine())
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
    cap_allocator(device, None, info)
