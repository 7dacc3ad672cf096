"""``python -m memtune.worker RUN_DIR``: one rank, the command every launcher starts
(deepspeed, torchrun, srun). The rank's code is :mod:`memtune.rank.worker`.

The top level of the package holds the commands users run and what every process shares;
this module only starts the command.
"""

import signal

if __name__ == "__main__":
    # First thing, before torch and DeepSpeed load (seconds): SIGTERM and SIGUSR2 are ignored
    # until rank.worker.catch_stop_signals makes them a stop at the next step boundary. Slurm
    # sends TERM to every process of a step; a rank still importing died of it (exit 143)
    # where the job promises a checkpoint and 75.
    # train.py on the node, which got it too, re-sends SIGUSR2 to its ranks until they stop.
    for stop in (signal.SIGTERM, signal.SIGUSR2):
        signal.signal(stop, signal.SIG_IGN)

    from memtune.rank.worker import main

    main()
