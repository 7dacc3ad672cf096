"""rank.memory_check: what each GPU measure is compared with, and when a run says it was over.
The plan record's rows say what they are (rundir.PlanRow); nothing is matched by row name."""

from __future__ import annotations

import pytest

from memtune.rank.memory_check import check, verdict
from memtune.rundir import PlanRecord, PlanRow

RECORD = PlanRecord(
    rows=[
        PlanRow("base weights", 3.55, "bf16"),
        PlanRow("activations", 14.94, "4,096 tokens", per_token=True),
        PlanRow("loss", 0.49, "chunked", per_token=True),
        PlanRow("allocator fragmentation", 1.0, "5%", live=False),
        PlanRow("CUDA context + workspaces", 0.8, "fixed", allocated=False),
    ],
    total_gib=20.78,
    device_gib=23.99,
)


def test_cuda_measures_compare_with_the_rows_they_can_see() -> None:
    checks = check(RECORD, [{"peak_allocated_gib": 18.0, "peak_reserved_gib": 19.0}], "cuda")
    allocated, reserved = checks
    assert allocated.planned_gib == pytest.approx(3.55 + 14.94 + 0.49)  # no context, no slack
    assert reserved.planned_gib == pytest.approx(3.55 + 14.94 + 0.49 + 1.0)
    assert allocated.ratio == pytest.approx(18.0 / 18.98)
    lines = verdict(RECORD, checks, "cuda")
    assert lines == [
        "rank0: peak allocated 18.00 of 18.98 GiB planned (0.95×), "
        "peak reserved 19.00 of 19.98 GiB planned (0.95×)"
    ]


def test_a_rank_over_its_plan_by_more_than_5_percent_says_so() -> None:
    measured = [
        {"peak_allocated_gib": 19.5, "peak_reserved_gib": 20.5},  # +2.7%, +2.6%: fine
        {"peak_allocated_gib": 20.5, "peak_reserved_gib": 21.9},  # +8%, +9.6%
    ]
    lines = verdict(RECORD, check(RECORD, measured, "cuda"), "cuda")
    warning = lines[-1]
    assert warning.startswith("WARNING: rank1's peak reserved is 10% over its plan")
    assert "2 measure(s) over" in warning
    # The rows that grow with the batch come first, then the largest.
    assert warning.index("activations 14.94") < warning.index("loss 0.49")
    assert warning.index("loss 0.49") < warning.index("base weights 3.55")


def test_cpu_is_reported_not_judged() -> None:
    measured = [{"peak_rss_gib": 0.55, "rss_gib": 0.5}]
    checks = check(RECORD, measured, "cpu", cpu_start_rss_gib=[0.3])
    assert checks[0].measured_gib == pytest.approx(0.25)
    (line,) = verdict(RECORD, checks, "cpu")
    assert "not judged" in line and "WARNING" not in line


def test_the_plan_record_says_what_each_row_is(tmp_path) -> None:
    """Written by the job from the planner's rows, read back typed by the ranks."""
    from memtune.config import to_run_config
    from memtune.memory.estimate import plan
    from memtune.rundir import RunDir
    from tests.conftest import compose_cfg, decided

    cfg = to_run_config(compose_cfg(["experiment=qwen2.5-7b-4x4090-lora"]))
    rd = RunDir(tmp_path)
    rd.write_plan(plan(cfg, decided(cfg)).record())
    record = rd.read_plan()
    assert record is not None and all(isinstance(r, PlanRow) for r in record.rows)
    kinds = {r.what: (r.allocated, r.live, r.per_token) for r in record.rows}
    assert kinds["activations"] == (True, True, True)
    assert kinds["allocator fragmentation"] == (True, False, False)
    assert kinds["CUDA context + workspaces"] == (False, True, False)
    assert kinds["base weights"] == (True, True, False)
    assert record.total_gib == sum(r.gib for r in record.rows)


def test_what_the_device_held_outside_the_allocator_is_judged_against_its_row() -> None:
    """A GPU rank's snapshot says what the card held beyond torch's allocator (rank.telemetry);
    it is compared with the rows the allocator never sees, and more than planned is said."""
    measured = [
        {"peak_allocated_gib": 18.0, "peak_reserved_gib": 19.0, "peak_outside_allocator_gib": 0.7},
        {"peak_allocated_gib": 18.0, "peak_reserved_gib": 19.0, "peak_outside_allocator_gib": 1.4},
    ]
    checks = check(RECORD, measured, "cuda")
    outside = [c for c in checks if c.measure == "outside the allocator"]
    assert [(c.rank, c.planned_gib, c.measured_gib) for c in outside] == [
        (0, 0.8, 0.7),
        (1, 0.8, 1.4),
    ]
    lines = verdict(RECORD, checks, "cuda")
    assert lines[0].endswith("outside the allocator 0.70 of 0.80 GiB planned (0.87×)")
    assert lines[-1].startswith(
        "WARNING: rank1 held 1.40 GiB outside torch's allocator against 0.80 planned"
    )
    assert not any("peak reserved is" in line for line in lines)  # the steps were as planned
    # a plan made without plan.device_gib has no row for it: measured, not judged
    rows = [r for r in RECORD.rows if r.allocated]
    bare = PlanRecord(rows=rows, total_gib=sum(r.gib for r in rows), device_gib=None)
    checks = check(bare, measured, "cuda")
    assert [c.measure for c in checks] == ["peak allocated", "peak reserved"] * 2
    assert not any("WARNING" in line for line in verdict(bare, checks, "cuda"))


def test_offloaded_inputs_in_host_memory_are_judged_against_the_host_row() -> None:
    """On a GPU and on CPU ranks alike (the buffers are counted, not read from RSS); a plan
    without host rows, or a rank that offloads nothing, has no such check."""
    import dataclasses

    offloading = dataclasses.replace(
        RECORD, host_rows=[PlanRow("offloaded layer inputs", 5.91, "27 layers × 32,768 tokens")]
    )
    gpu = {"peak_allocated_gib": 18.0, "peak_reserved_gib": 19.0}
    ranks = [{**gpu, "peak_host_offload_gib": 5.91}, {**gpu, "peak_host_offload_gib": 6.5}]
    lines = verdict(offloading, check(offloading, ranks, "cuda"), "cuda")
    assert lines[-2] == (
        "offloaded layer inputs in host memory per rank, GiB: rank0 5.91 of 5.91 planned, "
        "rank1 6.50 of 5.91 planned"
    )
    assert lines[-1].startswith("WARNING: rank1 held 6.50 GiB of host memory for offloaded")
    cpu = [{"peak_rss_gib": 0.55, "rss_gib": 0.5, "peak_host_offload_gib": 5.91}]
    (rss, host) = verdict(offloading, check(offloading, cpu, "cpu"), "cpu")
    assert "not judged" in rss and host.endswith("rank0 5.91 of 5.91 planned")
    assert [c.measure for c in check(RECORD, ranks, "cuda")] == [
        "peak allocated",
        "peak reserved",
    ] * 2
    # planned and not done (a layer's offload never applied): said, not read as a saving
    none = check(offloading, [{**gpu, "peak_host_offload_gib": 0.0}], "cuda")
    under = verdict(offloading, none, "cuda")[-1]
    assert under.startswith("WARNING: rank0 held 0.00 GiB of host memory for offloaded layer")
