"""``python -m memtune.merge ADAPTER OUT``: merge an adapter into its base
(:mod:`memtune.tools.merge`).

The top level of the package holds the commands users run and what every process shares;
this module only starts the command.
"""

from memtune.tools.merge import main

if __name__ == "__main__":
    main()
