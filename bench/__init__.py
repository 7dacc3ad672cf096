"""The benchmarks and checks (bench/README.md). The scripts run as files
(``python bench/bench.py``, with ``bench/`` first on ``sys.path``: they import ``common`` and
each other by their bare names); the GPU check is a package, run as ``python -m
bench.gpu_check`` from the repository's root."""
