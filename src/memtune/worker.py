"""``python -m memtune.worker RUN_DIR``: one rank, the command every launcher starts
(deepspeed, torchrun, srun). The rank's code is :mod:`memtune.rank.worker`.

The top level of the package holds the commands users run and what every process shares;
this module only starts the command.
"""

from memtune.rank.worker import main

if __name__ == "__main__":
    main()
