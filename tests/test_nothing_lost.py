"""memtune's contract with what the user owns: it never deletes or writes over a directory it did
not make, and refuses such a setting before anything starts (issue: nothing lost). Real
processes, real files; no mocks."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from memtune.tools.tiny import NotOurs, is_synthesized, synthesize
from tests.conftest import compose_cfg, run_train_py


def _tree(root: Path) -> dict[str, str]:
    """Every file under ``root`` with a hash of its bytes: what must not change."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _users_model(root: Path) -> Path:
    """A directory of the user's: a model they care about, with a config.json and weights."""
    model = root / "my-model"
    (model / "sub").mkdir(parents=True)
    (model / "config.json").write_text('{"model_type": "qwen2"}\n')
    (model / "model.safetensors").write_bytes(b"\x00weights\x01" * 1000)
    (model / "sub" / "notes.txt").write_text("three weeks of work\n")
    return model


@pytest.mark.parametrize("extra", [[], ["preprocess_only=true"]])
def test_name_or_path_on_the_demo_model_group_is_refused_and_the_dir_kept(
    tmp_path: Path, extra: list[str]
) -> None:
    """The demo's tiny-qwen2 group builds a random model; pointed at a user's directory it used
    to delete that directory and write the random model there."""
    model = _users_model(tmp_path)
    before = _tree(model)
    proc = run_train_py(
        [f"model.name_or_path={model}", f"run_dir={tmp_path / 'run'}", *extra],
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"model.name_or_path='{model}'" in proc.stderr
    assert "model=local" in proc.stderr and "Traceback" not in proc.stderr
    assert _tree(model) == before
    assert not (model / "memtune_synth.json").exists()


def test_name_or_path_that_does_not_exist_is_refused_not_created(tmp_path: Path) -> None:
    missing = tmp_path / "typo-of-my-model"
    proc = run_train_py(
        [f"model.name_or_path={missing}", f"run_dir={tmp_path / 'run'}"], cwd=tmp_path, timeout=120
    )
    assert proc.returncode == 2
    assert "model=local" in proc.stderr
    assert not missing.exists()


def test_synthesize_never_replaces_a_directory_it_did_not_build(tmp_path: Path) -> None:
    model = _users_model(tmp_path)
    before = _tree(model)
    arch = dict(compose_cfg()["model"]["architecture"])
    with pytest.raises(NotOurs, match="memtune did not build it"):
        synthesize(model, arch)
    assert _tree(model) == before
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(NotOurs):  # an empty directory is still the user's
        synthesize(empty, arch)
    assert empty.is_dir() and not any(empty.iterdir())


def test_synthesize_replaces_its_own_older_build(tmp_path: Path) -> None:
    arch = dict(compose_cfg()["model"]["architecture"])
    path = synthesize(tmp_path / "tiny", arch)
    first = (path / "config.json").read_text()
    synthesize(path, {**arch, "num_hidden_layers": 1})  # another architecture: rebuilt
    assert '"num_hidden_layers": 1' in (path / "config.json").read_text() != first
    assert is_synthesized(path)
    # Nothing of the build is left beside it but the lock file.
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tiny.lock", "tiny"]


_BUILD = """
import json, sys
from memtune.tools.tiny import synthesize
path = synthesize(sys.argv[1], json.loads(sys.argv[2]))
print("built:", path.stat().st_ino, (path / "memtune_synth.json").read_text())
"""


def test_two_processes_building_one_demo_model_both_succeed(tmp_path: Path) -> None:
    """Two jobs started at once on a fresh machine both build the demo model: one builds, the
    other waits for the lock and finds the build (before, the second could rmtree the first's
    model under its ranks, or fail to rename onto it)."""
    import json

    arch = json.dumps(dict(compose_cfg()["model"]["architecture"]))
    path = tmp_path / "cache" / "tiny-qwen2"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _BUILD, str(path), arch],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    seen = [[line for line in out.splitlines() if line.startswith("built:")] for out, _ in outs]
    assert seen[0] == seen[1] and len(seen[0]) == 1  # one build (one inode), seen by both
    assert is_synthesized(path)
    assert sorted(p.name for p in path.parent.iterdir()) == [".tiny-qwen2.lock", "tiny-qwen2"]


