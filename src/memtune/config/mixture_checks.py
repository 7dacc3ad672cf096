"""A mixture of experts' settings checked before anything starts (config.validate calls these):
which experts LoRA reaches, how they are stored, their split over ranks (expert parallelism)
and under a sequence split; every error names the offending field."""

from __future__ import annotations

from memtune.config.architecture import moe_layers, routed_experts
from memtune.config.schema import ConfigError, RunConfig


def check_experts_split(cfg: RunConfig, sp: int) -> None:
    experts = routed_experts(dict(cfg.model.architecture))
    if experts and sp > 1:
        raise ConfigError(
            f"trainer.sequence_parallel={sp} on {cfg.model.name_or_path} ({experts} routed "
            "experts a layer): not built for routed experts yet; use 1 (or auto, which keeps 1 "
            "for these models)"
        )


def check_experts(cfg: RunConfig) -> None:
    """A mixture of experts: what memtune does not build for its routed experts yet, and what
    cannot work with LoRA on them, refused by name before any rank loads 30B parameters."""
    from memtune.config.derive import REWRITING_INIT, adapts_experts

    arch = dict(cfg.model.architecture)
    experts = routed_experts(arch)
    coef = cfg.trainer.router_aux_loss_coef
    if coef < 0:
        raise ConfigError(f"trainer.router_aux_loss_coef must be >= 0 (got {coef})")
    if coef > 0 and not experts:
        raise ConfigError(
            f"trainer.router_aux_loss_coef={coef}: {cfg.model.name_or_path} is not a mixture "
            "of experts (no router to balance); leave it at 0"
        )
    if coef > 0 and cfg.trainer.activation_checkpointing and cfg.trainer.checkpointing_reentrant:
        raise ConfigError(
            f"trainer.router_aux_loss_coef={coef} with trainer.checkpointing_reentrant=true: "
            "reentrant checkpointing runs the forward without grad, so the routers' logits "
            "would carry no gradient for the balance loss; use checkpointing_reentrant=false"
        )
    if not experts:
        ep = str(cfg.trainer.expert_parallel)
        if ep not in ("1", "auto"):
            raise ConfigError(
                f"trainer.expert_parallel={ep}: {cfg.model.name_or_path} is not a mixture of "
                "experts (no routed experts to split over ranks); leave it at 1"
            )
        if cfg.peft.train_router:
            raise ConfigError(
                f"peft.train_router=true: {cfg.model.name_or_path} is not a mixture of experts "
                "(no router to train)"
            )
        return
    p, t = cfg.peft, cfg.trainer
    model = f"{cfg.model.name_or_path} ({experts} routed experts a layer)"
    if not all(moe_layers(arch)):
        dense = [i for i, sparse in enumerate(moe_layers(arch)) if not sparse]
        raise ConfigError(
            f"{model}: layers {dense} have a dense MLP (model.architecture mlp_only_layers / "
            "decoder_sparse_step): memtune plans and adapts mixtures whose every layer routes, "
            "as the released Qwen3-MoE and Qwen3.5-MoE models do"
        )
    if "on" in (str(t.tiled_mlp), str(t.offload_activations)) or t.compile:
        raise ConfigError(
            f"trainer.tiled_mlp / offload_activations=on or trainer.compile=true on {model}: "
            "not built for routed experts yet; leave them at their defaults"
        )
    sp = str(t.sequence_parallel)
    check_experts_split(cfg, int(sp) if sp.isdigit() else 1)
    _check_expert_parallel(cfg, experts)
    if (
        p.train_router
        and cfg.trainer.objective in ("dpo", "ipo")
        and cfg.preference.reference == "live"
    ):
        raise ConfigError(
            f"peft.train_router=true with preference.reference=live on {model}: the live "
            "reference would route with the trained routers, not the base's; use "
            "preference.reference=precomputed (computed before the first step)"
        )
    if not adapts_experts(cfg):
        return
    why = (
        f"with peft.target=all-linear on {model}, whose routed experts LoRA adapts as fused "
        "stacks (peft's target_parameters layout)"
    )
    if p.dropout > 0:
        raise ConfigError(
            f"peft.dropout={p.dropout} {why}: an expert adapter has no dropout (peft refuses to "
            "load one trained with it); set peft.dropout=0, or "
            "peft.target=all-linear-but-experts to leave the routed experts frozen"
        )
    if p.dora or p.init in REWRITING_INIT:
        what = "peft.dora=true" if p.dora else f"peft.init={p.init}"
        raise ConfigError(
            f"{what} {why}: peft builds DoRA, PiSSA and OLoRA for linear layers only; use "
            "plain LoRA (rsLoRA, LoRA+, gaussian init work), or "
            "peft.target=all-linear-but-experts"
        )


def _check_expert_parallel(cfg: RunConfig, experts: int) -> None:
    """Expert parallelism (rank.expert_parallel): the groups of ranks and what it is built
    with so far; the rest refused by name."""
    value = str(cfg.trainer.expert_parallel)
    if value != "auto" and not (value.isdigit() and int(value) >= 1):
        raise ConfigError(
            f"trainer.expert_parallel={value!r} is not supported; choose 1 | 2 | 4 ... | auto "
            "(ranks a mixture's routed experts are split over)"
        )
    ep = int(value) if value.isdigit() else 1  # auto: memory.layouts plans only what passes
    if ep == 1:
        return
    ranks = cfg.launcher.num_ranks
    if ranks % ep:
        raise ConfigError(
            f"trainer.expert_parallel={ep} does not divide launcher.num_ranks={ranks}: the "
            f"ranks form groups of {ep} that split the routed experts between them"
        )
    if experts % ep:
        ok = [n for n in range(1, experts + 1) if experts % n == 0 and ranks % n == 0]
        raise ConfigError(
            f"trainer.expert_parallel={ep} does not divide {cfg.model.name_or_path}'s "
            f"{experts} routed experts a layer (each rank holds an equal share); choose one "
            f"of {ok}"
        )
    if cfg.zero.stage == 3 and cfg.zero.template is not None:
        raise ConfigError(
            f"trainer.expert_parallel={ep} with zero={cfg.zero.template.replace('_', '-')}: "
            "not built (ZeRO-3 partitions the experts over the ranks holding them, tested "
            "with the weights on the device; DeepSpeed's parameter offload is untested with "
            "that placement); use zero=zero3 or zero=zero2"
        )
    if cfg.trainer.optimizer != "adamw":
        raise ConfigError(
            f"trainer.expert_parallel={ep} with trainer.optimizer={cfg.trainer.optimizer}: not "
            "built yet (tested with torch's AdamW, whose state the checkpoints keep whole for "
            "a resume at another split); use adamw"
        )
    if cfg.trainer.objective != "sft":
        raise ConfigError(
            f"trainer.expert_parallel={ep} with trainer.objective={cfg.trainer.objective}: not "
            "built yet (preference objectives are untested with it); use sft"
        )
    if cfg.peft.init_from:
        raise ConfigError(
            f"trainer.expert_parallel={ep} with peft.init_from: not built yet (a rank would "
            "load every expert's adapter into its share); start from it at "
            "trainer.expert_parallel=1, or resume a checkpoint, which may change the split"
        )
