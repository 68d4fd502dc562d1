"""Preemption signals: the first one asks the run to stop after its current optimizer step; a second exits at once.

Clusters announce preemption and the end of a time limit with a signal (SIGTERM, or SIGUSR1 when asked for with
``sbatch --signal``), then send SIGKILL after a grace period. `PreemptionHandler` turns the first such signal into
a request (``handler.requested``) that the trainer reads at the end of each optimizer step: it then saves a
checkpoint and exits with status 0. A second signal means "now": the handler restores the default action and
re-raises the signal, so the process ends at once (a save under way is abandoned; checkpoints are atomic, so the
previous ones stay complete).

Launchers often deliver one preemption twice: SLURM signals every process of a job step, and ``torchrun`` /
``accelerate launch`` forward the signal they receive to their workers as well. Signals that arrive within
``duplicate_window_s`` seconds of the first count as the same request.

Only the standard library is imported here.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import FrameType

DEFAULT_PREEMPTION_SIGNALS = ("SIGTERM", "SIGUSR1")

__all__ = ["DEFAULT_PREEMPTION_SIGNALS", "PreemptionHandler", "resolve_signal"]


def resolve_signal(name: str | int) -> signal.Signals:
    """``"SIGTERM"``, ``"TERM"`` or ``15`` -> ``signal.SIGTERM``; a clear error for names this platform lacks."""
    if isinstance(name, int) and not isinstance(name, bool):
        return signal.Signals(name)
    text = str(name).strip().upper()
    if not text.startswith("SIG"):
        text = "SIG" + text
    sig = getattr(signal, text, None)
    if not isinstance(sig, signal.Signals) or text in ("SIGKILL", "SIGSTOP"):
        raise ValueError(f"preemption signal {name!r} is not a signal this platform can handle; use names such as "
                         f"{', '.join(DEFAULT_PREEMPTION_SIGNALS)} (SIGKILL and SIGSTOP cannot be caught).")
    return sig


def _default_announce(message: str) -> None:
    print(f"[flowgrpo] {message}", file=sys.stderr, flush=True)


class PreemptionHandler:
    """Catches preemption signals while installed (see the module docstring).

    Args:
        signals: signal names or numbers to catch (default SIGTERM and SIGUSR1).
        duplicate_window_s: signals within this many seconds of the first one are the same request.
        announce: called with one line of text when a request arrives (default: print to stderr).
    """

    def __init__(self, signals: Sequence[str | int] = DEFAULT_PREEMPTION_SIGNALS, duplicate_window_s: float = 2.0,
                 announce: Callable[[str], None] | None = None):
        self.signals = [resolve_signal(s) for s in signals]
        self.duplicate_window_s = float(duplicate_window_s)
        self.announce = announce or _default_announce
        self.signal_name: str | None = None
        self._first_at: float | None = None
        self._previous: dict[signal.Signals, object] = {}

    @property
    def requested(self) -> bool:
        """True once a preemption signal has arrived."""
        return self.signal_name is not None

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def install(self) -> bool:
        """Install the handlers (main thread only); returns False, changing nothing, from another thread."""
        if self._previous or not self.signals:
            return bool(self._previous)
        if threading.current_thread() is not threading.main_thread():
            return False
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return True

    def uninstall(self) -> None:
        """Restore the handlers that were there before `install`."""
        previous, self._previous = self._previous, {}
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)

    @contextmanager
    def installed_while(self) -> Iterator[PreemptionHandler]:
        """``with handler.installed_while(): ...`` installs the handlers for the block."""
        self.install()
        try:
            yield self
        finally:
            self.uninstall()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        now = time.monotonic()
        if self._first_at is None:
            self._first_at = now
            self.signal_name = name
            self.announce(f"{name} received: finishing the current optimizer step, then saving a checkpoint and "
                          "exiting (status 0). Send it again to exit at once.")
            return
        if now - self._first_at <= self.duplicate_window_s:
            return  # the same preemption delivered twice (launcher forwarding + process-group delivery)
        self.announce(f"second {name}: exiting now, without saving.")
        self.exit_now(signum)

    def exit_now(self, signum: int) -> None:
        """End the process at once with ``signum``'s default action (status 128 + signum in a shell)."""
        self.uninstall()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        # SIGUSR1's default action terminates too; should the signal be blocked, leave anyway.
        os._exit(128 + signum)
