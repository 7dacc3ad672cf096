"""The one config tree: schema, validation, derived values and the DeepSpeed JSON.

``schema`` types every Hydra group, ``validate`` checks what a type cannot, ``derive`` computes
each value derived from the settings once, ``decisions`` is the typed value of what was decided
for a run (memory.fit decides it), ``deepspeed`` fills the DeepSpeed JSON from both. The names
most modules need are re-exported here (``from memtune.config import RunConfig, validate``).
"""

from memtune.config.derive import (
    LORA_TARGETS,
    compute_bytes,
    live_reference,
    lora_targets,
    needs_reference,
    one_rank_stage,
    persistence_threshold,
    preference_loss_kind,
    prefetch_bucket_elements,
    reduce_bucket_elements,
    rope_positions,
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
    "compose",
    "compute_bytes",
    "get_field",
    "live_reference",
    "load_run_config",
    "lora_targets",
    "needs_reference",
    "one_rank_stage",
    "persistence_threshold",
    "preference_loss_kind",
    "prefetch_bucket_elements",
    "reduce_bucket_elements",
    "register_configs",
    "rope_positions",
    "to_run_config",
    "validate",
]
