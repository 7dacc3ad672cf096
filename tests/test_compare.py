"""memory.compare: what each GPU measure is compared with, and when a run says it was over."""

from __future__ import annotations

import pytest

from memtune.memory.compare import check, verdict

RECORD = {
    "rows": [
        {"what": "base weights", "gib": 3.55, "how": "bf16"},
        {"what": "activations", "gib": 14.94, "how": "4,096 tokens"},
        {"what": "loss", "gib": 0.49, "how": "chunked"},
        {"what": "allocator fragmentation", "gib": 1.0, "how": "5%"},
        {"what": "CUDA context + workspaces", "gib": 0.8, "how": "fixed"},
    ],
    "total_gib": 20.78,
    "device_gib": 23.99,
}


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
