"""The machine a figure is measured on, and the code that measured it: the header every benchmark prints (the
CPU, its BLAS, the code's commit), the matmul rate now, a timing that starts once other libraries' threads
have gone to sleep, and the busy-machine check that marks a row measured beside other work (a load above the
core count, or a matmul rate that moved), from which no conclusion is drawn (concluded).

A script imports it as the module `machine`, as it does its other neighbours in scripts/:

    sys.path.insert(0, str(Path(__file__).resolve().parent))  # the modules this script shares sit beside it
    import machine

    info, lines = machine.header()
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from textwrap import fill
from typing import Any

import numpy as np

import tinyattn_np
from tinyattn_np.measure import machine_info, median_ms
from tinyattn_np.report import TABLE_WIDTH, fit_table

SETTLE_SECONDS = 0.3  # idle before each timed figure (settled_median_ms says why)
RATE_DRIFT = 0.20  # a row whose matmul rate moved more than this from the run's first is marked
# the n x n matmul of the rate measured beside each row of a quick benchmark (decode.py, serve.py)
RATE_SIZE = 1024


# ---------------------------------------------------------------------------------------------------
# timing


def settled_median_ms(fn: Callable[[], object], repeats: int) -> float:
    """median_ms after a short idle: OpenBLAS and torch's OpenMP threads busy-wait for a while after
    each call, and on a 2-core machine those spinning threads would slow the next library's first
    runs. Each figure starts once the previous library's threads have gone to sleep, and two untimed
    calls then wake its own threads (the first call after a sleep pays for waking them)."""
    time.sleep(SETTLE_SECONDS)
    return median_ms(fn, repeats, warmup=2)


def matmul_rate(dtype: str, n: int = 2048, repeats: int = 5) -> float:
    """GFLOP/s of one n x n matmul on all BLAS threads: the machine's ceiling for this dtype, now (after the
    same short idle as settled_median_ms, so that no other library's threads are still spinning)."""
    a = np.random.default_rng(1).standard_normal((n, n)).astype(dtype)
    time.sleep(SETTLE_SECONDS)
    return 2 * n**3 / median_ms(lambda: a @ a, repeats) / 1e6


# ---------------------------------------------------------------------------------------------------
# which machine and which code printed a table


def code_version() -> str:
    """'tinyattn_np 0.1.0, git 1e80941' ('-dirty' added when tracked files have changes), or
    'tinyattn_np 0.1.0, not a git checkout': which code printed a table that someone quotes."""
    version = f"tinyattn_np {tinyattn_np.__version__}"
    checkout = Path(tinyattn_np.__file__).resolve().parent.parent  # the folder that holds the package

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(checkout), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    top, head = git("rev-parse", "--show-toplevel"), git("rev-parse", "--short", "HEAD")
    if top is None or head is None or Path(top).resolve() != checkout:
        return f"{version}, not a git checkout"
    changes = git("status", "--porcelain", "--untracked-files=no")
    return f"{version}, git {head}{'-dirty' if changes else ''}"


def header(torch_version: str | None = None, threads: int | None = None) -> tuple[dict[str, Any], str]:
    """(machine_info(), the header lines every benchmark prints:
    the machine, its BLAS (and torch), the code)."""
    info = machine_info()
    blas = ", ".join(
        f"{b['internal_api']} {b['version']} {b['architecture']} kernels ({b['num_threads']} threads)"
        for b in info["blas"]
    )
    torch = f"\ntorch: {torch_version} ({threads} threads)" if torch_version else ""
    machine = f"machine: {info['cpu']}, {info['cores']} cores; Python {info['python']}, NumPy {info['numpy']}"
    return (
        info,
        f"{machine}\nBLAS: {blas}{torch}\ncode: {code_version()}",
    )  # a line each: each fits a terminal


# ---------------------------------------------------------------------------------------------------
# a busy machine: the figures of a row measured beside other work are marked, and the table says why


def load_average() -> float | None:
    """The 1-minute load average (processes running or waiting for a core), None where the OS has none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def busy_reasons(rate: float | None = None, first_rate: float | None = None) -> list[str]:
    """Why a row's figures may not compare with the others: its matmul rate moved more than RATE_DRIFT
    from the run's first, or more processes want a core than there are cores."""
    reasons = []
    if rate is not None and first_rate and abs(rate / first_rate - 1) > RATE_DRIFT:
        reasons.append(f"matmul rate {rate:.1f} GFLOP/s, {rate / first_rate - 1:+.0%} from the run's first")
    load, cores = load_average(), os.cpu_count() or 1
    if load is not None and round(load, 1) > cores:  # as printed: "2.0 on 2 cores" is not over
        reasons.append(f"load average {load:.1f} on {cores} cores")
    return reasons


NO_CONCLUSION = "no conclusion drawn: measured on a busy machine (*)"


def concluded(rows: list[dict[str, Any]], text: str) -> str:
    """A conclusion drawn from rows (a ratio judged, a fastest, a growth, a target met): text where no row was
    measured on a busy machine, else NO_CONCLUSION. A busy row's figures are printed, marked; nothing is
    concluded from them."""
    return NO_CONCLUSION if any(row.get("busy") for row in rows) else text


def mark_busy(body: list[list[str]], rows: list[dict[str, Any]]) -> list[list[str]]:
    """The table's rows with ' *' after the first cell of each row measured on a busy machine."""
    return [[f"{line[0]} *", *line[1:]] if row.get("busy") else line for line, row in zip(body, rows, strict=True)]


def busy_note(rows: list[dict[str, Any]], label: Callable[[dict[str, Any]], str]) -> str | None:
    """The lines under a table that say why its marked rows are marked (None when none is), each within
    TABLE_WIDTH."""
    marked = [
        fill(
            f"{label(row)}: {'; '.join(row['busy'])}",
            TABLE_WIDTH,
            initial_indent="  ",
            subsequent_indent="    ",
        )
        for row in rows
        if row.get("busy")
    ]
    if not marked:
        return None
    return "\n".join(["* measured on a busy machine: compare these rows with care", *marked])


def beside_the_row(dtype: str, first_rate: float, n: int = 2048) -> dict[str, Any]:
    """What a row records of the machine: the matmul rate measured now, and busy_reasons against the first."""
    rate = matmul_rate(dtype, n=n, repeats=5 if n >= 2048 else 3)
    return {"matmul_gflops": rate, "busy": busy_reasons(rate, first_rate)}


def marked_table(
    body: list[list[Any]],
    rows: list[dict[str, Any]],
    headers: list[str],
    fmt: str,
    label: Callable[[dict[str, Any]], str] | None = None,
    *,
    floatfmt: str | None = None,
    width: int | None = None,
) -> str:
    """A table of formatted cells (or, with floatfmt, of numbers) with its busy rows marked '*', split into
    parts of at most `width` columns of text (report.fit_table; None: whole), and under it the lines that say
    why rows are marked (label(row) names a row; default: its T)."""
    text = fit_table(mark_busy(body, rows), headers, fmt, width, floatfmt)
    note = busy_note(rows, label or (lambda row: f"T={row['tokens']:,}"))
    return text if note is None else f"{text}\n{note}"
