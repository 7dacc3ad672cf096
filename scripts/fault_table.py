"""The fault table (docs/faults.md) from a real run of the fault tests: each fault, what memtune
promises, and what the run showed, with the date, the CPU and the commit.

    .venv/bin/python -m pytest -m "" --junitxml=outputs/faults.xml <the tests below>
    # (-m "": the faults and ssh marks too; tests/ssh needs pdsh and sshd: make test-ssh)
    .venv/bin/python scripts/fault_table.py outputs/faults.xml > docs/faults.md

A row reads "kept" only when its test passed: every test asserts the promise on real processes,
signals and files (no mocks), including that nothing of the user's was lost.
"""

from __future__ import annotations

import datetime
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (test file, test name prefix, fault, promise)
FAULTS = [
    ("test_nothing_lost", "test_name_or_path_on_the_demo_model_group",
     "the demo model group pointed at the user's own model directory",
     "refused before anything starts, naming model=local; the directory untouched"),
    ("test_nothing_lost", "test_name_or_path_that_does_not_exist",
     "the demo model group pointed at a path that does not exist",
     "refused; nothing created there"),
    ("test_nothing_lost", "test_synthesize_never_replaces",
     "building a demo model where a directory memtune did not make exists",
     "refused (NotOurs); not a byte changed"),
    ("test_nothing_lost", "test_two_processes_building",
     "two jobs building the demo model at once",
     "both succeed, one build"),
    ("test_nothing_lost", "test_a_run_dir_held_by_a_job",
     "a second job on a held run dir; the holder then killed with -9",
     "refused at once naming host/pid/start, nothing written; free again after the kill"),
    ("test_checkpoint", "test_sigterm_saves_and_the_same_command_continues",
     "SIGTERM mid-run, and the same command started while the job trains; then train.py "
     "killed with -9",
     "checkpoint, exit 75, exact continuation; the second job refused, the run dir untouched; "
     "train.py killed: its ranks stop with a checkpoint, exit.json says why"),
    ("test_checkpoint", "test_ctrl_c_stops",
     "Ctrl-C once, then twice",
     "once: checkpoint and exit 75; twice: exit 130 at once; no traceback"),
    ("test_checkpoint", "test_kill_9_of_one_rank",
     "kill -9 of one rank mid-run",
     "the job ends, the same command resumes from the last checkpoint"),
    ("test_checkpoint", "test_a_rank_killed_while_loading",
     "kill -9 of a rank while it loads",
     "the job ends in seconds with exit 137, naming the rank and SIGKILL"),
    ("test_checkpoint", "test_a_stop_while_the_ranks_load",
     "SIGTERM while the ranks load",
     "exit 75, no traceback"),
    ("test_launch", "test_a_closed_terminals_sighup",
     "SIGHUP to train.py (a closed terminal, an ssh connection dropped); the same under nohup",
     "a stop like SIGTERM's: the ranks save and exit 75; under nohup the job goes on"),
    ("test_nodes", "test_sigterm_to_every_process_of_a_per_node_job",
     "SIGTERM to every process of a two-node per-node job (Slurm's scancel or time limit)",
     "every rank saves and every node exits 75 (the job exited 143 through DeepSpeed's "
     "launcher); the same commands continue"),
    ("test_nodes_crash", "test_a_node_whose_rank_fails_at_start_stops_the_other_node",
     "a per-node job's rank raising at start-up after node 0's ready mark, on node 0, then on "
     "node 1",
     "the other node's ranks stopped within seconds, its line naming the node and its error, "
     "exit 5 (they waited in torch's rendezvous until its 10-minute timeout)"),
    ("test_nodes_crash", "test_a_node_with_another_number_of_ranks_is_refused_and_stops_node_0",
     "a per-node job whose nodes are sized for different numbers of ranks (Slurm's --gpus=3 "
     "over 2 nodes)",
     "the node that differs is refused naming both counts and --gpus-per-node; node 0's ranks "
     "stopped within seconds, exit 5 (the ranks met in worlds of two sizes and hung)"),
    ("test_nodes_crash", "test_node_0_starts_no_rank_when_another_node_failed_while_it_prepared",
     "another node of a per-node job failed (its preflight, its refusal) while node 0 prepared",
     "node 0 starts no rank, names the node and its error, exit 5; its ready mark says so"),
    ("test_hostfile", "test_sigterm_stops_every_nodes_ranks",
     "SIGTERM to train.py in the hostfile form (the ranks started over ssh, sshd's, not its)",
     "every node's ranks save and exit 75 (the stop reached none of them); the same command "
     "continues"),
    ("test_hostfile", "test_kill_9_of_train_py_stops_the_ranks",
     "train.py killed with -9 in the hostfile form; then two Ctrl-Cs",
     "the ranks on its machine see it gone, every node's stop together with a checkpoint, "
     "exit.json says why; two Ctrl-Cs end every node's ranks at once (they trained on)"),
    ("test_checkpoint", "test_a_closed_terminal_stops_the_demo",
     "the demo's terminal (a real pty, train.py its session's leader) closed mid-run",
     "the kernel's SIGHUP stops it: the ranks save, exit 75, none left running"),
    ("test_launch", "test_a_process_outlives_its_closed_terminal",
     "a rank's terminal closed while it writes to it",
     "its lines go nowhere and it goes on (it died of EIO at its next line)"),
    ("test_checkpoint", "test_resume_after_a_crash_is_exact",
     "a crash in the middle of a save",
     "the half-written checkpoint skipped; the resumed run is bit-for-bit the uninterrupted one"),
    ("test_checkpoint", "test_a_cut_short_end",
     "the tokenizer cut short at the end of a run (full disk)",
     "not 'finished': exported again from the last checkpoint, no step repeated"),
    ("test_checkpoint", "test_a_damaged_newest_checkpoint",
     "one flipped byte in the newest checkpoint",
     "skipped with a warning, the previous one resumed; named explicitly: refused, file named"),
    ("test_rundir", "test_a_sealed_checkpoint_without_its_manifest_is_damaged",
     "the newest checkpoint's manifest deleted (a partial copy)",
     "skipped as damaged, the previous one resumed"),
    ("test_checkpoint", "test_checkpoint_files_are_verified",
     "a checkpoint file holding a pickled object",
     "refused before anything in it runs"),
    ("test_checkpoint", "test_resume_knows_the_base",
     "the base model moved, then modified in place; the optimizer changed",
     "moved: resumed; modified or another optimizer: refused before launch"),
    ("test_checkpoint", "test_resume_with_a_contradicting_config",
     "resume=never in a used run dir (after a refused resume)",
     "the earlier run's files moved to previous/, byte for byte; the user's own file stays"),
    ("test_checkpoint", "test_a_longer_max_steps",
     "a resume with a larger trainer.max_steps",
     "every step after the resume on the new schedule"),
    ("test_environment", "test_a_full_disk_while_tokenizing",
     "a full disk (RLIMIT_FSIZE) while tokenizing",
     "one line naming the path and the free space, exit 2; no half-built cache"),
    ("test_environment", "test_checkpoints_that_cannot_fit",
     "a run whose checkpoints cannot fit on the disk",
     "refused before launch"),
    ("test_environment", "test_another_users_buffer",
     "another user's DeepSpeed buffer in /dev/shm",
     "left in place, with a note"),
    ("test_environment", "test_a_buffer_this_user_cannot_remove",
     "a /dev/shm buffer this user may not remove",
     "the launch goes on, with a note"),
    ("test_environment", "test_wandb_leaves_nothing",
     "wandb's temporary dirs after a rank's hard exit",
     "removed"),
    ("test_environment", "test_the_data_cache_follows_the_umask",
     "files written under umask 002",
     "0664 / 0775, not safetensors' 0600"),
    ("test_environment", "test_a_team_shares_one_data_cache",
     "two members of a group, each under umask 022, tokenizing into the group's folder "
     "(setgid, group-writable); one's entry damaged",
     "the other reuses, builds beside and sets aside the first's entries; all group-writable"),
    ("test_environment", "test_what_another_member_may_not_change",
     "another member's cache folder not shared (0755); their damaged entry under a sticky bit",
     "one line naming whose it is and its mode; nothing left behind"),
    ("test_stores", "test_a_job_after_its_caches_were_damaged",
     "a flipped byte in the tokenized data cache and in the demo model, a changed digit in a "
     "cached parameter count, then the same command",
     "each set aside with one line naming it and what was wrong, rebuilt byte for byte; exit 0, "
     "the same losses"),
    ("test_stores", "test_a_damaged_data_cache_is_set_aside",
     "a data cache entry cut short, a byte flipped, a file missing, no manifest, a manifest of "
     "another version or listing none of its files",
     "set aside as .damaged-KEY with one line; tokenized again, byte for byte a clean build"),
    ("test_stores", "test_a_damaged_data_cache_that_cannot_be_set_aside",
     "a damaged data cache entry in a read-only cache",
     "one line naming the entry, what was wrong and data.cache_dir; nothing changed"),
    ("test_stores", "test_a_damaged_counts_entry",
     "one digit changed in a cached parameter count (the JSON still parses)",
     "set aside with one line, counted again"),
    ("test_stores", "test_a_damaged_linear_mixer_entry",
     "a flipped byte in a cached linear-mixer line",
     "set aside with one line, measured again"),
    ("test_stores", "test_damaged_reference_tables",
     "a flipped byte in the saved DPO reference tables",
     "set aside as .damaged-reference with one line, computed again"),
    ("test_stores", "test_a_damaged_demo_model",
     "a flipped byte in the demo model's weights; its marker file deleted",
     "set aside with one line, built again byte for byte"),
    ("test_errors_before_launch", "test_dataset_smaller_than_one_global_batch",
     "a dataset smaller than one global batch",
     "refused before launch, naming the global batch that fits"),
    ("test_errors_before_launch", "test_hub_model_offline",
     "a hub model id with no network",
     "refused in seconds, naming model=local and HF_HUB_OFFLINE"),
    ("test_errors_before_launch", "test_appended_unknown_key",
     "+trainer.max_step=2 (a key that is no setting)",
     "refused, suggesting trainer.max_steps"),
    ("test_errors_before_launch", "test_a_symlink_loop_given_as_a_path",
     "resume=, launcher.hostfile= or MEMTUNE_CACHE_DIR through a symlink loop",
     "refused in one line naming it, before any rank starts"),
    ("test_ds_config", "test_a_run_dir_entry_of_the_wrong_kind",
     "a file where the ranks make a folder (checkpoints/, adapter/, wandb/), or a folder where "
     "the job writes a file (exit.json, metrics.jsonl)",
     "refused in one line as the run dir is laid out, exit 2; nothing trained is lost after the "
     "last step"),
    ("test_environment", "test_a_full_disk_while_building_the_demo_model",
     "a full disk while the demo model is built",
     "one line naming the model's folder and MEMTUNE_CACHE_DIR; nothing half-built left"),
    ("test_environment", "test_a_write_on_a_read_only_filesystem",
     "a record written on a read-only mount",
     "one line naming the file asked for, not a temporary name"),
    ("test_sweep_report", "test_a_sweep_dir_on_a_full_disk",
     "a sweep (-m) whose sweep dir is on a full disk",
     "one line naming multirun.yaml, exit 2; nothing left in the sweep dir"),
    ("test_stores", "test_a_data_cache_entry_that_is_a_broken_symlink",
     "a data cache entry that is a broken symlink or a loop",
     "set aside and tokenized again, with a line"),
    ("test_stores", "test_a_data_cache_build_a_killed_process_left",
     "a tokenization killed with -9 before its rename",
     "its build dir removed by the next build, with a line naming its size; a live writer's "
     "and another host's kept"),
    ("test_stores", "test_a_write_a_killed_process_left",
     "a record's write killed with -9 before its rename (.NAME.tmp-host-pid)",
     "removed by the next write of that file; a live writer's, another host's, another name kept"),
    ("test_stores", "test_reference_tables_a_killed_write_left",
     "the DPO reference tables' write killed with -9",
     "its staging dir removed at the next write; the manifest lists the tables alone"),
    ("test_stores", "test_a_demo_model_build_a_killed_process_left",
     "a demo model build killed with -9 before its rename",
     "removed by the next build, with a line"),
    ("test_stores", "test_an_older_demo_build_a_killed_rebuild_set_aside",
     "a demo model rebuild killed with -9 after its rename, before the older build was removed",
     "the older build removed at the next build"),
    ("test_decisions", "test_a_save_cut_short_by_a_kill",
     "a checkpoint save cut short by kill -9 (checkpoints/.tmp-step-N)",
     "removed at the next start, with a line; a sealed save kept"),
    ("test_rundir", "test_a_checkpoint_left_at_its_set_aside_name",
     "kill -9 between a re-save's two renames",
     "the step found at its set-aside name, and resumed from"),
    ("test_rundir", "test_a_copy_a_killed_replace_set_aside",
     "kill -9 after a new adapter or checkpoint was in place, before the older copy was removed",
     "the older copy removed at the next replace or start; kept where it may be the only copy"),
    ("test_sweep_report", "test_a_sweep_point_that_raises",
     "an exception memtune does not catch in one point of a sweep (injected while tokenizing)",
     "that point a failed row with its line and exit.json; the other points run; the report "
     "written; exit 1"),
    ("test_sweep_report", "test_a_sweep_point_stopped_by_ctrl_c_while_tokenizing",
     "Ctrl-C while a sweep point tokenizes (injected there)",
     "exit 130; that point's row says it was interrupted before any rank started, the points "
     "never started not run"),
    ("test_sweep_report", "test_the_points_a_stopped_sweep_never_started",
     "a sweep stopped by SIGTERM in its first point",
     "exit 75; the report lists that point failed (exit 75) and the points never started as "
     "not run"),
    ("test_nothing_lost", "test_a_run_dir_whose_job_was_killed_names",
     "the same command while a killed train.py's ranks still hold the run dir",
     "refused, naming the ranks' pids and how to stop them"),
]  # fmt: skip


