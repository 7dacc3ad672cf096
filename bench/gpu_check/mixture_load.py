"""The streaming loader's peak on a real checkpoint (issue #48 item 6; phase ``mixture-load``,
group ``mixture``): a Qwen3-30B-A3B-shaped mixture with fewer layers (``mode.
mixture_load_layers``: 12 of 48 on the GPU, 15.6 GB of bf16 shards that the lent machine's
64 GiB disk holds; the full model's 61 GB would not leave room) written with random weights
to local disk in the released layout, then loaded through memtune's own loading path
(``rank.model.load_base_model`` for QLoRA: bitsandbytes quantizes the linear layers and
memtune each expert stack as the checkpoint is read), its peak host and device memory against
the plan's ``loading:`` line (memory.loading).

The checkpoint is written as Qwen's release stores it (each expert's gate / up / down apart,
which transformers merges into the fused stacks as it reads; the names checked against
``save_pretrained``'s in tests/test_gpu_check_mixture.py), one shard a layer with an index,
the config of the shortened model beside it. Each layer is drawn on the device, copied to the
host, written and freed before the next (bases.draw_weights on a meta model), so writing holds
one layer. The write is timed. The load then reads the shards back from the page cache (the
machine's memory holds them: the disk's read speed is not what is measured).

Host memory is sampled from /proc/self/status every 5 ms (measure.host_peak): RssAnon, what
the process allocated (the plan's host figure), and RssFile, the checkpoint's pages mapped
(shared, reclaimable: not in the plan). The checkpoint is deleted afterwards (this phase made
it)."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from .bases import draw_outside_layers, draw_weights, meta_model
from .configs import compose_cfg, decided_at
from .measure import empty_cache, host_peak, memory_now, peak_window, sync
from .mixture import MIXTURE_OVERRIDES
from .modes import GIB
from .recorder import Phase, device_and_env

SCRATCH_ENV = "GPU_CHECK_SCRATCH"
"""Where the checkpoint is written (default: the temporary directory, on the lent machine's
disk)."""
DISK_MARGIN = 1.10
"""Free disk wanted beyond the checkpoint's bytes before writing it."""


def released_names(prefix: str, stacks: dict[str, Any]) -> dict[str, Any]:
    """A layer's fused expert stacks (``mlp.experts.gate_up_proj``: experts × 2·I × hidden,
    ``down_proj``: experts × hidden × I) as the release stores them: each expert's
    ``gate_proj`` (the first I rows), ``up_proj`` (the next I) and ``down_proj``, under
    ``prefix`` (``model.layers.N.mlp.experts.``)."""
    gate_up, down = stacks["gate_up_proj"], stacks["down_proj"]
    half = gate_up.shape[1] // 2
    out = {}
    for e in range(gate_up.shape[0]):
        out[f"{prefix}{e}.gate_proj.weight"] = gate_up[e, :half].contiguous()
        out[f"{prefix}{e}.up_proj.weight"] = gate_up[e, half:].contiguous()
        out[f"{prefix}{e}.down_proj.weight"] = down[e].contiguous()
    return out


def write_checkpoint(cfg: Any, path: Path, device: Any) -> dict[str, Any]:
    """The mixture of ``cfg.model.architecture`` with random weights, written to ``path`` in
    the released layout, a shard a layer (and one for the rest) with
    ``model.safetensors.index.json`` and ``config.json``; returns what it wrote (bytes,
    shards, seconds, tensors)."""
    import torch
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    model = meta_model(cfg)
    torch.manual_seed(cfg.trainer.seed)
    layers = model.get_decoder().layers
    shards = len(layers) + 1
    weight_map: dict[str, str] = {}
    total = 0

    def write(index: int, named: dict[str, Any]) -> None:
        nonlocal total
        name = f"model-{index:05d}-of-{shards:05d}.safetensors"
        state: dict[str, Any] = {}
        for key, value in named.items():
            if isinstance(value, dict):  # a layer's fused expert stacks, on the host
                state.update(released_names(f"{key}.", value))
            else:
                state[key] = value.detach().to("cpu").contiguous()
        save_file(state, str(path / name), metadata={"format": "pt"})
        total += sum(v.numel() * v.element_size() for v in state.values())
        weight_map.update(dict.fromkeys(state, name))

    path.mkdir(parents=True)
    model.config.save_pretrained(path)
    draw_outside_layers(model, device)
    rest = {n: p for n, p in model.named_parameters() if not n.startswith("model.layers.")}
    write(shards, rest)
    del rest
    for i, layer in enumerate(layers):
        draw_weights(layer, device, model.config)
        named: dict[str, Any] = {}
        for n, p in layer.named_parameters():
            owner, _, leaf = n.rpartition(".")
            if owner.endswith("experts") and p.dim() == 3:
                named.setdefault(f"model.layers.{i}.{owner}", {})[leaf] = p.detach().to("cpu")
            else:
                named[f"model.layers.{i}.{n}"] = p
        write(i + 1, named)
        layer.to_empty(device="meta")  # freed before the next layer is drawn
        gc.collect()
        empty_cache(device)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    sync(device)
    seconds = time.perf_counter() - t0
    return {
        "bytes": total,
        "gb": total / 1e9,
        "shards": shards,
        "tensors": len(weight_map),
        "write_s": round(seconds, 2),
        "write_gb_s": total / 1e9 / seconds,
    }


def checkpoint_bytes(cfg: Any) -> int:
    """The checkpoint's bytes in the compute dtype: every parameter of the meta model."""
    return sum(p.numel() * p.element_size() for p in meta_model(cfg).parameters())