_HOLD = """
import sys, time
from pathlib import Path
from memtune.run_lock import hold
with hold(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(600)
"""


_HOLD_AND_START_A_RANK = """
import os, signal, subprocess, sys
from pathlib import Path
from memtune.run_lock import hold, held_lock_fds
with hold(Path(sys.argv[1])):  # as launcher.spawn starts a rank: the lock's descriptor passed on
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                            pass_fds=held_lock_fds(), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    print(rank.pid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_run_dir_whose_job_was_killed_names_the_ranks_that_still_hold_it(
    tmp_path: Path,
) -> None:
    # Seen: train.py killed (kill -9) while its ranks trained; the same command again was refused
    # with "in use by another memtune job (host vm, pid 16826, ...)", a pid that no longer
    # existed, while the ranks holding the lock (16829, 16830) were named nowhere.
    import contextlib
    import os
    import signal
    import socket
    import time

    from memtune.run_lock import RunDirBusy, hold

    run_dir = tmp_path / "run"
    job = subprocess.run(
        [sys.executable, "-c", _HOLD_AND_START_A_RANK, str(run_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert job.returncode == -9, job.stderr
    rank = int(job.stdout)
    try:
        with pytest.raises(RunDirBusy) as refused, hold(run_dir):
            pass
        killed = json.loads((run_dir / "job.lock").read_text())["pid"]
        assert f"(host {socket.gethostname()}, pid {killed}, started 20" in str(refused.value)
        assert str(refused.value).endswith(
            f"; pid {killed} has ended, but the ranks it started still run and hold the lock: "
            f"pids {rank}; stop them with kill -TERM {rank}, or wait for them): wait for it to "
            "end, or give this job another run_dir"
        )
    finally:
        os.kill(rank, signal.SIGKILL)
    for _ in range(100):  # the rank gone (not this process's child: no wait), the dir is free
        with contextlib.suppress(RunDirBusy), hold(run_dir):
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the run dir stayed held after its last rank was killed")


def test_a_run_dir_held_by_a_job_refuses_a_second_one_until_it_dies(tmp_path: Path) -> None:
    """The lock is the kernel's: a second job is refused at once, naming the holder, and writes
    nothing there; once the holder is killed (-9, no clean-up) the run dir is free again."""
    import os
    import signal
    import socket

    run_dir = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        args = [f"run_dir={run_dir}", "preprocess_only=true"]
        second = run_train_py(args, cwd=tmp_path, timeout=120)
        assert second.returncode == 2, second.stderr[-2000:]
        assert f"run dir {run_dir} is in use by another memtune job" in second.stderr
        assert f"host {socket.gethostname()}, pid {holder.pid}, started 20" in second.stderr
        assert "Traceback" not in second.stderr
        assert sorted(p.name for p in run_dir.iterdir()) == ["job.lock"]  # not even .hydra/
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    again = run_train_py(args, cwd=tmp_path, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert (run_dir / "config.yaml").is_file()
    assert f'"pid": {holder.pid}' not in (run_dir / "job.lock").read_text()


def test_a_run_dir_holding_files_named_as_memtunes_own_is_refused(tmp_path: Path) -> None:
    """run_dir pointed at a directory of the user's that holds an adapter/ (say, from another
    tool): the run would replace it at its end. Refused before anything is written."""
    run_dir = tmp_path / "my-project"
    adapter = run_dir / "adapter"
    adapter.mkdir(parents=True)
    (adapter / "adapter_model.safetensors").write_bytes(b"someone else's adapter")
    before = _tree(run_dir)
    proc = run_train_py([f"run_dir={run_dir}", "preprocess_only=true"], cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"run_dir {run_dir} holds adapter, which no memtune run left there" in proc.stderr
    assert _tree(run_dir) == before  # not one of them touched, nothing added: no exit.json
    # The same with a user's exit.json, another Hydra application's .hydra/ and a job.lock
    # that is not memtune's: named, refused, left as they were.
    mine = tmp_path / "other-app-output"
    (mine / ".hydra").mkdir(parents=True)
    (mine / ".hydra" / "config.yaml").write_text("lr: 0.1\nepochs: 3\n")
    (mine / "exit.json").write_text('{"mine": true}\n')
    (mine / "job.lock").write_text("locked by my scheduler\n")
    before = _tree(mine)
    proc = run_train_py([f"run_dir={mine}", "preprocess_only=true"], cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"run_dir {mine} holds .hydra, exit.json, job.lock, which no memtune" in proc.stderr
    assert _tree(mine) == before and "Traceback" not in proc.stderr


_HOLD_DATED = """
import contextlib, datetime, sys, time
from pathlib import Path
from memtune.run_lock import hold
now = datetime.datetime.now()
with contextlib.ExitStack() as stack:
    for s in range(-2, 180):
        t = now + datetime.timedelta(seconds=s)
        name = Path("outputs") / t.strftime("%Y-%m-%d") / (t.strftime("%H-%M-%S") + "-demo-cpu")
        stack.enter_context(hold(name))
        ended = name.with_name(name.name + "-2")  # another start's, already ended
        ended.mkdir()
        (ended / "config.yaml").write_text("theirs\\n")
    print("held", flush=True)
    time.sleep(600)
