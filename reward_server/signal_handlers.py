"""Python signal handlers for a block of code, shared by the file commands and ``sde2-train``."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from types import FrameType

Handler = Callable[[int, FrameType | None], object]


def exit_with_status(signum: int, frame: FrameType | None) -> None:
    """A signal as ``SystemExit(128 + signum)``: the shell's status for it, after the clean-up
    that an exit runs and a default handler's end skips."""
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def handling(signals: Iterable[signal.Signals], handler: Handler) -> Iterator[None]:
    """``handler`` for each of ``signals`` within the block, the previous handlers after it.

    In the main thread only: Python runs handlers there (``signal.signal`` raises in any other),
    so elsewhere the block runs with the handlers it had. A previous handler not set from Python
    (``signal.signal`` gave ``None``) cannot be put back and is left as the block leaves it.

    >>> seen = []
    >>> with handling([signal.SIGUSR1], lambda signum, frame: seen.append(signum)):
    ...     signal.raise_signal(signal.SIGUSR1)
    >>> seen == [signal.SIGUSR1], signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
    (True, True)
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {kind: signal.signal(kind, handler) for kind in signals}
    try:
        yield
    finally:
        for kind, before in previous.items():
            if before is not None:
                signal.signal(kind, before)
