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
it records their SHA-256, so that a file changed by hand is found when it is loaded. A write that fails (a
full disk) removes what it began and raises SaveError; what a killed run left (temporaries, arrays no JSON
names) is removed before the next run's first step (prepare_folder). A checkpoint is read whole or refused
in one line that names the file and the field (checkpoint_checks.py): nothing runs from half of one.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import secrets
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from checkpoint_checks import (
    CheckpointError,
    check_moments,
    check_weights,
    count,
    generator_state,
    preset_name,
    read_config,
    read_given,
    read_history,
    read_rows,
    read_tokenizer,
)
from json_fields import FieldError, Fields
from text_data import Data, Tokenizer, rng_from, rng_state
from train_flags import RunError, Settings, fraction

from tinyattn_np import AttentionMemoryError
from tinyattn_np.gpt import GPT, GPTConfig
from tinyattn_np.optim import AdamW

META = "checkpoint.json"
ARRAYS = re.compile(r"checkpoint-\d+\.npz")  # the arrays' file: a plain name in the folder
TEMPORARY = re.compile(r"\.(checkpoint\.json|checkpoint-\d+\.npz)\.\w+(\.tmp)?")  # write_atomically's


class SaveError(OSError):
    """A checkpoint that could not be written (a full disk, a folder made read-only); the message says what
    happened and which checkpoint is kept. Nothing of the attempt is left behind."""


def write_atomically(path: Path, data: bytes) -> None:
    """The bytes at path, written to a temporary file beside it and moved into place in one step. The file gets
    the permissions a new file gets from the user's umask. An OSError removes the temporary before it goes on."""
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # 0o666 less the umask, as open() makes
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # on disk before the name points to it
        os.replace(temporary, path)
    except BaseException:  # a full disk, or Ctrl-C in the middle: no half-written file stays
        temporary.unlink(missing_ok=True)
        raise


