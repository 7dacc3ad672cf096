"""The Slurm tier's session fixture: a real two-node cluster on 127.0.0.1 (see cluster.py).

The cluster is brought up once per session (installing Slurm and MariaDB with apt-get the first
time) and torn down at the end, unless it was already up before the session (`python -m
tests.slurm.cluster up`), in which case it is left running for whoever started it. The
cluster dir (daemon logs, MariaDB's data) is deleted too unless a test failed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.slurm.cluster import Cluster


@pytest.fixture(scope="session")
def slurm_cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    cluster = Cluster()
    was_up = cluster.is_up()
    cluster.up()
    previous = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(cluster.conf)  # sbatch, sacct, … and the jobs' environment
    try:
        yield cluster
    finally:
        if previous is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = previous
        if was_up:
            cluster.cancel_jobs()
        else:
            # Its logs stay in the cluster dir when a test failed; otherwise nothing is left.
            cluster.down(remove=request.session.testsfailed == 0)
        _clear_leftovers()


def _clear_leftovers() -> None:
    """What a killed rank of a cancelled job could leave: shared-memory buffers, build locks."""
    from memtune.launcher.extensions import extensions_root
    from memtune.launcher.hygiene import clear_shm_buffers, clear_stale_locks

    clear_shm_buffers()
    clear_stale_locks(extensions_root())
