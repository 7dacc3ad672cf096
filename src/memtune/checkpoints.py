"""A checkpoint directory as the job and the ranks both see it: its names, when it is complete,
and which one a run resumes from.

    RUN_DIR/checkpoints/step-0000040/
        engine/            DeepSpeed state of the trainable parameters: fp32 master weights,
                           optimizer moments, LR scheduler (frozen base weights excluded)
        adapter/           the LoRA adapter at this step, PEFT format
        gathered_state.*   the trainable state gathered from every rank (Adam optimizers):
                           what lets a resume change the number of ranks or the ZeRO stage
        trainer_state.json step, loss history, wall time, world size (rundir.TrainState)
        rng_rank{r}.pt     python / numpy / torch RNG states of every rank (CUDA: its own card's)
        config.yaml        the run's settings as the user gave them; decisions.json, what
                           was decided for them (compared on resume); base.json, its base
        manifest.json      every file above with its size and SHA-256 (memtune.integrity)
        complete.json      written last: a directory without it is never resumed from
    RUN_DIR/checkpoints/latest   name of the newest complete checkpoint, replaced atomically

The ranks write it (rank.checkpoint.save_checkpoint, then :func:`seal`); the job reads it
before any rank starts (launcher.prepare: :func:`find_latest`, :func:`is_complete`, the
manifest, :func:`has_gathered_state`). What needs torch or DeepSpeed to write or load a
checkpoint stays in rank.checkpoint, which the job side never imports: this module holds what
both sides need, and imports nothing that needs either.
"""

from __future__ import annotations

import json
from pathlib import Path

from memtune.filesystem import (
    REPLACED_LEFT,
    remove_leftover,
    set_aside_and_replaced,
    write_atomic,
)
from memtune.integrity import MANIFEST, Store, verify_manifest

TRAINER_STATE = "trainer_state.json"

COMPLETE = "complete.json"
"""A checkpoint is complete once rank 0 wrote it, last (:func:`seal`)."""

CHECKPOINT = Store("checkpoint", 1, digest="sha256")
"""A checkpoint's manifest: SHA-256 (hashed once at a save and once at a resume; a user can
check a copied checkpoint with sha256sum). Read with :func:`memtune.integrity.verify_manifest`,
which trusts a checkpoint from before manifests; a damaged one is skipped, never rebuilt."""

LATEST = "latest"
"""The name of the newest complete checkpoint, in the checkpoints folder."""

GATHERED = "gathered_state.safetensors"
GATHERED_META = "gathered_state.json"
"""A checkpoint's trainable state gathered from every rank (rank.checkpoint writes them with an
Adam optimizer): what lets the job allow a resume on another number of ranks or ZeRO stage."""


def has_gathered_state(checkpoint: Path) -> bool:
    return (checkpoint / GATHERED).is_file() and (checkpoint / GATHERED_META).is_file()


def step_dir_name(step: int) -> str:
    return f"step-{step:07d}"


SAVING = ".tmp-"
"""A checkpoint being saved: ``checkpoints/.tmp-step-N``, renamed to ``step-N`` once every rank
has written its part (rank.checkpoint.save_checkpoint)."""


def remove_cut_short_saves(root: Path) -> list[Path]:
    """Remove the saves in checkpoints dir ``root`` that a killed job left unfinished
    (``.tmp-step-N``: never read as a checkpoint), each with one line; for the job to call
    before its ranks start, the run dir held (no save of this run can be in progress). Such a
    leftover was replaced only by a save of the very same step, so a resume with another
    save_every, a lower max_steps, or none at all, kept it for good. A sealed one
    (complete.json: killed inside replace_dir, between setting the older save of its step
    aside and renaming this one into place) is the newest save of its step: kept. An older
    save of a step set aside (``.old-step-N.XXXXXXXX``) beside a complete ``step-N`` is
    removed too: a kill after the new one was in place left it (filesystem.replace_dir)."""
    removed = []
    for left in sorted(root.glob(f"{SAVING}step-*")):
        if left.is_symlink() or not left.is_dir() or is_complete(left):
            continue
        why = "a checkpoint whose save was cut short (its job was killed while writing it)"
        if remove_leftover(left, why):
            removed.append(left)
    # A step saved again (a resumed run's last step) and killed once the new save was in
    # place, before the older one set aside was removed: kept beside a complete one for good.
    for step in sorted(root.glob("step-*")):
        for left in set_aside_and_replaced(step) if is_complete(step) else []:
            if remove_leftover(left, REPLACED_LEFT.format(f"save of {step.name}")):
                removed.append(left)
    return removed


def is_complete(path: Path) -> bool:
    return (path / COMPLETE).is_file() and (path / TRAINER_STATE).is_file()


def seal(checkpoint: Path, step: int) -> None:
    """A checkpoint's last writes, once every other file is in it: the manifest (every file
    fsynced, then listed with its size and hash), then complete.json."""
    CHECKPOINT.seal(checkpoint, skip=(COMPLETE,))
    sealed = {"step": step, "manifest": MANIFEST}
    write_atomic(checkpoint / COMPLETE, json.dumps(sealed) + "\n")


def checkpoint_problem(checkpoint: Path) -> str | None:
    """What is wrong with a complete checkpoint, by its manifest (integrity.verify_manifest).
    One sealed with a manifest (complete.json names it) and now without it is damaged: only a
    checkpoint written before manifests existed is trusted without one."""
    try:
        sealed = json.loads((checkpoint / COMPLETE).read_text())
    except (OSError, ValueError):
        return f"its {COMPLETE} cannot be read"
    named = sealed.get("manifest") if isinstance(sealed, dict) else None
    if named and not (checkpoint / named).is_file():
        return f"its {named} is missing ({COMPLETE} says it was sealed with one)"
    return verify_manifest(checkpoint)


def older_to_remove(root: Path, saved: Path, keep_last: int) -> list[Path]:
    """The complete checkpoints of the checkpoints folder ``root`` to remove once ``saved`` (the
    one just written) is in place: all but the newest ``keep_last``, counting ``saved`` and the
    ones before it. A checkpoint of a later step (left by the run before a resume: a damaged one
    skipped, or the steps after the checkpoint a resume named) is neither counted nor removed:
    counted, it took the place of the one just saved, which was removed with keep_last 1 while
    ``latest`` still named it."""
    done = sorted(p for p in root.glob("step-*") if is_complete(p) and p.name <= saved.name)
    return done[: max(0, len(done) - keep_last)]


def find_latest(root: Path) -> tuple[Path | None, list[str]]:
    """Newest complete checkpoint in the checkpoints folder ``root`` (RunDir.checkpoints), and
    warnings about any skipped on the way."""
    warnings: list[str] = []
    if not root.is_dir():
        return None, warnings
    # A crash between the two renames of a re-save (rank.checkpoint.save_checkpoint) leaves
    # the step only at its set-aside name: still a candidate.
    found = {p.name: p for p in root.glob("step-*") if p.is_dir()}
    for aside in root.glob(".old-step-*"):
        found.setdefault(aside.name[len(".old-") :].split(".")[0], aside)
    candidates = [found[name] for name in sorted(found, reverse=True)]
    pointer = root / LATEST
    if pointer.is_file():
        named = root / pointer.read_text().strip()
        if named in candidates:
            candidates.remove(named)
            candidates.insert(0, named)
    for path in candidates:
        if not is_complete(path):
            warnings.append(f"skipping {path}: incomplete (a save was interrupted)")
            continue
        problem = checkpoint_problem(path)
        if problem is None:
            return path, warnings
        warnings.append(f"skipping {path}: damaged ({problem}); the one before it is used")
    return None, warnings
