"""The one config tree: typed schema for every Hydra group, validation and derived values.

Each group under ``conf/`` is checked against the dataclass here (registered in Hydra's
ConfigStore as ``memtune_schema``), so an unknown key or a wrong type fails when Hydra composes
the config. What a type cannot express (ranges, divisibility, choices) is checked by
:func:`validate`, which names the offending field.
"""

from __future__ import annotations

import copy
import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

ASSETS_DIR = Path(__file__).parent / "assets"
SOURCE_ROOT = Path(__file__).resolve().parents[2]
"""The checkout memtune runs from (``pip install -e .``): ``conf/``, ``ds_configs/`` and
``constraints.txt`` are found there, the bundled data in the package (ASSETS_DIR)."""
CONF_DIR = SOURCE_ROOT / "conf"


class ConfigError(ValueError):
    """A setting that cannot work; the message names the field and what to do."""


@dataclass
class ModelConfig:
    name_or_path: str = "???"
    """Hub name or local directory, read by the ranks with ``from_pretrained``."""
    architecture: dict[str, Any] = field(default_factory=dict)
    """The fields of the model's ``config.json``: lets plans and validation run offline."""
    synthesize: bool = False
    """Build a random-init model and tokenizer at ``name_or_path`` if absent (tiny demos)."""
    attn_implementation: str = "auto"
    """auto (flash_attention_2 if usable on CUDA, else sdpa) | sdpa | eager | flash_attention_2"""
    trust_remote_code: bool = False


@dataclass
class DataSource:
    path: str = "???"
    """.jsonl | .json | .parquet | a save_to_disk folder | a hub dataset name"""
    format: str = "alpaca"
    weight: float = 1.0
    """Sampling weight: 2.0 repeats every record twice, 0.5 keeps a (seeded) half."""


@dataclass
class DataConfig:
    path: str | None = None
    """One source (shorthand for sources: [{path, format}])."""
    format: str = "alpaca"
    """alpaca | messages (OpenAI messages or ShareGPT conversations) | text"""
    sources: list[DataSource] = field(default_factory=list)
    """Several sources, mixed by weight (instead of path)."""
    template: str = "chatml"
    """chatml (Qwen2.5) | plain (the seeds' ### 指令 / ### 回答 prompt)"""
    system_prompt: str | None = None
    """System message for records without one; none when null (never an implicit default)."""
    train_on_prompt: bool = False
    """Also learn the prompt tokens (default: assistant replies and their end marker only)."""
    max_seq_len: int = 1024
    overlong: str = "truncate"
    """truncate | drop: what happens to samples longer than max_seq_len (both are counted)."""
    packing: bool = False
    """Pack samples into max_seq_len rows (no attention across samples, positions restart)."""
    group_by_length: bool = False
    """Without packing: batch samples of similar length together to waste less on padding."""
    val_fraction: float = 0.0
    """Hold out this fraction of the records (seeded) as the validation split."""
    val_path: str | None = None
    """Or take the validation split from this file (same format as the first source)."""
    on_bad_record: str = "error"
    """error (stop before launch, naming file, line and field) | skip (count and report)"""
    cache_dir: str | None = None
    """Tokenized-data cache; default $MEMTUNE_CACHE_DIR/data."""
    num_workers: int = 0

    def all_sources(self) -> list[DataSource]:
        if self.sources:
            return list(self.sources)
        return [DataSource(path=self.path or "???", format=self.format)]


@dataclass
class PeftConfig:
    method: str = "lora"
    """lora | qlora | lora-int8"""
    r: int = 16
    alpha: int = 32
    dropout: float = 0.05
    target: str = "attention"
    """attention (q, k, v, o: the seeds' choice) | all-linear (adds gate, up, down)"""
    quant_type: str = "nf4"
    """qlora only: nf4 | fp4"""
    double_quant: bool = True
    """qlora only: quantize the per-block scales too (~0.37 bits less per weight)."""


