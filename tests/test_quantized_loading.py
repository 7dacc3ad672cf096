"""A quantized mixture loaded without a whole copy of its base in the compute dtype: each
routed-expert stack is quantized as transformers' loader reads it (rank.experts.
experts_as_loaded), bit for bit what quantizing after a full load gives, and the
loading peak is the quantized model and one stack, as the plan states it."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from memtune.config import to_run_config, validate
from tests.conftest import CPU_RANKS, compose_cfg, decided
from tests.test_moe import TINY

MIB = 2**20


def _cfg(model: str, path: Path, peft: str, *overrides: str) -> Any:
    return to_run_config(
        compose_cfg(
            [
                f"model={model}",
                f"model.name_or_path={path}",
                f"peft={peft}",
                "peft.target=all-linear",
                "peft.dropout=0",
                "zero=zero2",
                "launcher.num_ranks=1",
                "trainer.precision=bf16",
                *overrides,
            ]
        )
    )


def _save(model_type: str, arch: dict[str, Any], path: Path, fused: bool = False) -> Path:
    """A random mixture of the real config class saved as released checkpoints are: each
    expert's gate / up / down apart (save_pretrained: Qwen3-MoE's layout), or ``fused`` as the
    model holds them (one 3-D tensor a stack per layer)."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **arch)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    if not fused:
        model.save_pretrained(path)
        return path
    path.mkdir(parents=True)
    config.save_pretrained(path)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    return path


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8)


HYBRID = dict(  # Qwen3.5-MoE: linear attention, then full attention, a shared expert
    hidden_size=64,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    num_hidden_layers=2,
    layer_types=["linear_attention", "full_attention"],
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    vocab_size=128,
)
MOE = {k: v for k, v in TINY.items() if k != "initializer_range"}  # Qwen3-MoE


@contextlib.contextmanager
def _warmup_seen() -> Iterator[Any]:
    """transformers' caching_allocator_warmup as from_pretrained would call it, recorded each
    time a weight is set (a parameter hook), and put back afterwards."""
    from transformers import modeling_utils

    seen = types.SimpleNamespace(original=modeling_utils.caching_allocator_warmup, seen=set())

    def during_load(module: Any, name: str, param: Any) -> None:
        seen.seen.add(modeling_utils.caching_allocator_warmup)

    handle = torch.nn.modules.module.register_module_parameter_registration_hook(during_load)
    try:
        yield seen
    finally:
        handle.remove()
    assert modeling_utils.caching_allocator_warmup is seen.original


@pytest.mark.parametrize(
    ("model", "model_type", "arch", "fused", "peft"),
    [
        ("tiny-qwen3-moe", "qwen3_moe", MOE, False, "qlora-nf4"),
        ("tiny-qwen3.5-moe", "qwen3_5_moe_text", HYBRID, True, "lora-int8"),
    ],
    ids=["qwen3-moe-each-expert-nf4", "qwen3.5-moe-fused-int8"],
)
def test_stacks_quantized_as_read_are_those_of_a_full_load(
    tmp_path: Path, model: str, model_type: str, arch: dict, fused: bool, peft: str
) -> None:
    """Every weight of the streamed base, byte for byte, is the base loaded whole and then
    quantized (rank.experts.quantize_experts): a checkpoint storing each expert apart (merged
    by transformers as it reads) and one storing fused stacks."""
    from transformers import AutoModelForCausalLM

    from memtune.expert_stacks import quantized_stack
    from memtune.rank.experts import quantize_experts
    from memtune.rank.model import load_base_model, quantization_config

    path = _save(model_type, arch, tmp_path / "base", fused)
    cfg = _cfg(model, path, peft)
    d = decided(cfg, attention="sdpa")
    with _warmup_seen() as warmups:
        streamed = load_base_model(cfg, d)
    # transformers' caching-allocator warm-up would reserve each GPU's share of the model at
    # the checkpoint's dtype before reading it (2 bytes a weight of every expert stack: ~61 GB
    # for Qwen3-30B-A3B on one card): while stacks are quantized as read it does nothing.
    # Seen from inside from_pretrained, on a CPU rank where the warm-up itself never runs.
    assert warmups.seen and warmups.original not in warmups.seen
    assert all(w(None, {"x": torch.device("cuda", 0)}, None) is None for w in warmups.seen)
    whole = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, quantization_config=quantization_config(cfg, d.peft_method)
    )
    floats = [n for n, p in whole.named_parameters() if ".mlp.experts." in n]
    assert floats and all(p.dtype == torch.bfloat16 for p in whole.parameters() if p.ndim == 3)
    assert quantize_experts(whole, d.experts.storage, torch.bfloat16) == 2 * 2
    assert quantize_experts(streamed, d.experts.storage, torch.bfloat16) == 0  # done as read
    ours, theirs = dict(streamed.named_parameters()), dict(whole.named_parameters())
    assert ours.keys() == theirs.keys()
    for name, p in ours.items():
        assert p.dtype == theirs[name].dtype and torch.equal(_bytes(p), _bytes(theirs[name])), name
    kinds = {quantized_stack(ours[n]).kind for n in floats}
    assert kinds == {d.experts.storage}


