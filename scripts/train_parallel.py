"""The copy task's tiny model (copy_model.py, as `train.py --task copy` trains it), each sequence split over
MPI processes, and the losses side by side with one process's.

    mpiexec -n 2 python scripts/train_parallel.py                              # the ring
    mpiexec -n 2 python scripts/train_parallel.py --sequence-parallel ulysses

Each process holds T/P tokens of every sequence of the batch (tinyattn_np.shards.shard, the zigzag split):
their embeddings, their rows of q, k and v (RoPE turns them by their positions in the sequence), their
logits and their part of the loss. Everything in the model but attention works token by token, so it runs
on each process alone; attention, forward and backward, goes through ring_attention or ulysses_attention
and their backwards. A process then holds what its own tokens contribute to every weight's gradient, and
the sum over the processes (Allreduce) is the whole batch's gradient: every process takes the same Adam
step with it, so the weights stay the same everywhere. Rank 0 also trains the one-process model from the
same seed, on the same batches, and prints both losses step by step: they agree to float32 rounding.

--check (on by default) first compares every weight's gradient, in float64 on a tiny model, with one
process's. Only rank 0 prints. Ctrl-C stops every rank after the step it is in (a ring stopped halfway
would have to end the whole job), prints the rows so far and exits with status 130.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from tinyattn_np import MultiHeadAttention, rope_backward
from tinyattn_np.mpi_job import StopTogether, load_mpi
from tinyattn_np.report import Checklist, text_table
from tinyattn_np.ring import ring_attention, ring_attention_backward
from tinyattn_np.shards import shard
from tinyattn_np.ulysses import ulysses_attention, ulysses_attention_backward

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the modules this script shares sit beside it
import copy_task  # noqa: E402
import interrupts
import machine
import outputs
from copy_model import Adam, TinyModel, cross_entropy, make_batch
from copy_task import NonFiniteLoss, print_intro, table_steps

SCHEMES = {
    "ring": (ring_attention, ring_attention_backward),
    "ulysses": (ulysses_attention, ulysses_attention_backward),
}
# the two runs' losses agree as np.isclose(rtol, atol) says: float32's rounding, grown over the Adam steps,
# stays far below it (the losses fall to about 1e-4, where a relative tolerance alone would be too fine)
LOSS_RTOL, LOSS_ATOL = 1e-4, 1e-6


class Split(NamedTuple):
    """How this process takes part: the communicator, the scheme's forward and backward, and the positions
    in the sequence of the tokens it holds (T/P of them, zigzag)."""

    comm: Any
    forward: Any
    backward: Any
    positions: np.ndarray  # (T/P,)


def layer_forward(layer: MultiHeadAttention, x: np.ndarray, split: Split) -> tuple[np.ndarray, tuple[Any, ...]]:
    """MultiHeadAttention.forward on this process's tokens x (B, T/P, C), attention through the scheme:
    (out (B, T/P, C), what layer_backward needs)."""
    q, k, v = layer.split_heads(x, split.positions)  # (B, H, T/P, d), (B, Hkv, T/P, d) x 2: RoPE at their positions
    y, lse = split.forward(q, k, v, comm=split.comm, causal=True, return_lse=True)  # (B, H, T/P, d): our rows
    y_cat = y.swapaxes(1, 2).reshape(x.shape)  # (B, T/P, C): the heads side by side
    return y_cat @ layer.w_out, (x, q, k, v, y, lse, y_cat)


def layer_backward(
    layer: MultiHeadAttention, dout: np.ndarray, saved: tuple[Any, ...], split: Split
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """MultiHeadAttention.backward's lines for this process's tokens, the attention's through the scheme:
    dx (B, T/P, C) and this process's share of dw_qkv and dw_out."""
    x, q, k, v, y, lse, y_cat = saved
    B, t, C = x.shape
    dw_out = y_cat.reshape(B * t, C).T @ dout.reshape(B * t, C)  # (C, C)
    dy = (dout @ layer.w_out.T).reshape(B, t, layer.n_heads, layer.d_head).swapaxes(1, 2)  # (B, H, T/P, d)
    dq, dk, dv = split.backward(q, k, v, y, dy, lse, comm=split.comm, causal=True)
    dq, dk = rope_backward(dq, positions=split.positions), rope_backward(dk, positions=split.positions)
    dqkv = np.concatenate([g.swapaxes(1, 2).reshape(B, t, -1) for g in (dq, dk, dv)], axis=-1).reshape(B * t, -1)
    return (dqkv @ layer.w_qkv.T).reshape(B, t, C), x.reshape(B * t, C).T @ dqkv, dw_out


