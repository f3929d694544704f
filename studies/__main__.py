"""`python -m studies NAME [options]`: run one study (see studies/registry.py)."""

import sys

from studies.registry import run

sys.exit(run(sys.argv[1:]))
