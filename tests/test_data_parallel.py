"""scripts/data_parallel.py under mpiexec: the processes of train.py --data-parallel agree on the run before the
first step, or refuse together with the reason that rank 0 prints. A process that cannot start (its --data
missing or empty), or that would start another run (other --steps, --eval-every, text, --seed or vocabulary),
never leaves the others waiting for it, nor trains other weights beside them without a word; an unexpected
error on one process at the start ends the whole job (MPI_Abort). Every job runs under run_mpi's timeout."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from test_train import WRAPPER, gpt_flags, small_text

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("mpi4py") is None, reason="mpi4py is missing: the distributed extra"
)


@pytest.fixture
def mpi():  # run_mpi, where mpiexec is there
    from test_ring import MPIEXEC, run_mpi

    if MPIEXEC is None:
        pytest.skip("mpiexec is missing: the distributed extra")
    return run_mpi


def two_processes(tmp_path: Path, rank_0: list[str], rank_1: list[str], script: str = WRAPPER) -> list[str]:
    """run_mpi(1, ...)'s arguments for a job of two ranks, rank 0 and rank 1 each with its own flags (MPMD:
    mpiexec -n 1 python a : -n 1 python b)."""
    path = tmp_path / "train_small.py"
    path.write_text(script)
    second = ["-n", "1", sys.executable, str(path), *rank_1, "--data-parallel"]  # after mpiexec's ':'
    return [str(path), *rank_0, "--data-parallel", ":", *second]


@pytest.fixture
def texts(tmp_path: Path) -> dict[str, Path]:
    paths = {"text": tmp_path / "text.txt", "other": tmp_path / "other.txt", "empty": tmp_path / "empty.txt"}
    paths["text"].write_text(small_text(), encoding="utf-8")
    paths["other"].write_text(small_text(seed=1), encoding="utf-8")
    paths["empty"].write_text("")
    return paths


FAULTS = {  # rank 1's flags beside rank 0's gpt_flags(text) -> what rank 0 says
    "--data missing": (["--data", "{missing}"], "rank 1 of 2: --data {missing}: no such file"),
    "--data empty": (["--data", "{empty}"], "rank 1 of 2: --data {empty} is empty"),
    "other --steps": (["--steps", "12"], "the processes disagree on --steps: rank 0 has 8, rank 1 has 12"),
    "other --eval-every": (["--eval-every", "2"], "the processes disagree on --eval-every: rank 0 has 4, rank 1 has 2"),
    "other text": (["--data", "{other}"], "the processes disagree on the text (its fingerprint)"),
    "other --seed": (["--seed", "1"], "the processes disagree on --seed: rank 0 has 0, rank 1 has 1"),
    "other vocabulary": (["--tokenizer", "byte"], "the processes disagree on the vocabulary: rank 0 has 15 tokens"),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_processes_that_would_not_run_the_same_run_refuse_together(
    fault: str, mpi, texts: dict[str, Path], tmp_path: Path
) -> None:
    more, message = FAULTS[fault]
    names = {"missing": str(tmp_path / "missing.txt"), "empty": str(texts["empty"]), "other": str(texts["other"])}
    rank_1 = [*gpt_flags(texts["text"]), *(flag.format(**names) for flag in more)]
    result = mpi(1, *two_processes(tmp_path, gpt_flags(texts["text"]), rank_1), timeout=90)
    assert result.returncode == 2, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    assert f"train.py: error: {message.format(**names)}" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and "step " not in result.stdout, result.stdout + result.stderr


def test_an_unexpected_error_at_one_process_start_ends_the_job(mpi, texts: dict[str, Path], tmp_path: Path) -> None:
    """An error that is no refusal (a bug, a MemoryError) on one process while it starts: printed with its rank,
    and MPI_Abort ends every process, where the others would wait for it forever."""
    failing = WRAPPER.replace(
        "sys.exit(train.main",
        "from tinyattn_np.mpi_job import load_mpi\nif load_mpi().COMM_WORLD.Get_rank() == 1:\n"
        "    train.GPT = None  # calling it raises TypeError\nsys.exit(train.main",
    )
    flags = gpt_flags(texts["text"])
    result = mpi(1, *two_processes(tmp_path, flags, flags, script=failing), timeout=90)
    assert result.returncode == 1, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    assert "rank 1 of 2: train.py --data-parallel failed: TypeError" in result.stderr, result.stderr