def split_loss_and_grads(
    model: TinyModel, tokens: np.ndarray, length: int, split: Split
) -> tuple[float, dict[str, np.ndarray]]:
    """TinyModel.loss_and_grads with the sequence split: the lines run on this process's tokens, and the
    loss and every gradient are summed over the processes (Allreduce)."""
    MPI = load_mpi()
    mine = tokens[:, split.positions]  # (B, T/P): this process's tokens
    scored = np.flatnonzero((split.positions >= length) & (split.positions <= 2 * length - 2))  # (s,) its rows to score
    h = model.embed[mine]  # (B, T/P, C)
    saved = []
    for layer in model.layers:
        out, s = layer_forward(layer, h, split)
        saved.append(s)
        h = h + out
    n = tokens.shape[0] * (length - 1)  # every process's scored tokens: the loss is their mean
    loss, dh_rows, dw_head = cross_entropy(h[:, scored], model.w_head, tokens[:, split.positions[scored] + 1], n)
    grads = {"w_head": dw_head}
    dh = np.zeros_like(h)
    dh[:, scored] = dh_rows
    for i in reversed(range(len(model.layers))):
        dx, grads[f"layer{i}.w_qkv"], grads[f"layer{i}.w_out"] = layer_backward(model.layers[i], dh, saved[i], split)
        dh = dh + dx
    grads["embed"] = np.zeros_like(model.embed)
    np.add.at(grads["embed"], mine, dh)
    for gradient in grads.values():  # this process's share of each weight's gradient -> the whole batch's
        split.comm.Allreduce(MPI.IN_PLACE, gradient, op=MPI.SUM)
    return float(split.comm.allreduce(loss, op=MPI.SUM)), grads


# ---------------------------------------------------------------------------------------------------
# the run


def check_split(args: argparse.Namespace, size: int) -> str | None:
    """What keeps these flags from running split over `size` processes (None when nothing does)."""
    if (2 * args.length) % (2 * size):
        return (
            f"--sequence-parallel over {size} processes cuts each sequence of 2 x --length = "
            f"{2 * args.length} tokens into {2 * size} equal chunks (zigzag): use a --length that is a multiple "
            f"of {size}"
        )
    kv_heads = args.kv_heads or args.heads
    if args.sequence_parallel == "ulysses" and (args.heads % size or kv_heads % size):
        return (
            f"--sequence-parallel ulysses splits the heads over the {size} processes: --heads "
            f"({args.heads}) and --kv-heads ({kv_heads}) must be multiples of {size}; or use "
            "--sequence-parallel ring"
        )
    if args.plot:
        return "--plot draws one process's run: leave it out with --sequence-parallel"
    return None


def gradient_agreement(args: argparse.Namespace, comm: Any) -> float:
    """max |split − one process| over every weight's gradient of a tiny float64 model (vocab 5, 2P + 2P
    tokens, P heads and P kv heads of 4, --layers layers), the same on every rank."""
    size = comm.Get_size()
    model = TinyModel(5, 4 * size, size, size, args.layers, np.random.default_rng(args.seed), np.float64)
    tokens = make_batch(np.random.default_rng(args.seed + 2), 2, 2 * size, 5)
    split = Split(
        comm,
        *SCHEMES[args.sequence_parallel],
        shard(np.arange(4 * size)[:, None], comm.Get_rank(), size)[:, 0],
    )
    _, grads = split_loss_and_grads(model, tokens, 2 * size, split)
    _, gold = model.loss_and_grads(tokens, 2 * size, fused=True)
    return max(float(np.abs(grads[name] - gold[name]).max()) for name in gold)


def train_side_by_side(args: argparse.Namespace, split: Split, rows: list[dict[str, Any]]) -> TinyModel:
    """Adam steps on the split model (every rank) and on the one-process model (rank 0), from the same seed
    and on the same batches; each step's two losses go into rows as they are measured. Ctrl-C stops every
    rank after the same step (a KeyboardInterrupt on each)."""
    kv_heads, rank = args.kv_heads or args.heads, split.comm.Get_rank()
    # the same draws: weights, batches
    rngs = [np.random.default_rng(args.seed) for _ in range(1 if rank else 2)]
    models = [TinyModel(args.vocab, args.d_model, args.heads, kv_heads, args.layers, rng, np.float32) for rng in rngs]
    optimisers = [Adam(model.parameters(), args.lr) for model in models]
    start = time.perf_counter()
    with StopTogether() as ctrl_c:
        for step in range(1, args.steps + 1):
            batches = [make_batch(rng, args.batch, args.length, args.vocab) for rng in rngs]
            loss, grads = split_loss_and_grads(models[0], batches[0], args.length, split)
            if not (np.isfinite(loss) and all(np.isfinite(g).all() for g in grads.values())):
                # on every rank: the loss and gradients are their sums
                raise NonFiniteLoss(step, loss, args.lr)
            optimisers[0].step(grads)
            if rank == 0:  # the one-process model, on the same batch
                one_loss, one_grads = models[1].loss_and_grads(batches[1], args.length, args.fused)
                optimisers[1].step(one_grads)
                rows.append({"step": step, "one_process": one_loss, "split": loss})
                if step % 10 == 0:
                    outputs.progress(
                        f"  step {step}/{args.steps}  loss {loss:.3f}  {time.perf_counter() - start:.0f} s"
                    )
            if ctrl_c.stop(split.comm):
                raise KeyboardInterrupt
    return models[0]


