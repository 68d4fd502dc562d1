"""``python -m flowgrpo``: the ``flowgrpo`` command (``flowgrpo.cli.command``)."""

import sys

from flowgrpo.cli.command import main

if __name__ == "__main__":
    sys.exit(main())
