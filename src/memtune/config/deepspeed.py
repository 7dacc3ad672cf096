"""Fill a DeepSpeed JSON template from the settings and what was decided for the run.

The templates in ``ds_configs/`` are DeepSpeed's own format with ``"auto"`` where memtune
derives the value, so a setting is never written twice. Filling replaces every ``"auto"``;
a hard value that disagrees with the derived one is an error, and so is an ``"auto"`` that
memtune does not know how to fill.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from memtune.config import (
    SOURCE_ROOT,
    ConfigError,
    RunConfig,
    persistence_threshold,
    prefetch_bucket_elements,
    reduce_bucket_elements,
)
from memtune.config.decisions import Decisions

DS_CONFIG_DIR = SOURCE_ROOT / "ds_configs"


def derived_values(cfg: RunConfig, d: Decisions) -> dict[str, Any]:
    """Every DeepSpeed value memtune derives, keyed by dotted JSON path: the batch fields
    from the decided step's shape (config.decisions.BatchShape), the rest from the settings."""
    t = cfg.trainer
    values: dict[str, Any] = {
        **d.batch.deepspeed(),
        "gradient_clipping": t.max_grad_norm,
        "bf16.enabled": t.precision == "bf16",
        # DeepSpeed's default too; rank/loop.py relies on it to discard non-finite steps in bf16.
        "bf16.check_grad_overflow": True,
        # Gradients of the (bf16) adapters summed over micro batches in fp32, not bf16: the
        # adapters are small, so this costs MBs, and 8+ bf16 additions lose low bits.
        "data_types.grad_accum_dtype": "fp32",
        "zero_optimization.stage": d.zero_stage,
        "zero_optimization.reduce_bucket_size": reduce_bucket_elements(cfg),
    }
    if d.sequence_parallel > 1:
        # DeepSpeed's batch arithmetic counts data-parallel ranks: world / this. (The engine
        # also gets the groups (rank/sequence_parallel.py); this is for configs read without
        # them, e.g. transformers' zero.Init.)
        values["sequence_parallel_size"] = d.sequence_parallel
        if d.zero_stage == 3:
            # ZeRO-3 averages over all ranks on this path only, which rank.loop's loss scale
            # counts on (rank/sequence_parallel.py: gradient_averaging_ranks).
            values["zero_optimization.reduce_scatter"] = True
    if d.optimizer == "cpu_adam":
        # DeepSpeed builds DeepSpeedCPUAdam itself only from its own config (see optim.py).
        values["optimizer.type"] = "AdamW"
        values["optimizer.params.lr"] = t.lr
        values["optimizer.params.weight_decay"] = t.weight_decay
        values["zero_optimization.offload_optimizer.device"] = "cpu"
    if d.optimizer == "adamw_8bit":
        # ZeRO wraps bitsandbytes' optimizer like any other; DeepSpeed asks for this opt-in.
        values["zero_allow_untested_optimizer"] = True
    if d.zero_stage == 2:
        values["zero_optimization.allgather_bucket_size"] = reduce_bucket_elements(cfg)
    else:
        values["zero_optimization.stage3_prefetch_bucket_size"] = prefetch_bucket_elements(cfg)
        values["zero_optimization.stage3_param_persistence_threshold"] = persistence_threshold(cfg)
        values["zero_optimization.stage3_gather_16bit_weights_on_model_save"] = True
    return values


def template_path(d: Decisions) -> Path:
    name = d.zero_template or f"zero{d.zero_stage}"
    path = Path(name) if name.endswith(".json") else DS_CONFIG_DIR / f"{name}.json"
    if not path.is_file():
        raise ConfigError(f"zero.template={name!r}: no such DeepSpeed template ({path})")
    return path


