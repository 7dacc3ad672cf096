"""train.py's command line checked before Hydra's main runs it: what Hydra would refuse while
composing — an experiment, a data or ZeRO group that does not exist, a value of the wrong type
— said on one line with exit code 2, as every other config error is. Hydra's main prints such
an error over twenty lines (its options, its search path, a hint about HYDRA_FULL_ERROR) and
exits 1, the code a failed sweep point or a rank's Python error has."""

from __future__ import annotations

from memtune.config.schema import ConfigError, compose


def one_line(err: BaseException) -> str:
    """Hydra's or OmegaConf's error on one line, with the first line of its cause (Hydra's
    says which key); Hydra's search path left out."""
    text = " ".join(str(err).split()).split(" Config search path:")[0]
    cause = str(err.__cause__ or "").strip()
    return f"{text} ({cause.splitlines()[0]})" if cause else text


def composition_problem(argv: list[str]) -> str | None:
    """What composing train.py's arguments refuses, on one line; None when they compose (or are
    not ours to check: ``--help``, ``--cfg``, ``--info``, another config, Hydra's own keys). A
    sweep (``-m peft.r=4,8``) is composed at its first point; a glob over a group is left to
    Hydra."""
    from hydra._internal.utils import get_args_parser
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ValueType
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        args = get_args_parser().parse_args(argv)
    except SystemExit:  # argparse's own usage error: Hydra's main prints it
        return None
    asks = (args.help, args.hydra_help, args.cfg, args.info, args.shell_completion)
    other = (args.config_path, args.config_name, args.config_dir, args.experimental_rerun)
    if any(asks) or any(other):
        return None
    try:
        point = []
        for o in OverridesParser.create().parse_overrides(args.overrides):
            if o.key_or_group.startswith("hydra"):
                continue  # Hydra's own settings and launcher: Hydra checks them
            if not o.is_sweep_override():
                point.append(str(o.input_line))
            elif o.value_type != ValueType.GLOB_CHOICE_SWEEP:
                first = next(iter(o.sweep_string_iterator()))
                point.append(f"{o.get_key_element()}={first}")
        compose(point)
    except (ConfigError, HydraException, OmegaConfBaseException) as err:
        return one_line(err)
    return None
