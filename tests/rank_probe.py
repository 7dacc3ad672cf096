"""A rank entry point for tests: memtune.rank.worker.run, then checks that need the live engine.

Started by the real launcher (``deepspeed --module rank_probe RUN_DIR``) with tests/ on
PYTHONPATH. After training it records, per rank: how much of each parameter this rank holds,
whether the frozen base weights still equal the checkpoint on disk, and (rank 0) the trained
model's logits on a fixed batch, so the test process can compare them with base + saved adapter.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import weakref
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from memtune.rank.model import (
    check_all_quantized,
    is_quantized_layer,
    load_base_model,
    prepare_quantized,
    torch_dtype,
)
from memtune.rank.worker import RankContext, leave, run
from memtune.rundir import RunDir


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


class _NewStorages(TorchDispatchMode):
    """The storages the ops under it create (not their inputs' storages: views and in-place
    ops, collectives included, make none), each released when it dies: ``temporaries()`` is
    the peak bytes of those that died by the end (not what the ops made to keep)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.events: list[tuple[int, int]] = []  # (storage, +bytes made / -bytes released)

    def _release(self, key: int) -> None:
        self.events.append((key, -self.live.pop(key)))

    def temporaries(self) -> int:
        total = peak = 0
        for key, change in self.events:
            if key not in self.live:
                total += change
                peak = max(peak, total)
        return peak

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage()._cdata
            for t in pytree.tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if key in inputs or key in self.live:
                continue
            self.live[key] = storage.nbytes()
            self.events.append((key, storage.nbytes()))
            weakref.finalize(storage, self._release, key)
        return out


REDUCES: list[tuple[int, int]] = []
"""(elements in the gradient bucket, peak bytes DeepSpeed's reduce of it allocated) of each
reduce this rank ran while training and freed by its end: its temporaries beside the bucket
buffers (not what it keeps: ZeRO-2's first reduce makes the gradient partition it adds to)."""


