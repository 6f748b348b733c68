"""Ctrl-C in a script: what was measured is printed and kept, one line says so, and the exit code is 130 (143
for SIGTERM, where a loop notes it as train.py's does).
A script's entry point is `sys.exit(interrupts.run_main(main))`: no traceback for a Ctrl-C that main did not catch.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from typing import Any

INTERRUPTED = 130  # the exit code of a program stopped by Ctrl-C: 128 + SIGINT
TERMINATED = 143  # by SIGTERM (kill, systemd, a batch scheduler's time limit): 128 + SIGTERM


class Terminated(KeyboardInterrupt):
    """SIGTERM, taken as Ctrl-C is by a loop that notes both (mpi_job.StopTogether): it stops after its step
    and keeps what it has; the exit code is TERMINATED."""

    def __str__(self) -> str:
        return "SIGTERM"


def exit_code(stop: KeyboardInterrupt) -> int:
    """The exit code of a run stopped by Ctrl-C (130) or SIGTERM (143)."""
    return TERMINATED if isinstance(stop, Terminated) else INTERRUPTED


def how(stop: KeyboardInterrupt) -> str:
    """'interrupted (Ctrl-C)' or 'terminated (SIGTERM)'."""
    return "terminated (SIGTERM)" if isinstance(stop, Terminated) else "interrupted (Ctrl-C)"


def measure_each(items: Iterable[Any], measure: Callable[[Any], Any], rows: list[Any]) -> bool:
    """rows.append(measure(item)) for each item; True when Ctrl-C stopped it (the rows so far stay)."""
    try:
        for item in items:
            rows.append(measure(item))
    except KeyboardInterrupt:
        return True
    return False


def interrupted(done: int, total: int, what: str = "rows", stop: KeyboardInterrupt | None = None) -> int:
    """Say that Ctrl-C (or SIGTERM: stop) stopped the run after `done` of `total`; the exit code to return."""
    stop = stop or KeyboardInterrupt()
    print(f"{how(stop)} after {done} of {total} {what}: the figures above are all that was measured")
    return exit_code(stop)


def run_main(main: Callable[[], int]) -> int:
    """A script's entry point: main()'s exit code, or 130 and one line, no traceback, on a Ctrl-C that
    main did not catch itself (before its first row)."""
    try:
        return main()
    except KeyboardInterrupt:
        print("interrupted (Ctrl-C) before anything was measured", file=sys.stderr)
        return INTERRUPTED
