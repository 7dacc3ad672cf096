"""What was decided for a run, as one typed value: :class:`Decisions` (``decisions.json``).

The user's config (``config.yaml``) says what they asked for, and may leave choices to memtune
(``trainer.checkpoint_layers=auto``, the long-context switches on ``auto``, ``plan.auto_fit``'s
variants, one rank's ZeRO stage, the kernels on ``auto``). :mod:`memtune.memory.fit` makes
those choices once, before any rank starts, and returns them as a :class:`Decisions`: ints,
bools and closed choices, with no ``auto`` representable. The job writes it to the run dir
next to the untouched ``config.yaml`` (and into every checkpoint); the ranks, the planner's
estimates and the bench read it as is and never re-derive a decided number.

How a value gets here, in one place (:func:`decisions_for`): a setting the user fixed is taken
as given; a setting left to ``auto`` must be given by the decider, or this refuses. Nothing
here gives ``auto`` a meaning of its own.

The layer kernels (trainer.rms_norm_kernel, swiglu_kernel, rope_kernel: :class:`Kernels`) are
torch unless one is asked for by name, whatever the machine, until the GPU check measures
them. Choices only a rank's machine can see: the attention kernel and the loss kernel are
decided by the job from :class:`RankMachine` — what the machine the ranks run on offers (CUDA,
flash-attn, liger-kernel), probed by the job in the Python environment its ranks are started
with (:func:`rank_machine`). A rank checks that it can run what was decided
and refuses otherwise (exit 2, naming ``decisions.json`` and the field). Two kernel choices
stay with the rank, per call, because they depend on the tensors of the call and give the
same result by test: the routed experts' grouped product or loop (rank.experts), and Qwen3.5's
linear-attention kernels (memtune.linear_kernels).
"""

from __future__ import annotations

import dataclasses
import os
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from memtune.config.architecture import linear_attention_layers, rank_kv_heads, routed_experts
from memtune.config.schema import (
    AttnImplementation,
    DropoutKernel,
    FusedKernel,
    LeanKernel,
    Loss,
    Optimizer,
    PeftMethod,
    RunConfig,
    Switch,
    ZeroStage,
    choices_of,
)

DECISIONS_VERSION = 1
"""decisions.json's format. A run dir or checkpoint without the file (written before it
existed) is decided again by the job, as it was then."""

Recompute = Literal["keep", "selective", "full"]
"""One decoder layer's activations in backward: keep (every activation the forward saved) |
selective (its input, its base matmuls', LoRA's A and attention's outputs; the cheap ops —
norms, activations, rotary, dropout, LoRA's r-deep B — recomputed in backward: torch's
selective activation checkpointing, rank.layers) | full (only its input; its whole forward
recomputed)."""
AttentionKernel = Literal["sdpa_varlen", "sdpa", "eager", "flash_attention_2", "torch_varlen"]
"""model.attn_implementation as run: ``auto`` decided (rank.attention: sdpa_varlen)."""
SPLITTING_KERNELS: tuple[AttentionKernel, ...] = (
    "sdpa_varlen",
    "torch_varlen",
    "flash_attention_2",
)
"""The attention kernels that can run one call per KV head (rank.attention's own two, and
transformers' FlashAttention-2 function, which rank.attention wraps): every kernel ``auto``
decides; not transformers' ``sdpa`` or ``eager``."""
LossKernel = Literal["chunked", "plain", "liger"]
"""trainer.loss as run: ``auto`` decided (rank.loss)."""
LayerKernel = Literal["torch", "liger"]
"""trainer.rope_kernel as run: transformers' own code, or Liger's fused kernel (rank.kernels);
``auto`` decided torch until the GPU check measures it."""
LEAN_KERNELS = ("rms_norm", "swiglu")
"""The layer kernels memtune has a lean one of (rank.lean_norm, rank.lean_swiglu)."""
LeanLayerKernel = Literal["torch", "lean", "liger"]
"""trainer.rms_norm_kernel / swiglu_kernel as run: transformers' own code, memtune's lean
RMSNorm or SwiGLU (the same ops, less kept for backward: rank.lean_norm, rank.lean_swiglu), or
Liger's fused kernel."""
LoraDropout = Literal["peft", "regenerate"]
"""trainer.lora_dropout_kernel as run: peft's dropout module (its dropped copies and masks kept
for backward), or the mask regenerated in backward (rank.lora_dropout)."""
ALLOC_CONF_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
"""Where torch reads its allocator settings, in the order it reads them (the first is torch
2.9's name for every device; the second the older, CUDA's own)."""
EXPANDABLE = "expandable_segments:True"
ExpertStorage = Literal["compute", "nf4", "fp4", "int8"]
"""A mixture's routed-expert stacks: in the compute dtype, or quantized (rank.experts)."""


class DecisionError(ValueError):
    """A decided value that cannot be used; the message names the field (and the file)."""


