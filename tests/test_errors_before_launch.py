"""Mistakes knowable before launch stop train.py at once: exit 2, one line naming the field
and the fix, no traceback, no rank started (README "Bad input").

Real train.py processes with preprocess_only=true (they stop before the ranks either way, so
a refusal is told from a pass by the exit code and the line) and the real config functions.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from memtune.config import ConfigError, compose, to_run_config, validate
from memtune.config.decisions import BatchShape
from memtune.data.packing import step_shape
from tests.conftest import ROOT, run_train_py

DEMO = ROOT / "src" / "memtune" / "assets" / "demo_alpaca.jsonl"


def refused(proc, run_dir: Path | None = None) -> str:
    """The one line a refused job prints; checks exit code 2, no traceback and, given the run
    dir, exit.json's record of the same error."""
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("memtune: config error: "), lines[0]
    if run_dir is not None:
        record = json.loads((run_dir / "exit.json").read_text())
        assert record["code"] == 2
        assert record["error"] == lines[0].removeprefix("memtune: ")
    return lines[0]


# ------------------------------------------------------------------ 7a: too little data


def test_dataset_smaller_than_one_global_batch_is_refused(tmp_path: Path) -> None:
    """3 demo records pack into 1 row; the demo's step is 16 rows. Before: "max_steps 24 ≈ inf
    epochs", then every rank failed with "0 items per epoch ... use a smaller
    trainer.micro_batch_size"."""
    data = tmp_path / "three.jsonl"
    data.write_text("".join(DEMO.read_text().splitlines(keepends=True)[:3]))
    run_dir = tmp_path / "run"
    proc = run_train_py(
        ["preprocess_only=true", "logger=none", f"data.path={data}", f"run_dir={run_dir}"],
        cwd=tmp_path,
    )
    line = refused(proc, run_dir)
    assert "trainer.global_batch_size=16 takes 16 rows per step" in line
    assert "3 samples, packed into 1 row(s) of ≤ 128 tokens" in line
    # One micro step over the 2 demo ranks already takes 4 × 2 rows.
    assert "one micro step over the ranks already takes 8 rows" in line
    # a setting that runs as it stands (a walk-through followed "at most 1" into a refusal)
    assert (
        "without a sequence split: launcher.num_ranks=1 trainer.micro_batch_size=1 "
        "trainer.global_batch_size=1"
    ) in line
    assert "inf epochs" not in proc.stdout
    assert not (run_dir / "config.yaml").exists()  # the run dir holds no run


def test_step_shape_names_a_global_batch_that_fits() -> None:
    lengths = [100] * 20  # 20 rows of 128 (one sample each), 20 samples

    def batch(global_batch: int, micro_step: int = 1) -> BatchShape:
        return BatchShape(global_batch, micro_step, 1, 1, 128)  # micro_step rows on one rank

    with pytest.raises(ConfigError) as err:
        step_shape(lengths, True, batch(32, micro_step=8), max_steps=5)
    assert "trainer.global_batch_size=32 takes 32 rows per step" in str(err.value)
    assert "set trainer.global_batch_size=16 (the most that fits" in str(err.value)
    with pytest.raises(ConfigError) as err:
        step_shape(lengths, True, batch(32, micro_step=32), max_steps=5)
    assert "one micro step over the ranks already takes 32 rows" in str(err.value)
    assert "trainer.micro_batch_size=1 trainer.global_batch_size=20" in str(err.value)
    # packed rows are the limit, the samples would do: packing=false is named first
    with pytest.raises(ConfigError, match=r"Fix: set data\.packing=false \(the global batch"):
        step_shape([30] * 20, True, batch(16), max_steps=5)
    with pytest.raises(ConfigError, match=r"has 20 samples: not one step"):
        step_shape(lengths, False, batch(32), max_steps=5)
    exactly = step_shape(lengths, True, batch(20), max_steps=5)
    assert exactly.epochs == pytest.approx(5.0)


# ------------------------------------------------------------------ 7b: FlashAttention-2


def _flash_runs_here() -> bool:
    import importlib.util

    from memtune.machine import cuda_available

    return cuda_available() and importlib.util.find_spec("flash_attn") is not None


def test_flash_attention_where_it_cannot_run_is_refused(tmp_path: Path) -> None:
    # bf16: FlashAttention-2 has no fp32 kernels (the demo's precision: refused as such first)
    flash = ["model.attn_implementation=flash_attention_2", "trainer.precision=bf16"]
    cfg = to_run_config(compose(flash))
    validate(cfg, inputs=False)  # a memory plan may be made anywhere
    if _flash_runs_here():
        validate(cfg)
        return
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert "model.attn_implementation=flash_attention_2 cannot run here" in str(err.value)
    assert "model.attn_implementation=auto" in str(err.value) and "sdpa" in str(err.value)
    proc = run_train_py(
        [
            "preprocess_only=true",
            "logger=none",
            *flash,
            f"run_dir={tmp_path / 'run'}",
        ],
        cwd=tmp_path,
    )
    assert "cannot run here" in refused(proc, tmp_path / "run")


