#!/usr/bin/env bash
# The one command the lent H200 runs (bench/README.md, "GPU check"): install the carried
# wheels, record the machine, run the check (python -m bench.gpu_check) under a global time
# limit, and leave gpu_check.json, gpu_check.md and gpu_check.log in $OUT. All of it in under
# 8 minutes.
#
#   device:  bash bench/gpu_check.sh                          (with carry: [".whl"])
#            bash bench/gpu_check.sh --phases unsloth --keep-parts   (then, carry: [".whl-unsloth"])
#   here:    OUT=/tmp/gc bash bench/gpu_check.sh --dry-run    (.venv, CPU, tiny model, no wheels)
#
# Extra arguments go to the check (--phases lora-memtune,qlora-memtune ...; the Qwen3.5
# phases alone: --phases qwen35-torch,qwen35-fla; what a session skipped for want of time:
# the "next session" its status line names).
set -uo pipefail
cd "$(dirname "$0")/.."
START=$(date +%s)
TOTAL_S=${GPU_CHECK_TOTAL_S:-450} # everything, install included; the device run's limit is 600
OUT=${OUT:-/tmp/gpu_check_out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled
export TOKENIZERS_PARALLELISM=false PYTHONWARNINGS=ignore::FutureWarning

DRY=0
for arg in "$@"; do [ "$arg" = --dry-run ] && DRY=1; done

if [ "$DRY" = 1 ]; then
    PY=${PY:-.venv/bin/python}
else
    PY=${PY:-python3}
    echo "== wheels ($(ls .whl/*.whl 2>/dev/null | wc -l) in .whl/, $(ls .whl-unsloth/*.whl 2>/dev/null | wc -l) in .whl-unsloth/)"
    if ! ls .whl/*.whl >/dev/null 2>&1 && ! ls .whl-unsloth/*.whl >/dev/null 2>&1; then
        echo "no .whl/: run bash bench/gpu_wheels.sh here first and give the run carry: [\".whl\"]"
        exit 2
    fi
    # install_wheels WHEELS TARGET: once per machine; a warm machine's second call (the Unsloth
    # call, after the main check) finds the same wheels installed and skips it.
    install_wheels() {
        local stamp="$2/.gpu_check_wheels" listing
        listing=$(stat -c '%n %s' "$1"/*.whl) # names and sizes: a copy's new times are no change
        if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$listing" ]; then
            echo "== $1 already installed in $2"
            return 0
        fi
        [ -f "$stamp" ] && rm -rf "$2" # ours (its stamp says so): other wheels, start afresh
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$2" "$1"/*.whl && echo "$listing" >"$stamp"
    }
    if ls .whl/*.whl >/dev/null 2>&1; then
        install_wheels .whl /tmp/site || { echo "wheel install failed"; exit 3; }
    else
        echo "no .whl/ (not carried, not left by an earlier call): only the Unsloth phases can run"
    fi
    # Opt-in wheels (liger-kernel) apart: only the phase that measures them puts them on its
    # path (bench/gpu_check/kernels.py); the others run what a default install runs.
    if ls .whl/opt/*.whl >/dev/null 2>&1; then
        install_wheels .whl/opt /tmp/site-opt && export GPU_CHECK_OPT_SITE=/tmp/site-opt ||
            echo "opt-in wheel install failed: the kernels phase runs without liger-kernel"
        echo "== opt-in: $(ls .whl/opt/) in /tmp/site-opt"
    fi
    # Unsloth's own environment (bench/gpu_check/unsloth.py): .whl-unsloth/ apart, alone on the
    # Unsloth phases' path with the image's packages; their presence selects those phases.
    if ls .whl-unsloth/*.whl >/dev/null 2>&1; then
        install_wheels .whl-unsloth /tmp/site-unsloth && export GPU_CHECK_UNSLOTH_SITE=/tmp/site-unsloth ||
            echo "Unsloth's wheels failed to install: its phases record that they are not installed"
        echo "== Unsloth's: $(ls .whl-unsloth/ | tr '\n' ' ') in /tmp/site-unsloth"
    fi
    # --no-compile keeps the install short; compile on all cores once, not in every phase.
    "$PY" -m compileall -q -j 0 /tmp/site /tmp/site-opt /tmp/site-unsloth >/dev/null 2>&1 || true
    export PYTHONPATH=/tmp/site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}
    echo "== installed in $(($(date +%s) - START)) s"
    nvidia-smi || true
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,power.limit \
        --format=csv || true
fi
"$PY" - <<'EOF' || true
import importlib.metadata as md, platform
names = ["torch", "transformers", "peft", "accelerate", "deepspeed", "bitsandbytes", "hydra-core",
         "omegaconf", "pydantic", "tokenizers", "huggingface-hub", "safetensors", "numpy", "triton",
         "regex", "tqdm", "packaging", "pyyaml", "typing-extensions", "einops", "msgpack",
         "flash-linear-attention", "fla-core", "causal-conv1d"]
found = []
for n in names:
    try:
        found.append(f"{n} {md.version(n)}")
    except md.PackageNotFoundError:
        found.append(f"{n} MISSING")
print(f"== python {platform.python_version()}: " + ", ".join(found), flush=True)
EOF

if [ -n "${GPU_CHECK_UNSLOTH_SITE:-}" ]; then # Unsloth's environment: its wheels and the image's
    PYTHONPATH=$GPU_CHECK_UNSLOTH_SITE "$PY" -c '
import importlib.metadata as md
names = ["unsloth", "unsloth_zoo", "trl", "datasets", "transformers", "peft", "bitsandbytes",
         "triton", "torch", "huggingface-hub", "accelerate"]
def v(n):
    try:
        return md.version(n)
    except md.PackageNotFoundError:
        return "MISSING"
print("== Unsloth environment: " + ", ".join(f"{n} {v(n)}" for n in names), flush=True)' || true
fi
LEFT=$((TOTAL_S - ($(date +%s) - START)))
BUDGET=$((LEFT - 25)) # the phases' one budget; timeout below is the hard stop
echo "== python -m bench.gpu_check: ${BUDGET} s budget, hard stop at ${LEFT} s"
timeout -k 10 "$LEFT" "$PY" -m bench.gpu_check --out "$OUT" --work /tmp/gpu_check_parts \
    --budget-s "$BUDGET" "$@"
code=$?
echo "== exit $code after $(($(date +%s) - START)) s; results in $OUT"
ls -l "$OUT"
exit $code
