"""``python -m accum_kit.planning [flags]``: the same as ``accum-kit plan [flags]``."""

import sys

from ..cli import run

sys.exit(run("plan"))
