"""Fault injection for tests/test_teardown_abort.py (on PYTHONPATH only there): rank
MEMTUNE_TEST_ABORT_RANK dies by SIGABRT (os.abort) — at ``leave``, after its run is complete
(what a native library's teardown did now and then), or after optimizer step
MEMTUNE_TEST_ABORT_STEP (a crash in the middle of the run)."""

import os

_rank = os.environ.get("RANK")
if _rank is not None and _rank == os.environ.get("MEMTUNE_TEST_ABORT_RANK"):
    import memtune.rank.worker as _worker

    _step = os.environ.get("MEMTUNE_TEST_ABORT_STEP")
    if _step is None:

        def _leave(code):
            os.abort()

        _worker.leave = _leave
    else:
        _after_step = _worker.RunHooks.after_step

        def _aborting(self, step, result):
            _after_step(self, step, result)
            if step == int(_step):
                os.abort()

        _worker.RunHooks.after_step = _aborting