@dataclass(frozen=True)
class RankMachine:
    """What the machine the ranks run on offers, as the job sees it (memtune.machine)."""

    cuda: bool
    flash_attn: bool = False
    liger: bool = False


CPU_RANKS = RankMachine(cuda=False)
"""CPU ranks: no CUDA, so neither FlashAttention-2 nor Liger's kernels."""


def rank_machine() -> RankMachine:
    """What the ranks' machine offers, seen from the job: the ranks run on this machine (or on
    nodes like it, in the same Python environment: the launchers start them with this
    interpreter), so what is true here is what they will find. A rank that finds otherwise
    refuses the decided kernel by name (rank.build)."""
    import importlib.util

    from memtune.machine import cuda_available

    cuda = cuda_available()
    return RankMachine(
        cuda=cuda,
        flash_attn=cuda and importlib.util.find_spec("flash_attn") is not None,
        liger=cuda and importlib.util.find_spec("liger_kernel") is not None,
    )


@dataclass(frozen=True)
class Checkpointing:
    """Activation checkpointing, decided per decoder layer.

    ``layers[i]`` is layer i's choice, in the order ``full``, ``selective``, ``keep``: the
    layers that keep the least come first, since backward reaches them last, once the later
    layers' activations are freed, so one recomputed layer at a time adds to what is left
    (memory.estimate.activation_bytes). ``enabled``: transformers' checkpointing is installed
    on the model (trainer.activation_checkpointing); with no layer recomputed and the
    non-reentrant checkpoint the step keeps what it keeps with it off (transformers' hook that
    makes the embedding's output require a gradient dropped: rank.layers). Selective layers
    need the non-reentrant checkpoint (torch's selective checkpointing runs only there)."""

    layers: tuple[Recompute, ...]
    enabled: bool = True
    reentrant: bool = False

    def __post_init__(self) -> None:
        allowed = choices_of(Recompute)
        bad = [i for i, kind in enumerate(self.layers) if kind not in allowed]
        if bad:
            raise DecisionError(
                f"checkpointing.layers[{bad[0]}] is {self.layers[bad[0]]!r}, not one of "
                f"{' | '.join(choices_of(Recompute))}"
            )
        k, s = self.recomputed, self.selective
        if self.layers[: k + s] != ("full",) * k + ("selective",) * s:
            raise DecisionError(
                "checkpointing.layers: the layers recomputed in full come first, then the "
                f"selective ones, then those that keep everything (got {list(self.layers)})"
            )
        if (k or s) and not self.enabled:
            raise DecisionError("checkpointing: layers recompute but enabled is false")
        if self.reentrant and not self.enabled:
            raise DecisionError("checkpointing: reentrant without enabled")
        if s and self.reentrant:
            raise DecisionError(
                "checkpointing: selective layers need the non-reentrant checkpoint "
                "(reentrant: false)"
            )

    @classmethod
    def first(
        cls, recomputed: int, layers: int, reentrant: bool = False, selective: int = 0
    ) -> Checkpointing:
        """The first ``recomputed`` of ``layers`` decoder layers recompute in full, the next
        ``selective`` selectively, the rest keep everything."""
        k = max(0, min(recomputed, layers))
        s = max(0, min(selective, layers - k))
        kinds: list[Recompute] = [
            "full" if i < k else "selective" if i < k + s else "keep" for i in range(layers)
        ]
        return cls(tuple(kinds), True, reentrant)

    @classmethod
    def off(cls, layers: int) -> Checkpointing:
        kinds: list[Recompute] = ["keep"] * layers
        return cls(tuple(kinds), enabled=False)

    @property
    def recomputed(self) -> int:
        """How many decoder layers recompute their whole forward."""
        return self.layers.count("full")

    @property
    def selective(self) -> int:
        """How many decoder layers recompute their elementwise ops only."""
        return self.layers.count("selective")

    @property
    def embedding_output_grad_free(self) -> bool:
        """The first layer keeps everything and the checkpoint is non-reentrant (reentrant
        makes its input require a gradient): the frozen embedding's output needs none, as
        with checkpointing off (rank.layers drops transformers' hook that gives it one)."""
        return self.layers[:1] == ("keep",) and not self.reentrant

    def label(self) -> str:
        """For humans: "off", "all 28 layers", "9 of 28 layers", "9 of 28 layers, 12 more
        selectively", "12 of 28 layers selectively"."""
        k, s, n = self.recomputed, self.selective, len(self.layers)
        if k == 0:
            return "off" if s == 0 else f"{s} of {n} layers selectively"
        full = f"all {n} layers" if k == n else f"{k} of {n} layers"
        return full + (f", {s} more selectively" if s else "")


