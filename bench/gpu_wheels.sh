#!/usr/bin/env bash
# Fetch, here, every wheel the lent H200 machine lacks for bench/gpu_check.sh, into .whl/.
#
#     bash bench/gpu_wheels.sh            # ~1 min; prints every wheel and the total size
#
# The H200 image (see /work/.library/device/KINDS.md) has python 3.12, torch 2.11+cu130,
# transformers 5.17, peft, accelerate, numpy, safetensors, tokenizers, msgpack, ninja,
# py-cpuinfo, nvidia-ml-py, einops, psutil, tqdm, pyyaml ... and no network. What memtune
# needs beyond it travels as wheels in the git-ignored .whl/ folder (`carry: [".whl"]`):
#
#   deepspeed          sdist only: built here into a pure-python wheel (DS_BUILD_OPS=0)
#   hjson, pydantic, pydantic-core, annotated-types, typing-inspection   DeepSpeed's needs
#   typing-extensions  pydantic needs >= 4.16; the image's version is unknown
#   hydra-core, omegaconf, antlr4-python3-runtime (sdist: built here)    memtune.config
#   bitsandbytes       43 MB as published: repacked with only its CUDA 13.0 library
#   transformers       the image's 5.17 lacks activation_checkpointing_enable (memtune.rank.model)
#   peft               the version memtune is tested with (the image's is unknown)
#   flash-linear-attention, fla-core   Qwen3.5's Gated DeltaNet kernels (Triton, pure Python;
#                      needs einops, triton >= 3.3, torch >= 2.7, transformers >= 5.6.2, <6:
#                      the image's or carried): the qwen35-fla phase. Pinned (FLA below): not
#                      in the .venv, whose CPU torch has no Triton
#   liger-kernel       Liger's Triton kernels (pure Python; needs torch and triton, the image's):
#                      the kernels phase. Pinned (LIGER below), opt-in: in .whl/opt/, which
#                      gpu_check.sh installs apart and only that phase puts on its path (with it
#                      installed, trainer.loss=auto would pick Liger's loss in every phase)
#
# Versions are those of this repo's .venv (what `make test` runs), so the GPU check runs the
# library versions the CPU tests pass with; only torch (2.11+cu130) and the packages listed
# above as the image's own differ.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PY:-$ROOT/.venv/bin/python}
DEST=$ROOT/.whl
LIMIT_MIB=55

EXCLUDE=$(git rev-parse --git-path info/exclude) # (a worktree's is its repository's)
grep -qxF '/.whl/' "$EXCLUDE" 2>/dev/null || echo '/.whl/' >>"$EXCLUDE"

version() { "$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }

BINARY=(transformers peft hydra-core omegaconf hjson pydantic pydantic-core annotated-types
    typing-inspection typing-extensions bitsandbytes)
SDIST=(deepspeed antlr4-python3-runtime)
# fla-core holds the `fla` package transformers imports (fla.ops.gated_delta_rule);
# flash-linear-attention adds fla.layers and fla.models on top, as `pip install` gives them.
FLA_VERSION=0.6.0
FLA=(flash-linear-attention=="$FLA_VERSION" fla-core=="$FLA_VERSION")
LIGER_VERSION=0.8.5
OPT=(liger-kernel=="$LIGER_VERSION")

rm -rf "$DEST" && mkdir -p "$DEST"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

specs=()
for name in "${BINARY[@]}"; do specs+=("$name==$(version "$name")"); done
specs+=("${FLA[@]}")
echo "== binary wheels for cp312 manylinux x86_64: ${specs[*]}"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$DEST" "${specs[@]}"

echo "== opt-in wheels (.whl/opt): ${OPT[*]}"
"$PY" -m pip download -q --no-deps --only-binary=:all: -d "$DEST/opt" "${OPT[@]}"

for name in "${SDIST[@]}"; do
    spec="$name==$(version "$name")"
    echo "== building a wheel from the sdist of $spec"
    "$PY" -m pip download -q --no-deps --no-binary=:all: -d "$WORK/sdist" "$spec"
done
# No build isolation: DeepSpeed's setup.py imports torch (this venv's CPU torch; with
# DS_BUILD_OPS=0 nothing is compiled, and DeepSpeed picks the CUDA accelerator at run time).
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$DEST" "$WORK"/sdist/*

echo "== repacking bitsandbytes: keep libbitsandbytes_cuda130.so (torch 2.11+cu130) and the CPU one"
"$PY" "$ROOT/bench/wheel_repack.py" "$DEST"/bitsandbytes-*.whl 'libbitsandbytes_(?!(cuda130|cpu)\.so$)[^/]*\.so$'
unzip -Z1 "$DEST"/bitsandbytes-*.whl | grep '\.so$' | sed 's/^/   kept /'

echo "== $DEST"
ls -l "$DEST" "$DEST/opt" | awk '/\.whl$/ {printf "%10.2f MiB  %s\n", $5 / 1048576, $9}'
total=$(du -cb "$DEST"/*.whl "$DEST"/opt/*.whl | tail -1 | cut -f1)
# One du (xargs may split the list, and tail then read one part's total); a tracked file deleted
# here is not carried, and its error, under set -e, ended the script without a word.
tree=$(git ls-files -z --cached --others --exclude-standard |
    { du -cb --files0-from=- 2>/dev/null || true; } | tail -1 | cut -f1)
awk -v w="$total" -v t="$tree" -v lim="$LIMIT_MIB" 'BEGIN {
    printf "total wheels %.2f MiB; working tree without them %.2f MiB; together %.2f of 64 MiB\n",
        w / 1048576, t / 1048576, (w + t) / 1048576
    if (w / 1048576 > lim) { print "wheels over " lim " MiB"; exit 1 }
}'

# Verify, as far as this machine can: a scratch Python 3.12 venv with the wheels and a stand-in
# for every package of the image (bench/gpu_wheels_check.py says what that proves and not).
if [ -z "${PY312:-}" ]; then
    for candidate in python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do
        if "$candidate" -V >/dev/null 2>&1; then PY312=$candidate; break; fi
    done
fi
if [ -z "${PY312:-}" ]; then
    echo "no python3.12 here (set PY312=...): the wheel set is not verified"
    exit 0
fi
echo "== verifying with $("$PY312" -V) in a scratch venv"
VENV=$WORK/venv312
"$PY312" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --no-index --no-deps --no-compile "$DEST"/*.whl "$DEST"/opt/*.whl
# The image's own pyyaml and packaging, for the import test only (kept out of the venv's
# site-packages, where they would count as carried).
"$VENV/bin/python" -m pip install -q --target "$WORK/helpers" pyyaml packaging
GPU_WHEELS_HELPERS=$WORK/helpers "$VENV/bin/python" "$ROOT/bench/gpu_wheels_check.py" \
    /work/.library/device/KINDS.md
