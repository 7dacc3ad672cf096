"""LoRA dropout without its copies (decisions.json ``kernels.lora_dropout``;
trainer.lora_dropout_kernel).

peft computes an adapter as ``lora_B(lora_A(dropout(x))) * scaling``. Autograd then keeps, for
backward, the dropped copy of ``x`` that ``lora_A`` read and the dropout's mask — per adapted
module, even where several modules read the same ``x`` (q, k and v; gate and up), whose
adapters would otherwise share one saved tensor. At the peak of a 49,152-token QLoRA step on
one GPU those copies held 1.97 of 9.22 GiB (bench/results/2026-12-04-h200-long.md).

``regenerate`` keeps none of them. Each vanilla LoRA ``lora_A`` (an ``nn.Linear``) is given a
subclass whose forward is :class:`DroppedInput`: it notes the random generator's state, drops
``x`` with the same ``F.dropout`` call peft's ``nn.Dropout`` makes, multiplies, and keeps only
``x`` itself (shared with the other adapters that read it) and the generator state. Backward
sets the generator to that state, drops ``x`` again — the same call on the same state: the same
mask, bit for bit — and computes both gradients from it, then puts the generator back. peft's
dropout module becomes ``nn.Identity`` (what peft itself uses at dropout 0). The generator is
drawn from exactly as peft's module draws from it, once per adapted module per forward, so
everything random after it (the next module's mask, a checkpointed layer's replay) is unchanged:
a run's losses and gradients equal peft's (tests/test_lora_dropout.py).

The cost: one more dropout pass over each adapted module's input in backward (memory-bound, in
the step-time estimate). Not used (decided ``peft``): DoRA (peft's variant path drops inside its
own forward), trainer.compile (the generator's state is read outside the traced graph), and
adapters other than vanilla LoRA on ``nn.Linear`` (embeddings, convolutions).

Recompute composes: a checkpointed layer's replay restores the generator before it runs the
forward again (torch's checkpoint, rank.layers' selective one, rank.long_context's), so the
replayed forward notes the same state; and the ``ctx`` a non-reentrant checkpoint keeps is the
first forward's, whose state equals it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from memtune.config import ConfigError


def _generator(device: torch.device) -> torch.Generator:
    """The default generator ``F.dropout`` draws from on ``device``."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    if device.type == "cpu":
        return torch.default_generator
    raise ConfigError(
        f"kernels.lora_dropout=regenerate (decisions.json) runs on CPU and CUDA ranks; this "
        f"rank's tensors are on {device.type}: run with trainer.lora_dropout_kernel=peft"
    )