@dataclass(frozen=True)
class BatchShape:
    """The step's arithmetic, owned here: rows per optimizer step over all ranks, rows per rank
    per forward, the ranks and how each sequence is split over them. DeepSpeed's batch fields,
    the data's per-step summary (data.packing), the sampler's global batch and the planner's
    tokens per rank all read it."""

    global_batch: int
    """Rows per optimizer step over all ranks (packed rows, or samples / pairs unpacked)."""
    micro_batch: int
    """Rows per rank per forward."""
    ranks: int
    sequence_parallel: int
    """Ranks each sequence is split over (Ulysses); the others are data-parallel groups."""
    row_tokens: int
    """data.max_seq_len: a row's capacity."""

    def __post_init__(self) -> None:
        for name in ("global_batch", "micro_batch", "ranks", "sequence_parallel", "row_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise DecisionError(f"batch.{name} must be an integer >= 1 (got {value!r})")
        if self.ranks % self.sequence_parallel:
            raise DecisionError(
                f"batch.sequence_parallel={self.sequence_parallel} does not divide "
                f"batch.ranks={self.ranks}"
            )
        if self.global_batch % self.micro_step_rows:
            raise DecisionError(
                f"batch.global_batch={self.global_batch} is not a multiple of batch.micro_batch "
                f"× data-parallel ranks = {self.micro_step_rows}"
            )

    @property
    def data_parallel(self) -> int:
        """Ranks that read different data: the ranks over the sequence-parallel size."""
        return self.ranks // self.sequence_parallel

    @property
    def micro_step_rows(self) -> int:
        """Rows one micro step takes over all data-parallel ranks."""
        return self.micro_batch * self.data_parallel

    @property
    def accumulation(self) -> int:
        """Micro batches per optimizer step on each rank."""
        return self.global_batch // self.micro_step_rows

    @property
    def rank_tokens(self) -> int:
        """Tokens one rank computes per micro batch: micro × its share of a row."""
        return self.micro_batch * self.row_tokens // self.sequence_parallel

    def deepspeed(self) -> dict[str, int]:
        """DeepSpeed's batch fields (config.deepspeed fills them from here)."""
        return {
            "train_batch_size": self.global_batch,
            "train_micro_batch_size_per_gpu": self.micro_batch,
            "gradient_accumulation_steps": self.accumulation,
        }


@dataclass(frozen=True)
class Experts:
    """A mixture's routed experts: where they live and how they are stored and trained."""

    routed: int
    """Routed experts per mixture layer."""
    adapted: bool
    """LoRA on every routed expert (peft.target=all-linear)."""
    storage: ExpertStorage
    parallel: int = 1
    """Ranks the experts are split over by expert (expert parallelism, rank.expert_parallel:
    each group of ``parallel`` ranks holds routed / parallel experts a layer on each rank, and
    sends tokens to them by all-to-all); 1: every rank holds every expert, and ZeRO-3 shards
    them with the other weights. Built under ZeRO-2 only."""

    def __post_init__(self) -> None:
        if not isinstance(self.routed, int) or isinstance(self.routed, bool) or self.routed < 1:
            raise DecisionError(f"experts.routed must be an integer >= 1 (got {self.routed!r})")
        if self.storage not in choices_of(ExpertStorage):
            raise DecisionError(
                f"experts.storage is {self.storage!r}, not one of "
                f"{' | '.join(choices_of(ExpertStorage))}"
            )
        if not isinstance(self.parallel, int) or isinstance(self.parallel, bool):
            raise DecisionError(f"experts.parallel must be an integer (got {self.parallel!r})")
        if self.parallel < 1 or self.routed % self.parallel:
            raise DecisionError(
                f"experts.parallel={self.parallel} does not divide experts.routed={self.routed}"
            )


@dataclass(frozen=True)
class Vision:
    """A vision-language model's vision tower and merger, loaded for a run on images (the
    released class, ``AutoModelForImageTextToText``, instead of its text model): in the
    compute dtype (never quantized), sharded under ZeRO-3 with the other weights (rank.vision).
    Decided with the rest by the planner (:func:`vision_of`, through :func:`decisions_for`)
    when the plan is told of images (plan.images) or the target adapts the tower, and planned
    with them (memory.vision); once the data is read the job decides it from the data
    (launcher.prepare.vision_for_images) and plans again when the data says otherwise."""

    adapted: bool
    """LoRA on the tower's blocks and the merger (peft.target attention-and-vision |
    all-linear-and-vision); else they are frozen."""
    recompute: bool
    """The tower's blocks recomputed in backward, all of them: when adapted and the language
    model recomputes any layer (a frozen tower keeps no activations: nothing in it needs a
    gradient)."""


@dataclass(frozen=True)
class Kernels:
    """The kernels the decoder layers run (rank.kernels): transformers' own code (``torch``),
    Liger's fused kernels (``liger``), or for RMSNorm and SwiGLU memtune's lean ones
    (rank.lean_norm, rank.lean_swiglu); and
    how LoRA's dropout keeps what backward needs (rank.lora_dropout). A decisions.json written
    before a field existed reads as torch and peft: those runs ran transformers' and peft's
    code."""

    rms_norm: LeanLayerKernel = "torch"
    swiglu: LeanLayerKernel = "torch"
    rope: LayerKernel = "torch"
    lora_dropout: LoraDropout = "peft"

    def __post_init__(self) -> None:
        closed = {"rms_norm": LeanLayerKernel, "swiglu": LeanLayerKernel, "rope": LayerKernel}
        for name, literal in closed.items():
            value = getattr(self, name)
            if value not in choices_of(literal):
                raise DecisionError(
                    f"kernels.{name} is {value!r}, not one of {' | '.join(choices_of(literal))}"
                )
        if self.lora_dropout not in choices_of(LoraDropout):
            raise DecisionError(
                f"kernels.lora_dropout is {self.lora_dropout!r}, not one of "
                f"{' | '.join(choices_of(LoraDropout))}"
            )

    def fused(self) -> list[str]:
        """The kernels decided ``liger``, by name (``["rms_norm", "rope"]``)."""
        return [name for name in ("rms_norm", "swiglu", "rope") if getattr(self, name) == "liger"]

    def lean(self) -> list[str]:
        """The kernels decided ``lean``, by name (``["rms_norm", "swiglu"]``)."""
        return [name for name in LEAN_KERNELS if getattr(self, name) == "lean"]

    def label(self) -> str:
        """For humans: "torch", "lean RMSNorm + SwiGLU", or "Liger RMSNorm + SwiGLU" (the rest
        torch)."""
        names = {"rms_norm": "RMSNorm", "swiglu": "SwiGLU", "rope": "rotary"}
        fused, lean = self.fused(), self.lean()
        parts = ["lean " + " + ".join(names[n] for n in lean)] if lean else []
        if fused:
            parts.append("Liger " + " + ".join(names[n] for n in fused))
        return ", ".join(parts) or "torch"


@dataclass(frozen=True)
class Decisions:
    """Everything decided for a run (the module docstring says how, and what stays with the
    rank)."""

    zero_stage: ZeroStage
    zero_template: str | None
    """A ds_configs/ name or .json path; None: ``zero{stage}``."""
    peft_method: PeftMethod
    optimizer: Optimizer
    attention: AttentionKernel
    loss: LossKernel
    checkpointing: Checkpointing
    tiled_mlp: bool
    offload_activations: bool
    """Checkpointed layers keep their input in host memory (needs checkpointing)."""
    batch: BatchShape
    experts: Experts | None = None
    vision: Vision | None = None
    kernels: Kernels = Kernels()
    cuda_alloc_conf: str = ""
    """The CUDA caching allocator's settings the ranks start with (PYTORCH_CUDA_ALLOC_CONF's
    form; "": torch's defaults, as a decisions.json written before the field reads)."""
    attention_by_kv_head: bool = False
    """Attention runs one kernel call per KV head on the rank (rank.attention; memtune's
    attention functions only; false, as a decisions.json written before the field reads)."""
    version: int = DECISIONS_VERSION

    def __post_init__(self) -> None:
        closed = {
            "zero_stage": ZeroStage,
            "peft_method": PeftMethod,
            "optimizer": Optimizer,
            "attention": AttentionKernel,
            "loss": LossKernel,
        }
        for name, literal in closed.items():
            value = getattr(self, name)
            if value not in choices_of(literal):
                raise DecisionError(
                    f"{name} is {value!r}, not one of "
                    f"{' | '.join(str(c) for c in choices_of(literal))}"
                )
        for name in ("tiled_mlp", "offload_activations", "attention_by_kv_head"):
            if not isinstance(getattr(self, name), bool):
                raise DecisionError(f"{name} must be true or false (got {getattr(self, name)!r})")
        if self.zero_template is not None and not isinstance(self.zero_template, str):
            raise DecisionError(
                f"zero_template must be a string or null (got {self.zero_template!r})"
            )
        if not isinstance(self.cuda_alloc_conf, str):
            raise DecisionError(f"cuda_alloc_conf must be a string (got {self.cuda_alloc_conf!r})")
        if self.experts is not None and self.kernels.fused():
            raise DecisionError(
                f"kernels.{self.kernels.fused()[0]} is liger with experts (a mixture of "
                "experts): Liger's layer kernels are built for the dense Qwen models only"
            )
        if self.vision is not None and self.kernels.fused():
            raise DecisionError(
                f"kernels.{self.kernels.fused()[0]} is liger with vision (data with images): "
                "not built together yet"
            )
        if self.experts is not None and self.experts.parallel > 1:
            ep = self.experts.parallel
            if self.batch.ranks % ep:
                raise DecisionError(
                    f"experts.parallel={ep} does not divide batch.ranks={self.batch.ranks}"
                )
            if self.sequence_parallel > 1:
                raise DecisionError(
                    f"experts.parallel={ep} with sequence_parallel > 1: not built together "
                    "(expert parallelism runs with sequences whole)"
                )
        if self.attention_by_kv_head and self.attention not in SPLITTING_KERNELS:
            raise DecisionError(
                f"attention_by_kv_head with attention {self.attention}: built into "
                f"{' | '.join(SPLITTING_KERNELS)} only"
            )
        if self.offload_activations and not self.checkpointing.enabled:
            raise DecisionError("offload_activations needs checkpointing (enabled: true)")
        if self.checkpointing.selective:
            unbuilt = [
                what
                for what, on in (
                    ("tiled_mlp", self.tiled_mlp),
                    ("offload_activations", self.offload_activations),
                    ("experts (a mixture of experts)", self.experts is not None),
                    ("attention eager (its scores would be kept)", self.attention == "eager"),
                )
                if on
            ]
            if unbuilt:
                raise DecisionError(
                    f"checkpointing.layers: selective layers with {unbuilt[0]}: not built together"
                )

    @property
    def sequence_parallel(self) -> int:
        return self.batch.sequence_parallel

    def with_recompute(self, recomputed: int, selective: int = 0) -> Decisions:
        """These decisions with the first ``recomputed`` layers recomputing in full and the
        next ``selective`` selectively (checkpointing on)."""
        c = self.checkpointing
        mix = Checkpointing.first(recomputed, len(c.layers), c.reentrant, selective)
        return self.with_checkpointing(mix)

    def with_checkpointing(self, mix: Checkpointing) -> Decisions:
        """These decisions with the decoder layers checkpointed as ``mix``, and an adapted
        vision tower recomputing with them (:func:`vision_of`'s rule)."""
        vision = self.vision
        if vision is not None:
            vision = Vision(vision.adapted, tower_recomputes(vision.adapted, mix))
        return dataclasses.replace(self, checkpointing=mix, vision=vision)

    def as_dict(self) -> dict[str, Any]:
        """decisions.json's content: the format version first, then each decision."""
        out = dataclasses.asdict(self)
        out["checkpointing"]["layers"] = list(self.checkpointing.layers)
        return {"version": out.pop("version"), **out}

    @classmethod
    def from_dict(cls, raw: Any) -> Decisions:
        """The value a ``decisions.json`` holds, checked field by field: a missing or unknown
        field, ``auto`` or any value that cannot be used raises DecisionError naming it."""
        if not isinstance(raw, dict):
            raise DecisionError("not a JSON object")
        version = raw.get("version")
        if version != DECISIONS_VERSION:
            raise DecisionError(
                f"version is {version!r}; this memtune reads version {DECISIONS_VERSION} "
                "(a run dir from another memtune: lay it out again with train.py)"
            )
        body = dict(raw)
        body["checkpointing"] = _record(Checkpointing, body.get("checkpointing"), "checkpointing")
        body["batch"] = _record(BatchShape, body.get("batch"), "batch")
        experts = body.get("experts")
        body["experts"] = None if experts is None else _record(Experts, experts, "experts")
        vision = body.get("vision")
        body["vision"] = None if vision is None else _record(Vision, vision, "vision")
        if "kernels" in body:  # absent: written before the field, when every run was torch's
            body["kernels"] = _record(Kernels, body["kernels"], "kernels")
        decided = _record(cls, body, "")
        if "auto" in _leaves(raw):
            # Every closed choice refuses it already; this names the field for a free one.
            raise DecisionError(f"{_path_of(raw, 'auto')} is 'auto': decisions hold no auto")
        return decided


def _record(cls: type, raw: Any, where: str) -> Any:
    """``cls(**raw)`` with the field names checked: DecisionError naming a missing or unknown
    field, or a value the type refuses."""
    prefix = f"{where}." if where else ""
    if not isinstance(raw, dict):
        raise DecisionError(f"{where or 'the file'} is missing or not an object")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise DecisionError(f"{prefix}{unknown[0]} is not a decision field")
    missing = [
        name
        for name, f in fields.items()
        if name not in raw
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise DecisionError(f"{prefix}{missing[0]} is missing")
    values = dict(raw)
    if cls is Checkpointing:
        if not isinstance(values["layers"], list):
            raise DecisionError("checkpointing.layers must be a list (one choice per layer)")
        values["layers"] = tuple(values["layers"])
    hints = typing.get_type_hints(cls)
    for name, value in values.items():
        if hints[name] is bool and not isinstance(value, bool):
            raise DecisionError(f"{prefix}{name} must be true or false (got {value!r})")
    try:
        return cls(**values)
    except DecisionError as err:
        text = str(err)
        raise DecisionError(text if text.startswith(prefix) else f"{prefix}{text}") from None


def _leaves(node: Any) -> list[Any]:
    if isinstance(node, dict):
        return [x for v in node.values() for x in _leaves(v)]
    if isinstance(node, list):
        return [x for v in node for x in _leaves(v)]
    return [node]


def _path_of(node: Any, value: Any, prefix: str = "") -> str:
    if isinstance(node, dict):
        for k, v in node.items():
            found = _path_of(v, value, f"{prefix}{k}.")
            if found:
                return found
    elif isinstance(node, list):
        for i, v in enumerate(node):
            found = _path_of(v, value, f"{prefix.rstrip('.')}[{i}].")
            if found:
                return found
    elif node == value:
        return prefix.rstrip(".")
    return ""


# --- from the user's settings and the planner's choices -----------------------------------


def requested_recompute(cfg: RunConfig) -> int | None:
    """trainer.checkpoint_layers as the user asked: a number of layers (``all``: every one),
    or None for ``auto`` (the planner's to choose)."""
    value = str(cfg.trainer.checkpoint_layers)
    layers = int(cfg.model.architecture.get("num_hidden_layers") or 0)
    if value == "auto":
        return None
    return layers if value == "all" else min(int(value), layers)


def requested_selective(cfg: RunConfig, recompute: int) -> int | None:
    """trainer.selective_layers as the user asked, of the layers not recomputed in full
    (``recompute`` of them): a number (``all``: every other one), or None for ``auto``."""
    value = str(cfg.trainer.selective_layers)
    rest = int(cfg.model.architecture.get("num_hidden_layers") or 0) - recompute
    if value == "auto":
        return None
    return max(0, rest) if value == "all" else min(int(value), max(0, rest))


def requested_sequence_parallel(cfg: RunConfig) -> int | None:
    """trainer.sequence_parallel as the user asked, None for ``auto``."""
    value = str(cfg.trainer.sequence_parallel)
    return None if value == "auto" else int(value)


def requested_expert_parallel(cfg: RunConfig) -> int:
    """trainer.expert_parallel as the user asked, and ``auto`` 1: the decisions a run starts
    from before memory.fit chooses the experts' layout (memory.layouts, the ZeRO stage with
    it) and replaces them with the chosen layout's."""
    value = str(cfg.trainer.expert_parallel)
    return 1 if value == "auto" else int(value)


def requested_switch(value: str) -> bool | None:
    """An auto | on | off setting as the user asked, None for ``auto``."""
    return None if value == "auto" else value == "on"


def attention_kernel(
    requested: AttnImplementation, machine: RankMachine, precision: str = "bf16"
) -> AttentionKernel:
    """model.attn_implementation on the ranks' machine: ``auto`` is FlashAttention-2 where it
    runs (CUDA and flash-attn, in bf16 or fp16: its kernels have no fp32, and transformers
    only warns, so an fp32 run stopped in its first forward), else sdpa_varlen (SDPA per
    sample, no dense mask)."""
    if requested == "auto":
        flash = machine.cuda and machine.flash_attn and precision != "fp32"
        return "flash_attention_2" if flash else "sdpa_varlen"
    return requested


def loss_kernel(requested: Loss, machine: RankMachine) -> LossKernel:
    """trainer.loss on the ranks' machine: ``auto`` is memtune's chunked loss, wherever it
    runs. Liger's fused linear cross-entropy runs when asked for by name (``liger``): like the
    layer kernels, it is kept on by default only once the GPU check shows it faster at equal
    loss (issue #47; it used to be ``auto``'s choice wherever liger-kernel was installed)."""
    del machine  # what it offers decides no loss kernel until one is measured faster
    return "chunked" if requested == "auto" else requested


def fused_kernel(requested: FusedKernel) -> LayerKernel:
    """A layer-kernel setting as run: ``auto`` is torch (transformers' own code) until the GPU
    check (bench/gpu_check, phase ``kernels``) shows Liger's faster at equal loss; a kernel
    asked for by name is taken as given, and a rank that cannot run it refuses."""
    return "torch" if requested == "auto" else requested


KERNEL_MODELS = ("qwen2", "qwen3")
"""The model types rank.kernels wires its layer kernels into: the dense Qwen2 / Qwen2.5 and
Qwen3 layers."""


def kernels_unwired(cfg: RunConfig) -> str | None:
    """Why rank.kernels' layer kernels (Liger's, the lean RMSNorm) are not wired into ``cfg``'s
    model — not a dense Qwen2 / Qwen3 —, or None."""
    arch = dict(cfg.model.architecture)
    if routed_experts(arch):
        return "a mixture of experts"
    if linear_attention_layers(arch):
        return "a hybrid with linear-attention layers (Qwen3.5)"
    if arch.get("model_type") not in KERNEL_MODELS:
        return f"model_type {arch.get('model_type')!r}"
    return None


def lean_unbuilt(cfg: RunConfig) -> str | None:
    """Why memtune's lean RMSNorm and SwiGLU are not wired for ``cfg`` (rank.kernels), or
    None."""
    if cfg.trainer.compile:
        return "trainer.compile=true (the compiled layers fuse these ops themselves)"
    return kernels_unwired(cfg)


def lean_kernel(cfg: RunConfig, requested: LeanKernel) -> LeanLayerKernel:
    """trainer.rms_norm_kernel / swiglu_kernel as run: ``auto`` is memtune's lean kernel
    wherever it is wired (transformers' values, less kept for backward), else transformers'
    own; Liger's only by name."""
    if requested != "auto":
        return requested
    return "lean" if lean_unbuilt(cfg) is None else "torch"


def dropout_regeneration_unbuilt(cfg: RunConfig) -> str | None:
    """Why LoRA dropout cannot be regenerated for ``cfg`` (rank.lora_dropout), or None."""
    if cfg.peft.dora:
        return "peft.dora=true (peft's DoRA path drops inside its own forward)"
    if cfg.trainer.compile:
        return "trainer.compile=true (the random state is read outside the compiled graph)"
    return None


def dropout_kernel(
    cfg: RunConfig, requested: DropoutKernel, chosen: LoraDropout | None = None
) -> LoraDropout:
    """trainer.lora_dropout_kernel as run. ``auto``: the decider's choice (memory.recompute
    compares the two by step time within the memory), or before it chooses, regenerated
    wherever that is built and something is dropped (the same gradients, none of the copies),
    else peft's."""
    if requested != "auto":
        return _given("lora_dropout_kernel", requested, chosen)
    if chosen is not None:
        return chosen
    if cfg.peft.dropout > 0 and dropout_regeneration_unbuilt(cfg) is None:
        return "regenerate"
    return "peft"


def first_input_needs_no_grad(d: Decisions) -> bool:
    """The first layer's input needs no gradient: the embedding's output is grad-free
    (Checkpointing.embedding_output_grad_free) and no adapted tower's features are scattered
    into it. Its first norm and the projections reading it then keep nothing for one, and
    compute no input gradient (memory.estimate, memory.step_time)."""
    tower_grads = d.vision is not None and d.vision.adapted
    return d.checkpointing.embedding_output_grad_free and not tower_grads


def keeps_dropout_copies(cfg: RunConfig, d: Decisions) -> bool:
    """Whether LoRA dropout keeps each adapter's dropped input copy and mask for backward
    (peft's dropout), or nothing beyond the input the adapters share, as at peft.dropout=0
    (none dropped, or regenerated in backward: rank.lora_dropout)."""
    return cfg.peft.dropout > 0 and d.kernels.lora_dropout == "peft"


def kernels_of(cfg: RunConfig, lora_dropout: LoraDropout | None = None) -> Kernels:
    """trainer.rms_norm_kernel, swiglu_kernel, rope_kernel and lora_dropout_kernel as decided
    (``lora_dropout``: the decider's choice for an ``auto`` one)."""
    t = cfg.trainer
    return Kernels(
        rms_norm=lean_kernel(cfg, t.rms_norm_kernel),
        swiglu=lean_kernel(cfg, t.swiglu_kernel),
        rope=fused_kernel(t.rope_kernel),
        lora_dropout=dropout_kernel(cfg, t.lora_dropout_kernel, lora_dropout),
    )


def experts_of(cfg: RunConfig) -> Experts | None:
    """A mixture's routed experts as the settings decide them; None for a dense model."""
    from memtune.config.derive import adapts_experts

    count = routed_experts(dict(cfg.model.architecture))
    if not count:
        return None
    method = cfg.peft.method
    storage: ExpertStorage = (
        "int8" if method == "lora-int8" else cfg.peft.quant_type if method == "qlora" else "compute"
    )
    return Experts(count, adapts_experts(cfg), storage, requested_expert_parallel(cfg))


def vision_of(
    cfg: RunConfig, checkpointing: Checkpointing, images: bool | None = None
) -> Vision | None:
    """The vision tower as decided, or None (the text model). ``images``: whether the data has
    images, once it is read; None before, when the plan is told of them by plan.images and the
    tower is that of model.vision (empty: a text model, nothing to load). peft.target
    ``*-and-vision`` loads it too (the data must then have images: launcher.prepare). An
    adapted tower recomputes its blocks when the language model recomputes any layer."""
    from memtune.config.derive import adapts_vision

    adapted = adapts_vision(cfg)
    if images is None:
        if not cfg.model.vision:
            return None
        images = cfg.plan.images > 0
    if not (images or adapted):
        return None
    return Vision(adapted, tower_recomputes(adapted, checkpointing))


def tower_recomputes(adapted: bool, checkpointing: Checkpointing) -> bool:
    """Vision.recompute: an adapted tower's blocks recompute when the language model recomputes
    any layer (in full or selectively); a frozen tower keeps nothing to recompute."""
    return adapted and any(layer != "keep" for layer in checkpointing.layers)


def _given(name: str, asked: Any, chosen: Any) -> Any:
    """The user's fixed setting, or the decider's choice for an ``auto`` one."""
    if asked is None:
        if chosen is None:
            raise DecisionError(
                f"trainer.{name}=auto is the planner's to decide (memory.fit): no value chosen"
            )
        return chosen
    if chosen is not None and chosen != asked:
        raise DecisionError(f"trainer.{name} is set to {asked!r}; the choice {chosen!r} differs")
    return asked


@dataclass(frozen=True)
class Choices:
    """What a decider chose for the settings left to ``auto`` (None: the setting is fixed, or
    not chosen yet). A value given for a fixed setting must equal it."""

    recompute: int | None = None
    sequence_parallel: int | None = None
    tiled_mlp: bool | None = None
    offload_activations: bool | None = None
    selective: int | None = None
    lora_dropout: LoraDropout | None = None


def decisions_for(
    cfg: RunConfig, machine: RankMachine, choices: Choices | None = None
) -> Decisions:
    """The decisions for ``cfg`` (a validated config, or one of the decider's variants of it),
    with ``choices`` for what it leaves to ``auto``."""
    choices = choices or Choices()
    t = cfg.trainer
    layers = int(cfg.model.architecture["num_hidden_layers"])
    if t.activation_checkpointing:
        k = _given("checkpoint_layers", requested_recompute(cfg), choices.recompute)
        s = _given("selective_layers", requested_selective(cfg, k), choices.selective)
        checkpointing = Checkpointing.first(k, layers, t.checkpointing_reentrant, s)
        offload = _given(
            "offload_activations",
            requested_switch(t.offload_activations),
            choices.offload_activations,
        )
    else:
        if choices.recompute or choices.selective:
            raise DecisionError("trainer.activation_checkpointing=false: no layer recomputes")
        checkpointing = Checkpointing.off(layers)
        offload = False  # it moves checkpointed layers' inputs: there are none
    sp = _given("sequence_parallel", requested_sequence_parallel(cfg), choices.sequence_parallel)
    tiled = _given("tiled_mlp", requested_switch(t.tiled_mlp), choices.tiled_mlp)
    batch = BatchShape(
        global_batch=t.global_batch_size,
        micro_batch=t.micro_batch_size,
        ranks=cfg.launcher.num_ranks,
        sequence_parallel=sp,
        row_tokens=cfg.data.max_seq_len,
    )
    attention = attention_kernel(cfg.model.attn_implementation, machine, t.precision)
    return Decisions(
        zero_stage=cfg.zero.stage,
        zero_template=cfg.zero.template,
        peft_method=cfg.peft.method,
        optimizer=t.optimizer,
        attention=attention,
        loss=loss_kernel(t.loss, machine),
        checkpointing=checkpointing,
        tiled_mlp=tiled,
        offload_activations=offload,
        batch=batch,
        experts=experts_of(cfg),
        vision=vision_of(cfg, checkpointing),
        kernels=kernels_of(cfg, choices.lora_dropout),
        cuda_alloc_conf=cuda_alloc_conf(cfg),
        attention_by_kv_head=by_kv_head(cfg, attention, tiled, sp),
    )


def by_kv_head(cfg: RunConfig, attention: AttentionKernel, tiled_mlp: bool, sp: int) -> bool:
    """trainer.attention_by_kv_head as run: ``auto`` is on with the MLP tiled (there the flash
    backward's temporaries are a recomputed layer's peak: memory.attention) where the decided
    kernel can split (:data:`SPLITTING_KERNELS`) and a rank holds more than one KV head (a
    Ulysses split leaves max(kv, sp) / sp). ``on`` with a kernel that cannot is refused by
    config.validate: ``auto`` attention decides only kernels that can."""
    requested: Switch = cfg.trainer.attention_by_kv_head
    if requested == "auto":
        groups = rank_kv_heads(dict(cfg.model.architecture), sp)
        return tiled_mlp and attention in SPLITTING_KERNELS and groups > 1
    return requested == "on"


def cuda_alloc_conf(cfg: RunConfig, env: Mapping[str, str] | None = None) -> str:
    """trainer.expandable_segments as run: the allocator settings of the job's environment
    (``env``, default this process's) where it has any — kept as given, and carried by
    decisions.json to ranks whose launcher does not pass the environment on (DeepSpeed's
    hostfile runner over ssh) —, else expandable segments unless turned off ("": torch's
    defaults)."""
    env = os.environ if env is None else env
    given = next((env[name] for name in ALLOC_CONF_VARIABLES if env.get(name)), None)
    if given:
        return given
    return EXPANDABLE if cfg.trainer.expandable_segments else ""


def with_sections(cfg: RunConfig, **sections: dict[str, Any]) -> RunConfig:
    """``cfg`` with fields of some sections replaced (``with_sections(cfg, data={"max_seq_len":
    512})``): new objects for those sections and the top level, the rest shared. The decider's
    variants of the user's settings are made this way, never by copying or mutating them."""
    return dataclasses.replace(
        cfg,
        **{
            name: dataclasses.replace(getattr(cfg, name), **fields)
            for name, fields in sections.items()
        },
    )
