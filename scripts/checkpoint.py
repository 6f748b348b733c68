"""A training checkpoint on disk: a module that train.py, sample.py and attention.py share.

A checkpoint is a folder with two files:

    checkpoint.json          what the run was: the model's configuration, the tokenizer, the step, the random
                             generators' states, the data's fingerprint, the loss history; and the name of
    checkpoint-STEP.npz      the arrays: the weights, and the optimizer's moments (np.savez: plain NumPy)

Each file is written whole to a temporary name in the same folder and then moved over the old one with
os.replace, which is atomic: a run stopped while it writes (Ctrl-C, a full disk, a power cut) leaves the
previous checkpoint as it was. The arrays go first, under a new name, and the JSON that names them second;
only then is the previous .npz removed. At every moment checkpoint.json names arrays that exist whole, and
it records their SHA-256, so that a file changed by hand is found when it is loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from text_data import Tokenizer, tokenizer_from

from tinyattn_np.gpt import GPT, GPTConfig

META = "checkpoint.json"


class CheckpointError(ValueError):
    """A folder that holds no usable checkpoint; the message says what is wrong and what to do."""


def write_atomically(path: Path, data: bytes) -> None:
    """The bytes at path, written to a temporary file beside it and moved into place in one step."""
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", delete=False) as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())  # on disk before the name points to it
    os.replace(f.name, path)


def save(folder: str | Path, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> Path:
    """Write arrays and meta (anything JSON can hold) as a checkpoint in folder; return the JSON's path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile() as buffer:
        np.savez(buffer, **arrays)
        buffer.seek(0)
        data = buffer.read()
    name = f"checkpoint-{int(meta['step']):09d}.npz"
    write_atomically(folder / name, data)
    record = {**meta, "arrays": name, "arrays_sha256": hashlib.sha256(data).hexdigest()}
    write_atomically(folder / META, json.dumps(record, indent=1).encode("utf-8"))
    for old in folder.glob("checkpoint-*.npz"):  # the arrays that the JSON no longer names
        if old.name != name:
            old.unlink(missing_ok=True)
    return folder / META


def exists(folder: str | Path) -> bool:
    return (Path(folder) / META).is_file()


def load(folder: str | Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """(arrays, meta) of the checkpoint in folder; CheckpointError where there is none or it was altered."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: no such folder (train.py --out {folder} writes a checkpoint there)")
    if not exists(folder):
        raise CheckpointError(f"{folder} holds no {META}: it is not a checkpoint (train.py --out {folder} writes one)")
    try:
        meta = json.loads((folder / META).read_text(encoding="utf-8"))
        data = (folder / meta["arrays"]).read_bytes()
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{folder / META} cannot be read as a checkpoint: {err}") from None
    if hashlib.sha256(data).hexdigest() != meta.get("arrays_sha256"):
        raise CheckpointError(f"{folder / meta['arrays']} is not the file that {META} was written with (changed?)")
    with np.load(folder / meta["arrays"]) as npz:
        arrays = {name: npz[name] for name in npz.files}
    return arrays, meta


def load_model(folder: str | Path) -> tuple[GPT, Tokenizer, dict[str, Any], dict[str, np.ndarray]]:
    """(the GPT, its tokenizer, the meta, every array) of the checkpoint that train.py wrote in folder.
    A CheckpointError says why where the files do not make that model (another configuration's weights)."""
    arrays, meta = load(folder)
    try:
        config = GPTConfig.from_dict(meta["config"])
        tokenizer = tokenizer_from(meta["tokenizer"])
        weights = {name.removeprefix("param."): a for name, a in arrays.items() if name.startswith("param.")}
        model = GPT(config, weights)
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"the checkpoint in {folder} does not make its model: {err}") from None
    if tokenizer.vocab_size != config.vocab:
        raise CheckpointError(f"the checkpoint in {folder} has a tokenizer of {tokenizer.vocab_size} tokens for a "
                              f"model of {config.vocab}")  # fmt: skip
    return model, tokenizer, meta, arrays
