"""``python -m memtune.preflight --gpus N``: the GPU preflight on its own
(:mod:`memtune.launcher.preflight`; train.py runs it before a GPU launch).

The top level of the package holds the commands users run and what every process shares;
this module only starts the command.
"""

from memtune.launcher.preflight import main

if __name__ == "__main__":
    main()
