"""Linear attention in numbers: the gated delta rule's prefill in chunks beside its recurrence, transformers'
chunked function and our flash attention; the chunk size; and a decode step, whose state never grows, beside
softmax attention's KV cache, which grows with every token.

What it shows (H heads, d_k = d_v = d, float32; q and k L2-normalised, as Qwen3-Next's layer has them):
  1) the prefill of T tokens:
       chunks       tinyattn_np.gated_delta_rule, chunks of C tokens (the UT transform inside, the state across)
       recurrent    the same, chunk_size=None: a token at a time
       torch        transformers' torch_chunk_gated_delta_rule (--torch), chunks of C, timed in turns with ours
       flash        tinyattn_np.flash_attention, causal, at the same widths: softmax attention's prefill
     with the chunked algorithm's matmul FLOPs (transformers' and ours do the same products: q kᵀ and k kᵀ, the
     triangular solves, W S, q S, P u, kᵀ u) and their time at this machine's matmul rate.
  2) the chunk size C: the chunked prefill at each C (its FLOPs grow with C, its steps shrink).
  3) one decode step at each context S: the bytes it reads and writes, and its time. Softmax attention reads every
     cached k and v (flash_decode over S keys); the gated delta rule reads its state S (d_k x d_v a head) and
     writes it anew (the decay touches every number), whatever S: through gated_delta_rule on one token as
     GatedDeltaCache runs it, and the engine's step as a decode loop runs it (the recurrence over 64 tokens, a
     token's share). Beside them, the state's floors: one read of it (Sᵀx, one matmul over the heads) and one
     copy of it (read and written), the least a step that must write its state can do. Where the two cross.
  4) where the chunked prefill's time goes, at the largest --tokens on one thread (tinyattn_np.linear_profile:
     the engine copied, each NumPy call timed into its part): the matmuls, the triangular inverse, the
     element-wise lines, the copies, and after each the time so far as a multiple of section 1's FLOPs at the
     matmul rate of one thread, timed beside it: how much of the aim (within 2x) the products alone leave.

Run:  python scripts/linear.py [--tokens 2048] [--heads 16] [--head-dim 128] [--chunk-sizes 16 32 64 128]
                               [--contexts 256 1024 4096 16384] [--repeats 3] [--torch] [--json PATH]
Every claim is checked (chunks = recurrence, = torch); the exit code is 1 if one fails.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from tinyattn_np import attention, attention_flops, flash_attention, flash_decode, format_bytes, gated_delta_rule
from tinyattn_np.linear_profile import LINEAR_PARTS, profile_chunked
from tinyattn_np.measure import alternating_medians_ms
from tinyattn_np.report import Checklist, add_seed_and_format, max_diff, positive

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the modules this script shares sit beside it
import interrupts  # noqa: E402
import kernel_profile  # noqa: E402
import limits  # noqa: E402
import machine  # noqa: E402
import outputs  # noqa: E402
import torch_import  # noqa: E402

check = Checklist()  # every claim the script prints is checked; main() returns check.finish()
SAME = 1e-4  # float32 chunks against the recurrence and against torch, relative to the largest output
DECODE_RUN = 64  # tokens of the recurrence timed together in section 3, for its time a token
PREFILL_AIM = 2.0  # the chunked prefill: within 2x of its matmul FLOPs at the machine's matmul rate


# ---------------------------------------------------------------------------------------------------
# the inputs and the work


def rule_inputs(T: int, args: argparse.Namespace, batch: int = 1) -> tuple[np.ndarray, ...]:
    """q, k, v (B, H, T, d), g (B, H, T) in [-0.1, -0.01] (decays of a few dozen tokens), beta (B, H, T) in (0, 1)."""
    rng, shape = np.random.default_rng(args.seed), (batch, args.heads, T, args.head_dim)
    q, k, v = (rng.standard_normal(shape, dtype=np.float32) for _ in range(3))
    g = -rng.uniform(0.01, 0.1, shape[:3]).astype(np.float32)
    return q, k, v, g, rng.uniform(0.0, 1.0, shape[:3]).astype(np.float32)


def chunk_flops(T: int, H: int, d: int, C: int) -> float:
    """The chunked algorithm's matmul FLOPs (a multiply-add is 2), T padded to whole chunks. A chunk of one head:
    β k kᵀ and q kᵀ (2 · 2C²d), the two triangular solves for U and W (C² a column, 2d columns), W S and q S and
    kᵀ u (3 · 2Cd²), and P u (2C²d)."""
    chunks = -(-T // C) * H
    return chunks * (4 * C * C * d + 2 * C * C * d + 6 * C * d * d + 2 * C * C * d)


def torch_chunked(args: argparse.Namespace) -> Any:
    """transformers' torch_chunk_gated_delta_rule, taking our layout (B, H, T, ·), returning o in it."""
    torch, _ = torch_import.load_torch()
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    def run(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray, C: int) -> np.ndarray:
        tensors = [torch.from_numpy(x).transpose(1, 2) for x in (q, k, v, g, beta)]  # (B, T, H, ·)
        with torch.no_grad():
            o, _ = torch_chunk_gated_delta_rule(*tensors, chunk_size=C, use_qk_l2norm_in_kernel=True)
        return o.transpose(1, 2).numpy()

    return run