def fill_ds_config(
    template: dict[str, Any], cfg: RunConfig, d: Decisions, source: str = "template"
) -> dict:
    """Return a copy of ``template`` with every derived value in place, checked."""
    filled = json.loads(json.dumps(template))
    for dotted, value in derived_values(cfg, d).items():
        *parents, leaf = dotted.split(".")
        node = filled
        for part in parents:
            node = node.setdefault(part, {})
        current = node.get(leaf, "auto")
        if current != "auto" and current != value:
            raise ConfigError(
                f"{source}: {dotted} is {current!r} but the config gives {value!r}. "
                f'Set it to "auto" in the JSON and change the memtune config instead.'
            )
        node[leaf] = value
    leftover = list(_auto_paths(filled))
    if leftover:
        raise ConfigError(f'{source}: memtune cannot fill "auto" at {", ".join(leftover)}')
    stage = filled["zero_optimization"]["stage"]
    if stage == 2 and any(k.startswith("stage3_") for k in filled["zero_optimization"]):
        raise ConfigError(f"{source}: stage3_* settings in a ZeRO-2 config (zero.stage=2)")
    experts = d.experts
    if stage in (1, 2) and experts is not None and experts.parallel > 1 and experts.adapted:
        # rank.expert_parallel marks the split experts as DeepSpeed's MoE parameters, whose
        # ZeRO-1/2 optimizer asserts both (stage_1_and_2.py, _configure_moe_settings) once
        # every rank has loaded the base; its other reduction path would sum different
        # experts' gradients over all the ranks
        for key in ("reduce_scatter", "contiguous_gradients"):
            if filled["zero_optimization"].get(key, True) is False:
                raise ConfigError(
                    f"{source}: zero_optimization.{key} is false with "
                    f"trainer.expert_parallel={experts.parallel}: DeepSpeed reduces the split "
                    f"experts' gradients only with {key} true; set it to true (or remove it)"
                )
    return filled


def _auto_paths(node: Any, prefix: str = ""):
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _auto_paths(value, f"{prefix}{key}.")
    elif node == "auto":
        yield prefix.rstrip(".")


def build_ds_config(cfg: RunConfig, d: Decisions) -> dict[str, Any]:
    path = template_path(d)
    try:
        template = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}:{err.lineno}: invalid JSON ({err.msg})") from err
    return fill_ds_config(template, cfg, d, source=str(path))


def gradient_bucket_bytes(cfg: RunConfig, d: Decisions, largest: int = 0) -> tuple[int, str]:
    """What DeepSpeed 0.19 allocates for its gradient reduce buckets, read from the resolved
    config (build_ds_config): (bytes, how). With contiguous_gradients ZeRO-2 holds one buffer
    of reduce_bucket_size in the adapters' dtype, two with overlap_comm (stage_1_and_2.py,
    setup_buckets and _gradient_reduction_buffer_dtype: the fp32 grad_accum_dtype goes to the
    partition, not the bucket, at stage 2); ZeRO-3 one in the communication dtype (stage3.py,
    the IPG buffer allocated once in __init__); without contiguous_gradients none (a reduce
    flattens the bucket's gradients into one copy of that size, among its temporaries).
    Beside them, what the reduce of a full bucket makes and frees (reduce_temporaries_bytes;
    ``largest``: the elements of the largest adapter tensor as a rank holds it, a mixture's
    routed-expert stacks' included: ParamCounts.largest_lora_tensor).

    The temporaries are counted with the buffers, at the step's peak: a bucket reduces from a
    backward hook as soon as the next gradient would overflow it, so while a layer's backward
    runs. Where a layer's adapters hold about a bucket or more (a mixture's expert adapters:
    Qwen3-30B-A3B's 13.4M elements a layer, 3.6M a rank with its experts split over 4, against
    hidden² = 4.2M), the reduces run inside the first layers' backward, at the peak. (A dense
    model's adapters fill a hidden² bucket only every few layers, a few layers' held inputs
    below the peak; counted the same, a few tens of MB on 7B.)"""
    ds = build_ds_config(cfg, d)
    z = ds["zero_optimization"]
    stage = z["stage"]
    dtype = bucket_dtype(ds)
    size = _element_bytes(dtype)
    contiguous = z.get("contiguous_gradients", True)
    # DeepSpeed's default: overlap_comm on at stage 3 only (zero/config.py, overlap_comm_valid)
    overlap = z.get("overlap_comm", stage == 3)
    buffers = (2 if stage != 3 and overlap else 1) if contiguous else 0
    elements = int(z["reduce_bucket_size"])
    what = f"{buffers} gradient reduce buffer{'s' if buffers != 1 else ''} ({dtype})"
    reduce = reduce_temporaries_bytes(ds, elements, d.batch.ranks, d.sequence_parallel, largest)
    if reduce:
        mib = reduce / 2**20  # a CPU demo's are a fraction of one
        what += f" + {mib:.0f} MiB" if mib >= 10 else f" + {mib:.2f} MiB"
        what += " while one reduces"
    return buffers * elements * size + reduce, what


