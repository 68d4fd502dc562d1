"""``python -m flowgrpo.evaluate``: the same as ``flowgrpo evaluate`` (also under ``accelerate launch -m``)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m flowgrpo.evaluate"))
