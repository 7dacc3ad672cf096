"""What peft's DoRA adds to a step's memory: the outputs each adapted module keeps for its
backward, and what its forward holds for a moment (:mod:`memtune.memory.estimate` adds both,
:mod:`memtune.memory.step_time` prices its extra work). Pure functions of the config and the
parameter counts, checked against tools.step_trace."""

from __future__ import annotations

from memtune.config import RunConfig, compute_bytes
from memtune.memory.counts import ParamCounts


def dora_modules(
    inputs: list[tuple[str, int, int]], counts: ParamCounts
) -> list[tuple[int, int, int]]:
    """(in, out, r) of each adapted module of a layer (``inputs``: its lora_inputs)."""
    outs = {name.split(".")[-1]: o for name, _, o in counts.linear_shapes}
    return [(i, outs[name], r) for name, i, r in inputs]


def dora_saved_bytes(out: int, n: int, b: int) -> int:
    """What DoRA adds to an adapted module's saved activations for ``n`` tokens (peft's
    DoraLinearLayer): the base output and the LoRA output, each n × out, which the product
    with the magnitude scale keeps for backward (checked against tools.step_trace)."""
    return 2 * n * out * b


def dora_transient_bytes(cfg: RunConfig, counts: ParamCounts, tokens: int, kind: str) -> int:
    """What peft's DoRA holds for a moment in the forward (or recompute) of an adapted module,
    beyond what the layer keeps, for its largest module (0 without DoRA). peft builds the LoRA
    product as a weight by running A and B over an identity matrix (in × in, A's output
    in × r, the product in × out), which live until the module's forward ends; next to them,
    first the scaled product and its sum with the base weight for the row norms (out × in
    each, before the module's own outputs exist), then at the end one product with the
    magnitudes (n × out). The larger of the two moments, as tools.step_trace sees them."""
    if not cfg.peft.dora:
        return 0
    b = compute_bytes(cfg)
    inputs = (
        counts.linear_attention_lora_inputs if kind == "linear_attention" else counts.lora_inputs
    )

    def moment(m: tuple[int, int, int]) -> int:
        i, out, r = m
        identity = (i * i + i * r + i * out) * b
        norms = identity + 2 * i * out * b - dora_saved_bytes(out, tokens, b)
        ending = identity + tokens * out * b
        return max(norms, ending)

    return max((moment(m) for m in dora_modules(inputs, counts)), default=0)
