"""The run dir's typed records: what is written is what is read back, an old checkpoint format
is read, a newer or broken one is refused naming the file and the fields."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memtune.checkpoints import find_latest, older_to_remove, seal
from memtune.rundir import (
    TRAIN_STATE_VERSION,
    DataRecord,
    RecordError,
    RunDir,
    TrainState,
)

STATE = {
    "step": 8,
    "label_tokens": 1200,
    "input_tokens": 5000,
    "losses": [3.0, 2.5],
    "skipped": [],
    "wall_s": 4.5,
    "world_size": 2,
    "data_dir": "/cache/data/abc",
}


def test_train_state_round_trips_with_its_version(tmp_path: Path) -> None:
    TrainState(**STATE).write(tmp_path)
    raw = json.loads((tmp_path / "trainer_state.json").read_text())
    assert raw == {**STATE, "version": TRAIN_STATE_VERSION}
    assert TrainState.read(tmp_path) == TrainState(**STATE)


def test_a_checkpoint_from_before_versions_is_read(tmp_path: Path) -> None:
    (tmp_path / "trainer_state.json").write_text(json.dumps(STATE))  # no "version" field
    assert TrainState.read(tmp_path).version == 1


def test_a_newer_or_incomplete_checkpoint_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "trainer_state.json"
    path.write_text(json.dumps({**STATE, "version": TRAIN_STATE_VERSION + 1}))
    with pytest.raises(RecordError, match=r"trainer_state\.json: format version 2"):
        TrainState.read(tmp_path)
    path.write_text(json.dumps({k: v for k, v in STATE.items() if k not in ("step", "wall_s")}))
    with pytest.raises(RecordError, match=r"trainer_state\.json: missing step, wall_s"):
        TrainState.read(tmp_path)


def test_run_dir_records_keep_their_file_formats(tmp_path: Path) -> None:
    rd = RunDir(tmp_path / "run")
    rd.write_exit(0)
    assert json.loads(rd.exit.read_text()) == {"code": 0}
    rd.write_exit(2, "config error: peft.r must be > 0")
    assert rd.read_exit().error == "config error: peft.r must be > 0"
    rd.write_resume(None)
    assert json.loads(rd.resume.read_text()) == {"checkpoint": None, "changed": {}}
    rd.write_resume(tmp_path / "ckpt", {"launcher.num_ranks": [2, 1]})
    assert rd.read_resume().checkpoint == str(tmp_path / "ckpt")
    assert rd.read_resume().changed == {"launcher.num_ranks": [2, 1]}
    rd.write_data(DataRecord(dir="/d", reused=True, train={"samples": 3}))
    assert rd.read_data() == DataRecord(dir="/d", reused=True, train={"samples": 3}, val=None)
    assert (
        rd.preflight(0).name == "preflight.json" and rd.preflight(1).name == "preflight-node1.json"
    )
    assert rd.launch_cmd(1).name == "launch-node1.txt"


def test_the_newest_complete_checkpoint_wins(tmp_path: Path) -> None:
    root = RunDir(tmp_path).checkpoints
    for step, complete in ((4, True), (8, True), (12, False)):
        ckpt = root / f"step-{step:07d}"
        ckpt.mkdir(parents=True)
        TrainState(**{**STATE, "step": step}).write(ckpt)
        if complete:
            (ckpt / "complete.json").write_text("{}")
    latest, warnings = find_latest(root)
    assert latest == root / "step-0000008"
    assert warnings == [f"skipping {root / 'step-0000012'}: incomplete (a save was interrupted)"]


def test_a_checkpoint_left_at_its_set_aside_name_is_still_found(tmp_path: Path) -> None:
    """A crash between a re-save's two renames leaves step N only at its set-aside name."""
    root = RunDir(tmp_path).checkpoints
    for name, step in (("step-0000004", 4), (".old-step-0000008.k3j2x_q", 8)):
        ckpt = root / name
        ckpt.mkdir(parents=True)
        TrainState(**{**STATE, "step": step}).write(ckpt)
        (ckpt / "complete.json").write_text("{}")
    latest, _ = find_latest(root)
    assert latest == root / ".old-step-0000008.k3j2x_q"


KILLED_AFTER_THE_RENAME = (
    "import os, signal, sys; from pathlib import Path; from memtune.filesystem import "
    "replace_dir; replace_dir(Path(sys.argv[1]), Path(sys.argv[2]), "
    "before_removal=lambda: os.kill(os.getpid(), signal.SIGKILL))"
)


