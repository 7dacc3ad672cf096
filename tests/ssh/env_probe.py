"""A rank for the ssh tier: ``python -m tests.ssh.env_probe RUN_DIR`` writes the environment
it was started with to RUN_DIR/env-rankN.json and exits 0 (nothing trained)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

if __name__ == "__main__":
    run_dir = Path(sys.argv[1])
    out = run_dir / f"env-rank{os.environ['RANK']}.json"
    out.write_text(json.dumps(dict(os.environ), indent=1, sort_keys=True))
