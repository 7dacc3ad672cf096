"""``python -m bench.gpu_check``: the orchestrator, or one phase's process (``--phase``)."""

import sys

from .orchestrate import main

sys.exit(main())
