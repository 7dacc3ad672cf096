"""The decided run as one typed value: decisions.json holds every choice with no auto, the
ranks read it as is and refuse one they cannot use, and nothing downstream of the decider
reads a decided value from the user's settings."""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from memtune.checkpoints import TRAINER_STATE, seal
from memtune.config import ConfigError, to_run_config, validate
from memtune.config.decisions import (
    CPU_RANKS,
    BatchShape,
    Checkpointing,
    Choices,
    DecisionError,
    Decisions,
    RankMachine,
    decisions_for,
)
from memtune.launcher.prepare import checkpoint_run, lay_out
from memtune.rundir import RunDir
from tests.conftest import ROOT, Run, compose_cfg, decided


@pytest.fixture(scope="module")
def laid_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The CPU demo laid out as a launch lays it out (no ranks started)."""
    run_dir = tmp_path_factory.mktemp("decided") / "run"
    lay_out(compose_cfg(["trainer.max_steps=2"]), run_dir)
    return run_dir


def test_a_save_cut_short_by_a_kill_is_removed_at_the_next_start(
    laid_out: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Seen: the demo killed (kill -9, job and ranks) while it saved step 6 left
    # checkpoints/.tmp-step-0000006 (the engine's states, the adapter); resumed with
    # save_every=5 it trained from step 0 and kept the leftover for good.
    run_dir = laid_out.parent / "killed-mid-save"
    shutil.copytree(laid_out, run_dir)
    left = run_dir / "checkpoints" / ".tmp-step-0000006"
    (left / "engine").mkdir(parents=True)
    (left / "engine" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(bytes(2 << 20))
    done = run_dir / "checkpoints" / "step-0000004"  # not a complete one: left as it is
    done.mkdir()
    sealed = run_dir / "checkpoints" / ".tmp-step-0000008"  # killed inside its rename: kept
    sealed.mkdir()
    (sealed / TRAINER_STATE).write_text('{"step": 8}\n')
    seal(sealed, 8)
    capsys.readouterr()
    lay_out(compose_cfg(["trainer.max_steps=2"]), run_dir)
    assert (
        f"memtune: removed {left} (2.0 MiB): a checkpoint whose save was cut short (its job "
        "was killed while writing it)\n"
    ) in capsys.readouterr().out
    kept = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert kept == [sealed.name, done.name]


def test_the_run_dir_holds_every_decision_and_no_auto(laid_out: Path) -> None:
    raw = json.loads((laid_out / "decisions.json").read_text())
    assert next(iter(raw)) == "version" and raw["version"] == 1

    def leaves(node):
        if isinstance(node, dict):
            return [x for v in node.values() for x in leaves(v)]
        if isinstance(node, list):
            return [x for v in node for x in leaves(v)]
        return [node]

    assert "auto" not in leaves(raw)
    d = RunDir(laid_out).read_decisions()
    assert Decisions.from_dict(d.as_dict()) == d
    # The demo asks for auto everywhere it can; the decisions are numbers and switches.
    settings = (laid_out / "config.yaml").read_text()
    for asked in ("checkpoint_layers: auto", "sequence_parallel: auto", "tiled_mlp: auto"):
        assert asked in settings  # config.yaml keeps the user's intent, untouched
    assert d.checkpointing.layers == ("keep", "keep") and d.sequence_parallel == 1
    assert (d.tiled_mlp, d.offload_activations, d.attention, d.loss) == (
        False,
        False,
        "sdpa_varlen",
        "chunked",
    )
    # DeepSpeed's batch fields come from the decided step's shape.
    ds = json.loads((laid_out / "ds_config.json").read_text())
    assert ds["train_batch_size"] == d.batch.global_batch == 16
    assert ds["gradient_accumulation_steps"] == d.batch.accumulation == 2


def _copy(laid_out: Path, tmp_path: Path) -> Path:
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(laid_out, run_dir, ignore=shutil.ignore_patterns("job.lock"))
    return run_dir


def _edited(run_dir: Path, edit) -> Path:
    raw = json.loads((run_dir / "decisions.json").read_text())
    edit(raw)
    (run_dir / "decisions.json").write_text(json.dumps(raw))
    return run_dir


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (lambda raw: raw.update(loss="auto"), "loss is 'auto', not one of chunked | plain | liger"),
        (
            lambda raw: raw["checkpointing"]["layers"].__setitem__(1, "auto"),
            "checkpointing.layers[1] is 'auto'",
        ),
        (lambda raw: raw["batch"].update(micro_batch="auto"), "batch.micro_batch must be"),
        (lambda raw: raw.pop("tiled_mlp"), "tiled_mlp is missing"),
        (
            lambda raw: raw["checkpointing"].update(layers=["keep"]),
            "checkpointing.layers has 1 entries, the model 2 decoder layers",
        ),
    ],
)
def test_a_rank_refuses_decisions_it_cannot_use(laid_out: Path, tmp_path: Path, edit, named):
    """What a rank reads first (rank.worker.read_decisions, in this process)."""
    from memtune.config import load_run_config
    from memtune.rank.worker import read_decisions

    run_dir = _edited(_copy(laid_out, tmp_path), edit)
    cfg = load_run_config(run_dir / "config.yaml")
    with pytest.raises(ConfigError) as err:
        read_decisions(RunDir(run_dir), cfg)
    assert str(err.value).startswith(f"{run_dir / 'decisions.json'}: ") and named in str(err.value)


def test_a_started_rank_exits_2_naming_the_field(laid_out: Path, tmp_path: Path) -> None:
    """A real rank process on a hand-edited decisions.json: one line, exit 2, before anything
    loads (it never reaches the rendezvous). Its launcher is gone (a train.py killed with -9:
    a pid that runs no process), so rank 0 writes exit.json with the line, as train.py would
    have."""
    run_dir = _edited(_copy(laid_out, tmp_path), lambda raw: raw.update(tiled_mlp="auto"))
    (run_dir / "exit.json").unlink(missing_ok=True)
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}  # never reached
    env |= {"MEMTUNE_LAUNCHER_PID": str(2**22 + 12345)}  # above pid_max's default: no process
    proc = subprocess.run(
        [sys.executable, "-m", "memtune.worker", str(run_dir)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    said = f"config error: {run_dir / 'decisions.json'}: tiled_mlp must be true or false"
    assert said in proc.stderr
    assert "Traceback" not in proc.stderr
    record = json.loads((run_dir / "exit.json").read_text())
    assert record["code"] == 2 and record["error"].startswith(said)


def test_every_rank_stops_when_one_machine_lacks_what_train_py_wrote(
    laid_out: Path, tmp_path: Path
) -> None:
    """A hostfile job's rank on a node without the shared cache: the tokenized data train.py
    wrote is not there. One line naming the machine and the setting, exit 2, before the model
    loads (a traceback from the data loader before); the base checkpoint and peft.init_from
    are checked the same way (rank.this_machine.check_this_machine)."""
    import socket

    from memtune.config import load_run_config
    from memtune.launcher.spawn import free_port
    from memtune.rank.this_machine import check_this_machine

    run_dir = _copy(laid_out, tmp_path)
    data = json.loads((run_dir / "data.json").read_text())
    gone = tmp_path / "not-shared" / Path(data["dir"]).name
    (run_dir / "data.json").write_text(json.dumps({**data, "dir": str(gone)}))
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    env |= {"MASTER_PORT": str(free_port())}
    ranks = [
        subprocess.Popen(
            [sys.executable, "-m", "memtune.worker", str(run_dir)],
            stderr=subprocess.PIPE,
            text=True,
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            cwd=ROOT,
        )
        for r in range(2)
    ]
    host = socket.gethostname()
    said = f"the tokenized data train.py wrote ({gone}, data.json) is not on this machine ({host})"
    for rank in ranks:  # both stop, neither waits in a collective for the other
        _, err = rank.communicate(timeout=300)
        assert rank.returncode == 2, err[-2000:]
        assert f"memtune: config error: {said}: put data.cache_dir" in err
        assert "Traceback" not in err

    rd = RunDir(run_dir)
    cfg = load_run_config(run_dir / "config.yaml")
    record = rd.read_data()
    here = dataclasses.replace(record, dir=data["dir"])
    check_this_machine(cfg, rd, here)  # nothing missing: no error
    moved = dataclasses.replace(cfg.model, name_or_path=str(tmp_path / "elsewhere"))
    with pytest.raises(ConfigError) as err:
        check_this_machine(dataclasses.replace(cfg, model=moved), rd, here)
    assert str(err.value).startswith(
        f"model.name_or_path={tmp_path / 'elsewhere'}: train.py read it from disk on its "
        f"machine, and this machine ({host}) has no {tmp_path / 'elsewhere' / 'config.json'}"
    )


def test_a_rank_refuses_a_run_dir_without_decisions(laid_out: Path, tmp_path: Path) -> None:
    from memtune.config import load_run_config
    from memtune.rank.worker import read_decisions

    run_dir = _copy(laid_out, tmp_path)
    (run_dir / "decisions.json").unlink()
    with pytest.raises(ConfigError, match=r"decisions\.json is missing: a run dir is laid out"):
        read_decisions(RunDir(run_dir), load_run_config(run_dir / "config.yaml"))


@pytest.mark.slow
def test_the_rank_runs_what_was_decided_not_what_was_asked(one_rank_run: Run) -> None:
    """One rank asked for ZeRO-3 runs ZeRO-2 (decided): config.yaml says 3, decisions.json,
    the engine the rank built (its parameters whole, not partitioned) and its summary say 2."""
    run_dir = one_rank_run.dir
    assert "stage: 3" in (run_dir / "config.yaml").read_text()
    assert json.loads((run_dir / "decisions.json").read_text())["zero_stage"] == 2
    (probe,) = one_rank_run.probes()
    assert probe["zero3"] is False and one_rank_run.summary()["zero_stage"] == 2
    checkpoint = next((run_dir / "checkpoints").glob("step-*"))
    assert (checkpoint / "decisions.json").read_bytes() == (run_dir / "decisions.json").read_bytes()


def test_a_checkpoint_from_before_decisions_is_compared_by_its_settings(tmp_path: Path) -> None:
    """An older checkpoint has no decisions.json: its config.yaml held the decided values, and
    a resume compares those."""
    cfg = to_run_config(compose_cfg(["trainer.micro_batch_size=2"]))
    from omegaconf import OmegaConf

    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    old = checkpoint_run(tmp_path)
    assert old.d is None and old.value("trainer.micro_batch_size") == 2
    d = decided(cfg)
    (tmp_path / "decisions.json").write_text(json.dumps(d.as_dict()))
    ours = checkpoint_run(tmp_path)
    changed = dataclasses.replace(d, batch=dataclasses.replace(d.batch, micro_batch=4))
    (tmp_path / "decisions.json").write_text(json.dumps(changed.as_dict()))
    assert ours.value("trainer.micro_batch_size") == 2
    assert checkpoint_run(tmp_path).value("trainer.micro_batch_size") == 4  # decided, not asked
    (tmp_path / "decisions.json").write_text('{"version": 1, "loss": "auto"}')
    with pytest.raises(ConfigError, match=r"decisions\.json: .* is missing"):
        checkpoint_run(tmp_path)


def test_nothing_gives_auto_a_meaning_of_its_own() -> None:
    cfg = to_run_config(compose_cfg([]))  # checkpoint_layers, sequence_parallel, ... on auto
    with pytest.raises(DecisionError, match=r"checkpoint_layers=auto is the planner's to decide"):
        decisions_for(cfg, CPU_RANKS)
    with pytest.raises(DecisionError, match=r"sequence_parallel=auto"):
        decisions_for(cfg, CPU_RANKS, Choices(recompute=2, offload_activations=False, selective=0))
    d = decisions_for(cfg, CPU_RANKS, Choices(2, 1, False, False, 0))
    assert d.checkpointing.recomputed == 2 and d.batch.accumulation == 2
    fixed = to_run_config(compose_cfg(["trainer.checkpoint_layers=1"]))
    with pytest.raises(DecisionError, match=r"checkpoint_layers is set to 1; the choice 2"):
        decisions_for(fixed, CPU_RANKS, Choices(2, 1, False, False, 0))


def test_the_typed_values_refuse_what_cannot_run() -> None:
    with pytest.raises(DecisionError, match=r"recomputed in full come first, then the selective"):
        Checkpointing(("keep", "full"))
    assert Checkpointing.first(1, 3).label() == "1 of 3 layers"
    assert Checkpointing.off(3).label() == "off" and not Checkpointing.off(3).enabled
    with pytest.raises(DecisionError, match=r"batch\.global_batch=10 is not a multiple"):
        BatchShape(global_batch=10, micro_batch=4, ranks=2, sequence_parallel=1, row_tokens=64)
    shape = BatchShape(global_batch=16, micro_batch=2, ranks=4, sequence_parallel=2, row_tokens=64)
    assert (shape.data_parallel, shape.accumulation, shape.rank_tokens) == (2, 4, 64)
    assert shape.deepspeed() == {
        "train_batch_size": 16,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 4,
    }
    # a decisions.json edited by hand: named, not a TypeError from deep in a rank
    raw = decided(to_run_config(compose_cfg([]))).as_dict()
    mixture = {"routed": "128", "adapted": False, "storage": "compute"}
    with pytest.raises(DecisionError, match=r"experts\.routed must be an integer >= 1 \(got '128'"):
        Decisions.from_dict({**raw, "experts": mixture})
    with pytest.raises(DecisionError, match=r"experts\.routed must be an integer >= 1 \(got 0\)"):
        Decisions.from_dict({**raw, "experts": {**mixture, "routed": 0}})
    with pytest.raises(DecisionError, match=r"zero_template must be a string or null \(got 3\)"):
        Decisions.from_dict({**raw, "zero_template": 3})


def test_attention_runs_by_kv_head_with_the_mlp_tiled_where_the_kernel_splits() -> None:
    def decide(*overrides: str, machine: RankMachine = CPU_RANKS) -> Decisions:
        return decided(to_run_config(compose_cfg(list(overrides))), machine=machine)

    assert decide("trainer.tiled_mlp=on").attention_by_kv_head
    assert not decide("trainer.tiled_mlp=off").attention_by_kv_head
    # split over 2 ranks, each holds one of the tiny model's 2 KV heads: nothing to split
    assert not decide("trainer.tiled_mlp=on", "trainer.sequence_parallel=2").attention_by_kv_head
    assert decide("trainer.attention_by_kv_head=on").attention_by_kv_head
    assert not decide(
        "trainer.tiled_mlp=on", "trainer.attention_by_kv_head=off"
    ).attention_by_kv_head
    # auto's attention where flash-attn runs (bf16: it has no fp32 kernels): FlashAttention-2,
    # which splits as memtune's own do
    flash = RankMachine(cuda=True, flash_attn=True)
    on_flash = decide("trainer.tiled_mlp=on", "trainer.precision=bf16", machine=flash)
    assert on_flash.attention == "flash_attention_2" and on_flash.attention_by_kv_head
    by_head = decide("trainer.attention_by_kv_head=on", "trainer.precision=bf16", machine=flash)
    assert by_head.attention == "flash_attention_2" and by_head.attention_by_kv_head
    for kernel in ("eager", "sdpa"):  # transformers' own: one call, refused before any rank
        asked = [f"model.attn_implementation={kernel}", "trainer.attention_by_kv_head=on"]
        with pytest.raises(
            ConfigError,
            match=rf"attention_by_kv_head=on with model.attn_implementation={kernel}: one call "
            r"per KV head is built into sdpa_varlen, torch_varlen, flash_attention_2 only",
        ):
            validate(to_run_config(compose_cfg(asked)), inputs=False)
    d = decide("trainer.tiled_mlp=on")
    with pytest.raises(DecisionError, match=r"by_kv_head with attention sdpa: built into sdpa_"):
        dataclasses.replace(d, attention="sdpa")
    raw = d.as_dict()
    assert Decisions.from_dict(raw) == d
    raw.pop("attention_by_kv_head")  # a decisions.json written before the field
    assert Decisions.from_dict(raw) == dataclasses.replace(d, attention_by_kv_head=False)


# What the decider alone may read from the user's settings: every other module reads these
# values from a Decisions (memory.fit decides them; config.validate checks what was asked).
DECIDED_SETTINGS = {
    ("zero", "stage"),
    ("zero", "template"),
    ("peft", "method"),
    ("trainer", "optimizer"),
    ("trainer", "loss"),
    ("trainer", "rms_norm_kernel"),
    ("trainer", "swiglu_kernel"),
    ("trainer", "rope_kernel"),
    ("trainer", "micro_batch_size"),
    ("trainer", "global_batch_size"),
    ("trainer", "activation_checkpointing"),
    ("trainer", "checkpoint_layers"),
    ("trainer", "checkpointing_reentrant"),
    ("trainer", "sequence_parallel"),
    ("trainer", "tiled_mlp"),
    ("trainer", "offload_activations"),
    ("trainer", "attention_by_kv_head"),
    ("model", "attn_implementation"),
}
DECIDERS = {
    "config/decisions.py",
    "config/validate.py",
    "config/mixture_checks.py",
    "config/derive.py",
    "memory/fit.py",
    "memory/recompute.py",
    "memory/long_context_choice.py",
}
"""derive: one_rank_stage, the one intent-level rule the decider and the validator share;
mixture_checks: the validator's checks of a mixture (config.validate calls them);
memory.recompute: checkpoint_layers=auto's part of memory.fit; memory.long_context_choice:
the long-context choices' part."""
OLDER_RUNS = {"tools/merge.py"}
"""Reads an adapter's run written before decisions.json, whose config.yaml held the decided
values (tools.merge.trained_as; a run with decisions.json is read from it)."""
SECTIONS = {"zero": "zero", "peft": "peft", "trainer": "trainer", "model": "model"}