def test_torch_varlen_attention_without_cuda_is_refused() -> None:
    from memtune.machine import cuda_available

    given = ["model.attn_implementation=torch_varlen"]
    cfg = to_run_config(compose([*given, "trainer.precision=bf16"]))
    validate(cfg, inputs=False)  # a memory plan may be made anywhere
    fp32 = to_run_config(compose([*given, "trainer.precision=fp32"]))  # the CPU demo's
    with pytest.raises(ConfigError, match="runs bf16 and fp16 only"):
        validate(fp32, inputs=False)
    # FlashAttention-2 likewise (transformers only warned; flash-attn raised in the first
    # forward on every rank).
    flash = ["model.attn_implementation=flash_attention_2", "trainer.precision=fp32"]
    with pytest.raises(ConfigError, match="FlashAttention-2 runs bf16 and fp16 only"):
        validate(to_run_config(compose(flash)), inputs=False)
    if cuda_available():
        validate(cfg)
        return
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert "model.attn_implementation=torch_varlen cannot run here" in str(err.value)
    assert "model.attn_implementation=auto" in str(err.value)


# ------------------------------------------------------------------ 7c: model=local, no path


@pytest.mark.parametrize("mode", ["preprocess_only=true", "plan_only=true"])
def test_local_model_without_a_path(tmp_path: Path, mode: str) -> None:
    """Before: OmegaConf's MissingMandatoryValue traceback from to_object."""
    proc = run_train_py([mode, "model=local", f"run_dir={tmp_path / 'run'}"], cwd=tmp_path)
    line = refused(proc)
    assert "model.name_or_path is not set" in line
    assert "model=local model.name_or_path=/" in line


# ------------------------------------------------------------------ 7d: +key not in the schema


def test_a_symlink_loop_given_as_a_path_is_named_not_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """resume=, launcher.hostfile= or MEMTUNE_CACHE_DIR given as (or through) a symlink loop:
    Path.resolve's RuntimeError "Symlink loop from ..." on Python < 3.13, a traceback from
    train.py (and from `memtune plan`, for the cache) instead of the refusal a missing path
    gets. The cache itself is refused where the demo model is built (cannot_write)."""
    from memtune.launcher.prepare import resolve_resume
    from memtune.launcher.topology import resolve
    from memtune.rundir import RunDir
    from tests.conftest import decided

    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    cfg = to_run_config(compose([f"resume={loop}"]))
    with pytest.raises(ConfigError, match=rf"^resume={loop}: not a complete memtune checkpoint"):
        resolve_resume(cfg, decided(cfg), RunDir(tmp_path / "run"), tmp_path)
    cfg = to_run_config(compose([f"launcher.hostfile={loop}", "launcher.nnodes=2"]))
    with pytest.raises(ConfigError, match=rf"^launcher.hostfile={loop}: no such file$"):
        resolve(cfg, env={})
    monkeypatch.setenv("MEMTUNE_CACHE_DIR", str(loop / "cache"))
    validate(to_run_config(compose([])))  # the demo model is in the cache, as it should be


