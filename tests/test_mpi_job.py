"""mpi_job.py: what a program under mpiexec uses. StopTogether notes Ctrl-C (and SIGTERM) and every process
learns of it at the step's end; a failure on one process of one is raised as usual; mpi4py missing is a line
that says what to install; idle_wait sleeps between its polls. No real MPI here: tests/test_train.py runs
train.py under mpiexec."""

from __future__ import annotations

import os
import signal
import sys
import time
import types

import pytest

from tinyattn_np.mpi_job import StopTogether, abort_on_failure, idle_wait, load_mpi


class Gathering:
    """A communicator of one rank that answers allreduce (the only call StopTogether.stop makes)."""

    def allreduce(self, value: object, op: object = None) -> object:
        return value

    def Get_rank(self) -> int:
        return 0

    def Get_size(self) -> int:
        return 1


def test_stop_together_notes_ctrl_c_and_says_so_at_the_step_end(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mpi4py", types.SimpleNamespace(MPI=types.SimpleNamespace(LOR="LOR")))
    before = signal.getsignal(signal.SIGINT)
    with StopTogether() as ctrl_c:
        assert not ctrl_c.stop(Gathering()) and not ctrl_c.pressed
        os.kill(os.getpid(), signal.SIGINT)  # a real Ctrl-C: noted, not raised
        time.sleep(0.01)
        assert ctrl_c.stop(Gathering()) and ctrl_c.pressed
    assert signal.getsignal(signal.SIGINT) is before  # restored


def test_stop_together_notes_sigterm_as_it_notes_ctrl_c(monkeypatch: pytest.MonkeyPatch) -> None:
    """With sigterm=True (train.py's), SIGTERM (kill, a batch scheduler's time limit) is noted, not acted on, and
    said apart from Ctrl-C: the loop stops after its step and keeps what it has, as on Ctrl-C."""
    monkeypatch.setitem(sys.modules, "mpi4py", types.SimpleNamespace(MPI=types.SimpleNamespace(LOR="LOR")))
    before = signal.getsignal(signal.SIGTERM)
    with StopTogether() as ctrl_c:  # by default SIGTERM is left as it is: the programs that loop over rings
        assert signal.getsignal(signal.SIGTERM) is before
    with StopTogether(sigterm=True) as ctrl_c:
        os.kill(os.getpid(), signal.SIGTERM)  # the process would end here without the handler
        time.sleep(0.01)
        assert ctrl_c.stop(Gathering()) and ctrl_c.pressed and ctrl_c.terminated
    assert signal.getsignal(signal.SIGTERM) is before  # restored
    with StopTogether(sigterm=True) as ctrl_c:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)
        assert ctrl_c.pressed and not ctrl_c.terminated


def test_a_failure_in_a_job_of_one_process_is_raised_as_usual() -> None:
    with pytest.raises(MemoryError, match="no room"), abort_on_failure(Gathering(), "train.py --data-parallel"):
        raise MemoryError("no room")


def test_without_mpi4py_it_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # `from mpi4py import MPI` now fails
    with pytest.raises(ImportError, match=r'pip install -e "\.\[distributed\]"'):
        load_mpi()


def test_idle_wait_polls_until_every_rank_has_come(monkeypatch: pytest.MonkeyPatch) -> None:
    answers = iter([False, False, True])
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    comm = types.SimpleNamespace(Ibarrier=lambda: types.SimpleNamespace(Test=lambda: next(answers)))
    idle_wait(comm)
    assert slept == [0.005, 0.005]