def _section_aliases(tree: ast.AST) -> dict[str, str]:
    """Local names bound to a settings section (``t = cfg.trainer``, ``p = cfg.peft``)."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            pairs = []
            for target in node.targets:
                if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                    pairs += list(zip(target.elts, node.value.elts, strict=False))
                else:
                    pairs.append((target, node.value))
            for name, value in pairs:
                if (
                    isinstance(name, ast.Name)
                    and isinstance(value, ast.Attribute)
                    and value.attr in SECTIONS
                ):
                    out[name.id] = value.attr
    return out


def decided_reads(path: Path) -> list[str]:
    """``file:line section.field`` for every read of a decided setting from a RunConfig."""
    tree = ast.parse(path.read_text())
    aliases = _section_aliases(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value
        section = None
        if isinstance(owner, ast.Attribute) and owner.attr in SECTIONS:
            section = owner.attr  # cfg.trainer.tiled_mlp
        elif isinstance(owner, ast.Name) and owner.id in aliases:
            section = aliases[owner.id]  # t.tiled_mlp
        if section and (section, node.attr) in DECIDED_SETTINGS:
            found.append(f"{path}:{node.lineno} {section}.{node.attr}")
    return found


def test_only_the_decider_reads_decided_values_from_the_settings() -> None:
    src = ROOT / "src" / "memtune"
    reads = [
        read
        for path in sorted(src.rglob("*.py"))
        if str(path.relative_to(src)) not in DECIDERS | OLDER_RUNS
        for read in decided_reads(path)
    ]
    assert reads == []


def test_the_scan_finds_a_decided_read(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def f(cfg):\n    t = cfg.trainer\n    return t.tiled_mlp, cfg.zero.stage\n")
    assert [r.split(" ")[1] for r in decided_reads(bad)] == ["trainer.tiled_mlp", "zero.stage"]


def test_selective_layers_where_they_are_not_built_are_refused_by_name() -> None:
    from memtune.config import validate

    for extra, named in (
        (["trainer.checkpointing_reentrant=true"], "checkpointing_reentrant=true"),
        (["model.attn_implementation=eager"], "attn_implementation=eager"),
        (["trainer.tiled_mlp=on"], "tiled_mlp / offload_activations=on"),
        (["model=tiny-qwen3-moe"], "a mixture of experts"),
        (["model=tiny-qwen3.5"], "linear-attention layers"),
    ):
        cfg = to_run_config(compose_cfg(["trainer.selective_layers=1", *extra]))
        with pytest.raises(ConfigError, match=rf"trainer\.selective_layers=1 with .*{named}"):
            validate(cfg, inputs=False)
    with pytest.raises(DecisionError, match="selective layers need the non-reentrant"):
        Checkpointing(("selective", "keep"), reentrant=True)
    with pytest.raises(DecisionError, match="full come first, then the selective"):
        Checkpointing(("selective", "full"))
    d = decided(to_run_config(compose_cfg([])), recompute=0, selective=2)
    with pytest.raises(DecisionError, match="selective layers with tiled_mlp"):
        dataclasses.replace(d, tiled_mlp=True)


def test_a_resume_compares_the_beta_a_run_trained_with() -> None:
    """preference.beta unset trains with the objective's published default: a resume that
    now names that value is the same run (a walk-through was refused with 'checkpoint None,
    now 0.1'), and another value is a difference."""
    from memtune.launcher.prepare import RunValues

    def beta(*overrides: str) -> object:
        cfg = to_run_config(compose_cfg(["experiment=demo-dpo-cpu", *overrides]))
        return RunValues(cfg, None).value("preference.beta")

    assert beta() == beta("preference.beta=0.1") == 0.1
    assert (
        beta("trainer.objective=simpo")
        == 2.0
        != beta("trainer.objective=simpo", "preference.beta=2.5")
    )
    assert RunValues(to_run_config(compose_cfg([])), None).value("preference.beta") is None  # SFT