def test_a_folder_memtune_cannot_make_or_write_is_named(tmp_path: Path) -> None:
    """run_dir, data.cache_dir or MEMTUNE_CACHE_DIR where a file stands (or on a read-only
    filesystem: the same check, os.access and statvfs) is one line naming the setting, before
    Hydra makes the run dir or memtune writes the cache, not an OSError's traceback."""

    from memtune.config.command_line import composition_problem
    from memtune.filesystem import cannot_write

    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine\n")
    assert cannot_write(a_file) == f"{a_file} is a file, not a folder"
    assert cannot_write(a_file / "run" / "x") == f"{a_file} is a file, not a folder"
    assert cannot_write(tmp_path / "new" / "run") is None
    assert composition_problem([f"run_dir={a_file / 'run'}"]) == (
        f"run_dir={a_file / 'run'}: {a_file} is a file, not a folder; give the run a folder "
        "memtune can write"
    )
    # a symlink that leads nowhere, or round a loop, where the folder goes or on the way:
    # Hydra's mkdir raised FileExistsError, a traceback (a start, a sweep's dir)
    dangling, loop = tmp_path / "scratch", tmp_path / "loop"
    dangling.symlink_to(tmp_path / "gone")
    loop.symlink_to(loop)
    said = f"{dangling} is a symlink to {tmp_path / 'gone'}, which does not exist"
    assert cannot_write(dangling) == said and cannot_write(dangling / "run" / "x") == said
    assert composition_problem([f"run_dir={loop / 'run'}"]) == (
        f"run_dir={loop / 'run'}: {loop} is a symlink loop; give the run a folder memtune can write"
    )
    assert composition_problem(["-m", f"hydra.sweep.dir={dangling}", "peft.r=4,8"]) == (
        f"hydra.sweep.dir={dangling}: {said}; give the sweep a folder it can write"
    )
    assert not (tmp_path / "gone").exists()
    # run_dir in a sweep: refused before Hydra lays out the sweep's dir and its first point's
    sweep = tmp_path / "sweep"
    assert composition_problem(
        ["-m", f"hydra.sweep.dir={sweep}", "peft.r=4,8", f"run_dir={tmp_path / 'x'}"]
    ) == (
        "run_dir cannot be set in a sweep (-m): every point needs its own dir; set "
        "hydra.sweep.dir instead"
    )
    assert not sweep.exists()
    # an interpolation Hydra resolves only in its main is left to it (a review found these
    # common sweep-style run dirs refused with a traceback)
    assert composition_problem(["run_dir=runs/${hydra:job.name}"]) is None
    # a folder on the way that cannot be entered (a review found a traceback): as root, which
    # passes every permission check, the probe runs as another user (nobody) with a system
    # Python that user may run, on a copy of memtune.filesystem (stdlib only) it may read
    world = Path(tempfile.mkdtemp(prefix="memtune-perm-"))
    try:
        world.chmod(0o755)
        shutil.copy(ROOT / "src" / "memtune" / "filesystem.py", world / "filesystem.py")
        locked = world / "locked"
        locked.mkdir(mode=0o700)
        as_root = os.getuid() == 0
        python = sys.executable
        if as_root:
            python = next(
                (
                    p
                    for p in ("/usr/bin/python3", "/usr/local/bin/python3")
                    if Path(p).is_file() and os.stat(p).st_mode & 0o001
                ),
                "",
            )
            if not python:
                pytest.skip("as root, and no Python another user may run")
        else:
            locked.chmod(0o000)
        probe = (
            "import sys; from pathlib import Path; from filesystem import cannot_write; "
            "print(cannot_write(Path(sys.argv[1])))"
        )
        said = subprocess.run(
            [python, "-S", "-c", probe, str(locked / "inner" / "run")],
            capture_output=True,
            text=True,
            env={"PYTHONPATH": str(world)},
            user=65534 if as_root else None,
            timeout=60,
        )
        assert said.stdout.strip() == (
            f"cannot reach {locked / 'inner' / 'run'} (permission denied on a folder on the way)"
        ), said.stderr
    finally:
        (world / "locked").chmod(0o700)
        shutil.rmtree(world)
    args = [f"run_dir={tmp_path / 'run'}", "preprocess_only=true"]
    line = refused(run_train_py([*args, f"data.cache_dir={a_file}"], cwd=tmp_path))
    assert line == (
        f"memtune: config error: data.cache_dir: {a_file} is a file, not a folder; point it "
        "at a folder memtune can write"
    )
    env = {**os.environ, "MEMTUNE_CACHE_DIR": str(a_file)}
    line = refused(run_train_py(args, cwd=tmp_path, env=env))
    assert line.startswith(f"memtune: config error: the demo model cannot be built in {a_file}:")
    assert a_file.read_text() == "mine\n"


def test_appended_unknown_key_is_refused_with_the_close_name(tmp_path: Path) -> None:
    """Before: +trainer.max_step=2 composed, became a stray attribute, and the run trained
    trainer.max_steps (24) steps."""
    run_dir = tmp_path / "run"
    proc = run_train_py(
        ["preprocess_only=true", "+trainer.max_step=2", f"run_dir={run_dir}"], cwd=tmp_path
    )
    line = refused(proc, run_dir)
    assert "trainer.max_step is not a memtune setting: did you mean trainer.max_steps" in line
    proc = run_train_py(["plan_only=true", "+trainer.max_step=2"], cwd=tmp_path)
    assert "did you mean trainer.max_steps" in refused(proc)


