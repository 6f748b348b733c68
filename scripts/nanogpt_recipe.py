"""nanoGPT's own CPU recipe beside ours: the tiny GPT trained both ways on one text, each run timed from its
start to its exit, and both final models validated on the same windows. train_speed.py --nanogpt PATH --data
PATH runs it (nothing is downloaded: both paths are the user's).

    python scripts/train_speed.py --nanogpt ~/nanoGPT --data input.txt                # 2,000 steps each
    python scripts/train_speed.py --nanogpt ~/nanoGPT --data input.txt --steps 200    # a quick look

nanoGPT (Karpathy, github.com/karpathy/nanoGPT) runs in a temporary copy of the checkout given, never in the
checkout itself: its data/shakespeare_char/prepare.py on the text (copied in as the input.txt it reads, so it
finds nothing to download; a stand-in `requests` module in front of the real one refuses any download all the
same), then its README's CPU recipe (NANOGPT_RECIPE), with out_dir in the copy and always_save_checkpoint=True
so that its checkpoint holds the model of its last evaluation, after --steps steps. Ours is scripts/train.py
--data TEXT --preset tiny --steps N (OURS), with --out in a temporary folder and --sample 0 (nanoGPT samples
nothing). Both take their own threads: torch's (nanoGPT) and our BLAS's.

Both final models are then validated on the same --eval-windows windows of 64 + 1 characters, spread evenly
over the part of the text that both runs held out (nanoGPT's last 10% and ours: --validation's 10%): nanoGPT's
model through its own model.py (GPT(GPTConfig(**model_args)), loss = model(x, y)[1]), ours through
checkpoint.load_model, each window encoded by its model's own character vocabulary.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import machine
import numpy as np
import outputs
import text_data

from tinyattn_np.report import fit_table, positive, table_width

SCRIPTS = Path(__file__).resolve().parent
NANOGPT_RECIPE = [
    "config/train_shakespeare_char.py",
    "--device=cpu",
    "--compile=False",
    "--eval_iters=20",
    "--log_interval=1",
    "--block_size=64",
    "--batch_size=12",
    "--n_layer=4",
    "--n_head=4",
    "--n_embd=128",
    "--dropout=0.0",
]  # + --max_iters and --lr_decay_iters (--steps), out_dir and always_save_checkpoint (nanoGPT's README's CPU run)
EVAL_INTERVAL = 250  # config/train_shakespeare_char.py's: nanoGPT validates (and saves) every 250 steps
CONTEXT, BATCH, VALIDATION = 64, 12, 0.1  # the tiny preset's, and the part of the text both hold out
REFUSE_DOWNLOADS = 'def __getattr__(name):\n    raise RuntimeError("nothing is downloaded")\n'  # requests.py


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The runner's flags, in train_speed.py's parser."""
    p.add_argument("--nanogpt", metavar="PATH", help="a nanoGPT checkout: its CPU recipe beside ours")
    p.add_argument("--data", metavar="PATH", help="--nanogpt: the text both train on (input.txt)")
    p.add_argument("--steps", type=positive(int, 100_000), default=2000, help="--nanogpt: steps of each (default 2000)")
    p.add_argument(
        "--eval-windows",
        type=positive(int, 100_000),
        default=2400,
        help="--nanogpt: validation windows both models are scored on (default 2,400)",
    )


