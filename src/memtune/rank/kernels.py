"""Fused RMSNorm, SwiGLU and rotary kernels in the decoder layers, as decided (decisions.json
``kernels``; trainer.rms_norm_kernel, swiglu_kernel, rope_kernel).

``torch`` replaces nothing: transformers' own code runs. ``lean`` (RMSNorm and SwiGLU) puts
memtune's lean RMSNorm (rank.lean_norm: the same ops, no fp32 copy kept) in every RMSNorm
module, and its lean SwiGLU (rank.lean_swiglu: the same ops, SiLU's output not kept) in every
MLP, wired as Liger's are below. ``liger`` puts Liger's functional ops
(``liger_kernel.ops``: the Triton autograd Functions themselves, not its whole-model patches)
into the model memtune loaded, module by module, so memtune says what is replaced:

* **RMSNorm.** Every RMSNorm module of the model (each layer's two, Qwen3's per-head q / k
  norms, the final one) is given a subclass of its own class whose forward is
  ``rms_norm(x, self.weight, self.variance_epsilon)``. The weight is read inside the forward,
  as transformers reads it: under ZeRO-3 it is the one DeepSpeed gathered for this call.
* **SwiGLU.** Every MLP likewise: ``down_proj(silu_mul(gate_proj(x), up_proj(x)))``. The
  projections are called as they are — peft's LoRA layers, bitsandbytes' 4-bit ones under
  QLoRA — and only ``act_fn(gate) * up`` is replaced. A subclass rather than an instance
  attribute, so the tiled MLP (rank.long_context, which runs ``type(mlp).forward`` tile by
  tile) tiles the fused forward.
* **Rotary.** transformers' attention calls its modeling module's ``apply_rotary_pos_emb`` by
  name; that name is pointed at ``rope`` (checked: the attention's forward reads it from that
  module). Process-wide for that model class, which is one model on a rank.

Recompute composes as it does for the ops they replace: a layer recomputed in full runs them
again; a selective layer keeps its base matmuls' and attention's outputs and runs them again
(Liger's Functions are not matmuls). Liger's rotary writes q and k in place: they come from
peft's LoRA layers (a fresh sum, ``result + lora``) or Qwen3's q / k norms, never straight
from a matmul whose output selective recompute keeps, and an attention whose q_proj or k_proj
is not a LoRA layer is refused rather than risk it.

:func:`use_kernels` takes the functions as arguments: the CPU tests pass :data:`REFERENCE`
(the same math in torch, as transformers computes it) and check the patched model against the
unpatched one; a rank passes Liger's (:func:`use_fused_kernels`).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from memtune.config import ConfigError
from memtune.config.decisions import Kernels
from memtune.rank.lean_norm import lean_rms_norm
from memtune.rank.lean_swiglu import lean_silu_mul

RmsNorm = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
"""(x, weight, eps) -> weight · x / rms(x), in x's dtype as transformers' Qwen RMSNorm."""
SiluMul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(gate, up) -> silu(gate) · up."""
Rope = Callable[..., tuple[torch.Tensor, torch.Tensor]]
"""(q, k, cos, sin, unsqueeze_dim=1) -> (q, k) rotated: transformers' apply_rotary_pos_emb."""


@dataclass(frozen=True)
class KernelFunctions:
    """What replaces each op; None: transformers' own code."""

    rms_norm: RmsNorm | None = None
    silu_mul: SiluMul | None = None
    rope: Rope | None = None
    rope_in_place: bool = False
    """``rope`` writes q and k in place (Liger's): q_proj and k_proj must be LoRA layers."""


@dataclass(frozen=True)
class Wiring:
    """Where a model type's ops live in transformers."""

    modeling: str
    norm: str
    mlp: str
    attention: str


WIRED = {
    "qwen2": Wiring(
        "transformers.models.qwen2.modeling_qwen2", "Qwen2RMSNorm", "Qwen2MLP", "Qwen2Attention"
    ),
    "qwen3": Wiring(
        "transformers.models.qwen3.modeling_qwen3", "Qwen3RMSNorm", "Qwen3MLP", "Qwen3Attention"
    ),
}
"""The dense Qwen2 / Qwen2.5 and Qwen3 layers (config.validate.KERNEL_MODELS, the same)."""
ROPE_NAME = "apply_rotary_pos_emb"


@dataclass(frozen=True)
class Wired:
    """What :func:`use_kernels` replaced: modules reached, by kind."""

    norms: int = 0
    mlps: int = 0
    attentions: int = 0

    def missing(self, kernels: Kernels) -> list[str]:
        """Each kernel decided other than torch that reached no module, in words: a run (or
        a GPU check's variant) that would time transformers' code under another kernel's
        name."""
        reaches = {"rms_norm": "norms", "swiglu": "mlps", "rope": "attentions"}
        return [
            f"{name}={getattr(kernels, name)} decided but no {where} reached"
            for name, where in reaches.items()
            if getattr(kernels, name) != "torch" and not getattr(self, where)
        ]


