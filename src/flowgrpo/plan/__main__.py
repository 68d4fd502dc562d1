"""``python -m flowgrpo.plan RECIPE ...``: see :mod:`flowgrpo.plan.cli`."""

import sys

from .cli import main

sys.exit(main())