def test_a_chunked_quantization_is_the_whole_stacks() -> None:
    """_quantized cuts a large stack into chunks of experts (bitsandbytes' CPU temporaries);
    the bytes are those of one call over the stack."""
    from memtune.rank.experts import _quantized, _quantized_at_once

    torch.manual_seed(0)
    stack = torch.randn(6, 32, 64).bfloat16()
    for kind in ("nf4", "fp4", "int8"):
        chunked = _quantized(stack, kind, chunk_bytes=2 * 32 * 64 * 2)  # 2 experts a chunk
        once = _quantized_at_once(stack, kind)
        assert torch.equal(chunked[0], once[0]) and torch.equal(chunked[1], once[1]), kind


class _LiveHeap:
    """Bytes malloc has handed out and not taken back (glibc's mallinfo2: every torch CPU
    tensor, Python's large objects, bitsandbytes' buffers), sampled every 0.1 ms from a thread
    while the block runs; its peak less the value at the start. RSS would also count what
    glibc keeps of freed temporaries (more than the live bytes at this size) and the
    checkpoint's pages read through mmap (file-backed, reclaimable)."""

    def __init__(self) -> None:
        libc = ctypes.CDLL("libc.so.6")
        if not hasattr(libc, "mallinfo2"):
            pytest.skip("needs glibc's mallinfo2 (glibc >= 2.33)")

        class Info(ctypes.Structure):
            _fields_ = [
                (n, ctypes.c_size_t)
                for n in [
                    "arena",
                    "ordblks",
                    "smblks",
                    "hblks",
                    "hblkhd",
                    "usmblks",
                    "fsmblks",
                    "uordblks",
                    "fordblks",
                    "keepcost",
                ]
            ]

        libc.mallinfo2.restype = Info
        self.info = libc.mallinfo2
        self.peak = self.start = 0
        self.samples = 0

    def live(self) -> int:
        info = self.info()
        return int(info.uordblks + info.hblkhd)

    @contextlib.contextmanager
    def watch(self) -> Iterator[_LiveHeap]:
        gc.collect()
        self.start = self.peak = self.live()
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                self.peak = max(self.peak, self.live())
                self.samples += 1
                time.sleep(0.0001)

        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            done.set()
            thread.join()
            self.peak = max(self.peak, self.live())

    @property
    def added(self) -> int:
        return self.peak - self.start


def _file_backed_bytes(model: Any, folder: Path) -> int:
    """Bytes of ``model``'s parameters that are views of the checkpoint's mmap (weights read
    as stored, no copy: the embedding, norms, routers): host memory too, which malloc never
    sees."""
    maps = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split()
        if len(parts) > 5 and parts[5].startswith(str(folder)):
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            maps.append((lo, hi))
    return sum(
        p.numel() * p.element_size()
        for p in model.parameters()
        if any(lo <= p.data_ptr() < hi for lo, hi in maps)
    )


# Qwen3-30B-A3B's proportions at 1/8 of its width: experts 3/8 of the hidden width, 2 KV heads
# of 8 query heads' worth, every layer routing, experts ~93% of the weights; 16 layers (48 in
# the release) so that one stack is a few percent of the base, as there.
REAL_PROPORTIONS = dict(
    hidden_size=256,
    intermediate_size=768,
    moe_intermediate_size=96,
    num_hidden_layers=16,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    num_experts=16,
    num_experts_per_tok=2,
    vocab_size=1024,
    tie_word_embeddings=False,
)


