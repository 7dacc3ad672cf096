"""train.py's command line checked before Hydra's main runs it: what Hydra would refuse while
composing — an experiment, a data or ZeRO group that does not exist, a value of the wrong type
— said on one line with exit code 2, as every other config error is. Hydra's main prints such
an error over twenty lines (its options, its search path, a hint about HYDRA_FULL_ERROR) and
exits 1, the code a failed sweep point or a rank's Python error has."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from memtune.config.schema import CONF_DIR, ConfigError, compose, unexpanded_home
from memtune.filesystem import cannot_write

ENUMERABLE = ("CHOICE_SWEEP", "SIMPLE_CHOICE_SWEEP", "RANGE_SWEEP")
"""The sweeps Hydra's basic sweeper expands into values (hydra's ValueType names): choices
(``a,b`` and ``choice(a,b)``) and ``range(...)``; an interval is a plugin's, a glob Hydra's."""


def one_line(err: BaseException) -> str:
    """Hydra's or OmegaConf's error on one line, with the first line of its cause (Hydra's
    says which key); Hydra's search path left out."""
    text = " ".join(str(err).split()).split(" Config search path:")[0]
    cause = str(err.__cause__ or "").strip()
    return f"{text} ({cause.splitlines()[0]})" if cause else text


def _one_dir_for_all(fixed: list[str]) -> str | None:
    """A sweep's hydra.sweep.subdir given without an interpolation: every point would train
    in the one dir (the second refused as a resume of the first, after the first trained)."""
    for override in fixed:
        key, _, value = override.partition("=")
        if key.lstrip("+") == "hydra.sweep.subdir" and "${" not in value:
            return (
                f"{override} gives every point of the sweep the same run dir; keep "
                "${hydra.job.num} in it (the default: 0, 1, ...), e.g. "
                "hydra.sweep.subdir=r-${hydra.job.num}"
            )
    return None


def _glob_values(override: Any, overrides: list[str]) -> list[str] | None:
    """What a glob() sweep expands to, as Hydra's sweeper expands it (the group's configs
    that match); None when another search path may hold more (``hydra.searchpath``)."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if any("hydra.searchpath" in o for o in overrides):
        return None
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        override.config_loader = GlobalHydra.instance().config_loader()
        return list(override.sweep_string_iterator())


def _sweep_dir_problem(fixed: list[str]) -> str | None:
    """hydra.sweep.dir where no folder can be made (its part before any interpolation): Hydra
    raised from its mkdir, a traceback."""
    value = next((o.partition("=")[2] for o in fixed if o.startswith("hydra.sweep.dir=")), None)
    literal = (value or "multirun").split("${", 1)[0]
    if not literal:
        return None  # all of it an interpolation Hydra resolves (${oc.env:SCRATCH}/...)
    problem = cannot_write(Path(literal))
    if problem is None:
        return None
    return f"hydra.sweep.dir={value or literal}: {problem}; give the sweep a folder it can write"


def composition_problem(argv: list[str], env: Mapping[str, str] | None = None) -> str | None:
    """What composing train.py's arguments refuses, on one line; None when they compose, or
    when they are not ours to check: ``--help``, ``--cfg``, ``--info``, another config, a
    sweeper plugin (``hydra/sweeper=``), or ``HYDRA_FULL_ERROR=1`` in ``env`` (default this
    process's), where Hydra's whole error is wanted. A sweep (``-m peft.r=4,8``) is composed at
    every value of each swept key, the other keys at their first: Hydra's sweeper composes
    every point before launching any. A sweep without ``-m`` is refused, as Hydra would (in
    six lines). A glob is expanded as Hydra expands it (one that matches nothing is refused),
    an interval is a sweeper plugin's (refused without one); Hydra's own settings and groups
    are composed with the rest, as Hydra composes them (``hydra.searchpath`` finds a user's
    experiments, ``hydra/launcher=slurm`` makes ``hydra.launcher.timeout_min`` a setting)."""
    from hydra._internal.utils import get_args_parser
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    env = os.environ if env is None else env
    if env.get("HYDRA_FULL_ERROR") == "1":
        return None
    try:
        args = get_args_parser().parse_args(argv)
    except SystemExit:  # argparse's own usage error: Hydra's main prints it
        return None
    asks = (args.help, args.hydra_help, args.cfg, args.info, args.shell_completion)
    other = (args.config_path, args.config_name, args.config_dir, args.experimental_rerun)
    if any(asks) or any(other):
        return None
    for arg in args.overrides:
        if problem := unexpanded_home(arg):
            return problem
    try:
        fixed: list[str] = []
        swept: list[list[str]] = []  # each swept key's overrides, one a value
        parsed = OverridesParser.create().parse_overrides(args.overrides)
        if any(o.key_or_group == "hydra/sweeper" for o in parsed):
            return None  # a plugin's sweep syntax, wherever it is named
        for o in parsed:
            if not o.is_sweep_override():
                fixed.append(str(o.input_line))
            elif not args.multirun:
                return (
                    f"{o.input_line} gives several values, a sweep: add -m (--multirun) to "
                    "run one job for each, or give one value"
                )
            elif o.value_type is not None and o.value_type.name in ENUMERABLE:
                key = o.get_key_element()
                swept.append([f"{key}={value}" for value in o.sweep_string_iterator()])
            elif o.is_interval_sweep():  # Hydra's basic sweeper raised it from the sweep
                return (
                    f"{o.input_line}: an interval is for a sweeper plugin (hydra/sweeper=...); "
                    "Hydra's basic sweeper takes values: a,b or choice(a,b) or range(start,stop)"
                )
            elif o.value_type is not None and o.value_type.name == "GLOB_CHOICE_SWEEP":
                values = _glob_values(o, args.overrides)
                if values is None:
                    continue  # another search path may hold its matches: Hydra expands it
                if not values:
                    return (
                        f"{o.input_line} matches no config of the group {o.key_or_group}: the "
                        "sweep would run no point (a glob selects a group's configs, "
                        "experiment=glob(qwen3*); a setting's values are listed: a,b)"
                    )
                swept.append([f"{o.get_key_element()}={value}" for value in values])
        points = math.prod(len(values) for values in swept)
        if args.multirun and points > 1 and (problem := _one_dir_for_all(fixed)):
            return problem
        if args.multirun and (problem := _sweep_dir_problem(fixed)):
            return problem
        firsts = [values[0] for values in swept]
        cfg = compose([*fixed, *firsts])
        if args.multirun and OmegaConf.select(cfg, "run_dir", throw_on_resolution_failure=False):
            # before Hydra starts the sweep (it laid out its dir and a first point's first)
            return (
                "run_dir cannot be set in a sweep (-m): every point needs its own dir; set "
                "hydra.sweep.dir instead"
            )
        for i, values in enumerate(swept):
            for value in values[1:]:
                compose([*fixed, *firsts[:i], value, *firsts[i + 1 :]])
    except (ConfigError, HydraException, OmegaConfBaseException) as err:
        return one_line(err)
    # Hydra makes it before memtune's code runs; an interpolation Hydra resolves only then
    # (${hydra:job.name}, ${oc.env:...}) is left to it
    run_dir = OmegaConf.select(cfg, "run_dir", throw_on_resolution_failure=False)
    problem = cannot_write(Path(str(run_dir))) if run_dir else None
    if problem:
        return f"run_dir={run_dir}: {problem}; give the run a folder memtune can write"
    return None
