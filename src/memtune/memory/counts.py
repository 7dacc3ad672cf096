"""Parameter counts from the real architecture, and the shape rules of a quantized base.

The model is instantiated on the meta device from ``model.architecture`` (the fields of its
config.json) and LoRA is applied to it with peft, so nothing is downloaded and no formula
guesses which layers exist.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import json
import math
import warnings
from dataclasses import asdict, dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

from memtune.config import ConfigError, RunConfig, cache_dir, compute_bytes, lora_targets
from memtune.config.architecture import checkpoint_config_file, layer_types, routed_experts
from memtune.config.derive import adapts_experts, adapts_vision
from memtune.expert_stacks import QUANT_BLOCK
from memtune.integrity import Store


@dataclass
class ParamCounts:
    """From the meta-device model: where the base's parameters are, and LoRA's."""

    linear: int  # decoder linear weights (quantized under QLoRA / int8)
    layer: int  # parameters of one decoder layer
    linear_rows: int  # their output rows (int8 keeps one fp32 scale per row)
    embedding: int
    head: int  # 0 when tied to the embedding
    small: int  # norms and biases: under ZeRO-3's persistence threshold, never sharded
    lora: int
    lora_inputs: list[tuple[str, int, int]]  # (name, in_features, r) of each target in a layer
    linear_shapes: list[tuple[str, int, int]]  # (name in a layer, in, out) of each linear layer
    linear_attention_lora_inputs: list[tuple[str, int, int]] = field(default_factory=list)
    """lora_inputs of a linear-attention layer (a hybrid's, Qwen3.5); empty for other models."""
    experts: int = 0
    """A mixture's routed-expert stacks (fused 3-D parameters, not nn.Linear), all layers."""
    expert_lora: int = 0
    """The part of ``lora`` on the routed experts (rank.experts), 0 unless they are adapted."""
    expert_rows: int = 0
    """The routed-expert stacks' weight rows (experts × out, every stack): int8 keeps one fp32
    scale per row."""
    vision: int = 0
    """A vision-language model's tower and merger (model.vision), not in ``base``: loaded only
    for data with images (Decisions.vision), in the compute dtype."""
    vision_lora: int = 0
    """The part of ``lora`` on the tower (peft.target ``*-and-vision``), 0 unless adapted."""
    vision_merger: int = 0
    """The part of ``vision`` in its mergers, which run once a merged token (merge² patches)."""

    @property
    def base(self) -> int:
        return self.linear + self.embedding + self.head + self.small + self.experts

    @property
    def active(self) -> int:
        """Base parameters one token computes with: all but the routed experts it is not sent
        to (num_experts_per_tok of num_experts); the base for a dense model."""
        return self.base - self.experts + round(self.experts * self.routed_share)

    routed_share: float = 1.0
    """num_experts_per_tok / num_experts (1.0 for a dense model)."""

    expert_lora_tensor: int = 0
    """Elements of the largest routed-expert adapter tensor, every expert of its stack: A
    (experts × r × in) or B (experts × out × r), one parameter each (rank.experts); 0 unless
    the experts are adapted."""

    def largest_lora_tensor(self, expert_parallel: int = 1) -> int:
        """Elements of a decoder layer's largest adapter tensor as a rank holds it: a linear
        layer's A (r × in) or B (out × r), or a routed-expert stack's A or B, of this rank's
        1/``expert_parallel`` of the experts (rank.expert_parallel splits the stacks)."""
        widths = {name.split(".")[-1]: out for name, _, out in self.linear_shapes}
        adapters = [*self.lora_inputs, *self.linear_attention_lora_inputs]
        dense = max((r * max(i, widths.get(name, 0)) for name, i, r in adapters), default=0)
        return max(dense, self.expert_lora_tensor // expert_parallel)


TEXT_STAND_INS = {"qwen3_vl_text": "qwen3", "qwen2_5_vl_text": "qwen2"}
"""Language models that transformers builds only inside their vision-language class (no
causal-LM class of their own), counted as the text model whose decoder layers and head they
share: Qwen3-VL's are Qwen3's, Qwen2.5-VL's Qwen2's (biased q/k/v). Their 3-D rotary positions
hold no weight (tests/test_vision_train.py checks the counts against the released class)."""


def arch_config(cfg: RunConfig) -> Any:
    """The transformers config of ``model.architecture`` (no weights, nothing downloaded); a
    :data:`TEXT_STAND_INS` language model as its stand-in."""
    from transformers import AutoConfig

    arch = dict(cfg.model.architecture)
    kind = str(arch.pop("model_type"))
    if kind in TEXT_STAND_INS:
        kind = TEXT_STAND_INS[kind]
        for rope in ("rope_parameters", "rope_scaling"):  # mRoPE sections: no weights
            arch.pop(rope, None)
    from huggingface_hub.errors import StrictDataclassError

    try:
        return AutoConfig.for_model(kind, **arch)
    except (TypeError, ValueError, StrictDataclassError) as err:  # its checks of the fields
        cause = " ".join(str(err.__cause__ or err).split())
        raise ConfigError(
            f"model.architecture ({_source(cfg)}): transformers refuses it as a {kind} config: "
            f"{cause}"
        ) from None


def _source(cfg: RunConfig) -> str:
    """Where model.architecture came from, for a refusal: the checkpoint's config.json when
    it is on disk, else the config group."""
    found = checkpoint_config_file(cfg.model.name_or_path, cfg.model.revision)
    return str(found) if found is not None and not cfg.model.synthesize else "the model group"


COUNTS_CACHE_FORMAT = 9
"""7: each entry carries its digest (memtune.integrity.Store.write_value); 8: the vision
tower's counts (model.vision); 9: the largest routed-expert adapter tensor
(ParamCounts.expert_lora_tensor)."""

COUNTS_CACHE = Store("counts cache", COUNTS_CACHE_FORMAT)
"""The parameter counts and the linear-mixer lines, one JSON file a key in
``$MEMTUNE_CACHE_DIR/counts/``: a damaged one is set aside and counted again."""


def cached(path: Path, what: str) -> Any:
    """The value kept at ``path``, None when there is none; a damaged entry is set aside with
    one line (or, where the cache cannot be changed, only said) and None returned: the caller
    counts again."""
    value, problem = COUNTS_CACHE.read_value(path)
    if problem is None:
        return value
    try:
        aside = COUNTS_CACHE.set_aside(path)
    except OSError as err:  # a read-only cache only costs the time, as when it cannot be written
        print(
            f"memtune: {COUNTS_CACHE.name} {path} was damaged ({problem}) and cannot be set "
            f"aside ({err.strerror}); {what} again, not kept",
            flush=True,
        )
        return None
    print(COUNTS_CACHE.damaged_line(path, problem, aside, f"{what} again"), flush=True)
    return None


def count_params(cfg: RunConfig) -> ParamCounts:
    """Instantiate the architecture on the meta device, add LoRA with peft, and count.

    The answer is kept in ``$MEMTUNE_CACHE_DIR/counts/<key>.json``, the key being what it
    depends on: the architecture, LoRA's rank and targets, and the transformers / peft / torch
    versions that build the model. Building it imports transformers' model code and peft, ~5 s
    of every ``train.py`` start on a small machine, for the same numbers each time."""
    p = cfg.peft
    key = json.dumps(
        {
            "format": COUNTS_CACHE_FORMAT,
            "architecture": dict(cfg.model.architecture),
            "vision": dict(cfg.model.vision),
            "r": p.r,
            "targets": sorted(lora_targets(cfg)),
            "rank_pattern": dict(p.rank_pattern),
            "dora": p.dora,
            "experts": adapts_experts(cfg),
            "tower": adapts_vision(cfg),
            "router": cfg.peft.train_router,
            "versions": built_with("transformers", "peft", "torch"),
        },
        sort_keys=True,
        default=str,
    )
    path = cache_dir() / "counts" / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"
    saved = cached(path, "parameters counted")
    if saved is not None:
        return ParamCounts(
            **{
                **saved,
                "lora_inputs": [tuple(x) for x in saved["lora_inputs"]],
                "linear_shapes": [tuple(x) for x in saved["linear_shapes"]],
                "linear_attention_lora_inputs": [
                    tuple(x) for x in saved["linear_attention_lora_inputs"]
                ],
            }
        )
    counts = _count_on_meta(cfg)
    with contextlib.suppress(OSError):  # a read-only or full cache only costs the time
        COUNTS_CACHE.write_value(path, asdict(counts))  # its temporary file never stays
    return counts


def _count_on_meta(cfg: RunConfig) -> ParamCounts:
    # Imported here: a launch whose counts are cached never imports torch on the job side.
    import torch
    from peft import get_peft_model
    from peft.tuners.lora import LoraLayer
    from transformers import AutoModelForCausalLM

    from memtune.config.derive import lora_config
    from memtune.expert_stacks import (
        EXPERT_PARAMETERS,
        add_expert_adapters,
        expert_modules,
        train_routers,
    )

    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model = AutoModelForCausalLM.from_config(arch_config(cfg))
        embedding = model.get_input_embeddings().weight
        head = model.get_output_embeddings()
        tied = head is not None and head.weight is embedding
        linear = rows = small = 0
        for module in model.get_decoder().layers.modules():
            if isinstance(module, torch.nn.Linear):
                linear += module.weight.numel()
                rows += module.out_features
        n_all = sum(p.numel() for p in model.parameters())
        stacks = expert_modules(model)
        experts = sum(getattr(m, name).numel() for _, m in stacks for name in EXPERT_PARAMETERS)
        expert_rows = sum(
            math.prod(getattr(m, name).shape[:-1]) for _, m in stacks for name in EXPERT_PARAMETERS
        )
        layers = list(model.get_decoder().layers)
        layer = max(sum(q.numel() for q in each.parameters()) for each in layers)
        head_n = 0 if tied or head is None else head.weight.numel()
        small = n_all - linear - embedding.numel() - head_n - experts
        targets = lora_targets(cfg)
        # One layer of each kind (a hybrid's linear-attention and attention layers differ).
        kinds = layer_types(dict(cfg.model.architecture))
        first = {kind: layers[kinds.index(kind)] for kind in dict.fromkeys(kinds)}
        linear_shapes = list(
            dict.fromkeys(
                (name, m.in_features, m.out_features)
                for each in first.values()
                for name, m in each.named_modules()
                if isinstance(m, torch.nn.Linear)
            )
        )

        # The run's own LoraConfig (one place: rank.model), but no initialisation to compute:
        # counting needs the shapes only (PiSSA's SVD on the meta device is not one).
        config = lora_config(cfg)
        config.init_lora_weights = True
        peft_model = get_peft_model(model, config)  # adapts the layers in place
        expert_lora = expert_lora_tensor = 0
        if adapts_experts(cfg):
            expert_lora = add_expert_adapters(peft_model, cfg.peft.r, 1.0)
            expert_lora_tensor = max(
                getattr(m, f"{name}_lora_{ab}").numel()
                for _, m in expert_modules(peft_model)
                for name in EXPERT_PARAMETERS
                for ab in "AB"
            )
        if cfg.peft.train_router:  # trained in full, counted with the adapters
            train_routers(peft_model)
        lora = sum(q.numel() for q in peft_model.parameters() if q.requires_grad)
        vision, vision_merger, vision_lora = _tower_counts(cfg)
        lora += vision_lora

        # What one layer's adapters keep for backward (memory.estimate.layer_bytes), for each
        # kind of layer: each adapted module's input width and its rank (peft.rank_pattern's).
        def adapted(layer: Any) -> list[tuple[str, int, int]]:
            return [
                (name.split(".")[-1], int(m.in_features or 0), int(m.r["default"]))
                for name, m in layer.named_modules()
                if isinstance(m, LoraLayer) and name.split(".")[-1] in targets
            ]

        linear_kind = first.pop("linear_attention", None)
        lora_inputs = adapted(next(iter(first.values()), layers[0]))
        linear_attention_lora_inputs = adapted(linear_kind) if linear_kind is not None else []
    return ParamCounts(
        linear,
        layer,
        rows,
        embedding.numel(),
        head_n,
        small,
        lora,
        lora_inputs,
        linear_shapes,
        linear_attention_lora_inputs,
        experts,
        expert_lora,
        routed_share=routed_share(dict(cfg.model.architecture)),
        expert_rows=expert_rows,
        vision=vision,
        vision_lora=vision_lora,
        vision_merger=vision_merger,
        expert_lora_tensor=expert_lora_tensor,
    )


def _tower_counts(cfg: RunConfig) -> tuple[int, int, int]:
    """(the tower's and merger's parameters, the mergers' alone, their LoRA's: 0 unless
    peft.target adapts them) of model.vision, built alone on the meta device as the
    vision-language class builds it."""
    if not cfg.model.vision:
        return 0, 0, 0
    import torch
    from peft import inject_adapter_in_model
    from transformers import AutoModel

    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tower = AutoModel.from_config(tower_config(cfg))
        vision = sum(q.numel() for q in tower.parameters())
        merger = sum(q.numel() for n, q in tower.named_parameters() if "merger" in n)
        if not adapts_vision(cfg):
            return vision, merger, 0
        inject_adapter_in_model(tower_lora_config(cfg), tower)
        lora = sum(q.numel() for n, q in tower.named_parameters() if "lora_" in n)
    return vision, merger, lora


def routed_share(arch: dict[str, Any]) -> float:
    """The share of a mixture's routed experts each token is sent to (1.0: dense)."""
    experts = routed_experts(arch)
    return int(arch.get("num_experts_per_tok") or 0) / experts if experts else 1.0


@functools.cache
def built_with(*libraries: str) -> tuple[str, ...]:
    """The installed versions of ``libraries``, for the counts cache's keys: read once a process.
    importlib.metadata parses a package's METADATA file on every call, and the planner keys a
    cached value on every layer it plans (a Qwen3.5-9B ``make plan`` asked 42,000 times: 24 of
    its 26 s)."""
    return tuple(version(name) for name in libraries)


MIXER_CHUNK = 64
"""transformers' chunked delta rule pads a sequence to a multiple of this many tokens."""


def linear_mixer_bytes(cfg: RunConfig, tokens: int) -> int:
    """What one linear-attention token mixer (Qwen3.5's Gated DeltaNet, without its adapters)
    keeps for backward over ``tokens`` tokens, as measured: the module is run on the meta
    device at the architecture's widths in the compute dtype, and every tensor autograd saves
    is counted (transformers' torch implementation of the conv and the chunked recurrence: fp32
    internals, per-chunk states). Measured at 2 and 4 chunks; the bytes grow linearly with the
    chunks (tests check a longer sequence), so ``tokens`` is rounded up to a whole chunk."""
    slope, base = _mixer_line(cfg)
    chunks = -(-tokens // MIXER_CHUNK)
    return round(base + slope * chunks)


_MIXER_LINES: dict[str, tuple[float, float]] = {}
"""This process's mixer lines by cache key: the file is read once, not on every plan trial."""


def _mixer_line(cfg: RunConfig) -> tuple[float, float]:
    """(bytes per chunk, bytes at zero chunks) of :func:`linear_mixer_bytes`, kept in the counts
    cache like the parameter counts."""
    key = json.dumps(
        {
            "what": "linear mixer saved bytes",
            "format": COUNTS_CACHE_FORMAT,
            "architecture": dict(cfg.model.architecture),
            "bytes": compute_bytes(cfg),
            "versions": built_with("transformers", "torch"),
        },
        sort_keys=True,
        default=str,
    )
    if key in _MIXER_LINES:  # the planner asks once per layer kind, trial and length
        return _MIXER_LINES[key]
    path = cache_dir() / "counts" / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"
    saved = cached(path, "the linear mixer measured")
    if saved is not None:
        slope, base = saved
        _MIXER_LINES[key] = (float(slope), float(base))
        return _MIXER_LINES[key]
    two, four = (_mixer_saved_on_meta(cfg, c * MIXER_CHUNK) for c in (2, 4))
    line = ((four - two) / 2, two - (four - two))
    _MIXER_LINES[key] = line
    with contextlib.suppress(OSError):
        COUNTS_CACHE.write_value(path, list(line))
    return line


def _mixer_saved_on_meta(cfg: RunConfig, tokens: int) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from memtune.config.architecture import layer_types

    dtype = torch.bfloat16 if compute_bytes(cfg) == 2 else torch.float32
    index = layer_types(dict(cfg.model.architecture)).index("linear_attention")
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = arch_config(cfg)
        config.num_hidden_layers = index + 1
        config.layer_types = config.layer_types[: index + 1]
        mixer = AutoModelForCausalLM.from_config(config).get_decoder().layers[index].linear_attn
        mixer = mixer.to(dtype).requires_grad_(False)
        x = torch.empty(1, tokens, config.hidden_size, dtype=dtype, requires_grad=True)
    saved: dict[int, int] = {}

    def pack(t: Any) -> Any:
        storage = t.untyped_storage()
        saved[storage._cdata] = storage.nbytes()
        return t

    from memtune.linear_kernels import torch_code

    with (
        torch_code(type(mixer).__module__),
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
    ):
        mixer(x)
    own = {p.untyped_storage()._cdata for p in mixer.parameters()}
    own.add(x.untyped_storage()._cdata)  # the layer input: its norm counts it
    return sum(n for ptr, n in saved.items() if ptr not in own)


def quantized_shape_problems(cfg: RunConfig, method: str, counts: ParamCounts) -> list[str]:
    """The decoder's linear layers whose shape bitsandbytes cannot quantize as configured.

    A QLoRA base stores each 4-bit weight as packed bytes (two weights a byte) viewed as the
    storage dtype (rank.model.quantization_config: the compute dtype, so ZeRO-3 can shard it), which
    needs ceil(in × out / 2) to be a multiple of that dtype's size; otherwise bitsandbytes fails
    deep inside from_pretrained ("must be divisible by 2 to view Byte as BFloat16"). Real
    checkpoints' widths are multiples of 64, but a custom architecture may not be. (LLM.int8
    keeps one int8 per weight: no such rule. bitsandbytes' CPU inference layout needs
    out % 32 == 0 too, but training never uses it: rank.model.keep_training_layout.)
    """
    if method != "qlora":
        return []
    storage = compute_bytes(cfg)
    dtype = "bf16" if storage == 2 else "fp32"
    problems = [
        f"model.layers.*.{name} (in {i}, out {o}): {-(-i * o // 2):,} packed bytes are not a "
        f"multiple of {storage} ({dtype} storage, bnb_4bit_quant_storage)"
        for name, i, o in counts.linear_shapes
        if -(-i * o // 2) % storage
    ]
    a = cfg.model.architecture
    if counts.experts:  # rank.experts: one expert's weights in whole 4-bit blocks
        h, inter = int(a["hidden_size"]), int(a["moe_intermediate_size"])
        if (h * inter) % QUANT_BLOCK:
            problems.append(
                f"model.layers.*.mlp.experts (hidden {h} × moe_intermediate {inter}): an "
                f"expert's weights are not whole blocks of {QUANT_BLOCK} (its 4-bit scales)"
            )
    return problems


VISION_LANGUAGE_OF = {
    "qwen3_5_text": "qwen3_5",
    "qwen3_vl_text": "qwen3_vl",
    "qwen2_5_vl_text": "qwen2_5_vl",
}
"""The vision-language class (config.json ``model_type``) whose language model each planned
text model is (config.architecture.VISION_LANGUAGE_TYPES)."""


def vision_language_type(cfg: RunConfig) -> str:
    """The vision-language ``model_type`` of ``cfg``'s language model, or a ConfigError naming
    model.vision when there is none."""
    text = str(cfg.model.architecture.get("model_type"))
    kind = VISION_LANGUAGE_OF.get(text)
    if kind is None:
        raise ConfigError(
            f"model.vision is set, and model.architecture is a {text} model: a vision tower is "
            f"planned for the language models of {', '.join(VISION_LANGUAGE_OF.values())} only"
        )
    return kind


def tower_config(cfg: RunConfig, **changes: Any) -> Any:
    """transformers' config of the tower (``model.vision``, with ``changes``), as the
    vision-language class builds it (its out_hidden_size the language model's width unless the
    fields say). A copy of one built once a process: building one validates every field
    (~6 ms), and the planner reads the tower's widths on every trial (3,600 times in a
    Qwen3.5-9B images plan)."""
    fields = {k: v for k, v in dict(cfg.model.vision).items() if k != "model_type"}
    fields.setdefault("out_hidden_size", int(cfg.model.architecture["hidden_size"]))
    fields.update(changes)
    kind = vision_language_type(cfg)
    key = json.dumps([kind, fields], sort_keys=True, default=str)
    if key not in _TOWER_CONFIGS:
        from transformers import AutoConfig

        built = AutoConfig.for_model(kind, vision_config=copy.deepcopy(fields))
        _TOWER_CONFIGS[key] = built.vision_config
    return copy.deepcopy(_TOWER_CONFIGS[key])


_TOWER_CONFIGS: dict[str, Any] = {}
"""This process's tower configs by their fields (:func:`tower_config`)."""


def tower_lora_config(cfg: RunConfig) -> Any:
    """The run's LoraConfig (config.derive.lora_config) aimed at a tower built alone: its
    blocks' and mergers' linear layers (config.derive.VISION_TARGETS)."""
    from memtune.config.derive import VISION_TARGETS, lora_config

    config = lora_config(cfg)
    config.target_modules = f"(?:{VISION_TARGETS})"
    config.init_lora_weights = True  # shapes only: no SVD of uninitialised weights
    config.task_type = None
    return config