def test_a_copy_a_killed_replace_set_aside_is_removed_once_the_new_one_is_in_place(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Seen: a process killed inside replace_dir once the new adapter (or a step saved again)
    was in place, before the older one set aside was removed (the checkpoint's ``latest``
    is written there), left .old-NAME.XXXXXXXX, a whole older copy, for good. The next
    replace of the same name removes it, and a job's start removes a checkpoint's beside a
    complete step; one whose step is missing (the only copy: find_latest reads it), or
    beside an incomplete one, is kept."""
    import os
    import socket
    import subprocess
    import sys

    from memtune.checkpoints import TRAINER_STATE, remove_cut_short_saves
    from memtune.filesystem import replace_dir
    from tests.conftest import ROOT

    adapter = tmp_path / "adapter"
    for name, text in (("adapter", "older"), ("new", "newer"), ("newest", "newest")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_model.safetensors").write_text(text * 1024)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    args = [sys.executable, "-c", KILLED_AFTER_THE_RENAME, str(tmp_path / "new"), str(adapter)]
    assert subprocess.run(args, env=env, timeout=60).returncode == -9
    (left,) = tmp_path.glob(".old-adapter.*")
    assert (adapter / "adapter_model.safetensors").read_text().startswith("newer")
    capsys.readouterr()
    replace_dir(tmp_path / "newest", adapter)
    assert capsys.readouterr().out == (
        f"memtune: removed {left} (5.0 KiB): an earlier adapter that a process killed after "
        "replacing it left set aside\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]

    # Only memtune's names, this host's, of a process that has ended: a user's backup of the
    # shape mkdtemp's suffix alone gives (.old-NAME.20261207) is kept, as is a live pid's.
    ended = subprocess.Popen(["true"])  # a pid no process has now
    ended.wait()
    mine = f"{socket.gethostname()}-{ended.pid}-abcd1234"
    root = RunDir(tmp_path / "run").checkpoints
    for name in ("step-0000010", f".old-step-0000010.{mine}", f".old-step-0000012.{mine}"):
        (root / name).mkdir(parents=True)
        (root / name / TRAINER_STATE).write_text('{"step": 10}\n')
        seal(root / name, 10)
    kept = [
        ".old-step-0000010.20261207",
        f".old-step-0000010.{socket.gethostname()}-{os.getpid()}-abcd1234",
        f".old-step-0000010.another-host-{ended.pid}-abcd1234",
    ]
    for name in kept:
        (root / name).mkdir()
    (root / "step-0000004").mkdir()  # incomplete: its set-aside copy is kept
    (root / f".old-step-0000004.{mine}").mkdir()
    assert remove_cut_short_saves(root) == [root / f".old-step-0000010.{mine}"]
    said = capsys.readouterr().out
    assert said.startswith(f"memtune: removed {root / f'.old-step-0000010.{mine}'} (")
    assert said.endswith(
        "): an earlier save of step-0000010 that a process killed after replacing it left "
        "set aside\n"
    )
    also = [f".old-step-0000004.{mine}", f".old-step-0000012.{mine}", "step-0000004"]
    assert sorted(p.name for p in root.iterdir()) == sorted([*kept, *also, "step-0000010"])


def test_pruning_keeps_the_checkpoint_just_saved_whatever_later_steps_are_there(
    tmp_path: Path,
) -> None:
    """Resumed from step 4 past a newer step 12 (damaged, so skipped; or left behind by
    resume=<step 4>): saving step 8 with keep_last 1 removes step 4 only. Counting step 12,
    it removed step 8 itself, which ``latest`` names: the next resume found nothing whole."""
    root = RunDir(tmp_path).checkpoints
    for step in (4, 12, 8):
        ckpt = root / f"step-{step:07d}"
        ckpt.mkdir(parents=True)
        TrainState(**{**STATE, "step": step}).write(ckpt)
        (ckpt / "complete.json").write_text("{}")
    (root / "step-0000012" / "manifest.json").write_text("not json")  # damaged
    (root / "latest").write_text("step-0000008\n")
    saved = root / "step-0000008"
    assert older_to_remove(root, saved, keep_last=1) == [root / "step-0000004"]
    assert older_to_remove(root, saved, keep_last=2) == []
    (root / "step-0000004" / "complete.json").unlink()  # as if removed
    assert find_latest(root)[0] == saved


def test_a_sealed_checkpoint_without_its_manifest_is_damaged(tmp_path: Path) -> None:
    """complete.json names the manifest a checkpoint was sealed with: one missing it now (a
    partial copy) is skipped as damaged, not trusted unverified; one written before manifests
    existed (complete.json without the name) is still trusted."""
    root = RunDir(tmp_path).checkpoints
    for step in (2, 4):
        ckpt = root / f"step-{step:07d}"
        ckpt.mkdir(parents=True)
        TrainState(**{**STATE, "step": step}).write(ckpt)
        seal(ckpt, step)
    assert find_latest(root) == (root / "step-0000004", [])
    (root / "step-0000004" / "manifest.json").unlink()
    latest, warnings = find_latest(root)
    assert latest == root / "step-0000002"
    assert warnings == [
        f"skipping {root / 'step-0000004'}: damaged (its manifest.json is missing (complete.json "
        "says it was sealed with one)); the one before it is used"
    ]
    (root / "step-0000004" / "complete.json").write_text('{"step": 4}')  # an older memtune's
    assert find_latest(root) == (root / "step-0000004", [])


def test_the_adapter_a_stage_started_from_is_compared_by_content(tmp_path: Path, capsys) -> None:
    """peft.init_from on resume: the same adapter moved resumes (said), another adapter at the
    same path is a difference (a walk-through resumed DPO against a replaced SFT adapter)."""
    import shutil

    from memtune.config.architecture import adapter_fingerprint
    from memtune.launcher.prepare import _start_differences
    from memtune.rundir import BaseRecord, RunDir

    sft = tmp_path / "sft"
    sft.mkdir()
    (sft / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8}')
    (sft / "adapter_model.safetensors").write_bytes(b"weights one")
    moved = tmp_path / "moved"
    shutil.copytree(sft, moved)
    assert adapter_fingerprint(sft) == adapter_fingerprint(moved) is not None
    ckpt = tmp_path / "step-8"
    ckpt.mkdir()
    RunDir(ckpt).write_base(BaseRecord("base", "f", str(sft), adapter_fingerprint(sft)))

    def now(path: Path) -> BaseRecord:
        return BaseRecord("base", "f", str(path), adapter_fingerprint(path))

    assert _start_differences(ckpt, now(sft)) == []
    assert _start_differences(ckpt, now(moved)) == []
    assert f"the adapter of peft.init_from moved ({sft} → {moved})" in capsys.readouterr().out
    (sft / "adapter_model.safetensors").write_bytes(b"weights two")  # replaced in place
    (said,) = _start_differences(ckpt, now(sft)) or [""]
    assert said.startswith(f"  peft.init_from: the adapter at {sft} is not the one the checkpoint")
    assert "(the same path)" in said
    # a checkpoint from before the fingerprint: the path is compared instead
    RunDir(ckpt).write_base(BaseRecord("base", "f"))
    assert _start_differences(ckpt, now(sft)) is None


def test_resume_given_a_run_dir_names_its_checkpoint(tmp_path: Path) -> None:
    """resume=RUN_DIR (not one of its checkpoints): the refusal says which checkpoint to give,
    or run_dir= to continue in place (a walk-through got 'not a complete memtune checkpoint')."""
    import pytest

    from memtune.config import ConfigError, to_run_config
    from memtune.launcher.prepare import resolve_resume
    from memtune.rundir import RunDir
    from tests.conftest import compose_cfg, decided

    run = tmp_path / "full"
    (run / "checkpoints").mkdir(parents=True)
    cfg = to_run_config(compose_cfg([f"resume={run}"]))
    with pytest.raises(ConfigError) as err:
        resolve_resume(cfg, decided(cfg), RunDir(tmp_path / "new"), tmp_path)
    assert str(err.value) == (
        f"resume={run}: a run dir, not a checkpoint: give one of its checkpoints (it has none), "
        f"or continue that run in place with run_dir={run} (resume=auto)"
    )


def test_a_per_node_refusal_leaves_records_the_fixed_start_replaces(tmp_path: Path) -> None:
    """Node 0 of a per-node job refused before layout writes exit.json and launch.json (the
    other nodes' word of it): both memtune's, so the fixed start is not refused over them (a
    review found 'holds launch.json'); a user's launch.json still is."""
    from memtune.rundir import RunDir

    rd = RunDir(tmp_path)
    rd.write_exit(2, "config error: data.path ...")
    rd.nodes_ready.write_text(json.dumps({"launch_id": "7", "nnodes": 2, "error": "data.path"}))
    assert rd.refused_here() and rd.run_names_taken() == []
    assert rd.refusal_records() == [rd.exit, rd.nodes_ready]
    rd.nodes_ready.write_text(json.dumps({"nodes": ["a", "b"]}))  # not memtune's record
    assert rd.run_names_taken() == [rd.nodes_ready]
    rd.exit.write_text('{"mine": true}')
    assert not rd.refused_here() and rd.run_names_taken() == [rd.exit, rd.nodes_ready]
    for mine in ('{"code": 0}', '{"code": 2}', '{"code": 0, "error": "x"}'):
        rd.exit.write_text(mine)  # only memtune's refusal (a code and why) is replaced
        assert not rd.refused_here(), mine


def test_resume_json_keeps_the_earlier_starts_changes(tmp_path: Path) -> None:
    """Resumed on 1 rank, then on 2 again: each start rewrote resume.json, so the change of
    world size was gone from the run dir. The earlier changes are kept, oldest first, a restart
    of the same resume (before a new checkpoint) once."""
    from memtune.rundir import RunDir

    rd = RunDir(tmp_path)
    first, second = tmp_path / "step-0000011", tmp_path / "step-0000017"
    rd.write_resume(None)
    rd.write_resume(first, {"launcher.num_ranks": [2, 1], "zero.stage": [3, 2]})
    rd.write_resume(first, {"launcher.num_ranks": [2, 1], "zero.stage": [3, 2]})  # restarted
    rd.write_resume(second, {"launcher.num_ranks": [1, 2], "zero.stage": [2, 3]})
    record = rd.read_resume()
    assert record.checkpoint == str(second)
    assert record.changed == {"launcher.num_ranks": [1, 2], "zero.stage": [2, 3]}
    assert record.earlier == [
        {"checkpoint": str(first), "changed": {"launcher.num_ranks": [2, 1], "zero.stage": [3, 2]}}
    ]
    rd.write_resume(tmp_path / "step-0000020")  # nothing changed: the history stays
    assert len(rd.read_resume().earlier) == 2
