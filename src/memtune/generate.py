"""``python -m memtune.generate RUN_DIR PROMPT``: answer with a trained adapter
(:mod:`memtune.tools.generate`).

The top level of the package holds the commands users run and what every process shares;
this module only starts the command.
"""

from memtune.tools.generate import main

if __name__ == "__main__":
    main()
