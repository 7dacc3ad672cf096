"""The sweep report: one row per run of a Hydra multirun, as markdown, CSV and a loss plot.

Written at the end of every ``python train.py -m ...`` (a Hydra callback), and on demand with
``memtune report SWEEP_DIR``. A failed point is a row marked failed, never a missing row.
"""

from __future__ import annotations

import csv
import io
import json
import os
import sys
from pathlib import Path
from typing import Any

import yaml
from hydra.types import RunMode

from memtune.arguments import VerbParser
from memtune.exit_codes import EXIT_CONFIG
from memtune.filesystem import write_atomic
from memtune.run_lock import held
from memtune.rundir import ExitRecord, RecordError, RunDir

COLUMNS = [
    "point",
    "overrides",
    "adapter",
    "scaling",
    "decided",
    "status",
    "steps",
    "train_loss_last",
    "eval_loss",
    "tokens_per_s",
    "peak_memory_gib_max",
    "peak_memory_gib_per_rank",
    "trainable_params",
]
PREFERENCE_COLUMNS = [
    "train_rewards_accuracies",
    "train_rewards_margins",
    "eval_rewards_accuracies",
    "eval_rewards_margins",
]
"""A preference sweep's (e.g. over preference.beta) columns: the last step's and the validation
split's reward accuracy and margin (TRL's rewards/accuracies, rewards/margins)."""


def columns(rows: list[dict[str, Any]]) -> list[str]:
    """The report's columns: the preference ones when a point trained a preference objective."""
    extra = [c for c in PREFERENCE_COLUMNS if any(c in row for row in rows)]
    return COLUMNS + extra


MAX_DEPTH = 16
"""How far below a sweep dir its points are looked for (a subdir of several levels)."""


def _run_dirs(sweep_dir: Path) -> list[Path]:
    """The sweep's points: the folders with a .hydra/ record. Hydra's default subdir
    (${hydra.job.num}) puts them right under the sweep dir; a hydra.sweep.subdir with a / in
    it (r${peft.r}/${hydra.job.num}), or one whose value holds one (a path in
    ${hydra.job.override_dirname}), puts them deeper, where the report found none and ended
    without a word. Below a sweep dir (its multirun.yaml) they are looked for at any depth,
    never inside a point's own dir, a hidden folder (.submitit, .refused-points), a link or
    another sweep's dir; elsewhere (no multirun.yaml) in its subdirectories only."""
    nested = (sweep_dir / "multirun.yaml").is_file()
    found, todo = [], [(sweep_dir, 0)]
    while todo:
        folder, depth = todo.pop()
        try:
            entries = list(folder.iterdir())
        except OSError:
            continue  # a folder the report cannot read: not a point's
        for p in entries:
            if p.name.startswith(".") or p.is_symlink() or not p.is_dir():
                continue
            if (p / ".hydra").is_dir():
                found.append(p)
            elif nested and depth < MAX_DEPTH and not (p / "multirun.yaml").exists():
                todo.append((p, depth + 1))
    names = {p: _point_name(sweep_dir, p) for p in found}
    return sorted(found, key=lambda p: (len(names[p]), names[p]))


def _point_name(sweep_dir: Path, run: Path) -> str:
    """A point's dir, as the report names it: its path below the sweep dir (0, or r4/1)."""
    return run.relative_to(sweep_dir).as_posix()


RUN = "_run_dir"
"""A row's run dir (none: a point refused, or failed, before it had one), for the plot: not a
column."""

REFUSED = ".refused-points"
"""The sweep dir's folder of the points refused before they had a run dir of their own (their
dir another point's, or taken): one JSON record each, their rows (:func:`record_refused`)."""


def record_refused(
    sweep_dir: Path, num: int, overrides: list[str], error: str, code: int | None = None
) -> None:
    """A sweep point refused without writing into its dir (another point's run, another job's,
    a user's files): its report row, so that it is a row marked refused, never a missing row.
    ``code``: the point failed there instead (an exception memtune does not catch, raised
    before its job held its dir): a row marked failed with that code."""
    folder = sweep_dir / REFUSED
    folder.mkdir(parents=True, exist_ok=True)
    why = " ".join(error.split())
    record: dict[str, Any] = {"point": num, "overrides": overrides, "error": why}
    if code is not None:
        record["code"] = code
    write_atomic(folder / f"{num}.json", json.dumps(record) + "\n")


