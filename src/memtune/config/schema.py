"""The typed schema of every Hydra group, and how a composed or saved config becomes a RunConfig.

Each group under ``conf/`` is checked against the dataclass here (registered in Hydra's
ConfigStore as ``memtune_schema``), so an unknown key or a wrong type fails when Hydra composes
the config. Ranges and cross-field rules are :mod:`memtune.config.validate`'s.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

from memtune.paths import ASSETS_DIR, CONF_DIR, SOURCE_ROOT  # noqa: F401  (config's names too)

# The choice fields. Each Literal below is the one list of a field's values: mypy checks every
# comparison and assignment against it (strict_equality), and validate() refuses any other value
# before launch. A field is declared ``Choice[Name]``: the Literal to mypy, the Literal's value
# type (str or int) to OmegaConf, which cannot hold a Literal (and would turn strings into Enums
# by member name, which "lora-int8" cannot be).
ArchitectureSource = Literal["auto", "checkpoint"]
AttnImplementation = Literal[
    "auto", "sdpa_varlen", "sdpa", "eager", "flash_attention_2", "torch_varlen"
]
DataFormat = Literal["alpaca", "messages", "text", "preference"]
Template = Literal["chatml", "plain", "qwen3", "qwen3_5"]
Overlong = Literal["truncate", "drop", "split"]
OnBadRecord = Literal["error", "skip"]
PeftMethod = Literal["lora", "qlora", "lora-int8"]
PeftTarget = Literal[
    "attention",
    "all-linear",
    "all-linear-but-experts",
    "attention-and-vision",
    "all-linear-and-vision",
]
QuantType = Literal["nf4", "fp4"]
LoraInit = Literal["default", "gaussian", "pissa", "pissa_fast", "olora"]
ZeroStage = Literal[2, 3]
Precision = Literal["bf16", "fp32"]
Switch = Literal["auto", "on", "off"]
Optimizer = Literal["adamw", "adamw_8bit", "cpu_adam"]
Loss = Literal["auto", "chunked", "plain", "liger"]
FusedKernel = Literal["auto", "torch", "liger"]
LeanKernel = Literal["auto", "torch", "lean", "liger"]
DropoutKernel = Literal["auto", "peft", "regenerate"]
OnNonfinite = Literal["stop", "skip"]
Objective = Literal["sft", "dpo", "ipo", "simpo", "orpo"]
ReferenceMode = Literal["precomputed", "live"]
LoggerBackend = Literal["wandb", "none"]
LoggerMode = Literal["offline", "online", "auto"]

if TYPE_CHECKING:
    _T = typing.TypeVar("_T")
    Choice = typing.Annotated[_T, "memtune choice"]
else:

    class Choice:
        """``Choice[Literal[...]]`` is the Literal's value type at run time (what OmegaConf
        sees): str, or int for ZeroStage."""

        def __class_getitem__(cls, literal: Any) -> type:
            return type(typing.get_args(literal)[0])


def choices_of(literal: Any) -> tuple[Any, ...]:
    """The values a choice type allows: ``choices_of(Switch)`` → ("auto", "on", "off")."""
    return typing.get_args(literal)


FORMATS: tuple[str, ...] = choices_of(DataFormat)
"""data.format: what a record looks like (data.readers reads each)."""
TEMPLATES: tuple[str, ...] = choices_of(Template)
"""data.template: how a conversation becomes text (data.templates renders each)."""


class ConfigError(ValueError):
    """A setting that cannot work; the message names the field and what to do."""


@dataclass
class ModelConfig:
    name_or_path: str = "???"
    """Hub name or local directory, read by the ranks with ``from_pretrained``."""
    architecture: dict[str, Any] = field(default_factory=dict)
    """The fields of the model's ``config.json``: lets plans and validation run offline. When
    the checkpoint is on disk (a local directory, or the Hugging Face cache) its own config.json
    is planned instead, and a disagreement is refused (config.architecture)."""
    architecture_source: Choice[ArchitectureSource] = "auto"
    """auto (the checkpoint's config.json when on disk, and it must agree with architecture) |
    checkpoint (the checkpoint's config.json replaces architecture; it must be on disk)"""
    vision: dict[str, Any] = field(default_factory=dict)
    """A vision-language checkpoint's vision tower: the fields of its config.json's
    ``vision_config`` (depth, widths, patch_size, temporal_patch_size, spatial_merge_size),
    what the planner counts a run on images with (memory.vision). Filled from the checkpoint's
    config.json when it is on disk; empty: a text model, or a tower not planned."""
    synthesize: bool = False
    """Build a random-init model and tokenizer at ``name_or_path`` if absent (tiny demos)."""
    attn_implementation: Choice[AttnImplementation] = "auto"
    """auto (flash_attention_2 if usable on CUDA, else sdpa_varlen: SDPA per sample, no dense
    mask) | sdpa_varlen | sdpa | eager | flash_attention_2 | torch_varlen (torch's own
    variable-length flash kernel, one call a layer for packed rows; CUDA only)"""
    trust_remote_code: bool = False
    """Run the modelling / tokenizer code a hub repo ships (Python, on every rank). Pin
    model.revision to a commit with it: the code is then the one you reviewed."""
    revision: str | None = None
    """The hub revision to load, model and tokenizer (from_pretrained's ``revision``): a commit
    hash pins it; a branch or tag can move. null: the repo's main branch."""
    rope_scaling: dict[str, Any] | None = field(default_factory=dict)
    """Passed to from_pretrained over the checkpoint's config.json, e.g. Qwen's documented
    YaRN for 128k: {type: yarn, factor: 4.0, original_max_position_embeddings: 32768}; the
    positions a sample may use become max_position_embeddings × factor. Empty (or null): the
    checkpoint's own."""


@dataclass
class DataSource:
    path: str = "???"
    """.jsonl | .json | .parquet | a save_to_disk folder | a hub dataset name"""
    format: Choice[DataFormat] = "alpaca"
    """This source's record format, as data.format."""
    weight: float = 1.0
    """Sampling weight: 2.0 repeats every record twice, 0.5 keeps a (seeded) half."""


@dataclass
class DataConfig:
    path: str | None = None
    """One source (shorthand for sources: [{path, format}])."""
    format: Choice[DataFormat] = "alpaca"
    """alpaca | messages (OpenAI messages or ShareGPT conversations) | text | preference
    (prompt / chosen / rejected pairs, for trainer.objective=dpo, ipo, simpo or orpo)"""
    sources: list[DataSource] = field(default_factory=list)
    """Several sources, mixed by weight (instead of path)."""
    template: Choice[Template] = "chatml"
    """chatml (Qwen2.5) | qwen3 (Qwen3's template: a think block before the last reply) |
    qwen3_5 (Qwen3.5's template: contents stripped, a think block before the last reply) |
    plain (the seeds' ### 指令 / ### 回答 prompt)"""
    system_prompt: str | None = None
    """System message for records without one; none when null (never an implicit default)."""
    train_on_prompt: bool = False
    """Also learn the prompt tokens (default: assistant replies and their end marker only)."""
    max_seq_len: int = 1024
    """Tokens per sample (with packing: per packed row); longer samples meet data.overlong."""
    overlong: Choice[Overlong] = "truncate"
    """truncate | drop | split: what happens to samples longer than max_seq_len (all counted).
    split (format text only): a long document becomes consecutive max_seq_len samples."""
    packing: bool = True
    """Pack samples best-fit into max_seq_len rows (no attention across samples, positions
    restart); global_batch_size then counts rows. false: one sample per batch item, padded."""
    group_by_length: bool = False
    """Without packing: batch samples of similar length together to waste less on padding."""
    val_fraction: float = 0.0
    """Hold out this fraction of the records (seeded) as the validation split."""
    val_path: str | None = None
    """Or take the validation split from this file (same format as the first source)."""
    on_bad_record: Choice[OnBadRecord] = "error"
    """error (stop before launch, naming file, line and field) | skip (count and report)"""
    min_pixels: int | None = None
    """Images (format messages): each is resized to at least this many pixels (and so at least
    min_pixels / (patch_size × merge_size)² tokens); null: the model's preprocessor_config.json
    (Qwen3-VL / Qwen3.5: 65,536; Qwen2.5-VL: 3,136)."""
    max_pixels: int | None = None
    """Images: each is resized to at most this many pixels, keeping its aspect ratio (1280 ×
    720 is 880 tokens at Qwen3.5's 32-pixel merged patches); null: the model's (Qwen3-VL /
    Qwen3.5: 16,777,216, 16,384 tokens an image; Qwen2.5-VL: 12,845,056)."""
    image_cache_gb: float = 8.0
    """Images: the most the resized images (uint8, 3 × H × W each) of a split may take; past
    it the build stops, naming data.max_pixels. A 1280 × 720 picture is 2.7 MB resized (8 GiB:
    about 3,100), and the build's peak memory is about 3.2 times this (measured: 100 such
    images, 258 MiB resized, +835 MiB resident; a 2-core CPU, 2026-12-05)."""
    cache_dir: str | None = None
    """Tokenized-data cache; default $MEMTUNE_CACHE_DIR/data."""
    num_workers: int = 0
    """DataLoader worker processes per rank (the data is tokenized already: 0 is enough)."""

    def all_sources(self) -> list[DataSource]:
        if self.sources:
            return list(self.sources)
        return [DataSource(path=self.path or "???", format=self.format)]


@dataclass
class PeftConfig:
    method: Choice[PeftMethod] = "lora"
    """lora | qlora | lora-int8"""
    r: int = 16
    """The adapters' rank."""
    alpha: int = 32
    """The adapters' scale is alpha / r (alpha / sqrt(r) with rslora)."""
    dropout: float = 0.05
    """Dropout on each adapter's input (0 for a mixture's routed experts)."""
    target: Choice[PeftTarget] = "attention"
    """attention (q, k, v, o: the seeds' choice) | all-linear (adds gate, up, down; in a
    mixture of experts also every routed expert and the shared expert) | all-linear-but-experts
    (all-linear with a mixture's routed experts left frozen: a much smaller adapter) |
    attention-and-vision, all-linear-and-vision (the same in the language model, and LoRA on a
    vision-language model's vision blocks and merger too: data with images only; without, the
    tower is frozen)"""
    quant_type: Choice[QuantType] = "nf4"
    """qlora only: nf4 | fp4"""
    double_quant: bool = True
    """qlora only: quantize the per-block scales too (~0.37 bits less per weight)."""
    init_from: str | None = None
    """An adapter to start from (RUN_DIR/adapter of an SFT run): its weights, its r, alpha and
    targets. With a dpo or ipo objective it is also the reference (frozen as loaded)."""
    rslora: bool = False
    """Rank-stabilized LoRA (Kalajdzievski 2023): scale the adapter by alpha / sqrt(r) instead of
    alpha / r, so that a rank sweep does not change the update's size with the rank."""
    dora: bool = False
    """DoRA (Liu et al. 2024): a trained magnitude per output row of each adapted weight, the
    LoRA update setting its direction. Costs time and memory (the planner counts both)."""
    init: Choice[LoraInit] = "default"
    """How the adapters start: default (A random, B zero: the adapter starts as a no-op) |
    gaussian (A Gaussian, scaled by 1/r) | pissa (A, B from the weight's top r singular
    vectors, the base keeps the rest; full SVD) | pissa_fast (the same by a randomized SVD,
    16 subspace iterations) | olora (A, B from a QR decomposition of the weight)."""
    loraplus_lr_ratio: float | None = None
    """LoRA+ (Hayou et al. 2024): the B matrices learn at trainer.lr × this ratio (the paper
    suggests 16), A at trainer.lr. null: one rate for both."""
    rank_pattern: dict[str, int] = field(default_factory=dict)
    """Ranks other than peft.r for some modules, peft's rank_pattern: {module name or regex:
    r}, e.g. {"mlp.down_proj": 8}."""
    alpha_pattern: dict[str, int] = field(default_factory=dict)
    """Alphas other than peft.alpha for some modules, peft's alpha_pattern."""
    train_router: bool = False
    """A mixture of experts: train each layer's router (experts × hidden weights, in full)
    beside the adapters; exported as peft's modules_to_save. Off: the routing stays the
    base's."""


@dataclass
class ZeroConfig:
    stage: Choice[ZeroStage] = 3
    """2: optimizer state and gradients sharded over the ranks | 3: the weights too."""
    template: str | None = None
    """A ds_configs/ name (or a .json path) whose "auto" fields are filled; default zero{stage}."""
    reduce_bucket_size: int | None = None
    """Default hidden_size²."""
    prefetch_bucket_size: int | None = None
    """ZeRO-3 only. Default 0.9·hidden_size²."""
    param_persistence_threshold: int | None = None
    """ZeRO-3 only: parameters smaller than this stay gathered. Default 10·hidden_size."""
    one_rank_stage2: bool = True
    """With one rank ZeRO-3 shards nothing, yet its gather hooks cost time (1.7× per micro
    step in bench/): run ZeRO-2 instead. Not applied with a template (e.g. zero3-offload)."""


@dataclass
class PreferenceConfig:
    """The preference objectives' settings (trainer.objective other than sft)."""

    beta: float | None = None
    """How far the policy may move from the reference (dpo, ipo), or the reward scale (simpo),
    or the odds-ratio term's weight (orpo). null: the objective's published default (dpo 0.1,
    ipo 0.1, simpo 2.0, orpo 0.1; config.derive.DEFAULT_BETA)."""
    label_smoothing: float = 0.0
    """dpo and simpo: the assumed fraction of pairs whose labels are flipped (conservative DPO;
    on SimPO's margin as TRL's CPO applies it). Refused with ipo and orpo."""
    simpo_gamma: float = 0.5
    """simpo only: the target reward margin γ between chosen and rejected (γ itself, as in TRL;
    the SimPO repository's configs give gamma_beta_ratio = γ/β instead)."""
    reference: Choice[ReferenceMode] = "precomputed"
    """dpo and ipo: precomputed (the reference model's log-probabilities of every pair once,
    before training, saved in RUN_DIR/reference) | live (a reference forward in every step)."""


@dataclass
class TrainerConfig:
    objective: Choice[Objective] = "sft"
    """sft (next-token loss on the replies) | dpo | ipo | simpo | orpo (preference pairs:
    data.format=preference; settings under preference.*)"""
    micro_batch_size: int = 1
    """Rows per rank per forward (packed rows with data.packing, else samples)."""
    global_batch_size: int = 16
    """Rows per optimizer step over all ranks: micro_batch_size × accumulation × data-parallel
    ranks (accumulation is derived; it must divide)."""
    max_steps: int = 100
    """Optimizer steps of the run (the cosine schedule spans them)."""
    lr: float = 2e-4
    """Peak learning rate, after warmup_steps of linear warmup."""
    min_lr_ratio: float = 0.1
    """Cosine decay ends at lr·min_lr_ratio."""
    warmup_steps: int = 10
    """Steps of linear warmup from 0 to lr."""
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay on the trained weights."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this (DeepSpeed's gradient_clipping); 0 disables."""
    precision: Choice[Precision] = "bf16"
    """bf16 | fp32 (fp32 is for CPU demos and exact tests)"""
    activation_checkpointing: bool = True
    """Recompute the checkpointed layers' forward in backward instead of keeping their
    activations (which layers: checkpoint_layers)."""
    checkpoint_layers: str = "auto"
    """With activation_checkpointing: how many decoder layers recompute their forward (the
    first N). all | N | auto: the fewest that fit plan.device_gib with 2 GiB to spare (all when
    no device is planned for). Fewer checkpointed layers, less recompute, more memory."""
    selective_layers: str = "auto"
    """With activation_checkpointing: of the layers not recomputed in full, how many (the next
    ones) recompute only their cheap ops — norms, activations, rotary, dropout, LoRA's r-deep
    B — and keep their base matmuls', LoRA's A and attention's outputs (torch's selective
    activation checkpointing). all | N | auto: the planner's choice, the fewest full
    recomputes and then the fewest selective layers that fit (0 where it is not built: with
    checkpointing_reentrant, compile, a tiled MLP or offloaded inputs, eager attention, DoRA,
    a mixture of experts, linear-attention layers)."""
    checkpointing_reentrant: bool = False
    """torch's older reentrant checkpointing (use_reentrant=True); false: the non-reentrant
    one, which keeps less and lets the first layer's input need no gradient."""
    sequence_parallel: str = "auto"
    """Ranks each sequence is split over (Ulysses: attention exchanges heads for sequence, so
    every rank attends over the whole sequence for its share of heads). auto | 1 | 2 | 4 ...
    It must divide launcher.num_ranks (the rest are data-parallel groups), the query heads, and
    the KV heads (or be a multiple of them), and data.max_seq_len. auto: the planner's choice
    (1 unless a longer sequence needs it; README "Long context")."""
    expert_parallel: str = "1"
    """A mixture of experts: ranks its routed experts are split over by expert (expert
    parallelism; docs/moe.md). 1 | 2 | 4 ... | auto. Each group of N ranks holds E/N of each
    layer's experts (and their LoRA), and sends each token to the ranks holding its experts and
    back (all-to-all). It must divide launcher.num_ranks and the model's routed experts; ZeRO-2
    or ZeRO-3 (not zero3-offload). auto: the planner chooses where the experts live, the ZeRO
    stage with it (ZeRO-3 with every expert sharded, ZeRO-2 with every expert on every rank, or
    ZeRO-2 / ZeRO-3 split over N), the fastest by its step-time estimate that fits with 2 GiB
    to spare (memory.layouts; make plan shows them)."""
    tiled_mlp: Choice[Switch] = "auto"
    """auto | on | off: run each MLP over tiles of hidden_size tokens and recompute them in
    backward, so the 3 × tokens × intermediate temporaries exist for one tile only."""
    offload_activations: Choice[Switch] = "auto"
    """auto | on | off: checkpointed layers keep their input in (pinned) host memory until
    backward, instead of on the device. Needs activation_checkpointing."""
    attention_by_kv_head: Choice[Switch] = "auto"
    """auto | on | off: attention as one kernel call per KV head (with its group of query
    heads) instead of one call for all heads: the same outputs and gradients, and
    FlashAttention-2's backward holds one group's temporaries at a time (its fp32 dQ
    accumulator, and dK / dV expanded to every query head: 5.3 × tokens × hidden at once on
    Qwen2.5-7B, 1.8 split four ways), for one more copy of the attention output kept until
    o_proj's backward where it was not a copy already. model.attn_implementation sdpa_varlen,
    torch_varlen or flash_attention_2 (not sdpa or eager). auto: on with the MLP tiled, where
    attention's backward is a recomputed layer's peak; else off."""
    expandable_segments: bool = True
    """CUDA ranks run PyTorch's caching allocator with expandable segments
    (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True): a segment grows in place instead of
    freed blocks of many sizes staying reserved — the fragmentation that ended a one-card
    long-context run at 81,920 tokens with 2.21 GiB reserved but unallocated. Where the
    environment sets PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF already, yours is kept
    (decisions.json says which). No effect on CPU ranks."""
    compile: bool = False
    """torch.compile each decoder layer's forward (regional: one graph for all layers, dynamic
    shapes, attention left eager; checkpointed layers compiled inside memtune's checkpoint;
    rank.model.compile_layers); off until measured faster on the target (make bench has the
    row)."""
    optimizer: Choice[Optimizer] = "adamw"
    """adamw (torch) | adamw_8bit (bitsandbytes; paged on CUDA) | cpu_adam (DeepSpeed, state and
    step on the host: ZeRO-Offload)"""
    optim_8bit_min_size: int = 4096
    """adamw_8bit: tensors with fewer elements keep 32-bit state (bitsandbytes' rule)."""
    loss: Choice[Loss] = "auto"
    """auto (memtune's chunked loss, until the GPU check measures Liger's faster) | chunked |
    plain (full-sequence logits, as HF models compute them) | liger (Liger's fused linear CE:
    CUDA and liger-kernel)"""
    rms_norm_kernel: Choice[LeanKernel] = "auto"
    """auto | torch | lean | liger: every RMSNorm of a dense Qwen2 / Qwen2.5 / Qwen3 (each decoder
    layer's two, Qwen3's per-head q / k norms, the final one) as transformers computes it
    (torch: it keeps an fp32 copy of its input for backward); lean: the same ops as one
    autograd function that keeps the input as it came and a per-token inverse RMS, and runs
    its backward a block of tokens at a time (the same gradients; rank.lean_norm); or Liger's
    fused kernel (CUDA and liger-kernel). auto: lean where it is built (the dense Qwen models
    without trainer.compile), else torch; Liger's only by name until the GPU check shows it
    faster at equal loss."""
    swiglu_kernel: Choice[LeanKernel] = "auto"
    """auto | torch | lean | liger: each dense Qwen MLP's silu(gate) × up as transformers
    computes it (torch: SiLU's output kept for backward beside gate and up); lean: the same ops
    as one autograd function that keeps gate and up only and makes SiLU's output again in
    backward, a block of tokens at a time (the same gradients; rank.lean_swiglu); or Liger's
    fused kernel (CUDA and liger-kernel). gate_proj, up_proj and down_proj stay the LoRA layers
    they are. auto: lean where it is built (as rms_norm_kernel's), else torch; Liger's only by
    name until the GPU check shows it faster at equal loss."""
    rope_kernel: Choice[FusedKernel] = "auto"
    """auto | torch | liger: the rotary position embedding applied to q and k in one Liger
    kernel, in place, instead of transformers' six elementwise ops. auto: torch until
    measured."""
    lora_dropout_kernel: Choice[DropoutKernel] = "auto"
    """auto | peft | regenerate: LoRA dropout as peft computes it, which keeps each adapted
    module's dropped input copy and mask for backward (q, k and v each their own), or
    regenerated: the mask drawn again in backward from the forward's random state (the same
    masks, the same gradients), keeping only the input the adapters share. One more dropout
    pass in backward; no copies (the plan's "LoRA dropout copies" row). auto: regenerate
    where it runs (not with DoRA or trainer.compile: peft's there)."""
    loss_chunk_tokens: int = 512
    """Tokens per chunk of the chunked loss: its logits peak at chunk × vocab × 6 bytes in bf16
    (fp32 logits + their bf16 cast; README "The loss never holds the whole sequence's logits")."""
    router_aux_loss_coef: float = 0.0
    """A mixture of experts: add this × the routers' load-balancing loss (transformers'
    load_balancing_loss_func over each micro batch's tokens, every layer: a padded batch's
    padding left out, packed rows' tail padding counted; weighted as the objective's units)
    to the training loss; 0: off
    (the loss is the objective's alone; the balance is logged either way, moe/aux_loss). The
    released Qwen MoE configs pretrained with 0.001."""
    on_nonfinite: Choice[OnNonfinite] = "stop"
    """A step whose loss or gradient norm is not finite never updates the weights. stop: exit
    with code 3 (the last checkpoint is intact) | skip: discard the step and go on."""
    max_skipped_steps: int = 10
    """on_nonfinite=skip still stops after this many non-finite steps in a row."""
    seed: int = 42
    """Seeds the adapters' init, dropout and the order of the batches."""
    log_every: int = 1
    """Log loss, throughput and memory every this many steps (and at the last)."""
    eval_every: int = 0
    """Validation loss every this many steps (needs a val split); always at the end. 0: end."""
    save_every: int = 200
    """Save a resumable checkpoint every this many steps (and always at the end); 0: end only."""
    keep_last: int = 2
    """Complete checkpoints kept in RUN_DIR/checkpoints (older ones are deleted)."""


@dataclass
class LoggerConfig:
    backend: Choice[LoggerBackend] = "wandb"
    """wandb | none"""
    mode: Choice[LoggerMode] = "offline"
    """offline (default: nothing leaves the machine) | online | auto (online when logged in)"""
    project: str = "memtune"
    """The wandb project."""
    group: str | None = None
    """The wandb group (a sweep's runs side by side); null: none."""
    name: str | None = None
    """The wandb run name; null: the run dir's name."""


@dataclass
class LauncherConfig:
    num_ranks: int = 1
    """All ranks of the job, over all nodes: one per GPU; on a CPU machine, CPU processes."""
    nnodes: int = 1
    """Nodes of the job; each runs num_ranks / nnodes ranks. With nnodes > 1 and no hostfile,
    the same command runs on every node (the per-node form: Slurm, or no ssh between nodes)."""
    node_rank: int | None = None
    """Per-node form: this node's index. Default: $SLURM_NODEID, else $NODE_RANK, else 0."""
    master_addr: str | None = None
    """Node 0's address. Default: $MASTER_ADDR, else on Slurm the job's first host."""
    master_port: int | None = None
    """Default: a free port (one node), 29500 (per-node form), 20000 + job id % 20000 (Slurm)."""
    hostfile: str | None = None
    """Hostfile form: `deepspeed --hostfile` from this node starts the ranks of every node over
    ssh (pdsh). Lines `HOST slots=GPUS`."""
    launch_id: str | None = None
    """Per-node form: the same string on every node, new for every start, so nodes 1.. wait for
    node 0's run dir of *this* start. Default: $SLURM_JOB_ID.$SLURM_RESTART_COUNT, else
    $MEMTUNE_LAUNCH_ID."""
    preflight: bool = True
    """On GPUs: check count, memory, all-reduce and P2P before the ranks start, and set NCCL's
    P2P/IB switches from what it finds (saved in RUN_DIR/preflight.json)."""
    require_gpus: bool = False
    """Refuse to start on a machine without CUDA instead of running CPU ranks (the GPU
    experiments set it: a 7B job on CPU ranks would only crawl or exhaust the host's memory)."""
    omp_threads: int | None = None
    """OMP_NUM_THREADS per rank when not set in the environment. Default: the cores this
    process may use (its CPU affinity: a Slurm job's, taskset's) // ranks on this node."""
    from_allocation: bool = True
    """In a Slurm job step (train.sbatch, hydra/launcher=slurm, any ``srun train.py``):
    launcher.nnodes and launcher.num_ranks follow the allocation — the step's nodes × the GPUs
    on each ($MEMTUNE_RANKS_PER_NODE first, for CPU nodes) — unless given on the command line
    (a launch with one train.py on each node refuses a launcher.nnodes the step does not
    have). A requeue that lands on fewer nodes or GPUs then resumes on what it got."""


@dataclass
class PlanConfig:
    device_gib: float | None = None
    """Memory per GPU to plan against (RTX 4090D: 23.99); null: plan without a check (CPU)."""
    enforce: bool = True
    """Refuse, before any rank starts, a run whose planned peak exceeds device_gib."""
    auto_fit: bool = False
    """Instead of refusing, run the fastest variant that fits (checkpointing, smaller micro
    batch, ZeRO-3, 8-bit optimizer, QLoRA: see memory/fit.py), keeping the base's precision
    whenever a variant that keeps it fits (QLoRA is taken for memory, never for speed alone).
    The choice is printed and saved."""
    device_tflops: float | None = None
    """Dense bf16 matmul peak per GPU (RTX 4090D: 147, tensor cores with fp32 accumulate),
    for the step-time estimate (memory/step_time.py); null: no estimate."""
    mfu: float = 0.40
    """Share of device_tflops the step's matmuls reach, assumed by the step-time estimate."""
    link_gb_s: float | None = None
    """Bus bandwidth between the ranks (GB/s) for the communication estimate; the GPU
    preflight measures it (preflight.json). A 4×4090D box over PCIe without P2P: ~10."""
    host_gib: float | None = None
    """Host RAM per node the ranks may pin for offloaded activations (trainer.
    offload_activations); null: this machine's available RAM when planning CPU ranks, else
    unchecked."""
    device_gb_s: float | None = None
    """Device memory bandwidth (GB/s) for the memory-bound passes the step-time estimate prices:
    LoRA dropout's over each adapted input (RTX 4090D: 1,008 by the datasheet); null: not
    priced."""
    host_link_gb_s: float = 20.0
    """Device↔host copy bandwidth per GPU (GB/s) for offloaded activations: PCIe 4.0 x16
    moves ~25 GB/s pinned; 20 leaves room for four cards sharing the host's lanes."""
    max_seq_len_search: bool = True
    """make plan / plan_only: also report the longest data.max_seq_len that fits (long-context
    choices left to auto)."""
    images: int = 0
    """Images in the row the plan is for (a conversation; unpacked, the most one sample holds),
    each of plan.image_width × plan.image_height pixels before the processor resizes it: a
    vision-language model (model.vision) is planned with its tower, the images' patches and,
    when adapted, the tower's activations (memory.vision). 0: planned without images until the
    data is read; a launch whose data holds more images, or larger ones, is planned again with
    the data's (launcher.prepare)."""
    image_width: int = 1280
    """The planned images' width in pixels, before resizing (plan.images)."""
    image_height: int = 720
    """The planned images' height in pixels, before resizing (plan.images)."""


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    experiment: str = "custom"
    """The experiment's name (experiment=NAME sets it with its group choices): in the run
    dir's name and the logs."""
    plan_only: bool = False
    """Print the per-rank memory plan and stop (make plan); nothing is written or launched."""
    preprocess_only: bool = False
    """Tokenize the data into its cache, print the counts, launch nothing (make preprocess)."""
    resume: str = "auto"
    """auto: continue from RUN_DIR's newest complete checkpoint if any | never | a checkpoint dir"""
    run_dir: str | None = None
    """Where the run writes; default Hydra's output dir (outputs/DATE/TIME-EXP, multirun/...)."""


def register_configs() -> None:
    """Register the schema and the ``memtune_asset`` resolver; safe to call more than once."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="memtune_schema", node=RunConfig)
    if not OmegaConf.has_resolver("memtune_asset"):
        OmegaConf.register_new_resolver("memtune_asset", lambda name: str(ASSETS_DIR / name))
    if not OmegaConf.has_resolver("memtune_first"):
        OmegaConf.register_new_resolver("memtune_first", lambda *xs: next(x for x in xs if x))
    if not OmegaConf.has_resolver("memtune_cache"):
        OmegaConf.register_new_resolver("memtune_cache", lambda name: str(cache_dir() / name))


def unexpanded_home(arg: str) -> str | None:
    """An override whose value starts with ``~`` (``data.path=~/x.jsonl``): the shell expands
    ``~`` at the start of a word (and after ``NAME=``, NAME a shell variable's name, which
    ``data.path`` is not), so it reaches Hydra as is, and Hydra's override grammar cannot read
    it (``LexerNoViableAltException: data.path=~/x.jsonl ^``)."""
    key, eq, value = arg.partition("=")
    if not eq or not value.startswith("~"):
        return None
    if value == "~" or value.startswith("~/"):
        fix = f"write {key}=$HOME{value[1:]} instead (the shell expands $HOME there)"
    else:  # ~user/...
        fix = "write the whole path instead"
    return f"{arg}: the shell left this ~ unexpanded, and Hydra cannot read one; {fix}"


def compose(overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """The config train.py would compose with these command-line overrides, outside Hydra's
    main (for the tests, the benchmarks and the GPU check)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_configs()
    problem = unknown_override(overrides) or next(
        (said for o in overrides if (said := unexpanded_home(o))), None
    )
    if problem:
        raise ConfigError(problem)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=open_mappings(overrides))


def cache_dir() -> Path:
    """Where synthesized models live: $MEMTUNE_CACHE_DIR, else ~/.cache/memtune."""
    return Path(os.environ.get("MEMTUNE_CACHE_DIR", Path.home() / ".cache" / "memtune"))


def to_run_config(cfg: DictConfig | dict[str, Any]) -> RunConfig:
    """Merge a (possibly partial) config onto the schema and return the typed object.

    Raises ConfigError for a key the schema does not have (see :func:`unknown_keys`) and for a
    required value left unset (``???``, e.g. model=local without model.name_or_path), which
    OmegaConf would report as a traceback from inside its conversion."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(RunConfig), cfg)
    except ConfigKeyError as err:  # a plain mapping (a saved config.yaml) with a key too many
        raise ConfigError(_unknown_key_message(str(err.full_key), appended=False)) from None
    except ValidationError as err:  # a value of the wrong type in such a mapping
        reason = str(err).splitlines()[0]
        raise ConfigError(f"{err.full_key}: {reason}") from None
    for key in unknown_keys(merged, RunConfig):
        raise ConfigError(_unknown_key_message(key))
    missing = sorted(OmegaConf.missing_keys(merged))
    if missing:
        raise ConfigError(_missing_message(missing))
    obj = OmegaConf.to_object(merged)
    assert isinstance(obj, RunConfig)
    return obj


def unknown_keys(node: Any, schema: type, prefix: str = "") -> list[str]:
    """Dotted keys of ``node`` that ``schema`` (a dataclass) has no field for.

    The schema is a struct config, so a plain ``trainer.max_step=2`` fails when Hydra composes.
    But ``+trainer.max_step=2`` is Hydra's append: it adds the key with the struct flag lifted
    (OmegaConf.update(force_add=True)); merging that typed node onto the schema keeps the key
    (OmegaConf opens the struct flag for keys of a structured source), and OmegaConf.to_object
    sets it as a plain attribute on the dataclass, which nothing reads: the run would silently
    train with the default. Dict-typed fields (model.architecture, model.rope_scaling) hold
    free-form keys and are not looked into."""
    if not isinstance(node, DictConfig):
        return []
    hints = _field_types(schema)
    found = []
    for name in node:
        key = str(name)
        dotted = f"{prefix}{key}"
        if key not in hints:
            found.append(dotted)
            continue
        kind, child = hints[key], node._get_node(key)
        if isinstance(child, DictConfig) and dataclasses.is_dataclass(kind):
            found += unknown_keys(child, kind, f"{dotted}.")  # type: ignore[arg-type]
        elif isinstance(child, ListConfig) and typing.get_origin(kind) is list:
            (item,) = typing.get_args(kind)
            if dataclasses.is_dataclass(item):
                for i, element in enumerate(child):
                    found += unknown_keys(element, item, f"{dotted}[{i}].")  # type: ignore[arg-type]
    return found


@functools.cache
def _field_types(schema: type) -> dict[str, Any]:
    """Field name → its type, the annotations resolved (they are strings here: ``from
    __future__ import annotations``). Cached: resolving them is ~0.5 ms a call, and checking
    one command line's overrides asks ~200 times."""
    hints = typing.get_type_hints(schema)
    return {f.name: hints[f.name] for f in dataclasses.fields(schema)}


def schema_keys(schema: type | None = None, prefix: str = "") -> list[str]:
    """Every setting's dotted name (``trainer.max_steps``; data.sources' items as
    ``data.sources.path``)."""
    out = []
    for name, kind in _field_types(schema or RunConfig).items():
        if typing.get_origin(kind) is list:
            kind = typing.get_args(kind)[0]
        if dataclasses.is_dataclass(kind):
            out += schema_keys(kind, f"{prefix}{name}.")  # type: ignore[arg-type]
        else:
            out.append(f"{prefix}{name}")
    return out


def unknown_override(overrides: list[str] | tuple[str, ...]) -> str | None:
    """The first command-line override whose key is not a setting, said as a config error
    with the settings it may have meant. Hydra refuses such a key itself, but its advice is
    to append it (``+key=...``), which memtune then refuses: this answers first."""
    leaves = set(schema_keys())
    groups = {p for k in leaves for p in _prefixes(k)}  # model=local selects a group
    free = {k for k in leaves if _is_mapping(k)}  # model.architecture.*: any key
    for arg in overrides:
        key, eq, _ = arg.partition("=")
        if not eq or key[:1] in "+~" or "/" in key or key.startswith("hydra."):
            continue  # an option, an append / delete (checked after composing), Hydra's own
        key = key.split("@", 1)[0]
        if key in leaves or key in groups or any(key.startswith(f + ".") for f in free):
            continue
        return _unknown_key_message(key, appended=False)
    return None


def open_mappings(overrides: list[str] | tuple[str, ...]) -> list[str]:
    """The overrides with a whole free-form mapping given on the command line
    (``peft.rank_pattern={down_proj: 8}``, ``model.rope_scaling={...}``) turned into Hydra's
    force-add form (``++key=...``). The schema is a struct config, which refuses the mapping's
    new keys otherwise, and Hydra's advice (``+key=...``) fails too, since the key exists."""
    leaves = set(schema_keys())
    out = []
    for arg in overrides:
        key, eq, value = arg.partition("=")
        if eq and key in leaves and _is_mapping(key) and value.lstrip().startswith("{"):
            arg = f"++{arg}"
        out.append(arg)
    return out


def _prefixes(key: str) -> list[str]:
    parts = key.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _is_mapping(key: str) -> bool:
    """Whether the setting ``key`` is a free-form mapping (dict[str, Any])."""
    schema: Any = RunConfig
    *path, last = key.split(".")
    for name in path:
        kind = _field_types(schema)[name]
        if typing.get_origin(kind) is list:
            kind = typing.get_args(kind)[0]
        schema = kind
    kind = _field_types(schema)[last]
    if typing.get_origin(kind) in (typing.Union, types.UnionType):  # dict[...] | None
        kind = next(a for a in typing.get_args(kind) if a is not type(None))
    return typing.get_origin(kind) is dict or kind is dict


OTHER_TOOLS_NAMES = {
    "learning_rate": "trainer.lr",
    "lora_r": "peft.r",
    "lora_rank": "peft.r",
    "lora_alpha": "peft.alpha",
    "lora_dropout": "peft.dropout",
    "lora_target": "peft.target",
    "lora_target_modules": "peft.target",
    "target_modules": "peft.target",
    "cutoff_len": "data.max_seq_len",
    "sequence_len": "data.max_seq_len",
    "max_seq_length": "data.max_seq_len",
    "model_max_length": "data.max_seq_len",
    "max_length": "data.max_seq_len",
    "per_device_train_batch_size": "trainer.micro_batch_size",
    "gradient_accumulation_steps": (
        "none: accumulation is derived, set trainer.global_batch_size (= micro batch × ranks "
        "× accumulation)"
    ),
    "num_train_epochs": "none: memtune counts trainer.max_steps (the start-up line says how "
    "many epochs they are)",
    "num_epochs": "none: memtune counts trainer.max_steps (the start-up line says how many "
    "epochs they are)",
    "warmup_ratio": "trainer.warmup_steps",
    "gradient_checkpointing": "trainer.activation_checkpointing",
    "bf16": "trainer.precision=bf16",
    "fp16": "none: trainer.precision is bf16 or fp32",
    "deepspeed": "zero=zero2 or zero=zero3 (the config group fills the DeepSpeed JSON)",
    "save_steps": "trainer.save_every",
    "eval_steps": "trainer.eval_every",
    "logging_steps": "trainer.log_every",
    "output_dir": "run_dir",
    "load_in_4bit": "peft=qlora-nf4",
    "quantization_bit": "peft=qlora-nf4 (4-bit) or peft=lora-int8 (8-bit)",
    "model_name_or_path": "model.name_or_path (with model=local)",
    "base_model": "model.name_or_path (with model=local)",
    "dataset": "data.path",
}
"""The names LLaMA-Factory, axolotl and transformers' TrainingArguments give settings, by last
part, and memtune's (or, "none: ...", what to do instead): the keys users bring with them,
which the closest-spelling hint got wrong (``peft.lora_r``: "did you mean peft.rslora?")."""


def _unknown_key_message(key: str, appended: bool = True) -> str:
    """The unknown key and the settings it may have meant: another tool's name for a setting
    (OTHER_TOOLS_NAMES), else the closest full names, then the closest by last part
    (``trainer.max_seq_len`` → ``data.max_seq_len``)."""
    known = schema_keys()
    plain = re.sub(r"\[\d+\]", "", key)  # data.sources[0].paht → data.sources.paht
    close = difflib.get_close_matches(plain, known, n=3, cutoff=0.75)
    leaves = {k.rsplit(".", 1)[-1] for k in known}
    near = difflib.get_close_matches(plain.rsplit(".", 1)[-1], leaves, n=3, cutoff=0.75)
    close += [k for k in known if k.rsplit(".", 1)[-1] in near and k not in close]
    hint = f": did you mean {' or '.join(close[:3])}?" if close else ""
    other = OTHER_TOOLS_NAMES.get(plain.rsplit(".", 1)[-1].lower())
    if other is not None:  # "none: ..." says what to do instead
        hint = f": {other}" if other.startswith("none:") else f": memtune's name for it is {other}"
    why = "Hydra adds any +key=... unchecked; " if appended else ""
    return (
        f"{key} is not a memtune setting{hint} ({why}the settings are listed in "
        "docs/reference/options.md)"
    )


def _missing_message(missing: list[str]) -> str:
    """A required value left as ``???``; model=local's path gets its own advice."""
    key = missing[0]
    if key == "model.name_or_path":
        return (
            "model.name_or_path is not set: model=local trains a checkpoint on disk, so give "
            "its directory, e.g. model=local model.name_or_path=/models/Qwen2.5-7B-Instruct "
            "(or pick a model group such as model=qwen2.5-7b)"
        )
    if key == "data.path":
        return (
            "data.path is not set: give your file, e.g. data.path=/data/train.jsonl (or "
            "data.sources for several)"
        )
    if key == "data.sources":
        return (
            "data.sources is not set: data=mix takes a list, e.g. 'data.sources=[{path: "
            "/data/a.jsonl, format: alpaca}, {path: /data/b.jsonl, format: messages}]'"
        )
    if key.startswith("data.sources[") and key.endswith(".path"):
        return f"{key} is not set: every entry of data.sources needs a path"
    return f"{key} is not set (??? in the config): give it on the command line, {key}=..."


def load_run_config(path: str | Path) -> RunConfig:
    return to_run_config(_load_mapping(path))


def read_run_config(path: str | Path) -> tuple[RunConfig, dict[str, Any]]:
    """A saved config read once, in both forms a rank needs: typed, and as the file holds it
    (interpolations resolved), for a tracker's run config."""
    loaded = _load_mapping(path)
    mapping = OmegaConf.to_container(loaded, resolve=True)
    assert isinstance(mapping, dict)
    return to_run_config(loaded), mapping  # type: ignore[return-value]


def _load_mapping(path: str | Path) -> DictConfig:
    import yaml

    try:
        loaded = OmegaConf.load(path)
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        # a saved config.yaml cut short or overwritten: one line naming it, not yaml's traceback
        reason = " ".join(str(err).split())
        raise ConfigError(f"{path} is not valid YAML ({reason}): damaged") from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return loaded
