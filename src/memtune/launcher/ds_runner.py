"""DeepSpeed's launcher (``deepspeed ARGS``) as ``python -m memtune.launcher.ds_runner ARGS``.

The same ``deepspeed.launcher.runner.main`` the ``deepspeed`` script calls, in a process that
imported memtune first, so the filters of :mod:`memtune.quiet` apply to it. Jobs over several
nodes start here (it reads the hostfile and, for the hostfile form, reaches the other nodes over
ssh); a one-node job starts DeepSpeed's per-node launcher directly (launcher/spawn.py).
"""

from __future__ import annotations

from deepspeed.launcher.runner import main

import memtune  # noqa: F401  (installs memtune.quiet's filters)

if __name__ == "__main__":
    main()
