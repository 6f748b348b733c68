"""Run under mpiexec by torch_crosscheck/test_torch_data_parallel.py: one data-parallel training step.

    mpiexec -n P python torch_crosscheck/data_parallel_worker.py FOLDER

FOLDER holds case.json (the model's configuration, the seed of its weights, the step's settings) and
batch.npz (idx, targets: the whole batch, (B, T) each). Every process builds the same model from the seed,
takes its equal slice of the batch's rows and runs scripts/train.py's train_step on the processes of
MPI.COMM_WORLD, as `train.py --data-parallel` does: its loss and gradients on its rows, one Allreduce for their
mean, clipping, AdamW. Rank 0 writes result.npz: the loss ("loss") and every weight after the step (its name).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))  # train.py and the modules beside it
import train  # noqa: E402
from checkpoint import Run  # noqa: E402
from data_parallel import Processes  # noqa: E402
from mpi4py import MPI  # noqa: E402
from text_data import Data  # noqa: E402
from train_flags import Settings  # noqa: E402

from tinyattn_np.gpt import GPT, GPTConfig  # noqa: E402
from tinyattn_np.optim import AdamW  # noqa: E402


def main(folder: Path) -> None:
    case = json.loads((folder / "case.json").read_text())
    batch = np.load(folder / "batch.npz")
    processes = Processes(MPI.COMM_WORLD)
    idx, targets = batch["idx"], batch["targets"]  # (B, T) each
    mine = processes.rows(len(idx))  # train.py's split of the rows
    model = GPT(GPTConfig.from_dict(case["config"]), rng=case["seed"])
    s = case["settings"]
    optimizer = AdamW(model.params, lr=s["lr"], betas=tuple(s["betas"]), eps=s["eps"], weight_decay=s["weight_decay"])
    settings = Settings(
        steps=s["steps"],
        batch=s["batch"],
        accumulate=s["accumulate"],
        lr=s["lr"],
        min_lr=s["min_lr"],
        warmup=s["warmup"],
        beta2=s["betas"][1],
        weight_decay=s["weight_decay"],
        clip=s["clip"],
        dropout=s["dropout"],
        eval_every=s["steps"],
        eval_windows=1,
    )
    no_data = np.zeros(0, dtype=np.int64)  # the step reads its batch from the arguments, not from the run's text
    data = Data(None, "", "", 0.1, no_data, no_data)  # type: ignore[arg-type]  (no tokenizer: no text)
    batches, dropout = np.random.default_rng(0), np.random.default_rng(1)
    run = Run("tiny", settings, model, optimizer, data, case["seed"], batches, dropout)
    loss = train.train_step(run, idx[mine], targets[mine], processes)
    if processes.rank == 0:
        np.savez(folder / "result.npz", loss=loss, **model.params)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
