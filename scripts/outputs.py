"""What a script writes besides its tables: progress lines on stderr (stdout holds only the tables), --json
PATH and --plot PATH, each checked before the run starts, so that a path that cannot be written fails first,
not after minutes of measuring; and a picture that git tracks is replaced only on purpose (--overwrite)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

from machine import code_version


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
    """Every figure, the code version and whether Ctrl-C cut the run short, as JSON at path."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump({**figures, "code": code_version(), "interrupted": stopped}, f, indent=2, default=str)
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
        p.error("--plot needs matplotlib: pip install -e '.[plot]'")
