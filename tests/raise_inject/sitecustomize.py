"""Fault injection for the tests of an exception memtune does not catch (on PYTHONPATH only in
those tests): tokenizing the data file MEMTUNE_TEST_RAISE_ON (data.path) raises RuntimeError,
as a library's error on an input no check foresaw would (MEMTUNE_TEST_RAISE_CTRL_C=1:
KeyboardInterrupt, as Ctrl-C while tokenizing). Every other data file is tokenized as usual,
so one point of a sweep fails and the others run.

MEMTUNE_TEST_RAISE_IN_RANK=N: the rank whose $RANK is N raises RuntimeError as it starts, before
torch.distributed's rendezvous (a rank's error at start-up), and the other ranks wait for it
there."""

import os

_on = os.environ.get("MEMTUNE_TEST_RAISE_ON")
if _on:
    import memtune.data.cache as _cache

    _preprocess = _cache.preprocess

    def _raising(cfg, *args, **kwargs):
        if cfg.path == _on:
            if os.environ.get("MEMTUNE_TEST_RAISE_CTRL_C"):
                raise KeyboardInterrupt
            raise RuntimeError(f"injected fault tokenizing {_on}")
        return _preprocess(cfg, *args, **kwargs)

    _cache.preprocess = _raising

_rank = os.environ.get("MEMTUNE_TEST_RAISE_IN_RANK")
if _rank is not None and _rank == os.environ.get("RANK"):
    import memtune.rank.worker as _worker

    def _failing_start(*args, **kwargs):
        raise RuntimeError(f"injected fault starting rank {_rank}")

    _worker.init_distributed = _failing_start
