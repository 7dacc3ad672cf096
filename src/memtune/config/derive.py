"""Values derived from the user's settings, each computed in this one place: what LoRA adapts
and how, byte sizes, DeepSpeed's bucket sizes. What memtune decides for a run (recomputed
layers, sequence split, tiles, offload, the step's shape, kernels) is not derived here: it is
memory.fit's, as a config.decisions.Decisions."""

from __future__ import annotations

from typing import Any

from memtune.config.architecture import (
    linear_attention_layers,
    moe_layers,
    routed_experts,
    shared_expert,
)
from memtune.config.schema import RunConfig, ZeroStage

# The linear layers each peft.target preset adapts, by their name in a Qwen2 decoder layer.
LINEAR_ATTENTION_TARGETS = ["in_proj_qkv", "in_proj_z", "out_proj"]
"""A Gated DeltaNet layer's (Qwen3.5) counterparts of q, k, v, o: the fused q/k/v input, the
output gate's input and the output. Its two other projections, ``in_proj_a`` and ``in_proj_b``
(hidden → one value per value head: the decay and the write strength), are left out: an
adapter of rank r there adds hidden × r weights to steer 32 numbers a token."""
ATTENTION_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", *LINEAR_ATTENTION_TARGETS]
MLP_TARGETS = ["gate_proj", "up_proj", "down_proj"]
LORA_TARGETS = {
    "attention": ATTENTION_TARGETS,
    "all-linear": [*ATTENTION_TARGETS, *MLP_TARGETS],
    "all-linear-but-experts": [*ATTENTION_TARGETS, *MLP_TARGETS],
    "attention-and-vision": ATTENTION_TARGETS,
    "all-linear-and-vision": [*ATTENTION_TARGETS, *MLP_TARGETS],
}
"""peft.target → module names peft adapts; the linear-attention names only in a model that has
such layers (:func:`lora_targets`). In a mixture of experts the MLP names are the shared
expert's (Qwen3.5-MoE); the routed experts are fused 3-D parameters, not modules, and
``all-linear`` adapts them too (:func:`adapts_experts`, rank.experts)."""


VISION_SUFFIX = "-and-vision"
"""peft.target values ending so adapt a vision-language model's tower too
(:func:`adapts_vision`); in the language model they adapt what the value without it does."""

VISION_TARGETS = (
    r"blocks\.\d+\.(?:attn\.(?:qkv|proj)"
    r"|mlp\.(?:linear_fc1|linear_fc2|gate_proj|up_proj|down_proj))"
    r"|(?:merger|deepstack_merger_list\.\d+)\.(?:linear_fc1|linear_fc2|mlp\.0|mlp\.2)"
)
"""The linear layers of a Qwen vision tower's blocks (attention's fused q/k/v and output, the
MLP: Qwen3-VL's and Qwen3.5's two layers, Qwen2.5-VL's gated three) and of its mergers
(Qwen3-VL's deepstack mergers too), under ``model.visual``: what LoRA adapts there. The patch
embedding (a convolution), norms and position tables are left frozen."""


def adapts_vision(cfg: RunConfig) -> bool:
    """peft.target asks for LoRA on a vision tower and its merger (``*-and-vision``)."""
    return cfg.peft.target.endswith(VISION_SUFFIX)


def adapts_experts(cfg: RunConfig) -> bool:
    """LoRA reaches the routed experts: peft.target=all-linear on a mixture of experts (what a
    user means by "all linear": 93% of Qwen3.5-35B-A3B's weights are routed experts)."""
    language = cfg.peft.target.removesuffix(VISION_SUFFIX)
    return language == "all-linear" and routed_experts(dict(cfg.model.architecture)) > 0


def lora_target_pattern(names: list[str], vision: bool) -> str:
    """peft's ``target_modules`` for a vision-language class (its tower loaded, rank.vision):
    one regex, which peft matches whole against each module's name. The language names
    (:func:`lora_targets`) only under ``model.language_model`` — Qwen2.5-VL's tower has
    gate / up / down projections of its own — and, with ``vision``, the tower's
    :data:`VISION_TARGETS`."""
    language = r"model\.language_model\..*\.(?:" + "|".join(names) + ")"
    if not vision:
        return language
    return f"(?:{language}|model\\.visual\\.(?:{VISION_TARGETS}))"