# --- the functions ---------------------------------------------------------------------------


def liger_functions() -> KernelFunctions:
    """Liger's Triton autograd Functions (liger-kernel 0.8.5), imported from their own
    modules: the default Triton implementation, not the backend Liger's package would pick."""
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    from liger_kernel.ops.rope import LigerRopeFunction
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # offset 0, casting "llama" (the inverse RMS in fp32, x · rstd cast back to x's dtype,
        # then times the weight: transformers' Qwen RMSNorm); in_place False: dX gets its own
        # buffer instead of overwriting the incoming gradient, which memtune cannot see every
        # reader of (peft's branches, the chunked head's gradient).
        out: torch.Tensor = LigerRMSNormFunction.apply(x, weight, eps, 0.0, "llama", False)
        return out

    def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = LigerSiLUMulFunction.apply(gate, up)
        return out

    def rope(
        q: torch.Tensor,
        k: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        unsqueeze_dim: int = 1,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # q (b, heads, n, d), cos (b, n, d): what transformers' Qwen attention passes
        q, k = LigerRopeFunction.apply(q, k, cos, sin, None, unsqueeze_dim)
        return q, k

    return KernelFunctions(rms_norm, silu_mul, rope, rope_in_place=True)


def chosen(kernels: Kernels, functions: KernelFunctions) -> KernelFunctions:
    """``functions`` for the kernels decided liger, memtune's lean RMSNorm and SwiGLU where
    decided (rank.lean_norm, rank.lean_swiglu), None (transformers' code) for the rest."""
    rms_norm = {"liger": functions.rms_norm, "lean": lean_rms_norm}.get(kernels.rms_norm)
    silu_mul = {"liger": functions.silu_mul, "lean": lean_silu_mul}.get(kernels.swiglu)
    return KernelFunctions(
        rms_norm=rms_norm,
        silu_mul=silu_mul,
        rope=functions.rope if kernels.rope == "liger" else None,
        rope_in_place=functions.rope_in_place,
    )


NO_LIGER = KernelFunctions()
"""No Liger function: what :func:`chosen` picks from for a run that decided none."""


def liger_available(device: torch.device) -> bool:
    return device.type == "cuda" and importlib.util.find_spec("liger_kernel") is not None


def use_fused_kernels(model: Any, kernels: Kernels, device: torch.device) -> Wired:
    """The decided kernels (decisions.json ``kernels``) on ``model`` (the peft model), whatever
    was applied before; Liger's refused (ConfigError: exit 2, naming the field) on a rank
    without CUDA and liger-kernel (the job decided from its view of the machine)."""
    liger = kernels.fused()
    if not liger and not kernels.lean():
        remove_kernels(model)
        return Wired()
    if liger and not liger_available(device):
        name = liger[0]
        raise ConfigError(
            f"kernels.{name}=liger (decisions.json) needs CUDA and the liger-kernel package on "
            "every rank; this rank has neither or one: install it, or run with "
            f"trainer.{name}_kernel=torch"
        )
    return use_kernels(model, chosen(kernels, liger_functions() if liger else NO_LIGER))


# --- the wiring ------------------------------------------------------------------------------


def _norm_forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = self.memtune_rms_norm(hidden_states, self.weight, self.variance_epsilon)
    return out


def _mlp_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = self.down_proj(self.memtune_silu_mul(self.gate_proj(x), self.up_proj(x)))
    return out


_FUSED: dict[type, type] = {}
"""Each replaced class's fused subclass, made once."""


def _fused_class(cls: type, forward: Callable[..., Any]) -> type:
    if cls not in _FUSED:
        body = {"forward": forward, "memtune_replaces": cls, "__module__": __name__}
        _FUSED[cls] = type(f"Fused{cls.__name__}", (cls,), body)
    return _FUSED[cls]


_ROPE_ORIGINAL: dict[str, Any] = {}
"""A modeling module's own apply_rotary_pos_emb, while memtune's is in its place."""


def wiring_of(model: Any) -> Wiring:
    kind = getattr(model.config, "model_type", None)
    if kind not in WIRED:
        raise ConfigError(
            f"kernels: the layer kernels are wired for {' and '.join(sorted(WIRED))} "
            f"models; this one is {kind!r}: run with the trainer.*_kernel settings on torch"
        )
    return WIRED[kind]


def _calls_rope_by_name(attention: type, modeling: Any) -> bool:
    forward = inspect.unwrap(attention.forward)  # type: ignore[attr-defined]
    code = getattr(forward, "__code__", None)
    return (
        code is not None
        and ROPE_NAME in code.co_names
        and getattr(forward, "__globals__", None) is vars(modeling)
    )


def _is_lora(module: Any) -> bool:
    return hasattr(module, "lora_A")


def use_kernels(model: Any, functions: KernelFunctions) -> Wired:
    """Put ``functions`` in place of transformers' ops in ``model`` (a Qwen2 / Qwen3 causal LM,
    peft-wrapped or not), after taking out whatever this did before; returns what it reached.
    Everything is checked before anything is replaced: a refusal leaves the model as it was."""
    remove_kernels(model)
    wiring = wiring_of(model)
    modeling = importlib.import_module(wiring.modeling)
    norm_cls, mlp_cls, attention_cls = (
        getattr(modeling, name) for name in (wiring.norm, wiring.mlp, wiring.attention)
    )
    modules = list(model.modules())
    norms = [m for m in modules if type(m) is norm_cls] if functions.rms_norm else []
    mlps = [m for m in modules if type(m) is mlp_cls] if functions.silu_mul else []
    attentions = [m for m in modules if type(m) is attention_cls] if functions.rope else []
    for mlp in mlps:
        if mlp.config.hidden_act not in ("silu", "swish"):
            raise ConfigError(
                f"kernels.swiglu: the MLP's activation is {mlp.config.hidden_act!r}, not silu: "
                "run with trainer.swiglu_kernel=torch"
            )
    for attention in attentions:
        fresh = hasattr(attention, "q_norm") or (
            _is_lora(attention.q_proj) and _is_lora(attention.k_proj)
        )  # Qwen3 normalises q and k; peft's LoRA layers return a new sum
        if functions.rope_in_place and not fresh:
            raise ConfigError(
                "kernels.rope=liger rotates q and k in place: it needs LoRA on q_proj and "
                "k_proj (a matmul's output, which selective recompute keeps, would be rotated "
                "twice); run with trainer.rope_kernel=torch"
            )
    if attentions and not _calls_rope_by_name(attention_cls, modeling):
        raise ConfigError(
            f"kernels.rope=liger: transformers' {wiring.attention} no longer calls {ROPE_NAME} "
            "from its module; run with trainer.rope_kernel=torch"
        )
    for norm in norms:
        norm.memtune_rms_norm = functions.rms_norm
        norm.__class__ = _fused_class(norm_cls, _norm_forward)
    for mlp in mlps:
        mlp.memtune_silu_mul = functions.silu_mul
        mlp.__class__ = _fused_class(mlp_cls, _mlp_forward)
    if attentions:
        _ROPE_ORIGINAL.setdefault(wiring.modeling, getattr(modeling, ROPE_NAME))
        setattr(modeling, ROPE_NAME, functions.rope)
    return Wired(len(norms), len(mlps), len(attentions))


def remove_kernels(model: Any) -> None:
    """Transformers' own ops back in ``model``: what :func:`use_kernels` put there taken out."""
    for module in model.modules():
        original = getattr(type(module), "memtune_replaces", None)
        if original is not None:
            module.__class__ = original
            module.__dict__.pop("memtune_rms_norm", None)
            module.__dict__.pop("memtune_silu_mul", None)
    kind = getattr(getattr(model, "config", None), "model_type", None)
    if kind in WIRED and WIRED[kind].modeling in _ROPE_ORIGINAL:
        modeling = importlib.import_module(WIRED[kind].modeling)
        setattr(modeling, ROPE_NAME, _ROPE_ORIGINAL.pop(WIRED[kind].modeling))


def kernels_label(wired: Wired, kernels: Kernels) -> str:
    """For the start-up line: what was reached ("" with nothing replaced)."""
    lean = kernels.lean()
    lean_norm, lean_mlp = "rms_norm" in lean, "swiglu" in lean
    parts = [
        f"{n} {what}"
        for n, what in (
            (0 if lean_norm else wired.norms, "RMSNorms"),
            (0 if lean_mlp else wired.mlps, "SwiGLU MLPs"),
            (wired.attentions, "rotary attentions"),
        )
        if n
    ]
    got = [
        (n, kind, what)
        for n, kind, what in (
            (wired.norms if lean_norm else 0, "RMSNorm", "norms"),
            (wired.mlps if lean_mlp else 0, "SwiGLU", "MLPs"),
        )
        if n
    ]
    named = " + ".join(kind for _, kind, _ in got)
    said = [f"lean {named} in {', '.join(f'{n} {w}' for n, _, w in got)}"] if got else []
    if parts:
        said.append(f"Liger kernels in {', '.join(parts)}")
    return "; ".join(said)


# --- the same math in torch ------------------------------------------------------------------


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Qwen2RMSNorm / Qwen3RMSNorm, as a function."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def reference_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(gate) * up


def reference_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' apply_rotary_pos_emb (Qwen2 / Qwen3)."""

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


REFERENCE = KernelFunctions(reference_rms_norm, reference_silu_mul, reference_rope)
"""Liger's ops as torch computes them: what the CPU tests (and the GPU check's dry run) wire
in Liger's place, where Triton cannot run."""
