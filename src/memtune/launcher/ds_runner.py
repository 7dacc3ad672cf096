"""DeepSpeed's launcher (``deepspeed ARGS``) as ``python -m memtune.launcher.ds_runner ARGS``.

The same ``deepspeed.launcher.runner.main`` the ``deepspeed`` script calls, in a process that
imported memtune first, so the filters of :mod:`memtune.quiet` apply to it. Jobs over several
nodes start here (it reads the hostfile and, for the hostfile form, reaches the other nodes over
ssh); a one-node job starts DeepSpeed's per-node launcher directly (launcher/spawn.py).

Over ssh the ranks get only the variables DeepSpeed's runner exports (names starting with
NCCL, PYTHON, UCX, …, and a ``.deepspeed_env`` file's): the names the job lists in
``$MEMTUNE_EXPORT`` (spawn.node_exports: the threads, memtune's and the user's settings, the
launcher to watch) are added to them.
"""

from __future__ import annotations

import os

from deepspeed.launcher import runner

import memtune  # noqa: F401  (installs memtune.quiet's filters)
from memtune.launcher.spawn import EXPORT_ENV


def export_also(names: str) -> None:
    """Add comma-separated variable names to what DeepSpeed's runner exports to the nodes (it
    exports a variable whose name starts with one of ``runner.EXPORT_ENVS``)."""
    runner.EXPORT_ENVS.extend(n for n in names.split(",") if n and n not in runner.EXPORT_ENVS)


if __name__ == "__main__":
    export_also(os.environ.get(EXPORT_ENV, ""))
    runner.main()
