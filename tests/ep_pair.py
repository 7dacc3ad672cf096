"""A rank entry point for tests: two whole runs in one start of the ranks — the run dir named by
``$MEMTUNE_TEST_FIRST_RUN``, then RUN_DIR — each ``memtune.rank.worker.run`` from build to
export, the process group kept between them (the first run's teardown skips destroying it).
What two launches give, without starting the ranks twice (the interpreters, their imports,
gloo's rendezvous): tests/test_expert_parallel_matrix.py compares a run at
trainer.expert_parallel=2 with the same run at 1 this way.

Started by the real launcher (``launch(..., module="ep_pair")``) with tests/ on PYTHONPATH.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch.distributed as dist

from memtune.rank.worker import leave, run
from memtune.rundir import RunDir


def main() -> None:
    destroy = dist.destroy_process_group
    dist.destroy_process_group = lambda *args, **kwargs: None  # kept for the second run
    try:
        run(RunDir(Path(os.environ["MEMTUNE_TEST_FIRST_RUN"])))
    finally:
        dist.destroy_process_group = destroy
    run(RunDir(Path(sys.argv[1])))
    leave(0)


if __name__ == "__main__":
    main()