def _refused(sweep_dir: Path, ran: list[list[str]]) -> list[dict[str, Any]]:
    """The refused points' records, by number; one whose overrides a run dir holds is left out
    (the point ran since, or its own earlier run is there: that dir's row is the point's)."""
    found = []
    for path in (sweep_dir / REFUSED).glob("*.json"):
        try:
            record = json.loads(path.read_text())
            record["overrides"] = [str(o).removeprefix("++") for o in record["overrides"]]
            found.append((int(record["point"]), record))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not memtune's record
    return [r for _, r in sorted(found, key=lambda nr: nr[0]) if r["overrides"] not in ran]


def _overrides(run: Path) -> list[str]:
    """The point's command-line overrides as the user wrote them (train.py gives a whole
    mapping to Hydra as ``++key={...}``: config.schema.open_mappings); none where its
    overrides.yaml cannot be read as a list."""
    path = run / ".hydra" / "overrides.yaml"
    try:
        found = yaml.safe_load(path.read_text()) if path.is_file() else []
    except (OSError, yaml.YAMLError):
        return []
    return [str(o).removeprefix("++") for o in found] if isinstance(found, list) else []


def collect(sweep_dir: Path) -> list[dict[str, Any]]:
    runs = _run_dirs(sweep_dir)
    per_run = [_overrides(run) for run in runs]
    refused = _refused(sweep_dir, per_run)
    seen = per_run + [r["overrides"] for r in refused]
    never = [(n, o) for n, o in enumerate(_sweep_points(sweep_dir) or []) if o not in seen]
    every = seen + [o for _, o in never]
    shared = set.intersection(*(set(o) for o in every)) if every else set()
    rows = []
    for run, overrides in zip(runs, per_run, strict=True):
        varying = [o for o in overrides if o not in shared] if len(every) > 1 else overrides
        point = _point_name(sweep_dir, run)
        row: dict[str, Any] = {"point": point, "overrides": " ".join(varying), RUN: run}
        rd = RunDir(run)
        row |= _adapter(rd)
        row |= _decided(rd)
        try:
            row |= _results(rd) if rd.summary.is_file() else _ended(rd)
        except RecordError as err:  # a record cut short, rewritten by hand, not memtune's
            row["status"] = _unreadable(rd, str(err))
        rows.append(row)
    for record in refused:
        varying = [o for o in record["overrides"] if o not in shared] if len(every) > 1 else []
        rows.append(
            {
                "point": str(record["point"]),
                "overrides": " ".join(varying or record["overrides"]),
                "status": (
                    f"refused: {record['error']}"
                    if record.get("code") is None
                    else _failed(ExitRecord(record["code"], record["error"]))
                ),
            }
        )
    for num, overrides in never:
        varying = [o for o in overrides if o not in shared] if len(every) > 1 else []
        rows.append(
            {"point": str(num), "overrides": " ".join(varying or overrides), "status": NOT_RUN}
        )
    return rows


UNREADABLE = "record unreadable"
"""A point whose summary.json or exit.json cannot be read as memtune's record: the row says
which and why (`memtune report` was a RecordError traceback, and the report at a sweep's end
Hydra's warning, no report written)."""

NOT_RUN = "not run"
"""A point of the sweep (multirun.yaml) with no run dir and no record of a refusal: a sweep
stopped (Ctrl-C, SIGTERM) before it, or a report while the sweep runs (on Slurm: its job not
started yet). It had no row."""


