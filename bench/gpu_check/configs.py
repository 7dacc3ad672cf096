"""memtune's RunConfig for a phase (composition) and the planner's records of it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .modes import CAP_GIB, Mode

METHODS = {
    "lora": ("qwen2.5-7b-4x4090-lora", "lora-all-linear"),
    "qlora": ("qwen2.5-7b-4x4090-qlora", "qlora-nf4"),
    "qwen35": ("qwen3.5-9b-4x4090-lora", "lora"),  # the Qwen3.5 phases: that experiment's LoRA
    # DPO with the lora phase's adapters, so its rows compare with SFT's at the same shapes
    "dpo": ("qwen2.5-7b-4x4090-dpo", "lora-all-linear"),
    # the whole-mixture phases: Qwen3-30B-A3B's experiment, QLoRA, on one card (mixture.py)
    "mixture": ("qwen3-30b-a3b-4x4090-lora", "qlora-nf4"),
}
QWEN25 = ("lora", "qlora", "dpo")
"""The methods of the Qwen2.5 experiments (dense, full attention: selective layers are built)."""


def compose_cfg(
    mode: Mode, method: str, seq_len: int, extra: Sequence[str] = (), model: str | None = None
) -> Any:
    """memtune's RunConfig: the 4×4090 experiment of this method, on one rank, micro batch 1,
    global batch 1 (no accumulation), planned for a 24 GB card, never refused; ``model``:
    another model group than the mode's."""
    from memtune.config import compose, to_run_config

    experiment, peft = METHODS[method]
    overrides = [
        f"experiment={experiment}",
        f"model={model or mode.model}",
        f"peft={peft}",
        "launcher.num_ranks=1",
        "trainer.global_batch_size=1",
        f"data.max_seq_len={seq_len}",
        "logger=none",
        f"plan.device_gib={CAP_GIB}",
        "plan.enforce=false",
        *(mode.qwen25_overrides if method in QWEN25 else ()),  # a phase's own win over them
        *extra,
        *mode.overrides,
    ]
    return to_run_config(compose(overrides))


def decided_at(cfg: Any, seq_len: int, counts: Any) -> tuple[Any, Any]:
    """``cfg`` at another sequence length, and its decisions as a launch makes them
    (memory.fit), with the long-context choices the settings leave to auto kept off: one card,
    sp=1, the MLP untiled, the inputs on the device (the long phases set all three)."""
    from memtune.config.decisions import Choices, rank_machine, with_sections
    from memtune.memory.recompute import resolve_checkpoint_layers

    at = with_sections(cfg, data={"max_seq_len": seq_len})
    t = at.trainer
    one_card = Choices(
        sequence_parallel=1 if str(t.sequence_parallel) == "auto" else None,
        tiled_mlp=False if t.tiled_mlp == "auto" else None,
        offload_activations=False if t.offload_activations == "auto" else None,
    )
    d, _ = resolve_checkpoint_layers(at, one_card, counts, rank_machine())
    return at, d


def plan_record(cfg: Any, d: Any, counts: Any) -> dict[str, Any]:
    """The planner's rows; ``live_gib`` leaves out what torch's allocator never reports
    (fragmentation, the CUDA context), so it is what ``max_memory_allocated`` should read."""
    from memtune.memory.estimate import plan

    p = plan(cfg, d, counts)
    return {
        "total_gib": p.total_gib,
        "live_gib": sum(r.gib for r in p.rows if r.allocated and r.live),
        "fits": p.fits,
        "rows": [{"what": r.what, "gib": r.gib, "how": r.how} for r in p.rows],
        "host_gib": p.host_total_gib,  # offloaded inputs (rank.long_context's host buffers)
    }


def baseline_plan(cfg: Any, d: Any, counts: Any) -> dict[str, Any]:
    """The planner's nearest decisions to the baseline (it knows no run without DeepSpeed):
    ZeRO-2 on one rank, every layer checkpointed, the plain loss. Approximate by design."""
    import dataclasses

    layers = len(d.checkpointing.layers)
    nearest = dataclasses.replace(d, zero_stage=2, loss="plain").with_recompute(layers)
    return plan_record(cfg, nearest, counts)
