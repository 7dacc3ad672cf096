"""memtune's entry point: compose the config, lay out the run dir, start the ranks.

    python train.py                                  # the CPU demo (experiment=demo-cpu)
    python train.py experiment=qwen2.5-7b-4x4090-lora data=alpaca data.path=my.jsonl
    python train.py -m peft.r=4,8                    # a sweep: one run dir per point
    python train.py experiment=qwen2.5-7b-4x4090-lora plan_only=true   # memory plan only

This runs once per run (never once per rank); the ranks are `python -m memtune.worker RUN_DIR`.
What a job does is memtune.launcher.job.run_job; this file is Hydra's entry point.
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from memtune.config import register_configs
from memtune.config.command_line import composition_problem
from memtune.config.schema import open_mappings, unknown_override
from memtune.detached import outlive_the_terminal
from memtune.exit_codes import EXIT_CONFIG
from memtune.launcher.job import missing_slurm, run_job
from memtune.launcher.sweep_report import points_failed

register_configs()


def main() -> int:
    """Hydra runs the job, or every point of a sweep; a single run exits with its own code, a
    sweep with 1 when a point failed (their lines above say why). A Slurm sweep's points run in
    their own jobs, each ending with its point's code: the sweep's report, written here at
    the end, counts the failed ones."""
    failed: list[int] = []

    @hydra.main(version_base="1.3", config_path="conf", config_name="config")
    def job(cfg: DictConfig) -> int:
        if code := run_job(cfg):
            failed.append(code)
        return code  # a submitit job's result: the point's code (SweepReport.on_job_end)

    job()
    return 1 if failed or points_failed() else 0


if __name__ == "__main__":
    # A closed terminal or pipe makes this job's lines go nowhere, not its end fail (EIO).
    outlive_the_terminal()
    argv = sys.argv[1:]
    if problem := unknown_override(argv) or missing_slurm(argv) or composition_problem(argv):
        print(f"memtune: config error: {problem}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)
    sys.argv[1:] = open_mappings(argv)
    sys.exit(main())
