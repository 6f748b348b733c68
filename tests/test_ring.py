"""Ring attention: the tile counts as plain functions, the ring's forward and backward
in-process on MPI.COMM_SELF (a one-rank stand-in where mpi4py is missing), what every rank does with the
checks' reports, and scripts/ring.py under mpiexec. The runs on real processes (tests/ring_worker.py under
`mpiexec -n 1..4`, failures included) are in tests/test_sequence_parallel.py, with the helpers below. The
tests that need real MPI skip, saying why, when mpi4py or mpiexec is missing.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_close

from tinyattn_np import flash_attention, flash_attention_backward
from tinyattn_np._mpi import Failed, Report, abort_on_failure, agree, check_on_every_rank
from tinyattn_np.peaks import ring_attention_bytes
from tinyattn_np.ring import (
    DIAGONAL,
    FULL,
    HIDDEN,
    pair_kind,
    ring_attention,
    ring_attention_backward,
    ring_pairs,
    tile_counts,
)
from tinyattn_np.shards import n_chunks, shard

ROOT = Path(__file__).resolve().parents[1]
try:
    from mpi4py import MPI
except ImportError:  # pragma: no cover - depends on the machine
    MPI = None


def find_mpiexec() -> str | None:
    """The mpiexec beside this Python (the mpich wheel puts it there), else the one on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else shutil.which("mpiexec")


MPIEXEC = find_mpiexec()


class OneRankMPI(types.ModuleType):
    """Stands in for mpi4py.MPI where mpi4py is not installed: its COMM_SELF is a communicator of one rank.

    A ring of one never sends a message (there is no neighbour to pass a block to), and an all-to-all of
    one keeps its one row: allgather, Ialltoall and a poll of what is already done are all the schemes ask
    of it. With it, the in-process tests run the schemes' code on any machine, and the coverage floor holds
    without MPI; the proof on real processes is the mpiexec tests, which skip without mpi4py.
    """

    class Comm:
        def Get_rank(self) -> int:
            return 0

        def Get_size(self) -> int:
            return 1

        def allgather(self, value: object) -> list[object]:
            return [value]

        def Ialltoall(self, sendbuf: list[np.ndarray], recvbuf: list[np.ndarray]) -> object:
            recvbuf[0][...] = sendbuf[0]  # the one row is this rank's own
            return object()

    class Request:
        @staticmethod
        def Testall(requests: list[object]) -> bool:
            return True  # a ring of one posts nothing; an all-to-all of one was done when posted

    BYTE = "BYTE"

    def __init__(self) -> None:
        super().__init__("mpi4py.MPI")
        self.COMM_SELF = self.COMM_WORLD = self.Comm()  # a world of one rank


def one_rank_comm(monkeypatch: pytest.MonkeyPatch) -> object:
    """MPI.COMM_SELF, from mpi4py where it is installed, else from OneRankMPI."""
    if MPI is not None:
        return MPI.COMM_SELF
    one_rank = OneRankMPI()
    package = types.ModuleType("mpi4py")
    package.MPI = one_rank  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "mpi4py", package)
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", one_rank)
    return one_rank.COMM_SELF


@pytest.fixture
def comm_self(monkeypatch: pytest.MonkeyPatch) -> object:
    return one_rank_comm(monkeypatch)


needs_mpiexec = pytest.mark.skipif(
    MPI is None or MPIEXEC is None, reason='mpi4py or mpiexec is missing: pip install -e ".[distributed]"'
)


# --- the schedule and its tiles --------------------------------------------------------------------


def test_pair_kinds() -> None:
    assert pair_kind(3, 1, causal=True) == FULL
    assert pair_kind(3, 3, causal=True) == DIAGONAL
    assert pair_kind(1, 3, causal=True) == HIDDEN
    assert pair_kind(1, 3, causal=False) == FULL
    # zigzag, 2 ranks: rank 0 holds chunks 0 and 3; the block of rank 1 (chunks 1 and 2) is seen by chunk 3 only
    kinds = [(p.q_chunk, p.k_chunk, p.kind) for p in ring_pairs(0, 1, 2, causal=True)]
    assert kinds == [(0, 1, HIDDEN), (0, 2, HIDDEN), (3, 1, FULL), (3, 2, FULL)]
    assert [p.kind for p in ring_pairs(0, 1, 2, causal=False)] == [FULL]  # one pair: shard x shard


