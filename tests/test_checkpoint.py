"""scripts/checkpoint.py, through the three programs that read a checkpoint (train.py --resume, train.py
--init-from, sample.py): every array the model needs is there, of its shape and dtype, and finite, or the run is
refused; a checkpoint edited by hand or written by something else is one line naming the file and the field,
never a traceback; the settings read back pass the flags' own caps; a checkpoint that cannot be written says so
before the first step or, on a full disk, removes what it began; SIGTERM saves as Ctrl-C does; the files follow
the user's umask."""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import re
import shutil
import signal
import stat
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_scripts import load
from test_train import gpt_flags, signal_a_run, small_text, train_script

from tinyattn_np.gpt import GPTConfig

sample = load("sample.py")
checkpoint = sys.modules["checkpoint"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint of test_train's small model after 8 steps, and its text beside it."""
    train_flags = sys.modules["train_flags"]
    folder = tmp_path_factory.mktemp("trained")
    (folder / "text.txt").write_text(small_text(), encoding="utf-8")
    small = train_flags.Preset(GPTConfig(vocab=65, context=16, layers=2, heads=2, width=16), 4, 1e-2, 2, 0.99)
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(train_flags.PRESETS, "tiny", small)
        assert train_script.main(gpt_flags(folder / "text.txt", folder / "run")) == 0
    return folder


@pytest.fixture
def small(monkeypatch: pytest.MonkeyPatch) -> None:
    """test_train's small model as the tiny preset, as the trained checkpoint was made."""
    train_flags = sys.modules["train_flags"]
    small = train_flags.Preset(GPTConfig(vocab=65, context=16, layers=2, heads=2, width=16), 4, 1e-2, 2, 0.99)
    monkeypatch.setitem(train_flags.PRESETS, "tiny", small)


def edited(
    trained: Path,
    folder: Path,
    arrays: Callable[[dict[str, Any]], None] | None = None,
    meta: Callable[[dict[str, Any]], None] | None = None,
) -> Path:
    """A copy of the trained checkpoint in folder with its arrays changed (written again by checkpoint.save, so
    that their SHA-256 is recorded again) or its JSON changed by hand."""
    saved_arrays, saved_meta = checkpoint.load(trained / "run")
    saved_meta = {k: v for k, v in saved_meta.items() if k not in ("arrays", "arrays_sha256")}
    if arrays:
        arrays(saved_arrays)
    checkpoint.save(folder, saved_arrays, saved_meta)
    if meta:
        written = json.loads((folder / "checkpoint.json").read_text())
        meta(written)
        (folder / "checkpoint.json").write_text(json.dumps(written))
    return folder


def refused_by_all_three(
    trained: Path, folder: Path, capsys: pytest.CaptureFixture[str], programs: int = 3
) -> list[str]:
    """Run train.py --resume, train.py --init-from and sample.py (the first `programs` of them) on the checkpoint
    in folder; each must exit 2 with one line on stderr, no traceback and no step. Returns the lines."""
    text = trained / "text.txt"
    runs = {
        "train.py --resume": lambda: train_script.main(gpt_flags(text, folder, "--resume", "--steps", "12")),
        "train.py --init-from": lambda: train_script.main(
            gpt_flags(text, folder.parent / "new", "--init-from", str(folder))
        ),
        "sample.py": lambda: sample.main([str(folder), "--tokens", "4"]),
    }
    lines = []
    for name, call in list(runs.items())[:programs]:
        capsys.readouterr()
        code = call()
        out, err = capsys.readouterr()
        assert code == 2, f"{name}: exit {code}\n{out}\n{err}"
        assert len(err.splitlines()) == 1 and "Traceback" not in err, f"{name}:\n{err}"
        assert "step" not in out, f"{name} ran steps:\n{out}"
        lines.append(err)
    shutil.rmtree(folder.parent / "new", ignore_errors=True)
    return lines


# --- every array the model needs ------------------------------------------------------------------


def drop(name: str) -> Callable[[dict[str, Any]], None]:
    return lambda arrays: arrays.pop(name)


def change(name: str, value: Callable[[np.ndarray], np.ndarray]) -> Callable[[dict[str, Any]], None]:
    def edit(arrays: dict[str, Any]) -> None:
        arrays[name] = value(arrays[name])

    return edit


def keep_only(*names: str) -> Callable[[dict[str, Any]], None]:
    def edit(arrays: dict[str, Any]) -> None:
        for name in [n for n in arrays if n not in names]:
            arrays.pop(name)

    return edit


ARRAY_EDITS = {
    "no arrays but the history": (keep_only("history"), "param.wte"),
    "a weight missing": (drop("param.h.1.attn.w_qkv"), "param.h.1.attn.w_qkv"),
    "a weight of another shape": (change("param.ln_f.gain", lambda a: a[:-1]), "param.ln_f.gain"),
    "a weight of ints": (change("param.wte", lambda a: a.astype(np.int32)), "param.wte"),
    "a weight of float64": (change("param.wte", lambda a: a.astype(np.float64)), "param.wte"),
    "a weight gone NaN": (change("param.h.0.mlp.w_fc", lambda a: a * np.nan), "param.h.0.mlp.w_fc"),
    "an unexpected array": (lambda arrays: arrays.update({"param.extra": np.zeros(3, np.float32)}), "param.extra"),
    "a moment missing": (drop("adamw.v.wte"), "adamw.v.wte"),
    "a moment of another shape": (change("adamw.m.wte", lambda a: a[:2]), "adamw.m.wte"),
    "a negative second moment": (change("adamw.v.wte", lambda a: -a - 1), "adamw.v.wte"),
    "the history of another shape": (change("history", lambda a: a[:, :1]), "history"),
}


@pytest.mark.parametrize("edit", sorted(ARRAY_EDITS))
def test_a_checkpoint_without_its_arrays_is_refused_by_name(
    edit: str, trained: Path, small: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every array the model and AdamW need, present, of its shape and dtype, finite: else train.py (both ways)
    refuses the checkpoint before any step, in one line naming the .npz and the array; sample.py, which reads
    the weights alone, refuses a checkpoint whose weights are wrong."""
    change_arrays, name = ARRAY_EDITS[edit]
    folder = edited(trained, tmp_path / "ckpt", arrays=change_arrays)
    if name.startswith("param."):
        lines = refused_by_all_three(trained, folder, capsys)
    else:
        lines = refused_by_all_three(trained, folder, capsys, programs=2)
    for line in lines:
        assert re.search(r"checkpoint-\d+\.npz", line) and f"{name!r}" in line, line


def test_adamws_scalars_are_checked_before_any_step(
    trained: Path, small: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """AdamW's learning rate NaN or a negative step count in the .npz: --resume refuses it in one line that
    names the .npz (AdamW.load_state_dict's checks, nothing changed), before any step."""
    for name, value in (("adamw.lr", np.nan), ("adamw.t", -3)):
        folder = edited(trained, tmp_path / name, arrays=change(name, lambda a, v=value: np.full_like(a, v)))
        assert train_script.main(gpt_flags(trained / "text.txt", folder, "--resume", "--steps", "12")) == 2
        out, err = capsys.readouterr()
        assert "AdamW's state (the arrays adamw.*)" in err and len(err.splitlines()) == 1, err
        assert "Traceback" not in err and "\n      4 " not in out


# --- a checkpoint edited by hand --------------------------------------------------------------------


def set_field(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """An edit that sets meta's field at a dotted path (a.b.c) to value, or removes it (value DELETE)."""

    def edit(meta: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        for part in parents:
            meta = meta[part]
        if value is DELETE:
            meta.pop(last)
        else:
            meta[last] = value

    return edit


DELETE = object()
FIELD_EDITS = [
    ("step", "8"),
    ("step", -1),
    ("step", DELETE),
    ("preset", "huge"),
    ("preset", 3),
    ("config", [1, 2]),
    ("config.width", "16"),
    ("config.layers", 10**6),
    ("config.depth", 3),
    ("config", DELETE),
    ("settings", DELETE),
    ("settings.given", "lr"),
    ("settings.given.eval_every", 0),
    ("settings.given.batch", 10**9),
    ("settings.given.lr", "fast"),
    ("settings.given.lr", True),
    ("settings.given.steps", 1.5),
    ("settings.given.speed", 3),
    ("tokenizer", DELETE),
    ("tokenizer.kind", "words"),
    ("tokenizer.chars", 12),
    ("tokenizer.chars", "abc"),
    ("seed", -3),
    ("rows", {"step": 0}),
    ("rows", [{"step": 0}]),
    ("data", DELETE),
    ("data.fingerprint", None),
    ("data.validation", 2.0),
    ("rng", "{}"),
    ("rng", DELETE),
    ("dropout_rng", 7),
]


SAMPLE_READS = ("step", "config", "tokenizer", "rows")  # and the preset's name, as a label


@pytest.mark.parametrize(
    ("field", "value"), FIELD_EDITS, ids=[f"{f}={'deleted' if v is DELETE else v!r}" for f, v in FIELD_EDITS]
)
def test_a_field_of_the_wrong_type_or_missing_is_one_line_naming_it(
    field: str, value: Any, trained: Path, small: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """train.py refuses the edited checkpoint (--resume and --init-from alike) before any step, in one line that
    names checkpoint.json and the field, with no KeyError text; sample.py too where it reads the field. A stored
    batch of 10^9 is refused by the flag's own cap, at once."""
    folder = edited(trained, tmp_path / "ckpt", meta=set_field(field, value))
    read_by_sample = field.split(".")[0] in SAMPLE_READS or (field == "preset" and value == 3)
    started = time.monotonic()
    lines = refused_by_all_three(trained, folder, capsys, programs=3 if read_by_sample else 2)
    assert time.monotonic() - started < 30
    for line in lines:
        assert "checkpoint.json" in line and field in line, line
        assert "KeyError" not in line and not re.search(r": '\w+'$", line.strip()), line  # no bare KeyError text


def rewrite_json(folder: Path, text: bytes) -> None:
    (folder / "checkpoint.json").write_bytes(text)


@pytest.mark.parametrize(
    ("what", "message"),
    [
        ("nested", "checkpoint.json"),
        ("not an object", "checkpoint.json"),
        ("not UTF-8", "checkpoint.json"),
        ("not JSON", "checkpoint.json"),
        ("arrays outside the folder", "arrays"),
        ("arrays a folder", "arrays"),
        ("an npz that is not one", ".npz"),
        ("an npy", ".npz"),
        ("an npz of objects", ".npz"),
    ],
)
def test_a_foreign_file_is_one_line_naming_it(
    what: str, message: str, trained: Path, small: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = edited(trained, tmp_path / "ckpt")
    meta = json.loads((folder / "checkpoint.json").read_text())

    def record(name: str, data: bytes) -> None:  # arrays whose SHA-256 the JSON records: only their kind is wrong
        (folder / name).write_bytes(data)
        rewrite_json(
            folder, json.dumps({**meta, "arrays": name, "arrays_sha256": hashlib.sha256(data).hexdigest()}).encode()
        )

    if what == "nested":
        rewrite_json(folder, b"[" * 100_000 + b"]" * 100_000)  # RecursionError in json.loads
    elif what == "not an object":
        rewrite_json(folder, b"[1, 2, 3]")
    elif what == "not UTF-8":
        rewrite_json(folder, b'{"step": "\xff"}')
    elif what == "not JSON":
        rewrite_json(folder, b'{"step": 8,')
    elif what == "arrays outside the folder":
        rewrite_json(folder, json.dumps({**meta, "arrays": "../text.txt"}).encode())
    elif what == "arrays a folder":
        (folder / "sub").mkdir()
        rewrite_json(folder, json.dumps({**meta, "arrays": "sub"}).encode())
    elif what == "an npz that is not one":
        record("checkpoint-000000008.npz", b"not a zip file at all")
    elif what == "an npy":
        buffer = io.BytesIO()
        np.save(buffer, np.zeros(3))
        record("checkpoint-000000008.npz", buffer.getvalue())
    else:
        buffer = io.BytesIO()
        np.savez(buffer, history=np.array([None, 1], dtype=object))
        record("checkpoint-000000008.npz", buffer.getvalue())
    for line in refused_by_all_three(trained, folder, capsys):
        assert message in line, line


# --- --out, a full disk, a killed run, SIGTERM, the umask ----------------------------------------------


def test_an_out_that_cannot_be_written_is_refused_before_the_first_step(
    trained: Path, small: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    assert train_script.main(gpt_flags(trained / "text.txt", a_file / "run")) == 2
    out, err = capsys.readouterr()
    assert err.startswith(f"train.py: error: --out {a_file / 'run'}: ") and len(err.splitlines()) == 1, err
    assert "step" not in out, out
    if os.geteuid() != 0:  # root writes into a read-only folder all the same
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o555)
        assert train_script.main(gpt_flags(trained / "text.txt", locked)) == 2
        assert "--out" in capsys.readouterr().err


def test_a_full_disk_removes_the_temporary_and_keeps_the_last_checkpoint(
    trained: Path, small: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The checkpoint of step 4 meets a full disk (the write fails with ENOSPC): the run stops with one line
    that says so, the half-written file is gone, and step 0's checkpoint is still whole."""
    out = tmp_path / "run"
    real_fsync, writes = os.fsync, []

    def fsync(fd: int) -> None:
        writes.append(fd)
        if len(writes) > 2:  # step 0's two files are written; the next one meets a full disk
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    assert train_script.main(gpt_flags(trained / "text.txt", out)) == 1
    err = capsys.readouterr().err
    assert "No space left on device" in err and "step 0" in err and "Traceback" not in err, err
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-000000000.npz", "checkpoint.json"]
    assert checkpoint.load(out)[1]["step"] == 0


def test_a_temporary_left_by_a_killed_run_is_cleaned_on_the_next_start(
    trained: Path, small: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = edited(trained, tmp_path / "run")
    litter = [".checkpoint.json.k3x9", ".checkpoint-000000012.npz.q1w2", "checkpoint-000000012.npz"]
    for name in litter:
        (folder / name).write_bytes(b"half a file")
    (folder / "notes.txt").write_text("mine")  # not the checkpoint's: stays
    assert train_script.main(gpt_flags(trained / "text.txt", folder, "--resume", "--steps", "12")) == 0
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["checkpoint-000000012.npz", "checkpoint.json", "notes.txt"], names
    assert checkpoint.load(folder)[1]["step"] == 12


def test_sigterm_saves_a_checkpoint_and_says_so(trained: Path, tmp_path: Path) -> None:
    """kill (SIGTERM, as systemd and a batch scheduler's time limit send) stops the run after its step, keeps a
    checkpoint of where it stopped and says so, as Ctrl-C does; the exit status is 143 (128 + SIGTERM)."""
    code, stdout, stderr, out = signal_a_run(trained / "text.txt", tmp_path, signal.SIGTERM)
    assert code == 143 and "Traceback" not in stderr, stderr
    done = int(re.search(r"terminated \(SIGTERM\) after (\d+) of 100000 steps", stdout).group(1))
    assert done >= 1 and checkpoint.load(out)[1]["step"] == done
    assert f"checkpoint: {out} (step {done})" in stdout


def test_the_files_follow_the_users_umask(trained: Path, small: None, tmp_path: Path) -> None:
    before = os.umask(0o022)
    try:
        checkpoint.save(tmp_path / "run", {"history": np.zeros((0, 2))}, {"step": 0})
    finally:
        os.umask(before)
    for path in (tmp_path / "run").iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, (path.name, oct(path.stat().st_mode))


@pytest.mark.parametrize("config", [{"layers": 1024, "width": 65536, "heads": 2}, {"vocab": 10**9}])
def test_a_configuration_too_large_is_one_line(
    config: dict[str, int], trained: Path, small: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A checkpoint.json whose model would not fit (its weights alone, by arithmetic): one line, no traceback,
    from train.py (both ways) and sample.py, before anything of the model's size is made."""
    folder = edited(trained, tmp_path / "ckpt", meta=lambda meta: meta["config"].update(config))
    for line in refused_by_all_three(trained, folder, capsys):
        assert "checkpoint" in line, line


def test_weights_whose_logits_overflow_are_one_line_from_sample(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Finite weights so large that the logits overflow float32: sampling refuses a row it cannot draw from
    (tinyattn_np.sampling), and sample.py says so in one line, exit 1, with no traceback."""
    folder = edited(trained, tmp_path / "ckpt", arrays=change("param.wte", lambda a: np.sign(a) * np.float32(3e38)))
    assert sample.main([str(folder), "--tokens", "4"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("sample.py: error: ") and len(err.splitlines()) == 1 and "Traceback" not in err, err


def test_a_resumed_tokenizer_that_cannot_spell_the_text_names_the_checkpoint(
    trained: Path, small: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A checkpoint whose characters were edited (as many, others): --resume's message names the checkpoint's
    folder, not a flag that was not given ('--init-from None')."""
    folder = edited(trained, tmp_path / "ckpt", meta=lambda meta: meta["tokenizer"].update(chars="ABCDEFGHIJKLMNO"))
    assert train_script.main(gpt_flags(trained / "text.txt", folder, "--resume", "--steps", "12")) == 2
    err = capsys.readouterr().err
    assert f"the checkpoint in {folder}: its tokenizer cannot spell" in err and "None" not in err, err
