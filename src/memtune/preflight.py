"""Check the GPUs before a multi-GPU launch: ``python -m memtune.preflight --gpus 4``.

Prints what it finds (names, memory, driver) and stops with exit code 2 when fewer GPUs are
visible than the job needs, before any rank starts or any model is read.
"""

from __future__ import annotations

import argparse
import sys

GIB = 1024**3


def check(required: int) -> list[str]:
    """Lines describing the visible GPUs; raises SystemExit(2) if there are too few."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < required:
        hint = (
            "this machine has no usable CUDA GPU (or torch is a CPU build); "
            "`make train` runs the CPU demo"
            if count == 0
            else "set CUDA_VISIBLE_DEVICES or launcher.num_ranks to what is there"
        )
        print(
            f"memtune: preflight: {required} GPUs needed, {count} visible: {hint}", file=sys.stderr
        )
        raise SystemExit(2)
    lines = [f"memtune: preflight: {count} GPU(s) visible, using {required}"]
    for i in range(required):
        p = torch.cuda.get_device_properties(i)
        lines.append(
            f"  cuda:{i} {p.name} · {p.total_memory / GIB:.1f} GiB · sm_{p.major}{p.minor}"
        )
    lines.append(f"  torch {torch.__version__} · CUDA {torch.version.cuda}")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m memtune.preflight", description=__doc__)
    parser.add_argument("--gpus", type=int, required=True)
    args = parser.parse_args(argv)
    print("\n".join(check(args.gpus)))


if __name__ == "__main__":
    main()
