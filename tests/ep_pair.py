"""A rank entry point for tests: two whole runs in one start of the ranks — the run dir named by
``$MEMTUNE_TEST_FIRST_RUN``, then RUN_DIR — each ``memtune.rank.worker.run`` from build to
export, the process group kept between them (the first run's teardown skips destroying it).
What two launches give, without starting the ranks twice (the interpreters, their imports,
gloo's rendezvous): tests/test_expert_parallel_matrix.py compares a run at
trainer.expert_parallel=2 with the same run at 1 this way.

Started by the real launcher (``launch(..., module="ep_pair")``) with tests/ on PYTHONPATH.
After each run's training every rank records its routed-expert stacks as it holds them
(``stacks_rank{r}.json`` in the run dir): how each is stored (memtune's quantized_stack), its
dtype and the bytes this rank holds of it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist

from memtune.expert_stacks import full_shape, quantized_stack
from memtune.rank.worker import RankContext, leave, run
from memtune.rundir import RunDir


def record_stacks(engine: Any, ctx: RankContext) -> None:
    """This rank's routed-expert stacks (parameters named .mlp.experts., not the adapters):
    kind (nf4 / fp4 / int8, None in the compute dtype), the stack's shape as this rank's
    experts, dtype, and the bytes this rank holds (its ZeRO-3 partition, or the whole)."""
    stacks = {}
    for name, p in engine.module.model.named_parameters():
        if ".mlp.experts." not in name or "lora_" in name:
            continue
        quantized = quantized_stack(p)
        data = p.ds_tensor if hasattr(p, "ds_id") else p
        stacks[name] = {
            "kind": quantized.kind if quantized is not None else None,
            "shape": list(full_shape(p)),
            "dtype": str(p.dtype).removeprefix("torch."),
            "held_bytes": data.numel() * data.element_size(),
        }
    (ctx.rd.path / f"stacks_rank{ctx.rank}.json").write_text(json.dumps(stacks, indent=1))


def main() -> None:
    destroy = dist.destroy_process_group
    dist.destroy_process_group = lambda *args, **kwargs: None  # kept for the second run
    try:
        run(RunDir(Path(os.environ["MEMTUNE_TEST_FIRST_RUN"])), after_train=record_stacks)
    finally:
        dist.destroy_process_group = destroy
    run(RunDir(Path(sys.argv[1])), after_train=record_stacks)
    leave(0)


if __name__ == "__main__":
    main()
