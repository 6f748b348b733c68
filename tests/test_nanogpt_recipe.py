"""scripts/nanogpt_recipe.py (train_speed.py --nanogpt PATH --data PATH) with a stand-in for nanoGPT: a folder
of its file names whose train.py checks the recipe's flags and saves a model that predicts every character
alike (validation loss log V), so that the suite needs no nanoGPT. The timings themselves are not under test."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from test_scripts import load

pytest.importorskip("torch")

MODEL = '''
from dataclasses import dataclass

import torch


@dataclass
class GPTConfig:
    vocab_size: int = 65


class GPT(torch.nn.Module):
    """Every character alike: the same logits at every position."""

    def __init__(self, config):
        super().__init__()
        print("number of parameters: stand-in")
        self.logits = torch.nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, idx, targets):
        idx.view(-1)  # as nanoGPT's own model, which views its inputs: they must be contiguous
        logits = self.logits.expand(*idx.shape, -1)
        return logits, torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.view(-1))
'''

TRAIN = """
import os, pickle, sys

import torch

from model import GPT, GPTConfig

flags = dict(arg[2:].split("=", 1) for arg in sys.argv[2:])
assert sys.argv[1] == "config/train_shakespeare_char.py", sys.argv
assert flags["device"] == "cpu" and flags["compile"] == "False" and flags["block_size"] == "64", flags
assert flags["n_layer"] == flags["n_head"] == "4" and flags["n_embd"] == "128" and flags["dropout"] == "0.0", flags
assert flags["always_save_checkpoint"] == "True", flags
try:
    import requests
    requests.get("https://example.org")
    sys.exit("a download went through")
except RuntimeError as err:
    assert "nothing is downloaded" in str(err)
with open("data/shakespeare_char/meta.pkl", "rb") as f:
    vocab = pickle.load(f)["vocab_size"]
os.makedirs(flags["out_dir"], exist_ok=True)
model = GPT(GPTConfig(vocab_size=vocab))
saved = {"model": model.state_dict(), "model_args": {"vocab_size": vocab}}
torch.save(saved, os.path.join(flags["out_dir"], "ckpt.pt"))
print(f"step {flags['max_iters']}: train loss 4.1000, val loss 4.2000")
"""

PREPARE = """
import os, pickle

here = os.path.dirname(__file__)
with open(os.path.join(here, "input.txt")) as f:
    chars = sorted(set(f.read()))
with open(os.path.join(here, "meta.pkl"), "wb") as f:
    pickle.dump({"vocab_size": len(chars), "stoi": {c: i for i, c in enumerate(chars)}}, f)
"""


@pytest.fixture
def stand_in(tmp_path: Path) -> Path:
    folder = tmp_path / "nanoGPT"
    (folder / "config").mkdir(parents=True)
    (folder / "data" / "shakespeare_char").mkdir(parents=True)
    (folder / "config" / "train_shakespeare_char.py").write_text("batch_size = 64\n")
    (folder / "data" / "shakespeare_char" / "prepare.py").write_text(PREPARE)
    (folder / "model.py").write_text(MODEL)
    (folder / "train.py").write_text(TRAIN)
    return folder


def test_the_runner_trains_both_and_scores_both_on_the_same_windows(stand_in, tmp_path, capsys):
    text = tmp_path / "input.txt"
    text.write_text("To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n" * 40)
    before = sorted(p.relative_to(stand_in) for p in stand_in.rglob("*"))
    speed, figures = load("train_speed.py"), tmp_path / "recipe.json"
    flags = ["--nanogpt", str(stand_in), "--data", str(text), "--steps", "2", "--eval-windows", "30"]
    assert speed.main([*flags, "--json", str(figures)]) == 0
    out = capsys.readouterr().out
    assert sorted(p.relative_to(stand_in) for p in stand_in.rglob("*")) == before  # the checkout only read
    vocab = len(set(text.read_text()))
    row = json.loads(figures.read_text())["nanogpt"]
    assert row["nanogpt_loss"] == pytest.approx(math.log(vocab), rel=1e-6)  # the stand-in's, on our windows
    assert 0 < row["ours_loss"] < 2 * math.log(vocab) and row["nanogpt_s"] > 0 and row["ours_s"] > 0
    assert re.search(r"^nanoGPT's train.py \(torch, eager\) +[0-9.]+ +[0-9.,]+ +1.00$", out, re.MULTILINE), out
    assert re.search(r"^ours: scripts/train.py --preset tiny +[0-9.]+ +[0-9.,]+ +[0-9.]+$", out, re.MULTILINE), out
    assert "scored on the same 30 windows" in out and "step 2: train loss 4.1000, val loss 4.2000" in out
    assert "--max_iters=2 --lr_decay_iters=2 --eval_interval=2" in out and "number of parameters" not in out


def test_the_runner_needs_both_paths_and_a_checkout(stand_in, tmp_path, capsys):
    speed = load("train_speed.py")
    with pytest.raises(SystemExit):
        speed.parse_args(["--nanogpt", str(stand_in)])
    assert "--nanogpt PATH and --data PATH come together" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        speed.parse_args(["--nanogpt", str(tmp_path), "--data", str(stand_in / "train.py")])
    assert "no train.py and model.py there" in capsys.readouterr().err
    recipe = load("nanogpt_recipe.py")
    assert "--eval_interval" not in " ".join(recipe.nanogpt_command(2000, "out"))  # 250 divides it: the config's
