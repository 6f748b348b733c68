"""A training run's state (Run) and its checkpoint on disk: a module that train.py, sample.py and attention.py
share. A run's state is the model's weights, AdamW's moments and step count, and the two random generators
(the batches', which is where the data stands, and dropout's); a checkpoint holds all of it, so that a run
resumed from one draws the same batches and takes the same steps as a run that never stopped: the same bits.

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

import argparse
import hashlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from text_data import Data, Tokenizer, rng_from, rng_state, tokenizer_from
from train_flags import RunError, Settings

from tinyattn_np.gpt import GPT, GPTConfig
from tinyattn_np.optim import AdamW

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
        raise CheckpointError(
            f"the checkpoint in {folder} has a tokenizer of {tokenizer.vocab_size} tokens for a model of {config.vocab}"
        )
    return model, tokenizer, meta, arrays


# ---------------------------------------------------------------------------------------------------
# a training run, and its checkpoint


@dataclass
class Row:
    """A row of train.py's table, one per validation: the training loss (the mean of the steps since the last
    row), the validation loss, the last step's learning rate and the speed of those steps."""

    step: int
    train_loss: float | None  # None at step 0
    val_loss: float
    lr: float | None
    tokens_per_s: float | None
    seconds: float  # this session's steps, in all


@dataclass
class Run:
    """What train.py's loop moves on: everything a checkpoint of it keeps, and where its checkpoints go."""

    preset: str  # the name of the model's preset (train_flags.PRESETS)
    settings: Settings
    model: GPT
    optimizer: AdamW
    data: Data
    seed: int
    rng: np.random.Generator  # the batches': where the data stands
    dropout_rng: np.random.Generator
    step: int = 0  # steps taken
    history: list[tuple[int, float]] = field(default_factory=list)  # (step, training loss) of every step
    rows: list[Row] = field(default_factory=list)  # one per validation
    out: str | None = None  # the folder its checkpoints go to (--out)
    saved_step: int | None = None  # the step of the checkpoint there, if any


def save_run(folder: str, run: Run) -> None:
    """The run's state as a checkpoint in folder: the weights, AdamW's state, every step's loss; the model's
    configuration, the settings, the tokenizer, the text's fingerprint and split, and both generators' states."""
    arrays = {f"param.{name}": p for name, p in run.model.params.items()}
    arrays |= {f"adamw.{name}": a for name, a in run.optimizer.state_dict().items()}
    arrays["history"] = np.array(run.history, dtype=np.float64).reshape(-1, 2)  # (steps, 2): step, loss
    data = {"source": run.data.source, "fingerprint": run.data.fingerprint, "validation": run.data.validation}
    meta = {
        "step": run.step,
        "preset": run.preset,
        "config": run.model.config.to_dict(),
        "settings": asdict(run.settings),
        "tokenizer": run.data.tokenizer.describe(),
        "seed": run.seed,
        "rows": [asdict(row) for row in run.rows],
        "data": data,
        "rng": rng_state(run.rng),
        "dropout_rng": rng_state(run.dropout_rng),
    }
    save(folder, arrays, meta)


@dataclass
class Saved:
    """A run's checkpoint read back: what --resume continues, or what --init-from starts a new run from."""

    folder: str
    step: int
    preset: str
    config: GPTConfig
    tokenizer: dict[str, Any]  # as Tokenizer.describe() wrote it
    given: dict[str, Any]  # Settings.given: the flags given to the run that wrote it
    source: str
    fingerprint: str
    validation: float
    rows: list[Row]
    rng: str  # the generators' states (text_data.rng_state)
    dropout_rng: str
    params: dict[str, np.ndarray]
    adamw: dict[str, np.ndarray]
    history: list[tuple[int, float]]

    @staticmethod
    def read(folder: str) -> Saved:
        """The checkpoint that train.py wrote in folder; a CheckpointError says why where it is none."""
        arrays, meta = load(folder)
        try:
            data = meta["data"]
            return Saved(
                folder=folder,
                step=meta["step"],
                preset=meta["preset"],
                config=GPTConfig.from_dict(meta["config"]),
                tokenizer=meta["tokenizer"],
                given=meta["settings"]["given"],
                source=data["source"],
                fingerprint=data["fingerprint"],
                validation=data["validation"],
                rows=[Row(**row) for row in meta["rows"]],
                rng=meta["rng"],
                dropout_rng=meta["dropout_rng"],
                params={name.removeprefix("param."): a for name, a in arrays.items() if name.startswith("param.")},
                adamw={name.removeprefix("adamw."): a for name, a in arrays.items() if name.startswith("adamw.")},
                history=[(int(step), float(loss)) for step, loss in arrays["history"]],
            )
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"the checkpoint in {folder} is not a training run's: {err}") from None


def resumed(args: argparse.Namespace) -> Saved | None:
    """--out's checkpoint with --resume; None for a new run, whose --out must hold none. A RunError where a
    flag given does not fit it."""
    if not args.out:
        return None
    if not args.resume:
        if exists(args.out):
            raise RunError(
                f"--out {args.out} holds a checkpoint already: add --resume to continue it, or give another --out"
            )
        return None
    saved = Saved.read(args.out)
    if args.steps is not None and args.steps <= saved.step:
        raise RunError(f"the checkpoint in {args.out} is at step {saved.step} already: give --steps above it")
    check_preset(args, saved)
    if args.validation not in (None, saved.validation):  # another split would train on other windows
        raise RunError(
            f"the checkpoint in {args.out} validates on the last {saved.validation:g} of its text; --validation "
            f"{args.validation:g} is another split: leave it out to resume"
        )
    return saved


def initial(args: argparse.Namespace) -> Saved | None:
    """--init-from's checkpoint, whose model, tokenizer and weights a new run starts from (its AdamW, step and
    data are not taken: fine-tuning, nanoGPT's init_from); None without the flag."""
    if not args.init_from:
        return None
    saved = Saved.read(args.init_from)  # a CheckpointError names the folder
    check_preset(args, saved)
    return saved


def check_preset(args: argparse.Namespace, saved: Saved) -> None:
    if args.preset is not None and args.preset != saved.preset:  # the checkpoint's preset is the run's
        raise RunError(
            f"the checkpoint in {saved.folder} is a {saved.preset} model; --preset {args.preset} is another "
            "configuration: leave --preset out to go on from it"
        )


def restore(run: Run, saved: Saved) -> None:
    """The run as the checkpoint left it: AdamW's moments and step count, both generators, the step, the rows
    and every step's loss (the weights came with the model)."""
    run.optimizer.load_state_dict(saved.adamw)
    run.rng, run.dropout_rng = rng_from(saved.rng), rng_from(saved.dropout_rng)
    run.step = run.saved_step = saved.step
    run.rows, run.history = list(saved.rows), list(saved.history)
