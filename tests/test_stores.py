"""Every store memtune reads back is verified (memtune.integrity): the tokenized data cache, the
counts caches, the DPO reference tables and the synthesized demo models. Each is damaged here
for real (a cut file, a flipped byte, a missing file, a manifest from another version) and read
again: the damaged entry is set aside under memtune's name with one line, and what is rebuilt
is byte for byte a clean build. The checkpoints' own tests are in test_checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from memtune.config import ConfigError, DataConfig, to_run_config
from memtune.data.cache import DATA_CACHE, load_split, preprocess
from memtune.data.encode import load_tokenizer
from memtune.integrity import MANIFEST, Store
from memtune.memory.counts import COUNTS_CACHE, count_params
from memtune.rank import reference
from memtune.tools.tiny import _MARKER, DEMO_MODEL, is_synthesized, synthesize
from tests.conftest import FAST, ROOT, compose_cfg
from tests.test_environment import public_dir, unprivileged  # noqa: F401 - a fixture


def _files(root: Path) -> dict[str, bytes]:
    return {
        str(f.relative_to(root)): f.read_bytes() for f in sorted(root.rglob("*")) if f.is_file()
    }


def _cut(f: Path) -> None:
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _flip(f: Path, at: int | None = None) -> None:
    data = bytearray(f.read_bytes())
    i = len(data) // 2 if at is None else at
    data[i] ^= 0x01
    f.write_bytes(bytes(data))


def _other_version(entry: Path) -> None:
    record = json.loads((entry / MANIFEST).read_text())
    (entry / MANIFEST).write_text(json.dumps({**record, "format": record["format"] - 1}))


def _lists_nothing(entry: Path) -> None:
    record = json.loads((entry / MANIFEST).read_text())
    (entry / MANIFEST).write_text(json.dumps({**record, "files": {}}))


DAMAGE: dict[str, Callable[[Path, str], None]] = {
    "cut": lambda entry, name: _cut(entry / name),
    "flipped byte": lambda entry, name: _flip(entry / name),
    "missing file": lambda entry, name: (entry / name).unlink(),
    "manifest of another version": lambda entry, name: _other_version(entry),
    "no manifest": lambda entry, name: (entry / MANIFEST).unlink(),
    "manifest listing no files": lambda entry, name: _lists_nothing(entry),
}
SAID = {
    "cut": "were written",
    "flipped byte": "its XXH3-128 differs",
    "missing file": "is missing",
    "manifest of another version": "format",
    "no manifest": "writing was cut short",
    "manifest listing no files": "does not list",
}


# ------------------------------------------------------------------ the mechanism


def test_a_store_names_what_is_wrong(tmp_path: Path) -> None:
    store = Store("test store", 3, required=("a.bin",))
    entry = tmp_path / "entry"
    (entry / "sub").mkdir(parents=True)
    (entry / "a.bin").write_bytes(bytes(range(256)) * 40)
    (entry / "sub" / "b.json").write_text('{"x": 1}')
    store.seal(entry)
    assert store.problem(entry) is None and store.is_ours(entry)
    record = json.loads((entry / MANIFEST).read_text())
    assert record["store"] == "test store" and record["format"] == 3
    assert record["digest"] == "xxh3_128" and record["files"]["a.bin"][0] == 10240
    assert not Store("other store", 3).is_ours(entry)
    assert "other store format 3" in str(Store("other store", 3).problem(entry))
    for kind, damage in DAMAGE.items():
        copy = tmp_path / kind.replace(" ", "-")
        shutil.copytree(entry, copy)
        damage(copy, "a.bin")
        problem = store.problem(copy)
        assert problem is not None and SAID[kind] in problem, (kind, problem)
    assert store.problem(entry, required=("c.bin",)) == (
        f"its {MANIFEST} does not list c.bin, which the entry must hold"
    )
    (entry / MANIFEST).write_text("{not json")
    assert store.problem(entry) == f"{entry / MANIFEST} cannot be read"


def test_a_one_file_entry_knows_a_changed_digit(tmp_path: Path) -> None:
    store = Store("test store", 2)
    path = tmp_path / "value.json"
    value = {"linear": 123456, "shapes": [["q_proj", 64, 64]], "share": 0.0625}
    store.write_value(path, value)
    assert store.read_value(path) == (value, None)
    assert store.read_value(tmp_path / "absent.json") == (None, None)
    path.write_text(path.read_text().replace("123456", "123457"))  # still valid JSON
    assert store.read_value(path) == (
        None,
        "its value does not hold what was written (its digest differs)",
    )
    path.write_text(path.read_text()[:-9])
    assert store.read_value(path) == (None, "it cannot be read")
    store.write_value(path, value)
    assert "format 1" in str(Store("test store", 1).read_value(path)[1])


def _aside(parent: Path, name: str) -> Path:
    """The one entry set aside from ``name`` in ``parent`` (``.damaged-NAME.XXXX``)."""
    (found,) = parent.glob(f".damaged-{name}.*")
    return found


def test_set_aside_deletes_and_replaces_nothing(tmp_path: Path) -> None:
    """Each damaged entry (a directory or a file) goes to a fresh name of its own: an earlier
    aside, and a name the user chose that looks like one, stay as they were."""
    store = Store("test store", 1)
    (tmp_path / ".damaged-key").write_text("the user's")
    asides = []
    for text in ("first", "second"):
        entry = tmp_path / "key"
        entry.mkdir()
        (entry / "f").write_text(text)
        asides.append(store.set_aside(entry))
        assert asides[-1].name.startswith(".damaged-key.") and not entry.exists()
    assert [(a / "f").read_text() for a in asides] == ["first", "second"]
    one = tmp_path / "value.json"
    one.write_text("{}")
    aside = store.set_aside(one)
    assert aside.name.startswith(".damaged-value.json.") and aside.read_text() == "{}"
    assert (tmp_path / ".damaged-key").read_text() == "the user's"
    assert len(list(tmp_path.iterdir())) == 4
    # Moved by another job that found the same damage: the line named the fresh name made for
    # it, removed again (two plans at once on a damaged counts entry both said "set aside as").
    gone = store.set_aside(tmp_path / "absent")
    assert gone is None and len(list(tmp_path.iterdir())) == 4
    assert store.damaged_line(tmp_path / "absent", "cut", gone, "counted again") == (
        f"memtune: test store {tmp_path / 'absent'} was damaged (cut): another job set it "
        "aside meanwhile; counted again"
    )


# ------------------------------------------------------------------ the tokenized data cache


@pytest.fixture(scope="module")
def tokenizer():
    cfg = to_run_config(compose_cfg())
    synthesize(cfg.model.name_or_path, cfg.model.architecture)
    return load_tokenizer(cfg)


def _data(root: Path) -> DataConfig:
    path = root / "d.jsonl"
    rows = [{"instruction": f"q{i}", "input": "", "output": f"a{i} " * (i + 1)} for i in range(12)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return DataConfig(path=str(path), cache_dir=str(root / "cache"), val_fraction=0.25)


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_a_damaged_data_cache_is_set_aside_and_tokenized_again(
    tokenizer, tmp_path: Path, kind: str
) -> None:
    cfg = _data(tmp_path)
    first = preprocess(cfg, tokenizer, seed=0)
    clean = _files(first.dir)
    assert preprocess(cfg, tokenizer, seed=0).reused  # sound: reused, no line
    DAMAGE[kind](first.dir, "train.safetensors")
    again = preprocess(cfg, tokenizer, seed=0)
    aside = _aside(first.dir.parent, first.dir.name)
    assert not again.reused and again.dir == first.dir
    assert again.set_aside is not None and SAID[kind] in again.set_aside
    assert again.set_aside.startswith(f"memtune: data cache {first.dir} was damaged (")
    assert again.set_aside.endswith(f"set aside as {aside}; tokenizing again")
    assert _files(again.dir) == clean  # the rebuilt entry is a clean build, byte for byte
    assert aside.is_dir() and _files(aside) != clean
    assert again.train == first.train and again.val == first.val
    assert len(load_split(again.dir)) == first.train.samples
    assert preprocess(cfg, tokenizer, seed=0).reused


def test_a_data_cache_entry_that_is_a_broken_symlink_is_set_aside(
    tokenizer, tmp_path: Path
) -> None:
    """An entry's name a symlink that leads nowhere (its target purged) or round a loop.
    Before: tokenized, then the rename onto the link failed: exit 2 naming the build's
    temporary dir, gone by then ("cannot use CACHE/.building-XXXX (NotADirectoryError)")."""
    cfg = _data(tmp_path)
    first = preprocess(cfg, tokenizer, seed=0)
    clean = _files(first.dir)
    shutil.rmtree(first.dir)
    for target in (tmp_path / "purged", first.dir):  # dangling; a loop
        first.dir.symlink_to(target)
        again = preprocess(cfg, tokenizer, seed=0)
        aside = _aside(first.dir.parent, first.dir.name)
        assert again.set_aside == DATA_CACHE.damaged_line(
            first.dir, "a symlink that leads nowhere", aside, "tokenizing again"
        )
        assert aside.is_symlink() and os.readlink(aside) == str(target)  # moved, not removed
        assert _files(again.dir) == clean and again.train == first.train
        aside.unlink()
        shutil.rmtree(first.dir)


KILLED_WRITER = (
    "import os, signal, sys; from pathlib import Path; "
    "from memtune.filesystem import owned_temp_dir; "
    "d = owned_temp_dir(Path(sys.argv[1]), sys.argv[2]); "
    "(d / sys.argv[3]).write_bytes(bytes(3 << 20)); print(d, flush=True); "
    "os.kill(os.getpid(), signal.SIGKILL)"
)


def left_by_killed_writer(parent: Path, prefix: str, name: str) -> Path:
    """The temporary directory a real writer made in ``parent`` the way memtune's writers make
    theirs, with a 3 MiB ``name`` in it, when it was killed (kill -9: no cleanup ran)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    args = [sys.executable, "-c", KILLED_WRITER, str(parent), prefix, name]
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == -9, proc.stderr
    left = Path(proc.stdout.strip())
    assert left.parent == parent and (left / name).is_file()
    return left


