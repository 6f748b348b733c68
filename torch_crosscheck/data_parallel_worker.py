"""Run under mpiexec by torch_crosscheck/test_torch_data_parallel.py: one data-parallel training step.

    mpiexec -n P python torch_crosscheck/data_parallel_worker.py FOLDER

FOLDER holds case.json (the model's configuration, the seed of its weights, the step's settings) and
batch.npz (idx, targets: the whole batch, (B, T) each). Every process builds the same model from the seed,
takes its equal slice of the batch's rows and runs scripts/training.py's train_step with the communicator,
as `train.py --data-parallel` does: its loss and gradients on its rows, one Allreduce for their mean,
clipping, AdamW. Rank 0 writes result.npz: the loss ("loss") and every weight after the step (its name).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))  # training.py, the step train.py takes
import training  # noqa: E402
from mpi4py import MPI  # noqa: E402

from tinyattn_np.gpt import GPT, GPTConfig  # noqa: E402
from tinyattn_np.optim import AdamW  # noqa: E402


def main(folder: Path) -> None:
    case = json.loads((folder / "case.json").read_text())
    batch = np.load(folder / "batch.npz")
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    idx, targets = batch["idx"], batch["targets"]  # (B, T) each
    mine = slice(rank * len(idx) // size, (rank + 1) * len(idx) // size)  # train.py's split of the rows
    model = GPT(GPTConfig.from_dict(case["config"]), rng=case["seed"])
    s = case["settings"]
    optimizer = AdamW(model.params, lr=s["lr"], betas=tuple(s["betas"]), eps=s["eps"], weight_decay=s["weight_decay"])
    no_data = np.zeros(0, dtype=np.int64)  # the step reads its batch from the arguments, not from the run's text
    run = training.Run(argparse.Namespace(out=None), "tiny", s, model, optimizer, None, "", "", 0.1, no_data, no_data,
                       np.random.default_rng(0), np.random.default_rng(1))  # fmt: skip
    loss = training.train_step(run, idx[mine], targets[mine], comm)
    if rank == 0:
        np.savez(folder / "result.npz", loss=loss, **model.params)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
