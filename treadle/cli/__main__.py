"""`python -m treadle.cli`: the `treadle` command (as the launchers and tests start it)."""

import sys

from treadle.cli import main

sys.exit(main())
