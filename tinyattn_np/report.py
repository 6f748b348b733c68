"""Every table in the project goes through here: tabulate, byte units, number formats.

Byte figures always carry their unit. Binary units (KiB, MiB, GiB: powers of 1024) and decimal units
(KB, MB, GB: powers of 1000) are never mixed in one figure; a table header names the unit it uses.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
from tabulate import tabulate, tabulate_formats

from ._bytes import best_unit

__all__ = [
    "TABLE_FORMATS",
    "TABLE_WIDTH",
    "Checklist",
    "add_format_argument",
    "add_seed_and_format",
    "add_wide_argument",
    "check_format",
    "column_unit",
    "fit_table",
    "fold_lines",
    "format_duration",
    "format_sig",
    "matrix_table",
    "max_diff",
    "nonnegative_seed",
    "positive",
    "table",
    "table_width",
    "text_table",
]

TABLE_FORMATS: list[str] = sorted(tabulate_formats)


def check_format(fmt: str) -> str:
    """Return fmt if tabulate knows it, else raise a ValueError that lists the formats it does know."""
    if fmt not in tabulate_formats:
        raise ValueError(f"table format must be one of {', '.join(TABLE_FORMATS)}; got {fmt!r}")
    return fmt


def table(
    rows: Iterable[Sequence[Any]],
    headers: Sequence[str],
    fmt: str = "simple",
    floatfmt: str | Sequence[str] = "g",
    colalign: Sequence[str] | None = None,
    disable_numparse: bool = False,
) -> str:
    """Render rows as text with tabulate; fmt is any tabulate format (github, simple, latex, ...)."""
    check_format(fmt)
    return tabulate(
        list(rows),
        headers=list(headers),
        tablefmt=fmt,
        floatfmt=floatfmt,
        colalign=colalign,
        disable_numparse=disable_numparse,
    )


def matrix_table(
    matrix: np.ndarray,
    row_labels: Sequence[str],
    col_labels: Sequence[str] | None = None,
    fmt: str = "simple",
    digits: int = 3,
) -> str:
    """A 2-D array with a label on every row and column, e.g. attention weights between tokens."""
    matrix = np.asarray(matrix)
    if matrix.ndim != 2 or matrix.shape[0] != len(row_labels):
        raise ValueError(f"matrix must be 2-D with one row per label ({len(row_labels)}); got shape {matrix.shape}")
    col_labels = list(row_labels if col_labels is None else col_labels)
    rows = [[label, *row] for label, row in zip(row_labels, matrix.tolist(), strict=True)]
    return table(rows, ["", *col_labels], fmt=fmt, floatfmt=f".{digits}f")


def column_unit(values: Iterable[float], units: str = "binary") -> str:
    """One unit for a whole column of byte figures: the best unit for its median nonzero value.

    A header then names the unit once ("KV cache (GiB)") and every cell is a bare number in it.
    """
    nonzero = sorted(abs(v) for v in values if v)
    return best_unit(nonzero[len(nonzero) // 2] if nonzero else 0, units)


def format_sig(x: float) -> str:
    """A number with about 3 significant digits and no exponent: 0.000488, 1.50, 15.0, 131, 8,192."""
    if abs(x) < 1000:
        x = float(f"{x:.3g}")  # round first, so that 9.996 prints as 10.0, not 10.00
    size = abs(x)
    if size == 0:
        return "0"
    if size >= 1000:
        return f"{x:,.0f}"
    if size >= 1:
        return f"{x:.{max(0, 2 - int(np.floor(np.log10(size))))}f}"
    return f"{x:#.3g}"  # '#' keeps trailing zeros: 0.500, not 0.5


def text_table(rows: Iterable[Sequence[str]], headers: Sequence[str], fmt: str = "simple") -> str:
    """Rows of already formatted cells: the first column left-aligned, the rest right-aligned.

    tabulate's number parsing is off, so "15.0" stays "15.0" and a flag such as "12.0 *" lines up.
    """
    colalign = ["left"] + ["right"] * (len(headers) - 1)
    return table(rows, headers, fmt=fmt, colalign=colalign, disable_numparse=True)


TABLE_WIDTH = 120  # columns of text a table may take: a terminal's width; wider tables are split


def fit_table(
    rows: Sequence[Sequence[Any]],
    headers: Sequence[str],
    fmt: str = "simple",
    width: int | None = TABLE_WIDTH,
    floatfmt: str | None = None,
) -> str:
    """The table (text_table, or with floatfmt table), and where it is wider than `width` columns of text,
    its columns in parts that each fit, one under the other, every part led by the first column (the row's
    name). width=None prints it whole (a script's --wide)."""

    def part(columns: list[int]) -> str:
        cells, names = [[row[c] for c in columns] for row in rows], [headers[c] for c in columns]
        return table(cells, names, fmt=fmt, floatfmt=floatfmt) if floatfmt else text_table(cells, names, fmt)

    def too_wide(text: str) -> bool:
        return width is not None and max(len(line) for line in text.splitlines()) > width

    whole = part(list(range(len(headers))))
    if not too_wide(whole):
        return whole
    parts, columns = [], [0]
    for column in range(1, len(headers)):
        if len(columns) > 1 and too_wide(part([*columns, column])):
            parts.append(part(columns))
            columns = [0]
        columns.append(column)
    return "\n\n".join([*parts, part(columns)])


def add_format_argument(parser: argparse.ArgumentParser) -> None:
    """The --format flag every script takes: any of tabulate's table formats, "simple" by default."""
    parser.add_argument(
        "--format",
        default="simple",
        choices=TABLE_FORMATS,
        metavar="FORMAT",
        help="table format, any of tabulate's: simple, github, grid, latex, ... (default simple)",
    )


def format_duration(seconds: float) -> str:
    """A duration as a person reads it: 3725.0 -> '1 h 02 min', 65.0 -> '1 min 05 s', 5.0 -> '5 s'."""
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min" if hours else f"{minutes} min {secs:02d} s" if minutes else f"{secs} s"


def add_wide_argument(parser: argparse.ArgumentParser) -> None:
    """--wide: print every table whole; without it a table wider than TABLE_WIDTH is split (fit_table)."""
    parser.add_argument(
        "--wide",
        action="store_true",
        help=f"print each table whole, even wider than {TABLE_WIDTH} columns (default: in parts that fit)",
    )


def fold_lines(text: str, width: int = TABLE_WIDTH) -> str:
    """text with each line longer than width cut into lines of width characters, as a terminal of that width
    would show it (generated text, which may run on for hundreds of characters without a newline); every
    character is kept, in order, and nothing else changes."""
    lines = text.split("\n")
    return "\n".join(line[i : i + width] for line in lines for i in range(0, max(len(line), 1), width))


def table_width(args: argparse.Namespace) -> int | None:
    """The columns of text a script's tables may take: TABLE_WIDTH, or None (whole) with --wide."""
    return None if getattr(args, "wide", False) else TABLE_WIDTH


def positive(kind: type[int] | type[float], most: float | None = None) -> Callable[[str], Any]:
    """argparse type for a size or a rate: positive(int) or positive(float), finite and > 0 (nan and inf too
    are refused up front, where they would otherwise fail deep inside a run), and at most `most` where given:
    a size no run on one machine could use is refused by its flag, before anything is allocated."""
    bound = "" if most is None else f" at most {most:,}"

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            hint = _int_hint(text, bound) if kind is int else ""
            raise argparse.ArgumentTypeError(f"must be a positive {kind.__name__}{hint}; got {text!r}") from None
        if not (math.isfinite(value) and value > 0):
            raise argparse.ArgumentTypeError(f"must be a positive {kind.__name__}; got {value}")
        if most is not None and value > most:
            raise argparse.ArgumentTypeError(f"must be a positive {kind.__name__}{bound}; got {value:,}")
        return value

    return parse


def _int_hint(text: str, bound: str) -> str:
    """What to add to "must be a positive int" for text that is a positive number but no int: the bound, and
    for a whole number written as a float ('1e9', '4096.0') the digits to write instead."""
    try:
        value = float(text)
    except ValueError:
        return ""
    if not (math.isfinite(value) and value > 0):
        return ""
    return f"{bound}, written in digits (such as {int(value)})" if value.is_integer() and value < 1e18 else bound


def nonnegative_seed(text: str) -> int:
    """argparse type for --seed: an int >= 0 (np.random.default_rng refuses negative seeds)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an int >= 0; got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an int >= 0 (NumPy refuses negative seeds); got {value}")
    return value


def add_seed_and_format(parser: argparse.ArgumentParser, seed_help: str) -> None:
    """The two flags every script takes: --seed (an int >= 0, for seed_help) and --format (any of tabulate's)."""
    parser.add_argument(
        "--seed", type=nonnegative_seed, default=0, help=f"seed for {seed_help} (an int >= 0; default 0)"
    )
    add_format_argument(parser)


def max_diff(a: Any, b: Any) -> float:
    """max |a - b| in float64, 0.0 for empty arrays: what a script's check prints and compares."""
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)), initial=0.0))


class Checklist:
    """The claims a demo script checks as it prints: a false one is reported where it happens, and
    finish() lists them all and gives the exit code (1 if any failed)."""

    def __init__(self) -> None:
        self.failures: list[str] = []

    def __call__(self, ok: bool, claim: str) -> None:
        if not ok:
            self.failures.append(claim)
            print(f"   CHECK FAILED: {claim}")

    def finish(self) -> int:
        if self.failures:
            print(f"\n{len(self.failures)} check(s) failed:", file=sys.stderr)
            for claim in self.failures:
                print(f"  - {claim}", file=sys.stderr)
            return 1
        print("\nall checks passed")
        return 0
