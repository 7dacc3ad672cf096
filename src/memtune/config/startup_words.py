"""What is allowed but worth a word at start-up: warnings (risky: remote code from a repo that
can move) and notes (settings that do less than they seem to). config.validate refuses; these
only print, before launch (launcher.prepare) and in ``memtune plan``."""

from __future__ import annotations

import re
from pathlib import Path

from memtune.config.schema import ASSETS_DIR, RunConfig

COMMIT = re.compile(r"[0-9a-f]{40}")


def config_warnings(cfg: RunConfig) -> list[str]:
    """What is allowed but risky, one sentence each, for the launcher to print before launch
    (validate() raises; these only warn)."""
    out = []
    m = cfg.model
    on_disk = Path(m.name_or_path).expanduser().is_dir() or m.synthesize
    if m.trust_remote_code and not on_disk and not COMMIT.fullmatch(m.revision or ""):
        pinned = "is not set" if m.revision is None else f"is {m.revision!r}, which can move"
        out.append(
            f"model.trust_remote_code=true runs the Python code of the hub repo "
            f"{m.name_or_path} on every rank, and model.revision {pinned}: whatever the repo "
            "holds when it is downloaded runs. Pin the commit you reviewed: "
            "model.revision=<40-hex commit hash>"
        )
    return out


def config_notes(cfg: RunConfig) -> list[str]:
    """Settings that do less than they seem to, one sentence each, printed at start-up as
    ``memtune: note: ...``: allowed (a short test run may mean them), but silent otherwise."""
    out = []
    t, data = cfg.trainer, cfg.data
    if t.eval_every and not data.val_fraction and not data.val_path:
        out.append(
            f"trainer.eval_every={t.eval_every} without a validation split (data.val_fraction "
            "is 0 and data.val_path is not set): nothing will be evaluated; hold some data "
            "out with data.val_fraction=0.05 or give data.val_path"
        )
    if t.warmup_steps >= t.max_steps:
        # rank.loop.lr_factor: the last step (max_steps - 1 done) is still warming up
        peak = t.max_steps / (t.warmup_steps + 1)
        out.append(
            f"trainer.warmup_steps={t.warmup_steps} with trainer.max_steps={t.max_steps}: the "
            f"run ends inside its warmup, so the learning rate peaks at {peak:.0%} of "
            f"trainer.lr={t.lr:g}; set trainer.warmup_steps below {t.max_steps} to reach it"
        )
    bundled = ASSETS_DIR.resolve()
    ours = [
        src.path
        for src in data.all_sources()
        if not Path(src.path).expanduser().resolve().is_relative_to(bundled)
    ]
    if cfg.model.synthesize and ours:
        name = Path(cfg.model.name_or_path).name
        out.append(
            f"the model is {name}, a tiny model with random weights built for the demo and the "
            "tests, and the data is yours: it learns nothing useful; give a real base with "
            "experiment=... (the 4x4090 ones) or model=... (docs/models.md)"
        )
    return out
