"""Known third-party noise, dropped at its source so that memtune's own lines come first.

Each entry below is one message a library prints on every run that the user can do nothing
about, matched exactly; everything else those libraries say still gets through (their real
warnings and errors included). :func:`install` is called first thing by every memtune process
(the job, each rank, the tools); :func:`drop_stdout_lines` covers the one message that is a bare
``print``.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import sys
import warnings
from collections.abc import Iterator

# (logger name, message prefix): log records dropped.
LOG_NOISE = (
    # bitsandbytes (>= 0.49) tries to fetch a CPU kernel from the Hugging Face hub at import on
    # AVX512-BF16 CPUs and falls back to its bundled one; the hub is not reachable here anyway,
    # and memtune never trains through that kernel (rank.model.keep_training_layout).
    ("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward from kernels-"),
    # bitsandbytes (0.50) on every LLM.int8 matmul of a bf16 or fp32 run on GPUs: the cast
    # notice it raised as a UserWarning before (WARNING_NOISE), now a log record, one a step
    # per layer and projection
    ("bitsandbytes.autograd._functions", "MatMul8bitLt: inputs will be cast"),
    # transformers, once per rank, when a Qwen3.5 model runs its torch code for the conv and the
    # recurrence: the start-up line names the kernels that run (rank.linear_attention.kernels)
    # and the README says what installing them changes.
    ("transformers.integrations.hub_kernels", "`causal_conv1d_fn` is falling back"),
    ("transformers.integrations.hub_kernels", "`chunk_gated_delta_rule` is falling back"),
    # ... and, in memtune generate, its one-token decoding steps' kernels (the answer is the
    # same; memtune's own lines are what a user of generate reads)
    ("transformers.integrations.hub_kernels", "`causal_conv1d_update` is falling back"),
    ("transformers.integrations.hub_kernels", "`fused_recurrent_gated_delta_rule` is falling back"),
    # matplotlib, the first time a machine draws a sweep's loss plot (an empty font cache): an
    # INFO record that Hydra's log format printed as "[HYDRA] generated new fontManager" at the
    # end of a sweep, a line that looks like Hydra's and means nothing to the sweep
    ("matplotlib.font_manager", "generated new fontManager"),
)
# Bare prints (stdout lines) dropped where :func:`drop_stdout_lines` wraps the call.
STDOUT_NOISE = (
    # deepspeed.comm prints this in every rank when it loads its shared-memory all-reduce op.
    re.compile(r"^DeepSpeed \S+ built successfully$"),
)
# Python warnings raised on every step by DeepSpeed, peft and bitsandbytes: deprecations of
# their own internals and a cast notice (older bitsandbytes; LOG_NOISE for 0.50's), nothing a
# user can act on.
WARNING_NOISE = (
    (FutureWarning, r"", r"torch\.distributed"),
    (Warning, r".*is_gradient_checkpointing.*is deprecated", r""),
    (UserWarning, r"MatMul8bitLt: inputs will be cast", r""),
)


class _DropPrefix(logging.Filter):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


_installed = False


def install() -> None:
    """Attach the filters (idempotent; before or after the libraries are imported)."""
    global _installed
    if _installed:
        return
    _installed = True
    for name, prefix in LOG_NOISE:
        logging.getLogger(name).addFilter(_DropPrefix(prefix))
    for category, message, module in WARNING_NOISE:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)


@contextlib.contextmanager
def no_progress_bars() -> Iterator[None]:
    """transformers' progress bars (its "Loading weights", save_pretrained's "Writing model
    shards") off for the block: the tools print memtune's own lines instead."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def drop_stdout_lines() -> Iterator[None]:
    """Run the block with stdout captured, then print what it printed minus the known noise."""
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer):
            yield
    finally:
        kept = [
            line
            for line in buffer.getvalue().splitlines()
            if not any(p.match(line) for p in STDOUT_NOISE)
        ]
        if kept:
            print("\n".join(kept), file=sys.stdout, flush=True)