def _results(rd: RunDir) -> dict[str, Any]:
    """A finished point's results (summary.json): RecordError where it cannot be read, a
    record unreadable status where a field cannot be used."""
    s = rd.read_summary()
    try:
        row = dict(
            status="ok",
            steps=s.steps,
            train_loss_last=round(s.loss_last, 4),
            eval_loss=None if s.eval_loss is None else round(s.eval_loss, 4),
            tokens_per_s=s.tokens_per_s,
            peak_memory_gib_max=round(max(s.peak_memory_gib), 3),
            peak_memory_gib_per_rank=" ".join(f"{m:.3f}" for m in s.peak_memory_gib),
            trainable_params=s.trainable_params,
        )
        row.update(
            {k.replace("/", "_"): round(v, 4) for k, v in s.preference.items()
             if k.replace("/", "_") in PREFERENCE_COLUMNS}
        )  # fmt: skip
    except (TypeError, ValueError, AttributeError) as err:  # a field of the wrong kind
        return {"status": _unreadable(rd, f"{rd.summary}: {type(err).__name__}: {err}")}
    return row


def _unreadable(rd: RunDir, why: str) -> str:
    """The status of a point whose record cannot be read: which record (named below its run
    dir), and why."""
    return f"{UNREADABLE}: {' '.join(why.removeprefix(f'{rd.path}/').split())}"


def _ended(rd: RunDir) -> dict[str, Any]:
    """A point without results: failed (with its exit.json's code and reason), running, or
    laid out by a preprocess_only sweep; RecordError (or a record unreadable status) where
    its exit.json cannot be read."""
    if held(rd.path):  # before exit.json: a resumed point's earlier stop (75) stays in it
        return {"status": RUNNING}
    ended = rd.read_exit() if rd.exit.is_file() else None
    if ended is None and _laid_out_only(rd):
        return {"status": LAID_OUT}
    if ended is not None and not (type(ended.code) is int and isinstance(ended.error, str | None)):
        return {"status": _unreadable(rd, f"{rd.exit}: code {ended.code!r}, error {ended.error!r}")}
    return {"status": _failed(ended)}


BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


def _sweep_points(sweep_dir: Path) -> list[list[str]] | None:
    """Every point of the sweep, in order, with its overrides, as Hydra's basic sweeper makes
    them from multirun.yaml (hydra.sweeper.params, then the command line's overrides); None
    where that cannot be told for sure: no multirun.yaml, another sweeper (Optuna's points
    depend on the results), values Hydra expands from elsewhere (glob over a config group)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        hydra = yaml.load((sweep_dir / "multirun.yaml").read_text(), Loader=_LOADER)["hydra"]
        if hydra["sweeper"]["_target_"] != BASIC_SWEEPER:
            return None
        params = [f"{k}={v}" for k, v in (hydra["sweeper"].get("params") or {}).items()]
        overrides = OverridesParser.create().parse_overrides([*params, *hydra["overrides"]["task"]])
        batches = BasicSweeper.split_arguments(overrides, None)
    except Exception:  # whatever the file holds, or Hydra's parser says: no such rows
        return None
    return [[o.removeprefix("++") for o in point] for batch in batches for point in batch]


_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _failed(ended: ExitRecord | None) -> str:
    """A failed point's status: its exit code and, where its exit.json says why (a refusal, an
    exception memtune does not catch), the reason, on one line."""
    if ended is None:
        return "failed"
    why = f": {' '.join(ended.error.split())}" if ended.error else ""
    return f"failed (exit {ended.code}){why}"


LAID_OUT = "laid out (preprocess_only)"
"""A point of a ``preprocess_only=true`` sweep: its data tokenized and run dir laid out, no rank
started (it was reported "failed", with a count of failed points, although every point did
what it was asked)."""


RUNNING = "running"
"""A point whose job still holds its run dir (memtune.run_lock): ``memtune report`` during a
sweep, or a second sweep into the same dir, called it "failed" (and counted it) while it
trained."""


def _laid_out_only(rd: RunDir) -> bool:
    """The point's config.yaml (written as its run dir is laid out) says preprocess_only."""
    try:
        return bool((yaml.safe_load(rd.config.read_text()) or {}).get("preprocess_only"))
    except (OSError, yaml.YAMLError, AttributeError):
        return False