def relative(mine: np.ndarray, gold: np.ndarray) -> float:
    return max_diff(mine, gold) / float(np.max(np.abs(gold)))


# ---------------------------------------------------------------------------------------------------
# 1) the prefill, 2) the chunk size


def measure_prefill(T: int, args: argparse.Namespace, run: SimpleNamespace) -> dict[str, Any]:
    """Each prefill of T tokens checked (chunks = recurrence = torch), then timed: ours and torch's in turns."""
    outputs.progress(f"prefill, T = {T:,}")
    q, k, v, g, beta = rule_inputs(T, args)
    C = args.chunk_size
    steps = {
        "chunks": lambda: gated_delta_rule(q, k, v, g, beta, chunk_size=C, l2norm_qk=True),
        "recurrent": lambda: gated_delta_rule(q, k, v, g, beta, chunk_size=None, l2norm_qk=True),
        "flash": lambda: flash_attention(q, k, v, causal=True),
    }
    if run.torch is not None:
        steps["torch"] = lambda: run.torch(q, k, v, g, beta, C)
    gold = steps["recurrent"]()
    for name in ("chunks", "torch", "flash"):
        if name == "flash":
            steps[name]()  # its first run (flash attention computes another thing: nothing to compare)
        elif name in steps:
            diff = relative(steps[name](), gold)
            check(diff <= SAME, f"T = {T:,}: {name} equals the recurrence (relative {diff:.1e})")
    row: dict[str, Any] = {"tokens": T, **machine.beside_the_row("float32", run.rate)}
    # each step has run once (its check): the rest are timed without more warm-up, the long ones being long;
    # ours and torch's in turns, so that a drift of the machine slows both alike
    turns = ["chunks", "torch"] if "torch" in steps else ["chunks"]
    times = alternating_medians_ms(
        [steps[name] for name in turns], args.repeats, rounds=2, idle=machine.SETTLE_SECONDS, warmup=0
    )
    row.update({f"{name}_ms": ms for name, ms in zip(turns, times, strict=True)})
    for name in ("recurrent", "flash"):
        row[f"{name}_ms"] = alternating_medians_ms(
            [steps[name]], args.repeats, rounds=1, idle=machine.SETTLE_SECONDS, warmup=0
        )[0]
    row["chunk_flops"] = chunk_flops(T, args.heads, args.head_dim, C)
    row["flash_flops"] = attention_flops(T, heads=args.heads, head_dim=args.head_dim, causal=True)
    return row