def replayed_dropout(
    x: torch.Tensor, p: float, native: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``F.dropout(x, p, training=True)`` as torch computes it, and the factor backward
    multiplies the gradient by: on CUDA torch's fused ``native_dropout`` (the output and a bool
    mask; the gradient is ``grad · mask / (1 − p)``), on CPU a Bernoulli noise in x's dtype
    already divided by ``1 − p`` (``x · noise``; the gradient is ``grad · noise``). The same
    draws from the generator as ``F.dropout`` (tests/test_lora_dropout.py checks it against
    peft's module on CPU, and on a GPU when there is one). ``native``: CUDA's way on any
    device (tools.step_trace stands for a GPU rank on CPU: memory.vision.as_on_cuda)."""
    if native or x.device.type == "cuda":
        dropped, mask = torch.native_dropout(x, p, True)
        return dropped, mask
    noise = torch.empty_like(x).bernoulli_(1 - p).div_(1 - p)
    return x * noise, noise


class DroppedInput(torch.autograd.Function):
    """``dropout(x, p) @ weightᵀ``, keeping ``x`` and the generator's state instead of the
    dropped copy and its mask (module docstring). Backward holds one input-sized copy and the
    mask at a time: the copy for the weight's gradient, freed before the input's gradient."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, p: float, native: bool = False
    ) -> torch.Tensor:
        ctx.state = _generator(x.device).get_state()
        ctx.p, ctx.native = p, native
        ctx.save_for_backward(x, weight)
        dropped = replayed_dropout(x, p, True)[0] if native else F.dropout(x, p, True)
        return F.linear(dropped, weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        x, weight = ctx.saved_tensors
        generator = _generator(x.device)
        now = generator.get_state()
        generator.set_state(ctx.state)
        try:
            dropped, factor = replayed_dropout(x, ctx.p, ctx.native)
        finally:
            generator.set_state(now)
        grad_w = None
        if ctx.needs_input_grad[1]:
            rows = grad.reshape(-1, grad.shape[-1])
            grad_w = (rows.t() @ dropped.reshape(-1, dropped.shape[-1])).to(weight.dtype)
        del dropped
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = grad @ weight.to(grad.dtype)
            grad_x.mul_(factor)
            if factor.dtype == torch.bool:
                grad_x.mul_(1.0 / (1.0 - ctx.p))
        return grad_x, grad_w, None, None


class RegeneratedDropoutLinear(nn.Linear):
    """A LoRA ``lora_A`` whose input dropout (``memtune_dropout_p``) is :class:`DroppedInput`:
    the same parameters and state-dict names as the ``nn.Linear`` it was (its class swapped in
    place), so saving, loading and export see peft's module."""

    memtune_dropout_p: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return F.linear(x, self.weight, self.bias)
        native = vars(self).get("memtune_native_dropout", False)
        out: torch.Tensor = DroppedInput.apply(x, self.weight, self.memtune_dropout_p, native)
        return out


def _adapters(model: nn.Module) -> list[tuple[nn.ModuleDict, str, nn.Linear]]:
    """(the LoRA layer's ``lora_dropout``, adapter name, its ``lora_A``) of every vanilla LoRA
    adapter of ``model`` on an ``nn.Linear`` lora_A."""
    found = []
    for module in model.modules():
        drops, a_of = getattr(module, "lora_dropout", None), getattr(module, "lora_A", None)
        if not isinstance(drops, nn.ModuleDict) or not isinstance(a_of, nn.ModuleDict):
            continue
        variants = getattr(module, "lora_variant", {}) or {}
        a_by_name = dict(a_of.items())
        for name in drops:
            a = a_by_name.get(name)
            if name in variants or not isinstance(a, nn.Linear):
                continue
            if type(a) in (nn.Linear, RegeneratedDropoutLinear):
                found.append((drops, name, a))
    return found


def use_lora_dropout(model: nn.Module, kind: str) -> int:
    """The decided LoRA dropout (``peft`` | ``regenerate``) on every vanilla LoRA adapter of
    ``model``, whatever was applied before (the GPU check switches one built model between
    them). Returns the adapters whose dropout is regenerated."""
    regenerated = 0
    for drops, name, a in _adapters(model):
        drop = drops[name]
        if isinstance(a, RegeneratedDropoutLinear):
            p = a.memtune_dropout_p
        elif isinstance(drop, nn.Dropout):
            p = float(drop.p)
        else:
            continue  # peft.dropout=0: nn.Identity, nothing dropped
        if kind == "regenerate" and p > 0:
            a.__class__ = RegeneratedDropoutLinear
            vars(a)["memtune_dropout_p"] = p  # a plain attribute (nn.Module's setattr is typed)
            drops[name] = nn.Identity()
            regenerated += 1
        elif isinstance(a, RegeneratedDropoutLinear):
            a.__class__ = nn.Linear  # type: ignore[assignment]
            del a.memtune_dropout_p
            vars(a).pop("memtune_native_dropout", None)
            drops[name] = nn.Dropout(p).train(a.training)
    return regenerated


def regenerated_dropouts(model: nn.Module) -> int:
    """The adapters of ``model`` whose dropout mask is regenerated in backward."""
    return sum(isinstance(m, RegeneratedDropoutLinear) for m in model.modules())
