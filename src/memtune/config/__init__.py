"""The one config tree: schema, validation, derived values and the DeepSpeed JSON.

``schema`` types every Hydra group, ``validate`` checks what a type cannot, ``derive`` computes
each derived value once, ``deepspeed`` fills the DeepSpeed JSON. The names most modules need are
re-exported here (``from memtune.config import RunConfig, validate``).
"""

from memtune.config.derive import (
    LORA_TARGETS,
    checkpointed_layers,
    checkpointing_label,
    compute_bytes,
    data_parallel_ranks,
    grad_accumulation_steps,
    one_rank_zero,
    persistence_threshold,
    prefetch_bucket_elements,
    reduce_bucket_elements,
    sequence_parallel_size,
)
from memtune.config.schema import (
    ASSETS_DIR,
    CONF_DIR,
    SOURCE_ROOT,
    ConfigError,
    DataConfig,
    DataSource,
    LauncherConfig,
    LoggerConfig,
    ModelConfig,
    PeftConfig,
    PlanConfig,
    RunConfig,
    TrainerConfig,
    ZeroConfig,
    cache_dir,
    compose,
    load_run_config,
    register_configs,
    to_run_config,
)
from memtune.config.validate import get_field, validate

__all__ = [
    "ASSETS_DIR",
    "CONF_DIR",
    "LORA_TARGETS",
    "SOURCE_ROOT",
    "ConfigError",
    "DataConfig",
    "DataSource",
    "LauncherConfig",
    "LoggerConfig",
    "ModelConfig",
    "PeftConfig",
    "PlanConfig",
    "RunConfig",
    "TrainerConfig",
    "ZeroConfig",
    "cache_dir",
    "checkpointed_layers",
    "checkpointing_label",
    "compose",
    "compute_bytes",
    "data_parallel_ranks",
    "get_field",
    "grad_accumulation_steps",
    "load_run_config",
    "one_rank_zero",
    "persistence_threshold",
    "prefetch_bucket_elements",
    "reduce_bucket_elements",
    "register_configs",
    "sequence_parallel_size",
    "to_run_config",
    "validate",
]