def print_prefill(rows: list[dict[str, Any]], args: argparse.Namespace, run: SimpleNamespace) -> None:
    body = []
    for row in rows:
        at_rate = row["chunk_flops"] / run.rate / 1e6  # ms
        torch = row.get("torch_ms")
        body.append(
            [
                f"{row['tokens']:,}",
                f"{row['chunks_ms']:.1f}",
                f"{row['recurrent_ms']:.1f}",
                "-" if torch is None else f"{torch:.1f}",
                f"{row['flash_ms']:.1f}",
                f"{row['chunk_flops'] / 1e9:.1f}",
                f"{at_rate:.1f}",
                f"{row['chunks_ms'] / at_rate:.2f}x",
                "-" if torch is None else f"{row['chunks_ms'] / torch:.2f}x",
            ]
        )
    print(
        f"\n1) the prefill: {args.heads} heads of {args.head_dim}, float32, chunks of {args.chunk_size}; ms "
        "(median), and the\n   chunked algorithm's matmul GFLOP and their time at this machine's matmul "
        "rate"
    )
    headers = ["T", "chunks", "recurrent", "torch", "flash", "GFLOP", "at rate", "chunks / rate", "chunks / torch"]
    print(machine.marked_table(body, rows, headers, args.format))
    for row in rows:
        said = (
            f"chunks {row['recurrent_ms'] / row['chunks_ms']:.1f}x faster than the recurrence; flash attention "
            f"{row['flash_ms'] / row['chunks_ms']:.2f}x the chunks' time ({row['flash_flops'] / 1e9:.1f} GFLOP)"
        )
        print(f"   T = {row['tokens']:,}: {machine.concluded([row], said)}")


def measure_chunk_size(C: int, args: argparse.Namespace, run: SimpleNamespace) -> dict[str, Any]:
    outputs.progress(f"chunks of {C}")
    q, k, v, g, beta = rule_inputs(args.tokens[0], args)
    ms = machine.settled_median_ms(
        lambda: gated_delta_rule(q, k, v, g, beta, chunk_size=C, l2norm_qk=True), args.repeats
    )
    row = {"chunk_size": C, "ms": ms, "flops": chunk_flops(args.tokens[0], args.heads, args.head_dim, C)}
    return {**row, **machine.beside_the_row("float32", run.rate)}


def print_chunk_sizes(rows: list[dict[str, Any]], args: argparse.Namespace, run: SimpleNamespace) -> None:
    body = [
        [
            str(row["chunk_size"]),
            f"{row['ms']:.1f}",
            f"{row['flops'] / 1e9:.1f}",
            f"{row['ms'] / (row['flops'] / run.rate / 1e6):.2f}x",
        ]
        for row in rows
    ]
    print(f"\n2) the chunk size: the prefill of T = {args.tokens[0]:,} in chunks of C")
    headers = ["C", "ms (median)", "GFLOP", "/ at rate"]
    print(machine.marked_table(body, rows, headers, args.format, label=lambda row: f"C={row['chunk_size']}"))


# ---------------------------------------------------------------------------------------------------
# 3) one decode step


def decode_inputs(S: int, args: argparse.Namespace) -> SimpleNamespace:
    """A KV cache of S tokens (1, H, S, d) and a query (1, H, 1, d); a state (1, H, d, d) and one token's q, k, v
    (1, H, 1, d), g and beta (1, H, 1), and DECODE_RUN tokens of them for the recurrence; a buffer of the state's
    shape."""
    rng, H, d = np.random.default_rng(args.seed), args.heads, args.head_dim
    keys, values = (rng.standard_normal((1, H, S, d), dtype=np.float32) for _ in range(2))
    q, k, v = (rng.standard_normal((1, H, DECODE_RUN, d), dtype=np.float32) for _ in range(3))
    state = (0.1 * rng.standard_normal((1, H, d, d))).astype(np.float32)
    g, beta = np.full((1, H, DECODE_RUN), -0.05, np.float32), np.full((1, H, DECODE_RUN), 0.5, np.float32)
    return SimpleNamespace(
        keys=keys, values=values, q=q, k=k, v=v, g=g, beta=beta, state=state, buffer=np.empty_like(state)
    )