def test_a_group_value_or_type_hydra_refuses_is_one_line(tmp_path: Path) -> None:
    """What Hydra refuses while composing (a group value that does not exist, a value of the
    wrong type, in a single run or any of a sweep's points) is one line and exit 2 before
    anything is laid out, not Hydra's twenty lines and exit 1 (a failed sweep point's code)."""
    cases = [
        (["experiment=qwen2.5-7b-lora"], "Could not find 'experiment/qwen2.5-7b-lora'"),
        (["trainer.lr=abc"], "Error merging override trainer.lr=abc (Value 'abc' of type"),
        (["-m", "peft.r=4,8", "data=alpacca"], "Could not find 'data/alpacca' Available"),
        (["-m", "peft.r=4,oops"], "Error merging override peft.r=oops"),  # its second point
    ]
    for args, said in cases:
        line = refused(run_train_py(args, cwd=tmp_path))
        assert said in line, line
    assert list(tmp_path.iterdir()) == []  # no run dir, no outputs/, no multirun/
    from memtune.config.command_line import composition_problem

    # every value of a sweep is composed (the other keys at their first), as Hydra's sweeper
    # does before it launches any point; without -m a sweep is refused as Hydra would
    assert "Value 'oops' of type 'str'" in str(
        composition_problem(["-m", "data=alpaca,messages", "trainer.lr=1e-4,oops"])
    )
    assert composition_problem(["-m", "trainer.lr=1e-4,2e-4", "peft.r=range(4,12,4)"]) is None
    assert str(composition_problem(["peft.r=4,8"])).startswith("peft.r=4,8 gives several values")
    # Hydra's to answer: --cfg (printing the config), a sweeper plugin's interval, and
    # everything under HYDRA_FULL_ERROR=1
    assert composition_problem(["--cfg", "job", "experiment=nope"]) is None
    plugin = ["-m", "hydra/sweeper=optuna", "trainer.lr=interval(1e-5,1e-4)"]
    assert composition_problem(plugin) is None
    assert composition_problem(["experiment=nope"], env={"HYDRA_FULL_ERROR": "1"}) is None
    # hydra.searchpath is composed with the rest: an experiment of the user's own config dir
    mine = tmp_path / "conf" / "experiment"
    mine.mkdir(parents=True)
    (mine / "mine.yaml").write_text((ROOT / "conf/experiment/demo-cpu.yaml").read_text())
    searched = [f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "experiment=mine"]
    assert composition_problem(searched) is None
    assert "Could not find 'experiment/mine'" in str(composition_problem(searched[1:]))
    # as are Hydra's groups: the Slurm launcher's settings exist once it is chosen (the Slurm
    # tier caught a pre-check that left the group out and refused them)
    slurm = ["-m", "hydra/launcher=slurm", "hydra.launcher.timeout_min=20", "peft.r=4,8"]
    assert composition_problem(slurm) is None
    assert "timeout_min" in str(composition_problem([slurm[0], *slurm[2:]]))