def lora_targets(cfg: RunConfig) -> list[str]:
    """The module names LoRA adapts in this run's model: ``LORA_TARGETS[peft.target]``, less the
    linear-attention names where the model has no linear-attention layer (an ``out_proj`` of
    some other architecture is not what ``attention`` means)."""
    arch = dict(cfg.model.architecture)
    names = list(LORA_TARGETS[cfg.peft.target])
    if not linear_attention_layers(arch):
        names = [name for name in names if name not in LINEAR_ATTENTION_TARGETS]
    if all(moe_layers(arch)) and routed_experts(arch) and not shared_expert(arch):
        # No layer has a dense MLP or a shared expert (Qwen3-30B-A3B): the MLP names would
        # match nothing, and peft (0.21, for transformers 5) would turn them into its own
        # adapters on the fused experts, with gate_up at twice the rank, next to memtune's.
        names = [name for name in names if name not in MLP_TARGETS]
    return names


def one_rank_stage(cfg: RunConfig) -> ZeroStage:
    """The ZeRO stage the run asks for, with one rank's exception: ZeRO-3 on a single rank
    shards nothing, yet its gather hooks cost time, so it runs ZeRO-2 (zero.one_rank_stage2;
    not with a template of the user's). memory.fit decides it; launcher.prepare says so."""
    z = cfg.zero
    one = cfg.launcher.num_ranks == 1 and z.stage == 3 and z.template is None
    return 2 if one and z.one_rank_stage2 else z.stage


REFERENCE_OBJECTIVES = ("dpo", "ipo")
"""The objectives that compare the policy with a reference model (rank.reference)."""


def needs_reference(cfg: RunConfig) -> bool:
    return cfg.trainer.objective in REFERENCE_OBJECTIVES


DEFAULT_BETA = {"dpo": 0.1, "ipo": 0.1, "simpo": 2.0, "orpo": 0.1}
"""The published defaults: DPO's and IPO's β 0.1 (TRL's DPOConfig), SimPO's β 2.0 with
γ 0.5 (the SimPO paper's recommended range, torchtune's SimPOLoss), ORPO's λ 0.1 (the paper,
TRL's ORPOConfig)."""


def beta_of(cfg: RunConfig) -> float | None:
    """preference.beta, or the objective's published default; None for SFT (no beta)."""
    b = cfg.preference.beta
    if b is not None:
        return float(b)
    return DEFAULT_BETA.get(cfg.trainer.objective)


def objective_label(cfg: RunConfig) -> str:
    """The preference objective as it runs, for the start-up line ("" for SFT): its β (and
    whether that is the objective's default), SimPO's γ, label smoothing, the reference."""
    t, pref = cfg.trainer, cfg.preference
    if t.objective == "sft":
        return ""
    default = " (its default)" if pref.beta is None else ""
    parts = [f"{t.objective} β {beta_of(cfg):g}{default}"]
    if t.objective == "simpo":
        parts.append(f"γ {pref.simpo_gamma:g}")
    if pref.label_smoothing:
        parts.append(f"label smoothing {pref.label_smoothing:g}")
    if needs_reference(cfg):
        parts.append(f"reference {pref.reference}")
    return " · " + ", ".join(parts)


def preference_loss_kind(loss: str) -> str:
    """The head a preference objective reads per-token log-probabilities through: full logits
    (trainer.loss=plain) or the chunked frozen head (every other kind: Liger's fused
    cross-entropy returns no per-token values)."""
    return "plain" if loss == "plain" else "chunked"


def live_reference(cfg: RunConfig) -> bool:
    """The reference's forward runs inside every step (preference.reference=live)."""
    return needs_reference(cfg) and cfg.preference.reference == "live"


def rope_positions(cfg: RunConfig) -> int:
    """Positions the model can encode: max_position_embeddings, × model.rope_scaling's
    factor when set."""
    a = cfg.model.architecture
    positions = int(a.get("max_position_embeddings") or 0)
    scaling = cfg.model.rope_scaling or a.get("rope_scaling") or {}
    return int(positions * float(scaling.get("factor", 1.0)))


def compute_bytes(cfg: RunConfig) -> int:
    """Bytes per element of the compute dtype (trainer.precision): bf16 2, fp32 4."""
    return 2 if cfg.trainer.precision == "bf16" else 4


