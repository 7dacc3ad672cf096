"""The launcher side of a run: validate, derive, and lay out the run dir the ranks read."""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from memtune.config import RunConfig, to_run_config, validate
from memtune.ds_config import build_ds_config
from memtune.preprocess import Prepared, preprocess


def prepare_run_dir(cfg_node: DictConfig, run_dir: Path) -> RunConfig:
    """Validate ``cfg_node``, write ``config.yaml`` and ``ds_config.json`` to ``run_dir``.

    Everything that can fail before a rank starts fails here: schema, ranges, the DeepSpeed
    template, a missing data file. A synthesized demo model is built here too, once, rather
    than by every rank at the same time.
    """
    cfg = to_run_config(cfg_node)
    cfg.run_dir = str(run_dir)
    validate(cfg)
    ds_config = build_ds_config(cfg)
    if cfg.model.synthesize:
        from memtune.tiny import synthesize

        synthesize(cfg.model.name_or_path, cfg.model.architecture)
    prepared = prepare_data(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    (run_dir / "ds_config.json").write_text(json.dumps(ds_config, indent=2) + "\n")
    data_record = {
        "dir": str(prepared.dir),
        "reused": prepared.reused,
        "train": prepared.train.as_dict(),
        "val": prepared.val and prepared.val.as_dict(),
    }
    (run_dir / "data.json").write_text(json.dumps(data_record, indent=2) + "\n")
    return cfg


def prepare_data(cfg: RunConfig) -> Prepared:
    """Tokenize into the cache (or find it there) and say what was kept, cut and dropped."""
    from memtune.model import load_tokenizer

    prepared = preprocess(cfg.data, load_tokenizer(cfg), cfg.trainer.seed)
    how = "reused cache" if prepared.reused else "tokenized into"
    print(f"memtune: data {how} {prepared.dir}", flush=True)
    print(f"memtune: train: {prepared.train.line()}", flush=True)
    if prepared.val is not None:
        print(f"memtune: val: {prepared.val.line()}", flush=True)
    for example in prepared.train.bad_examples[1:]:
        print(f"memtune:   also skipped: {example}", flush=True)
    return prepared
