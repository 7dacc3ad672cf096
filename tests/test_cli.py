"""``memtune VERB``: one command surface; help exits 0, bad input ends in one line and exit 2.

Every command runs as a person runs it: the installed console script (or ``python -m
memtune.cli``) in a subprocess. No DeepSpeed rank is started here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from memtune.exit_codes import EXIT_CONFIG

VERBS = ["plan", "report", "merge", "generate", "preflight", "trace", "machine"]
MEMTUNE = Path(sys.executable).parent / "memtune"
QWEN7B = "experiment=qwen2.5-7b-4x4090-lora"


def memtune(*args: str, cwd: Path | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    assert MEMTUNE.is_file(), f"{MEMTUNE}: the console script is missing (make install)"
    return subprocess.run(
        [str(MEMTUNE), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def assert_refused(proc: subprocess.CompletedProcess, verb: str, *names: str) -> str:
    """Exit 2 with one line ``memtune VERB: ...`` on stderr naming ``names``; returns it."""
    assert proc.returncode == EXIT_CONFIG, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"memtune {verb}: "), lines[0]
    for name in names:
        assert name in lines[0], (name, lines[0])
    return lines[0]


def tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*") if p.is_file()}


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_lists_every_verb_and_exits_0(flag: str) -> None:
    proc = memtune(flag)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: memtune")
    listed = re.findall(r"^    (\w+)  +\S", proc.stdout, flags=re.MULTILINE)
    assert listed == VERBS, proc.stdout


def test_help_imports_no_torch() -> None:
    # `memtune --help` must answer at once: the verbs' heavy modules load only when they run.
    code = (
        "import sys\n"
        "from memtune.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "heavy = [m for m in ('torch', 'transformers', 'peft', 'deepspeed') if m in sys.modules]\n"
        "print('HEAVY', heavy, file=sys.stderr)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "HEAVY []" in proc.stderr, proc.stderr


@pytest.mark.parametrize("verb", VERBS)
def test_each_verb_has_help_exit_0(verb: str) -> None:
    proc = memtune(verb, "--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith(f"usage: memtune {verb}"), proc.stdout[:300]


@pytest.mark.parametrize("args", [[], ["nosuchverb"], ["--nosuchflag"]])
def test_no_verb_or_an_unknown_one_is_usage_on_stderr_exit_2(args: list[str]) -> None:
    proc = memtune(*args)
    assert proc.returncode == EXIT_CONFIG, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.startswith("usage: memtune")
    assert "Traceback" not in proc.stderr


def test_python_m_memtune_cli_is_the_same_command() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "memtune.cli", "report", "/nonexistent"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert_refused(proc, "report", "/nonexistent")


def test_the_preflight_module_the_launcher_starts_answers() -> None:
    # launcher.preflight.for_launch runs `python -m memtune.launcher.preflight` as its child.
    proc = subprocess.run(
        [sys.executable, "-m", "memtune.launcher.preflight", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "--gpus" in proc.stdout


def test_report_refuses_a_missing_sweep_dir() -> None:
    assert_refused(memtune("report", "/nonexistent"), "report", "/nonexistent")


def test_report_refuses_a_dir_without_sweep_points_and_writes_nothing(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine\n")
    before = tree(tmp_path)
    assert_refused(memtune("report", str(tmp_path)), "report", str(tmp_path))
    assert tree(tmp_path) == before and len(list(tmp_path.iterdir())) == 1


def test_generate_refuses_a_missing_run_dir() -> None:
    assert_refused(memtune("generate", "/nonexistent", "hi"), "generate", "/nonexistent")


def test_generate_refuses_a_run_dir_without_an_adapter(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text("{}\n")
    line = assert_refused(memtune("generate", str(tmp_path), "hi"), "generate", "adapter")
    assert "adapter_config.json" in line


def test_merge_refuses_a_missing_adapter_and_creates_nothing(tmp_path: Path) -> None:
    out = tmp_path / "OUT"
    assert_refused(memtune("merge", "/nonexistent", str(out)), "merge", "/nonexistent")
    assert list(tmp_path.iterdir()) == []


def test_merge_refuses_an_adapter_path_that_is_a_symlink_loop(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: Path.resolve's RuntimeError "Symlink loop from ..." (Python < 3.13), a traceback
    from reading the adapter's run before its path was checked."""
    loop = tmp_path / "adapter"
    loop.symlink_to(loop)
    line = refused_in_process(["merge", str(loop), str(tmp_path / "out")], capsys)
    assert line == f"memtune merge: {loop}: no such directory (give RUN_DIR/adapter)"
    assert [p.name for p in tmp_path.iterdir()] == ["adapter"]