def run_mixture_load(phase: Phase, deadline: float) -> None:
    """Write the shortened mixture, then load it for QLoRA through ``load_base_model`` on
    this rank's device, measuring the host's and the device's peak against the plan."""
    import torch

    from memtune.memory.counts import count_params
    from memtune.memory.estimate import plan
    from memtune.rank.model import load_base_model

    mode = phase.mode
    device = device_and_env(phase)
    layers = mode.mixture_load_layers
    scratch = Path(os.environ.get(SCRATCH_ENV) or tempfile.gettempdir())
    folder = Path(tempfile.mkdtemp(prefix="gpu_check_mixture_", dir=scratch))
    path = folder / "checkpoint"
    extra = (
        *MIXTURE_OVERRIDES,
        f"model.name_or_path={path}",
        f"model.architecture.num_hidden_layers={layers}",
        # the loading plan of the device the base is read onto (a CPU rank's: no device_gib)
        *(() if device.type == "cuda" else ("plan.device_gib=null",)),
    )
    seq_len = mode.mixture_lengths[0]
    cfg = compose_cfg(mode, "mixture", seq_len, extra, model=mode.mixture_model)
    info: dict[str, Any] = {"model": mode.mixture_model, "layers": layers, "path": str(path)}
    phase.data["mixture_load"] = info
    try:
        need = checkpoint_bytes(cfg)
        free = shutil.disk_usage(scratch).free
        info.update(checkpoint_gb=need / 1e9, disk_free_gb=free / 1e9)
        if free < DISK_MARGIN * need:
            info["skipped"] = f"{need / 1e9:.1f} GB to write, {free / 1e9:.1f} GB free"
            phase.data["notes"].append(f"mixture-load: {info['skipped']}")
            phase.save()
            return
        counts = count_params(cfg)
        cfg, d = decided_at(cfg, seq_len, counts)
        planned = plan(cfg, d, counts)
        info["plan"] = {
            "device_gib": planned.loading.device_gib if planned.loading else None,
            "host_gib": planned.loading.host_gib if planned.loading else None,
            "how": planned.loading.how if planned.loading else None,
            "base_weights_gib": next(r.gib for r in planned.rows if r.what == "base weights"),
        }
        phase.save()
        info["write"] = write_checkpoint(cfg, path, device)
        phase.save()
        print(
            f"gpu_check: {phase.name}: wrote {info['write']['gb']:.2f} GB in "
            f"{info['write']['write_s']:.1f} s",
            flush=True,
        )
        gc.collect()
        empty_cache(device)
        load: dict[str, Any] = {"before": memory_now(device)}
        load["host_trimmed_gib"] = trim_host_heap()
        before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        t = time.perf_counter()
        with peak_window(device, load), host_peak(load):
            model = load_base_model(cfg, d, 0 if device.type == "cuda" else None)
        load["load_s"] = round(time.perf_counter() - t, 2)
        if device.type == "cuda":
            load["device_peak_gib"] = load["peak_allocated_gib"] - before / GIB
            load["device_kept_gib"] = (torch.cuda.memory_allocated(device) - before) / GIB
        info["load"] = load
        info["check"] = layout_check(model, path, d.experts.storage, cfg)
        compare_to_plan(info)
        phase.save()
        del model
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(folder)  # ours: made above
        gc.collect()
        empty_cache(device)
    phase.save()


def trim_host_heap() -> float | None:
    """Give the heap's free pages back to the system (glibc's ``malloc_trim``), so the load
    cannot reuse what writing freed without RssAnon showing it; returns the GiB released (None
    where there is no glibc)."""
    import ctypes

    from .measure import rss_gib

    before = rss_gib()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return None
    after = rss_gib()
    return None if before is None or after is None else before[0] - after[0]


def layout_check(model: Any, path: Path, storage: str, cfg: Any) -> dict[str, Any]:
    """That the written layout is the one transformers reads: layer 0's router as written,
    and its gate_up stack, as loaded and quantized while read, byte for byte the written
    experts' gate and up merged and quantized here (rank.experts.quantized_parameter)."""
    import torch
    from safetensors import safe_open

    from memtune.rank.experts import quantized_parameter
    from memtune.rank.model import torch_dtype

    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    layer = model.get_decoder().layers[0]
    experts = layer.mlp.experts
    device = experts.gate_up_proj.device
    prefix = "model.layers.0.mlp."
    with safe_open(str(path / index[f"{prefix}gate.weight"]), "pt") as f:
        router = f.get_tensor(f"{prefix}gate.weight")
        n = int(experts.num_experts)
        gate_up = torch.stack(
            [
                torch.cat(
                    [
                        f.get_tensor(f"{prefix}experts.{e}.gate_proj.weight"),
                        f.get_tensor(f"{prefix}experts.{e}.up_proj.weight"),
                    ]
                )
                for e in range(n)
            ]
        )
    mine = quantized_parameter(gate_up.to(device), storage, torch_dtype(cfg))
    loaded = experts.gate_up_proj
    return {
        "router_equal": bool(torch.equal(layer.mlp.gate.weight.detach().cpu(), router)),
        "gate_up_equal": bool(
            loaded.shape == mine.shape
            and torch.equal(loaded.detach().view(torch.uint8), mine.detach().view(torch.uint8))
        ),
        "stacks_quantized": sum(
            1 for p in model.parameters() if getattr(p, "memtune_quantized", None) is not None
        ),
    }


def compare_to_plan(info: dict[str, Any]) -> None:
    """The measured peaks beside the plan's (``*_error_pct``: planned over measured, less 1)."""
    load, planned = info["load"], info["plan"]
    pairs = (("device", load.get("device_peak_gib")), ("host", load.get("host_anon_peak_gib")))
    for side, measured in pairs:
        want = planned.get(f"{side}_gib")
        if measured and want is not None:
            load[f"{side}_error_pct"] = 100 * (want / measured - 1)
