"""The machine around a job: other users' files, a full disk, temporary dirs, file modes.

Real files and real processes; where the kernel's answer depends on who runs the test (root
bypasses permission checks), the test takes the unprivileged path itself (seteuid).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from memtune.launcher.hygiene import SHM_PREFIX, clear_shm_buffers

NOBODY = 65534


@contextlib.contextmanager
def unprivileged() -> Iterator[None]:
    """File operations as an ordinary user: as root, the effective uid becomes nobody's for
    the block (the real uid, which names DeepSpeed's buffers, stays); otherwise nothing to do."""
    if os.geteuid() != 0:
        yield
        return
    os.seteuid(NOBODY)
    try:
        yield
    finally:
        os.seteuid(0)


@pytest.fixture
def public_dir() -> Iterator[Path]:
    """A directory every user can reach (pytest's tmp_path is root's 0700 when run as root,
    so an unprivileged block could not even look into it)."""
    path = Path(tempfile.mkdtemp(prefix="memtune-env-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _buffer(shm_dir: Path, uid: int, port: int = 29500, rank: int = 0) -> Path:
    path = shm_dir / f"{SHM_PREFIX}_{uid}_127.0.0.1_{port}_{rank}"
    path.write_bytes(b"\0" * 4096)
    return path


# ------------------------------------------------------------------ 10a: /dev/shm of others


def test_another_users_buffer_is_left_with_a_note(tmp_path: Path) -> None:
    """A buffer named with this user's uid but owned by another (containers sharing /dev/shm
    each name theirs with uid 0; from here the other's is owned by 65534). Before: root
    removed it (another user's file), anyone else stopped with PermissionError."""
    if os.geteuid() != 0:
        pytest.skip("needs root to give a file to another uid (the next test runs as anyone)")
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o1777)
    os.chmod(shm, 0o1777)  # /dev/shm's mode: sticky, world-writable
    foreign = _buffer(shm, os.getuid())
    os.chown(foreign, NOBODY, NOBODY)
    ours = _buffer(shm, os.getuid(), rank=1)
    notes: list[str] = []
    freed = clear_shm_buffers(shm_dir=shm, log=notes.append)
    assert foreign.exists() and not ours.exists()
    assert freed == 4096
    assert any(
        f"left 1 DeepSpeed shared-memory buffer(s) in {shm}" in n and "uid 65534" in n
        for n in notes
    ), notes


def test_a_buffer_this_user_cannot_remove_does_not_stop_the_launch(public_dir: Path) -> None:
    """unlink refused by the kernel (here: a directory without write permission, seen as an
    ordinary user) used to raise PermissionError out of clear_shm_buffers, i.e. out of every
    launch (spawn.launch calls it first)."""
    shm = public_dir / "shm"
    shm.mkdir()
    stuck = _buffer(shm, os.getuid(), port=29501)
    os.chmod(shm, 0o555)
    notes: list[str] = []
    try:
        with unprivileged():
            freed = clear_shm_buffers(29501, shm_dir=shm, log=notes.append)
    finally:
        os.chmod(shm, 0o755)
    assert freed == 0 and stuck.exists()
    assert len(notes) == 1 and f"{stuck.name}: Permission denied" in notes[0], notes


# ------------------------------------------------------------------ 10b: a full disk


def _limited_train_py(args: list[str], cwd: Path, max_file_bytes: int):
    """train.py whose every file may grow to ``max_file_bytes`` (RLIMIT_FSIZE): a write past
    it fails with EFBIG, as a full disk fails with ENOSPC. Python ignores SIGXFSZ itself, so
    the write raises instead of the signal killing the process."""
    import resource
    import signal
    import subprocess
    import sys

    from tests.conftest import ROOT

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_bytes, max_file_bytes))

    return subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        preexec_fn=limit,
    )


