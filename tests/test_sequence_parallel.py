"""The sequence split over real processes: tests/ring_worker.py under `mpiexec -n 1..4`, where the ring's
and Ulysses' forward and backward must equal one process and bad input on some ranks must raise on every
rank; then one rank failing inside a call (an exception in a step's compute, a MemoryError, Ctrl-C in the
compute or in the input check) must end the whole job at once, with that rank's error printed, never a
hang; and the bytes each scheme sends, by formula (peaks.sequence_parallel_bytes).

Every run has a timeout (run_mpi): a hang fails the test instead of stalling the suite.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from test_ring import MPIEXEC, ROOT, needs_mpiexec, run_mpi

from tinyattn_np.peaks import ring_attention_bytes, sequence_parallel_bytes

WORKER = str(ROOT / "tests" / "ring_worker.py")
FAILURE_TIMEOUT = 60  # seconds; a failing job ends in about one (2 cores, 2 or 3 ranks)


@needs_mpiexec
@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_sequence_parallel_on_real_processes_equals_one_process(ranks: int) -> None:
    result = run_mpi(ranks, WORKER)
    log = f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.returncode == 0, log
    cases = 24 if ranks == 1 else 29  # the mismatch cases and Ulysses' uneven heads need a second rank
    assert f"ring worker: {ranks} ranks, {cases} cases passed, 0 failed" in result.stdout, log
    assert "FAIL" not in result.stdout, log


# --- one rank fails: the job ends ---------------------------------------------------------------------------

NAMES = {
    "ring": "ring_attention",
    "ring-backward": "ring_attention_backward",
    "ulysses": "ulysses_attention",
    "ulysses-backward": "ulysses_attention_backward",
}
SAID = {
    "error-0": "failed: RuntimeError: injected failure in call 0 of",
    "error-1": "failed: RuntimeError: injected failure in call 1 of",
    "memory": "failed: MemoryError: injected: no memory for",
    "interrupt": "interrupted (Ctrl-C)",
    "interrupt-in-check": "'s check interrupted (Ctrl-C)",
}
FAILURES = [
    (function, how)
    for function in NAMES
    for how in SAID
    if not (function.startswith("ulysses") and how == "error-1")  # Ulysses computes in one call
]


@needs_mpiexec
@pytest.mark.parametrize(("function", "how"), FAILURES)
def test_one_rank_failing_ends_the_job_with_its_error(function: str, how: str) -> None:
    index = FAILURES.index((function, how))
    ranks = 2 + index % 2  # -n 2 and -n 3 in turn
    failing_rank = index % ranks  # first, middle or last
    started = time.perf_counter()
    result = run_mpi(ranks, WORKER, "fail", function, how, str(failing_rank), timeout=FAILURE_TIMEOUT)
    log = f"exit {result.returncode} after {time.perf_counter() - started:.1f} s\n{result.stdout}\n{result.stderr}"
    assert result.returncode == (130 if how.startswith("interrupt") else 1), log
    assert f"rank {failing_rank} of {ranks}: {NAMES[function]}" in result.stderr, log
    assert SAID[how] in result.stderr and "MPI_Abort" in result.stderr, log
    assert ("Traceback (most recent call last)" in result.stderr) == (not how.startswith("interrupt")), log


def run_and_interrupt(ranks: int, *args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run the worker under mpiexec, press Ctrl-C (SIGINT to mpiexec, which passes it to every rank) half a
    second after rank 0 says it is calling; return what it printed and how long it took to end after that."""
    assert MPIEXEC is not None
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    command = [MPIEXEC, "-n", str(ranks), sys.executable, WORKER, *args]
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with subprocess.Popen(command, cwd=ROOT, env=env, start_new_session=True, **pipes) as process:
        try:
            first = process.stdout.readline()  # "rank 0: calling ring_attention"
            time.sleep(0.5)
            pressed = time.perf_counter()
            os.kill(process.pid, signal.SIGINT)
            stdout, stderr = process.communicate(timeout=FAILURE_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
            pytest.fail(f"Ctrl-C did not end mpiexec -n {ranks} {' '.join(args)} (a hang)\n{stdout}\n{stderr}")
    return subprocess.CompletedProcess(
        command, process.returncode, first + stdout, stderr
    ), time.perf_counter() - pressed


@needs_mpiexec
def test_ctrl_c_ends_a_running_ring() -> None:
    result, seconds = run_and_interrupt(3, "long")
    assert result.returncode == 130, result.stderr
    assert "ring_attention interrupted (Ctrl-C)" in result.stderr and seconds < 10, result.stderr


@needs_mpiexec
def test_another_communicator_on_one_rank_waits_until_ctrl_c() -> None:
    """The one mistake the ring cannot see (the module doc says so): the last rank passes MPI.COMM_SELF and
    computes a ring of its own, while rank 0 waits for it in the input check. Ctrl-C ends that wait."""
    result, seconds = run_and_interrupt(2, "other-comm")
    assert "rank 1: returned" in result.stdout, result.stdout  # a ring of one: no error to give
    assert "rank 0: returned" not in result.stdout, result.stdout
    assert result.returncode == 130 and seconds < 10, result.stderr
    assert "rank 0 of 2: ring_attention's check interrupted (Ctrl-C)" in result.stderr, result.stderr


# --- the bytes each scheme sends ------------------------------------------------------------------------


def test_sequence_parallel_bytes_by_hand() -> None:
    # 2 ranks, B = 2, Hq = 4, Hkv = 2, t = 42 tokens each, E = 8, Ev = 5, float64 (the worker's sizes)
    kv, qe, o, r = 2 * 2 * 42 * 13, 2 * 4 * 42 * 8, 2 * 4 * 42 * 5, 2 * 4 * 42
    sizes = dict(heads=4, kv_heads=2, head_dim=8, head_dim_v=5, batch=2, dtype="fp64")
    assert sequence_parallel_bytes(84, 2, scheme="ring", **sizes) == {
        "tokens_per_device": 42,
        "forward": kv * 8,  # the K/V block, once
        "backward": kv * 8 + kv * 8,  # the K/V block and its dK/dV accumulator
    }
    assert sequence_parallel_bytes(84, 2, scheme="ulysses", **sizes) == {
        "tokens_per_device": 42,
        "forward": ((qe + kv + o) * 8 + r * 8) // 2,  # half of each all-to-all leaves the device
        "backward": ((qe + kv + 2 * o) * 8 + r * 8 + (qe + kv) * 8) // 2,
    }
    assert sequence_parallel_bytes(84, 2, scheme="ulysses", return_lse=False, **sizes)["forward"] == (qe + kv + o) * 4
    # fp16: the ring's accumulators and Ulysses' lse travel in fp32
    half = dict(sizes, dtype="fp16")
    assert sequence_parallel_bytes(84, 2, scheme="ring", **half)["backward"] == kv * 2 + kv * 4
    assert sequence_parallel_bytes(84, 2, scheme="ulysses", **half)["forward"] == ((qe + kv + o) * 2 + r * 4) // 2
    # one device sends nothing; the ring's forward is ring_attention_bytes' sent_total
    assert sequence_parallel_bytes(84, 1, scheme="ring", **sizes)["backward"] == 0
    assert sequence_parallel_bytes(84, 1, scheme="ulysses", **sizes)["backward"] == 0
    ring = sequence_parallel_bytes(
        1 << 20, 8, scheme="ring", heads=32, kv_heads=8, head_dim=128, layers=32, dtype="bf16"
    )
    assert (
        ring["forward"]
        == ring_attention_bytes(1 << 20, 8, kv_heads=8, head_dim=128, layers=32, dtype="bf16")["sent_total"]
    )


def test_sequence_parallel_bytes_refuses_what_cannot_run() -> None:
    llama = dict(heads=32, kv_heads=8, head_dim=128, dtype="bf16")
    with pytest.raises(ValueError, match="heads=32 and kv_heads=8 must both be multiples of devices=16"):
        sequence_parallel_bytes(1 << 20, 16, scheme="ulysses", **llama)
    assert sequence_parallel_bytes(1 << 20, 16, scheme="ring", **llama)["forward"] > 0  # the ring has no such limit
    with pytest.raises(ValueError, match="scheme must be one of 'ring', 'ulysses'; got 'tree'"):
        sequence_parallel_bytes(64, 2, scheme="tree", **llama)
    with pytest.raises(ValueError, match="split evenly over the devices"):
        sequence_parallel_bytes(10, 4, scheme="ring", **llama)
    with pytest.raises(TypeError, match="return_lse must be True or False"):
        sequence_parallel_bytes(64, 2, scheme="ring", return_lse="yes", **llama)  # type: ignore[arg-type]
