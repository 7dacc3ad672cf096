"""The run dir: the contract between the job and its ranks, in one place.

The job (memtune.launcher) writes ``config.yaml``, ``ds_config.json``, ``plan.txt``,
``data.json`` and ``resume.json``; the ranks (memtune.rank) read them and write
``metrics.jsonl``, checkpoints, ``adapter/``, ``summary.json`` and ``memory.json``; the job
ends with ``exit.json``. Every path is a property of :class:`RunDir`, and every JSON file has a
typed record here, read and written by that record only, so a renamed field is one edit and
a missing one fails on reading with the file's name, not later with a KeyError. What is inside
a checkpoint is memtune.checkpoints'; the job lock on ``job.lock`` is memtune.run_lock's.

A checkpoint's ``trainer_state.json`` carries a format version (:data:`TRAIN_STATE_VERSION`): a
checkpoint written before versions (no field) is read as version 1 when it has every field;
one from a newer memtune, or with fields missing, is refused, naming the file and the fields.
"""

from __future__ import annotations

import dataclasses
import datetime
import errno
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from memtune.config.decisions import Decisions

from memtune.checkpoints import TRAINER_STATE
from memtune.filesystem import write_atomic

R = TypeVar("R")

TRAIN_STATE_VERSION = 1


class RecordError(ValueError):
    """A run-dir or checkpoint file that cannot be read as its record."""


def _read(cls: type[R], path: Path) -> R:
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise RecordError(f"{path}: cannot read it ({err})") from None
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    required = {
        f.name
        for f in dataclasses.fields(cls)  # type: ignore[arg-type]
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }
    missing = sorted(required - raw.keys())
    if missing:
        raise RecordError(f"{path}: missing {', '.join(missing)} (not a {cls.__name__} record)")
    return cls(**{k: v for k, v in raw.items() if k in names})


def _lock_is_memtunes(path: Path) -> bool:
    """A job lock as memtune.run_lock writes it: empty (being written) or who holds it."""
    try:
        text = path.read_text()
        raw = json.loads(text) if text.strip() else {}
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and (not raw or {"host", "pid", "started"} <= raw.keys())