def test_a_job_lock_that_cannot_be_written_is_one_line(tmp_path: Path) -> None:
    """The run dir's filesystem full as the job takes its lock (ulimit -f here, EFBIG as
    ENOSPC): os.pwrite's error names no file, and it was a traceback; a write cut short left
    cut-off JSON, which the next start refused as a job.lock memtune did not write."""
    from memtune.rundir import RunDir

    run_dir = tmp_path / "run"
    for room in (0, 64):  # nothing written; the first 64 bytes of the record
        proc = _limited_train_py(["preprocess_only=true", f"run_dir={run_dir}"], tmp_path, room)
        assert proc.returncode == 2 and proc.stdout == "", proc.stderr[-3000:]
        assert proc.stderr == (
            f"memtune: error: cannot use {run_dir / 'job.lock'} (OSError: File too large)\n"
        )
        assert (run_dir / "job.lock").read_text() == "" and RunDir(run_dir).not_ours() == []


def test_a_full_disk_while_tokenizing_is_one_line(tmp_path: Path) -> None:
    """The tokenized cache (~200 kB here) cannot be written: exit 2, one line naming the
    file, the free space and data.cache_dir; nothing half-built left in the cache."""
    from tests.conftest import ROOT, run_train_py
    from tests.test_errors_before_launch import refused

    demo = (ROOT / "src" / "memtune" / "assets" / "demo_alpaca.jsonl").read_text()
    warm = run_train_py(  # the demo model is built first, without a limit
        ["preprocess_only=true", f"run_dir={tmp_path / 'warm'}"], cwd=tmp_path
    )
    assert warm.returncode == 0, warm.stderr
    data = tmp_path / "four_times.jsonl"
    data.write_text(demo * 4)
    cache, run_dir = tmp_path / "cache", tmp_path / "run"
    args = [
        "preprocess_only=true",
        f"data.path={data}",
        f"data.cache_dir={cache}",
        f"run_dir={run_dir}",
    ]
    proc = _limited_train_py(args, tmp_path, max_file_bytes=64 << 10)
    line = refused(proc, run_dir)
    # the entry, not the build's temporary dir, removed by the time the line is read
    assert re.match(rf"memtune: config error: cannot write {cache}/[0-9a-f]{{20}}: ", line), line
    assert "larger than this process may write (ulimit -f)" in line
    assert " free there); free space, or point data.cache_dir at a filesystem" in line
    # the partial build was ours: removed; the entry's (empty) build lock stays
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == []


def test_a_full_disk_while_building_the_demo_model_is_one_line(tmp_path: Path) -> None:
    """The demo model's weights (12 MB) cannot be written: a ConfigError naming the model's
    folder and MEMTUNE_CACHE_DIR, as launcher.prepare wraps the build; nothing half-built
    left. Before: safetensors' SafetensorError passed the full-disk handler, a traceback."""
    import resource

    from memtune.config import ConfigError, compose, to_run_config
    from memtune.data.cache import no_space_is_an_error
    from memtune.tools.tiny import synthesize

    architecture = to_run_config(compose([])).model.architecture
    model = tmp_path / "tiny-qwen2"
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))  # Python ignores SIGXFSZ
    try:
        with (
            pytest.raises(ConfigError) as err,
            no_space_is_an_error(tmp_path, "MEMTUNE_CACHE_DIR"),
        ):
            synthesize(model, architecture)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert str(err.value).startswith(
        f"cannot write {model}: the file is larger than this process may write (ulimit -f) ("
    )
    assert "free space, or point MEMTUNE_CACHE_DIR at a filesystem with room" in str(err.value)
    assert [p.name for p in tmp_path.iterdir()] == [".tiny-qwen2.lock"]


def test_no_space_left_names_the_path(tmp_path: Path) -> None:
    """ENOSPC itself, from the kernel's /dev/full (every write to it fails so)."""
    from memtune.config import ConfigError
    from memtune.data.cache import no_space_is_an_error

    if not Path("/dev/full").is_char_device():
        pytest.skip("no /dev/full on this machine")
    with (
        pytest.raises(ConfigError) as err,
        no_space_is_an_error(tmp_path, "run_dir"),
        open("/dev/full", "w") as full,
    ):
        full.write("x")
    assert str(err.value).startswith(f"cannot write {tmp_path}: no space left on the device (")
    assert "free space, or point run_dir at a filesystem with room" in str(err.value)