def save(folder: str | Path, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> Path:
    """Write arrays and meta (anything JSON can hold) as a checkpoint in folder; return the JSON's path. A
    SaveError, with nothing of this checkpoint left behind, where a file cannot be written."""
    folder = Path(folder)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    data = buffer.getvalue()
    name = f"checkpoint-{int(meta['step']):09d}.npz"
    record = {**meta, "arrays": name, "arrays_sha256": hashlib.sha256(data).hexdigest()}
    try:
        folder.mkdir(parents=True, exist_ok=True)
        write_atomically(folder / name, data)
        write_atomically(folder / META, json.dumps(record, indent=1).encode("utf-8"))
    except OSError as err:
        if not (folder / META).is_file() or read_name(folder) != name:
            (folder / name).unlink(missing_ok=True)  # arrays that no JSON names
        kept = f"the checkpoint of step {read_step(folder)} is kept" if exists(folder) else "no checkpoint is kept"
        reason = err.strerror or str(err)
        raise SaveError(
            f"the checkpoint of step {meta['step']} could not be written to {folder} ({reason}); {kept}"
        ) from None
    for old in folder.glob("checkpoint-*.npz"):  # the arrays that the JSON no longer names
        if old.name != name:
            old.unlink(missing_ok=True)
    return folder / META


def read_name(folder: Path) -> str | None:
    """The arrays' file that folder's checkpoint.json names, None where it names none."""
    try:
        return str(Fields.read(folder / META).get("arrays", str))
    except FieldError:
        return None


def read_step(folder: Path) -> Any:
    """The step of folder's checkpoint, '?' where checkpoint.json says none."""
    try:
        return Fields.read(folder / META).get("step", int)
    except FieldError:
        return "?"


def prepare_folder(folder: str | Path) -> None:
    """Before a run's first step: make --out, make sure a file can be written in it (a SaveError says why not),
    and remove what a run killed while it wrote left there: temporary files, and arrays that checkpoint.json
    does not name."""
    folder = Path(folder)
    probe = folder / f".{META}.{secrets.token_hex(4)}.tmp"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        probe.unlink()
    except OSError as err:
        raise SaveError(f"--out {folder}: a checkpoint cannot be written there ({err.strerror or err})") from None
    named = read_name(folder)
    for path in folder.iterdir():
        if TEMPORARY.fullmatch(path.name) or (ARRAYS.fullmatch(path.name) and named and path.name != named):
            path.unlink(missing_ok=True)


def exists(folder: str | Path) -> bool:
    return (Path(folder) / META).is_file()


def read(folder: str | Path) -> tuple[dict[str, np.ndarray], Fields, Path]:
    """(arrays, meta, the arrays' path) of the checkpoint in folder; a CheckpointError, in one line that names
    the file and the field, where there is none, it was altered, or it is not one that NumPy and JSON read."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: no such folder (train.py --out {folder} writes a checkpoint there)")
    if not exists(folder):
        raise CheckpointError(f"{folder} holds no {META}: it is not a checkpoint (train.py --out {folder} writes one)")
    try:
        meta = Fields.read(folder / META)
        name = meta.get("arrays", str, check=arrays_name)
        sha256 = meta.get("arrays_sha256", str)
    except FieldError as err:
        raise CheckpointError(str(err)) from None
    path = folder / name
    try:
        data = path.read_bytes()
    except OSError as err:
        raise CheckpointError(f"{folder / META}: arrays names {name}, which cannot be read ({err.strerror})") from None
    if hashlib.sha256(data).hexdigest() != sha256:
        raise CheckpointError(f"{path} is not the file that {META} was written with (changed?)")
    return read_npz(path, data), meta, path


def arrays_name(name: str) -> str:
    if not ARRAYS.fullmatch(name):
        raise ValueError("must name a file checkpoint-STEP.npz in the checkpoint's folder")
    return name


def read_npz(path: Path, data: bytes) -> dict[str, np.ndarray]:
    """Every array of an .npz's bytes; a CheckpointError where they are not an .npz of plain arrays."""
    try:
        npz = np.load(io.BytesIO(data), allow_pickle=False)
        if not isinstance(npz, np.lib.npyio.NpzFile):
            raise ValueError("it holds one array, as an .npy does")
        with npz:
            return {name: npz[name] for name in npz.files}
    except (ValueError, TypeError, OSError, EOFError, zipfile.BadZipFile, KeyError) as err:
        raise CheckpointError(f"{path} is not an .npz of plain arrays that NumPy reads ({err})") from None


def load(folder: str | Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """(arrays, meta) of the checkpoint in folder; CheckpointError where there is none or it was altered."""
    arrays, meta, _ = read(folder)
    return arrays, meta.values


def load_model(folder: str | Path) -> tuple[GPT, Tokenizer, dict[str, Any], dict[str, np.ndarray]]:
    """(the GPT, its tokenizer, the meta, every array) of the checkpoint that train.py wrote in folder. A
    CheckpointError, in one line that names the file and the field, where the files do not make that model."""
    arrays, meta, path = read(folder)
    try:
        meta.get("step", int, check=count)
        meta.get("preset", str)
        read_rows(meta)
        config = read_config(meta)
        _, tokenizer = read_tokenizer(meta, config)
    except FieldError as err:
        raise CheckpointError(str(err)) from None
    weights = check_weights(arrays, config, path)
    try:
        model = GPT(config, weights)
    except (ValueError, TypeError, AttentionMemoryError) as err:
        raise CheckpointError(f"the checkpoint in {folder} does not make its model: {err}") from None
    return model, tokenizer, meta.values, arrays


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
    seconds: float  # the steps' time in all, the sessions before a --resume included


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
    seconds: float = 0.0  # their time in all, the sessions before a --resume included
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
        "seconds": run.seconds,
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
    """A run's checkpoint read back and checked: what --resume continues, or what --init-from starts a new run
    from. Every field of checkpoint.json of its type, the settings within the flags' caps, every array the model
    and AdamW need of its shape and dtype: a checkpoint that is not whole is refused before any step."""

    folder: str
    npz: Path  # the arrays' file
    step: int
    seconds: float  # the steps' time in all
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
        """The checkpoint that train.py wrote in folder; a CheckpointError, in one line naming the file and the
        field, says why where it is none."""
        arrays, meta, npz = read(folder)
        try:
            config, rows = read_config(meta), [Row(**row) for row in read_rows(meta)]
            data = meta.object("data")
            saved = Saved(
                folder=folder,
                npz=npz,
                step=meta.get("step", int, check=count),
                seconds=meta.get("seconds", float, default=rows[-1].seconds if rows else 0.0),  # the rows' before
                preset=meta.get("preset", str, check=preset_name),
                config=config,
                tokenizer=read_tokenizer(meta, config)[0],
                given=read_given(meta),
                source=data.get("source", str),
                fingerprint=data.get("fingerprint", str),
                validation=data.get("validation", float, check=lambda value: fraction(repr(value))),
                rows=rows,
                rng=meta.get("rng", str, check=generator_state),
                dropout_rng=meta.get("dropout_rng", str, check=generator_state),
                params=check_weights(arrays, config, npz),
                adamw={name.removeprefix("adamw."): a for name, a in arrays.items() if name.startswith("adamw.")},
                history=read_history(arrays, npz),
            )
            meta.get("seed", int, check=count)
        except FieldError as err:
            raise CheckpointError(str(err)) from None
        check_moments(arrays, saved.params, npz)
        return saved


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
    try:
        run.optimizer.load_state_dict(saved.adamw)  # its scalars checked, and nothing changed if one is wrong
    except (ValueError, TypeError) as err:
        raise CheckpointError(f"{saved.npz}: AdamW's state (the arrays adamw.*): {err}") from None
    run.rng, run.dropout_rng = rng_from(saved.rng), rng_from(saved.dropout_rng)
    run.step = run.saved_step = saved.step
    run.seconds = saved.seconds
    run.rows, run.history = list(saved.rows), list(saved.history)