LORA_CONFIG = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}


def _safetensors(path: Path) -> Path:
    """A whole safetensors file of one 4 × 4 fp32 tensor (written by safetensors itself)."""
    import numpy as np
    from safetensors.numpy import save_file

    save_file({"w": np.zeros((4, 4), dtype=np.float32)}, str(path))
    return path


def _adapter_dir(path: Path, base: str) -> Path:
    """An adapter memtune's checks take for whole (a LoRA config, its weights' file), naming
    ``base``: what peft would load, short of the tensors' names."""
    path.mkdir(parents=True)
    config = {**LORA_CONFIG, "base_model_name_or_path": base}
    (path / "adapter_config.json").write_text(json.dumps(config))
    _safetensors(path / "adapter_model.safetensors")
    return path


def refused_in_process(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """``memtune ARGV`` run in this process (memtune.cli.main): exit code 2 and one line on
    stderr; returns it."""
    from memtune.cli import main

    try:
        code = main(argv)
    except SystemExit as stop:  # argparse's refusals (memtune.arguments.VerbParser)
        code = stop.code  # type: ignore[assignment]
    err = capsys.readouterr().err
    assert code == EXIT_CONFIG, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def _truncate(path: Path, by: int) -> int:
    """Cut ``by`` bytes off the end of ``path`` (a copy stopped short); returns its new size."""
    size = path.stat().st_size - by
    with path.open("r+b") as f:
        f.truncate(size)
    return size


def test_a_damaged_adapter_is_one_line_naming_its_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """memtune merge and memtune generate share memtune.adapter_check: before, a config that
    is not JSON was a JSONDecodeError, truncated weights a SafetensorError from peft, missing
    weights huggingface_hub's "Repo id must be in the form ..." (tracebacks, exit 1)."""
    whole = "give an adapter saved whole (a run's RUN_DIR/adapter, or a checkpoint's adapter/)"
    bad_json = _adapter_dir(tmp_path / "bad-json", "/nonexistent-base")
    (bad_json / "adapter_config.json").write_text("{not json")
    truncated = _adapter_dir(tmp_path / "truncated", "/nonexistent-base")
    weights = truncated / "adapter_model.safetensors"
    full = weights.stat().st_size
    size = _truncate(weights, 10)
    no_weights = _adapter_dir(tmp_path / "no-weights", "/nonexistent-base")
    (no_weights / "adapter_model.safetensors").unlink()
    cases = {
        bad_json: f"{bad_json}/adapter_config.json is not valid JSON (Expecting property name "
        "enclosed in double quotes at line 1 column 2): damaged",
        truncated: f"{weights} is truncated: {size:,} bytes, its header says {full:,}",
        no_weights: f"{no_weights} has no adapter_model.safetensors (the adapter's weights): "
        "saved only in part",
    }
    for adapter, said in cases.items():
        line = refused_in_process(["merge", str(adapter), str(tmp_path / "out")], capsys)
        assert line == f"memtune merge: {said}; {whole}"
    assert not (tmp_path / "out").exists()
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("{}\n")
    truncated.rename(run / "adapter")
    line = refused_in_process(["generate", str(run), "hi"], capsys)
    assert line == (
        f"memtune generate: {run}/adapter/adapter_model.safetensors is truncated: {size:,} "
        f"bytes, its header says {full:,}; copy the run dir again, or merge one of its "
        "checkpoints' adapter/ (memtune merge) and give the merged model with --model"
    )


def test_a_damaged_config_yaml_beside_the_adapter_is_one_line_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """merge and generate read the run's config.yaml (how it trained): one cut short was
    yaml's ParserError traceback, exit 1."""
    run = tmp_path / "run"
    adapter = _adapter_dir(run / "adapter", "/nonexistent-base")
    (run / "config.yaml").write_text("trainer: [\n")
    for argv in (["merge", str(adapter), str(tmp_path / "out")], ["generate", str(run), "hi"]):
        line = refused_in_process(argv, capsys)
        assert line.startswith(f"memtune {argv[0]}: {run}/config.yaml is not valid YAML (while ")
        assert line.endswith("line 2, column 1): damaged")
    assert not (tmp_path / "out").exists()


def test_generate_refuses_a_model_whose_weights_are_cut_short(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """generate --model M where M/model.safetensors is truncated: before, SafetensorError."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("{}\n")
    model = tmp_path / "merged"
    model.mkdir()
    (model / "config.json").write_text("{}\n")
    weights = _safetensors(model / "model.safetensors")
    full = weights.stat().st_size
    size = _truncate(weights, 1)
    line = refused_in_process(["generate", str(run), "hi", "--model", str(model)], capsys)
    assert line == (
        f"memtune generate: {weights} is truncated: {size:,} bytes, its header says {full:,}; "
        "copy the model again, or merge it again (memtune merge)"
    )


def test_merge_names_a_base_path_that_does_not_exist(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: "base model /nope: cannot load it (Repo id must be in the form 'repo_name' ...",
    transformers taking the missing path for a hub name."""
    adapter = _adapter_dir(tmp_path / "adapter", "/nonexistent-base")
    line = refused_in_process(
        ["merge", str(adapter), str(tmp_path / "out"), "--base", "/nope", "--into", "original"],
        capsys,
    )
    assert line == (
        "memtune merge: base model /nope: no such directory; give --base a model directory "
        "saved with save_pretrained, or a hub name (Qwen/Qwen2.5-7B-Instruct)"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]  # no temporary left


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (
            ["generate", "/nonexistent", "hi", "--max-new-tokens", "-5"],
            "memtune generate: argument --max-new-tokens: must be a whole number > 0 (got -5)",
        ),
        (
            ["generate", "/nonexistent", "hi", "--max-new-tokens", "0"],
            "memtune generate: argument --max-new-tokens: must be a whole number > 0 (got 0)",
        ),
        (
            ["preflight", "--gpus", "-1"],
            "memtune preflight: argument --gpus: must be a whole number > 0 (got -1)",
        ),
        (
            ["preflight", "--gpus", "two"],
            "memtune preflight: argument --gpus: 'two' is not a whole number",
        ),
        (
            ["preflight", "--gpus", "1", "--timeout", "0"],
            "memtune preflight: argument --timeout: must be a number > 0 (got 0)",
        ),
    ],
)
def test_a_number_a_verb_cannot_use_is_one_line(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: --max-new-tokens -5 was transformers' ValueError traceback; preflight --gpus -1
    checked for "-1" GPUs and exited 0."""
    verb = argv[0]
    assert refused_in_process(argv, capsys) == f"{said}; see memtune {verb} --help"


def test_merge_refuses_an_existing_non_empty_out_and_leaves_it_untouched(tmp_path: Path) -> None:
    adapter = _adapter_dir(tmp_path / "run" / "adapter", "/nonexistent-base")
    out = tmp_path / "mine"
    (out / "sub").mkdir(parents=True)
    (out / "config.json").write_text('{"mine": true}\n')
    (out / "sub" / "weights.bin").write_bytes(bytes(range(256)))
    before = tree(out)
    line = assert_refused(memtune("merge", str(adapter), str(out)), "merge", str(out))
    assert "another OUT" in line  # says what to do
    assert tree(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "run"]  # no temporary left


def test_merge_refuses_out_that_is_a_file(tmp_path: Path) -> None:
    adapter = _adapter_dir(tmp_path / "adapter", "/nonexistent-base")
    out = tmp_path / "out.bin"
    out.write_bytes(b"mine")
    assert_refused(memtune("merge", str(adapter), str(out)), "merge", str(out))
    assert out.read_bytes() == b"mine"


def test_a_failed_merge_removes_its_temporary_dir_and_leaves_no_out(tmp_path: Path) -> None:
    # Past the path checks: the base model cannot be loaded (loads transformers, peft).
    adapter = _adapter_dir(tmp_path / "adapter", str(tmp_path / "no-such-base"))
    out = tmp_path / "merged"
    proc = memtune("merge", str(adapter), str(out), "--into", "original")
    assert_refused(proc, "merge", "no-such-base")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]


def test_merge_writes_into_a_new_dir_by_renaming_its_temporary(
    tiny_base: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_base), LoraConfig(r=2, target_modules=["q_proj"])
    )
    work = tmp_path / "work"
    model.save_pretrained(work / "adapter")
    out = work / "merged"
    out.mkdir()  # an empty dir is taken: nothing in it to overwrite
    # A full disk (ulimit -f here: EFBIG, as ENOSPC): one line naming OUT, nothing kept.
    # Before: safetensors' SafetensorError from save_pretrained, a traceback.
    import resource

    from memtune.config import ConfigError
    from memtune.tools.merge import merge

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, hard))  # Python ignores SIGXFSZ
    try:
        with pytest.raises(ConfigError) as err:
            # (no run's config.yaml beside this adapter: merged into the weights as stored)
            merge(work / "adapter", out, dtype="fp32", into="original")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert str(err.value) == (
        f"{out}: cannot write the merged model there (File too large); nothing was kept: free "
        "space, or give an OUT on a filesystem with room"
    )
    assert sorted(p.name for p in work.iterdir()) == ["adapter", "merged"] and not any(
        out.iterdir()
    )
    # Another merge filled OUT while this one ran (the last moment: just before the rename).
    # Before: "cannot put the merged model there ([Errno 39] Directory not empty:
    # '.merged.tmp-HOST-PID-XXXXXXXX' -> ...)", naming a dir removed by then.
    from memtune.tools import merge as merging

    follow_umask = merging.follow_umask

    def filled_meanwhile(path: Path) -> None:
        follow_umask(path)
        (out / "config.json").write_text("{}\n")

    monkeypatch.setattr(merging, "follow_umask", filled_meanwhile)
    with pytest.raises(ConfigError) as err:
        merge(work / "adapter", out, dtype="fp32", into="original")
    monkeypatch.undo()
    assert str(err.value) == (
        f"{out}: filled while this merge ran (another merge into it?): kept as it is, and this "
        "merge's model not kept; give another OUT"
    )
    assert [p.name for p in out.iterdir()] == ["config.json"]
    assert (out / "config.json").read_text() == "{}\n"
    assert sorted(p.name for p in work.iterdir()) == ["adapter", "merged"]  # no temporary left
    (out / "config.json").unlink()
    proc = memtune(
        "merge", str(work / "adapter"), str(out), "--dtype", "fp32", "--into", "original"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"merged model (fp32) written to {out}" in proc.stdout
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer_config.json"} <= names, names
    assert sorted(p.name for p in work.iterdir()) == ["adapter", "merged"]  # no temporary left
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask  # not mkdtemp's 0700
    merged = AutoModelForCausalLM.from_pretrained(out)  # a plain model: no LoRA left
    assert not any("lora_" in n for n, _ in merged.named_parameters())


TINY = {
    "model_type": "qwen2",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 1024,
    "max_position_embeddings": 128,
}


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 1-layer Qwen2 and its tokenizer (memtune.tools.tiny), built once here."""
    from memtune.tools.tiny import synthesize

    return synthesize(tmp_path_factory.mktemp("models") / "base", TINY)


def _tiny_run(run: Path, base: Path, *overrides: str) -> Path:
    """A run dir as a finished run leaves it, on ``base``: config.yaml (fp32, ``overrides``)
    and adapter/ (LoRA on q and v, initialized at random so that it changes the logits, and
    the tokenizer); returns ``run``."""
    import torch
    from omegaconf import OmegaConf
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from memtune.config import to_run_config
    from tests.conftest import compose_cfg

    cfg = to_run_config(
        compose_cfg(
            [
                f"model.name_or_path={base}",
                "model.synthesize=false",
                "trainer.precision=fp32",
                *overrides,
            ]
        )
    )
    cfg.model.architecture = dict(TINY)
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    torch.manual_seed(0)
    lora = LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(AutoModelForCausalLM.from_pretrained(base), lora).save_pretrained(
        run / "adapter"
    )
    AutoTokenizer.from_pretrained(base).save_pretrained(run / "adapter")
    return run


def test_merge_and_generate_hold_the_runs_rope_scaling(tiny_base: Path, tmp_path: Path) -> None:
    """A run with model.rope_scaling (YaRN) trained under it: merge loads the base with it, so
    the merged config.json carries it and the merged model's logits are base + adapter's under
    it; generate holds the base the same way. Before: both loaded the base with plain RoPE,
    and the merged config.json had none."""
    import torch
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    from memtune.tools.generate import load
    from memtune.tools.merge import merge

    yarn = "{type: yarn, factor: 4.0, original_max_position_embeddings: 32}"
    run = _tiny_run(tmp_path / "run", tiny_base, f"model.rope_scaling={yarn}")
    out = merge(run / "adapter", tmp_path / "merged")
    want = {
        "rope_theta": 10000.0,  # the checkpoint's own, kept
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    assert json.loads((out / "config.json").read_text())["rope_parameters"] == want

    def with_adapter(config: object = None) -> torch.nn.Module:
        base = AutoModelForCausalLM.from_pretrained(tiny_base, config=config)
        return PeftModel.from_pretrained(base, run / "adapter").eval()

    config = AutoConfig.from_pretrained(tiny_base)
    config.rope_parameters = dict(want)  # YaRN as transformers builds it, given whole
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    generating, _ = load(run)
    ids = torch.arange(3, 123).unsqueeze(0)  # past original_max_position_embeddings
    with torch.no_grad():
        expected = with_adapter(config)(input_ids=ids).logits
        got = merged(input_ids=ids).logits
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(generating(input_ids=ids).logits, expected)
        plain = with_adapter()(input_ids=ids).logits
    assert (got - plain)[0, 32:].abs().max() > 1e-2  # plain RoPE answers otherwise


def _ends_its_turn_at_once(run: Path, prompt: str) -> None:
    """Replace the run's adapter with LoRA on lm_head that makes <|im_end|> the first token the
    model answers ``prompt`` with: B·A adds to that token's logit the square of the base's last
    hidden state (made large)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from memtune.tools.generate import prompt_inputs

    adapter = run / "adapter"
    tokenizer = AutoTokenizer.from_pretrained(adapter)
    base = AutoModelForCausalLM.from_pretrained(
        json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    )
    ids = prompt_inputs(run, prompt, tokenizer)["input_ids"]
    with torch.no_grad():
        h = base(input_ids=ids, output_hidden_states=True).hidden_states[-1][0, -1]
    lora = LoraConfig(r=1, lora_alpha=1, target_modules=["lm_head"])
    model = get_peft_model(base, lora)
    head = model.base_model.model.lm_head
    with torch.no_grad():
        head.lora_A["default"].weight.copy_(h.unsqueeze(0))
        head.lora_B["default"].weight.zero_()
        head.lora_B["default"].weight[tokenizer.convert_tokens_to_ids("<|im_end|>"), 0] = 1e3
    shutil.rmtree(adapter)
    model.save_pretrained(adapter)
    tokenizer.save_pretrained(adapter)


def test_generate_says_when_the_answer_was_cut_at_max_new_tokens(
    tiny_base: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An answer stopped by --max-new-tokens before the model ended its turn is followed by one
    line on stderr naming the flag (before: nothing, the cut answer passed for the whole one);
    an answer that ended its turn on the limit's last token was not cut: no line."""
    from memtune.cli import main
    from memtune.tools.generate import answer, load, stop_token_ids

    run = _tiny_run(tmp_path / "run", tiny_base)
    model, tokenizer = load(run)
    text, new = answer(model, tokenizer, run, "Hi", max_new_tokens=3)
    assert len(new) == 3 and not set(new) & set(stop_token_ids(tokenizer))  # it goes on
    capsys.readouterr()  # (transformers' loading bars)
    assert main(["generate", str(run), "Hi", "--max-new-tokens", "3"]) == 0
    out, err = capsys.readouterr()
    assert out == f"{text}\n"
    assert err == (
        "memtune generate: the answer stopped at --max-new-tokens 3, before the model ended "
        "its turn; give a larger --max-new-tokens for the rest\n"
    )
    _ends_its_turn_at_once(run, "Hi")
    capsys.readouterr()
    assert main(["generate", str(run), "Hi", "--max-new-tokens", "1"]) == 0
    out, err = capsys.readouterr()
    assert (out, err) == ("(empty answer: the model ended its turn after 1 token(s))\n", "")


@pytest.mark.parametrize("template", ["chatml", "plain"])
def test_generate_system_is_a_records_own_system_prompt_as_training_lays_it_out(
    template: str, tiny_base: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--system TEXT: the prompt's tokens are those before the reply of a training record
    with its own system prompt TEXT (data.readers, data.encode), in place of the run's
    data.system_prompt; without it, those of a record without one (the run's). Before:
    generate rendered data.system_prompt only, and a run trained on per-record system prompts
    was asked under one it never saw."""
    from transformers import AutoTokenizer

    from memtune.cli import main
    from memtune.config import load_run_config
    from memtune.data.encode import IGNORE_INDEX, encode_records
    from memtune.data.readers import parse
    from memtune.tools.generate import answer, load, prompt_inputs

    run = _tiny_run(
        tmp_path / "run", tiny_base, f"data.template={template}", "data.system_prompt=Be brief."
    )
    data = load_run_config(run / "config.yaml").data
    tokenizer = AutoTokenizer.from_pretrained(run / "adapter")

    def trained_prompt(**system: str) -> list[int]:
        record = parse({"instruction": "Hi", "output": "Hello", **system}, "alpaca", "a:1")
        sample = encode_records([record], tokenizer, data)[0]
        reply = next(i for i, label in enumerate(sample.labels) if label != IGNORE_INDEX)
        return sample.input_ids[:reply]

    def prompt(system: str | None = None) -> list[int]:
        return prompt_inputs(run, "Hi", tokenizer, system=system)["input_ids"][0].tolist()

    own = trained_prompt(system="Answer in French.")
    assert prompt("Answer in French.") == own
    assert prompt() == trained_prompt() != own  # the run's data.system_prompt
    assert tokenizer.decode(own).startswith(
        "<|im_start|>system\nAnswer in French.<|im_end|>\n"
        if template == "chatml"
        else "Answer in French.\n\n"
    )
    model, _ = load(run)
    text, _ = answer(model, tokenizer, run, "Hi", max_new_tokens=3, system="Answer in French.")
    assert text != answer(model, tokenizer, run, "Hi", max_new_tokens=3)[0]
    capsys.readouterr()  # (transformers' loading bars)
    argv = ["generate", str(run), "Hi", "--system", "Answer in French.", "--max-new-tokens", "3"]
    assert main(argv) == 0
    assert capsys.readouterr().out == f"{text}\n"


@pytest.mark.parametrize("into", [[], ["--into", "dequantized"]])
def test_merge_refuses_an_adapter_whose_run_is_unknown_unless_into_original(
    into: list[str], tiny_base: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An adapter copied out of its run dir (no config.yaml beside it): how its run held the
    base is unknown, so it is not merged as if trained without quantization unless --into
    original says so. Before: trained_as found no run, load_base quantized nothing, and a
    QLoRA adapter's merge went into the original weights without a word (exit 0)."""
    run = _tiny_run(tmp_path / "run", tiny_base, "peft=qlora-nf4")
    copied = tmp_path / "copied" / "adapter"
    shutil.copytree(run / "adapter", copied)
    capsys.readouterr()  # (transformers' loading bars)
    out = tmp_path / "out"
    line = refused_in_process(["merge", str(copied), str(out), *into], capsys)
    assert line == (
        f"memtune merge: {copied}: no run's config.yaml beside it, so how its training held the "
        "base (unquantized, QLoRA or LLM.int8) is unknown: copy the run's config.yaml and "
        "decisions.json (what ran: plan.auto_fit may have chosen QLoRA) into "
        f"{copied.parent} to merge as trained, or give --into original to merge into the base's "
        "weights as stored (right for an adapter trained without quantization)"
    )
    assert not out.exists()


def test_generate_names_a_base_whose_weights_are_cut_short(
    tiny_base: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """generate RUN_DIR (no --model) checks the base the run's config.yaml names, as merge
    does: a truncated shard is one line naming it, exit 2 (before: safetensors'
    SafetensorError, a traceback), and a base that is not there one line naming it."""
    base = tmp_path / "base"
    shutil.copytree(tiny_base, base)
    run = _tiny_run(tmp_path / "run", base)
    weights = base / "model.safetensors"
    full = weights.stat().st_size
    size = _truncate(weights, 100)
    capsys.readouterr()  # (transformers' loading bars)
    hint = (
        "the run's config.yaml names that base (model.name_or_path): put the model the run "
        "trained on there, or give its merged model with --model"
    )
    line = refused_in_process(["generate", str(run), "hi"], capsys)
    assert line == (
        f"memtune generate: base model {weights} is truncated: {size:,} bytes, its header says "
        f"{full:,}; {hint}"
    )
    shutil.rmtree(base)
    line = refused_in_process(["generate", str(run), "hi"], capsys)
    assert line == f"memtune generate: base model {base}: no such directory; {hint}"


def test_plan_prints_train_py_plan_and_writes_nothing(tmp_path: Path) -> None:
    proc = memtune("plan", QWEN7B, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for row in ("base weights", "LoRA weights", "optimizer state", "activations"):
        assert row in proc.stdout
    assert "(the step's peak: " in proc.stdout  # the loss's row or the backward's says where
    assert "device 23.99 GiB per rank: fits" in proc.stdout
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("verb", ["plan", "trace"])
def test_a_bad_override_is_one_line(verb: str, tmp_path: Path) -> None:
    line = assert_refused(memtune(verb, "nosuchkey=1", cwd=tmp_path), verb, "nosuchkey")
    assert "nosuchkey is not a memtune setting" in line and "+nosuchkey" not in line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("launcher.num_ranks=0", "launcher.num_ranks must be > 0 (got 0)"),
        ("trainer.lr=-1", "trainer.lr must be > 0 (got -1.0)"),
    ],
)
def test_trace_validates_the_config_as_plan_does(
    override: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """memtune trace skipped validation: launcher.num_ranks=0 was a DecisionError traceback
    and trainer.lr=-1 was traced (exit 0) as if it could run."""
    from memtune.cli import main

    assert main(["trace", override]) == EXIT_CONFIG
    out, err = capsys.readouterr()
    assert err == f"memtune trace: {message}\n" and out == ""


def test_trace_says_what_it_does_not_trace_as_given(capsys: pytest.CaptureFixture[str]) -> None:
    """memtune trace traced a dpo run as sft, and decided for the machine it ran on (as plan
    does), without a word of either: the comparison read as the run's own."""
    from memtune.cli import main

    assert main(["trace", "trainer.objective=dpo", "data.max_seq_len=64"]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if "note: " in line]
    assert notes == [
        "  note: trainer.objective=dpo traced as sft (the row's cross-entropy, not dpo's pair "
        "log-probabilities: the plan's loss row is dpo's)",
        "  note: decided for this machine (no CUDA GPU: no FlashAttention-2, no Liger kernels), "
        "as memtune plan decides: a launch on another machine may decide other kernels and "
        "recomputed layers",
    ]


def test_machine_prints_the_machine_and_refuses_arguments() -> None:
    proc = memtune("machine")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("memtune: CPU ")
    proc = memtune("machine", "extra")
    assert proc.returncode == EXIT_CONFIG and "unrecognized arguments" in proc.stderr


def test_a_merge_is_in_the_precision_the_adapter_was_trained_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """memtune merge without --dtype: the run's trainer.precision (the fp32 CPU demo merged
    in bf16 answered a prompt differently from its adapter); bf16 for an adapter from
    elsewhere, even with a run's config.yaml folders above it; --dtype wins."""
    from omegaconf import OmegaConf

    from memtune.config import to_run_config
    from memtune.tools.merge import merged_dtype, trained_as
    from tests.conftest import compose_cfg

    run = tmp_path / "run"
    (run / "adapter").mkdir(parents=True)
    for precision in ("fp32", "bf16"):
        cfg = to_run_config(compose_cfg([f"trainer.precision={precision}"]))
        (run / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
        assert merged_dtype(trained_as(run / "adapter"), None) == precision
    assert merged_dtype(trained_as(run / "adapter"), "fp16") == "fp16"
    (tmp_path / "elsewhere").mkdir()
    assert merged_dtype(trained_as(tmp_path / "elsewhere"), None) == "bf16"
    # a copy under some other folder is not merged as the config.yaml above it says
    (run / "copies" / "adapter").mkdir(parents=True)
    assert trained_as(run / "copies" / "adapter") is None
    # a checkpoint's adapter: its own config.yaml, else its run's
    step = run / "checkpoints" / "step-0000002"
    (step / "adapter").mkdir(parents=True)
    assert merged_dtype(trained_as(step / "adapter"), None) == "bf16"  # the run's, as written
    fp32 = OmegaConf.to_yaml(
        OmegaConf.structured(to_run_config(compose_cfg(["trainer.precision=fp32"])))
    )
    (run / "config.yaml").write_text(fp32)
    monkeypatch.chdir(step.parent)  # given as step-0000002/adapter from checkpoints/
    assert merged_dtype(trained_as(Path(step.name) / "adapter"), None) == "fp32"
    (run / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))  # bf16
    (step / "config.yaml").write_text(fp32)
    assert merged_dtype(trained_as(step / "adapter"), None) == "fp32"


def test_a_run_on_plain_documents_generates_from_the_prompt_itself(
    tiny_base: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """memtune generate on a run on plain documents only (continued pre-training: no template
    in training) continues the prompt as given: data.format=text, or data.sources all of
    format text (before: their template was put on, data.format's default alpaca being read);
    a run with any source of conversations answers a template's turn (it learned to answer
    one), documents mixed in or not. --system on a documents run is refused: no system turn."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from memtune.config import to_run_config
    from memtune.tools.generate import prompt_text
    from tests.conftest import compose_cfg

    tokenizer = SimpleNamespace(eos_token="<|endoftext|>")  # all the template reads of it
    turn = "<|im_start|>user\nOnce upon a time<|im_end|>\n<|im_start|>assistant\n"
    text, chat = "{path: a.jsonl, format: text}", "{path: b.jsonl, format: alpaca}"
    for overrides, want in [
        (["data=text", "data.path=x.jsonl"], "Once upon a time"),
        (["data.path=null", f"data.sources=[{text}]"], "Once upon a time"),
        (["data.path=null", f"data.sources=[{text}, {text}]"], "Once upon a time"),
        ([], turn),
        (["data.path=null", f"data.sources=[{text}, {chat}]"], turn),
        (["data.path=null", f"data.sources=[{chat}, {text}]"], turn),
    ]:
        cfg = to_run_config(compose_cfg([*overrides, f"model.name_or_path={tiny_base}"]))
        (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
        assert prompt_text(tmp_path, "Once upon a time", tokenizer) == want, overrides
    documents = ["data=text", "data.path=x.jsonl", f"model.name_or_path={tiny_base}"]
    cfg = to_run_config(compose_cfg(documents))
    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    _adapter_dir(tmp_path / "adapter", str(tiny_base))
    line = refused_in_process(["generate", str(tmp_path), "Once", "--system", "Be brief."], capsys)
    assert line == (
        f"memtune generate: --system: {tmp_path} trained on plain documents only (every data "
        "source of format text), with no template and so no system turn: give the prompt "
        "alone, which the model continues"
    )