def test_the_loading_peak_is_the_quantized_model_and_one_stack(tmp_path: Path) -> None:
    """QLoRA's load of a Qwen3-MoE checkpoint (each expert stored apart) on a CPU rank, through
    rank.model.load_base_model: the host's peak (live heap + the parameters left on the
    checkpoint's mmap) stays under the plan's loading peak, which is the whole base in bf16
    less ~40% here; the heap did hold the stacks' transients (not a quantized-only figure)."""
    from memtune.memory.counts import count_params
    from memtune.memory.estimate import GIB, plan
    from memtune.rank.model import load_base_model

    warm = _cfg("tiny-qwen3-moe", _save("qwen3_moe", MOE, tmp_path / "warm"), "qlora-nf4")
    load_base_model(warm, decided(warm, attention="sdpa"))  # imports, first-call set-up

    path = _save("qwen3_moe", REAL_PROPORTIONS, tmp_path / "base")
    arch = {"model_type": "qwen3_moe", **REAL_PROPORTIONS}
    cfg = _cfg(
        "tiny-qwen3-moe",
        path,
        "qlora-nf4",
        *(f"++model.architecture.{k}={json.dumps(v)}" for k, v in arch.items()),
    )
    d = decided(cfg, attention="sdpa")
    counts = count_params(cfg)
    planned = plan(cfg, d, counts)
    assert planned.loading is not None
    bf16 = counts.base * 2  # the whole base in the compute dtype
    stack = 16 * 2 * 96 * 256 * 2

    heap = _LiveHeap()
    with heap.watch():
        model = load_base_model(cfg, d)
    host = heap.added + _file_backed_bytes(model, path)
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    print(
        f"loading peak {host / MIB:.2f} MiB (heap {heap.added / MIB:.2f}, {heap.samples} "
        f"samples), planned {planned.loading.host_gib * GIB / MIB:.2f} MiB, quantized "
        f"{held / MIB:.2f} MiB, whole base in bf16 {bf16 / MIB:.2f} MiB"
    )
    assert planned.loading.host_gib * GIB <= 0.65 * bf16  # the margin the plan expects
    assert host <= planned.loading.host_gib * GIB * 1.1  # measured -2.5% .. +3.9% (2026-12-05)
    assert heap.added >= held - _file_backed_bytes(model, path) + 2 * stack


def test_a_quantized_mixture_is_validated_under_zero2_on_gpus() -> None:
    """No more refusal: a rank no longer loads the whole base in bf16 (the planner says
    whether the replicated quantized base fits)."""
    for method in ("qlora-nf4", "lora-int8"):
        cfg = to_run_config(
            compose_cfg(
                ["model=qwen3-30b-a3b", f"peft={method}", "zero=zero2", "plan.device_gib=24"]
            )
        )
        validate(cfg, inputs=False)


def test_a_bf16_mixture_split_under_zero3_is_read_on_the_host_and_sharded_onto_the_gpu() -> None:
    """Qwen3-30B-A3B in bf16 under ZeRO-3, its experts split over the 4 ranks: each rank reads
    the rest of the base and its 32 experts of each layer on the host, with the stack being
    read (2 + 1/4 of a 768 MiB gate_up stack), then converts the model to ZeRO-3 parameters
    one at a time before the engine (rank.expert_parallel.partition_before_the_engine): its
    GPU holds its share and the largest parameter, the embedding (151,936 × 2,048), at most.
    CPU ranks hold it all in the one memory."""
    from memtune.memory.estimate import GIB, plan

    args = ["experiment=qwen3-30b-a3b-4x4090-lora", "zero=zero3"]
    cfg = to_run_config(compose_cfg(args))
    d = decided(cfg)
    assert d.experts is not None and d.experts.parallel == 4
    result = plan(cfg, d)
    lo = result.loading
    assert lo is not None
    embedding = 151_936 * 2_048 * 2 / GIB
    assert lo.device_gib == pytest.approx(result.gib()["base weights"] + embedding, abs=1e-6)
    assert lo.host_gib == pytest.approx(18.06, abs=0.005)  # docs/moe.md: 18.1 GiB a rank
    assert "(1.69 GiB at most), on the host; on the device ZeRO-3's share" in lo.how
    cpu = to_run_config(compose_cfg([*args, "plan.device_gib=null"]))
    on_cpu = plan(cpu, decided(cpu)).loading
    assert on_cpu is not None and on_cpu.device_gib == on_cpu.host_gib == lo.host_gib


