"""The sequence split over real processes: tests/ring_worker.py under `mpiexec -n 1..4`, where the ring's
and Ulysses' forward and backward must equal one process and bad input on some ranks must raise on every
rank; then one rank failing inside a call (an exception in a step's compute, a MemoryError, Ctrl-C in the
compute or in the input check) must end the whole job at once, with that rank's error printed, never a
hang; the bytes each scheme sends, by formula (peaks.sequence_parallel_bytes); and the two scripts,
scripts/sequence_parallel.py and scripts/train_parallel.py, under mpiexec.

Every run has a timeout (run_mpi): a hang fails the test instead of stalling the suite.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from test_ring import MPIEXEC, ROOT, mpi_job_environment, needs_mpiexec, run_mpi

from tinyattn_np.peaks import ring_attention_bytes, sequence_parallel_bytes

SCHEMES = {"ring zigzag", "ring contiguous", "ulysses"}  # what scripts/sequence_parallel.py runs

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


def run_and_interrupt(
    ranks: int, *args: str, after: str = "rank 0: calling"
) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run `mpiexec -n ranks python args...`, press Ctrl-C (SIGINT to mpiexec, which passes it to every rank)
    half a second after `after` (a regex) shows in its output; return what it printed and how long it took
    to end after that."""
    assert MPIEXEC is not None
    command = [MPIEXEC, "-n", str(ranks), sys.executable, *args]
    with mpi_job_environment() as env, tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        env["PYTHONUNBUFFERED"] = "1"
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=err, start_new_session=True)
        deadline = time.monotonic() + FAILURE_TIMEOUT
        while not re.search(after, read(out) + read(err)) and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.5)
        pressed = time.perf_counter()
        os.kill(process.pid, signal.SIGINT)
        try:
            process.wait(timeout=FAILURE_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            pytest.fail(f"Ctrl-C did not end mpiexec -n {ranks} {' '.join(args)} (a hang)\n{read(out)}\n{read(err)}")
        ended = time.perf_counter() - pressed
        return subprocess.CompletedProcess(command, process.returncode, read(out), read(err)), ended


def read(file: Any) -> str:
    """All that a TemporaryFile holds so far."""
    file.seek(0)
    return str(file.read())


@needs_mpiexec
def test_ctrl_c_ends_a_running_ring() -> None:
    result, seconds = run_and_interrupt(3, WORKER, "long")
    assert result.returncode == 130, result.stderr
    assert "ring_attention interrupted (Ctrl-C)" in result.stderr and seconds < 10, result.stderr


@needs_mpiexec
def test_another_communicator_on_one_rank_waits_until_ctrl_c() -> None:
    """The one mistake the ring cannot see (_mpi.py's module doc says so): the last rank passes MPI.COMM_SELF and
    computes a ring of its own, while rank 0 waits for it in the input check. Ctrl-C ends that wait."""
    result, seconds = run_and_interrupt(2, WORKER, "other-comm")
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


# --- the scripts --------------------------------------------------------------------------------------------


@needs_mpiexec
def test_sequence_parallel_script_under_mpiexec(tmp_path: Path) -> None:
    flags = ["--tokens", "512", "--block", "64", "--repeats", "1", "--reference-workers", "1"]
    result = run_mpi(2, "scripts/sequence_parallel.py", *flags, "--json", str(tmp_path / "sp.json"))
    log = f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    assert result.returncode == 0 and "all checks passed" in result.stdout, log
    assert result.stdout.count("2 rank(s): T = 512 tokens") == 1, "only rank 0 prints"
    for section in (
        "1) GiB one process sends",
        "2) the ring's backward",
        "3) ring (zigzag) against Ulysses",
        "4) wall",
    ):
        assert section in result.stdout, section
    assert re.search(r"^8 +131,072 +112\.0 +336\.0 +70\.4 +140\.4$", result.stdout, re.MULTILINE), log
    assert re.search(r"^ulysses +1 +", result.stdout, re.MULTILINE), log  # Ulysses ran: 4 heads split over 2
    saved = json.loads((tmp_path / "sp.json").read_text())
    assert saved["interrupted"] is False and {row["scheme"] for row in saved["summary"]} == set(SCHEMES)


@needs_mpiexec
def test_sequence_parallel_script_skips_ulysses_where_the_heads_do_not_split() -> None:
    result = run_mpi(
        3, "scripts/sequence_parallel.py", "--tokens", "384", "--block", "64", "--repeats", "1", "--no-reference"
    )
    assert result.returncode == 0 and "all checks passed" in result.stdout, result.stdout + result.stderr
    assert "Ulysses did not run: 4 query heads and 4 kv heads do not both split over 3 ranks" in result.stdout


@needs_mpiexec
def test_ctrl_c_in_the_sequence_parallel_script_keeps_what_was_measured() -> None:
    flags = ["--tokens", "1024", "--block", "128", "--repeats", "100", "--no-reference"]  # each scheme a few s
    result, seconds = run_and_interrupt(2, "scripts/sequence_parallel.py", *flags, after="ring zigzag: done")
    assert result.returncode == 130 and seconds < 30, result.stderr
    assert "interrupted (Ctrl-C) after 1 of 3 schemes" in result.stdout, result.stdout
    assert re.search(r"^ring zigzag +1 +", result.stdout, re.MULTILINE), result.stdout  # its rows are printed


@needs_mpiexec
@pytest.mark.parametrize("scheme", ["ring", "ulysses"])
def test_training_split_over_processes_equals_one_process(scheme: str) -> None:
    flags = ["--sequence-parallel", scheme, "--steps", "6", "--eval-every", "3", "--batch", "8"]
    result = run_mpi(2, "scripts/train_parallel.py", *flags)
    log = f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    assert result.returncode == 0 and "all checks passed" in result.stdout, log
    assert re.search(r"max \|difference\| = \d\.\de-1[6-9] ok", result.stdout), log  # float64 gradients
    assert re.search(r"^6 +\d\.\d{6} +\d\.\d{6} +[-+]\d\.\de[-+]\d\d$", result.stdout, re.MULTILINE), log
    assert "the same bits on every rank" in result.stdout, log


@needs_mpiexec
def test_training_split_refuses_what_does_not_split() -> None:
    result = run_mpi(3, "scripts/train_parallel.py", "--sequence-parallel", "ulysses", "--steps", "2")
    message = "--sequence-parallel ulysses splits the heads over the 3 processes"
    assert result.returncode == 2 and result.stderr.count(message) == 1, result.stderr


@needs_mpiexec
def test_ctrl_c_in_split_training_stops_every_rank_after_one_step() -> None:
    flags = ["--sequence-parallel", "ring", "--steps", "5000", "--no-check"]
    result, seconds = run_and_interrupt(2, "scripts/train_parallel.py", *flags, after="step 10/5000")
    assert result.returncode == 130 and seconds < 30 and "Traceback" not in result.stderr, result.stderr
    assert re.search(r"interrupted \(Ctrl-C\) after \d+ of 5000 steps", result.stdout), result.stdout