@dataclass
class ZeroConfig:
    stage: int = 3
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
class TrainerConfig:
    micro_batch_size: int = 1
    global_batch_size: int = 16
    max_steps: int = 100
    lr: float = 2e-4
    min_lr_ratio: float = 0.1
    """Cosine decay ends at lr·min_lr_ratio."""
    warmup_steps: int = 10
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    precision: str = "bf16"
    """bf16 | fp32 (fp32 is for CPU demos and exact tests)"""
    activation_checkpointing: bool = True
    checkpoint_layers: str = "all"
    """With activation_checkpointing: how many decoder layers recompute their forward (the
    first N). all | N | auto: the fewest that fit plan.device_gib with 2 GiB to spare (all when
    no device is planned for). Fewer checkpointed layers, less recompute, more memory."""
    checkpointing_reentrant: bool = False
    optimizer: str = "adamw"
    """adamw (torch) | adamw_8bit (bitsandbytes; paged on CUDA) | cpu_adam (DeepSpeed, state and
    step on the host: ZeRO-Offload)"""
    optim_8bit_min_size: int = 4096
    """adamw_8bit: tensors with fewer elements keep 32-bit state (bitsandbytes' rule)."""
    loss: str = "auto"
    """auto (Liger's fused linear CE on CUDA when installed, else chunked) | chunked | plain
    (full-sequence logits, as HF models compute them) | liger"""
    loss_chunk_tokens: int = 512
    """Tokens per chunk of the chunked loss: its logits peak at chunk × vocab × 6 bytes in bf16
    (fp32 logits + their bf16 cast; README "The loss never holds the whole sequence's logits")."""
    on_nonfinite: str = "stop"
    """A step whose loss or gradient norm is not finite never updates the weights. stop: exit
    with code 3 (the last checkpoint is intact) | skip: discard the step and go on."""
    max_skipped_steps: int = 10
    """on_nonfinite=skip still stops after this many non-finite steps in a row."""
    seed: int = 42
    log_every: int = 1
    eval_every: int = 0
    """Validation loss every this many steps (needs a val split); always at the end. 0: end."""
    save_every: int = 200
    """Save a resumable checkpoint every this many steps (and always at the end); 0: end only."""
    keep_last: int = 2
    """Complete checkpoints kept in RUN_DIR/checkpoints (older ones are deleted)."""


@dataclass
class LoggerConfig:
    backend: str = "wandb"
    """wandb | none"""
    mode: str = "offline"
    """offline (default: nothing leaves the machine) | online | auto (online when logged in)"""
    project: str = "memtune"
    group: str | None = None
    name: str | None = None


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
    """OMP_NUM_THREADS per rank when not set in the environment. Default: cores // ranks."""


@dataclass
class PlanConfig:
    device_gib: float | None = None
    """Memory per GPU to plan against (RTX 4090D: 23.99); null: plan without a check (CPU)."""
    enforce: bool = True
    """Refuse, before any rank starts, a run whose planned peak exceeds device_gib."""
    auto_fit: bool = False
    """Instead of refusing, run the fastest variant that fits (checkpointing, smaller micro
    batch, ZeRO-3, 8-bit optimizer, QLoRA: see autofit.py). The choice is printed and saved."""


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    experiment: str = "custom"
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


