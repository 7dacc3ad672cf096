"""DeepSpeed's launcher (``deepspeed ARGS``) as ``python -m memtune.launcher.ds_runner ARGS``.

The same ``deepspeed.launcher.runner.main`` the ``deepspeed`` script calls, in a process that
imported memtune first, so the filters of :mod:`memtune.quiet` apply to it. The hostfile form
starts here (it reads the hostfile and reaches the nodes over ssh); one node, and each node of
the per-node form, start their ranks themselves (launcher/spawn.py).

Over ssh the ranks get only the variables DeepSpeed's runner exports (names starting with
NCCL, PYTHON, UCX, …, and a ``.deepspeed_env`` file's): the names the job lists in
``$MEMTUNE_EXPORT`` (spawn.node_exports: the threads, memtune's and the user's settings, the
launcher to watch) are added to them.
"""

from __future__ import annotations

import os
from typing import Any

from deepspeed.launcher import multinode_runner, runner

import memtune  # noqa: F401  (installs memtune.quiet's filters)
from memtune.launcher.spawn import EXPORT_ENV


def pass_the_log_level() -> None:
    """DeepSpeed's runner gives each node's launcher ``--log_level`` without ssh, but not over
    pdsh: there every node's launcher logged its world, ranks and commands at INFO (seven lines
    a node, every run). Its pdsh command gets the level too (the job runs ``--log_level
    warning``), before the rank module's name; a command of another shape is left as it is."""
    runner_cls = multinode_runner.PDSHRunner
    original = runner_cls.get_cmd

    def get_cmd(self: Any, environment: Any, active_resources: Any) -> Any:
        cmd, kill_cmd, env = original(self, environment, active_resources)
        if self.user_script in cmd:
            cmd.insert(cmd.index(self.user_script), f"--log_level={self.args.log_level}")
        return cmd, kill_cmd, env

    runner_cls.get_cmd = get_cmd


def export_also(names: str) -> None:
    """Add comma-separated variable names to what DeepSpeed's runner exports to the nodes (it
    exports a variable whose name starts with one of ``runner.EXPORT_ENVS``)."""
    runner.EXPORT_ENVS.extend(n for n in names.split(",") if n and n not in runner.EXPORT_ENVS)


if __name__ == "__main__":
    export_also(os.environ.get(EXPORT_ENV, ""))
    pass_the_log_level()
    runner.main()
