"""Run the test suite and report how long it took and how busy it kept the cores (``make test`` runs it).

    python scripts/run_tests.py [pytest arguments]

pytest runs as a child process with the given arguments; once it ends, this prints

    tests: 312 s wall, 571 s CPU, CPU share 183% of 2 cores

(CPU = user + system time of pytest and every process it waited for: its xdist workers, the launches and workers
they started; a daemon that outlives its parent, such as a Ray node, is not counted) and exits with pytest's exit
code, 5 ("no tests ran") included, so that CI fails when nothing was collected.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time


def _cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def main(argv: list[str]) -> int:
    start = time.monotonic()
    try:
        code = subprocess.call([sys.executable, "-m", "pytest", *argv])
    except KeyboardInterrupt:
        code = 2
    wall = time.monotonic() - start
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = usage.ru_utime + usage.ru_stime
    print(f"tests: {wall:.0f} s wall, {cpu:.0f} s CPU, CPU share {100 * cpu / max(wall, 1e-9):.0f}% of {_cores()} cores",
          flush=True)
    if code == 5:
        print("no tests ran (pytest exit code 5)", file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