def _adapter(rd: RunDir) -> dict[str, Any]:
    """The point's adapter and its scaling (alpha / r, or alpha / sqrt(r) with rsLoRA): a rank
    sweep with plain LoRA's scaling changes the update's size along with the rank, and the
    report says so instead of leaving it to be inferred."""
    from memtune.config import ConfigError, load_run_config
    from memtune.config.derive import lora_scaling, lora_variant

    if not rd.config.is_file():
        return {}
    try:
        cfg = load_run_config(rd.config)
    except ConfigError:
        return {}
    return {"adapter": lora_variant(cfg), "scaling": round(lora_scaling(cfg), 4)}


METHODS = {"lora": "LoRA", "qlora": "QLoRA", "lora-int8": "LoRA int8"}


def _decided(rd: RunDir) -> dict[str, Any]:
    """What the point ran as, from its run dir's records of the launch (decisions.json, and the
    DeepSpeed config it was given): the adapter's method on its base, the ZeRO stage, an 8-bit
    optimizer, and what was offloaded to the host. The adapter column is the config as asked;
    plan.auto_fit (or an out-of-memory restart) may have run a point as QLoRA, on another
    ZeRO stage or with offload, and one rank runs ZeRO-2: rows that ran differently read
    differently."""
    if not rd.decisions.is_file():
        return {}  # stopped before its run dir was laid out
    try:
        d = rd.read_decisions()
    except RecordError:
        return {"decided": f"({rd.decisions.name} cannot be read)"}
    parts = [METHODS.get(d.peft_method, d.peft_method), f"ZeRO-{d.zero_stage}"]
    if d.optimizer == "adamw_8bit":
        parts.append("8-bit AdamW")
    offloaded = [what for what, on in _offloaded(rd).items() if on]
    if d.offload_activations:
        offloaded.append("activations")
    if offloaded:
        parts.append(f"offload: {'+'.join(offloaded)}")
    return {"decided": ", ".join(parts)}


def _offloaded(rd: RunDir) -> dict[str, bool]:
    """The ZeRO offload of the point's DeepSpeed config (ds_config.json): parameters (a
    zero.template such as zero3_offload) and optimizer state (trainer.optimizer=cpu_adam)."""
    try:
        zero = json.loads(rd.ds_config.read_text()).get("zero_optimization")
    except (OSError, ValueError, AttributeError):
        return {}

    def on(section: Any) -> bool:
        return isinstance(section, dict) and str(section.get("device", "none")) != "none"

    if not isinstance(zero, dict):
        return {}
    return {"params": on(zero.get("offload_param")), "optimizer": on(zero.get("offload_optimizer"))}


def _losses(run: Path) -> list[tuple[int, float]]:
    metrics = RunDir(run).metrics
    if not metrics.is_file():
        return []
    curve = []
    for line in metrics.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
            curve.append((row["step"], row["train/loss"]))
        except (ValueError, KeyError, TypeError):
            # not a step's row: the one a running point is appending, read half written (a
            # report during a sweep, on NFS), or the last one a kill or a full disk cut short
            # (it was a JSONDecodeError traceback, and no report)
            continue
    return curve


def write_report(sweep_dir: Path) -> dict[str, Path]:
    """Write sweep_report.md, sweep_report.csv and sweep_loss.png into ``sweep_dir``, each
    through a temporary sibling renamed into place (write_atomic): a symlink at one of those
    names is replaced, not written through (a user's file it led to was overwritten), and a
    file that cannot be written is an OSError naming it."""
    rows = collect(sweep_dir)
    out = {
        "md": sweep_dir / "sweep_report.md",
        "csv": sweep_dir / "sweep_report.csv",
        "png": sweep_dir / "sweep_loss.png",
    }
    names = columns(rows)
    table = io.StringIO(newline="")
    writer = csv.DictWriter(table, fieldnames=names)
    writer.writeheader()
    for row in rows:
        writer.writerow({c: row.get(c) for c in names})
    write_atomic(out["csv"], table.getvalue())
    lines = [
        f"# Sweep {sweep_dir.name}",
        "",
        "| " + " | ".join(names) + " |",
        "|" + "---|" * len(names),
    ]
    lines += ["| " + " | ".join(_cell(row.get(c), c) for c in names) + " |" for row in rows]
    write_atomic(out["md"], "\n".join(lines) + "\n")
    _plot(sweep_dir, rows, out["png"])
    return out