def test_a_sweep_the_basic_sweeper_cannot_run_is_one_line(tmp_path: Path) -> None:
    """-m peft.r=interval(1,4) was the basic sweeper's HydraException traceback; a glob that
    matches nothing (peft.r=glob(*), experiment=glob(nomatch*)) ran a sweep of no point and
    exited 0 with an empty report; hydra.sweep.dir under a file was Hydra's mkdir traceback."""
    from memtune.config.command_line import composition_problem

    assert composition_problem(["-m", "peft.r=interval(1,4)"]) == (
        "peft.r=interval(1,4): an interval is for a sweeper plugin (hydra/sweeper=...); Hydra's "
        "basic sweeper takes values: a,b or choice(a,b) or range(start,stop)"
    )
    for glob, group in (("peft.r=glob(*)", "peft.r"), ("experiment=glob(nope*)", "experiment")):
        said = str(composition_problem(["-m", glob]))
        assert said.startswith(f"{glob} matches no config of the group {group}: the sweep would")
    assert composition_problem(["-m", "experiment=glob(demo-c*)", "peft.r=4,8"]) is None
    a_file = tmp_path / "file"
    a_file.write_text("")
    assert composition_problem(["-m", f"hydra.sweep.dir={a_file}/s", "peft.r=4,8"]) == (
        f"hydra.sweep.dir={a_file}/s: {a_file} is a file, not a folder; give the sweep a "
        "folder it can write"
    )
    # What is not the basic sweeper's, or not ours to expand, is left to Hydra (the review
    # found these refused): a plugin named after the interval, a glob over a user's search
    # path (it may match there), a sweep dir that is all an interpolation
    assert composition_problem(["-m", "trainer.lr=interval(0.1,1)", "hydra/sweeper=optuna"]) is None
    mine = tmp_path / "conf" / "experiment"
    mine.mkdir(parents=True)
    (mine / "mine.yaml").write_text((ROOT / "conf/experiment/demo-cpu.yaml").read_text())
    searched = f"hydra.searchpath=[file://{tmp_path / 'conf'}]"
    assert composition_problem(["-m", "experiment=glob(mine*)", searched]) is None
    sweep_dir = "hydra.sweep.dir=${oc.env:HOME}/sweeps"
    assert composition_problem(["-m", sweep_dir, "peft.r=4,8"]) is None


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("+trainer.max_seq_len=64", r"trainer\.max_seq_len is not .* data\.max_seq_len"),
        ("+zero.stages=2", r"zero\.stages is not a memtune setting: did you mean zero\.stage"),
        ("+lora_r=8", r"lora_r is not a memtune setting"),
    ],
)
def test_appended_keys_anywhere(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        to_run_config(compose([override]))


def test_free_form_fields_take_any_key() -> None:
    """model.architecture is a config.json's fields: a + there is not refused."""
    cfg = to_run_config(compose(["+model.architecture.sliding_window=4096"]))
    assert cfg.model.architecture["sliding_window"] == 4096


def test_saved_config_with_a_key_too_many(tmp_path: Path) -> None:
    """load_run_config (a checkpoint's config.yaml): one line, not OmegaConf's traceback."""
    from memtune.config import load_run_config

    bad = tmp_path / "config.yaml"
    bad.write_text("trainer:\n  max_step: 2\n")
    with pytest.raises(ConfigError, match=r"max_step is not a memtune setting: did you mean"):
        load_run_config(bad)


# ------------------------------------------------------------------ 7e: a hub name, no hub


def test_hub_model_offline_answers_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: ~50 s of huggingface_hub retries, printed twice, then a traceback. Now one
    line and no retry (judged by what it printed, not by a clock: a loaded CI machine once took
    31 s to start Python and refuse)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty cache
    run_dir = tmp_path / "run"
    proc = run_train_py(
        ["preprocess_only=true", "logger=none", "model=qwen2.5-0.5b", f"run_dir={run_dir}"],
        cwd=tmp_path,
    )
    line = refused(proc, run_dir)
    assert "model.name_or_path='Qwen/Qwen2.5-0.5B' is not on disk" in line
    assert "HF_HUB_OFFLINE is set" in line
    assert "model=local model.name_or_path=/path/to/checkpoint" in line
    assert "Retrying" not in proc.stdout + proc.stderr


def test_unreachable_hub_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without HF_HUB_OFFLINE: a connect to the hub's host is tried first. A port on this
    machine that nothing listens on stands for the unreachable hub (no network involved)."""
    import huggingface_hub.constants

    from memtune.data.encode import check_downloadable

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again when the block ends: refused
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HTTPS_PROXY", "https_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delenv("ALL_PROXY", raising=False)
    monkeypatch.delenv("all_proxy", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"https://127.0.0.1:{port}")
    start = time.monotonic()
    with pytest.raises(ConfigError) as err:
        check_downloadable("Qwen/Qwen2.5-0.5B")
    assert time.monotonic() - start < 5
    assert f"https://127.0.0.1:{port} cannot be reached from this machine" in str(err.value)
    assert "model=local" in str(err.value) and "HF_HUB_OFFLINE=1" in str(err.value)
    check_downloadable(str(tmp_path))  # a local directory is never probed


# ------------------------------------------------------------------ the data and the model


def test_a_token_id_beyond_the_models_vocabulary_is_refused(tmp_path: Path) -> None:
    """A tokenizer with an added special token the model has no embedding row for (its id ≥
    config.json's vocab_size), and data that holds it. Before: every rank failed in its first
    forward with "IndexError: index out of range in self"."""
    import shutil

    from transformers import AutoTokenizer

    from memtune.config.given import given_config
    from memtune.launcher.prepare import check_token_ids, prepare_data
    from memtune.tools.tiny import synthesize

    demo = to_run_config(compose([]))
    model = tmp_path / "model"
    built = synthesize(demo.model.name_or_path, demo.model.architecture)
    shutil.copytree(built, model, ignore=shutil.ignore_patterns("manifest.json", "memtune_*"))
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})
    tokenizer.save_pretrained(model)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    token = tokenizer.convert_tokens_to_ids("<|tool|>")
    assert token >= vocab
    rows = [{"instruction": "call it", "input": "", "output": f"ok {t}"} for t in ("", "<|tool|>")]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    overrides = [
        "model=local",
        f"model.name_or_path={model}",
        "data=alpaca",
        f"data.path={data}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "preprocess_only=true",
    ]
    cfg = given_config(compose(overrides))
    prepared = prepare_data(cfg)
    with pytest.raises(ConfigError) as err:
        check_token_ids(cfg, prepared)
    assert str(err.value) == (
        f"data: the tokenized train split holds token id {token} ('<|tool|>'), and the model "
        f"{model} has vocab_size {vocab} ({model / 'config.json'}): it has no embedding for ids "
        f"from {vocab} on, and every rank would fail on it; the tokenizer has tokens the model "
        "has no embedding for (added special tokens?): train with the model's own tokenizer, "
        "or with a checkpoint whose embeddings were resized to this tokenizer"
    )
    data.write_text(json.dumps(rows[0]) + "\n")  # the token not in the data: nothing to refuse
    check_token_ids(cfg, prepare_data(given_config(compose(overrides))))


# ------------------------------------------------------------------ a damaged peft.init_from


def test_a_damaged_init_from_adapter_is_refused_before_launch(tmp_path: Path) -> None:
    """peft.init_from=DIR whose adapter_config.json is not JSON was a JSONDecodeError traceback
    before launch (exit 1); whose adapter_model.safetensors is cut short it passed the checks
    and every rank stopped with SafetensorError. memtune.adapter_check (shared with memtune
    merge and generate) reads the config and the weights' header, never the tensors."""
    import numpy as np
    from safetensors.numpy import save_file

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    lora = {"peft_type": "LORA", "r": 16, "lora_alpha": 32, "target_modules": ["q_proj"]}
    (adapter / "adapter_config.json").write_text(json.dumps(lora))
    weights = adapter / "adapter_model.safetensors"
    save_file({"w": np.zeros((8, 8), dtype=np.float32)}, str(weights))
    whole = "give an adapter saved whole (a run's RUN_DIR/adapter, or a checkpoint's adapter/)"

    def refusal() -> str:
        cfg = to_run_config(compose([f"peft.init_from={adapter}"]))
        with pytest.raises(ConfigError) as err:
            validate(cfg)
        return str(err.value)

    full = weights.stat().st_size
    with weights.open("r+b") as f:
        f.truncate(full - 4)
    assert refusal() == (
        f"peft.init_from={adapter}: {weights} is truncated: {full - 4:,} bytes, its header "
        f"says {full:,}; {whole}"
    )
    (adapter / "adapter_config.json").write_text('{"r": 16,')
    assert refusal() == (
        f"peft.init_from={adapter}: {adapter}/adapter_config.json is not valid JSON (Expecting "
        f"property name enclosed in double quotes at line 1 column 10): damaged; {whole}"
    )
    (adapter / "adapter_config.json").write_text(json.dumps({**lora, "peft_type": "IA3"}))
    assert refusal() == (
        f"peft.init_from={adapter}: {adapter}/adapter_config.json: peft_type 'IA3', not a LoRA "
        f"adapter's settings (peft_type LORA); {whole}"
    )


# ------------------------------------------------------------------ numbers that mean nothing


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("plan.device_gib=-1", "plan.device_gib must be > 0 or null (got -1.0)"),
        ("plan.device_gib=0", "plan.device_gib must be > 0 or null (got 0.0)"),
        ("plan.host_gib=-2", "plan.host_gib must be > 0 or null (got -2.0)"),
        ("plan.host_link_gb_s=0", "plan.host_link_gb_s must be > 0 (got 0.0)"),
        ("launcher.omp_threads=0", "launcher.omp_threads must be > 0 or null (got 0)"),
        ("trainer.weight_decay=-0.1", "trainer.weight_decay must be >= 0 (got -0.1)"),
        ("trainer.optim_8bit_min_size=-1", "trainer.optim_8bit_min_size must be >= 0 (got -1)"),
        ("data.num_workers=-1", "data.num_workers must be >= 0 (got -1)"),
        ("trainer.lr=nan", "trainer.lr must be a finite number (got nan)"),
        ("trainer.max_grad_norm=nan", "trainer.max_grad_norm must be a finite number (got nan)"),
        ("plan.device_gib=inf", "plan.device_gib must be a finite number (got inf)"),
        ("trainer.seed=-1", "trainer.seed must be in [0, 2**32) (got -1; numpy's seeds)"),
        (
            "launcher.master_port=99999",
            "launcher.master_port=99999 is not a port: choose one in 1-65535, or leave it unset "
            "(null) for memtune's default",
        ),
        (
            "launcher.master_port=0",
            "launcher.master_port=0 is not a port: choose one in 1-65535, or leave it unset "
            "(null) for memtune's default",
        ),
        (
            "trainer.checkpoint_layers=99",
            "trainer.checkpoint_layers=99: {model} has 2 layers (num_hidden_layers); choose "
            "0-2, all, or auto",
        ),
        (
            "trainer.selective_layers=3",
            "trainer.selective_layers=3: {model} has 2 layers (num_hidden_layers); choose 0-2, "
            "all, or auto",
        ),
    ],
)
def test_a_number_that_cannot_mean_anything_is_refused(override: str, message: str) -> None:
    """Each passed validation before: plan.device_gib=-1 printed a whole plan ending "the
    device has -1.00 GiB", launcher.master_port=99999 stopped every rank with "port must be
    0-65535", trainer.seed=-1 with numpy's ValueError, and trainer.checkpoint_layers=99 on the
    2-layer demo model ran as all, silently; trainer.lr=nan passed every range check (a run
    trained on NaN) and plan.device_gib=inf planned every run as fitting."""
    cfg = to_run_config(compose([override]))
    with pytest.raises(ConfigError) as err:
        validate(cfg, inputs=False)
    assert str(err.value) == message.format(model=cfg.model.name_or_path)


