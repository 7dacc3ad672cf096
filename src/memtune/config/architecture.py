"""Which architecture a run plans: the checkpoint's own ``config.json`` when it is on disk.

A model config group carries ``model.architecture`` (the fields of its config.json) so that a
plan can be made offline for a hub name that is not downloaded. But the ranks load whatever
``model.name_or_path`` holds: a local directory of a 48-layer model planned as the group's
28-layer one would be refused by nothing until it ran out of memory on the card. So when the
checkpoint's config.json can be read without a download (a local directory, or the local
Hugging Face cache), the plan uses it, and a disagreement with the group is refused before
launch, naming the fields, unless ``model.architecture_source=checkpoint`` says the checkpoint
wins. After loading, every rank checks that the model it holds is the one that was planned
(:func:`loaded_mismatches`).
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any

from memtune.config.schema import ConfigError, RunConfig
from memtune.paths import is_local_source

LINEAR_ATTENTION_FIELDS = (
    "layer_types",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
)
"""A hybrid's (Qwen3.5) linear-attention layers: which layers they are and their widths."""

MOE_FIELDS = (
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "decoder_sparse_step",
    "mlp_only_layers",
    "norm_topk_prob",
)
"""A mixture of experts' (Qwen3-MoE, Qwen3.5-MoE) routed experts: how many, how many a token
goes to, their width, the shared expert's, and which layers have them."""

PLANNED_FIELDS = (
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "tie_word_embeddings",
    "attention_bias",
    *LINEAR_ATTENTION_FIELDS,
    *MOE_FIELDS,
)
"""What the memory plan and the parameter counts depend on; a checkpoint and its config group
must agree on each (head_dim and attention_bias as their model type defaults them)."""

KEPT_FIELDS = (
    *PLANNED_FIELDS,
    "max_position_embeddings",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "rms_norm_eps",
    "hidden_act",
    "use_sliding_window",
    "sliding_window",
    "max_window_layers",
    "partial_rotary_factor",
    "router_aux_loss_coef",
)
"""The config.json fields copied into ``model.architecture`` when the checkpoint's win (the
rest — token ids, dtype, versions, a quantization block — are not the architecture's)."""


def head_dim(arch: dict[str, Any]) -> int:
    """Per-head width: the explicit ``head_dim`` (Qwen3: 128 at every size), else
    hidden / heads (Qwen2, Qwen2.5)."""
    explicit = arch.get("head_dim")
    if explicit:
        return int(explicit)
    return int(arch["hidden_size"]) // int(arch["num_attention_heads"])


def rank_kv_heads(arch: dict[str, Any], sequence_parallel: int) -> int:
    """The KV heads one rank's attention holds: all of them, or under Ulysses a 1/sp share of
    max(kv, sp) (DeepSpeed repeats KV heads up to sp when there are fewer)."""
    kv = int(arch.get("num_key_value_heads") or arch["num_attention_heads"])
    return max(kv, sequence_parallel) // sequence_parallel


HYBRID_FULL_ATTENTION_INTERVAL = {"qwen3_5_text": 4, "qwen3_5_moe_text": 4, "qwen3_next": 4}
"""Hybrids whose config.json may leave ``layer_types`` out: transformers' config class then
makes every ``full_attention_interval``-th layer (default 4) full attention and the others
linear attention. Kept here so that a plan imports no transformers (and no torch);
tests/test_qwen35.py checks it against the config classes."""


def layer_types(arch: dict[str, Any]) -> list[str]:
    """Each decoder layer's token mixer, as transformers lays the layers out:
    ``"linear_attention"`` or an attention kind (``"full_attention"``, ``"sliding_attention"``)."""
    n = int(arch.get("num_hidden_layers") or 0)
    given = arch.get("layer_types")
    if given:
        return list(given)
    interval = HYBRID_FULL_ATTENTION_INTERVAL.get(str(arch.get("model_type")))
    if interval is None:
        return ["full_attention"] * n
    interval = int(arch.get("full_attention_interval", interval))
    return ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]


def linear_attention_layers(arch: dict[str, Any]) -> int:
    """How many decoder layers are linear attention (Gated DeltaNet: Qwen3.5's three in four);
    0 for a model of attention layers only."""
    return sum(kind == "linear_attention" for kind in layer_types(arch))


def attention_exchange_widths(arch: dict[str, Any], sequence_parallel: int) -> tuple[int, int]:
    """(out, back): the values per token an attention layer sends through Ulysses'
    all-to-alls — q, k and v out to the ranks' heads (KV heads repeated up to sp:
    :func:`rank_kv_heads`), the output back to the tokens (rank.sequence_parallel)."""
    heads = int(arch["num_attention_heads"])
    kv = int(arch.get("num_key_value_heads") or heads)
    hd = head_dim(arch)
    return hd * (heads + 2 * max(kv, sequence_parallel)), hd * heads