def reduce_bucket_elements(cfg: RunConfig) -> int:
    """DeepSpeed's gradient reduce (and ZeRO-2 all-gather) bucket: zero.reduce_bucket_size, by
    default hidden_size²."""
    h = int(cfg.model.architecture["hidden_size"])
    return cfg.zero.reduce_bucket_size or h * h


def prefetch_bucket_elements(cfg: RunConfig) -> int:
    """ZeRO-3's parameter prefetch bucket: zero.prefetch_bucket_size, by default 0.9·hidden²."""
    h = int(cfg.model.architecture["hidden_size"])
    return cfg.zero.prefetch_bucket_size or int(0.9 * h * h)


def persistence_threshold(cfg: RunConfig) -> int:
    """ZeRO-3: parameters smaller than this stay gathered; zero.param_persistence_threshold,
    by default 10·hidden_size."""
    t = cfg.zero.param_persistence_threshold
    return 10 * int(cfg.model.architecture["hidden_size"]) if t is None else t


def lora_scaling(cfg: RunConfig) -> float:
    """What the adapter's product B·A is multiplied by: peft.alpha / r, or with rsLoRA
    alpha / sqrt(r) (modules in peft.rank_pattern / alpha_pattern have their own)."""
    p = cfg.peft
    return p.alpha / (p.r**0.5 if p.rslora else p.r)


def lora_config(cfg: RunConfig, tower: bool = False) -> Any:
    """peft's LoraConfig for ``cfg.peft``: what the ranks adapt with, what the planner counts
    (memory.counts, on the meta device) and what bench/'s baselines use. ``tower``: the model
    is a vision-language class with its vision tower (decisions.json ``vision``), whose
    modules are named apart (:func:`lora_target_pattern`)."""
    import warnings

    from peft import LoraConfig

    p = cfg.peft
    targets: Any = lora_targets(cfg)
    if tower:
        targets = lora_target_pattern(targets, adapts_vision(cfg))
    with warnings.catch_warnings():
        # peft warns that rsLoRA or per-module ranks with PiSSA / OLoRA stop its own
        # post-training conversion (path_initial_model_for_weight_conversion): memtune's export
        # converts such an adapter itself, tested with both (docs/lora.md)
        warnings.filterwarnings("ignore", message="Using Rank-Stabilized LoRA with rank_pattern")
        return LoraConfig(
            r=p.r,
            lora_alpha=p.alpha,
            lora_dropout=p.dropout,
            target_modules=targets,
            bias="none",
            task_type="CAUSAL_LM",
            use_rslora=p.rslora,
            use_dora=p.dora,
            init_lora_weights=PEFT_INIT[p.init],
            rank_pattern=dict(p.rank_pattern or {}),
            alpha_pattern=dict(p.alpha_pattern or {}),
        )


PEFT_INIT: dict[str, Any] = {
    "default": True,
    "gaussian": "gaussian",
    "pissa": "pissa",
    "pissa_fast": "pissa_niter_16",
    "olora": "olora",
}
"""peft.init as peft's init_lora_weights (True: peft's default, B = 0)."""
REWRITING_INIT = ("pissa", "pissa_fast", "olora")
"""peft.init values that move part of each adapted weight into the adapter (the base keeps
W − the adapter's start): an adapter trained from them applies to that residual base only."""


def variant_words(cfg: RunConfig) -> list[str]:
    """The LoRA variant in words, [] for plain LoRA: rsLoRA, DoRA, the initialisation, LoRA+,
    per-module ranks and alphas (the start-up line and the sweep report)."""
    p = cfg.peft
    words = ["rsLoRA"] if p.rslora else []
    if p.dora:
        words.append("DoRA")
    if p.init != "default":
        words.append(f"init {p.init}")
    if p.loraplus_lr_ratio is not None:
        words.append(f"LoRA+ {p.loraplus_lr_ratio:g}")
    if p.rank_pattern:
        words.append("ranks " + ", ".join(f"{k}={v}" for k, v in p.rank_pattern.items()))
    if p.alpha_pattern:
        words.append("alphas " + ", ".join(f"{k}={v}" for k, v in p.alpha_pattern.items()))
    return words


def lora_variant(cfg: RunConfig) -> str:
    """The adapter in a few words, for reports: "LoRA r=16", "LoRA r=8 rsLoRA DoRA"."""
    return " ".join([f"LoRA r={cfg.peft.r}", *variant_words(cfg)])