def test_memtune_plan_refuses_a_negative_device(capsys: pytest.CaptureFixture[str]) -> None:
    from memtune.launcher.job import print_plan

    assert print_plan(compose(["plan.device_gib=-1"])) == 2
    out, err = capsys.readouterr()
    assert err == "memtune: config error: plan.device_gib must be > 0 or null (got -1.0)\n"
    assert "GiB" not in out


def test_a_master_port_in_use_is_refused_before_the_ranks_start() -> None:
    """Before: the ranks started and stopped with DistNetworkError EADDRINUSE."""
    from memtune.launcher.spawn import check_master_port, free_port
    from memtune.launcher.topology import resolve

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = to_run_config(compose([f"launcher.master_port={port}"]))
        with pytest.raises(ConfigError) as err:
            check_master_port(cfg, resolve(cfg))
    assert str(err.value) == (
        f"launcher.master_port={port}: the port is in use on this machine (127.0.0.1: another "
        "job's ranks, or another program); choose a free port, or leave it unset: memtune "
        "picks a free one"
    )
    for attempt in range(3):  # a free port can be taken by another process in between
        free = to_run_config(compose([f"launcher.master_port={free_port()}"]))
        try:
            check_master_port(free, resolve(free))
            break
        except ConfigError:
            if attempt == 2:
                raise
    unset = to_run_config(compose([]))
    check_master_port(unset, resolve(unset))  # memtune's own free port, picked at launch
    # per-node, node 0: the port it derived (here $MASTER_PORT; else the Slurm job id's)
    nodes = ["launcher.num_ranks=2", "launcher.nnodes=2", "run_dir=/r", "launcher.launch_id=1"]
    per_node = to_run_config(compose([*nodes, "launcher.master_addr=127.0.0.1"]))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        spec = resolve(per_node, env={"MASTER_PORT": str(port)})
        with pytest.raises(ConfigError) as err:
            check_master_port(per_node, spec)
    assert str(err.value) == (
        f"the rendezvous port {port} (from $MASTER_PORT or the Slurm job id): the port is in "
        "use on this machine (127.0.0.1: another job's ranks, or another program); set "
        "launcher.master_port (or $MASTER_PORT) to a free port"
    )


