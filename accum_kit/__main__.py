"""``python -m accum_kit <command>`` (and ``accelerate launch -m accum_kit <command>``)."""

import sys

from .cli import main

sys.exit(main())