def linear_exchange_widths(arch: dict[str, Any]) -> tuple[int, int]:
    """(out, back): the values per token a linear-attention layer (Gated DeltaNet) sends
    through its all-to-alls (rank.linear_attention.Split) — q and k (key heads × key width
    each), v and the gate z (value heads × value width each), a and b (one number per value
    head) out to the ranks' heads; the recurrence's output (v's width) back to the tokens.
    Neither depends on sp: the layer's heads divide evenly (config.validate)."""
    keys = int(arch["linear_num_key_heads"]) * int(arch["linear_key_head_dim"])
    value_heads = int(arch["linear_num_value_heads"])
    values = value_heads * int(arch["linear_value_head_dim"])
    return 2 * keys + 2 * values + 2 * value_heads, values


FIELD_ALIASES = {"num_local_experts": "num_experts"}
"""Other spellings of planned fields: transformers 5 saves Qwen3-MoE's ``num_experts`` as
``num_local_experts`` (its config's attribute_map); the released config.json files say
``num_experts``."""


def canonical_fields(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with FIELD_ALIASES renamed to the names memtune plans by."""
    out = dict(data)
    for alias, name in FIELD_ALIASES.items():
        if alias in out:
            value = out.pop(alias)
            out.setdefault(name, value)
    return out


def routed_experts(arch: dict[str, Any]) -> int:
    """Routed experts per mixture-of-experts layer; 0 for a dense model."""
    return int(arch.get("num_experts") or 0)


def shared_expert(arch: dict[str, Any]) -> int:
    """The width of a mixture's shared expert (Qwen3.5-MoE: a dense MLP beside the routed
    experts, every token goes through it); 0 when it has none."""
    return int(arch.get("shared_expert_intermediate_size") or 0)


ALL_SPARSE = ("qwen3_5_moe_text", "qwen3_5_moe", "qwen3_next")
"""MoE model types whose every decoder layer routes (no decoder_sparse_step, no dense layers)."""


def moe_layers(arch: dict[str, Any]) -> list[bool]:
    """Whether each decoder layer's MLP is a routed-experts block, as transformers builds them:
    every layer of a Qwen3.5-MoE; in a Qwen3-MoE the layers not in ``mlp_only_layers`` whose
    index + 1 is a multiple of ``decoder_sparse_step`` (default 1: all)."""
    n = int(arch.get("num_hidden_layers") or 0)
    if not routed_experts(arch):
        return [False] * n
    if str(arch.get("model_type")) in ALL_SPARSE:
        return [True] * n
    step = int(arch.get("decoder_sparse_step") or 1)
    dense = set(arch.get("mlp_only_layers") or [])
    return [i not in dense and (i + 1) % step == 0 for i in range(n)]


def _planned_values(arch: dict[str, Any]) -> dict[str, Any]:
    """The planned fields with their model type's defaults filled in (via transformers' config
    class), so "head_dim absent" and "head_dim = hidden / heads" compare equal."""
    from transformers import AutoConfig

    arch = canonical_fields(arch)
    fields = {k: v for k, v in arch.items() if k in KEPT_FIELDS and k != "model_type"}
    try:
        config = AutoConfig.for_model(str(arch.get("model_type")), **fields)
    except (ValueError, KeyError, TypeError):
        config = None
    out: dict[str, Any] = {}
    for key in PLANNED_FIELDS:
        if key == "head_dim":
            out[key] = head_dim(arch) if "hidden_size" in arch else None
        elif key == "layer_types":  # which layers are linear attention (the kinds of attention
            # layers, full or sliding, are not planned differently)
            kinds = getattr(config, "layer_types", None) or layer_types(arch)
            out[key] = [i for i, kind in enumerate(kinds) if kind == "linear_attention"]
        elif config is not None and hasattr(config, key):
            out[key] = getattr(config, key)
        else:
            out[key] = arch.get(key)
    return out


def checkpoint_config_file(name_or_path: str, revision: str | None = None) -> Path | None:
    """The checkpoint's config.json if it can be read without a download: ``name_or_path`` is
    a local directory, or a hub name already in the local Hugging Face cache (at
    ``revision``: model.revision, None for main)."""
    path = Path(name_or_path).expanduser()
    if (path / "config.json").is_file():
        return path / "config.json"
    if path.exists() or name_or_path.count("/") != 1:
        return None
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(name_or_path, "config.json", revision=revision)
    except Exception:  # an invalid repo id: not in any cache
        return None
    return Path(cached) if isinstance(cached, str) else None


FINGERPRINT_SAMPLES = 16
FINGERPRINT_BLOCK = 64 << 10
WEIGHT_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def base_fingerprint(name_or_path: str, revision: str | None = None) -> str | None:
    """The base checkpoint's identity by content, in well under a second on a 15 GB model:
    its config.json, and of every weight file the name, the size, the first 1 MiB (a
    safetensors header: every tensor's name, dtype, shape and offset) and 16 blocks of 64 KiB
    spread over the file — a fine-tune rewrites every tensor, so it changes the sampled bytes.
    None when the checkpoint is not on disk (a hub name not downloaded)."""
    config = checkpoint_config_file(name_or_path, revision)
    if config is None:
        return None
    h = hashlib.sha256(config.read_bytes())
    for f in sorted(config.parent.iterdir()):
        if not (f.is_file() and f.name.endswith(WEIGHT_FILE_SUFFIXES)):
            continue
        size = f.stat().st_size
        h.update(f"{f.name} {size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
            for i in range(FINGERPRINT_SAMPLES):
                fh.seek(size * i // FINGERPRINT_SAMPLES)
                h.update(fh.read(FINGERPRINT_BLOCK))
    return h.hexdigest()[:32]


def adapter_fingerprint(folder: str | Path | None) -> str | None:
    """An adapter's identity by content: its weights (adapter_model.safetensors), whole (an
    adapter is MBs, not GBs); the reference tables' key (rank.reference) and a resume's
    comparison (launcher.prepare) read this one digest. r, alpha and targets are checked
    apart (config.validate). None without a folder or weights there."""
    if folder is None:
        return None
    weights = Path(folder).expanduser() / "adapter_model.safetensors"
    if not weights.is_file():
        return None
    h = hashlib.sha256()
    with open(weights, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_architecture(config_file: Path) -> dict[str, Any]:
    """The architecture fields of a config.json (KEPT_FIELDS that are present)."""
    try:
        data = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ConfigError(f"{config_file}: cannot read the model's config.json ({err})") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise ConfigError(f"{config_file}: no model_type; not a transformers config.json")
    text = canonical_fields(language_model_config(data))
    return {k: v for k, v in text.items() if k in KEPT_FIELDS}


def language_model_config(data: dict[str, Any]) -> dict[str, Any]:
    """The language model's fields of a config.json. A multimodal checkpoint (the released
    Qwen3.5: ``Qwen3_5ForConditionalGeneration``) nests them in ``text_config``, beside its
    vision tower's; memtune trains the language model, which ``AutoModelForCausalLM`` loads from
    such a checkpoint without the vision tower, so that is what is planned. Top-level fields
    the text config lacks (``tie_word_embeddings`` is written at the top) are taken over."""
    text = data.get("text_config")
    if not (isinstance(text, dict) and text.get("model_type")):
        return data
    return {**{k: v for k, v in data.items() if k != "text_config"}, **text}


LANGUAGE_MODEL_PREFIX = ("model.", "model.language_model.")
"""Where a multimodal checkpoint's class keeps the decoder that ``AutoModelForCausalLM``
loads from it: ``model.layers.N`` of the text class is ``model.language_model.layers.N`` of
``Qwen3_5ForConditionalGeneration`` (and of the other Qwen multimodal classes in transformers
5); the LM head is ``lm_head`` in both."""


def is_multimodal(name_or_path: str, revision: str | None = None) -> bool:
    """Whether the checkpoint on disk is a multimodal one (its config.json nests the language
    model in ``text_config``): what memtune trains is then its text model, and what it exports
    must name the modules as the checkpoint's own class does."""
    found = checkpoint_config_file(name_or_path, revision)
    if found is None:
        return False
    try:
        data = json.loads(found.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    text = data.get("text_config") if isinstance(data, dict) else None
    return isinstance(text, dict) and bool(text.get("model_type"))


VISION_LANGUAGE_TYPES = ("qwen3_5", "qwen3_vl", "qwen2_5_vl")
"""The vision-language checkpoints (config.json ``model_type``) memtune trains on images: their
released class with its vision tower (rank.vision). Qwen3.6 is ``qwen3_5``."""


def vision_model_type(name_or_path: str, revision: str | None = None) -> str | None:
    """The checkpoint's ``model_type`` when its config.json has a vision tower
    (``vision_config``); None for a text model, or a checkpoint not on disk."""
    found = checkpoint_config_file(name_or_path, revision)
    if found is None:
        return None
    try:
        data = json.loads(found.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not (isinstance(data, dict) and isinstance(data.get("vision_config"), dict)):
        return None
    return str(data.get("model_type"))


def mismatches(planned: dict[str, Any], actual: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(field, planned value, actual value) for each PLANNED_FIELDS entry that differs."""
    a, b = _planned_values(planned), _planned_values(actual)
    return [(k, a[k], b[k]) for k in PLANNED_FIELDS if a[k] != b[k]]


def read_vision(config_file: Path) -> dict[str, Any]:
    """A vision-language config.json's ``vision_config`` (model.vision); {} when it has none."""
    try:
        data = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    vision = data.get("vision_config") if isinstance(data, dict) else None
    return dict(vision) if isinstance(vision, dict) else {}


def resolve_architecture(cfg: RunConfig) -> tuple[RunConfig, list[str]]:
    """``cfg`` with the architecture that will really be loaded, and notes saying where it came
    from. Raises ConfigError when the checkpoint on disk contradicts ``model.architecture``
    (and model.architecture_source is not ``checkpoint``). A vision-language checkpoint on
    disk gives model.vision its ``vision_config`` (the tower the ranks load for images)."""
    out, notes = _resolve_text(cfg)
    m = out.model
    found = None if m.synthesize else checkpoint_config_file(m.name_or_path, m.revision)
    vision = read_vision(found) if found is not None else {}
    if not vision or vision == dict(m.vision):
        return out, notes
    if vision_model_type(m.name_or_path, m.revision) not in VISION_LANGUAGE_TYPES:
        # a tower memtune does not train images with (the released Qwen3.5-MoE's): its text
        # model alone, as text data loads it; images are refused by name (launcher.prepare)
        return out, notes
    differs = sorted(k for k, v in m.vision.items() if k in vision and vision[k] != v)
    if differs:
        notes.append(f"model.vision from {found} (the config group's differs in {differs})")
    out = copy.deepcopy(out)
    out.model.vision = vision
    return out, notes


def _resolve_text(cfg: RunConfig) -> tuple[RunConfig, list[str]]:
    m = cfg.model
    source = m.architecture_source
    if m.synthesize:
        return cfg, []  # built from model.architecture by memtune itself (tools.tiny)
    found = checkpoint_config_file(m.name_or_path, m.revision)
    if found is None:
        if source == "checkpoint":
            raise ConfigError(
                f"model.architecture_source=checkpoint, but {m.name_or_path!r} has no "
                "config.json on disk (not a local directory, not in the Hugging Face cache)"
            )
        if not m.architecture:
            return cfg, []  # validate() names the missing architecture
        if is_local_source(m.name_or_path):  # a path: nothing is downloaded to it
            return cfg, [
                f"planned from the config group's architecture: {m.name_or_path} holds no "
                "config.json (a path on this machine: a run needs the checkpoint there)"
            ]
        return cfg, [
            f"planned from the config group's architecture: {m.name_or_path} is not on disk "
            "(a run downloads it where the hub is reachable; its config.json is checked when "
            "the ranks load it)"
        ]
    on_disk = read_architecture(found)
    if not m.architecture:
        out = copy.deepcopy(cfg)
        out.model.architecture = on_disk
        return out, [f"architecture from {found}"]
    diffs = mismatches(m.architecture, on_disk)
    if not diffs:
        return cfg, []
    listed = ", ".join(f"{k} {old!r} → {new!r}" for k, old, new in diffs)
    if source == "checkpoint":
        out = copy.deepcopy(cfg)
        out.model.architecture = on_disk
        return out, [
            f"architecture from {found} (model.architecture_source=checkpoint): config group "
            f"→ checkpoint: {listed}"
        ]
    raise ConfigError(
        f"model.name_or_path={m.name_or_path!r} is not the model the config group describes: "
        f"its {found} differs in {listed} (config group → checkpoint). The ranks would load the "
        "checkpoint, so a plan of the group's architecture would be wrong. Plan the checkpoint "
        "with model=local (architecture from its config.json) or "
        "model.architecture_source=checkpoint, or point "
        "model.name_or_path at the model the group describes."
    )


def loaded_mismatches(cfg: RunConfig, loaded_config: Any) -> list[str]:
    """After from_pretrained: how the loaded model's config differs from the planned
    architecture ("field: planned X, loaded Y"); empty when it is the planned model."""
    # A vision-language class (its tower loaded for images) nests the planned text fields.
    loaded = language_model_config(loaded_config.to_dict())
    loaded.setdefault("head_dim", getattr(loaded_config.get_text_config(), "head_dim", None))
    return [
        f"{k}: planned {old!r}, loaded {new!r}"
        for k, old, new in mismatches(dict(cfg.model.architecture), loaded)
    ]