# ------------------------------------------------------------------ notes, not refusals


def test_settings_that_do_less_than_they_seem_are_noted_at_start_up(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """trainer.eval_every without a validation split never evaluated, and a warmup longer
    than the run never reached trainer.lr, both without a word."""
    from memtune.config.given import given_config

    given_config(
        compose(["trainer.eval_every=1", "trainer.warmup_steps=50", "trainer.max_steps=2"])
    )
    notes = [line for line in capsys.readouterr().out.splitlines() if "note:" in line]
    assert notes == [
        "memtune: note: trainer.eval_every=1 without a validation split (data.val_fraction is 0 "
        "and data.val_path is not set): nothing will be evaluated; hold some data out with "
        "data.val_fraction=0.05 or give data.val_path",
        "memtune: note: trainer.warmup_steps=50 with trainer.max_steps=2: the run ends inside "
        "its warmup, so the learning rate peaks at 4% of trainer.lr=0.005; set "
        "trainer.warmup_steps below 2 to reach it",
    ]
    given_config(compose(["trainer.eval_every=1", "data.val_fraction=0.1"]))
    assert "note:" not in capsys.readouterr().out  # the demo: 24 steps, 3 of warmup
    # a user's data on the default experiment trained the tiny random demo model unsaid
    demo = Path(__file__).resolve().parents[1] / "src/memtune/assets/demo_alpaca.jsonl"
    mine = tmp_path / "mine.jsonl"
    mine.write_text(demo.read_text())
    given_config(compose(["data=alpaca", f"data.path={mine}"]))
    assert capsys.readouterr().out.splitlines() == [
        "memtune: note: the model is tiny-qwen2, a tiny model with random weights built for the "
        "demo and the tests, and the data is yours: it learns nothing useful; give a real base "
        "with experiment=... (the 4x4090 ones) or model=... (docs/models.md)"
    ]


# ------------------------------------------------------------------ ~ the shell left alone


def test_a_tilde_the_shell_did_not_expand_is_named() -> None:
    """data.path=~/x.jsonl reaches Hydra with its ~ (the shell expands one at the start of a
    word): before, "LexerNoViableAltException: data.path=~/x.jsonl ^"."""
    from memtune.config.command_line import composition_problem

    said = "the shell left this ~ unexpanded, and Hydra cannot read one"
    assert composition_problem(["data.path=~/x.jsonl"]) == (
        f"data.path=~/x.jsonl: {said}; write data.path=$HOME/x.jsonl instead (the shell "
        "expands $HOME there)"
    )
    assert composition_problem(["-m", "peft.r=4,8", "run_dir=~bob/runs"]) == (
        f"run_dir=~bob/runs: {said}; write the whole path instead"
    )
    assert composition_problem(["data.path='~/x.jsonl'"]) is None  # quoted for Hydra: a string
    # the verbs compose through memtune.config.compose: `memtune plan data.path=~/x.jsonl`
    from memtune.cli import main

    with pytest.raises(ConfigError, match=r"data\.path=~/x\.jsonl: the shell left this ~"):
        compose(["data.path=~/x.jsonl"])
    assert main(["plan", "data.path=~/x.jsonl"]) == 2


@pytest.mark.parametrize(
    ("overrides", "env", "message"),
    [
        (
            ["logger.project=team/sweeps"],
            {},
            "logger.project='team/sweeps' is not a wandb project name: it has /; wandb takes at "
            "most 128 characters and none of / \\ # ? % :",
        ),
        ([], {"WANDB_MODE": "bogus"}, r"$WANDB_MODE='bogus': wandb refuses it: Input should be"),
        ([], {"WANDB_PROJECT": "a:b"}, r"$WANDB_PROJECT='a:b': wandb refuses it: Invalid project"),
        ([], {"WANDB_RUN_ID": "a/b"}, r"$WANDB_RUN_ID='a/b': wandb refuses it: Run ID cannot"),
        (
            ["logger.mode=online"],
            {},
            "logger.mode=online: no wandb credentials for",
        ),
        (
            ["logger.mode=auto"],
            {"WANDB_API_KEY": "abc"},
            "logger.mode=auto: wandb's credentials: WANDB_API_KEY invalid",
        ),
    ],
    ids=["project", "mode-env", "project-env", "run-id-env", "online-no-key", "auto-bad-key"],
)
def test_wandb_settings_rank_0_would_die_on_are_refused_before_launch(
    overrides: list[str],
    env: dict[str, str],
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each was a traceback from wandb.init in rank 0, after the ranks had loaded the model
    (logger.project=team/sweeps: 'Invalid project name'; logger.mode=online on a machine not
    logged in: 'No API key configured')."""
    for name in [n for n in os.environ if n.startswith("WANDB_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))  # not logged in
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    cfg = to_run_config(compose(overrides))
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert str(err.value).startswith(message)
    validate(to_run_config(compose(["logger.backend=none", *overrides])))  # wandb not used


@pytest.mark.parametrize(
    ("override", "asked"),
    [
        ("trainer.checkpoint_layers=all", "trainer.checkpoint_layers=all"),
        ("trainer.checkpoint_layers=1", "trainer.checkpoint_layers=1"),
        ("trainer.checkpointing_reentrant=true", "trainer.checkpointing_reentrant=true"),
    ],
)
def test_checkpointing_asked_for_with_checkpointing_off_is_refused(
    override: str, asked: str
) -> None:
    """Each was dropped without a word: the run checkpointed nothing (memtune plan's
    activations row said 'no checkpointing')."""
    cfg = to_run_config(compose(["trainer.activation_checkpointing=false", override]))
    with pytest.raises(ConfigError) as err:
        validate(cfg, inputs=False)
    assert str(err.value) == (
        f"{asked} with trainer.activation_checkpointing=false: nothing is checkpointed then; "
        "set trainer.activation_checkpointing=true to checkpoint, or leave "
        "trainer.checkpoint_layers=auto and trainer.checkpointing_reentrant=false"
    )
    validate(to_run_config(compose(["trainer.activation_checkpointing=false"])), inputs=False)
    validate(to_run_config(compose(["trainer.activation_checkpointing=true", override])), False)


def test_logger_mode_auto_goes_online_where_wandb_login_logged_in(tmp_path: Path) -> None:
    """auto looked for api.wandb.ai in ~/.netrc, where the pinned wandb (0.31) logs in to
    api.forge.coreweave.com by default, or $WANDB_BASE_URL's host: logged in, it stayed
    offline without a word."""
    from memtune.config.logger_check import wandb_mode
    from memtune.config.schema import LoggerConfig

    auto = LoggerConfig(mode="auto")
    netrc = tmp_path / "netrc"
    env = {"NETRC": str(netrc)}
    assert wandb_mode(auto, env) == "offline"  # no file
    for host in ("api.wandb.ai", "api.forge.coreweave.com"):
        netrc.write_text(f"machine {host}\n  login user\n  password {'x' * 40}\n")
        assert wandb_mode(auto, env) == "online", host
    netrc.write_text("machine api.wandb.ai.example.org\n  login user\n  password p\n")
    assert wandb_mode(auto, env) == "offline"  # another machine
    netrc.write_text("machine wandb.mycorp.internal login user password p\n")
    assert wandb_mode(auto, env) == "offline"
    assert wandb_mode(auto, {**env, "WANDB_BASE_URL": "https://wandb.mycorp.internal"}) == "online"
    assert wandb_mode(auto, {"NETRC": str(tmp_path / "none"), "WANDB_API_KEY": "k"}) == "online"
    assert wandb_mode(LoggerConfig(mode="offline"), {"WANDB_API_KEY": "k"}) == "offline"
