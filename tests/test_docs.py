"""The documentation against what it documents: every command it shows, its generated pages,
and the site's build. A renamed key, group, make target or verb fails here, not for a reader.

Checked, in README.md and every page under docs/ (the generated list of refusals aside: its
messages are the source's own):
- each ``python train.py ...``, ``memtune VERB ...`` and ``make TARGET ...`` line of a ```bash
  block, and each inline code span that is such a command: the overrides compose with Hydra
  against conf/ into the typed schema (``make ... ARGS="..."`` and ``EXP=`` included; a
  multirun's sweep ``a,b`` is composed value by value); make targets and variables exist in
  the Makefile; memtune verbs and their ``--options`` exist (the verb's ``--help``);
- each inline span that is one override (``trainer.sequence_parallel=4``, ``peft=qlora-nf4``):
  its key is a setting, or its group ships that option;
- each ```text block of ``make plan``'s output (and README's table of the shipped plans): what
  the command prints now.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import ROOT

GROUPS = tuple(sorted(p.name for p in (ROOT / "conf").iterdir() if p.is_dir()))
INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
ONE_OVERRIDE = re.compile(r"^\+{0,2}[a-z_]+(\.[\w\[\]-]+)+=\S*$")


def documents() -> list[Path]:
    pages = sorted((ROOT / "docs").rglob("*.md"))
    return [ROOT / "README.md", *(p for p in pages if p.name != "refusals.md")]


@dataclass(frozen=True)
class Command:
    where: str  # file:line
    text: str


def commands(text: str, name: str) -> tuple[list[Command], list[Command]]:
    """(the commands of a markdown text's shell blocks and inline spans, its inline single
    overrides), each with its file and line."""
    found, overrides = [], []
    lines = text.splitlines()
    fence: tuple[int, str] | None = None  # (backticks, language) of the open fence
    i = 0
    while i < len(lines):
        line, number = lines[i], i + 1
        i += 1
        opening = re.match(r"^\s*(`{3,}|~{3,})\s*(\w*)", line)
        if fence is None and opening:
            fence = (len(opening.group(1)), opening.group(2))
            continue
        if fence is not None:
            if re.match(rf"^\s*(`{{{fence[0]},}}|~{{{fence[0]},}})\s*$", line):
                fence = None
                continue
            if fence[1] not in ("bash", "sh", "shell", "console"):
                continue
            while line.rstrip().endswith("\\") and i < len(lines):
                line = line.rstrip()[:-1] + " " + lines[i]
                i += 1
            for part in re.split(r"\s(?:&&|\|\||;|\|)\s", line):
                if _is_ours(part):
                    found.append(Command(f"{name}:{number}", part.strip()))
            continue
        for m in INLINE.finditer(line):
            span = m.group(1).strip()
            if _is_ours(span):
                found.append(Command(f"{name}:{number}", span))
            elif ONE_OVERRIDE.match(span) or re.match(rf"^({'|'.join(GROUPS)})=[\w.\-]+$", span):
                overrides.append(Command(f"{name}:{number}", span))
    return found, overrides


def _is_ours(line: str) -> bool:
    words = _words(line)
    return bool(words) and (
        words[0] in ("memtune", "make") or "train.py" in words[:3] or words[:1] == ["srun"]
    )


def _words(line: str) -> list[str]:
    try:
        words = shlex.split(line, comments=True)
    except ValueError:
        return []
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):  # VAR=value before a command
        words.pop(0)
    return words


@functools.cache
def _make_targets() -> tuple[set[str], set[str]]:
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][\w-]*):", makefile, re.M))
    variables = set(re.findall(r"\$\((\w+)\)", makefile))
    return targets, variables


@functools.cache
def _verb_help(verb: str) -> str | None:
    """``memtune VERB --help``'s text, None if there is no such verb."""
    out = subprocess.run(
        [sys.executable, "-m", "memtune.cli", verb, "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return out.stdout if out.returncode == 0 else None


@contextlib.contextmanager
def hydra() -> Iterator[None]:
    """Hydra initialized on conf/ once for many compositions (memtune.config.compose
    initializes it for each: ~0.2 s a command)."""
    from hydra import initialize_config_dir

    from memtune.config.schema import register_configs
    from memtune.paths import CONF_DIR

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        yield


ELIDED = ("...", "…")
"""``...`` for more overrides, ``key=...`` for a value left to the reader: its key is checked."""
PLACEHOLDER = re.compile(r"^[A-Z][A-Z_]*$")
"""``data.max_seq_len=N``, ``launcher.node_rank=RANK``: a value for the reader; the key is
checked."""
WRONG_ON_PURPOSE = {"trainer.max_step=2"}
"""Overrides the documentation shows as mistakes (with the refusal they get)."""


def _elided(override: str) -> bool:
    value = override.partition("=")[2]
    return value in ELIDED or bool(PLACEHOLDER.match(value))


@functools.cache
def _composed(groups: tuple[str, ...]) -> object:
    """Hydra's composition of these group choices (``experiment=...``, ``model=...``): ~0.4 s
    each, so once per combination; the leaf overrides are applied to a copy."""
    from hydra import compose

    return compose(config_name="config", overrides=list(groups))


def _compose(overrides: list[str]) -> str | None:
    """None when the overrides compose into the schema (inside :func:`hydra`), else why not.
    ``...`` stands for more overrides; ``key=...`` for a value: its key is checked.

    The group choices are composed by Hydra, the other overrides applied to that config by
    Hydra's own code for the command line's overrides, as train.py gets them."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    from memtune.config.schema import open_mappings, unknown_override

    keep = [
        o[1:-1] if o.startswith("[") and o.endswith("]") else o  # [optional=value]
        for o in overrides
        if o not in ELIDED and not o.startswith("hydra.")
    ]
    for o in [o for o in keep if _elided(o)]:
        if why := unknown_override([o]):
            return why
        keep.remove(o)
    sweep = re.compile(r"^([^=]+)=([^{\[]*,.*)$")
    first = [
        m.group(1) + "=" + m.group(2).split(",")[0] if (m := sweep.match(o)) else o for o in keep
    ]
    tries = [first]
    for i, o in enumerate(keep):  # a multirun's a,b,c: each value in turn, the others first
        if m := sweep.match(o):
            tries += [
                [*first[:i], f"{m.group(1)}={v}", *first[i + 1 :]] for v in m.group(2).split(",")
            ]
    for attempt in tries:
        try:
            if why := unknown_override(attempt):
                return why
            parsed = OverridesParser.create().parse_overrides(open_mappings(attempt))
            groups = [
                o.input_line for o in parsed if o.key_or_group in GROUPS or "/" in o.key_or_group
            ]
            cfg = copy.deepcopy(_composed(tuple(groups)))
            leaves = [o for o in parsed if o.input_line not in groups]
            ConfigLoaderImpl._apply_overrides_to_config(leaves, cfg)
            if missing := OmegaConf.missing_keys(cfg):
                return f"{' '.join(attempt)}: no value for {sorted(missing)}"
        except Exception as err:
            return f"{' '.join(attempt)}: {type(err).__name__}: {str(err).splitlines()[0]}"
    return None


def check(command: Command) -> str | None:
    """Why a documented command would not run as shown, or None."""
    words = _words(command.text)
    if words[0] == "make":
        targets, variables = _make_targets()
        overrides: list[str] = []
        named = [w for w in words[1:] if "=" not in w and not w.startswith("-")]
        for target in named:
            if target not in targets:
                return f"make {target}: no such target"
        for assignment in (w for w in words[1:] if "=" in w):
            var, _, value = assignment.partition("=")
            if var not in variables:
                return f"make {var}=: the Makefile has no {var}"
            if var == "ARGS" and (not named or named[0] in ("train", "plan", "preprocess")):
                overrides += shlex.split(value)
            elif var == "EXP":
                overrides.append(f"experiment={value}")
        return _compose(overrides) if overrides else None
    if words[0] == "memtune":
        if len(words) < 2 or words[1].startswith("-"):
            return None
        verb, args = words[1], words[2:]
        if not re.match(r"^[a-z][a-z-]*$", verb):
            return None  # a pattern (memtune VERB: ...), not a command
        help_text = _verb_help(verb)
        if help_text is None:
            return f"memtune {verb}: no such verb"
        for option in (a.split("=")[0] for a in args if a.startswith("--")):
            if not re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", help_text):
                return f"memtune {verb} {option}: not an option of the verb"
        if verb in ("plan", "trace"):
            return _compose([a for a in args if "=" in a and not a.startswith("-")])
        return None
    if "train.py" in words:
        args = words[words.index("train.py") + 1 :]
        return _compose([a for a in args if not a.startswith("-")])
    return None


def check_override(override: Command) -> str | None:
    from memtune.config.schema import unknown_override

    if override.text in WRONG_ON_PURPOSE:
        return None
    key, _, value = override.text.lstrip("+").partition("=")
    if _elided(override.text):
        return unknown_override([f"{key}=x"]) if key not in GROUPS else None
    if key in GROUPS:
        if not (ROOT / "conf" / key / f"{value}.yaml").exists():
            return f"{override.text}: conf/{key}/ has no {value}.yaml"
        return None
    return unknown_override([f"{key}={value}"])


def _all() -> tuple[list[Command], list[Command]]:
    found: list[Command] = []
    overrides: list[Command] = []
    for path in documents():
        c, o = commands(path.read_text(), str(path.relative_to(ROOT)))
        found += c
        overrides += o
    return found, overrides


def test_every_documented_command_composes() -> None:
    found, _ = _all()
    assert len(found) > 50, "the command extraction found almost nothing"
    with hydra():
        problems = [f"{c.where}: {c.text}\n    {why}" for c in found if (why := check(c))]
    assert not problems, "\n".join(problems)


def test_every_documented_override_names_a_setting() -> None:
    _, overrides = _all()
    assert len(overrides) > 50
    problems = [f"{o.where}: {why}" for o in overrides if (why := check_override(o))]
    assert not problems, "\n".join(problems)


def test_the_checks_catch_a_renamed_key_group_target_and_verb() -> None:
    """The checker itself can fail: a page with one mistake of each kind."""
    page = "\n".join(
        [
            "```bash",
            "python train.py experiment=qwen2.5-7b-4x4090-lora peft.rank=32",
            'make train ARGS="model=tiny-qwen3 trainer.max_step=5"',
            "make plan EXP=qwen2.5-7b-4x4090-lorax",
            "make trian",
            "memtune plot RUN_DIR",
            "memtune merge RUN_DIR/adapter OUT --dtyp fp32",
            "python train.py -m peft.r=8,16,3x",
            "```",
            "Set `trainer.sequence_paralel=4` or `peft=qlora-nf5`.",
        ]
    )
    found, overrides = commands(page, "page.md")
    with hydra():
        assert [bool(check(c)) for c in found] == [True] * 7, [(c.text, check(c)) for c in found]
        good = commands("```bash\nmake plan EXP=qwen2.5-7b-4x4090-lora\n```\n`peft.r=8`", "ok.md")
        assert [check(c) for c in good[0]] == [None]
    assert [bool(check_override(o)) for o in overrides] == [True, True]
    assert [check_override(o) for o in good[1]] == [None]


def test_the_generated_reference_pages_are_current() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "docs_reference.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_options_page_gives_the_defaults_a_run_gets() -> None:
    """Every run takes trainer=default (the only trainer option), whose file sets values the
    schema's defaults do not: the page shows what a run gets, not the bare schema's. And every
    group's options are listed, one folder down too (hydra/launcher/slurm.yaml)."""
    import yaml

    trainer = yaml.safe_load((ROOT / "conf" / "trainer" / "default.yaml").read_text())
    row = _table_row("reference/options.md", "`trainer.max_steps`")
    assert row.split("|")[3].strip().startswith(f"`{trainer['max_steps']}` (`trainer=default`")
    row = _table_row("reference/options.md", "`trainer.warmup_steps`")
    assert row.split("|")[3].strip().startswith(f"`{trainer['warmup_steps']}` (`trainer=default`")
    row = _table_row("reference/options.md", "`trainer.lr`")  # the file agrees: as it is
    assert row.split("|")[3].strip() == "`0.0002`"
    assert _table_row("reference/options.md", "`hydra/launcher=slurm`")


def test_every_option_has_a_docstring() -> None:
    """The options page is the schema's docstrings: a field without one is a blank row."""
    text = (ROOT / "docs" / "reference" / "options.md").read_text()
    blank = [line.split("|")[1].strip() for line in text.splitlines() if line.endswith("|  |")]
    assert not blank, f"options without a docstring in config/schema.py: {blank}"


def _table_row(page: str, first_cell: str) -> str:
    text = (ROOT / "docs" / page).read_text()
    (row,) = [line for line in text.splitlines() if line.startswith(f"| {first_cell} |")]
    return row


def test_the_config_table_lists_every_option_of_every_group() -> None:
    for group in GROUPS:
        row = _table_row("configuration.md", f"`{group}`")
        listed = set(re.findall(r"`([\w.\-]+)`", row.split("|")[2]))
        shipped = {p.stem for p in (ROOT / "conf" / group).glob("*.yaml")}
        assert shipped <= listed, f"{group}: {sorted(shipped - listed)} missing from the table"


def test_the_exit_code_table_lists_every_exit_code() -> None:
    import memtune.exit_codes as exit_codes

    codes = {v for k, v in vars(exit_codes).items() if k.startswith("EXIT_")}
    for code in codes:
        assert _table_row("troubleshooting.md", str(code)), code


README_PLANS = re.findall(
    r"^\| `([\w.-]+)`[^|]*\| ([\d.]+) GiB[^|]*\| ([\d.]+) s",
    (ROOT / "README.md").read_text(),
    re.MULTILINE,
)
"""README's table of the shipped experiments: (experiment, GiB a rank, seconds a step)."""


def test_the_readme_lists_every_shipped_4x4090_experiment() -> None:
    """The table the next test reads is there, a row for each shipped 4 × 4090 training
    experiment (an empty parse would leave it nothing to check)."""
    shipped = {p.stem for p in (ROOT / "conf" / "experiment").glob("*-4x4090-*.yaml")}
    listed = {name for name, _, _ in README_PLANS}
    assert listed and listed <= shipped
    assert shipped - listed <= {"qwen2.5-7b-4x4090-dpo", "qwen2.5-7b-4x4090-long"}, shipped - listed


@pytest.mark.parametrize(("experiment", "gib", "seconds"), README_PLANS)
def test_the_readmes_plans_are_what_make_plan_says(experiment: str, gib: str, seconds: str) -> None:
    """Each shipped experiment's memory per rank and step, as README states them, are what
    ``make plan`` decides and prints now (the planner moved under five of these rows between
    12-03 and 12-05 without anyone re-planning them)."""
    from memtune.config.given import given_config
    from memtune.launcher.prepare import decide
    from memtune.memory.step_time import step_time
    from tests.conftest import compose_cfg

    fitted = decide(
        given_config(compose_cfg([f"experiment={experiment}"]), inputs=False),
        refuse=False,
        say=False,
    )
    estimate = step_time(fitted.cfg, fitted.decisions, fitted.plan.counts)
    assert estimate is not None
    assert (f"{fitted.plan.total_gib:.2f}", f"{estimate.step_s:.1f}") == (gib, seconds)


PLAN_COMMAND = re.compile(r'make plan\s+EXP=([\w.-]+)(?:\s+ARGS="([^"]*)")?')
"""``make plan EXP=... [ARGS="..."]`` in the paragraph that introduces a block of its output."""
GAP = ("…", "...")
"""A line of its own saying lines were left out; within a line, "…" stands for a cut."""


def plan_blocks() -> list[tuple[str, list[str], list[str]]]:
    """Each part of a ```text block that shows ``make plan``'s output: (where, the plan's
    arguments, the lines shown). A part is a plan when it starts with ``memtune plan:
    EXPERIMENT · ...``, or when the paragraph before the block names the command (a block of a
    few of its lines)."""
    blocks: list[tuple[str, list[str], list[str]]] = []
    for page in documents():
        text, name = page.read_text(), page.relative_to(ROOT)
        for block in re.finditer(r"^```text\n(.*?)^```", text, re.M | re.S):
            where = f"{name}:{text[: block.start()].count(chr(10)) + 2}"
            paragraph = text[: block.start()].rstrip().rsplit("\n\n", 1)[-1]
            named = PLAN_COMMAND.findall(paragraph)
            for part in re.split(r"\n\s*\n", block.group(1)):
                lines = part.strip("\n").splitlines()
                if lines and lines[0].startswith("memtune plan: "):
                    experiment = lines[0].removeprefix("memtune plan: ").split(" · ")[0]
                    blocks.append((where, [f"experiment={experiment}"], lines))
                elif lines and named:
                    experiment, extra = named[-1]
                    blocks.append((where, [f"experiment={experiment}", *shlex.split(extra)], lines))
    return blocks


PLAN_BLOCKS = plan_blocks()


def test_the_docs_show_plans() -> None:
    """The next test has blocks to read (an empty parse would leave it nothing to check)."""
    assert len(PLAN_BLOCKS) >= 7, PLAN_BLOCKS


@pytest.mark.parametrize(("where", "args", "shown"), PLAN_BLOCKS, ids=[w for w, *_ in PLAN_BLOCKS])
def test_each_plan_the_docs_show_is_what_make_plan_prints(
    where: str, args: list[str], shown: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """The lines of a plan a page shows are lines ``make plan`` prints now, one after another
    as printed, except where a line of its own ("…") says some were left out; within a line,
    "…" is a cut (docs/models.md showed a plan two planner changes old: 59,392 tokens where it
    now prints 110,592)."""
    from memtune.cli import main

    assert main(["plan", *args]) == 0
    printed = capsys.readouterr().out.splitlines()
    at, gap = 0, True  # the first line shown may come after lines left out
    for line in shown:
        if line.strip() in GAP:
            gap = True
            continue
        pattern = re.compile(".*".join(re.escape(part) for part in line.split("…")))
        tried = range(at, len(printed)) if gap else range(at, min(at + 1, len(printed)))
        found = next((i for i in tried if pattern.fullmatch(printed[i])), None)
        assert found is not None, (
            f"{where}: {line!r} is not the line make plan {' '.join(args)} prints "
            + ("there" if not gap else "now")
            + ":\n"
            + "\n".join(printed)
        )
        at, gap = found + 1, False
