"""Every shipped experiment composes and validates; bad settings fail naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

from memtune.config import ConfigError, to_run_config, validate
from tests.conftest import ROOT, compose_cfg, decided

EXPERIMENTS = sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml"))


def test_experiments_are_shipped() -> None:
    assert {"demo-cpu", "qwen2.5-7b-4x4090-lora", "qwen2.5-7b-4x4090-qlora"} <= set(EXPERIMENTS)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes(experiment: str) -> None:
    from memtune.launcher.prepare import decide

    data = "data.path=books.jsonl" if experiment.endswith("-long") else "data=demo"
    if "-dpo" in experiment:  # a preference objective reads preference pairs
        data = "data=demo-preference"
    cfg = to_run_config(compose_cfg([f"experiment={experiment}", data]))
    assert cfg.experiment == experiment
    validate(cfg, inputs=not experiment.endswith("-long"))
    # ... and is planned offline (the meta-device model of its architecture) and fits.
    fitted = decide(cfg, refuse=False)
    assert fitted.plan.total_gib > 0 and fitted.plan.fits and fitted.changes == []


def test_default_is_the_cpu_demo() -> None:
    cfg = to_run_config(compose_cfg())
    validate(cfg)
    assert cfg.experiment == "demo-cpu"
    assert (cfg.launcher.num_ranks, cfg.zero.stage) == (2, 3)
    assert cfg.model.synthesize and cfg.model.architecture["num_key_value_heads"] == 2
    assert Path(cfg.data.path).is_file()


def test_4x4090_experiment_values() -> None:
    cfg = to_run_config(compose_cfg(["experiment=qwen2.5-7b-4x4090-lora"]))
    # A real run has no default data: the demo set would silently train a 7B model on toys.
    with pytest.raises(ConfigError, match=r"data.path is not set: give your file"):
        validate(cfg)
    validate(cfg, inputs=False)  # what a memory plan needs
    assert cfg.model.name_or_path == "Qwen/Qwen2.5-7B-Instruct"
    assert cfg.model.architecture["hidden_size"] == 3584
    assert cfg.launcher.num_ranks == 4 and cfg.zero.stage == 2  # the faster stage that fits
    assert cfg.trainer.precision == "bf16"
    assert decided(cfg).batch.accumulation == 32 // (1 * 4)


def test_command_line_wins_over_experiment() -> None:
    cfg = to_run_config(compose_cfg(["peft.r=4", "zero=zero2", "trainer.max_steps=7"]))
    assert (cfg.peft.r, cfg.zero.stage, cfg.trainer.max_steps) == (4, 2, 7)


def test_a_mapping_on_the_command_line_where_none_is_set() -> None:
    """model.rope_scaling as the positions error advises it, typed on the command line: it
    used to end in an OmegaConf traceback (a mapping merged into null); and over an
    experiment's own, the keys given win."""
    yarn = "{type: yarn, factor: 8.0, original_max_position_embeddings: 32768}"
    cfg = to_run_config(
        compose_cfg(["experiment=qwen2.5-7b-4x4090-qlora", f"model.rope_scaling={yarn}"])
    )
    assert cfg.model.rope_scaling == {
        "type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 32768,
    }
    assert not to_run_config(compose_cfg(["experiment=qwen2.5-7b-4x4090-qlora"])).model.rope_scaling
    long = ["experiment=qwen2.5-7b-4x4090-long", "model.rope_scaling={factor: 2.0}"]
    assert to_run_config(compose_cfg(long)).model.rope_scaling["factor"] == 2.0


@pytest.mark.parametrize(
    ("override", "said"),
    [
        ("model.not_a_field=1", "model.not_a_field is not a memtune setting"),
        ("trainer.lrr=0.1", "trainer.lrr is not a memtune setting: did you mean trainer.lr or"),
        (
            "peft.lora_r=8",
            "peft.lora_r is not a memtune setting: memtune's name for it is peft.r (",
        ),
        (
            "trainer.learning_rate=1e-4",
            "learning_rate is not a memtune setting: memtune's name for it is trainer.lr (",
        ),
        (
            "data.cutoff_len=512",
            "data.cutoff_len is not a memtune setting: memtune's name for it is data.max_seq_len (",
        ),
        ("trainer.max_step=2", "did you mean trainer.max_steps or"),
        (
            "trainer.num_train_epochs=3",
            "trainer.num_train_epochs is not a memtune setting: none: memtune counts "
            "trainer.max_steps (",
        ),
    ],
)
def test_unknown_key_fails_at_compose_with_the_settings_it_may_mean(
    override: str, said: str
) -> None:
    """Before Hydra, whose own refusal advises appending the key (+key=...), which memtune
    then refuses too."""
    with pytest.raises(ConfigError) as err:
        compose_cfg([override])
    assert said in str(err.value) and "+" not in str(err.value)


