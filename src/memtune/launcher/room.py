"""The run dir's room on the disk: what a run's checkpoints and adapter take there, checked
before launch against the free space, so that no rank fails at its first save with a full disk,
hours in. Sized from the parameter counts (memory.counts); the job side's, like every check
that refuses a run before a rank starts.
"""

from __future__ import annotations

from memtune.checkpoints import is_complete
from memtune.config import ConfigError, RunConfig, compute_bytes
from memtune.config.schema import Optimizer
from memtune.filesystem import free_bytes, human_bytes
from memtune.memory.counts import ParamCounts
from memtune.rundir import RunDir

CHECKPOINT_STATE_BYTES = {"adamw": 12, "cpu_adam": 12, "adamw_8bit": 6}
"""Per trainable parameter in DeepSpeed's engine files: the fp32 master weight and the
optimizer's two moments (fp32, or 8-bit with bitsandbytes' AdamW)."""


def checkpoint_bytes(cfg: RunConfig, optimizer: Optimizer, counts: ParamCounts) -> int:
    """The least one resumable checkpoint takes on disk (rank.checkpoint.save_checkpoint):
    the engine files (CHECKPOINT_STATE_BYTES per trainable parameter, summed over the ranks'
    partitions), the gathered copy of the same state that lets a resume change the number of
    ranks (Adam optimizers only) and the adapter in the compute dtype. RNG states and
    DeepSpeed's bookkeeping are left out: the demo's real checkpoint (fp32, AdamW, 217,088
    trainable parameters) is 6.26 MB, this says 6.08 MB."""
    state = CHECKPOINT_STATE_BYTES[optimizer]
    gathered = 0 if optimizer == "adamw_8bit" else state
    return counts.lora * (state + gathered + compute_bytes(cfg))


def run_dir_bytes(
    cfg: RunConfig, optimizer: Optimizer, counts: ParamCounts, present: int = 0
) -> int:
    """The least a run still writes into its run dir: the checkpoints that exist at once (the
    newest trainer.keep_last and the one being written, which is complete before the oldest
    is pruned; fewer when max_steps leaves fewer saves), less the ``present`` ones already on
    the disk (a resumed run's: paid for), and the final adapter."""
    t = cfg.trainer
    saves = -(-t.max_steps // t.save_every) if t.save_every else 1
    at_once = max(0, min(saves, t.keep_last + 1) - present)
    return at_once * checkpoint_bytes(cfg, optimizer, counts) + counts.lora * compute_bytes(cfg)


def check_run_dir_room(
    cfg: RunConfig, optimizer: Optimizer, counts: ParamCounts, rd: RunDir
) -> None:
    """Refuse before launch a run whose checkpoints cannot fit where it writes them: the ranks
    would otherwise fail at their first save with a full disk, hours in. A lower bound
    (:func:`run_dir_bytes`), so a run that may fit is never refused. ``optimizer``: the
    decided one (its state is what the checkpoints hold)."""
    root = rd.checkpoints
    present = 0  # resume=never: the earlier checkpoints move aside, on the same disk
    if root.is_dir() and cfg.resume != "never":
        present = sum(1 for p in root.glob("step-*") if is_complete(p))
    need, free = run_dir_bytes(cfg, optimizer, counts, present), free_bytes(rd.path)
    if free is None or need <= free:
        return
    each = checkpoint_bytes(cfg, optimizer, counts)
    raise ConfigError(
        f"run_dir {rd.path}: the run needs at least {human_bytes(need)} for its checkpoints "
        f"({human_bytes(each)} each, trainer.keep_last={cfg.trainer.keep_last} kept and one "
        f"being written, and the adapter), {human_bytes(free)} free there; free space, lower "
        "trainer.keep_last, or point run_dir at a filesystem with room"
    )
