"""What a script writes besides its tables: progress lines on stderr (stdout holds only the tables), --json
PATH and --plot PATH, each checked before the run starts, so that a path that cannot be written fails first,
not after minutes of measuring; a picture that git tracks is replaced only on purpose (--overwrite); and
the one rule for an optional package that is missing: one line, exit 2 (needs)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any, NoReturn

from machine import code_version

MISSING_DEPENDENCY = 2  # the exit code of a flag whose optional package is not installed: argparse's, a usage error


def needs(message: str) -> NoReturn:
    """A flag (or a script) that needs an optional package which is not installed: one line on stderr, the
    script's name first as argparse writes it, and exit MISSING_DEPENDENCY, in every script alike."""
    print(f"{os.path.basename(sys.argv[0])}: error: {message}", file=sys.stderr)
    sys.exit(MISSING_DEPENDENCY)


def progress(message: str) -> None:
    """A progress line on stderr, so that stdout holds only the tables."""
    print(message, file=sys.stderr, flush=True)


def check_output(p: argparse.ArgumentParser, flag: str, path: str | None) -> None:
    """Refuse now, not after the run, a --json or --plot PATH that cannot be written."""
    if path is None or path == "-":
        return
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        p.error(f"{flag} {path} is a folder: give a file name in it")
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        p.error(
            f"{flag} {path}: the folder {folder} does not exist or is not writable (give a file name in a "
            "folder that exists)"
        )


def write_json(path: str, figures: dict[str, Any], stopped: bool = False) -> None:
    """Every figure, the code version and whether Ctrl-C cut the run short, as JSON at path. A file that cannot
    be written (a full disk) ends the program with one line (exit 1), the tables printed before it kept."""
    text = json.dumps({**figures, "code": code_version(), "interrupted": stopped}, indent=2, default=str)
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as err:
        sys.exit(f"{os.path.basename(sys.argv[0])}: error: --json {path}: cannot write it ({err.strerror or err})")
    print(f"figures written to {path}")


def git_tracks(path: str) -> bool:
    """Whether git tracks the file at path (False outside a checkout or without git)."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        command = ["git", "-C", folder, "ls-files", "--error-unmatch", os.path.basename(path)]
        done = subprocess.run(command, capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def add_plot_arguments(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--plot", metavar="PATH.png", help=f"draw {what} (needs the plot extra)")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="let --plot replace a picture that git tracks (such as docs/*.png); without it --plot refuses, so "
        "that a committed picture is only regenerated on purpose",
    )


def check_plot(p: argparse.ArgumentParser, path: str | None, overwrite: bool) -> None:
    """--plot: a writable path, matplotlib importable, and no tracked picture replaced by accident."""
    if path is None:
        return
    check_output(p, "--plot", path)
    if os.path.exists(path) and not overwrite and git_tracks(path):
        p.error(f"--plot {path}: git tracks this picture; add --overwrite to replace it")
    try:
        import matplotlib  # noqa: F401  (only to know now that the plot can be drawn)
    except ImportError:
        needs("--plot needs matplotlib: pip install -e '.[plot]'")