def print_side_by_side(args: argparse.Namespace, rows: list[dict[str, Any]], check: Checklist) -> float:
    """The two losses at the table's steps, and the largest difference over every step; returns it."""
    shown = set(table_steps(args))
    body = [
        [r["step"], f"{r['one_process']:.6f}", f"{r['split']:.6f}", f"{r['split'] - r['one_process']:+.1e}"]
        for r in rows
        if r["step"] in shown
    ]
    print(
        text_table(
            body,
            ["step", "train loss, one process", f"{args.sequence_parallel}, split", "difference"],
            fmt=args.format,
        )
    )
    worst = max((abs(r["split"] - r["one_process"]) for r in rows), default=0.0)
    close = all(np.isclose(r["split"], r["one_process"], rtol=LOSS_RTOL, atol=LOSS_ATOL) for r in rows)
    print(
        f"   over all {len(rows)} steps the two losses differ by at most {worst:.1e} (float32 rounding; "
        f"tolerance {LOSS_RTOL:g} of the loss + {LOSS_ATOL:g})"
    )
    check(close, "the split run's loss equals one process's at every step")
    return worst


def run(args: argparse.Namespace) -> int:
    """The whole run on this rank: the exit code."""
    try:
        comm = load_mpi().COMM_WORLD
    except ImportError as err:
        outputs.needs(f"{err}")
    rank, size = comm.Get_rank(), comm.Get_size()
    problem = check_split(args, size)
    if problem:
        if rank == 0:
            print(f"train_parallel.py: error: {problem}", file=sys.stderr)
        return 2
    check, rows, stop = Checklist(), [], None
    if rank == 0:
        info, lines = machine.header()
        print(lines)
        print_intro(args)
        print(
            f"the sequence split over {size} process(es) by {args.sequence_parallel}_attention (zigzag: "
            f"{2 * args.length // size} tokens each), weight gradients summed by Allreduce"
        )
        if size == 1:
            print(
                f"ran 1 process, so nothing was split; for 2: mpiexec -n 2 python scripts/train_parallel.py "
                f"--sequence-parallel {args.sequence_parallel}"
            )
    if args.check:
        worst = gradient_agreement(args, comm)
        if rank == 0:
            print(
                f"gradient check (float64, every weight of a tiny model, split against one process): max "
                f"|difference| = {worst:.1e} {'ok' if worst < 1e-10 else 'FAILED (> 1e-10)'}"
            )
        check(worst < 1e-10, "the split gradients equal one process's")
    split = Split(comm, *SCHEMES[args.sequence_parallel], shard(np.arange(2 * args.length)[:, None], rank, size)[:, 0])
    start = time.perf_counter()
    model = None
    try:
        model = train_side_by_side(args, split, rows)
    except (KeyboardInterrupt, NonFiniteLoss) as err:
        stop = err
    return finish(args, comm, model, rows, check, stop, time.perf_counter() - start)


def finish(
    args: argparse.Namespace,
    comm: Any,
    model: TinyModel | None,
    rows: list[dict[str, Any]],
    check: Checklist,
    stop: BaseException | None,
    seconds: float,
) -> int:
    """Rank 0 prints the table, the weights' agreement over the ranks and the checks; every rank returns the
    exit code (130 after Ctrl-C, 1 after a loss that is not finite: every rank stopped at the same step)."""
    interrupted = isinstance(stop, KeyboardInterrupt)
    weights = None  # compared over the ranks when every rank trained to the end
    if model is not None:
        weights = comm.allgather(np.concatenate([w.ravel() for w in model.parameters().values()]))
    if comm.Get_rank() == 0:
        print(
            f"\nAdam, lr {args.lr}, batch {args.batch}, {len(rows)} of {args.steps} steps in {seconds:.1f} s, both "
            "runs one after the other at each step"
        )
        worst = print_side_by_side(args, rows, check)
        if weights is not None:
            same = all(np.array_equal(w, weights[0]) for w in weights)
            print(f"   the weights after the last step: {'the same bits' if same else 'NOT the same'} on every rank")
            check(same, "the weights are the same bits on every rank")
        if args.json:
            figures = {
                "args": vars(args),
                "ranks": comm.Get_size(),
                "rows": rows,
                "largest_difference": worst,
            }
            outputs.write_json(args.json, figures, interrupted)
    if interrupted:  # on every rank, after the same step
        return (
            interrupts.interrupted(len(rows), args.steps, "steps") if comm.Get_rank() == 0 else interrupts.INTERRUPTED
        )
    if isinstance(stop, NonFiniteLoss):
        if comm.Get_rank() == 0:
            print(f"train_parallel.py: stopped: {stop}", file=sys.stderr)
        return 1
    return int(comm.bcast(check.finish() if comm.Get_rank() == 0 else 0, root=0))


def add_scheme(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--sequence-parallel",
        choices=sorted(SCHEMES),
        default="ring",
        help="how each sequence is split over the processes: ring_attention (default) or ulysses_attention",
    )


def main(argv: list[str] | None = None) -> int:
    args = copy_task.parse_args(argv, add_scheme, __doc__ or "")
    copy_task.check_run(args, "train_parallel.py")
    return run(args)


if __name__ == "__main__":
    sys.exit(interrupts.run_main(main))