def check_arguments(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--nanogpt and --data come together, as a nanoGPT checkout and a text file."""
    if (args.nanogpt is None) != (args.data is None):
        p.error("--nanogpt PATH and --data PATH come together: a nanoGPT checkout and the text to train on")
    if args.nanogpt is None:
        return
    if not (Path(args.nanogpt) / "train.py").is_file() or not (Path(args.nanogpt) / "model.py").is_file():
        p.error(f"--nanogpt {args.nanogpt}: no train.py and model.py there; give a nanoGPT checkout")
    if not Path(args.data).is_file():
        p.error(f"--data {args.data}: no such file; give a text file (tiny Shakespeare's input.txt)")


def nanogpt_command(steps: int, out_dir: str) -> list[str]:
    """nanoGPT's recipe for `steps` steps, its checkpoint written to out_dir at its last evaluation: every
    EVAL_INTERVAL steps (its config's) where that divides `steps`, else once, after the last."""
    iters = [f"--max_iters={steps}", f"--lr_decay_iters={steps}"]
    iters += [] if steps % EVAL_INTERVAL == 0 else [f"--eval_interval={steps}"]
    return ["train.py", *NANOGPT_RECIPE, *iters, f"--out_dir={out_dir}", "--always_save_checkpoint=True"]


def our_command(data: str, steps: int, out_dir: str) -> list[str]:
    """scripts/train.py's tiny run for `steps` steps, its checkpoint in out_dir."""
    flags = ["--data", data, "--preset", "tiny", "--steps", str(steps), "--out", out_dir, "--sample", "0"]
    return [str(SCRIPTS / "train.py"), *flags]


def copy_nanogpt(checkout: Path, text: Path, into: Path) -> Path:
    """A copy of the checkout's files (no .git, no data made before) with the text as the Shakespeare input."""
    copy = into / "nanogpt"
    shutil.copytree(checkout, copy, ignore=shutil.ignore_patterns(".git", "*.bin", "*.pkl", "out*", "input.txt"))
    shutil.copyfile(text, copy / "data" / "shakespeare_char" / "input.txt")
    (into / "no_downloads").mkdir()
    (into / "no_downloads" / "requests.py").write_text(REFUSE_DOWNLOADS)
    return copy


def timed_run(command: list[str], cwd: Path, log: Path, env: dict[str, str] | None = None) -> float:
    """Run `python command` in cwd, its output into log; the wall seconds from its start to its exit. A
    failed run raises RuntimeError with the end of its log."""
    started = time.perf_counter()
    with open(log, "w", encoding="utf-8") as out:
        done = subprocess.run([sys.executable, *command], cwd=cwd, stdout=out, stderr=subprocess.STDOUT, env=env)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        tail = "\n".join(log.read_text(encoding="utf-8", errors="replace").splitlines()[-15:])
        raise RuntimeError(f"{' '.join(command[:2])} in {cwd} failed (exit {done.returncode}):\n{tail}")
    return seconds


def held_out(text: str) -> tuple[int, str]:
    """(first character, the text from there): the part that both runs held out, nanoGPT's last 10%
    (data[int(0.9 n):]) and ours (the last round(0.1 n) tokens of a character vocabulary)."""
    start = max(int(len(text) * (1 - VALIDATION)), len(text) - int(round(len(text) * VALIDATION)))
    return start, text[start:]


def validation_loss(loss_of: Any, ids: np.ndarray, count: int) -> float:
    """The mean of loss_of(x, y) over `count` windows spread evenly over ids (text_data.fixed_batches)."""
    batches = text_data.fixed_batches(ids, count, BATCH, CONTEXT)
    return sum(loss_of(x, y) * len(x) for x, y in batches) / sum(len(x) for x, _ in batches)


def nanogpt_loss(copy: Path, out_dir: Path, held: str, count: int) -> float:
    """nanoGPT's final model on the windows, through its own model.py and its vocabulary (meta.pkl)."""
    import torch

    spec = importlib.util.spec_from_file_location("nanogpt_model", copy / "model.py")
    assert spec is not None and spec.loader is not None
    nano = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(nano)
    saved = torch.load(out_dir / "ckpt.pt", map_location="cpu")
    with contextlib.redirect_stdout(io.StringIO()):  # its line on the parameters, printed by the run already
        model = nano.GPT(nano.GPTConfig(**saved["model_args"]))
    model.load_state_dict(saved["model"])
    model.eval()
    with open(copy / "data" / "shakespeare_char" / "meta.pkl", "rb") as f:
        stoi = pickle.load(f)["stoi"]
    ids = np.array([stoi[c] for c in held], np.int64)

    def loss_of(x: np.ndarray, y: np.ndarray) -> float:
        with torch.no_grad():
            x_t, y_t = (torch.from_numpy(np.ascontiguousarray(a)) for a in (x, y))  # (B, T) each: its views need rows
            return float(model(x_t, y_t)[1].item())

    return validation_loss(loss_of, ids, count)


def our_loss(out_dir: Path, held: str, count: int) -> float:
    """Our final model on the windows, through its checkpoint and its tokenizer."""
    import checkpoint

    model, tokenizer, _, _ = checkpoint.load_model(out_dir)
    return validation_loss(model.loss, tokenizer.encode(held).astype(np.int64), count)


def nanogpt_val_line(log: Path) -> str:
    """nanoGPT's own last "step N: train loss .., val loss .." line (its --eval_iters random batches)."""
    lines = [line for line in log.read_text(encoding="utf-8", errors="replace").splitlines() if "val loss" in line]
    return lines[-1].strip() if lines else "(none printed)"


def run_both(args: argparse.Namespace) -> dict[str, Any]:
    """Both runs, nanoGPT's first, in a temporary folder; both losses on the same windows, both wall times."""
    text, python_path = Path(args.data).read_text(encoding="utf-8"), os.environ.get("PYTHONPATH", "")
    start, held = held_out(text)
    with tempfile.TemporaryDirectory(prefix="nanogpt_recipe_") as folder:
        work = Path(folder)
        copy = copy_nanogpt(Path(args.nanogpt), Path(args.data), work)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(work / "no_downloads"), python_path]))}
        outputs.progress("nanoGPT: data/shakespeare_char/prepare.py")
        timed_run(["data/shakespeare_char/prepare.py"], copy, work / "prepare.log", env)
        outputs.progress(f"nanoGPT: train.py, {args.steps:,} steps")
        nano_s = timed_run(nanogpt_command(args.steps, str(work / "nano_out")), copy, work / "nanogpt.log", env)
        outputs.progress(f"ours: scripts/train.py, {args.steps:,} steps")
        ours_s = timed_run(our_command(args.data, args.steps, str(work / "ours")), work, work / "ours.log")
        outputs.progress(f"validating both on {args.eval_windows:,} windows")
        nano_loss = nanogpt_loss(copy, work / "nano_out", held, args.eval_windows)
        ours = our_loss(work / "ours", held, args.eval_windows)
        own_line = nanogpt_val_line(work / "nanogpt.log")
    row = {"steps": args.steps, "characters": len(text), "held_out_from": start, "windows": args.eval_windows}
    row.update(nanogpt_s=nano_s, ours_s=ours_s, nanogpt_loss=nano_loss, ours_loss=ours, nanogpt_own=own_line)
    return row