def decode_steps(s: SimpleNamespace) -> dict[str, Any]:
    """The steps of section 3 as calls: flash_decode over the cache; the rule's step as GatedDeltaCache runs it
    (gated_delta_rule on one token, chunk_size=None: its checks, the L2 norms, a new state); the recurrence, the
    engine's step DECODE_RUN times in one call (timed per token: the step as a decode loop runs it, the state
    updated in place); the state's two floors."""
    one = [x[:, :, :1] for x in (s.q, s.k, s.v, s.g, s.beta)]  # (1, H, 1, ·): one token
    return {
        "softmax": lambda: flash_decode(one[0], s.keys, s.values),
        "rule": lambda: gated_delta_rule(
            *one, chunk_size=None, initial_state=s.state, return_state=True, l2norm_qk=True
        ),
        "engine": lambda: gated_delta_rule(
            s.q, s.k, s.v, s.g, s.beta, chunk_size=None, initial_state=s.state, return_state=True, l2norm_qk=True
        ),
        "read once": lambda: s.q[0, :, :1] @ s.state[0],  # (H, 1, d) @ (H, d, d): every number of S read once
        "copy": lambda: np.copyto(s.buffer, s.state),  # read once and written once
    }


def measure_decode(S: int, args: argparse.Namespace, run: SimpleNamespace) -> dict[str, Any]:
    outputs.progress(f"decode, S = {S:,}")
    inputs = decode_inputs(S, args)
    steps = decode_steps(inputs)
    if S == min(args.contexts):
        gold = attention(inputs.q[:, :, :1], inputs.keys, inputs.values)
        check(relative(steps["softmax"](), gold) <= SAME, f"S = {S:,}: flash_decode equals attention()")
    row: dict[str, Any] = {"context": S, **machine.beside_the_row("float32", run.rate)}
    names = list(steps)  # in turns, so that a drift of the machine slows each alike
    times = alternating_medians_ms([steps[name] for name in names], max(2, args.repeats * 10 // 3), rounds=3)
    for name, ms in zip(names, times, strict=True):
        row[f"{name}_us"] = 1e3 * ms / (DECODE_RUN if name == "engine" else 1)
    itemsize, H, d = 4, args.heads, args.head_dim
    row["softmax_bytes"], row["rule_bytes"] = 2 * S * H * d * itemsize, 2 * H * d * d * itemsize
    return row


def print_decode(rows: list[dict[str, Any]], args: argparse.Namespace, run: SimpleNamespace) -> None:
    body = [
        [
            f"{row['context']:,}",
            format_bytes(row["softmax_bytes"]),
            format_bytes(row["rule_bytes"]),
            *(f"{row[f'{name}_us']:,.0f}" for name in ("softmax", "rule", "engine", "read once", "copy")),
            f"{row['rule_us'] / row['read once_us']:.1f}x",
            f"{row['engine_us'] / row['read once_us']:.1f}x",
            f"{row['engine_us'] / row['copy_us']:.1f}x",
        ]
        for row in rows
    ]
    print(
        f"\n3) one decode step, {args.heads} heads of {args.head_dim}, float32: the bytes it reads (softmax) or "
        "reads and writes (the rule's\n   state); its time in microseconds (median, in turns): flash_decode, the "
        "rule's step as the cache runs it,\n   the engine's step in a decode loop (a token of the recurrence), "
        "the state read once and copied"
    )
    headers = ["S", "KV bytes", "state bytes", "softmax", "rule", "engine", "read", "copy", "rule / read"]
    headers += ["engine / read", "/ copy"]
    print(machine.marked_table(body, rows, headers, args.format, label=lambda row: f"S={row['context']:,}"))
    state, token = 2 * args.heads * args.head_dim**2 * 4, 2 * args.heads * args.head_dim * 4  # bytes
    print(
        f"   bytes: the KV cache ({format_bytes(token)} a token) passes the state's read and write "
        f"({format_bytes(state)}) at S = {state // token:,}"
    )
    print(f"   time: {machine.concluded(rows, crossing(rows))}")
    floor = statistics.median(row["copy_us"] / row["read once_us"] for row in rows)
    print(
        f"   floor: a step reads S (Sᵀk, Sᵀq) and writes S' = e^g S + k uᵀ; the copy, a read and a write, takes "
        f"{floor:.1f}x the read\n   (median of the rows): a step within 1.3x of one read writes less than its state"
    )


def crossing(rows: list[dict[str, Any]]) -> str:
    """Where softmax's step becomes slower than the rule's, interpolated in log S between two measured contexts."""
    for low, high in zip(rows, rows[1:], strict=False):
        a, b = (row["softmax_us"] - row["rule_us"] for row in (low, high))
        if a <= 0 < b:
            s = np.exp(np.log(low["context"]) + (np.log(high["context"]) - np.log(low["context"])) * -a / (b - a))
            return f"softmax's step becomes slower than the rule's near S = {s:,.0f} (between the measured contexts)"
    if rows and rows[0]["softmax_us"] > rows[0]["rule_us"]:
        return f"softmax's step is already the slower at S = {rows[0]['context']:,}"
    return "softmax's step is the faster at every context measured: add longer --contexts"


# ---------------------------------------------------------------------------------------------------
# 4) where the chunked prefill's time goes


def prefill_parts(T: int, args: argparse.Namespace, run: SimpleNamespace) -> dict[str, Any]:
    """Section 1's chunked prefill of T tokens (the same inputs, from --seed) on one thread, part by part."""
    outputs.progress(f"the chunked prefill's parts on one thread, T = {T:,}")
    q, k, v, g, beta = rule_inputs(T, args)
    row = profile_chunked(
        q,
        k,
        v,
        g,
        beta,
        chunk_size=args.chunk_size,
        repeats=args.repeats,
        matmul_rate=lambda: machine.matmul_rate("float32", repeats=1),  # one thread: profile_chunked holds BLAS
    )
    check(row["same_bits"], f"T = {T:,}: the profile's copy of the chunked forward gives its output and state")
    flops = chunk_flops(T, args.heads, args.head_dim, args.chunk_size)
    return {**row, "tokens": T, "chunk_flops": flops, "busy": machine.busy_reasons()}


def print_parts(rows: list[dict[str, Any]], args: argparse.Namespace, run: SimpleNamespace) -> None:
    row = rows[0]
    parts, rate, (matmuls, inverse) = row["parts_ms"], row["matmul_gflops"], LINEAR_PARTS[:2]
    at_rate = row["chunk_flops"] / rate / 1e6  # ms: section 1's FLOPs at the one-thread rate
    runs = kernel_profile.runs_said(args.repeats)
    print(
        f"\n4) where the chunked prefill's time goes: T = {row['tokens']:,} in chunks of {args.chunk_size} on one "
        f"thread, the engine copied\n   part by part ({runs}); the matmul on one BLAS thread beside them: "
        f"{rate:.1f} GFLOP/s;\n   section 1's {row['chunk_flops'] / 1e9:.1f} GFLOP take {at_rate:,.0f} ms at that "
        f"rate (the engine's matmuls do {row['flops'] / 1e9:.1f}: it applies\n   the triangular inverse as products)"
    )
    print(kernel_profile.parts_so_far(row, at_rate, args.format))
    alone, floor = parts[matmuls] / at_rate, (parts[matmuls] + parts[inverse]) / at_rate
    said = kernel_profile.floor_verdict(row, floor, PREFILL_AIM)
    print(
        f"   the engine itself: {row['kernel_ms']:,.0f} ms on one thread; the copy gives its output and state: "
        f"{'yes' if row['same_bits'] else 'NO'}\n   the matmuls alone take {alone:.2f}x the FLOPs at the rate, "
        f"and with the triangular inverse {floor:.2f}x:\n   {said} the aim of {PREFILL_AIM:g}x before the "
        f"element-wise lines"
    )


# ---------------------------------------------------------------------------------------------------
# arguments and the run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--tokens",
        type=positive(int, limits.MAX_TOKENS),
        nargs="+",
        default=[2048],
        metavar="T",
        help="tokens T of each prefill (default 2048)",
    )
    p.add_argument("--heads", type=positive(int, limits.MAX_HEADS), default=16, help="heads H (default 16)")
    p.add_argument("--head-dim", type=positive(int, 1024), default=128, help="d = d_k = d_v (default 128)")
    p.add_argument("--chunk-size", type=positive(int, 1024), default=64, help="C of section 1 (default 64)")
    p.add_argument(
        "--chunk-sizes",
        type=positive(int, 1024),
        nargs="+",
        default=[16, 32, 64, 128],
        metavar="C",
        help="the chunk sizes of section 2, at the first --tokens (default 16 32 64 128)",
    )
    p.add_argument(
        "--contexts",
        type=positive(int, limits.MAX_TOKENS),
        nargs="+",
        default=[256, 1024, 4096, 16384],
        metavar="S",
        help="cached tokens S of each decode step (default 256 1024 4096 16384)",
    )
    p.add_argument(
        "--repeats",
        type=positive(int, limits.MAX_REPEATS),
        default=3,
        help="timed runs per figure (default 3; a decode step ten times as many)",
    )
    p.add_argument("--torch", action="store_true", help="add transformers' torch_chunk_gated_delta_rule")
    p.add_argument("--json", metavar="PATH", help="write every figure, the machine and the code version to PATH")
    add_seed_and_format(p, "the random inputs")
    args = p.parse_args(argv)
    args.tokens, args.contexts = sorted(args.tokens), sorted(args.contexts)
    problem = limits.memory_problem(run_bytes(args), "this run", "lower --tokens, --contexts or --heads")
    if problem:
        p.error(problem)
    outputs.check_output(p, "--json", args.json)
    return args


def run_bytes(args: argparse.Namespace) -> float:
    """The largest arrays at once: a prefill's inputs, output and the recurrence's or flash's working memory (about
    ten times q), or the longest context's KV cache."""
    per_token = args.heads * args.head_dim * 4
    return max(10 * max(args.tokens) * per_token, 2 * max(args.contexts) * per_token) + 64 * 2**20


def run_flops(args: argparse.Namespace) -> float:
    """FLOPs of the whole run at the matmul rate (a lower bound): each prefill's chunks, flash and the
    recurrence (2 d² a token and head, four times over) checked and timed; each chunk size's prefill; section 4's
    engine and copy at the largest T (3 repeats + 1 runs), counted twice, as they run on one thread."""
    H, d, C, n = args.heads, args.head_dim, args.chunk_size, args.repeats + 3
    total = 0.0
    for T in args.tokens:
        flash = attention_flops(T, heads=H, head_dim=d, causal=True)
        total += n * (chunk_flops(T, H, d, C) * (2 if args.torch else 1) + flash + 8 * T * H * d * d)
    parts = (3 * args.repeats + 1) * chunk_flops(max(args.tokens), H, d, C) * 2
    return total + n * sum(chunk_flops(args.tokens[0], H, d, size) for size in args.chunk_sizes) + parts


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch = torch_import.load_torch()[0] if args.torch else None
    info, lines = machine.header(*((torch.__version__, torch.get_num_threads()) if torch else ()))
    print(lines)
    run = SimpleNamespace(rate=machine.matmul_rate("float32"), torch=torch_chunked(args) if torch else None)
    print(f"float32 matmul, 2048 x 2048: {run.rate:.1f} GFLOP/s")
    problem = limits.time_problem(run_flops(args), run.rate, "lower --tokens, --heads or --repeats")
    if problem:
        sys.exit(f"linear.py: error: {problem}")
    sections = [
        (args.tokens, measure_prefill, print_prefill),
        (args.chunk_sizes, measure_chunk_size, print_chunk_sizes),
        (args.contexts, measure_decode, print_decode),
        ([max(args.tokens)], prefill_parts, print_parts),
    ]
    figures: dict[str, Any] = {"machine": info, "matmul_gflops": run.rate, "args": vars(args)}
    for (items, measure, show), key in zip(sections, ("prefill", "chunk_sizes", "decode", "parts"), strict=True):
        rows: list[dict[str, Any]] = []
        stopped = interrupts.measure_each(items, lambda item, measure=measure: measure(item, args, run), rows)
        if rows:
            show(rows, args, run)
        figures[key] = rows
        if stopped:
            break
    if args.json:
        outputs.write_json(args.json, figures, stopped)
    return interrupts.interrupted(len(rows), len(items)) if stopped else check.finish()


if __name__ == "__main__":
    sys.exit(interrupts.run_main(main))
