"""The ``memtune VERB`` command lines: a parser whose refusals are one line, and the number types
the verbs take.

argparse answers a bad argument with its usage (several lines for a verb with many options)
and then ``memtune VERB: error: ...``; memtune's verbs refuse bad input on one line,
``memtune VERB: ...``, with exit code 2 (memtune.cli). :class:`VerbParser` says argparse's
refusals that way. ``--help`` is unchanged. Imports nothing heavy: ``memtune --help`` answers at
once.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from memtune.exit_codes import EXIT_CONFIG


class VerbParser(argparse.ArgumentParser):
    """An ArgumentParser for one verb (``prog="memtune VERB"``): a bad or missing argument is one
    line, ``memtune VERB: MESSAGE; see memtune VERB --help``, and exit code 2."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: {' '.join(message.split())}; see {self.prog} --help", file=sys.stderr)
        sys.exit(EXIT_CONFIG)


def positive_int(text: str) -> int:
    """An argparse type: a whole number > 0 (``--gpus 4``, ``--max-new-tokens 64``)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a whole number > 0 (got {value})")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a number > 0 (``--timeout 120``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:  # nan too
        raise argparse.ArgumentTypeError(f"must be a number > 0 (got {text})")
    return value
