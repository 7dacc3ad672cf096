"""DeepSpeed's launcher (``deepspeed ARGS``) as ``python -m memtune.launcher.ds_runner ARGS``.

The same ``deepspeed.launcher.runner.main`` the ``deepspeed`` script calls, in a process that
imported memtune first, so the filters of :mod:`memtune.quiet` apply to it: a local launch then
starts without DeepSpeed's notice that /job/hostfile does not exist.
"""

from __future__ import annotations

from deepspeed.launcher.runner import main

import memtune  # noqa: F401  (installs memtune.quiet's filters)

if __name__ == "__main__":
    main()