# Numbers in one column side by side with the same decimals (6.0830 next to 6.0146).
DECIMALS = {"train_loss_last": 4, "eval_loss": 4, "tokens_per_s": 1, "peak_memory_gib_max": 3}
DECIMALS |= {"scaling": 4}
DECIMALS |= {c: 4 for c in PREFERENCE_COLUMNS}


def _cell(value: Any, column: str = "") -> str:
    if isinstance(value, int | float) and column in DECIMALS:
        return f"{value:.{DECIMALS[column]}f}"
    return "" if value is None else str(value)


def _plot(sweep_dir: Path, rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    for row in rows:
        if RUN not in row:
            continue  # no run dir of its own (refused, or failed before it had one)
        curve = _losses(row[RUN])
        if curve:
            steps, losses = zip(*curve, strict=True)
            ax.plot(steps, losses, label=row["overrides"] or row["point"], linewidth=1.2)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax.set_xlabel("step")
    ax.set_ylabel("train loss")
    ax.set_title(f"sweep {sweep_dir.name}")
    if ax.lines:
        ax.legend(fontsize=8)
    fig.tight_layout()
    figure = io.BytesIO()
    try:
        fig.savefig(figure, format="png")
    finally:
        plt.close(fig)
    write_atomic(path, figure.getvalue())


def cannot_use(err: OSError) -> str:
    """A report file that cannot be written (a folder in its place, a read-only or full sweep
    dir), or a point's record that cannot be read, in words."""
    return f"cannot use {err.filename} ({type(err).__name__}: {err.strerror or err})"


_FAILED: list[str] = []
"""The points the report at the end of this process's sweep counted failed (points_failed)."""


def points_failed() -> list[str]:
    """The points the report at the end of this process's sweep counted failed: train.py's exit
    code for a sweep whose points ran in other processes (hydra/launcher=slurm), where the
    codes they returned stay."""
    return list(_FAILED)


def end_failed_submitit_job(config: Any, job_return: Any) -> None:
    """In a sweep point's submitit job (hydra/launcher=slurm), a point that failed returned its
    code to Hydra and the job's function returned normally: Slurm recorded the job COMPLETED,
    exit 0, whatever the point's code. Here, after Hydra has the point's result: that result
    handed to submitit as submitit itself does once the function returns (its result file,
    which the submitting side reads: the report is written as before), then the job ends
    with the point's code (SystemExit: submitit passes it through, and Hydra does not turn it
    into a warning as it does a callback's other exceptions), so that Slurm records it
    FAILED. A submitit job's exception would not do: submitit hands it to the submitting
    side, whose launcher raises it there, and the sweep ended without its report."""
    from hydra.core.utils import JobStatus

    if not os.environ.get("SUBMITIT_EXECUTOR") or config.hydra.mode != RunMode.MULTIRUN:
        return
    if job_return.status != JobStatus.COMPLETED:
        return  # an exception: submitit's path, as before
    code = job_return.return_value
    if type(code) is not int or code == 0:
        return
    import submitit
    from submitit.core import utils

    result = submitit.JobEnvironment().paths.result_pickle
    with utils.temporary_save_path(result) as written:
        utils.cloudpickle_dump(("success", job_return), written)
    print(f"memtune: this sweep point's job ends with its code, {code}", file=sys.stderr)
    raise SystemExit(code)


class SweepReport:
    """Hydra callback (``hydra.callbacks``): the report at the end of every multirun."""

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        """Hydra's sweeper writes ``SWEEP_DIR/multirun.yaml`` next, before any point and
        outside memtune's code; on a full disk its OSError (raised as the file closes: it
        names no file) was a traceback from Hydra, exit 1. The same file is written here
        first (Hydra then writes the same text again): where it cannot be, one line and exit
        2, as a point's run dir record that cannot be written (launcher.job). Only an OSError
        of this write is caught; a callback's other errors are Hydra's to report."""
        from omegaconf import OmegaConf

        sweep_dir = Path(config.hydra.sweep.dir)
        try:
            sweep_dir.mkdir(parents=True, exist_ok=True)
            write_atomic(sweep_dir / "multirun.yaml", OmegaConf.to_yaml(config))
        except OSError as err:
            if not err.filename:
                raise
            # SystemExit: Hydra turns an Exception of a callback into a warning and goes on
            print(f"memtune: error: {cannot_use(err)}", file=sys.stderr, flush=True)
            raise SystemExit(EXIT_CONFIG) from None

    def on_job_start(self, config: Any, **kwargs: Any) -> None:
        pass

    def on_job_end(self, config: Any, job_return: Any, **kwargs: Any) -> None:
        """A sweep point that failed inside a submitit job (hydra/launcher=slurm) ends that
        job with its code (:func:`end_failed_submitit_job`)."""
        end_failed_submitit_job(config, job_return)

    def on_run_start(self, config: Any, **kwargs: Any) -> None:
        pass

    def on_run_end(self, config: Any, **kwargs: Any) -> None:
        pass

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        from omegaconf import OmegaConf

        sweep_dir = Path(config.hydra.sweep.dir)
        if not sweep_dir.is_dir() or not (_run_dirs(sweep_dir) or (sweep_dir / REFUSED).is_dir()):
            if not OmegaConf.select(config, "plan_only", default=False):
                print(
                    f"memtune: no sweep report: no point of the sweep left a run dir (a folder "
                    f"with .hydra/) under {sweep_dir}",
                    file=sys.stderr,
                    flush=True,
                )
            return  # plan_only=true: its points make no run dir, nothing to compare
        try:
            out = write_report(sweep_dir)
        except OSError as err:
            if not err.filename:
                raise
            # after every point ran: one line, not a traceback; their run dirs hold it all
            print(
                f"memtune: sweep report not written: {cannot_use(err)}; `memtune report "
                f"{sweep_dir}` writes it once that is fixed",
                file=sys.stderr,
                flush=True,
            )
            out = None
        rows = collect(sweep_dir)
        failed = [r["point"] for r in rows if r["status"] not in ("ok", LAID_OUT, RUNNING)]
        # the exit code's, only where the points' codes stayed in other processes (submitit's
        # jobs): a local sweep counts the codes its points returned here, not the rows of an
        # earlier sweep into the same dir (which made a sweep of points that all ended well
        # exit 1)
        launcher = str(OmegaConf.select(config, "hydra.launcher._target_", default="") or "")
        _FAILED[:] = failed if "submitit" in launcher else []
        if out is not None:
            print(f"memtune: sweep report {out['md']} (+ .csv, {out['png'].name})", flush=True)
            print(out["md"].read_text(), flush=True)
        if failed:
            print(f"memtune: {len(failed)} sweep point(s) failed: {', '.join(failed)}", flush=True)


def main(argv: list[str] | None = None) -> None:
    from memtune.config import ConfigError  # in main: only the command line's bad input uses it

    parser = VerbParser(prog="memtune report", description=__doc__)
    parser.add_argument("sweep_dir", type=Path, help="a multirun dir: multirun/DATE/TIME-EXP")
    args = parser.parse_args(argv)
    if not args.sweep_dir.is_dir():
        raise ConfigError(f"{args.sweep_dir}: no such directory (give multirun/DATE/TIME-EXP)")
    if not _run_dirs(args.sweep_dir):
        raise ConfigError(
            f"{args.sweep_dir} holds no sweep point (no subdirectory with .hydra/): not a "
            "sweep dir, nothing written"
        )
    try:
        out = write_report(args.sweep_dir)
    except OSError as err:
        if not err.filename:
            raise
        raise ConfigError(cannot_use(err)) from None
    print(out["md"].read_text())
    print(f"written: {out['md']}, {out['csv']}, {out['png']}")


if __name__ == "__main__":
    main()