def test_a_write_on_a_read_only_filesystem_names_the_file(tmp_path: Path) -> None:
    """write_atomic on a read-only mount (root only: a tmpfs mounted ro). Before: its cleanup's
    unlink of the temporary name that was never made failed too (EROFS, not ENOENT), and that
    error replaced the first: `memtune report` on a read-only sweep dir said "cannot use
    DIR/.sweep_report.csv.tmp-HOST-PID"."""
    import subprocess

    from memtune.filesystem import write_atomic

    if os.geteuid() != 0:
        pytest.skip("mounting a read-only tmpfs needs root")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k,ro", "tmpfs", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        with pytest.raises(OSError) as err:
            write_atomic(tmp_path / "plan.txt", "x")
    finally:
        subprocess.run(["umount", str(tmp_path)], check=True)
    assert (err.value.errno, err.value.filename) == (errno.EROFS, str(tmp_path / "plan.txt"))


def test_checkpoints_that_cannot_fit_are_refused_before_launch(tmp_path: Path) -> None:
    """What a run's checkpoints take is known from the parameter counts: a run whose
    checkpoints cannot fit where it writes them is refused, naming run_dir, the need and the
    free space (the ranks would fail at their first save, after hours)."""
    from memtune.config import ConfigError, compose, to_run_config
    from memtune.filesystem import free_bytes
    from memtune.launcher.room import check_run_dir_room, checkpoint_bytes, run_dir_bytes
    from memtune.memory.counts import count_params
    from memtune.rundir import RunDir

    demo = to_run_config(compose(["trainer.precision=fp32"]))
    counts = count_params(demo)
    assert counts.lora == 217_088
    # fp32 master + 2 Adam moments, their gathered copy, the fp32 adapter: 28 bytes a
    # parameter; the demo's real step-12 checkpoint is 6,257,501 bytes
    assert checkpoint_bytes(demo, "adamw", counts) == 28 * 217_088
    # 24 steps saved every 8: 3 saves, keep_last 2 + the one being written = 3, + the adapter
    assert run_dir_bytes(demo, "adamw", counts) == 3 * 28 * 217_088 + 4 * 217_088
    check_run_dir_room(demo, "adamw", counts, RunDir(tmp_path / "run"))  # fits anywhere

    huge = to_run_config(
        compose(
            [
                "experiment=qwen2.5-7b-4x4090-lora",
                "trainer.max_steps=1000000",
                "trainer.save_every=1",
                "trainer.keep_last=1000000",
            ]
        )
    )
    big = count_params(huge)
    free = free_bytes(tmp_path)
    assert free is not None and run_dir_bytes(huge, "adamw", big) > free  # ~250 TB
    with pytest.raises(ConfigError) as err:
        check_run_dir_room(huge, "adamw", big, RunDir(tmp_path / "run"))
    message = str(err.value)
    assert message.startswith(f"run_dir {tmp_path / 'run'}: the run needs at least ")
    assert "trainer.keep_last=1000000 kept" in message and " free there; " in message


# ------------------------------------------------------------------ 10c: wandb's temporary dirs

WANDB_RANK = """
import os, sys
from pathlib import Path
from memtune.config import LoggerConfig
from memtune.rank.telemetry import RunLogger
from memtune.rundir import RunDir
run_dir = RunDir(Path(sys.argv[1]))
logger = RunLogger(run_dir, 1, LoggerConfig(backend="wandb", mode="offline"), {"peft": {"r": 4}})
logger.log(1, {"train/loss": 1.0})
logger.close()
sys.stdout.flush()
os._exit(0)  # as a rank ends (rank.worker.leave): no atexit hooks
"""


