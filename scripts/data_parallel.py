"""train.py's processes: under mpiexec with --data-parallel each process takes an equal slice of every batch's
rows, and one Allreduce makes every process's gradients the mean over all of them; without the flag one
process takes the whole batch and nothing is exchanged. Each process's loss and gradients are the means over
its equal share of the batch, so their mean is the whole batch's: the same losses as one process, to float32
rounding. Before the first step the processes agree on the run (start_together): the settings, the seed,
the text's fingerprint, the vocabulary, the model, the step and the weights' and generators' states; a process
that cannot start, or one that would start another run, is said by rank 0 and every process refuses, where
one process alone would leave the others waiting for it forever or train other weights without a word. And
the split's speed: a step on the processes against one process with the whole batch.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict
from typing import Any

import machine
import numpy as np
import outputs
import text_data
from checkpoint import CheckpointError, Run, SaveError
from train_flags import RunError

from tinyattn_np.mpi_job import StopTogether, abort_on_failure, idle_wait, load_mpi

START_ERRORS = (text_data.DataError, CheckpointError, SaveError, RunError)  # what refuses a start, in one line


class Processes:
    """This process among --data-parallel's: its rank and their number (0 of 1 without MPI), and what they do
    together: average the gradients, add up a sum, agree to stop after the same step."""

    def __init__(self, comm: Any = None):
        self.comm = comm  # MPI.COMM_WORLD, or None for one process alone
        self.rank, self.size = (comm.Get_rank(), comm.Get_size()) if comm is not None else (0, 1)
        self.allreduce_seconds: list[float] = []  # the time of each step's Allreduce

    @staticmethod
    def of(args: argparse.Namespace) -> Processes:
        """MPI.COMM_WORLD's processes with --data-parallel, else this one alone; where mpi4py is missing, the
        install line and exit 2 (outputs.needs)."""
        if not args.data_parallel:
            return Processes()
        try:
            return Processes(load_mpi().COMM_WORLD)
        except ImportError as err:
            outputs.needs(f"--data-parallel {err}")

    def start_together(self, start: Callable[[], Run]) -> Run:
        """start() on every process, and the run it made, agreed on: a START_ERRORS error on any process, or
        runs that differ (run_summary), raise the same RunError on every process, which rank 0 says. Anything
        else that fails on one process ends the job (abort_on_failure): never a rank left waiting."""
        if self.comm is None:
            return start()
        with self.guard():
            try:
                run = start()
                report: dict[str, Any] | str = run_summary(run)
            except START_ERRORS as err:
                run, report = None, str(err)
            reports = self.comm.allgather(report)
        failed = {rank: report for rank, report in enumerate(reports) if isinstance(report, str)}
        if failed:
            raise RunError("; ".join(f"rank {rank} of {self.size}: {message}" for rank, message in failed.items()))
        for label in reports[0]:
            values = [report[label] for report in reports]
            other = next((rank for rank, value in enumerate(values) if value != values[0]), None)
            if other is not None:
                raise RunError(
                    f"the processes disagree on {label}: rank 0 has {values[0]}, rank {other} has {values[other]}; "
                    "start every process with the same flags and files"
                )
        assert run is not None
        return run

    def from_rank_0(self, value: Any) -> Any:
        """Rank 0's value, on every process (alone: value)."""
        return value if self.comm is None else self.comm.bcast(value, root=0)

    def rows(self, batch: int) -> slice:
        """This process's rows of a batch: an equal share, in rank order."""
        return slice(self.rank * batch // self.size, (self.rank + 1) * batch // self.size)

    def mean(self, loss: float, grads: dict[str, np.ndarray]) -> float:
        """Every gradient, in place, and the loss: the mean over the processes, with one Allreduce of one
        buffer (alone: as they are)."""
        if self.comm is None:
            return loss
        MPI = load_mpi()
        start = time.perf_counter()
        flat = np.concatenate([g.ravel() for g in grads.values()])  # (number of parameters,)
        self.comm.Allreduce(MPI.IN_PLACE, flat, op=MPI.SUM)
        flat /= self.size
        offset = 0
        for g in grads.values():
            g[...] = flat[offset : offset + g.size].reshape(g.shape)
            offset += g.size
        self.allreduce_seconds.append(time.perf_counter() - start)
        return float(self.comm.allreduce(loss, op=MPI.SUM)) / self.size

    def total(self, value: float) -> float:
        """The sum of every process's value (alone: value)."""
        return value if self.comm is None else self.comm.allreduce(value, op=load_mpi().SUM)

    def stop(self, ctrl_c: StopTogether) -> bool:
        """Whether Ctrl-C was pressed on any process (every process asks at the same point of its loop)."""
        return ctrl_c.stop(self.comm) if self.comm is not None else ctrl_c.pressed

    def guard(self) -> AbstractContextManager[Any]:
        """A failure on one process ends every process (the others would wait for it forever)."""
        return abort_on_failure(self.comm, "train.py --data-parallel") if self.comm is not None else nullcontext()


def run_summary(run: Run) -> dict[str, Any]:
    """What every process of a run must share, by the name a message gives it: each setting (by its flag), the
    seed, the text, the vocabulary, the model, the step, and the SHA-256 of the weights and of the generators'
    states (the same batches on every process, each taking its rows)."""
    settings = {f"--{name.replace('_', '-')}": value for name, value in asdict(run.settings).items() if name != "given"}
    weights = hashlib.sha256(b"".join(np.ascontiguousarray(p).tobytes() for p in run.model.params.values()))
    vocabulary = hashlib.sha256(repr(run.data.tokenizer.describe()).encode()).hexdigest()[:16]
    generators = hashlib.sha256((text_data.rng_state(run.rng) + text_data.rng_state(run.dropout_rng)).encode())
    return (
        settings
        | {
            "--seed": run.seed,
            "--validation": run.data.validation,
            "the text (its fingerprint)": run.data.fingerprint,  # its content: the same text may have other paths
            "the vocabulary": f"{run.data.tokenizer.vocab_size:,} tokens (SHA-256 {vocabulary})",
            "the model": repr(run.model.config),
            "the step": run.step,
            "the weights (their SHA-256)": weights.hexdigest()[:16],
            "the random generators (their SHA-256)": generators.hexdigest()[:16],
        }
    )


def one_process_seconds(run: Run, train_step: Callable[..., float], repeats: int = 3) -> float:
    """The median time of train_step(run, x, y, processes) on the whole batch in this process alone (a copy of
    the run, so that the run itself does not change): what the processes' step is compared with."""
    alone = copy.deepcopy(run)
    context, batch = run.model.config.context, run.settings.batch
    x, y = text_data.random_batch(np.random.default_rng(0), run.data.train, batch, context)
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        train_step(alone, x, y, Processes())
        times.append(time.perf_counter() - began)
    return float(np.median(times))


def scaling(run: Run, processes: Processes, step_seconds: list[float], train_step: Callable[..., float]) -> str | None:
    """Rank 0's line on the split's speed (every rank must call it; the others wait while rank 0 times one
    process on the whole batch): the step's time, the Allreduce's part, the speed-up and the efficiency."""
    if not step_seconds:
        return None
    if processes.rank != 0:
        idle_wait(processes.comm)
        return None
    alone = one_process_seconds(run, train_step)
    idle_wait(processes.comm)
    size, step = processes.size, float(np.median(step_seconds))
    allreduce = float(np.median(processes.allreduce_seconds))
    ratios = f"speed-up {alone / step:.2f}x, scaling efficiency {alone / (size * step):.0%}"
    return (
        f"a step: {step * 1e3:,.1f} ms on {size} processes ({allreduce * 1e3:,.1f} ms of it in the Allreduce),\n"
        f"  {alone * 1e3:,.1f} ms on one process with the whole batch (medians): "
        + machine.concluded([{"busy": machine.busy_reasons()}], ratios)
    )