def tiles_by_brute_force(tokens: int, size: int, layout: str, block: int) -> list[int]:
    """An independent count: every block x block tile of every (query part, key part) that holds at least
    one score the causal mask keeps, found from the global positions that shard() gives each token."""
    positions = np.arange(tokens)[:, None]  # (T, 1)
    per_rank = n_chunks(size, layout) // size
    counts = []
    for rank in range(size):
        q_pos = shard(positions, rank, size, layout=layout)[:, 0]
        count = 0
        for source_rank in range(size):
            k_pos = shard(positions, source_rank, size, layout=layout)[:, 0]
            part = len(q_pos) // per_rank
            for a in range(per_rank):
                for b in range(per_rank):
                    qs, ks = q_pos[a * part : (a + 1) * part], k_pos[b * part : (b + 1) * part]
                    for i in range(0, part, block):
                        for j in range(0, part, block):
                            count += bool((ks[j : j + block][None, :] <= qs[i : i + block][:, None]).any())
        counts.append(count)
    return counts


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_tile_counts_match_a_brute_force_count(layout: str, size: int) -> None:
    tokens = 2 * size * 20  # chunks of 20 (zigzag) or 40 (contiguous) in tiles of 16: partial edge tiles
    counted = tile_counts(tokens, size, layout=layout, block_q=16, block_k=16)
    assert [row["tiles"] for row in counted] == tiles_by_brute_force(tokens, size, layout, 16)


@pytest.mark.parametrize("size", range(2, 9))
def test_zigzag_balances_the_causal_work(size: int) -> None:
    counted = tile_counts(2 * size * 512, size, layout="zigzag")
    assert len({row["tiles"] for row in counted}) == 1  # every rank the same, exactly
    assert all((row[FULL], row[DIAGONAL], row[HIDDEN]) == (2 * size - 1, 2, 2 * size - 1) for row in counted)


@pytest.mark.parametrize(("size", "ratio"), [(2, 1.5), (4, 1.75)])
def test_contiguous_busiest_rank_does_about_two_minus_one_over_size(size: int, ratio: float) -> None:
    tiles = [row["tiles"] for row in tile_counts(65536, size, layout="contiguous")]
    assert max(tiles) / np.mean(tiles) == pytest.approx(ratio, abs=0.005)


def test_tile_counts_without_mask_and_errors() -> None:
    counted = tile_counts(64, 2, causal=False, block_q=16, block_k=16)
    assert [row["tiles"] for row in counted] == [2 * 2 * 2, 2 * 2 * 2]  # 2 steps of a 32 x 32 shard pair
    with pytest.raises(ValueError, match="cannot be split into 8 equal chunks"):
        tile_counts(100, 4)
    with pytest.raises(TypeError, match="causal must be True or False"):
        tile_counts(64, 2, causal="yes")  # type: ignore[arg-type]


# --- the byte estimate -------------------------------------------------------------------------------


def test_ring_attention_bytes_by_hand() -> None:
    est = ring_attention_bytes(1024, 4, kv_heads=2, head_dim=64, layers=3, dtype="fp16")
    block = 2 * 256 * (64 + 64) * 2  # Hkv · t · (E + Ev) · 2 bytes
    assert est == {
        "tokens_per_device": 256,
        "block": block,
        "kv_shards": 3 * block,
        "in_flight": 2 * block,
        "score_tile": 256 * 256 * 4,  # fp16 scores are computed in fp32
        "steps": 3,
        "sent_per_step": block,
        "sent_total": 3 * 3 * block,
    }
    assert ring_attention_bytes(10, 1, kv_heads=1, head_dim=2)["score_tile"] == 10 * 10 * 4
    with pytest.raises(ValueError, match="split evenly over the devices"):
        ring_attention_bytes(10, 4, kv_heads=1, head_dim=2)


