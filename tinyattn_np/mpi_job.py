"""A program's MPI job, as the scripts run one under mpiexec: mpi4py loaded with the line that installs it, a
failing process ending the whole job, Ctrl-C (and SIGTERM, where asked) stopping every process after the same
step, and a wait that leaves the cores to the one process at work.

    comm = load_mpi().COMM_WORLD
    with StopTogether() as ctrl_c, abort_on_failure(comm, "train.py --data-parallel"):
        while ...:
            ...  # one step on every process, their gradients averaged
            if ctrl_c.stop(comm):  # every process asks at the same point: all stop after the same step
                break

load_mpi and abort_on_failure are the ring's own (ring.py and ulysses.py call them inside their schemes);
mpi4py is imported only when load_mpi runs, so importing this module needs NumPy alone.
"""

from __future__ import annotations

import signal
import time
from contextlib import AbstractContextManager
from typing import Any

from . import _mpi

__all__ = ["StopTogether", "abort_on_failure", "idle_wait", "load_mpi"]


def load_mpi() -> Any:
    """The mpi4py.MPI module, or an ImportError that says what to install (the distributed extra)."""
    return _mpi.load_mpi()


def abort_on_failure(comm: Any, what: str) -> AbstractContextManager[None]:
    """A context in which any exception, Ctrl-C and MemoryError included, ends the whole job: it is printed with
    this rank's number and `what` failed, then MPI_Abort ends every process (exit status 130 for Ctrl-C, else 1).
    One rank that raised alone would leave the others waiting for its next message forever. A communicator of
    one rank has nobody waiting: there the exception is raised as usual."""
    return _mpi.abort_on_failure(comm, what)


def idle_wait(comm: Any) -> None:
    """Wait for the other ranks without spinning: MPI's blocking calls poll the CPU, and a polling rank
    would take a core from the work (a timing, a measurement) that one rank does meanwhile."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.005)


class StopTogether:
    """Ctrl-C in a program that loops over ring calls or collective steps (a training loop), without ending the
    job: inside `with StopTogether() as ctrl_c:`, Ctrl-C (SIGINT) is noted instead of raised, and with
    StopTogether(sigterm=True) SIGTERM too (kill, a batch scheduler's time limit), so that no rank stops in the
    middle of a ring (which ends the job, abort_on_failure) or of a collective call. ctrl_c.stop(comm), called
    by every rank at the same point (between two steps), tells every rank whether any rank has seen one, so that
    all of them stop after the same step and the program can keep what it has; ctrl_c.pressed is this process's
    own answer, for a program of one process, and ctrl_c.terminated whether the signal it saw was SIGTERM. It
    must be entered from the main thread (Python runs signal handlers there); a second Ctrl-C still reaches
    mpiexec, which then ends the job itself."""

    def __init__(self, sigterm: bool = False):
        self.signals = (signal.SIGINT, signal.SIGTERM) if sigterm else (signal.SIGINT,)

    def __enter__(self) -> StopTogether:
        self.pressed = self.terminated = False
        self.previous = {number: signal.signal(number, self.press) for number in self.signals}
        return self

    def press(self, signum: int, frame: Any) -> None:
        self.pressed = True
        self.terminated = self.terminated or signum == signal.SIGTERM

    def stop(self, comm: Any) -> bool:
        """Whether any rank of comm saw Ctrl-C or SIGTERM (a collective call: every rank must make it)."""
        return bool(comm.allreduce(self.pressed, op=load_mpi().LOR))

    def __exit__(self, *exc: object) -> None:
        for number, handler in self.previous.items():
            signal.signal(number, handler)
