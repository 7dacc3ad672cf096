"""Repack a wheel without some of its files, for the GPU check's carried wheels (a device call
carries 64 MiB in all): ``RECORD`` rewritten without them, and every kept file checked against
its ``RECORD`` hash afterwards, so pip installs the result as it would the original.

    python bench/wheel_repack.py WHEEL REGEX [REGEX ...]    # drop the paths a REGEX matches

Used by ``bench/gpu_wheels.sh`` (bitsandbytes without the CUDA libraries torch 2.11+cu130 does
not load) and ``bench/gpu_wheels_unsloth.sh`` (Unsloth without its web UI and its CLI). The
wheel is rewritten through a temporary file renamed over it; the files it dropped are printed.
"""

from __future__ import annotations

import base64
import hashlib
import re
import sys
import zipfile
from pathlib import Path


def repack(wheel: Path, drop: list[str]) -> list[str]:
    """Rewrite ``wheel`` without the paths a pattern of ``drop`` matches (``re.search``);
    returns them. A dropped path must not be the RECORD or the METADATA."""
    patterns = [re.compile(p) for p in drop]
    tmp = wheel.with_name(f".{wheel.name}.tmp")
    with zipfile.ZipFile(wheel) as src:
        names = [i.filename for i in src.infolist()]
        dropped = {n for n in names if any(p.search(n) for p in patterns)}
        kept_meta = [n for n in names if n.endswith((".dist-info/RECORD", ".dist-info/METADATA"))]
        if dropped & set(kept_meta):
            raise SystemExit(f"{wheel.name}: will not drop {sorted(dropped & set(kept_meta))}")
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as out:
            for info in src.infolist():
                if info.filename in dropped:
                    continue
                data = src.read(info.filename)
                if info.filename.endswith(".dist-info/RECORD"):
                    lines = [
                        ln for ln in data.decode().splitlines() if ln.split(",")[0] not in dropped
                    ]
                    data = ("\n".join(lines) + "\n").encode()
                out.writestr(info, data)
    tmp.replace(wheel)
    verify(wheel)
    return sorted(dropped)


def verify(wheel: Path) -> None:
    """Every file of ``wheel`` listed in its RECORD with a hash has that hash, and every file
    in it is listed."""
    with zipfile.ZipFile(wheel) as z:
        record = next(n for n in z.namelist() if n.endswith(".dist-info/RECORD"))
        listed = set()
        for line in z.read(record).decode().splitlines():
            path, digest, _ = line.rsplit(",", 2)
            listed.add(path)
            if digest:
                algo, want = digest.split("=", 1)
                got = base64.urlsafe_b64encode(hashlib.new(algo, z.read(path)).digest())
                if got.rstrip(b"=").decode() != want:
                    raise SystemExit(f"{wheel.name}: {path} does not match its RECORD hash")
        unlisted = [n for n in z.namelist() if n not in listed and not n.endswith("/")]
        if unlisted:
            raise SystemExit(f"{wheel.name}: not in RECORD: {unlisted[:5]}")


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        raise SystemExit("usage: python bench/wheel_repack.py WHEEL REGEX [REGEX ...]")
    wheel = Path(argv[0])
    before = wheel.stat().st_size
    dropped = repack(wheel, argv[1:])
    tops = sorted({d.split("/")[0] for d in dropped})
    print(
        f"   {wheel.name}: dropped {len(dropped)} files (under {', '.join(tops) or '-'}), "
        f"{before / 2**20:.2f} -> {wheel.stat().st_size / 2**20:.2f} MiB; RECORD hashes check"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