def print_both(row: dict[str, Any], args: argparse.Namespace) -> None:
    windows_used = min(args.eval_windows, row["characters"] - row["held_out_from"] - CONTEXT)
    print(
        f"\nnanoGPT's CPU recipe beside ours: {row['steps']:,} steps each of the tiny GPT (4 layers, 4 heads, width "
        f"128, context 64, batch 12)\non {args.data} ({row['characters']:,} characters); both final models scored on "
        f"the same {windows_used:,} windows\nof characters {row['held_out_from']:,} on (held out by both)"
    )
    ratio = row["ours_s"] / row["nanogpt_s"]
    body = [
        ["nanoGPT's train.py (torch, eager)", f"{row['nanogpt_loss']:.4f}", f"{row['nanogpt_s']:,.1f}", "1.00"],
        ["ours: scripts/train.py --preset tiny", f"{row['ours_loss']:.4f}", f"{row['ours_s']:,.1f}", f"{ratio:.2f}"],
    ]
    headers = ["run", "validation loss", "wall s", "wall / nanoGPT's"]
    print(fit_table(body, headers, fmt=args.format, width=table_width(args)))
    print(f"nanoGPT's own last evaluation (--eval_iters=20 random batches): {row['nanogpt_own']}")
    print(f"nanoGPT: python train.py {' '.join(nanogpt_command(args.steps, 'OUT')[1:])}")
    print(f"ours:    python scripts/train.py {' '.join(our_command(args.data, args.steps, 'OUT')[1:])}")


def main_recipe(args: argparse.Namespace) -> tuple[dict[str, Any], bool]:
    """--nanogpt: the header, both runs, the table; (the figures, whether Ctrl-C stopped it)."""
    import torch

    info, lines = machine.header(torch.__version__, torch.get_num_threads())
    print(lines)
    try:
        row = run_both(args)
    except KeyboardInterrupt:
        return {"machine": info, "args": vars(args), "nanogpt": None}, True
    print_both(row, args)
    return {"machine": info, "args": vars(args), "nanogpt": row}, False
