"""``python -m memtune.preflight --gpus N``: the GPU preflight as the launcher starts it.

An alias of ``memtune preflight`` (:func:`memtune.launcher.preflight.main`) kept because
:func:`memtune.launcher.preflight.for_launch` runs the checks as this child process; people run
``memtune preflight``.
"""

from memtune.launcher.preflight import main

if __name__ == "__main__":
    main()
