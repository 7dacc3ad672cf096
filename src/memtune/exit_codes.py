"""Exit codes shared by the ranks and the job (train.py, the Slurm script).

A module of its own so the job side reads them without importing the rank side.
"""

EXIT_ERROR = 1
"""An exception memtune does not catch (Python's own code for one): a single run ends with its
traceback; a sweep point with its traceback and a failed row, and the sweep goes on."""
EXIT_CONFIG = 2
"""A config, plan or preflight error: nothing was started."""
EXIT_NON_FINITE = 3
"""A rank (and so train.py) stopped by a non-finite loss."""
EXIT_OOM = 4
"""A rank ran out of memory (CUDA OOM, or a failed host allocation); RUN_DIR/oom-rankN.json
says where. With plan.auto_fit the job restarts once from the last checkpoint."""
EXIT_PEER_LOST = 5
"""A rank whose peer went away mid-collective (another rank's failure is the cause)."""
EXIT_REQUEUE = 75
"""After SIGTERM / SIGUSR2: a checkpoint was saved; run again (or requeue) to go on. 75 is
EX_TEMPFAIL, which launch/slurm/train.sbatch requeues."""
EXIT_INTERRUPTED = 130
"""A second Ctrl-C ended the ranks at once (128 + SIGINT, the shell's code for it); the last
saved checkpoint is where the same command continues. The first Ctrl-C stops like SIGTERM."""