# --- the ring in this process: a communicator of one rank ----------------------------------------------


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [True, False])
def test_ring_of_one_is_flash_attention(layout: str, causal: bool, rng: np.random.Generator, comm_self: object) -> None:
    q = rng.standard_normal((2, 4, 42, 8))  # (B, Hq, T, E), GQA below; 42 tokens = two chunks of 21
    k = rng.standard_normal((2, 2, 42, 8))
    v = rng.standard_normal((2, 2, 42, 5))
    out, lse, stats = ring_attention(
        q,
        k,
        v,
        comm=comm_self,
        causal=causal,
        layout=layout,
        return_lse=True,
        return_stats=True,
        block_q=16,
        block_k=16,
    )
    gold, gold_lse = flash_attention(q, k, v, causal=causal, return_lse=True)
    assert_close(out, gold, np.float64, "out")
    assert_close(lse, gold_lse, np.float64, "lse")
    assert stats.tiles == tile_counts(42, 1, layout=layout, causal=causal, block_q=16, block_k=16)[0]["tiles"]
    assert (stats.bytes_sent, stats.bytes_received, len(stats.steps)) == (0, 0, 1)
    assert stats.wait_seconds >= 0 and stats.compute_seconds > 0
    assert sum(stats.pairs.values()) == (4 if causal and layout == "zigzag" else 1)


def test_ring_keeps_float16_and_returns_out_alone(rng: np.random.Generator, comm_self: object) -> None:
    q, k, v = (rng.standard_normal((1, 2, 16, 8)).astype(np.float16) for _ in range(3))
    out = ring_attention(q, k, v, comm=comm_self, causal=True)
    assert isinstance(out, np.ndarray) and out.dtype == np.float16
    assert_close(out, flash_attention(q, k, v, causal=True), np.float16, "float16")
    _, lse = ring_attention(q, k, v, comm=comm_self, causal=True, return_lse=True)
    assert lse.dtype == np.float32  # as flash_attention's: float16 would overflow past 65504


def test_ring_errors_name_what_is_wrong(comm_self: object) -> None:
    x = np.zeros((1, 2, 8, 4))
    with pytest.raises(TypeError, match="comm must be an mpi4py communicator"):
        ring_attention(x, x, x, comm="world")
    with pytest.raises(ValueError, match="rank 0 of 1: a zigzag shard is two equal chunks"):
        ring_attention(x[..., :7, :], x[..., :7, :], x[..., :7, :], comm=comm_self)
    with pytest.raises(TypeError, match="rank 0 of 1: causal must be True or False"):
        ring_attention(x, x, x, comm=comm_self, causal="False")
    with pytest.raises(ValueError, match="the same tokens"):
        ring_attention(x, x[..., :4, :], x[..., :4, :], comm=comm_self)
    with pytest.raises(ValueError, match="with a head axis"):
        ring_attention(x[0, 0], x[0, 0], x[0, 0], comm=comm_self)
    with pytest.raises(ValueError, match="layout must be one of"):
        ring_attention(x, x, x, comm=comm_self, layout="striped")


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [True, False])
def test_ring_backward_of_one_is_flash_attention_backward(
    layout: str, causal: bool, rng: np.random.Generator, comm_self: object
) -> None:
    q = rng.standard_normal((2, 4, 42, 8))  # (B, Hq, T, E), GQA: 2 query heads per kv head
    k, v = rng.standard_normal((2, 2, 42, 8)), rng.standard_normal((2, 2, 42, 5))
    dout = rng.standard_normal((2, 4, 42, 5))
    settings = dict(causal=causal, layout=layout, block_q=16, block_k=16)
    out, lse = ring_attention(q, k, v, comm=comm_self, return_lse=True, **settings)
    dq, dk, dv, stats = ring_attention_backward(q, k, v, out, dout, lse, comm=comm_self, return_stats=True, **settings)
    gold = flash_attention_backward(q, k, v, out, dout, lse, causal=causal, block_q=16, block_k=16)
    for name, mine, want in zip(("dq", "dk", "dv"), (dq, dk, dv), gold, strict=True):
        np.testing.assert_allclose(mine, want, rtol=1e-10, atol=1e-10, err_msg=name)
    assert stats.tiles == tile_counts(42, 1, layout=layout, causal=causal, block_q=16, block_k=16)[0]["tiles"]
    assert (stats.bytes_sent, len(stats.steps)) == (0, 1)  # a ring of one sends nothing, its gradients included