def compose(overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """The config train.py would compose with these command-line overrides, outside Hydra's
    main (for the tests, the benchmarks and the GPU check)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=list(overrides))


def cache_dir() -> Path:
    """Where synthesized models live: $MEMTUNE_CACHE_DIR, else ~/.cache/memtune."""
    return Path(os.environ.get("MEMTUNE_CACHE_DIR", Path.home() / ".cache" / "memtune"))


def to_run_config(cfg: DictConfig | dict[str, Any]) -> RunConfig:
    """Merge a (possibly partial) config onto the schema and return the typed object."""
    merged = OmegaConf.merge(OmegaConf.structured(RunConfig), cfg)
    obj = OmegaConf.to_object(merged)
    assert isinstance(obj, RunConfig)
    return obj


def one_rank_zero(cfg: RunConfig) -> RunConfig:
    """``cfg``, or a copy on ZeRO-2 when ZeRO-3 would run on one rank (see one_rank_stage2)."""
    z = cfg.zero
    if not (cfg.launcher.num_ranks == 1 and z.stage == 3 and z.template is None):
        return cfg
    if not z.one_rank_stage2:
        return cfg
    out = copy.deepcopy(cfg)
    out.zero.stage = 2
    print(
        "memtune: one rank: ZeRO-2 instead of ZeRO-3 (nothing to shard; ZeRO-3's gather hooks "
        "only cost time). zero.one_rank_stage2=false keeps ZeRO-3.",
        flush=True,
    )
    return out


def checkpointed_layers(cfg: RunConfig) -> int:
    """Decoder layers that recompute their forward (the first ones): 0 .. num_hidden_layers."""
    layers = int(cfg.model.architecture.get("num_hidden_layers") or 0)
    if not cfg.trainer.activation_checkpointing:
        return 0
    value = str(cfg.trainer.checkpoint_layers)
    return layers if value in ("all", "auto") else min(int(value), layers)


def load_run_config(path: str | Path) -> RunConfig:
    loaded = OmegaConf.load(path)
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return to_run_config(loaded)


_CHOICES: dict[str, tuple[Any, ...]] = {
    "zero.stage": (2, 3),
    "peft.method": ("lora", "qlora", "lora-int8"),
    "peft.target": ("attention", "all-linear"),
    "peft.quant_type": ("nf4", "fp4"),
    "data.format": ("alpaca", "messages", "text"),
    "data.template": ("chatml", "plain"),
    "data.overlong": ("truncate", "drop"),
    "data.on_bad_record": ("error", "skip"),
    "trainer.precision": ("bf16", "fp32"),
    "trainer.loss": ("auto", "chunked", "plain", "liger"),
    "trainer.optimizer": ("adamw", "adamw_8bit", "cpu_adam"),
    "trainer.on_nonfinite": ("stop", "skip"),
    "model.attn_implementation": ("auto", "sdpa", "eager", "flash_attention_2"),
    "logger.backend": ("wandb", "none"),
    "logger.mode": ("offline", "online", "auto"),
}


def get_field(cfg: RunConfig, dotted: str) -> Any:
    """``get_field(cfg, "peft.r")`` → cfg.peft.r."""
    obj: Any = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def validate(cfg: RunConfig, inputs: bool = True) -> None:
    """Check what types cannot; raise :class:`ConfigError` naming the first bad field.
    ``inputs=False`` leaves out the model and data paths (a memory plan needs neither)."""
    for key, choices in _CHOICES.items():
        if get_field(cfg, key) not in choices:
            allowed = " | ".join(str(c) for c in choices)
            raise ConfigError(f"{key}={get_field(cfg, key)!r} is not supported; choose {allowed}")

    t, p = cfg.trainer, cfg.peft
    positive = {
        "peft.r": p.r,
        "peft.alpha": p.alpha,
        "trainer.micro_batch_size": t.micro_batch_size,
        "trainer.global_batch_size": t.global_batch_size,
        "trainer.max_steps": t.max_steps,
        "trainer.lr": t.lr,
        "trainer.log_every": t.log_every,
        "trainer.loss_chunk_tokens": t.loss_chunk_tokens,
        "trainer.keep_last": t.keep_last,
        "trainer.max_skipped_steps": t.max_skipped_steps,
        "launcher.num_ranks": cfg.launcher.num_ranks,
        "launcher.nnodes": cfg.launcher.nnodes,
        "data.max_seq_len": cfg.data.max_seq_len,
    }
    for key, value in positive.items():
        if value <= 0:
            raise ConfigError(f"{key} must be > 0 (got {value})")
    if not 0.0 <= p.dropout < 1.0:
        raise ConfigError(f"peft.dropout must be in [0, 1) (got {p.dropout})")
    if t.warmup_steps < 0:
        raise ConfigError(f"trainer.warmup_steps must be >= 0 (got {t.warmup_steps})")
    if not 0.0 <= t.min_lr_ratio <= 1.0:
        raise ConfigError(f"trainer.min_lr_ratio must be in [0, 1] (got {t.min_lr_ratio})")
    ckpt = str(t.checkpoint_layers)
    if ckpt not in ("all", "auto") and not (ckpt.isdigit() and int(ckpt) >= 0):
        raise ConfigError(
            f"trainer.checkpoint_layers={ckpt!r} is not supported; choose all | auto | a number "
            "of layers >= 0"
        )
    if t.eval_every < 0:
        raise ConfigError(f"trainer.eval_every must be >= 0 (got {t.eval_every})")
    if t.save_every < 0:
        raise ConfigError(
            f"trainer.save_every must be >= 0, 0 saves at the end only (got {t.save_every})"
        )
    if t.max_grad_norm < 0:
        raise ConfigError(f"trainer.max_grad_norm must be >= 0, 0 disables (got {t.max_grad_norm})")
    if cfg.launcher.num_ranks % cfg.launcher.nnodes:
        raise ConfigError(
            f"launcher.num_ranks={cfg.launcher.num_ranks} (all ranks) is not a multiple of "
            f"launcher.nnodes={cfg.launcher.nnodes}: every node runs the same number of ranks"
        )
    per_step = t.micro_batch_size * cfg.launcher.num_ranks
    if t.global_batch_size % per_step:
        raise ConfigError(
            f"trainer.global_batch_size={t.global_batch_size} is not a multiple of "
            f"trainer.micro_batch_size × launcher.num_ranks = {t.micro_batch_size} × "
            f"{cfg.launcher.num_ranks} = {per_step}"
        )
    if t.loss == "liger" and importlib.util.find_spec("liger_kernel") is None:
        raise ConfigError(
            "trainer.loss=liger needs the liger-kernel package (CUDA only); "
            "use trainer.loss=auto to fall back to memtune's chunked loss"
        )
    for key in ("zero.reduce_bucket_size", "zero.prefetch_bucket_size"):
        value = get_field(cfg, key)
        if value is not None and value <= 0:
            raise ConfigError(f"{key} must be > 0 when set (got {value})")
    if (
        cfg.zero.param_persistence_threshold is not None
        and cfg.zero.param_persistence_threshold < 0
    ):
        raise ConfigError("zero.param_persistence_threshold must be >= 0 when set")
    arch = cfg.model.architecture
    if not arch.get("hidden_size"):
        raise ConfigError(
            "model.architecture.hidden_size is missing: every model config carries its "
            "config.json fields (see conf/model/qwen2.5-7b.yaml)"
        )
    if cfg.model.name_or_path in ("", "???"):
        raise ConfigError("model.name_or_path is not set: give a hub name or a local directory")
    if inputs:
        _check_model_path(cfg.model)
        _check_data(cfg.data)


def _check_data(data: DataConfig) -> None:
    from memtune.readers import FORMATS, is_local_source

    if data.path and data.sources:
        raise ConfigError("data.path and data.sources are both set: use one")
    if not data.path and not data.sources:
        raise ConfigError(
            "data.path is not set: give your file, e.g. data.path=/data/train.jsonl "
            "(or data.sources for several)"
        )
    for i, src in enumerate(data.all_sources()):
        key = "data.path" if not data.sources else f"data.sources[{i}]"
        if src.format not in FORMATS:
            raise ConfigError(f"{key}: format {src.format!r}; choose {' | '.join(FORMATS)}")
        if src.weight <= 0:
            raise ConfigError(f"{key}: weight must be > 0 (got {src.weight})")
        if is_local_source(src.path) and not Path(src.path).expanduser().exists():
            raise ConfigError(f"{key}={src.path!r}: no such file or folder")
    if not 0.0 <= data.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction must be in [0, 1) (got {data.val_fraction})")
    if data.val_path and data.val_fraction:
        raise ConfigError("data.val_path and data.val_fraction are both set: use one")
    if data.val_path and not Path(data.val_path).expanduser().exists():
        raise ConfigError(f"data.val_path={data.val_path!r}: no such file or folder")
    if data.packing and data.group_by_length:
        raise ConfigError("data.packing and data.group_by_length exclude each other")


def _check_model_path(model: ModelConfig) -> None:
    """A local path must hold a checkpoint; "org/name" is left to the hub (or its cache)."""
    name = model.name_or_path
    looks_local = name.startswith(("/", ".", "~"))
    path = Path(name).expanduser()
    if model.synthesize or not (looks_local or path.exists()):
        return
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"model.name_or_path={name!r}: no config.json there; point it at a directory "
            "saved with save_pretrained (or a hub name such as Qwen/Qwen2.5-7B-Instruct)"
        )


def grad_accumulation_steps(cfg: RunConfig) -> int:
    t = cfg.trainer
    return t.global_batch_size // (t.micro_batch_size * cfg.launcher.num_ranks)
