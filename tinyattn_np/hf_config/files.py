"""load_model_shape: a preset's name, a config.json on disk, or a dict; every problem with a file named."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..models import ModelShape
from ..presets import PRESETS
from .read import shape_from_config

__all__ = ["MAX_CONFIG_BYTES", "load_model_shape"]


def load_model_shape(source: str | Path | dict[str, Any] | ModelShape) -> ModelShape:
    """A ModelShape from a preset name (see PRESETS), a path to a config.json (or its folder), or a dict.

    The model's name is the config's own "_name_or_path"; without one, the file's: a/x.json is "x", and
    a/config.json (the Hugging Face layout) is "a", its folder's.

    Every problem with a file is a ValueError (or, for a field of the wrong type, a TypeError) that names
    the file: one that cannot be found or read, is not UTF-8 JSON, nests too deeply, or holds a bad field.
    """
    if isinstance(source, ModelShape):
        return source
    if isinstance(source, dict):
        return shape_from_config(source)
    if not isinstance(source, (str, Path)):
        raise TypeError(f"source must be a preset name, a path to a config.json or a dict; got {type(source).__name__}")
    if isinstance(source, str) and source.lower() in PRESETS:
        return PRESETS[source.lower()]
    path = _config_path(source)
    config = _read_json(path)
    # a config without a name of its own is named by its file: a/x.json is "x", a/config.json is "a"
    name = path.parent.name if path.name == "config.json" else path.stem
    try:
        return shape_from_config(config, default_name=name or None)
    except (TypeError, ValueError) as err:  # say which file the bad field is in
        raise (TypeError if isinstance(err, TypeError) else ValueError)(f"{path}: {err}") from None


# a config.json is a few KiB (Phi-3's with its longrope lists: about 10 KiB); a bigger file is something else
MAX_CONFIG_BYTES = 16 * 2**20


def _config_path(source: str | Path) -> Path:
    """The config.json that source names (itself, or config.json in the folder), checked to be a file."""
    path = Path(source)
    try:
        if path.is_dir():
            path = path / "config.json"
        found = path.is_file()
    except OSError as err:  # a name longer than the file system allows (ENAMETOOLONG), and the like
        raise ValueError(f"source {_shown(source)} cannot be opened as a config.json: {err.strerror}") from None
    if not found:
        raise ValueError(
            f"source must be a preset ({', '.join(PRESETS)}) or a path to a config.json; got {_shown(source)}"
        )
    return path


def _read_json(path: Path) -> Any:
    """The JSON in path, every failure a ValueError that names the file."""
    try:
        size = path.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise ValueError(f"{path} has {size:,} bytes, more than a config.json (at most {MAX_CONFIG_BYTES:,})")
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        byte = f"byte {err.object[err.start]:#04x} at offset {err.start}"
        raise ValueError(f"{path} is not UTF-8 text, as a config.json is: {byte}") from None
    except OSError as err:
        raise ValueError(f"{path} could not be read: {err.strerror}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None
    except RecursionError:  # Python's decoder recurses once per level: thousands of [ or { exhaust the stack
        raise ValueError(f"{path} nests its JSON too deeply to read (a config.json is a few levels deep)") from None
    except ValueError as err:  # an integer longer than Python converts (4,300 digits)
        raise ValueError(f"{path} holds a value that cannot be read: {err}") from None


def _shown(source: str | Path) -> str:
    """source for a message: whole when short, else its ends and its length (a 5,000-character path)."""
    text = str(source)
    return repr(text) if len(text) <= 200 else f"{text[:80]!r} ... {text[-40:]!r} ({len(text):,} characters)"