@pytest.mark.parametrize("zero", ["zero2", "zero3"])
def test_the_plan_states_the_loading_peak_of_a_quantized_mixture(zero: str) -> None:
    """Qwen3.5-35B-A3B QLoRA on 4 × 24 GB: one gate_up stack is 256 × 1,024 × 2,048 in bf16
    (1 GiB), held twice while the checkpoint's experts are merged (no CUDA temporaries for
    NF4). ZeRO-2 and ZeRO-3 alike read the quantized base whole onto each GPU (under ZeRO-3
    bitsandbytes' device map, before DeepSpeed shards it), the host holding one checkpoint
    tensor at a time. A bf16 base's plan states none."""
    from memtune.config import ConfigError
    from memtune.memory.estimate import plan
    from memtune.memory.fit import fit_to_device
    from memtune.memory.plan_text import format_plan

    # every expert on every rank (the shipped run splits them: trainer.expert_parallel=2)
    args = ["experiment=qwen3.5-35b-a3b-4x4090-qlora", f"zero={zero}", "trainer.expert_parallel=1"]
    cfg = to_run_config(compose_cfg(args))
    d = decided(cfg)
    result = plan(cfg, d)
    lo = result.loading
    assert lo is not None
    base = result.gib()["base weights"]
    if zero == "zero2":
        assert lo.device_gib == pytest.approx(base + 2.0, abs=1e-6)
    else:  # the base-weights row is a rank's quarter of it
        assert lo.device_gib == pytest.approx(base * 4 + 2.0, rel=0.01)
    assert lo.host_gib == pytest.approx(1.0)  # one checkpoint tensor: the stack, fused
    assert not lo.how.endswith("on the host")
    text = format_plan(cfg, d, result)
    assert "loading: device" in text
    # the experiment's plan.host_gib (120) over its 4 ranks, which all read at once
    assert result.loading_host_budget_gib == pytest.approx(30.0) and result.loading_fits_host
    assert "all reading at once): fits" in text
    if zero == "zero3":  # ~21.5 GiB a GPU while loading, ~20.5 GiB a step: a 21 GiB card
        small = to_run_config(compose_cfg([*args, "plan.device_gib=21"]))
        tight = plan(small, decided(small))
        assert tight.total_gib <= 21 < tight.loading.device_gib  # type: ignore[union-attr]
        assert not tight.device_fits and tight.loading_fits_host and not tight.fits
        assert "DOES NOT FIT while loading (-0.49 GiB; the step +" in format_plan(
            small, decided(small), tight
        )
        with pytest.raises(
            ConfigError, match=r"this run's loading needs 21\.49 GiB per rank"
        ) as err:
            fit_to_device(small)  # a launch: refused before any rank starts
        # what lowers the load: each rank reading half of the experts (not the step's cuts)
        tips = str(err.value).split("Try (each alone, per rank):\n")[1].split("\n(")[0]
        assert tips.splitlines() == [
            "  - trainer.expert_parallel=2 (each rank reads and keeps fewer experts): -3.24 GiB"
        ]
        # the long-context choices the step needs (none), not the smallest step's
        assert "long context (auto)" not in str(err.value)
    bf16 = to_run_config(compose_cfg(["experiment=qwen3-30b-a3b-4x4090-lora"]))
    assert plan(bf16, decided(bf16)).loading is None