def test_ring_backward_keeps_the_dtypes_and_rows_that_see_nothing(rng: np.random.Generator, comm_self: object) -> None:
    q, k, v, dout = (rng.standard_normal((1, 2, 16, 8)).astype(np.float16) for _ in range(4))
    out, lse = ring_attention(q, k, v, comm=comm_self, causal=True, return_lse=True)
    grads = ring_attention_backward(q, k, v, out, dout, lse, comm=comm_self, causal=True, workers=2)
    gold = flash_attention_backward(q, k, v, out, dout, lse, causal=True)
    for mine, want in zip(grads, gold, strict=True):
        assert mine.dtype == np.float16
        assert_close(mine, want, np.float16, "float16 gradients")
    # a row with lse = -inf (it saw no key) gets P = 0: zero gradients, not NaN
    q64, dout64 = q.astype(np.float64), dout.astype(np.float64)
    out64, lse64 = np.zeros_like(dout64), np.full(q.shape[:-1], -np.inf)
    dq, dk, dv = ring_attention_backward(q64, q64, q64, out64, dout64, lse64, comm=comm_self)
    assert not dq.any() and not dk.any() and not dv.any()


def test_ring_backward_errors_name_what_is_wrong(rng: np.random.Generator, comm_self: object) -> None:
    q, k, v, dout = (rng.standard_normal((1, 2, 16, 8)) for _ in range(4))
    out, lse = ring_attention(q, k, v, comm=comm_self, return_lse=True)  # no mask
    with pytest.raises(ValueError, match="rank 0 of 1: lse must have shape"):
        ring_attention_backward(q, k, v, out, dout, lse[..., :3], comm=comm_self)
    with pytest.raises(ValueError, match=r"rank 0 of 1: out must have shape"):
        ring_attention_backward(q, k, v, out[..., :3, :], dout, lse, comm=comm_self)
    with pytest.raises(ValueError, match="rank 0 of 1: lse does not match q, k and the mask"):
        ring_attention_backward(q, k, v, out, dout, lse, comm=comm_self, causal=True)  # another mask than the forward's
    with pytest.raises(TypeError, match="rank 0 of 1: return_stats must be True or False"):
        ring_attention_backward(q, k, v, out, dout, lse, comm=comm_self, return_stats=1)  # type: ignore[arg-type]


# --- every rank: the checks' reports, and a failure ----------------------------------------------------------------


def report(tokens: int = 8, heads: int = 2, causal: bool = True) -> Report:
    shape = (1, heads, tokens, 4)
    return Report((shape, shape, shape), ("float64",) * 3, (causal, "zigzag", 0.5, 256, 256))


def test_agree_raises_the_same_error_for_every_rank() -> None:
    """What every rank does with the allgathered reports (the mpiexec tests show it on real ranks)."""
    agree([report(), report()])  # all the same: nothing to say
    with pytest.raises(ValueError, match=r"unequal length: tokens per rank \[8, 10\]"):
        agree([report(), report(tokens=10)])
    with pytest.raises(ValueError, match="disagree on their shapes"):
        agree([report(), report(heads=4)])
    with pytest.raises(ValueError, match=r"disagree on their settings .* rank 1 has \(False"):
        agree([report(), report(causal=False)])


def test_a_failed_check_is_raised_on_every_rank_naming_the_rank() -> None:
    assert isinstance(Failed("TypeError", "causal must be True or False").error(1, 2), TypeError)
    assert str(Failed("ValueError", "bad").error(0, 3)) == "rank 0 of 3: bad"
    assert str(Failed("MemoryError", "out of memory").error(0, 2)) == "rank 0 of 2: MemoryError: out of memory"


class TwoRanks:
    """A communicator of two ranks whose allgather hands back this rank's report twice and whose Abort is
    recorded: enough to see what a rank does, in this process. Its Abort raises so that the test lives on."""

    class Aborted(Exception):
        pass

    def __init__(self) -> None:
        self.aborted: list[int] = []

    def Get_rank(self) -> int:
        return 1

    def Get_size(self) -> int:
        return 2

    def Ibarrier(self) -> object:
        return object()

    def allgather(self, value: object) -> list[object]:
        return [value, value]

    def Abort(self, status: int) -> None:
        self.aborted.append(status)
        raise self.Aborted


