"""What the benchmarks under mpiexec share (ring.py, sequence_parallel.py): the start on every rank (the flags
parsed on every rank, quietly on all but rank 0, and a run too large for the machine refused on every rank
alike), rank 0's random inputs and each rank's shard of them, and the note that more ranks than cores only
time-share the cores.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import outputs

from tinyattn_np.mpi_job import idle_wait, load_mpi
from tinyattn_np.shards import shard

DTYPES = {"float32": np.float32, "float64": np.float64, "float16": np.float16}


def setup(
    argv: list[str] | None,
    parse_args: Callable[[list[str] | None], argparse.Namespace],
    too_large: Callable[[argparse.Namespace, int], str | None],
    script: str,
) -> tuple[Any, argparse.Namespace] | int:
    """(MPI.COMM_WORLD, the flags), checked on every rank; or the exit code where they cannot run: mpi4py
    missing (--help and bad flags still answer; then exit 2, outputs.needs), or too_large(args, ranks), asked
    on rank 0 alone, says why."""
    try:
        comm = load_mpi().COMM_WORLD
    except ImportError as err:
        parse_args(argv)
        outputs.needs(f"{err}")
    rank = comm.Get_rank()
    # only rank 0 speaks: the others parse the same flags quietly, and fail the same way
    quiet = io.StringIO()
    with (
        contextlib.redirect_stdout(quiet if rank else sys.stdout),
        contextlib.redirect_stderr(quiet if rank else sys.stderr),
    ):
        args = parse_args(argv)
    problem = too_large(args, comm.Get_size()) if rank == 0 else None
    idle_wait(comm)  # the other ranks sleep while rank 0 measures the matmul rate for its estimate
    problem = comm.bcast(problem, root=0)
    if problem:
        if rank == 0:
            print(f"{script}: error: {problem}", file=sys.stderr)
        return 2
    return comm, args


def draw_inputs(args: argparse.Namespace, heads: dict[str, int]) -> dict[str, np.ndarray]:
    """Rank 0's inputs: name -> (1, heads, T, E) random normal in --dtype, drawn in the order of `heads`."""
    rng = np.random.default_rng(args.seed)
    dtype = DTYPES[args.dtype]
    return {name: rng.standard_normal((1, h, args.tokens, args.head_dim)).astype(dtype) for name, h in heads.items()}


def scatter_shards(comm: Any, full: dict[str, np.ndarray] | None, layout: str) -> dict[str, np.ndarray]:
    """This rank's shard of each of rank 0's inputs (full, None on the other ranks):
    name -> (1, H, T/P, E)."""
    size = comm.Get_size()
    parts = (
        None if full is None else [{n: shard(x, r, size, layout=layout) for n, x in full.items()} for r in range(size)]
    )
    return comm.scatter(parts, root=0)


def say_if_time_shared(size: int) -> None:
    """The line under a table of times where the ranks outnumber the cores."""
    if size > (os.cpu_count() or 1):
        print(f"   {size} ranks on {os.cpu_count()} cores time-share them: these times show correctness, not speed")