def test_wandb_leaves_nothing_in_tmpdir(tmp_path: Path) -> None:
    """A rank-0 logger with offline wandb, ended the way a rank ends. Before: two dirs per run
    in $TMPDIR (tmp*wandb-media, tmp*wandb-artifacts), left because os._exit skips the atexit
    hooks that remove them."""
    import subprocess
    import sys
    import time

    tmpdir, run_dir = tmp_path / "tmp", tmp_path / "run"
    tmpdir.mkdir()
    run_dir.mkdir()
    env = {**os.environ, "TMPDIR": str(tmpdir), "WANDB_SILENT": "true"}
    proc = subprocess.run(
        [sys.executable, "-c", WANDB_RANK, str(run_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))  # the run is recorded
    left = sorted(p.name for p in tmpdir.iterdir())
    for _ in range(50):  # wandb's service removes its own socket dir as it exits
        if not left:
            break
        time.sleep(0.1)
        left = sorted(p.name for p in tmpdir.iterdir())
    assert left == []


# ------------------------------------------------------------------ 10d: modes follow the umask


def test_the_data_cache_follows_the_umask(tmp_path: Path) -> None:
    """umask 002 (a group sharing the cache): 0775 dirs, 0664 files. Before: the cache dir
    was tempfile.mkdtemp's 0700 and train.safetensors safetensors' 0600."""
    import stat
    import subprocess
    import sys

    from tests.conftest import ROOT

    cache = tmp_path / "cache"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "train.py"),
            "preprocess_only=true",
            f"data.cache_dir={cache}",
            f"run_dir={tmp_path / 'run'}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        preexec_fn=lambda: os.umask(0o002),
    )
    assert proc.returncode == 0, proc.stderr
    lock, built = sorted(cache.iterdir())  # the entry's build lock, and the entry
    assert lock.name == f".{built.name}.lock" and stat.S_IMODE(lock.stat().st_mode) == 0o664
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in [built, *built.iterdir()]}
    assert modes == {
        built.name: 0o775,
        "train.safetensors": 0o664,
        "stats.json": 0o664,
        "manifest.json": 0o664,
    }


def test_the_reference_tables_follow_the_umask(tmp_path: Path) -> None:
    """DPO's reference tables (RUN_DIR/reference/) under umask 002: 0664, not safetensors'
    0600 (a fresh-clone walk-through found them private)."""
    import stat

    import torch

    from memtune.rank.reference import _write

    old = os.umask(0o002)
    try:
        _write(tmp_path / "reference", "key", {"train": torch.zeros(4)})
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "reference").iterdir()}
    assert set(modes.values()) == {0o664}, modes


# ------------------------------------------------------------------ 10d: a team's one cache

TEAM, ALICE, BOB = 61000, 61001, 61002  # a group and two members (no passwd entry needed)


@contextlib.contextmanager
def member(uid: int, umask: int = 0o022) -> Iterator[None]:
    """File operations as ``uid`` of the group TEAM, under ``umask`` (022: the usual one):
    effective ids only, as :func:`unprivileged` (root's real uid stays, to come back)."""
    groups = os.getgroups()
    os.setgroups([TEAM])
    os.setegid(TEAM)
    os.seteuid(uid)
    old = os.umask(umask)
    try:
        yield
    finally:
        os.umask(old)
        os.seteuid(0)
        os.setegid(0)
        os.setgroups(groups)


def _owner(uid: int) -> str:
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


@pytest.fixture(scope="module")
def demo_tokenizer():
    from memtune.config import to_run_config
    from memtune.data.encode import load_tokenizer
    from memtune.tools.tiny import synthesize
    from tests.conftest import compose_cfg

    cfg = to_run_config(compose_cfg())
    synthesize(cfg.model.name_or_path, cfg.model.architecture)
    return load_tokenizer(cfg)