def _measure_reduces() -> None:
    """Wrap DeepSpeed 0.19's bucket reduce (ZeRO-1/2: average_tensor of the filled bucket;
    ZeRO-3: the private reduce-and-partition of the IPG bucket) so that each call records what
    its own code allocates (config.deepspeed.reduce_temporaries_bytes plans it)."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    average = DeepSpeedZeroOptimizer.average_tensor

    def average_tensor(self: Any, tensor: torch.Tensor, dtype: torch.dtype) -> Any:
        with _NewStorages() as mode:
            out = average(self, tensor, dtype)
        REDUCES.append((tensor.numel(), mode.temporaries()))
        return out

    DeepSpeedZeroOptimizer.average_tensor = average_tensor  # type: ignore[method-assign]
    name = "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads"
    reduce = getattr(DeepSpeedZeroOptimizer_Stage3, name)

    def reduce_ipg(self: Any, dtype: torch.dtype) -> Any:
        elements = self.ipg_buckets[dtype].elements
        with _NewStorages() as mode:
            out = reduce(self, dtype)
        if elements:
            REDUCES.append((elements, mode.temporaries()))
        return out

    setattr(DeepSpeedZeroOptimizer_Stage3, name, reduce_ipg)


PROBE_TEXT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


def probe(engine: Any, ctx: RankContext) -> None:
    import deepspeed

    if os.environ.get("MEMTUNE_TEST_CRASH_RANK") == str(ctx.rank):
        os._exit(7)  # dies while the other ranks enter the collectives below
    # What torch.compile did during training, read before the eval forward below (no_grad is a
    # new guard, so it would compile again).
    dynamo: dict[str, int] = {}
    if "torch._dynamo" in sys.modules:
        from torch._dynamo.utils import counters

        dynamo = {
            "graphs": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": int(sum(counters["graph_break"].values())),
        }
    model = engine.module.model
    params = dict(model.named_parameters())
    zero3 = any(hasattr(p, "ds_id") for p in params.values())
    held = sum(int(p.ds_tensor.numel()) if zero3 else p.numel() for p in params.values())
    total = sum(int(getattr(p, "ds_numel", p.numel())) for p in params.values())
    held_bytes = {"base": 0, "lora": 0}
    lora_dtypes = set()
    counted: set[int] = set()  # storages already counted
    for name, p in params.items():
        data = p.ds_tensor if zero3 else p
        counted.add(data.untyped_storage()._cdata)
        held_bytes["lora" if "lora_" in name else "base"] += data.numel() * data.element_size()
        if "lora_" in name:
            lora_dtypes.add(str(data.dtype))
    # What bitsandbytes' 8-bit layers hold beside the parameters (ZeRO-3 frees only a
    # parameter's .data): the weight's int8 bytes and fp32 row scales, on the Int8Params
    # (CB / SCB, until the first forward) or in the layer's MatmulLtState (state.CB / state.SCB,
    # from then on), and the weight's .data (bitsandbytes points it at state.CB after each
    # forward). Each storage counted once, parameters' shards included.
    int8_held: dict[str, int] = {}
    for layer in model.modules():
        if not is_quantized_layer(layer) or type(layer).__name__ != "Linear8bitLt":
            continue  # bitsandbytes' layer, not peft's LoRA wrapper of that name
        state = layer.state
        for where, t in (
            ("weight.CB", getattr(layer.weight, "CB", None)),
            ("weight.SCB", getattr(layer.weight, "SCB", None)),
            ("state.CB", state.CB),
            ("state.SCB", state.SCB),
            ("weight.data", layer.weight.data),
        ):
            if t is None or t.numel() == 0:
                continue
            size = t.untyped_storage().nbytes()
            int8_held[where] = int8_held.get(where, 0) + t.numel() * t.element_size()
            key = t.untyped_storage()._cdata
            if key not in counted:
                counted.add(key)
                held_bytes["base"] += size

    gathered = deepspeed.zero.GatheredParameters(list(params.values())) if zero3 else None
    if gathered is not None:
        gathered.__enter__()
    full = {n: p.detach().cpu().clone() for n, p in params.items()}
    if gathered is not None:
        gathered.__exit__(None, None, None)

    # The base as a fresh load makes it (quantized and prepared the same way for QLoRA / int8),
    # compared byte for byte: a frozen weight that changed at all is a bug.
    as_run = dataclasses.replace(ctx.decisions, attention="sdpa")
    fresh_model = load_base_model(ctx.cfg, as_run)
    if as_run.peft_method != "lora":
        fresh_model = prepare_quantized(fresh_model, torch_dtype(ctx.cfg))
        check_all_quantized(fresh_model, ctx.cfg, as_run)  # a mixture's expert stacks too
    fresh = dict(fresh_model.named_parameters())
    base_changed = []
    for name, value in full.items():
        if "lora_" in name or params[name].requires_grad:  # adapters, a mixture's trained routers
            continue
        ref = fresh[name.replace("base_model.model.", "").replace(".base_layer", "")].detach()
        if ref.dtype != value.dtype and ref.is_floating_point():
            ref = ref.to(value.dtype)  # a ZeRO-3 partition keeps the dtype it was loaded in
        if not torch.equal(_bytes(value), _bytes(ref)):
            base_changed.append(name)
    n_base = sum(1 for n in full if "lora_" not in n)
    lora = b"".join(_bytes(v).numpy().tobytes() for n, v in sorted(full.items()) if "lora_" in n)
    bnb_layers = [m for m in model.modules() if is_quantized_layer(m)]
    quantized = {type(m).__name__: str(m.weight.dtype) for m in bnb_layers}
    n_quantized = len(bnb_layers)
    lora_b_zero = [n for n, v in full.items() if "lora_B" in n and not torch.any(v != 0)]
    n_lora_b = sum(1 for n in full if "lora_B" in n)

    basic = getattr(engine.optimizer, "optimizer", engine.optimizer)  # inside ZeRO's wrapper
    masters = getattr(engine.optimizer, "single_partition_of_fp32_groups", None) or getattr(
        engine.optimizer, "fp32_partitioned_groups_flat", []
    )
    optimizer_bytes = sum(t.numel() * t.element_size() for t in masters) + sum(
        v.numel() * v.element_size()
        for s in basic.state.values()
        for v in s.values()
        if torch.is_tensor(v) and v.dim() > 0  # not the step counter
    )
    # DeepSpeed's gradient reduce buffers: ZeRO-3 keeps its own from __init__ on; ZeRO-2 makes
    # them as a backward starts (setup_buckets) and frees them after it, so they are made here
    # once more by DeepSpeed's own code, measured and freed as its backward would.
    zero = engine.optimizer
    if not zero3:
        micro_step = zero.micro_step_id
        zero.setup_buckets()
    bucket_bytes = sum(
        t.numel() * t.element_size()
        for bucket in zero.ipg_buckets.values()
        for t in (bucket.buffer if isinstance(bucket.buffer, list) else [bucket.buffer])
        if t is not None
    )
    if not zero3:
        zero._release_ipg_buffers()
        zero.micro_step_id = micro_step
    ids = torch.tensor([ctx.tokenizer.encode(PROBE_TEXT, add_special_tokens=False)])
    engine.eval()
    with torch.no_grad():
        logits = engine.module.model(input_ids=ids.to(ctx.device)).logits.float().cpu()
    result = {
        "rank": ctx.rank,
        "world_size": ctx.world_size,
        "zero3": zero3,
        "held_params": held,
        "total_params": total,
        "base_tensors_checked": n_base,
        "base_changed": base_changed,
        "quantized": quantized,
        "quantized_modules": n_quantized,
        "lora_sha256": hashlib.sha256(lora).hexdigest(),
        "lora_b_tensors": n_lora_b,
        "lora_b_all_zero": lora_b_zero,
        "optimizer": type(basic).__name__,
        "group_lrs": [float(g["lr"]) for g in basic.param_groups],
        "grad_accum_dtype": str(getattr(engine.optimizer, "gradient_accumulation_dtype", None)),
        "held_bytes": held_bytes,
        "int8_held": int8_held,
        "lora_dtypes": sorted(lora_dtypes),
        "optimizer_bytes": optimizer_bytes,
        "bucket_bytes": bucket_bytes,
        # the reduce that allocated the most: (its bucket's elements, those bytes)
        "reduce_temporaries": max(REDUCES, key=lambda r: r[1], default=None),
        "dynamo": dynamo,
        "optimizer_state_dtypes": sorted(
            {str(v.dtype) for s in basic.state.values() for v in s.values() if torch.is_tensor(v)}
        ),
    }
    (ctx.rd.path / f"probe_rank{ctx.rank}.json").write_text(json.dumps(result, indent=2))
    if ctx.rank == 0:
        torch.save({"input_ids": ids, "logits": logits}, ctx.rd.path / "probe_logits.pt")


if __name__ == "__main__":
    _measure_reduces()
    run(RunDir(sys.argv[1]), after_train=probe)
    # as memtune.worker ends a rank: without the interpreter's teardown of the native libraries,
    # where a rank now and then aborted after a complete run (SIGABRT, "terminate called
    # without an active exception": seen in test_lora_variants' shared run)
    leave(0)
