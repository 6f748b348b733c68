"""What a checkpoint must hold to make its model and go on with its run, checked before anything runs: every
field of checkpoint.json of its type, the settings within the flags' own caps (train_flags.check_flag), a
tokenizer of the model's vocabulary, and every array the model and AdamW need, of its shape and dtype, and
finite. What is wrong is one line that names the file and the field (a FieldError of json_fields.py, or a
CheckpointError naming the .npz and the array). checkpoint.py reads a checkpoint through these checks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np
from json_fields import Fields
from text_data import DataError, Tokenizer, rng_from, tokenizer_from
from train_flags import PRESETS, SETTINGS, check_flag

from tinyattn_np.gpt import GPTConfig, param_shapes


class CheckpointError(ValueError):
    """A folder that holds no usable checkpoint; the message says what is wrong and what to do."""


def read_config(meta: Fields) -> GPTConfig:
    """The model's configuration: each field of its type, the model flags' caps, then GPTConfig's own checks."""
    config = meta.object("config")
    known = {f.name for f in fields(GPTConfig)}
    unknown = sorted(set(config.values) - known)
    if unknown:
        raise config.error(unknown[0], f"is no field of GPTConfig (its fields: {', '.join(sorted(known))})")
    values = {name: config.get(name, int, check=flag_check(name)) for name in ("layers", "heads", "width", "context")}
    values["vocab"] = config.get("vocab", int)
    values |= {name: config.get(name, str) for name in ("mlp", "norm", "dtype")}
    values |= {"bias": config.get("bias", bool), "dropout": config.get("dropout", float)}
    values["mlp_hidden"] = config.get("mlp_hidden", int, default=None)
    values["layer_pattern"] = config.get("layer_pattern", str, default=None)  # absent: every layer softmax
    values["positions"] = config.get("positions", str, default="rope")  # absent: RoPE, as before the field
    try:
        return GPTConfig(**values)
    except (ValueError, TypeError) as err:
        raise meta.error("config", f"does not make a model: {err}") from None


def read_tokenizer(meta: Fields, config: GPTConfig) -> tuple[dict[str, Any], Tokenizer]:
    """The tokenizer as the checkpoint describes it, and made: of the model's vocabulary."""
    described = meta.object("tokenizer")
    kind = described.get("kind", str)
    text = {"char": "chars", "tokenizer.json": "json"}.get(kind)
    if kind != "byte" and text is None:
        raise described.error("kind", f"{kind!r} is none of char, byte, tokenizer.json")
    if text:
        described.get(text, str)
    try:
        tokenizer = tokenizer_from(described.values)
    except DataError as err:
        raise described.error(text or "kind", f"does not make a tokenizer: {err}") from None
    if tokenizer.vocab_size != config.vocab:
        raise described.error(
            text or "kind", f"makes a vocabulary of {tokenizer.vocab_size:,} tokens for a model of {config.vocab:,}"
        )
    return described.values, tokenizer


def read_given(meta: Fields) -> dict[str, Any]:
    """settings.given, the flags given to the run that wrote the checkpoint: each a setting of train.py, of
    its type and within the flag's own caps, as if it were typed again."""
    given = meta.object("settings").object("given")
    unknown = sorted(set(given.values) - set(SETTINGS))
    if unknown:
        raise given.error(unknown[0], f"is no setting of train.py (its settings: {', '.join(SETTINGS)})")
    return {name: given.get(name, float, check=flag_check(name)) for name in given.values}


def flag_check(name: str) -> Callable[[Any], Any]:
    """The check of a value read back for the flag `name`: train_flags.check_flag(name, value)."""
    return lambda value: check_flag(name, value)


def read_rows(meta: Fields) -> list[dict[str, Any]]:
    """The table's rows (checkpoint.Row's fields), each field of its type."""
    rows = []
    for row in meta.items("rows"):
        values = {"step": row.get("step", int, check=count)}
        values |= {name: row.get(name, float, default=None) for name in ("train_loss", "lr", "tokens_per_s")}
        rows.append(values | {name: row.get(name, float) for name in ("val_loss", "seconds")})
    return rows


def count(value: int) -> int:
    if value < 0:
        raise ValueError("must be >= 0")
    return value


def preset_name(name: str) -> str:
    if name not in PRESETS:
        raise ValueError(f"no preset of train.py (its presets: {', '.join(sorted(PRESETS))})")
    return name


def generator_state(state: str) -> str:
    """state, where it is a random generator's as text_data.rng_state writes it."""
    try:
        rng_from(state)
    except (ValueError, TypeError, KeyError, RecursionError):
        raise ValueError("not a random generator's state (text_data.rng_state writes one)") from None
    return state


def check_weights(arrays: dict[str, np.ndarray], config: GPTConfig, path: Path) -> dict[str, np.ndarray]:
    """The weights (param.NAME) the config needs: every one there and no other, of its shape and the config's
    dtype, finite. A CheckpointError names the .npz and the array."""
    shapes = {f"param.{name}": shape for name, shape in param_shapes(config).items()}
    unexpected = sorted(name for name in arrays if name.startswith("param.") and name not in shapes)
    if unexpected:
        raise CheckpointError(f"{path}: {unexpected[0]!r} is no weight of this model ({config_text(config)})")
    for name, shape in shapes.items():
        check_array(arrays, name, shape, np.dtype(config.dtype), path, finite=True)
    return {name.removeprefix("param."): arrays[name] for name in shapes}


def check_array(
    arrays: dict[str, np.ndarray], name: str, shape: tuple[int, ...], dtype: np.dtype, path: Path, finite: bool
) -> None:
    """arrays[name] there, of the shape and dtype, and finite where asked; else a CheckpointError naming it."""
    if name not in arrays:
        raise CheckpointError(f"{path} lacks the array {name!r}: it is not a whole checkpoint of this model")
    array = arrays[name]
    if array.shape != shape or array.dtype != dtype:
        raise CheckpointError(
            f"{path}: {name!r} is {array.dtype} of shape {array.shape}; the model needs {dtype} of shape {shape}"
        )
    if finite and not np.isfinite(array).all():
        raise CheckpointError(f"{path}: {name!r} holds NaN or inf: no model can be run from it")


def check_moments(arrays: dict[str, np.ndarray], params: dict[str, np.ndarray], path: Path) -> None:
    """AdamW's moments of every weight (adamw.m.NAME and adamw.v.NAME), each of its weight's shape and dtype,
    the first finite and the second >= 0: else a CheckpointError naming the array. (AdamW.load_state_dict
    checks its scalars when the run is restored.)"""
    for name, weight in params.items():
        for kind in ("m", "v"):
            check_array(arrays, f"adamw.{kind}.{name}", weight.shape, weight.dtype, path, finite=kind == "m")
        if not (arrays[f"adamw.v.{name}"] >= 0).all():
            raise CheckpointError(f"{path}: 'adamw.v.{name}' holds negative numbers: a second moment is >= 0")


def read_history(arrays: dict[str, np.ndarray], path: Path) -> list[tuple[int, float]]:
    """Every step's (step, loss): the array 'history', (steps, 2) of float64."""
    history = arrays.get("history")
    if history is None or history.ndim != 2 or history.shape[1:] != (2,) or history.dtype != np.float64:
        got = "no such array" if history is None else f"{history.dtype} of shape {history.shape}"
        raise CheckpointError(f"{path}: 'history' must be float64 of shape (steps, 2); got {got}")
    return [(int(step), float(loss)) for step, loss in history]


def config_text(config: GPTConfig) -> str:
    return f"{config.layers} layers, width {config.width}, vocabulary {config.vocab}"