def test_wrong_type_fails_at_compose() -> None:
    with pytest.raises((ConfigCompositionException, ValidationError)) as err:
        compose_cfg(["peft.r=eight"])
    assert "peft.r" in str(err.value) + str(err.value.__cause__)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["zero.stage=4"], r"zero\.stage=4 is not supported"),
        (["peft.r=0"], r"peft\.r must be > 0"),
        (["peft.dropout=1.5"], r"peft\.dropout"),
        (
            ["trainer.micro_batch_size=3", "trainer.global_batch_size=16"],
            r"trainer\.global_batch_size=16 is not a multiple of .* 3 × 2 = 6",
        ),
        (["trainer.precision=fp16"], r"trainer\.precision='fp16'"),
        (["peft.target=everything"], r"peft\.target"),
        (["data.path=/nonexistent/train.jsonl"], r"data\.path=.*no such file"),
        # relative typos were asked of the hub: ~30 s of retries, then a traceback
        (["data.path=data/trian.jsonl"], r"^data\.path='data/trian\.jsonl': no such file"),
        (["data.path=trian.parquet"], r"^data\.path='trian\.parquet': no such file"),
        (["data.path=data/sub/train"], r"^data\.path='data/sub/train': no such file"),
        (["launcher.num_ranks=0"], r"launcher\.num_ranks must be > 0"),
        (
            ["model=qwen2.5-7b", "model.name_or_path=/nonexistent/Qwen2.5-7B"],
            r"model\.name_or_path='/nonexistent/Qwen2\.5-7B': no config\.json",
        ),
    ],
)
def test_bad_values_name_the_field(overrides: list[str], message: str) -> None:
    cfg = to_run_config(compose_cfg(overrides))
    with pytest.raises(ConfigError, match=message):
        validate(cfg)


def test_data_sources_from_the_command_line(tmp_path: Path) -> None:
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text('{"instruction": "q", "output": "a"}\n')
    b.write_text(
        '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}\n'
    )
    cfg = to_run_config(
        compose_cfg(
            [
                "data=mix",
                f"data.sources=[{{path: {a}, weight: 2.0}}, {{path: {b}, format: messages}}]",
            ]
        )
    )
    validate(cfg)
    sources = cfg.data.all_sources()
    assert [(s.path, s.format, s.weight) for s in sources] == [
        (str(a), "alpaca", 2.0),
        (str(b), "messages", 1.0),
    ]
    cfg.data.path = str(a)
    with pytest.raises(ConfigError, match=r"data\.path and data\.sources are both set"):
        validate(cfg)


def test_one_rank_runs_zero2_instead_of_zero3(capsys) -> None:
    from memtune.config import one_rank_stage
    from memtune.launcher.prepare import decide

    def stage(*overrides: str) -> int:
        return one_rank_stage(to_run_config(compose_cfg(["zero=zero3", *overrides])))

    assert stage("launcher.num_ranks=1") == 2
    # The job says so when it decides (config.derive only derives).
    fitted = decide(to_run_config(compose_cfg(["zero=zero3", "launcher.num_ranks=1"])))
    assert "ZeRO-2 instead of ZeRO-3" in capsys.readouterr().out
    assert fitted.decisions.zero_stage == 2 and fitted.cfg.zero.stage == 3
    assert stage("launcher.num_ranks=2") == 3
    assert stage("launcher.num_ranks=1", "zero.one_rank_stage2=false") == 3
    assert stage("launcher.num_ranks=1", "zero=zero3-offload") == 3  # offload needs ZeRO-3


CHOICE_FIELDS = {
    "model.architecture_source": "auto | checkpoint",
    "model.attn_implementation": (
        "auto | sdpa_varlen | sdpa | eager | flash_attention_2 | torch_varlen"
    ),
    "data.format": "alpaca | messages | text | preference",
    "data.template": "chatml | plain | qwen3 | qwen3_5",
    "data.overlong": "truncate | drop | split",
    "data.on_bad_record": "error | skip",
    "peft.method": "lora | qlora | lora-int8",
    "peft.target": (
        "attention | all-linear | all-linear-but-experts | attention-and-vision | "
        "all-linear-and-vision"
    ),
    "peft.quant_type": "nf4 | fp4",
    "trainer.precision": "bf16 | fp32",
    "trainer.tiled_mlp": "auto | on | off",
    "trainer.offload_activations": "auto | on | off",
    "trainer.optimizer": "adamw | adamw_8bit | cpu_adam",
    "trainer.loss": "auto | chunked | plain | liger",
    "trainer.rms_norm_kernel": "auto | torch | lean | liger",
    "trainer.swiglu_kernel": "auto | torch | lean | liger",
    "trainer.rope_kernel": "auto | torch | liger",
    "trainer.on_nonfinite": "stop | skip",
    "logger.backend": "wandb | none",
    "logger.mode": "offline | online | auto",
}


@pytest.mark.parametrize("key", sorted(CHOICE_FIELDS))
def test_every_choice_field_refuses_a_value_outside_its_literal(key: str) -> None:
    """The schema's Literal is the one list of a choice field's values: a value outside it
    composes (Hydra sees str) and is refused before launch, listing the values it allows."""
    cfg = to_run_config(compose_cfg([f"{key}=bogus"]))
    with pytest.raises(ConfigError) as err:
        validate(cfg, inputs=False)
    assert str(err.value) == f"{key}='bogus' is not supported; choose {CHOICE_FIELDS[key]}"


def test_every_other_tools_name_is_in_the_configuration_page() -> None:
    """docs/configuration.md's table of LLaMA-Factory's, axolotl's and transformers' names
    lists every one the refusal knows (config.schema.OTHER_TOOLS_NAMES)."""
    from memtune.config.schema import OTHER_TOOLS_NAMES
    from tests.conftest import ROOT

    text = (ROOT / "docs" / "configuration.md").read_text()
    table = text.split("### Coming from LLaMA-Factory")[1].split("\n## ")[0]
    assert [name for name in OTHER_TOOLS_NAMES if f"`{name}`" not in table] == []
