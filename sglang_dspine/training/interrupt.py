"""Stopping a training run cleanly: SIGINT (Ctrl-C) and SIGTERM (a scheduler's or `kill`'s stop) are turned into
a request the loop reads at the end of its step, so it saves a resumable checkpoint of whole steps instead of dying
mid-step with nothing saved. A second signal stops at once (KeyboardInterrupt): someone who presses Ctrl-C twice
does not want to wait for a large checkpoint."""
from __future__ import annotations

import contextlib
import signal
import threading


class Interrupted(Exception):
    """The run stopped on a signal after `step` of `total` optimizer steps; `checkpoint`: what it saved (None when
    the run saves nothing, --no-save)."""

    def __init__(self, step: int, total: int, checkpoint: str | None):
        super().__init__(f"interrupted at step {step} of {total}")
        self.step, self.total, self.checkpoint = step, total, checkpoint


class StopRequest:
    """Set by the first SIGINT/SIGTERM inside `stop_requests()`."""

    def __init__(self) -> None:
        self.requested = False


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def stop_requests():
    """Inside: the first SIGINT/SIGTERM sets the yielded StopRequest; a second raises KeyboardInterrupt. Python
    installs signal handlers only in the main thread: elsewhere (a benchmark training in a worker thread) the
    signals keep their handlers and the request is never set."""
    stop = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def handler(signum, frame):
        if stop.requested:
            raise KeyboardInterrupt
        stop.requested = True

    old = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield stop
    finally:
        for s, h in old.items():
            signal.signal(s, h)


@contextlib.contextmanager
def sigterm_as_keyboard_interrupt():
    """SIGTERM raises KeyboardInterrupt, as SIGINT does, so a command stopped either way before its loop (while
    a target loads) reports it in one line instead of dying silently (main thread only, as above)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)
