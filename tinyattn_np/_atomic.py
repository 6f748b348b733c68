"""All or nothing: a change to a cache happens whole or not at all, whatever exception interrupts it.

A Ctrl-C raises KeyboardInterrupt in the main thread between two bytecodes, so a change made in several
steps (a block table grown, then its slots written, then the counts) can stop half done. The rule every
change of a cache follows:

  1) prepare the new state apart, on copies that no reader can see (a draft of the tables and counts);
  2) write what is too big to copy (the preallocated buffers of keys and values) only where the current
     state shows nothing, or, in a ring, where the change replaces a token, saving first what was there
     (Undo.write);
  3) commit: one assignment makes the new state the cache's (self._state = draft, self._seen = stop);
  4) on any exception before that assignment, put back what step 2 saved (Undo.undo) and raise it again.

An interrupt before the commit leaves the cache as it was; one after it, as the whole call leaves it.

The lock around a change must be released on any exception too, and `with lock:` does not promise that: an
exception raised at one of the bytecodes of its normal exit (after the body, before the call of __exit__)
skips __exit__ and leaves the lock held. `holding` releases it wherever the exception is raised.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

__all__ = ["Undo", "holding", "locked"]

R = TypeVar("R")


class Undo:
    """Writes into preallocated buffers, each remembered with what it overwrote, so that all can be undone."""

    def __init__(self) -> None:
        self.saved: list[tuple[np.ndarray, Any, np.ndarray]] = []

    def write(self, buffer: np.ndarray, index: Any, values: np.ndarray) -> None:
        """buffer[index] = values, after saving buffer[index] (saved first: an interrupt between the two
        lines leaves a saved copy equal to what is there, which undo writes back harmlessly)."""
        self.saved.append((buffer, index, buffer[index].copy()))
        buffer[index] = values

    def undo(self) -> None:
        """Put back what each write overwrote, the last write first."""
        for buffer, index, old in reversed(self.saved):
            buffer[index] = old


def holding(lock: Any, fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
    """fn(*args, **kwargs) with the re-entrant `lock` held, released whatever bytecode an exception is raised at.

    A thread that holds the lock already (a caller's `with cache.lock:`) keeps it as it was. Otherwise every
    step after acquire() runs inside the try, and the handler asks the lock whether this thread still holds
    it (RLock._is_owned, one C call) rather than trusting a flag that an interrupt could leave unset.
    """
    owned = lock._is_owned()
    try:
        if not owned:
            lock.acquire()
        result = fn(*args, **kwargs)
        if not owned:
            lock.release()
        return result
    except BaseException:
        if not owned and lock._is_owned():
            lock.release()
        raise


def locked(method: Callable[..., R]) -> Callable[..., R]:
    """A method run by `holding(self.lock, ...)`: the checks, the reads and the commit as one step for other
    threads, and the lock released on any exception."""

    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> R:
        return holding(self.lock, method, self, *args, **kwargs)

    return run