def bucket_dtype(ds: dict[str, Any]) -> str:
    """The dtype of DeepSpeed's gradient reduce buckets: the adapters' (bf16 or fp32); at
    stage 3 the communication dtype where one is set."""
    dtype = "bf16" if ds.get("bf16", {}).get("enabled") else "fp32"
    if ds["zero_optimization"]["stage"] == 3:
        dtype = (ds.get("communication_data_type") or dtype).lower()  # fp16, bf16, fp32
    return str(dtype)


def _element_bytes(dtype: str) -> int:
    """Bytes of one element of a DeepSpeed dtype name (fp16, bf16, fp32)."""
    return 2 if dtype in ("bf16", "fp16") else 4


def reduce_temporaries_bytes(
    ds: dict[str, Any], elements: int, ranks: int, sequence_parallel: int, largest: int = 0
) -> int:
    """The most that DeepSpeed 0.19's reduce of a bucket of ``elements`` gradients allocates
    and frees again, from the resolved config ``ds`` (gradients accumulate in fp32:
    data_types.grad_accum_dtype):

    * ZeRO-1/2 with reduce_scatter (average_tensor, allreduce_bucket in stage_1_and_2.py):
      the bucket's slices flattened into one copy in the bucket's dtype; with the sequence
      split (sequence_parallel_size > 1) that copy is communicated in fp32 whatever the
      dtype, so a bf16 bucket is copied once more to fp32; unsplit, a bf16 copy's slices are
      added to the fp32 gradient partition one at a time, each upcast first
      (_add_to_grad_partition_buffer): at most the ``largest`` adapter tensor's. Without
      reduce_scatter (gradient_reduction_w_predivide) a copy only where
      communication_data_type differs. Without contiguous_gradients, whatever reduce_scatter
      says, the same as with it: reduce_ipg_grads takes the fallback (allreduce_bucket), which
      flattens the bucket and upcasts as above.
    * ZeRO-3 with reduce_scatter (DeepSpeed's default; __avg_scatter_grads and
      reduce_scatter_coalesced in stage3.py): the bucket concatenated in the communication
      dtype, and this rank's 1/ranks of it reduced, upcast to fp32. Without it, contiguous
      (__avg_scatter_contiguous_grads): the whole reduced bucket upcast to fp32 (stage3.py,
      "buffer_to_reduce.to(self.gradient_accumulation_dtype)")."""
    z = ds["zero_optimization"]
    dtype = bucket_dtype(ds)
    size = _element_bytes(dtype)
    scatter = z.get("reduce_scatter", True)
    if z["stage"] == 3:
        if scatter or not z.get("contiguous_gradients", True):
            return elements * size + (elements * 4 // ranks if size != 4 else 0)
        return elements * 4 if size != 4 else 0
    if not scatter and z.get("contiguous_gradients", True):
        communicated = (ds.get("communication_data_type") or dtype).lower()
        return elements * _element_bytes(communicated) if communicated != dtype else 0
    if size == 4:
        return elements * size
    return elements * size + (elements if sequence_parallel > 1 else largest) * 4