@pytest.mark.parametrize(
    ("error", "status", "said"),
    [
        (RuntimeError("inside the compute"), 1, "rank 1 of 2: the ring failed: RuntimeError: inside the compute"),
        (MemoryError("no room"), 1, "rank 1 of 2: the ring failed: MemoryError: no room"),
        (KeyboardInterrupt(), 130, "rank 1 of 2: the ring interrupted (Ctrl-C)"),
    ],
)
def test_a_failure_among_ranks_is_printed_and_aborts_the_job(
    error: BaseException, status: int, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    comm = TwoRanks()
    with pytest.raises(TwoRanks.Aborted), abort_on_failure(comm, "the ring"):
        raise error
    assert comm.aborted == [status]
    printed = capsys.readouterr().err
    assert said in printed and "MPI_Abort ends the whole job" in printed
    assert ("Traceback" in printed) == (status == 1)  # Ctrl-C: one line, not a traceback


def test_a_failure_in_a_ring_of_one_is_raised_as_usual(comm_self: object) -> None:
    with pytest.raises(MemoryError, match="no room"), abort_on_failure(comm_self, "the ring"):
        raise MemoryError("no room")


def test_a_ctrl_c_in_a_check_aborts_where_an_error_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mpi4py", types.SimpleNamespace(MPI=OneRankMPI()))  # Testall: done at once
    comm = TwoRanks()

    def check() -> tuple[object, object]:
        raise ValueError("bad input here")

    with pytest.raises(ValueError, match="rank 0 of 2: bad input here"):  # the same report twice: rank 0's first
        check_on_every_rank(comm, check, "the check")
    assert comm.aborted == []

    def interrupted() -> tuple[object, object]:
        raise KeyboardInterrupt  # no Exception: `except Exception` misses it, so it must abort, not hang

    with pytest.raises(TwoRanks.Aborted):
        check_on_every_rank(comm, interrupted, "the check")
    assert comm.aborted == [130]


def test_without_mpi4py_it_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # `from mpi4py import MPI` now fails
    x = np.zeros((1, 1, 2, 2))
    with pytest.raises(ImportError, match=r'pip install -e "\.\[distributed\]"'):
        ring_attention(x, x, x, comm=None)


# --- real processes: mpiexec -n 1, 2, 3, 4 --------------------------------------------------------------


HYDRA_TOPOLOGY = "hydra_hwloc_xmlfile_*"  # what MPICH's mpiexec leaves in /tmp when its job is aborted
SHARED_MEMORY = Path("/dev/shm")  # where MPICH's ranks share memory on one machine (POSIX shm_open)
MPICH_SEGMENTS = "mpich_shm_*"  # a job's shared memory: one that ends by MPI_Abort or a kill never unlinks it


def segment_users(paths: set[Path]) -> dict[Path, set[str]]:
    """For each of paths that a live process maps or holds open (/proc), the environments of those processes:
    which job each belongs to (mpi_job_environment marks its processes)."""
    users: dict[Path, set[str]] = {}
    for process in Path("/proc").glob("[0-9]*"):
        try:
            maps = (process / "maps").read_text(errors="replace")
            links = {os.readlink(fd) for fd in (process / "fd").iterdir()}
            environ = (process / "environ").read_bytes().decode(errors="replace")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        for path in paths:
            if str(path) in maps or str(path) in links:
                users.setdefault(path, set()).add(environ)
    return users


def left_segments(before: set[Path]) -> set[Path]:
    """The MPICH segments made since `before` that no live process uses: what an ended job left behind."""
    new = set(SHARED_MEMORY.glob(MPICH_SEGMENTS)) - before
    return new - set(segment_users(new)) if new else set()


@contextmanager
def mpi_job_environment() -> Iterator[dict[str, str]]:
    """The environment of one mpiexec job: this checkout on the path, one BLAS thread per rank, and a temporary
    folder of its own (TMPDIR), removed when the job ends, aborted or not.

    MPICH's mpiexec writes the machine's topology for its processes to /tmp/hydra_hwloc_xmlfile_* (TMPDIR or
    not), unless HWLOC_XMLFILE names a topology file, and a job that ends by MPI_Abort or Ctrl-C never removes
    it: the job's HWLOC_XMLFILE names a file in its own folder (one that need not exist: hwloc then reads the
    machine itself). Its ranks share memory through /dev/shm/mpich_shm_* files, which such a job leaves too.
    When the job ends, the segments made meanwhile are removed once none of this job's processes (each carries
    the job's folder in its environment) still maps them, and no other process does (another job's, running
    beside it in another test process, stay)."""
    before = set(SHARED_MEMORY.glob(MPICH_SEGMENTS))
    with tempfile.TemporaryDirectory(prefix="mpiexec-") as job_folder:
        try:
            yield dict(
                os.environ,
                PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                OMP_NUM_THREADS="1",
                OPENBLAS_NUM_THREADS="1",
                TMPDIR=job_folder,
                HWLOC_XMLFILE=os.path.join(job_folder, "topology.xml"),
            )
        finally:
            remove_segments_of(job_folder, before)


def remove_segments_of(job_folder: str, before: set[Path], patience: float = 10.0) -> None:
    """Remove the segments made since `before` once the job's own processes (job_folder in their environment)
    have let go of them, waiting up to `patience` seconds for ranks that are still ending; a segment another
    live process uses stays."""
    deadline = time.monotonic() + patience
    while True:
        new = set(SHARED_MEMORY.glob(MPICH_SEGMENTS)) - before
        users = segment_users(new)
        ours = {path for path, environs in users.items() if any(job_folder in env for env in environs)}
        if not ours or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for segment in new - set(users):
        segment.unlink(missing_ok=True)


def run_mpi(ranks: int, *args: str, timeout: float = 90, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """`mpiexec -n ranks python args...` in cwd (mpi_job_environment); a run past `timeout` seconds is killed
    with every rank and fails the test."""
    assert MPIEXEC is not None
    command = [MPIEXEC, "-n", str(ranks), sys.executable, *args]
    with mpi_job_environment() as env:
        # a session of its own, so that a hang is ended with every rank, not just mpiexec
        with subprocess.Popen(
            command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        ) as process:
            try:
                stdout, stderr = process.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                stdout, stderr = process.communicate()
                pytest.fail(f"mpiexec -n {ranks} {' '.join(args)} ran past {timeout} s (a hang?)\n{stdout}\n{stderr}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


@needs_mpiexec
def test_an_aborted_job_leaves_nothing_in_the_temporary_folder_or_the_shared_memory() -> None:
    temp = Path(tempfile.gettempdir())
    before, segments_before = set(temp.glob(HYDRA_TOPOLOGY)), set(SHARED_MEMORY.glob(MPICH_SEGMENTS))
    result = run_mpi(2, "-c", "from mpi4py import MPI; MPI.COMM_WORLD.Abort(3)", timeout=60)
    assert result.returncode != 0, result.stdout + result.stderr
    left = set(temp.glob(HYDRA_TOPOLOGY)) - before
    assert not left, f"the aborted job left {sorted(p.name for p in left)} in {temp}"
    segments, deadline = left_segments(segments_before), time.monotonic() + 10
    while segments and time.monotonic() < deadline:  # another test's job that just ended: its test removes them
        time.sleep(0.2)
        segments = {segment for segment in segments if segment.exists()}
    assert not segments, f"the aborted job left {sorted(p.name for p in segments)} in {SHARED_MEMORY}"


COMM_NONE_ON_RANK_1 = """
import numpy as np
from mpi4py import MPI
from tinyattn_np.ring import ring_attention, ring_attention_backward
from tinyattn_np.ulysses import ulysses_attention, ulysses_attention_backward

world, x = MPI.COMM_WORLD, np.zeros((1, 2, 8, 4))
comm = None if world.Get_rank() == 1 else world
for name, call in [
    ("ring_attention", lambda: ring_attention(x, x, x, comm=comm)),
    ("ring_attention_backward", lambda: ring_attention_backward(x, x, x, x, x, x[..., 0], comm=comm)),
    ("ulysses_attention", lambda: ulysses_attention(x, x, x, comm=comm)),
    ("ulysses_attention_backward", lambda: ulysses_attention_backward(x, x, x, x, x, x[..., 0], comm=comm)),
]:
    try:
        call()
        print(f"rank {world.Get_rank()} {name}: returned", flush=True)
    except TypeError as err:
        print(f"rank {world.Get_rank()} {name}: TypeError: {err}", flush=True)
"""


@needs_mpiexec
def test_comm_none_on_one_rank_is_refused_on_every_rank_before_any_message() -> None:
    result = run_mpi(2, "-c", COMM_NONE_ON_RANK_1, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    expected = "TypeError: rank 1 of 2: comm must be an mpi4py communicator such as MPI.COMM_WORLD; got NoneType"
    for rank in (0, 1):
        for name in ("ring_attention", "ring_attention_backward", "ulysses_attention", "ulysses_attention_backward"):
            assert f"rank {rank} {name}: {expected}" in result.stdout, result.stdout + result.stderr


@needs_mpiexec
def test_ring_script_under_mpiexec() -> None:
    result = run_mpi(2, "scripts/ring.py", "--tokens", "512", "--block", "64", "--repeats", "1", "--max-ranks", "4")
    log = f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.returncode == 0 and "all checks passed" in result.stdout, log
    assert result.stdout.count("ring of 2 rank(s)") == 1, "only rank 0 prints"
    for section in ("1) tiles per rank", "2) zigzag", "3) contiguous", "4) wall time"):
        assert section in result.stdout, section
    assert "contiguous / zigzag wall time" in result.stdout


@needs_mpiexec
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tokens", "4098"], "--tokens 4098 cannot be split into 4 equal chunks"),
        (["--seed", "-1"], "--seed must be 0 or more"),
        (["--tokens", "10"], "--tokens must be at least 2 x --max-ranks = 16"),
        (["--heads", "1024", "--tokens", "4000000"], "needs about 4,882.8 GiB on rank 0"),
        (["--heads", "100000"], "--heads must be at most 1,024; got 100,000"),
        (["--heads", "4", "--kv-heads", "3"], "must be a multiple of --kv-heads"),
        (["--json", "/no/such/folder/ring.json"], "does not exist"),
        (["--tokens", "nan"], "invalid int value"),
    ],
)
def test_ring_script_rejects_bad_flags_once_without_a_traceback(flags: list[str], message: str) -> None:
    result = run_mpi(2, "scripts/ring.py", *flags, timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count(message) == 1 and "Traceback" not in result.stderr, result.stderr


def test_ring_script_without_mpi4py_says_what_to_install() -> None:
    hide = (
        "import runpy, sys; sys.modules['mpi4py'] = None; sys.argv = sys.argv[1:]; "
        "runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    result = subprocess.run(
        [sys.executable, "-c", hide, "scripts/ring.py"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2 and 'pip install -e ".[distributed]"' in result.stderr, result.stderr


def test_memory_script_ring_section() -> None:
    """scripts/memory.py section 5: per-device bytes of a ring over 1 .. 64 devices at 1M tokens."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    result = subprocess.run(
        [sys.executable, "scripts/memory.py"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    section = result.stdout.split("5) Ring attention")[1]
    # Llama-3-8B, bf16: 128 KiB of K/V per token, 128 GiB at 2^20 tokens, halved by every doubling of devices
    assert re.search(r"^1 +1,048,576 +128 +8\.00 +256 +15\.0 +151 +0 +no$", section, re.MULTILINE), section
    assert re.search(r"^4 +262,144 +32\.0 +2\.00 +256 +15\.0 +49\.0 +96\.0 +yes$", section, re.MULTILINE), section
    assert "every device fits in one H100 80GB (81,559 MiB): 4 devices" in section


def modules_after(imports: str, prefix: str) -> list[str]:
    """The modules named prefix... that a fresh Python holds after `import imports` (this checkout first)."""
    check = f"import sys, {imports}; print(*sorted(m for m in sys.modules if m.startswith({prefix!r})))"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    result = subprocess.run(
        [sys.executable, "-c", check], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


def test_importing_the_package_or_the_ring_module_does_not_import_mpi4py() -> None:
    assert modules_after("tinyattn_np, tinyattn_np.ring", "mpi4py") == []
