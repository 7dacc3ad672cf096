"""The out-of-memory report of a rank names the measure of the rank's own device: the peak
the CUDA allocator held on a GPU rank, the process's RSS on a CPU rank, whatever
``torch.cuda.is_available()`` says on the machine (CPU ranks run on GPU machines too; the
report took "cuda" from it). On this CPU machine a GPU rank's report is what would have come
out as a CPU one."""

from __future__ import annotations

from pathlib import Path

import pytest

from memtune.rank.worker import RankOutOfMemory, report_out_of_memory
from memtune.rundir import RunDir

MEMORY = {"peak_allocated_gib": 71.25, "peak_rss_gib": 3.5}


@pytest.mark.parametrize(
    ("device_type", "measure", "said"),
    [
        ("cuda", "peak_allocated_gib", "peak allocated 71.25 GiB"),
        ("cpu", "peak_rss_gib", "peak rss 3.50 GiB"),
    ],
)
def test_the_report_counts_the_ranks_own_device(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], device_type: str, measure: str, said: str
) -> None:
    rd = RunDir(tmp_path)
    oom = RankOutOfMemory(1, 4, dict(MEMORY), "out of memory\ndetails", device_type)
    report_out_of_memory(rd, oom)
    [report] = rd.oom_reports()
    assert (report.rank, report.step, report.measure) == (1, 4, measure)
    assert report.error == "out of memory"
    assert said in capsys.readouterr().err