"""


def test_two_starts_in_one_second_get_a_dated_dir_each(tmp_path: Path) -> None:
    """No run_dir given: Hydra names the dir by the second, so two starts of one experiment in
    the same second got the same dir and the second was refused as if the user had named it.
    Here every dated name of the next three minutes is held by another start, and each NAME-2
    holds an ended start's files: the job takes NAME-3, says so, and touches neither."""
    import os
    import signal

    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_DATED], cwd=tmp_path, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        proc = run_train_py(["preprocess_only=true", "logger=none"], cwd=tmp_path, timeout=300)
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    assert proc.returncode == 0, proc.stderr[-2000:]
    ours = [p for p in (tmp_path / "outputs").glob("*/*") if (p / "plan.json").is_file()]
    assert len(ours) == 1 and ours[0].name.endswith("-demo-cpu-3"), ours
    taken = ours[0].with_name(ours[0].name.removesuffix("-3"))
    said = f"run dir {taken} was taken by another start of demo-cpu in the same second "
    said += "(running, or one that stopped already): "
    assert said + f"this job writes to {ours[0].name}" in proc.stdout
    assert sorted(p.name for p in taken.iterdir()) == ["job.lock"]
    hydra = (ours[0] / ".hydra" / "hydra.yaml").read_text()
    assert f"output_dir: {ours[0]}\n" in hydra  # the dir this job wrote, not the one it lost
    ended = ours[0].with_name(taken.name + "-2")
    assert [p.name for p in ended.iterdir()] == ["config.yaml"]
    assert (ended / "config.yaml").read_text() == "theirs\n"


def test_a_refused_start_leaves_a_dir_the_fixed_start_uses(tmp_path: Path) -> None:
    """A start refused before it laid a run out records why in exit.json (and its lock and
    .hydra/): memtune's own, so the same command, fixed, runs in that dir."""
    run_dir = tmp_path / "my-run"
    missing = tmp_path / "nope.jsonl"
    args = [f"run_dir={run_dir}", "preprocess_only=true"]
    proc = run_train_py([*args, f"data.path={missing}"], cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and str(missing) in proc.stderr, proc.stderr[-2000:]
    assert json.loads((run_dir / "exit.json").read_text())["code"] == 2
    fixed = run_train_py(args, cwd=tmp_path, timeout=300)  # the demo's own data
    assert fixed.returncode == 0, fixed.stderr[-2000:]
    assert (run_dir / "config.yaml").is_file() and (run_dir / "base.json").is_file()
    assert not (run_dir / "exit.json").exists()  # the refusal's record, replaced by the run
