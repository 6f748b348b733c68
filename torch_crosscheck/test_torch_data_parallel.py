"""One data-parallel training step under mpiexec beside torch's step of the same model over the whole batch.

`mpiexec -n 2` runs data_parallel_worker.py: each process takes half of the batch's rows, and
scripts/train.py's train_step (the step of `train.py --data-parallel`) averages the two halves' gradients
with one Allreduce, clips their global norm and takes AdamW's step; with accumulate 2 (`--accumulate 2`)
each half runs as two slices of one row, their gradients summed first. torch takes one step of the model of
test_torch_gpt.py, from the same weights, on the whole batch. In float64 the loss agrees to 1e-10 relative
and every weight to 1e-10 of its array's largest. Skips without torch, mpi4py or mpiexec.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("mpi4py", reason="mpi4py is missing: the distributed extra")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # run_mpi: mpiexec with a timeout, as tests/ runs it
from test_ring import MPIEXEC, run_mpi  # noqa: E402
from test_torch_gpt import LR, batches, torch_adamw, torch_model, torch_weights  # noqa: E402

from tinyattn_np.gpt import GPT, GPTConfig  # noqa: E402
from tinyattn_np.optim import global_norm, warmup_cosine_lr  # noqa: E402

CLIP, TOLERANCE, SEED = 1.0, 1e-10, 0
CONFIG = GPTConfig(vocab=23, context=16, layers=2, heads=2, width=32, bias=True, dtype="float64")
SETTINGS = {
    "steps": 10,
    "batch": 4,
    "accumulate": 1,
    "lr": LR,
    "min_lr": LR / 10,
    "warmup": 2,
    "weight_decay": 0.1,
    "clip": CLIP,
    "dropout": 0.0,
    "betas": [0.9, 0.95],
    "eps": 1e-8,
}


@pytest.mark.skipif(MPIEXEC is None, reason="mpiexec is missing: the distributed extra")
@pytest.mark.parametrize("accumulate", [1, 2])
def test_one_data_parallel_step_matches_torch_on_the_whole_batch(tmp_path: Path, accumulate: int) -> None:
    idx, targets = batches(CONFIG, SETTINGS["batch"], seed=1)[0]  # (B, T) each
    np.savez(tmp_path / "batch.npz", idx=idx, targets=targets)
    case = {"config": CONFIG.to_dict(), "seed": SEED, "settings": {**SETTINGS, "accumulate": accumulate}}
    (tmp_path / "case.json").write_text(json.dumps(case))
    result = run_mpi(2, str(HERE / "data_parallel_worker.py"), str(tmp_path), timeout=120)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    ours = np.load(tmp_path / "result.npz")

    model = GPT(CONFIG, rng=SEED)  # the weights every process started from
    _, grads = model.loss_and_grads(idx, targets)
    assert global_norm(grads) > CLIP, "clipping would not engage: the test would not check it"
    module = torch_model(model, "cpu")
    optimizer = torch_adamw(module)
    for group in optimizer.param_groups:
        group["lr"] = warmup_cosine_lr(
            0, lr=LR, warmup=SETTINGS["warmup"], total=SETTINGS["steps"], min_lr=SETTINGS["min_lr"]
        )
    loss = module(torch.from_numpy(idx), torch.from_numpy(targets))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(module.parameters(), CLIP)
    optimizer.step()

    assert float(ours["loss"]) == pytest.approx(loss.item(), rel=TOLERANCE, abs=0)
    gold = torch_weights(module, model)
    assert sorted(gold) == sorted(model.params)
    for name, theirs in gold.items():
        assert not np.array_equal(theirs, model.params[name]), f"{name} did not move: the step would check nothing"
        scale = float(np.abs(theirs).max())
        np.testing.assert_allclose(ours[name], theirs, rtol=0, atol=TOLERANCE * scale, err_msg=name)
