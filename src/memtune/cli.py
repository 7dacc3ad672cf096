"""``memtune report | merge | generate``: the commands around a training run."""

from __future__ import annotations

import sys

COMMANDS = {
    "report": "memtune.launcher.sweep_report",
    "merge": "memtune.tools.merge",
    "generate": "memtune.tools.generate",
}


def main(argv: list[str] | None = None) -> None:
    import importlib

    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] not in COMMANDS:
        names = " | ".join(COMMANDS)
        raise SystemExit(f"usage: memtune {{{names}}} ...   (training: python train.py ...)")
    importlib.import_module(COMMANDS[args[0]]).main(args[1:])


if __name__ == "__main__":
    main()
