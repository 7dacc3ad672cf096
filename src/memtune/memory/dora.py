"""What peft's DoRA adds to a step's memory: the outputs each adapted module keeps for its
backward, and what its forward holds for a moment (:mod:`memtune.memory.estimate` adds both,
:mod:`memtune.memory.step_time` prices its extra work). Pure functions of the config and the
parameter counts, checked against tools.step_trace."""

from __future__ import annotations

from memtune.config import RunConfig, compute_bytes
from memtune.config.decisions import Decisions
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


def dequantized_weight_bytes(
    cfg: RunConfig, d: Decisions, modules: list[tuple[int, int, int]], b: int
) -> int:
    """What a layer's DoRA modules keep of a quantized base's weights for backward (``modules``:
    :func:`dora_modules`). peft's DoRA dequantizes the base weight (a new out × in tensor in the
    compute dtype; a compute-dtype base's is the parameter itself, nothing new). With LoRA
    dropout, peft's forward multiplies the dropped input by that copy, and autograd keeps it
    until the backward: every kept layer holds one per adapted module (0 without dropout, where
    the base layer's own output is reused)."""
    if not cfg.peft.dora or d.peft_method == "lora" or cfg.peft.dropout <= 0:
        return 0
    return sum(i * out * b for i, out, _ in modules)


def dora_kept_bytes(
    cfg: RunConfig, d: Decisions, inputs: list[tuple[str, int, int]], counts: ParamCounts, n: int
) -> int:
    """What DoRA adds to what the adapted modules ``inputs`` (lora_inputs) keep for backward
    over ``n`` tokens: their outputs (:func:`dora_saved_bytes`) and a quantized base's
    dequantized weights (:func:`dequantized_weight_bytes`); 0 without DoRA."""
    if not cfg.peft.dora:
        return 0
    b = compute_bytes(cfg)
    modules = dora_modules(inputs, counts)
    saved = sum(dora_saved_bytes(out, n, b) for _, out, _ in modules)
    return saved + dequantized_weight_bytes(cfg, d, modules, b)


def dora_transient_bytes(
    cfg: RunConfig, d: Decisions, counts: ParamCounts, tokens: int, kind: str
) -> int:
    """What peft's DoRA holds for a moment in the forward (or recompute) of an adapted module,
    beyond what the layer keeps, for its largest module (0 without DoRA). peft builds the LoRA
    product as a weight by running A and B over an identity matrix (in × in, A's output
    in × r, the product in × out), which live until the module's forward ends; next to them,
    first the scaled product and its sum with the base weight for the row norms (out × in
    each, before the module's own outputs exist), then at the end one product with the
    magnitudes (n × out). The larger of the two moments, as tools.step_trace sees them. A
    quantized base's weight is dequantized for both (out × in more, in the compute dtype)."""
    if not cfg.peft.dora:
        return 0
    b = compute_bytes(cfg)
    inputs = (
        counts.linear_attention_lora_inputs if kind == "linear_attention" else counts.lora_inputs
    )

    dequantized = d.peft_method != "lora"

    def moment(m: tuple[int, int, int]) -> int:
        i, out, r = m
        identity = (i * i + i * r + i * out + dequantized * i * out) * b
        norms = identity + 2 * i * out * b - dora_saved_bytes(out, tokens, b)
        ending = identity + tokens * out * b
        return max(norms, ending)

    return max((moment(m) for m in dora_modules(inputs, counts)), default=0)