def _team_folder(public_dir: Path, mode: int) -> tuple[Path, Path]:
    """The team's folder (root's, group TEAM, ``mode``) and a data file in it."""
    import json

    team = public_dir / "team"
    team.mkdir()
    os.chown(team, 0, TEAM)
    team.chmod(mode)
    data = team / "d.jsonl"
    rows = [{"instruction": f"q{i}", "output": "a b c"} for i in range(20)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data.chmod(0o644)
    return team, data


@pytest.mark.skipif(os.geteuid() != 0, reason="two users need root to be played (seteuid)")
def test_a_team_shares_one_data_cache_under_umask_022(public_dir: Path, demo_tokenizer) -> None:
    """Two members of a group, each under the usual umask 022, one data cache in the group's
    folder (setgid, group-writable: ``chmod 2775``). Before: the first member to tokenize made
    the cache's folders 0755 and its lock 0644, and the second could not tokenize anything
    new there ("cannot write CACHE/.building-…: Permission denied") nor set a damaged entry
    of the first's aside. Now what memtune makes in such a folder is group-writable."""
    import dataclasses
    import stat

    from memtune.config import DataConfig
    from memtune.data.cache import preprocess

    team, data = _team_folder(public_dir, 0o2775)
    cfg = DataConfig(path=str(data), cache_dir=str(team / "cache" / "data"))
    with member(ALICE):
        first = preprocess(cfg, demo_tokenizer, seed=0)
    made = [team / "cache", team / "cache" / "data", first.dir]
    lock = first.dir.parent / f".{first.dir.name}.lock"
    modes = {p: stat.S_IMODE(p.stat().st_mode) for p in [*made, lock, *first.dir.iterdir()]}
    assert modes == {
        **dict.fromkeys(made, 0o2775),
        lock: 0o664,
        **{f: 0o664 for f in first.dir.iterdir()},
    }
    assert {p.stat().st_gid for p in modes} == {TEAM}
    with member(BOB):
        assert preprocess(cfg, demo_tokenizer, seed=0).reused  # alice's entry, read
        other = preprocess(dataclasses.replace(cfg, max_seq_len=64), demo_tokenizer, seed=0)
    assert not other.reused and other.dir.stat().st_uid == BOB
    (first.dir / "train.safetensors").write_bytes(b"junk")  # alice's entry, damaged
    with member(BOB):
        again = preprocess(cfg, demo_tokenizer, seed=0)
    assert not again.reused and again.set_aside is not None
    assert again.dir.stat().st_uid == BOB
    with member(ALICE):
        assert preprocess(cfg, demo_tokenizer, seed=0).reused  # bob's rebuild, read


@pytest.mark.skipif(os.geteuid() != 0, reason="two users need root to be played (seteuid)")
def test_what_another_member_may_not_change_is_named(public_dir: Path, demo_tokenizer) -> None:
    """Where the group may not change what a member made, the refusal names whose it is:
    alice's cache folder in a folder not shared (0755, the team folder without setgid), and
    alice's damaged entry in a folder with the sticky bit (3775: only an entry's owner may
    move it). Before, the sticky bit's refusal also left an empty ``.damaged-KEY.XXXX``."""
    import dataclasses

    from memtune.config import ConfigError, DataConfig
    from memtune.data.cache import preprocess

    team, data = _team_folder(public_dir, 0o1777)  # every user may write: no group rule
    cfg = DataConfig(path=str(data), cache_dir=str(team / "cache"))
    with member(ALICE):
        preprocess(cfg, demo_tokenizer, seed=0)
    with member(BOB), pytest.raises(ConfigError) as err:
        preprocess(dataclasses.replace(cfg, max_seq_len=64), demo_tokenizer, seed=0)
    assert str(err.value) == (
        f"data.cache_dir: cannot write in {team / 'cache'} (permission denied: "
        f"{_owner(ALICE)}'s, drwxr-xr-x); point it at a folder memtune can write"
    )

    shutil.rmtree(team)
    team, data = _team_folder(public_dir, 0o3775)
    cfg = DataConfig(path=str(data), cache_dir=str(team))
    with member(ALICE):
        first = preprocess(cfg, demo_tokenizer, seed=0)
    written = (first.dir / "train.safetensors").stat().st_size
    (first.dir / "train.safetensors").write_bytes(b"junk")
    with member(BOB), pytest.raises(ConfigError) as err:
        preprocess(cfg, demo_tokenizer, seed=0)
    assert str(err.value) == (
        f"data cache {first.dir} is damaged ({first.dir / 'train.safetensors'} has 4 bytes, "
        f"{written:,} were written) and cannot be set aside (Operation not permitted; "
        f"it is {_owner(ALICE)}'s, drwxrwsr-x): point data.cache_dir at a folder memtune can "
        "write"
    )
    assert not [p for p in team.iterdir() if p.name.startswith(".damaged-")]


@pytest.mark.skipif(os.geteuid() != 0, reason="two users need root to be played (seteuid)")
def test_the_group_rule_reaches_every_store_writer(public_dir: Path) -> None:
    """The writers of the counts cache and the demo model (make_dirs, write_atomic, the build
    lock) under umask 022: group-writable in the group's folder, the umask's modes elsewhere."""
    import stat

    from memtune.filesystem import make_dirs, sibling_lock, write_atomic

    team, _ = _team_folder(public_dir, 0o2775)
    plain = public_dir / "plain"
    plain.mkdir()
    plain.chmod(0o1777)
    with member(ALICE):
        for top in (team, plain):
            make_dirs(top / "a" / "b")
            write_atomic(top / "a" / "b" / "value.json", "{}")
            with sibling_lock(top / "a" / "b" / "model"):
                pass

    def modes(top: Path) -> list[int]:
        paths = [top / "a", top / "a" / "b", top / "a" / "b" / "value.json"]
        return [stat.S_IMODE(p.stat().st_mode) for p in [*paths, top / "a" / "b" / ".model.lock"]]

    assert modes(team) == [0o2775, 0o2775, 0o664, 0o664]
    assert modes(plain) == [0o755, 0o755, 0o644, 0o644]


# ------------------------------------------------------------------ 10e: remote code, pinned


def test_remote_code_without_a_pinned_revision_warns() -> None:
    from memtune.config import compose, to_run_config
    from memtune.config.startup_words import config_warnings

    def warnings_for(*overrides: str) -> list[str]:
        return config_warnings(to_run_config(compose(["model=qwen2.5-7b", *overrides])))

    assert warnings_for() == []
    (unpinned,) = warnings_for("model.trust_remote_code=true")
    assert "model.trust_remote_code=true runs the Python code of the hub repo" in unpinned
    assert "model.revision is not set" in unpinned
    assert "model.revision=<40-hex commit hash>" in unpinned
    (branch,) = warnings_for("model.trust_remote_code=true", "model.revision=main")
    assert "model.revision is 'main', which can move" in branch
    commit = "a" * 40
    assert warnings_for("model.trust_remote_code=true", f"model.revision={commit}") == []
    # the code of a checkpoint on disk is the user's own: nothing to pin
    demo = to_run_config(compose(["model.trust_remote_code=true"]))
    assert config_warnings(demo) == []


def test_the_revision_is_the_one_looked_for(tmp_path: Path, monkeypatch) -> None:
    """model.revision reaches the Hugging Face cache lookups: a snapshot of another revision
    is not the model asked for (offline: refused), the pinned one is found."""
    import huggingface_hub.constants

    from memtune.config import ConfigError
    from memtune.data.cache import tokenizer_files_digest
    from memtune.data.encode import check_downloadable

    pinned, main = "1" * 40, "2" * 40
    repo = tmp_path / "hub" / "models--org--model"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(main)
    (repo / "snapshots" / pinned).mkdir(parents=True)
    (repo / "snapshots" / pinned / "config.json").write_text('{"model_type": "qwen2"}')
    (repo / "snapshots" / pinned / "tokenizer.json").write_text("{}")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    check_downloadable("org/model", pinned)
    with pytest.raises(ConfigError, match=r"'org/model' is not on disk .* HF_HUB_OFFLINE is set"):
        check_downloadable("org/model")  # main's snapshot is not there
    assert tokenizer_files_digest("org/model", pinned) is not None
    assert tokenizer_files_digest("org/model", main) is None
