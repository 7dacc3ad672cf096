"""Fault injection for the out-of-memory tests (on PYTHONPATH only in those tests): after
optimizer step MEMTUNE_TEST_OOM_STEP, rank MEMTUNE_TEST_OOM_RANK caps its own address space
(RLIMIT_AS) at what it has mapped then, so the next allocation that needs new memory fails for
real inside torch. MEMTUNE_TEST_OOM_ONCE names a file that makes it happen in one launch only
(a restarted job runs uncapped)."""

import os

_rank = os.environ.get("RANK")
if _rank is not None and _rank == os.environ.get("MEMTUNE_TEST_OOM_RANK"):
    once = os.environ.get("MEMTUNE_TEST_OOM_ONCE", "")
    if not (once and os.path.exists(once)):
        import resource

        import memtune.rank.worker as _worker

        _after_step = _worker.RunHooks.after_step
        _at = int(os.environ.get("MEMTUNE_TEST_OOM_STEP", "1"))

        def _capped(self, step, result):
            _after_step(self, step, result)
            if step == _at:
                if once:
                    open(once, "w").close()
                with open("/proc/self/status") as f:
                    vm = next(int(x.split()[1]) for x in f if x.startswith("VmSize:")) * 1024
                _, hard = resource.getrlimit(resource.RLIMIT_AS)
                resource.setrlimit(resource.RLIMIT_AS, (vm, hard))

        _worker.RunHooks.after_step = _capped
