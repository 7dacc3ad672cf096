"""Optimizer choices: 8-bit AdamW really keeps 8-bit state; CPU Adam (offload) equals AdamW."""

from __future__ import annotations

import json
from pathlib import Path

import bitsandbytes as bnb
import pytest
import torch

from tests.conftest import Run, _finished


@pytest.mark.parametrize(("min_size", "state_dtype"), [(4096, torch.float32), (0, torch.uint8)])
def test_small_tensors_keep_32bit_state_unless_the_minimum_is_lowered(min_size, state_dtype):
    p = torch.nn.Parameter(torch.randn(16, 64))  # 1,024 elements, a tiny model's LoRA A
    opt = bnb.optim.AdamW8bit([p], lr=1e-3, min_8bit_size=min_size)
    p.grad = torch.randn_like(p)
    opt.step()
    assert opt.state[p]["state1"].dtype == state_dtype


def test_adamw_8bit_trains_with_8bit_state_on_two_ranks(adamw8bit_run: Run) -> None:
    run = adamw8bit_run
    ds = json.loads((run.dir / "ds_config.json").read_text())
    assert ds["zero_allow_untested_optimizer"] is True
    for probe in run.probes():
        assert probe["optimizer"] == "AdamW8bit"  # not paged: this is a CPU
        assert "torch.uint8" in probe["optimizer_state_dtypes"]
        assert probe["base_changed"] == [] and probe["lora_b_all_zero"] == []
    losses = run.losses()
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5, losses


def test_a_resume_with_another_8bit_minimum_size_is_refused(adamw8bit_run: Run) -> None:
    """The saved moments are 8-bit or fp32 by trainer.optim_8bit_min_size: a resume with
    another is refused by name before launch (an adamw run's checkpoint ignores it)."""
    import dataclasses

    from memtune.checkpoints import find_latest
    from memtune.config import ConfigError
    from memtune.launcher.prepare import resolve_resume
    from memtune.rundir import RunDir

    run = adamw8bit_run
    ckpt, _ = find_latest(RunDir(run.dir).checkpoints)
    assert ckpt is not None and run.decisions is not None
    trainer = dataclasses.replace(run.cfg.trainer, optim_8bit_min_size=4096)
    cfg = dataclasses.replace(run.cfg, trainer=trainer, resume=str(ckpt))
    data_dir = Path(json.loads((ckpt / "trainer_state.json").read_text())["data_dir"])
    with pytest.raises(ConfigError, match=r"trainer\.optim_8bit_min_size: checkpoint 0, now 4096"):
        resolve_resume(cfg, run.decisions, RunDir(run.dir), data_dir)


def test_cpu_adam_offload_matches_adamw(zero2_run: Run, runs_root) -> None:
    run = _finished(
        runs_root, "cpu_adam", "zero=zero2", "launcher.num_ranks=2", "trainer.optimizer=cpu_adam"
    )
    ds = json.loads((run.dir / "ds_config.json").read_text())
    assert ds["optimizer"]["type"] == "AdamW"
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert {p["optimizer"] for p in run.probes()} == {"DeepSpeedCPUAdam"}
    # Same maths as torch AdamW (fp32): the same loss curve as the zero2 fixture.
    assert run.losses() == pytest.approx(zero2_run.losses(), rel=1e-4)


def test_a_resume_takes_this_runs_weight_decay_not_the_saved_one() -> None:
    """The engine files restore each parameter group as saved (torch's load_state_dict, which
    DeepSpeed's ZeRO optimizers call on a resume on the same ranks), weight decay included:
    trainer.weight_decay changed on a resume was dropped there, and taken on another number of
    ranks. follow_schedule, which every resume calls, sets this run's rate and weight decay."""
    from types import SimpleNamespace

    from memtune.config import to_run_config
    from memtune.rank.checkpoint import follow_schedule
    from memtune.rank.optim import build_optimizer, scheduler_factory
    from tests.conftest import compose_cfg

    def engine(weight_decay: float) -> SimpleNamespace:
        cfg = to_run_config(compose_cfg([f"trainer.weight_decay={weight_decay}"]))
        groups = [{"params": [torch.nn.Parameter(torch.ones(4))], "lr_ratio": 1.0}]
        opt, _ = build_optimizer(cfg, "adamw", groups, torch.device("cpu"))
        return SimpleNamespace(optimizer=opt, lr_scheduler=scheduler_factory(cfg)(opt))

    saved, resumed = engine(0.0), engine(0.1)
    resumed.optimizer.load_state_dict(saved.optimizer.state_dict())
    resumed.lr_scheduler.load_state_dict(saved.lr_scheduler.state_dict())
    assert resumed.optimizer.param_groups[0]["weight_decay"] == 0.0  # as saved
    follow_schedule(resumed, 2e-4, 0.1)
    assert resumed.optimizer.param_groups[0]["weight_decay"] == 0.1