def test_a_dense_quantized_base_under_zero3_is_read_whole_by_each_rank(tmp_path: Path) -> None:
    """QLoRA on a dense Qwen2 under ZeRO-3: transformers builds no quantized model under
    zero.Init, so a rank reads the whole NF4 base (plus the weight being quantized) before
    DeepSpeed shards it; the plan's loading line says so, measured on a CPU rank through
    rank.model.load_base_model (live heap + the parameters left on the checkpoint's mmap). On
    GPUs (plan.device_gib set) the whole base is on each card, the host reading one tensor at a
    time; under ZeRO-2 (the base kept whole anyway) no loading line."""
    from memtune.memory.counts import count_params
    from memtune.memory.estimate import GIB, base_weight_bytes, plan
    from memtune.rank.model import load_base_model

    # Qwen2.5-7B's proportions at 1/14 of its width: MLP 5.3× the hidden width, untied
    # embedding and head ~1/7 of the weights
    arch = dict(
        hidden_size=256,
        intermediate_size=1344,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=1,
        vocab_size=1536,
        tie_word_embeddings=False,
    )
    path = _save("qwen2", arch, tmp_path / "base")
    overrides = [f"++model.architecture.{k}={json.dumps(v)}" for k, v in arch.items()]
    cfg = _cfg("tiny-qwen2", path, "qlora-nf4", "zero=zero3", "launcher.num_ranks=4", *overrides)
    d = decided(cfg, attention="sdpa")
    counts = count_params(cfg)
    planned = plan(cfg, d, counts)
    lo = planned.loading
    assert lo is not None and lo.device_gib == lo.host_gib  # CPU ranks: one memory
    assert lo.device_gib > 3.5 * planned.gib()["base weights"]  # the whole base, not a 1/4
    assert "the whole nf4 base on each rank, read outside zero.Init" in lo.how

    load_base_model(cfg, d)  # imports, first-call set-up
    heap = _LiveHeap()
    with heap.watch():
        model = load_base_model(cfg, d)
    host = heap.added + _file_backed_bytes(model, path)
    print(f"loading peak {host / MIB:.2f} MiB, planned {lo.host_gib * GIB / MIB:.2f} MiB")
    assert 0.9 * lo.host_gib * GIB <= host <= 1.1 * lo.host_gib * GIB

    gpus = to_run_config(compose_cfg(["experiment=qwen2.5-7b-4x4090-qlora", "zero=zero3"]))
    on_gpus = plan(gpus, decided(gpus))
    assert on_gpus.loading is not None
    whole = base_weight_bytes(gpus, decided(gpus), on_gpus.counts, 1)[0] / GIB  # type: ignore[arg-type]
    gate = 18_944 * 3_584 * 2 / GIB  # the largest linear weight, in bf16
    assert on_gpus.loading.device_gib == pytest.approx(whole + gate)  # 5.29 GiB
    assert 3.5 * on_gpus.gib()["base weights"] < whole
    assert on_gpus.loading.host_gib == pytest.approx(152_064 * 3_584 * 2 / GIB)  # embedding
    zero2 = to_run_config(compose_cfg(["experiment=qwen2.5-7b-4x4090-qlora"]))
    assert plan(zero2, decided(zero2)).loading is None

    # A card that holds the step (~3.4 GiB at 256 tokens on 8 ranks) but not the load: refused
    # before any rank starts, and the one change that helps is a bf16 base (loaded sharded)
    from memtune.config import ConfigError
    from memtune.memory.fit import fit_to_device

    small = ["plan.device_gib=5.2", "data.max_seq_len=256", "launcher.num_ranks=8"]
    tight = to_run_config(compose_cfg(["experiment=qwen2.5-7b-4x4090-qlora", "zero=zero3", *small]))
    with pytest.raises(ConfigError) as err:
        fit_to_device(tight)
    said = str(err.value)
    assert "this run's loading needs 5.29 GiB per rank on the device" in said
    tips = said.split("Try (each alone, per rank):\n")[1].split("\n(")[0].splitlines()
    assert tips == ["  - peft=lora (a bf16 base loads already sharded under ZeRO-3): -0.61 GiB"]

    # Qwen3.5-27B QLoRA on 14 GiB cards: the step fits only with the sequence split and
    # the inputs offloaded, the 16.61 GiB load at no length. The long-context choices are
    # the fastest for the step (once the smallest step's: sp=4 at 244 s a step, not 170); no
    # single change helps, and the longest-sequence search says why it finds none.
    from memtune.memory.long_context_choice import format_longest_sequence

    big = ["experiment=qwen3.5-27b-4x4090-lora", "peft=qlora-nf4", "zero=zero3"]
    small27 = to_run_config(compose_cfg([*big, "plan.device_gib=14"]))
    with pytest.raises(ConfigError) as err:
        fit_to_device(small27)
    said = str(err.value)
    assert (
        "long context (auto): sequence_parallel=2 tiled_mlp=off offload_activations=on (the "
        "fastest for the step of 12 combinations; its loading does not fit)" in said
    )
    assert "this run's loading needs 16.61 GiB per rank" in said
    assert (
        "\nTry: no single change memtune knows lowers it by 0.05 GiB or more; it needs a "
        "device of 16.61 GiB per rank (plan.device_gib=14)\n"
    ) in said
    assert (
        "checkpoint_layers=auto: 63 of 64 layers (the fewest that fit 14.00 GiB with 2 GiB to "
        "spare; the step's, for its loading needs 16.61 GiB)"
    ) in said
    d27 = decided(small27, recompute=63)
    assert format_longest_sequence(small27, d27, plan(small27, d27).counts, CPU_RANKS).endswith(
        "none, at any length: this run's loading does not fit (its loading: line), and the "
        "length does not change it"
    )
