"""Trace one training step of an experiment's full-size model on fake tensors and compare it
with the memory plan (tools.step_trace):

    memtune trace experiment=qwen2.5-7b-4x4090-lora [data.max_seq_len=32768]

Takes the same overrides as train.py; ``checkpoint_layers=auto`` and ``plan.auto_fit`` are
decided as a launch would decide them.
"""

from __future__ import annotations

import argparse
import sys

from memtune.arguments import VerbParser
from memtune.config import compose
from memtune.config.decisions import RankMachine
from memtune.config.given import given_config
from memtune.memory.fit import fit_to_device
from memtune.tools.step_trace import format_trace, trace_step


def main(argv: list[str] | None = None) -> int:
    parser = VerbParser(
        prog="memtune trace",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "overrides", nargs="*", metavar="OVERRIDE", help="train.py's overrides: experiment=..."
    )
    overrides = parser.parse_args(argv).overrides
    # Validated as memtune plan validates: launcher.num_ranks=0 was a DecisionError traceback,
    # trainer.lr=-1 was traced as if it could run.
    given = given_config(compose(overrides), inputs=False)
    fitted = fit_to_device(given, refuse=False)
    cfg, d = fitted.cfg, fitted.decisions
    print(format_trace(cfg, d, trace_step(cfg, d)), flush=True)
    print(f"  note: {machine_note(fitted.machine)}", flush=True)
    return 0


def machine_note(machine: RankMachine) -> str:
    """The trace decides for the machine it runs on, as memtune plan does: a trace on a laptop
    is not what a launch on the GPU machine decides (kernels, and so the recomputed layers)."""
    if not machine.cuda:
        offers = "no CUDA GPU: no FlashAttention-2, no Liger kernels"
    else:
        have = {"FlashAttention-2": machine.flash_attn, "Liger": machine.liger}
        offers = "CUDA; " + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in have.items())
    return (
        f"decided for this machine ({offers}), as memtune plan decides: a launch on another "
        "machine may decide other kernels and recomputed layers"
    )


if __name__ == "__main__":
    sys.exit(main())