def results(junit: Path) -> dict[str, list[str]]:
    """test file → name → outcome for every test case in a JUnit XML report."""
    out: dict[str, list[str]] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        module = case.get("classname", "").rsplit(".", 1)[-1]
        failed = case.find("failure") is not None or case.find("error") is not None
        skipped = case.find("skipped") is not None
        outcome = "failed" if failed else "skipped" if skipped else "passed"
        out.setdefault(f"{module}::{case.get('name', '')}", []).append(outcome)
    return out


def main(argv: list[str]) -> int:
    seen = results(Path(argv[0]))
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        "unknown CPU",
    )
    lines = [
        "# Faults: what memtune promises and what it did",
        "",
        f"Generated by `scripts/fault_table.py` from a run of the fault tests on "
        f"{datetime.date.today():%Y-%m-%d}, commit {commit}, {cpu}. Every row is a real process,",
        "signal, file or disk fault (no mocks); *kept* means its test, which asserts the promise",
        "and that nothing of the user's was lost, passed.",
        "",
        "| fault | promise | result | data lost | test |",
        "|---|---|---|---|---|",
    ]
    missing = 0
    for module, prefix, fault, promise in FAULTS:
        outcomes = [o for k, v in seen.items() if k.startswith(f"{module}::{prefix}") for o in v]
        if not outcomes:
            result, lost = "not run", "?"
            missing += 1
        elif all(o == "passed" for o in outcomes):
            result, lost = "kept", "none"
        else:
            result, lost = "BROKEN", "see the test"
            missing += 1
        lines.append(f"| {fault} | {promise} | {result} | {lost} | `{module}::{prefix}` |")
    print("\n".join(lines))
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