_WRITER_WITH_A_CHILD = """
import os, signal, sys, time
from pathlib import Path
from memtune.filesystem import owned_temp_dir
d = owned_temp_dir(Path(sys.argv[1]), ".building-")
child = os.fork()
if child == 0:  # keeps the lock (the open directory) after its parent, the named pid, died
    os.setsid()
    for fd in (0, 1, 2):
        os.close(fd)
    time.sleep(600)
print(d, child, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_build_whose_named_pid_ended_but_whose_lock_lives_is_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A pid from another PID namespace (a container beside this one, sharing the cache and
    its host name) names no process here although its writer lives: the kernel's lock on the
    directory says so. Played by a writer killed after forking a child that keeps the lock."""
    import signal
    import time

    from memtune.filesystem import remove_left_by_dead

    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    writer = subprocess.run(
        [sys.executable, "-c", _WRITER_WITH_A_CHILD, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert writer.returncode == -9, writer.stderr
    made, child = writer.stdout.split()
    live, holder = Path(made), int(child)
    try:
        assert remove_left_by_dead(tmp_path, ".building-", "a build") == []
        assert live.is_dir() and capsys.readouterr().out == ""
    finally:
        os.kill(holder, signal.SIGKILL)
    for _ in range(100):  # the child gone (not this process's: no wait), nothing holds it
        if remove_left_by_dead(tmp_path, ".building-", "a build", log=lambda _: None):
            break
        time.sleep(0.05)
    assert not live.exists()


def test_a_data_cache_build_a_killed_process_left_is_removed(
    tokenizer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Seen: every kill -9 of train.py while it wrote the cache left a .building-XXXX holding the
    # data set, which no later start removed (one per kill, behind a dot).
    cfg = _data(tmp_path)
    root = Path(str(cfg.cache_dir))
    root.mkdir()
    left = left_by_killed_writer(root, ".building-", "train.safetensors")
    capsys.readouterr()
    built = preprocess(cfg, tokenizer, seed=0)
    assert not left.exists()
    assert (
        f"memtune: removed {left} (3.0 MiB): a data cache build that process "
        f"{left.name.split('-')[-2]} left unfinished when it was killed\n"
    ) in capsys.readouterr().out
    assert sorted(p.name for p in root.iterdir()) == [f".{built.dir.name}.lock", built.dir.name]


KILLED_AT_FSYNC = (
    "import os, signal, sys; from pathlib import Path; from memtune import filesystem; "
    "os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL); "
    "filesystem.write_atomic(Path(sys.argv[1]), bytes(int(sys.argv[2])))"
)


def killed_while_writing(path: Path, size: int) -> Path:
    """What a real process left when it was killed (kill -9) inside write_atomic(``path``),
    its ``size`` bytes written, not yet renamed into place."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    args = [sys.executable, "-c", KILLED_AT_FSYNC, str(path), str(size)]
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == -9, proc.stderr
    (left,) = path.parent.glob(f".{path.name}.tmp-*")
    assert left.stat().st_size == size and not path.exists()
    return left


def test_a_write_a_killed_process_left_is_removed_by_the_next_write(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Seen: every kill -9 inside write_atomic (a run dir's records, the counts cache, a
    sweep's reports) left its .NAME.tmp-<host>-<pid>, one per kill, which nothing removed.
    The next write of the same file removes the ones this host's dead writers left, and
    nothing else: a live writer's (its pid, or its lock: a writer in another PID namespace),
    another host's, another file's, a name memtune does not make."""
    import fcntl
    import socket

    from memtune.filesystem import write_atomic

    record = tmp_path / "record.json"
    left = killed_while_writing(record, 3 << 10)
    dead = int(left.name.rsplit("-", 1)[1])
    host = socket.gethostname()
    unused = next(n for n in range(dead + 1, dead + 10_000) if not os.path.exists(f"/proc/{n}"))
    kept = [
        f".record.json.tmp-{host}-{os.getppid()}",  # a live pid's
        f".record.json.tmp-another-{host}-{dead}",  # another host's
        f".record.json.tmp-{host}-{dead}.bak",  # not a name memtune makes
        f".other.json.tmp-{host}-{dead}",  # another file's, removed at its own next write
        f".record.json.tmp-{host}-{unused}",  # locked: a live writer in another namespace
    ]
    for name in kept:
        (tmp_path / name).write_text("theirs")
    with open(tmp_path / kept[-1]) as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        write_atomic(record, "{}\n")
    assert capsys.readouterr().out == (
        f"memtune: removed {left} (3.0 KiB): a write of record.json that process {dead} "
        "left unfinished when it was killed\n"
    )
    assert record.read_text() == "{}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*kept, "record.json"])
    assert all((tmp_path / name).read_text() == "theirs" for name in kept)


def test_a_data_cache_manifest_must_list_the_files_an_entry_holds(
    tokenizer, tmp_path: Path
) -> None:
    """Before: a manifest listing no files (or not val.safetensors) verified, and the launch
    failed on the file it then read (KeyError: 'val')."""
    cfg = _data(tmp_path)
    first = preprocess(cfg, tokenizer, seed=0)
    record = json.loads((first.dir / MANIFEST).read_text())
    del record["files"]["val.safetensors"]
    (first.dir / MANIFEST).write_text(json.dumps(record))
    again = preprocess(cfg, tokenizer, seed=0)
    assert again.set_aside is not None and not again.reused
    assert f"(its {MANIFEST} does not list val.safetensors, which the entry must hold)" in (
        again.set_aside
    )
    stats = json.loads((again.dir / "stats.json").read_text())
    (again.dir / "stats.json").write_text(json.dumps({"train": stats["train"]}))
    DATA_CACHE.seal(again.dir)  # listed and verified, but not the counts a build writes
    third = preprocess(cfg, tokenizer, seed=0)
    assert third.set_aside is not None and not third.reused
    assert f"({again.dir / 'stats.json'} does not hold the counts of a split)" in third.set_aside
    assert third.train == first.train and third.val == first.val


def test_a_damaged_data_cache_that_cannot_be_set_aside(tokenizer, public_dir: Path) -> None:  # noqa: F811
    """A read-only cache: rebuilding is impossible, so one line (exit 2 before launch)."""
    cfg = _data(public_dir)
    first = preprocess(cfg, tokenizer, seed=0)
    _flip(first.dir / "stats.json", at=3)
    cache = Path(cfg.cache_dir)
    for f in [public_dir, *public_dir.rglob("*")]:
        f.chmod(0o555 if f.is_dir() else 0o444)
    try:
        with unprivileged(), pytest.raises(ConfigError) as err:
            preprocess(cfg, tokenizer, seed=0)
    finally:
        for f in [public_dir, *public_dir.rglob("*")]:
            f.chmod(0o755 if f.is_dir() else 0o644)
    assert str(err.value).startswith(f"data cache {first.dir} is damaged (")
    import pwd

    owner = pwd.getpwuid(cache.stat().st_uid).pw_name  # root's, or the user running the tests
    assert (
        f"cannot be set aside (Permission denied; {cache} is {owner}'s, dr-xr-xr-x): point "
        "data.cache_dir" in str(err.value)
    )
    assert sorted(p.name for p in cache.iterdir()) == [f".{first.dir.name}.lock", first.dir.name]


_SECOND_JOB = """
import sys
from memtune.config import DataConfig
from memtune.data.cache import TokenizerFiles, preprocess

def load():
    raise SystemExit("the tokenizer was loaded: this job tokenized the data again")

cfg = DataConfig(path=sys.argv[1], cache_dir=sys.argv[2], val_fraction=0.25)
got = preprocess(cfg, TokenizerFiles("files:two-jobs", load), seed=0)
print(f"reused={got.reused} {got.dir}", flush=True)
"""


def test_two_jobs_tokenizing_the_same_data_at_once_build_it_once(tokenizer, tmp_path: Path) -> None:
    """Two jobs on the same data started together (two experiments, a `make plan` beside a
    job): both tokenized it, each with all of it in memory and a whole copy written beside
    the cache (twice the disk one build needs), and the second's rename failed onto the
    first's entry. Now the second, a real process started while this test builds under the
    entry's lock, waits with one line and reuses the entry without loading a tokenizer."""
    import fcntl

    from memtune.data.cache import TokenizerFiles, _prepare, fingerprint, one_build

    cfg = _data(tmp_path)
    assert cfg.cache_dir is not None
    files = TokenizerFiles("files:two-jobs", lambda: tokenizer)
    root = Path(cfg.cache_dir)
    out = root / fingerprint(cfg, files, 0)
    with one_build(root, out):  # this test is the job that builds
        job = subprocess.Popen(
            [sys.executable, "-c", _SECOND_JOB, cfg.path, cfg.cache_dir],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert job.stdout is not None
        assert job.stdout.readline() == (
            f"memtune: another job is tokenizing the same data into {out}: waiting for it, to "
            "reuse what it builds\n"
        )
        built = _prepare(cfg, files, 0, None, root, out)
    said, err = job.communicate(timeout=60)
    assert job.returncode == 0, err
    assert said == f"reused=True {out}\n" and not built.reused
    assert sorted(p.name for p in root.iterdir()) == [f".{out.name}.lock", out.name]
    lock = os.open(root / f".{out.name}.lock", os.O_RDONLY)
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released by both
    os.close(lock)


# ------------------------------------------------------------------ the counts caches


def test_a_damaged_counts_entry_is_counted_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("MEMTUNE_CACHE_DIR", str(tmp_path))
    cfg = to_run_config(compose_cfg())
    clean = count_params(cfg)
    (entry,) = (tmp_path / "counts").iterdir()
    record = json.loads(entry.read_text())
    assert record["store"] == COUNTS_CACHE.name and record["value"]["linear"] == clean.linear
    # One digit of a count changed: the JSON still parses, the digest does not match.
    digits = str(clean.linear)
    entry.write_text(entry.read_text().replace(f'"linear": {digits}', f'"linear": {digits}1'))
    capsys.readouterr()
    assert count_params(cfg) == clean
    line = capsys.readouterr().out.strip()
    aside = _aside(tmp_path / "counts", entry.name)
    assert line == (
        f"memtune: counts cache {entry} was damaged (its value does not hold what was written "
        f"(its digest differs)): set aside as {aside}; parameters counted again"
    )
    assert json.loads(entry.read_text()) == record and aside.is_file()
    assert count_params(cfg) == clean and capsys.readouterr().out == ""


# ------------------------------------------------------------------ the DPO reference tables


def test_damaged_reference_tables_are_set_aside_and_computed_again(tmp_path: Path) -> None:
    folder = tmp_path / "reference"
    tables = {"train": torch.arange(12, dtype=torch.float32).reshape(6, 2)}
    reference._write(folder, "key-1", tables)
    clean = _files(folder)
    assert reference._read(folder, "key-1")["train"].equal(tables["train"])
    assert reference._read(folder, "key-2") is None  # another computation's: not damage
    assert (folder / reference.TABLES).is_file()
    said: list[str] = []
    _flip(folder / reference.TABLES, at=-5)
    assert reference._read(folder, "key-1", None) is None  # a rank other than 0: only None
    assert folder.is_dir()
    assert reference._read(folder, "key-1", said.append) is None
    aside = _aside(tmp_path, "reference")
    assert len(said) == 1 and said[0].startswith(f"memtune: reference folder {folder} was ")
    assert said[0].endswith(f"set aside as {aside}; computing them again")
    assert "XXH3-128 differs" in said[0] and not folder.exists() and aside.is_dir()
    reference._write(folder, "key-1", tables)
    assert _files(folder) == clean  # byte for byte a clean write
    assert reference._read(folder, "key-1")["train"].equal(tables["train"])


def test_reference_tables_a_killed_write_left_are_removed_at_the_next(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Seen: a kill -9 while the tables were written left safetensors' own temporary file
    (.tmpXXXXXX, as large as the tables) in RUN_DIR/reference, which nothing removed and every
    later manifest listed. Now the write happens in .reference.tmp-<host>-<pid>-XXXXXXXX
    beside it: the next write removes a dead writer's (with safetensors' file in it), not a
    live writer's or another host's, and the manifest lists the tables alone."""
    import socket

    folder = tmp_path / "reference"
    ended = subprocess.Popen(["true"])  # a pid no process has now
    ended.wait()
    dead, host = ended.pid, socket.gethostname()
    left = tmp_path / f".reference.tmp-{host}-{dead}-abcd1234"
    kept = [
        f".reference.tmp-{host}-{os.getppid()}-abcd1234",
        f".reference.tmp-b{host}-{dead}-abcd1234",
    ]
    for name in (left.name, *kept):
        (tmp_path / name).mkdir()
        (tmp_path / name / ".tmpQY238o").write_bytes(bytes(3 << 10))  # safetensors' name
    capsys.readouterr()
    reference._write(folder, "key-1", {"train": torch.zeros(6, 2)})
    assert capsys.readouterr().out == (
        f"memtune: removed {left} (3.0 KiB): a write of the reference tables that process "
        f"{dead} left unfinished when it was killed\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*kept, "reference"])
    assert sorted(p.name for p in folder.iterdir()) == [reference.TABLES, MANIFEST]
    assert list(json.loads((folder / MANIFEST).read_text())["files"]) == [reference.TABLES]


# ------------------------------------------------------------------ the demo models


@pytest.mark.parametrize(
    "damage",
    [
        lambda model: _flip(model / "model.safetensors", at=-3),
        lambda model: (model / _MARKER).unlink(),
    ],
    ids=["flipped byte in the weights", "marker missing"],
)
def test_a_damaged_demo_model_is_set_aside_and_built_again(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: Callable[[Path], None]
) -> None:
    arch = dict(compose_cfg()["model"]["architecture"])
    model = synthesize(tmp_path / "tiny", arch)
    clean = _files(model)
    assert DEMO_MODEL.problem(model) is None
    damage(model)
    assert is_synthesized(model)  # memtune's by its manifest, even without its marker
    capsys.readouterr()
    assert synthesize(model, arch) == model
    line = capsys.readouterr().out.strip()
    aside = _aside(tmp_path, "tiny")
    assert line.startswith(f"memtune: demo model {model} was damaged (")
    assert line.endswith(f"set aside as {aside}; building it again")
    assert _files(model) == clean and aside.is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == [aside.name, ".tiny.lock", "tiny"]
    synthesize(model, arch)
    assert capsys.readouterr().out == ""


def test_a_demo_model_build_a_killed_process_left_is_removed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Seen: a first make train killed while it built the demo model left .tiny-qwen2.XXXX
    # (12 MB) in MEMTUNE_CACHE_DIR; the next start built it again and left that one for good.
    left = left_by_killed_writer(tmp_path, ".tiny.", "model.safetensors")
    capsys.readouterr()
    model = synthesize(tmp_path / "tiny", dict(compose_cfg()["model"]["architecture"]))
    assert (
        f"memtune: removed {left} (3.0 MiB): a build of tiny that process "
        f"{left.name.split('-')[-2]} left unfinished when it was killed\n"
    ) in capsys.readouterr().out  # (and DeepSpeed's first-import line, run alone)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tiny.lock", "tiny"]
    assert DEMO_MODEL.problem(model) is None


def test_an_older_demo_build_without_a_manifest_is_replaced_quietly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    arch = dict(compose_cfg()["model"]["architecture"])
    model = synthesize(tmp_path / "tiny", arch)
    (model / MANIFEST).unlink()
    marker = json.loads((model / _MARKER).read_text())
    (model / _MARKER).write_text(json.dumps({**marker, "fingerprint": "an older builder"}))
    capsys.readouterr()
    synthesize(model, arch)
    assert capsys.readouterr().out == "" and DEMO_MODEL.problem(model) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tiny.lock", "tiny"]
    assert os.access(model / MANIFEST, os.R_OK)


def test_an_older_demo_build_a_killed_rebuild_set_aside_is_removed_at_the_next(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Seen: a rebuild killed after it set the older build aside and renamed the new one into
    place, before it removed the older one, left .tiny.old-PID (12 MB), one per kill, which
    nothing removed. Now .tiny.old-<host>-<pid>-XXXXXXXX: the next build removes a dead
    writer's, nothing else (a live pid's, another host's, one without a host)."""
    import socket

    arch = dict(compose_cfg()["model"]["architecture"])
    model = synthesize(tmp_path / "tiny", arch)
    (model / MANIFEST).unlink()  # an older build (as in the test above)
    marker = json.loads((model / _MARKER).read_text())
    (model / _MARKER).write_text(json.dumps({**marker, "fingerprint": "an older builder"}))
    ended = subprocess.Popen(["true"])  # a pid no process has now
    ended.wait()
    dead, host = ended.pid, socket.gethostname()
    left = tmp_path / f".tiny.old-{host}-{dead}-abcd1234"
    kept = [
        f".tiny.old-{host}-{os.getppid()}-abcd1234",  # a live pid's
        f".tiny.old-another-{host}-{dead}-abcd1234",  # another host's
        f".tiny.old-{dead}",  # named before hosts were: whose, cannot be told
    ]
    for aside in (left.name, *kept):
        (tmp_path / aside).mkdir()
        (tmp_path / aside / "model.safetensors").write_bytes(bytes(2 << 20))
    capsys.readouterr()
    synthesize(model, arch)
    assert capsys.readouterr().out == (
        f"memtune: removed {left} (2.0 MiB): the replaced build of tiny that process {dead} "
        "left unfinished when it was killed\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*kept, ".tiny.lock", "tiny"])
    assert DEMO_MODEL.problem(model) is None


def test_a_damaged_linear_mixer_entry_is_measured_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from memtune.memory import counts

    monkeypatch.setenv("MEMTUNE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(counts, "_MIXER_LINES", {})  # this process's copy: read the file again
    cfg = to_run_config(compose_cfg(["model=tiny-qwen3.5"]))
    clean = counts.linear_mixer_bytes(cfg, 256)
    (entry,) = (tmp_path / "counts").iterdir()
    _flip(entry, at=entry.read_text().index('"value": [') + 11)  # a digit of the slope
    counts._MIXER_LINES.clear()
    capsys.readouterr()
    assert counts.linear_mixer_bytes(cfg, 256) == clean
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"memtune: counts cache {entry} was damaged (")
    assert line.endswith("; the linear mixer measured again")
    assert _aside(tmp_path / "counts", entry.name).is_file()


# ------------------------------------------------------------------ end to end


def _train(run_dir: Path, cache: Path) -> subprocess.CompletedProcess:
    args = [*FAST, "launcher.num_ranks=1", "trainer.max_steps=3", f"run_dir={run_dir}"]
    return subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "MEMTUNE_CACHE_DIR": str(cache)},
    )


def _losses(run_dir: Path) -> list[float]:
    rows = [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["train/loss"] for r in rows if "train/loss" in r]


@pytest.mark.faults
def test_a_job_after_its_caches_were_damaged(tmp_path: Path) -> None:
    """The issue's user: the demo trained once, then a byte of its tokenized data, of its demo
    model and of a cached parameter count changed (a disk hiccup); the same command in a new run
    dir says what it rebuilt in one line each and trains exactly as before (it used to end in a
    SafetensorError traceback, on every later run)."""
    cache = tmp_path / "cache"
    first = _train(tmp_path / "run1", cache)
    assert first.returncode == 0, first.stderr[-3000:]
    (data,) = (p for p in (cache / "data").iterdir() if not p.name.startswith("."))  # .KEY.lock
    model = cache / "tiny-qwen2"
    counts = sorted((cache / "counts").iterdir())
    clean = {"data": _files(data), "model": _files(model), "counts": counts[0].read_bytes()}
    _flip(data / "train.safetensors", at=-7)
    _flip(model / "model.safetensors", at=-7)
    text = counts[0].read_text()  # one digit of the first number in the value
    at = text.index('"value": ') + next(
        i for i, c in enumerate(text[text.index('"value": ') :]) if c.isdigit()
    )
    counts[0].write_text(text[:at] + str((int(text[at]) + 1) % 10) + text[at + 1 :])

    again = _train(tmp_path / "run2", cache)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "Traceback" not in again.stderr
    lines = [line for line in again.stdout.splitlines() if "was damaged" in line]
    assert lines[0].startswith(f"memtune: counts cache {counts[0]} was damaged (")
    model_aside, data_aside = _aside(cache, "tiny-qwen2"), _aside(data.parent, data.name)
    assert lines[1:] == [
        f"memtune: demo model {model} was damaged ({model / 'model.safetensors'} does not hold "
        f"the bytes that were written (its XXH3-128 differs)): set aside as "
        f"{model_aside}; building it again",
        f"memtune: data cache {data} was damaged ({data / 'train.safetensors'} does not hold "
        f"the bytes that were written (its XXH3-128 differs)): set aside as "
        f"{data_aside}; tokenizing again",
    ]
    assert _files(data) == clean["data"] and _files(model) == clean["model"]
    assert counts[0].read_bytes() == clean["counts"]
    assert model_aside.is_dir() and data_aside.is_dir()
    assert _losses(tmp_path / "run2") == _losses(tmp_path / "run1")


def test_a_finished_builds_lock_is_released_at_the_next(tmp_path: Path) -> None:
    """owned_temp_dir keeps a descriptor (its lock) while the directory is there under its
    temporary name; once renamed into place or removed, the next call closes it: a long
    process (a test worker, a sweep) held one descriptor per build it ever made."""
    from memtune import filesystem

    first = filesystem.owned_temp_dir(tmp_path, ".building-")
    assert first in filesystem._OWNED
    first.rename(tmp_path / "entry")  # renamed into place, as a finished build is
    second = filesystem.owned_temp_dir(tmp_path, ".building-")
    assert first not in filesystem._OWNED and second in filesystem._OWNED
    second.rmdir()  # a failed build removes its own
    third = filesystem.owned_temp_dir(tmp_path, ".building-")
    assert second not in filesystem._OWNED and third in filesystem._OWNED
    assert os.path.samefile(f"/proc/self/fd/{filesystem._OWNED[third]}", third)