def _composition_is_memtunes(folder: Path) -> bool:
    """``.hydra/`` as launcher.job records it: none of its three files, or a config.yaml of
    memtune's settings (another Hydra application's output dir has its own)."""
    import yaml

    names = ("config.yaml", "hydra.yaml", "overrides.yaml")
    if not folder.is_dir():
        return False
    if not any((folder / n).exists() for n in names):
        return True
    try:
        config = yaml.safe_load((folder / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return False
    return isinstance(config, dict) and {"model", "trainer", "launcher"} <= config.keys()


def _write(record: Any, path: Path) -> None:
    write_atomic(path, json.dumps(asdict(record), indent=2) + "\n")


@dataclass
class ExitRecord:
    """``exit.json``: how the job ended (0, a config / preflight error 2, a rank's code)."""

    code: int
    error: str | None = None

    def as_json(self) -> dict[str, Any]:
        return {"code": self.code} if self.error is None else asdict(self)


@dataclass
class ResumeRecord:
    """``resume.json``: the checkpoint the ranks restore, or None for a fresh start."""

    checkpoint: str | None
    changed: dict[str, list[Any]] = field(default_factory=dict)
    """What differs from the checkpoint's run and may ({"launcher.num_ranks": [2, 1]})."""
    earlier: list[dict[str, Any]] = field(default_factory=list)
    """The earlier starts' resumes that changed something, oldest first, each its checkpoint
    and changes: a run resumed on 1 rank, then on 2 again, keeps both (each start rewrote the
    record, and the change of world size was gone)."""


@dataclass
class PlanRow:
    """One row of the memory plan, with what a measurement can see of it."""

    what: str
    gib: float
    how: str
    allocated: bool = True
    """Counted by a CUDA allocator's max_memory_allocated when live (not so: the CUDA context
    and library workspaces, outside the allocator)."""
    live: bool = True
    """Live tensors (not so: allocator fragmentation, which only the reserved pool holds)."""
    per_token: bool = False
    """Grows with the tokens of a micro batch: the first suspect of a rank over its plan."""


def memtune_record(path: Path, keys: set[str]) -> bool:
    """Whether ``path`` is a JSON object with exactly ``keys``: a mark memtune writes under a
    name a user's file might have, told apart from one (never written over, nor removed)."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and raw.keys() == keys


@dataclass
class PlanRecord:
    """``plan.json``: the per-rank plan the run was admitted with, for the ranks to compare
    their peaks with (rank.memory_check) and the OOM report to cite."""

    rows: list[PlanRow]
    total_gib: float
    device_gib: float | None = None
    host_rows: list[PlanRow] = field(default_factory=list)
    host_gib: float = 0.0
    loading_device_gib: float | None = None
    """A quantized base's loading peak on a rank's device (memory.loading.loading_peak);
    None where loading holds no more than the base."""
    loading_host_gib: float | None = None

    @classmethod
    def read(cls, path: Path) -> PlanRecord:
        record = _read(cls, path)
        try:
            record.rows = [PlanRow(**r) for r in record.rows]  # type: ignore[arg-type]
            record.host_rows = [PlanRow(**r) for r in record.host_rows]  # type: ignore[arg-type]
        except TypeError as err:
            raise RecordError(f"{path}: a row is not a plan row ({err})") from None
        return record


@dataclass
class OomReport:
    """``oom-rankN.json``: a rank that could not allocate what a step needed."""

    rank: int
    step: int
    planned_gib: float | None
    measured: dict[str, float]
    measure: str
    """The key of ``measured`` that counts (peak_allocated_gib on CUDA, peak_rss_gib on CPU)."""
    error: str


def at_step(step: int) -> str:
    """Where a rank ran out of memory, in words: step 0 is what came before the first step
    (the model, DeepSpeed's engine, a checkpoint loaded)."""
    return f"at step {step}" if step else "before its first step"


@dataclass
class OomRestart:
    """``oom_restart.json``: what plan.auto_fit changed to restart after an out-of-memory stop
    (one restart per run dir: its presence says it was used)."""

    after: list[OomReport]
    changes: list[str]
    resumed_from: str | None


@dataclass
class MemoryRecord:
    """``memory.json``: every rank's peak and last memory reading at the end, and each next to
    the plan (rank.memory_check), written by rank 0."""

    measure: str
    """What was read: "CUDA allocator (GiB)" or "process RSS (GiB)"."""
    ranks: list[dict[str, float]]
    vs_plan: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class BaseRecord:
    """``base.json``: which base model the run trains, by content. A resume compares the
    fingerprints, so the same weights moved to a new path resume and other weights at the same
    path are refused (config.architecture.base_fingerprint)."""

    name_or_path: str
    fingerprint: str | None
    """None when the checkpoint is not on disk (a hub name not yet downloaded)."""
    init_from: str | None = None
    """peft.init_from: the adapter the stage starts from (and, for DPO / IPO, its reference)."""
    init_from_fingerprint: str | None = None
    """That adapter by content (config.architecture.adapter_fingerprint), compared as the base
    is: the same adapter moved resumes, another one at the same path is refused."""


@dataclass
class DataRecord:
    """``data.json``: where the tokenized data is and what was kept, cut and dropped
    (DataStats.as_dict() of each split)."""

    dir: str
    reused: bool
    train: dict[str, Any]
    val: dict[str, Any] | None = None
    step: dict[str, Any] | None = None  # data.packing.StepShape.as_dict()


@dataclass
class TrainState:
    """``checkpoints/step-N/trainer_state.json``: where training stood at that checkpoint."""

    step: int
    label_tokens: int
    input_tokens: int
    losses: list[float]
    wall_s: float
    world_size: int
    skipped: list[int] = field(default_factory=list)
    data_dir: str | None = None
    version: int = TRAIN_STATE_VERSION

    @classmethod
    def read(cls, checkpoint: Path) -> TrainState:
        path = checkpoint / TRAINER_STATE
        state = _read(cls, path)
        if state.version > TRAIN_STATE_VERSION:
            raise RecordError(
                f"{path}: format version {state.version}, this memtune reads up to "
                f"{TRAIN_STATE_VERSION}: resume it with the memtune that wrote it"
            )
        return state

    def write(self, checkpoint: Path) -> None:
        _write(self, checkpoint / TRAINER_STATE)


DECISIONS = "decisions.json"


def write_decisions(path: Path, decisions: Decisions) -> None:
    write_atomic(path, json.dumps(decisions.as_dict(), indent=2) + "\n")


def read_decisions(path: Path) -> Decisions:
    """The decisions a run dir or checkpoint holds; RecordError naming the file and the field
    when it is missing, unreadable or holds a value that cannot be used (an ``auto`` too)."""
    from memtune.config.decisions import DecisionError, Decisions

    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise RecordError(f"{path}: cannot read it ({err})") from None
    try:
        return Decisions.from_dict(raw)
    except DecisionError as err:
        raise RecordError(f"{path}: {err}") from None


@dataclass
class Summary:
    """``summary.json``: what the run did, written by rank 0 at the end."""

    run_dir: str
    steps: int
    label_tokens: int
    input_tokens: int
    loss_first: float
    loss_last: float
    skipped_steps: list[int]
    wall_s: float
    tokens_per_s: float
    world_size: int
    zero_stage: int
    attention: str
    trainable_params: int
    total_params: int
    adapter_tensors: int
    eval_loss: float | None
    data: dict[str, Any]
    peak_memory_gib: list[float]
    memory: list[dict[str, float]]
    memory_vs_plan: list[dict[str, Any]] = field(default_factory=list)
    """Per rank and measure: planned, measured, their ratio (rank.memory_check)."""
    compiled_layers: int = 0
    """Decoder layers run through torch.compile (trainer.compile)."""
    outputs: dict[str, list[Any]] = field(default_factory=dict)
    """The final files ({"adapter/NAME": [size, sha256]}): the run counts as finished only
    while they verify (launcher.prepare.already_finished)."""
    preference: dict[str, float] = field(default_factory=dict)
    """A preference objective's last train/… and eval/… rewards and log-probs (TRL's names)."""


@dataclass(frozen=True)
class RunDir:
    """Every file of a run dir (see the README's "What a run leaves")."""

    path: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))

    # written by the job
    @property
    def config(self) -> Path:
        return self.path / "config.yaml"

    @property
    def decisions(self) -> Path:
        """What was decided for the run (config.decisions.Decisions); config.yaml keeps what
        the user asked. Every checkpoint keeps a copy."""
        return self.path / DECISIONS

    @property
    def ds_config(self) -> Path:
        return self.path / "ds_config.json"

    @property
    def plan(self) -> Path:
        return self.path / "plan.txt"

    @property
    def plan_json(self) -> Path:
        return self.path / "plan.json"

    @property
    def data(self) -> Path:
        return self.path / "data.json"

    @property
    def resume(self) -> Path:
        return self.path / "resume.json"

    @property
    def base(self) -> Path:
        """The base model's identity (:class:`BaseRecord`); every checkpoint keeps a copy."""
        return self.path / "base.json"

    def launch_cmd(self, node_rank: int = 0) -> Path:
        """The command that started this node's ranks."""
        return self.path / ("launch.txt" if node_rank == 0 else f"launch-node{node_rank}.txt")

    @property
    def nodes_ready(self) -> Path:
        """Per-node form: node 0's mark that the run dir is ready for this launch_id."""
        return self.path / "launch.json"

    @property
    def node0_preparing(self) -> Path:
        """Per-node form: node 0's beat while it prepares the run dir (topology.preparing),
        removed once it marks it ready; hidden, as no record of the run."""
        return self.path / ".node0-preparing.json"

    def node_stopped(self, node_rank: int) -> Path:
        """Per-node form: node K's mark that its ranks stopped with a checkpoint (launch_id)."""
        return self.path / f"stopped-node{node_rank}.json"

    def node_failed(self, node_rank: int) -> Path:
        """Per-node form: node K's mark that its part of the job failed (launch_id, its code
        and line), which the other nodes' launchers watch for while their ranks run."""
        return self.path / f"failed-node{node_rank}.json"

    def lock(self, node_rank: int = 0) -> Path:
        """This node's job lock (run_lock.hold): held by the job for its whole life."""
        return self.path / ("job.lock" if node_rank == 0 else f"job-node{node_rank}.lock")

    def oom_report(self, rank: int) -> Path:
        return self.path / f"oom-rank{rank}.json"

    @property
    def oom_restart(self) -> Path:
        return self.path / "oom_restart.json"

    @property
    def exit(self) -> Path:
        return self.path / "exit.json"

    def preflight(self, node_rank: int = 0) -> Path:
        return self.path / (
            "preflight.json" if node_rank == 0 else f"preflight-node{node_rank}.json"
        )

    # written by the ranks
    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def adapter(self) -> Path:
        return self.path / "adapter"

    @property
    def reference(self) -> Path:
        """The reference model's precomputed log-probabilities (rank.reference; DPO, IPO)."""
        return self.path / "reference"

    @property
    def summary(self) -> Path:
        return self.path / "summary.json"

    @property
    def memory(self) -> Path:
        return self.path / "memory.json"

    # an earlier run in the same dir (nodes.hostfile: the per-node form's, before its nodes
    # started their ranks themselves)
    RUN_FILES = (
        "config.yaml", "decisions.json", "ds_config.json", "plan.txt", "plan.json", "data.json",
        "resume.json", "base.json", "launch.txt", "launch-node[0-9]*.txt", "launch.json",
        "stopped-node[0-9]*.json", "failed-node[0-9]*.json", "nodes.hostfile", "exit.json",
        "metrics.jsonl", "checkpoints", "adapter", "summary.json", "memory.json",
        "oom-rank[0-9]*.json", "restarted-oom-rank[0-9]*.json", "oom_restart.json", "wandb",
        "reference", ".damaged-reference.*",
    )  # fmt: skip
    """What a run leaves in its dir (the README's table), as names and glob patterns. Not the
    GPU preflight's records (they describe the machine, and this launch's are written before
    the run dir is laid out) nor .hydra/ (the newest start's composition)."""

    def wrong_kind(self, folders: tuple[str, ...] = ()) -> OSError | None:
        """What the ranks or the job's end would meet long after the start, said before any
        rank starts: a file (or a symlink that leads nowhere) where they make a folder
        (checkpoints/ at the first save, adapter/ after the last step, and ``folders``: wandb/
        for a run logging to wandb), or a folder where they write a file (exit.json after the
        ranks end). The OSError opening that path would raise, named for it; None when every
        such name is free or of its kind."""
        for path in (self.checkpoints, self.adapter, *(self.path / name for name in folders)):
            if path.is_symlink() and not path.exists():
                return NotADirectoryError(errno.ENOTDIR, "a symlink that leads nowhere", str(path))
            if path.exists() and not path.is_dir():
                return NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(path))
        for path in (self.metrics, self.summary, self.memory, self.launch_cmd(), self.exit):
            if path.is_dir():
                return IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        return None

    @property
    def previous(self) -> Path:
        """Where a fresh start (resume=never) moves the run that was in the dir before it."""
        return self.path / "previous"

    def held_a_run(self) -> bool:
        """Whether memtune laid a run out here: base.json is its first record, resume.json its
        last (an exit.json alone is a start refused before either: it laid nothing out)."""
        return self.base.is_file() or self.resume.is_file()

    def refused_here(self) -> bool:
        """Whether exit.json is memtune's record of a start refused before it laid a run out
        (exactly ``{"code": N, "error": "..."}``, N not 0, and no run beside it): memtune's, so
        a start after the fix uses the dir (and replaces it); a user's exit.json of any other
        shape is not, and is never touched."""
        if self.held_a_run():
            return False
        try:
            raw = json.loads(self.exit.read_text())
        except (OSError, ValueError):
            return False
        fields = {f.name for f in dataclasses.fields(ExitRecord)}
        if not (isinstance(raw, dict) and raw.keys() == fields):  # a refusal says why
            return False
        return type(raw["code"]) is int and raw["code"] != 0 and isinstance(raw["error"], str)

    def run_names_taken(self) -> list[Path]:
        """Entries named as memtune's own, in a dir that never held a memtune run: the user's
        (memtune would write into or replace them: its adapter/, checkpoints/, ...); memtune's
        record of a refused start (:meth:`refused_here`) is not among them."""
        if self.held_a_run():
            return []
        found = {p for pattern in self.RUN_FILES for p in self.path.glob(pattern)}
        if self.refused_here():
            found -= set(self.refusal_records())
        return sorted(found - set(self.failure_marks()))

    def failure_marks(self) -> list[Path]:
        """The per-node form's marks of a node's failure (topology.announce_failed), as memtune
        writes them (exactly ``{"launch_id", "node", "code", "error"}``): a node may fail before
        node 0 has laid the run out (its GPUs differ in number, its preflight failed), and node
        0 then starts in a dir that holds the mark (and watches it: launcher.spawn)."""
        keys = {"launch_id", "node", "code", "error"}
        return [p for p in self.path.glob("failed-node[0-9]*.json") if memtune_record(p, keys)]

    def refusal_records(self) -> list[Path]:
        """What a start refused before it laid a run out left under memtune's names (given
        :meth:`refused_here`): its exit.json, and in the per-node form node 0's launch.json
        telling the other nodes why (``{"launch_id", "nnodes", "error"}``, an error given)."""
        records = [self.exit]
        try:
            mark = json.loads(self.nodes_ready.read_text())
        except (OSError, ValueError):
            return records
        fields = {"launch_id", "nnodes", "error"}
        if isinstance(mark, dict) and mark.keys() <= fields and mark.get("error"):
            records.append(self.nodes_ready)
        return records

    def not_ours(self, node_rank: int = 0) -> list[Path]:
        """What a start on node ``node_rank`` would write over although memtune did not write
        it: on node 0, which lays the run out, :meth:`run_names_taken`; on every node, its job
        lock and ``.hydra/`` (the composition each start records) unless they read as
        memtune's. Checked before the start writes anything (launcher.job)."""
        found = set(self.run_names_taken()) if node_rank == 0 else set()
        lock = self.lock(node_rank)
        if lock.exists() and not _lock_is_memtunes(lock):
            found.add(lock)
        composition = self.path / ".hydra"
        if composition.exists() and not _composition_is_memtunes(composition):
            found.add(composition)
        return sorted(found)

    def earlier_run(self) -> list[Path]:
        """The entries an earlier run left here (none of a user's other files); none unless
        the dir held a memtune run."""
        if not self.held_a_run():
            return []
        found = {p for pattern in self.RUN_FILES for p in self.path.glob(pattern)}
        # not the nodes' failure marks: another node may have marked this start's failure
        # before node 0 sets the earlier run aside (they name their launch; node 0 reads it)
        return sorted(found - set(self.failure_marks()))

    def set_aside_earlier_run(self) -> Path | None:
        """Move an earlier run's entries to ``previous/<UTC time>/``, renamed, never copied or
        deleted; returns that folder, or None when there was nothing to move."""
        entries = self.earlier_run()
        if not entries:
            return None
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H-%M-%S")
        dest = self.previous / stamp
        n = 1
        while dest.exists():
            n += 1
            dest = self.previous / f"{stamp}-{n}"
        dest.mkdir(parents=True)
        for entry in entries:
            os.replace(entry, dest / entry.name)
        return dest

    # the records
    def write_exit(self, code: int, error: str | None = None) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        write_atomic(self.exit, json.dumps(ExitRecord(code, error).as_json()) + "\n")

    def read_exit(self) -> ExitRecord:
        return _read(ExitRecord, self.exit)

    def write_decisions(self, decisions: Decisions) -> None:
        write_decisions(self.decisions, decisions)

    def read_decisions(self) -> Decisions:
        """RecordError naming the file and the field when it is missing or cannot be used."""
        return read_decisions(self.decisions)

    def write_resume(
        self, checkpoint: Path | None, changed: dict[str, list[Any]] | None = None
    ) -> None:
        earlier: list[dict[str, Any]] = []
        try:
            before = self.read_resume() if self.resume.is_file() else None
        except RecordError:
            before = None  # a record that cannot be read: this start's is written whole
        if before is not None and isinstance(before.earlier, list):
            earlier = list(before.earlier)
        checkpoint_name = None if checkpoint is None else str(checkpoint)
        if before is not None and before.changed:
            entry = {"checkpoint": before.checkpoint, "changed": before.changed}
            # the same resume again (a restart before a new checkpoint) is one entry
            again = entry == {"checkpoint": checkpoint_name, "changed": changed or {}}
            if not again and entry not in earlier[-1:]:
                earlier.append(entry)
        record = asdict(ResumeRecord(checkpoint_name, changed or {}, earlier))
        if not earlier:  # the file as before this field: a start whose run changed nothing
            del record["earlier"]
        write_atomic(self.resume, json.dumps(record, indent=2) + "\n")

    def read_resume(self) -> ResumeRecord:
        return _read(ResumeRecord, self.resume)

    def write_plan(self, record: PlanRecord) -> None:
        _write(record, self.plan_json)

    def read_plan(self) -> PlanRecord | None:
        """None for a run dir laid out by a memtune that wrote no plan.json."""
        return PlanRecord.read(self.plan_json) if self.plan_json.is_file() else None

    def write_oom_report(self, report: OomReport) -> None:
        _write(report, self.oom_report(report.rank))

    def oom_reports(self) -> list[OomReport]:
        """The out-of-memory reports of the ranks' last stop (not those of a restart's)."""
        return [_read(OomReport, p) for p in sorted(self.path.glob("oom-rank*.json"))]

    def write_oom_restart(self, record: OomRestart) -> None:
        _write(record, self.oom_restart)

    def read_oom_restart(self) -> OomRestart:
        """Its changes checked (a list of overrides); ``after`` as read (the reports' dicts)."""
        record = _read(OomRestart, self.oom_restart)
        if not (
            isinstance(record.changes, list) and all(isinstance(c, str) for c in record.changes)
        ):
            raise RecordError(f"{self.oom_restart}: changes is not a list of overrides")
        return record

    def write_base(self, record: BaseRecord) -> None:
        _write(record, self.base)

    def read_base(self) -> BaseRecord:
        return _read(BaseRecord, self.base)

    def write_data(self, record: DataRecord) -> None:
        _write(record, self.data)

    def read_data(self) -> DataRecord:
        return _read(DataRecord, self.data)

    def write_summary(self, summary: Summary) -> None:
        _write(summary, self.summary)

    def read_summary(self) -> Summary:
        return _read(Summary, self.summary)

    def write_memory(
        self,
        measure: str,
        ranks: list[dict[str, float]],
        vs_plan: list[dict[str, Any]] | None = None,
    ) -> None:
        ranked = [{"rank": r, **m} for r, m in enumerate(ranks)]
        _write(MemoryRecord(measure, ranked, vs_plan or []), self.memory)

    def read_memory(self) -> MemoryRecord:
        return _read(MemoryRecord, self.memory)
