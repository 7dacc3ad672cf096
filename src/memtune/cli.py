"""``memtune VERB``: every command a person runs around a training run.

    memtune plan experiment=qwen2.5-7b-4x4090-lora   # per-rank memory plan; launches nothing
    memtune report multirun/DATE/TIME-EXP            # rebuild a sweep's report
    memtune merge RUN_DIR/adapter OUT                # merge an adapter into its base
    memtune generate RUN_DIR "prompt"                # answer with a trained adapter
    memtune preflight --gpus 4                       # the GPU checks on their own
    memtune trace experiment=...                     # one full-size step on fake tensors
    memtune machine                                  # CPU, kernel-switching flags, versions

Training itself is ``python train.py`` (Hydra's entry point) and a rank is
``python -m memtune.worker RUN_DIR`` (what the launchers start). ``memtune VERB --help`` gives a
verb's arguments. Bad input (a missing dir, an OUT that already exists) ends in one line
``memtune VERB: ...`` on stderr and exit code 2 (memtune.exit_codes.EXIT_CONFIG).

This module imports nothing heavy, so ``memtune --help`` answers at once: each verb imports
what it runs when it runs.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from memtune.arguments import VerbParser
from memtune.exit_codes import EXIT_CONFIG

Verb = Callable[[list[str]], int | None]


def _plan(argv: list[str]) -> int:
    """What ``train.py ... plan_only=true`` prints, without Hydra's main (no run dir made)."""
    parser = VerbParser(
        prog="memtune plan",
        description="The per-rank memory plan of a config, with what a launch would decide "
        "(checkpoint_layers=auto, plan.auto_fit); writes nothing, launches nothing.",
    )
    parser.add_argument(
        "overrides", nargs="*", metavar="OVERRIDE", help="train.py's overrides: experiment=..."
    )
    args = parser.parse_args(argv)
    # Inside the verb: Hydra's compose and the planner are not needed for the other verbs.
    from memtune.config import compose
    from memtune.launcher.job import print_plan
    from memtune.launcher.topology import size_from_allocation

    cfg = compose(args.overrides)
    sized = size_from_allocation(cfg.launcher, args.overrides, launching=False)
    if sized:
        print(
            f"memtune: Slurm job {os.environ.get('SLURM_JOB_ID')}: {' '.join(sized)}, sized "
            "from its allocation (launcher.from_allocation)",
            flush=True,
        )
    return print_plan(cfg)


def _report(argv: list[str]) -> None:
    # Inside the verb: the report loads yaml, and matplotlib for its plot.
    from memtune.launcher.sweep_report import main

    main(argv)


def _merge(argv: list[str]) -> None:
    # Inside the verb: merging imports torch, transformers and peft (seconds).
    from memtune.tools.merge import main

    main(argv)


def _generate(argv: list[str]) -> None:
    # Inside the verb: generating imports torch, transformers and peft (seconds).
    from memtune.tools.generate import main

    main(argv)


def _preflight(argv: list[str]) -> None:
    # Inside the verb: the GPU checks import torch and start CUDA.
    from memtune.launcher.preflight import main

    main(argv)


def _trace(argv: list[str]) -> int:
    # Inside the verb: the trace imports torch (fake tensors) and Hydra's compose.
    from memtune.tools.trace import main

    return main(argv)


def _machine(argv: list[str]) -> None:
    # Inside the verb, as every verb's module: `memtune --help` imports none of them.
    from memtune.machine import main

    main(argv)


VERBS: dict[str, tuple[Verb, str]] = {
    "plan": (_plan, "per-rank memory plan (train.py's overrides); launches nothing"),
    "report": (_report, "rebuild a sweep's report (md, csv, loss plot) from its dir"),
    "merge": (_merge, "merge a LoRA adapter into its base model, into a new dir"),
    "generate": (_generate, "answer a prompt with a trained adapter or a merged model"),
    "preflight": (_preflight, "check this node's GPUs and NCCL (what train.py runs first)"),
    "trace": (_trace, "one full-size training step on fake tensors, against the plan"),
    "machine": (_machine, "this machine: CPU, kernel-switching flags, library versions"),
}


class _Help(argparse.HelpFormatter):
    """One column for the verbs' help: argparse measures the verbs without their indent, which
    put the longest (preflight) on a line of its own."""

    def add_argument(self, action: argparse.Action) -> None:
        super().add_argument(action)
        if isinstance(action, argparse._SubParsersAction):
            names = [len(name) for name in action.choices]
            self._action_max_length = max(
                self._action_max_length, max(names) + self._current_indent + 2
            )


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="memtune",
        formatter_class=_Help,
        description="The commands around a training run (training: python train.py ...).",
        epilog="memtune VERB --help: that verb's arguments. Exit code 2: bad input, nothing done.",
    )
    verbs = top.add_subparsers(dest="verb", metavar="VERB", required=True)
    for name, (_, summary) in VERBS.items():
        verbs.add_parser(name, help=summary, add_help=False)
    return top


def run(verb: str, argv: list[str]) -> int:
    """One verb; bad input (a config error, a missing or existing path) ends in one line."""
    # Inside run: `memtune --help` needs neither Hydra nor OmegaConf.
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from memtune.config import ConfigError
    from memtune.config.command_line import one_line
    from memtune.machine import name_cpu_accelerator

    name_cpu_accelerator()  # a verb that loads peft loads DeepSpeed: no accelerator warning
    try:
        return VERBS[verb][0](argv) or 0
    except (ConfigError, HydraException, OmegaConfBaseException) as err:
        print(f"memtune {verb}: {one_line(err)}", file=sys.stderr)
        return EXIT_CONFIG


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if args and args[0] in VERBS:
        # The verb parses its own arguments (argparse would not pass options through).
        return run(args[0], args[1:])
    # -h / --help: usage, exit 0; no verb or an unknown one: usage on stderr, exit 2.
    known, rest = parser().parse_known_args(args)
    return run(known.verb, rest)


if __name__ == "__main__":
    sys.exit(main())
