"""Ctrl-C in a script: what was measured is printed and kept, one line says so, and the exit code is 130.
A script's entry point is `sys.exit(interrupts.run_main(main))`: no traceback for a Ctrl-C that main did not catch.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from typing import Any

INTERRUPTED = 130  # the exit code of a program stopped by Ctrl-C: 128 + SIGINT


def measure_each(items: Iterable[Any], measure: Callable[[Any], Any], rows: list[Any]) -> bool:
    """rows.append(measure(item)) for each item; True when Ctrl-C stopped it (the rows so far stay)."""
    try:
        for item in items:
            rows.append(measure(item))
    except KeyboardInterrupt:
        return True
    return False


def interrupted(done: int, total: int, what: str = "rows") -> int:
    """Say that Ctrl-C stopped the run after `done` of `total`; the exit code to return."""
    print(f"interrupted (Ctrl-C) after {done} of {total} {what}: the figures above are all that was measured")
    return INTERRUPTED


def run_main(main: Callable[[], int]) -> int:
    """A script's entry point: main()'s exit code, or 130 and one line, no traceback, on a Ctrl-C that
    main did not catch itself (before its first row)."""
    try:
        return main()
    except KeyboardInterrupt:
        print("interrupted (Ctrl-C) before anything was measured", file=sys.stderr)
        return INTERRUPTED
