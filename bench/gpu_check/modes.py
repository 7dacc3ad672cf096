"""What differs between the GPU check and its CPU dry run (:class:`Mode`), and the constants
every phase reads: the device's rates, the 24 GB card, the long-context overrides, the MoE
block's shape."""

from __future__ import annotations

import os
from dataclasses import dataclass

GIB = 1024**3
PEAK_TFLOPS = 989.0
"""H100 and H200 SXM dense bf16 by the datasheet (the two kinds this workplace lends)."""
MEASURED_TFLOPS = 790.0
"""An 8192³ bf16 matmul through PyTorch on random data on this workplace's H200 (KINDS.md;
the H100 gave 798): ``of_measured_ceiling``'s yardstick. Each run also measures its own card
(``env.matmul_tflops``)."""
CAP_GIB = 23.99
"""A 24 GB card: RTX 4090D's 24,564 MiB, what the 4×4090 experiments plan against."""


@dataclass(frozen=True)
class Mode:
    """What differs between the GPU check and its CPU dry run."""

    dry_run: bool
    model: str
    lengths: tuple[int, ...]
    search: tuple[int, ...]
    warmup: int
    timed: int
    overrides: tuple[str, ...] = ()
    qwen25_overrides: tuple[str, ...] = ()  # ... and the Qwen2.5 phases' own (configs.QWEN25)
    fake_oom_above: int | None = None
    budget_s: float = 420.0
    long_lengths: tuple[int, ...] = ()  # long-context phases: timed lengths
    long_search: tuple[int, ...] = ()  # ... and the lengths tried under the cap, ascending
    long_search_lora: tuple[int, ...] = ()  # ... for LoRA on a bf16 base, if not those
    hybrid_model: str = "tiny-qwen3.5"  # the Qwen3.5 phases: a hybrid model ...
    hybrid_len: int = 256  # ... trained on packed rows of this many tokens
    moe_tokens: int = 256  # the MoE block phase: tokens a step (Qwen3-30B-A3B's width on a GPU)
    mixture_model: str = "tiny-qwen3-moe"  # the whole-mixture phases (mixture.py): the model
    mixture_lengths: tuple[int, ...] = (64, 128)  # ... its rows, the shorter first
    mixture_load_layers: int = 2  # mixture-load: the decoder layers of the checkpoint it writes


GPU = Mode(
    dry_run=False,
    model="qwen2.5-7b",
    lengths=(4096, 2048),
    search=(8192, 12288, 16384, 20480, 24576, 28672, 32768),
    warmup=2,
    timed=3,
    long_lengths=(32768,),
    # from 96k (issue #47's target): 65,536 was measured with transformers' RMSNorm
    # (2026-12-04); the lean one plans 135,168, and a step there takes about a minute
    long_search=(98304, 114688, 131072),
    # a bf16 base: 32,768 fitted and 49,152 did not with transformers' RMSNorm (2026-12-04);
    # the lean kernels plan 45,056
    long_search_lora=(40960, 49152, 57344),
    hybrid_model="qwen3.5-2b",
    hybrid_len=4096,
    moe_tokens=4096,
    mixture_model="qwen3-30b-a3b",
    mixture_lengths=(2048, 4096),
    mixture_load_layers=12,  # of 48: 15.6 GB of bf16 shards, on the lent machine's 64 GiB disk
)


def lengths_from_env(mode: Mode) -> Mode:
    """``GPU_CHECK_LONG_TIMED`` / ``GPU_CHECK_LONG_SEARCH`` (comma-separated token counts, may
    be empty) replace the long phases' lengths: a short rerun for the census, say
    ``GPU_CHECK_LONG_TIMED= GPU_CHECK_LONG_SEARCH=49152``. Read in every phase's process."""
    import dataclasses

    def read(name: str) -> tuple[int, ...] | None:
        value = os.environ.get(name)
        return None if value is None else tuple(int(v) for v in value.split(",") if v.strip())

    timed, search = read("GPU_CHECK_LONG_TIMED"), read("GPU_CHECK_LONG_SEARCH")
    if timed is not None:
        mode = dataclasses.replace(mode, long_lengths=timed)
    if search is not None:
        mode = dataclasses.replace(mode, long_search=search, long_search_lora=search)
    return mode


def long_search_of(mode: Mode, method: str) -> tuple[int, ...]:
    """The lengths a long phase of ``method`` tries under the cap, ascending."""
    return mode.long_search_lora if method == "lora" and mode.long_search_lora else mode.long_search


# The tiny model has 2 layers: the first recomputed in full and, in the Qwen2.5 phases, the
# second selectively, as the 24 GB plans choose on the GPU (docs/memory.md) and the CPU's
# roomy plan would not: with 0 selective layers the dry run never ran the GPU rows' path (the
# profile phase's labels stopped a selective layer's recompute). The search raises a simulated
# OOM above 256 tokens, so the OOM path runs too.
DRY = Mode(
    dry_run=True,
    model="tiny-qwen2",
    lengths=(128, 64),
    search=(128, 256, 512),
    warmup=1,
    timed=2,
    overrides=("trainer.checkpoint_layers=1",),
    qwen25_overrides=("trainer.selective_layers=1",),
    fake_oom_above=256,
    budget_s=900.0,
    long_lengths=(256,),
    long_search=(384, 512),
)
# The long-context phases: one GPU (sp=1), every layer recomputed from an offloaded input,
# the MLP tiled (README "Long context"), planned for the same 24 GB card.
LONG_OVERRIDES = (
    "trainer.sequence_parallel=1",
    "trainer.tiled_mlp=on",
    "trainer.offload_activations=on",
    "trainer.checkpoint_layers=all",
    "trainer.selective_layers=0",  # not built with a tiled MLP or offloaded inputs
)

MOE_SHAPE = dict(
    hidden_size=2048,
    moe_intermediate_size=768,
    num_experts=128,
    num_experts_per_tok=8,
)
"""Qwen3-30B-A3B's sparse block at its full width (conf/model/qwen3-30b-a3b.yaml); the dry run
takes bench/moe_bench.py's reduced SHAPE (half the width, 64 experts), which a CPU can step."""
