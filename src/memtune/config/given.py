"""The settings as a run will see them, before anything is decided: composed, typed, completed
with the architecture the ranks will load, validated, with the start-up notes said. Every entry
point (train.py's job, ``memtune plan``, ``memtune trace``) starts here."""

from __future__ import annotations

from omegaconf import DictConfig

from memtune.config import RunConfig, to_run_config, validate
from memtune.config.architecture import resolve_architecture
from memtune.config.startup_words import config_notes, config_warnings


def given_config(cfg_node: DictConfig, inputs: bool = True) -> RunConfig:
    """The composed config as the run will see it: typed, planned with the architecture the
    ranks will really load (config.architecture), validated (``inputs=False``: no data or model
    path checks, for plan_only)."""
    cfg, notes = resolve_architecture(to_run_config(cfg_node))
    for note in notes:
        print(f"memtune: {note}", flush=True)
    validate(cfg, inputs=inputs)
    for warning in config_warnings(cfg):
        print(f"memtune: warning: {warning}", flush=True)
    for note in config_notes(cfg):
        print(f"memtune: note: {note}", flush=True)
    return cfg
