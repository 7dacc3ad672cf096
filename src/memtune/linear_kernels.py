"""Which code runs a Qwen3.5 linear-attention layer's conv and recurrence.

transformers' Qwen3.5 module binds ``causal_conv1d_fn`` and ``torch_chunk_gated_delta_rule``
when it is imported: to the CUDA packages' functions (causal-conv1d, flash-linear-attention)
when they import, else to its own torch code. The rank names what runs in its start-up line
(rank.linear_attention); the planner measures the torch code on the meta device, where no CUDA
kernel runs (memory.counts.linear_mixer_bytes). Shared by both sides, so it imports neither.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Iterator
from typing import Any

KERNEL_FUNCTIONS = (("conv", "causal_conv1d_fn"), ("recurrence", "torch_chunk_gated_delta_rule"))
"""The two functions of transformers' Qwen3.5 module that carry state along the sequence; at
import it binds each to the CUDA package's (causal-conv1d, flash-linear-attention) when that
imports, else to its own torch code."""


def resolved(fn: Any) -> Any:
    """The implementation transformers' fallback wrapper ``fn`` calls (the ``implementation`` it
    closes over), or ``fn`` itself."""
    code = getattr(fn, "__code__", None)
    cells = dict(zip(code.co_freevars, fn.__closure__ or (), strict=True)) if code else {}
    return cells["implementation"].cell_contents if "implementation" in cells else fn


def kernels(layer: Any) -> str:
    """Which code runs the conv and the recurrence of ``layer``'s class, as bound at import."""
    hf = sys.modules[type(layer).__module__]
    names = []
    for what, name in KERNEL_FUNCTIONS:
        impl = resolved(getattr(hf, name))
        package = impl.__module__.split(".")[0]
        label = {"fla": "flash-linear-attention", "causal_conv1d": "causal-conv1d"}.get(package)
        names.append(f"{what} {label or 'torch'}")
    return ", ".join(names)


@contextlib.contextmanager
def torch_code(module_name: str) -> Iterator[None]:
    """transformers' own torch code for the conv and the recurrence while inside, whatever the
    module bound at import (the meta device runs no CUDA kernel: memory.counts measures this)."""
    hf = sys.modules[module_name]
    bound = {name: getattr(hf, name) for _, name in KERNEL_FUNCTIONS}
    try:
        for name, fn in bound.items():
            setattr(hf, name, inspect.unwrap(fn))
        yield
    finally:
        for name, fn in bound.items():
            setattr(hf, name, fn)
