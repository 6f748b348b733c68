"""Sparse attention in numbers: DeepSeek-V3.2's indexer and the attention over the keys it chose, against dense
latent attention, in arithmetic at DeepSeek's sizes and measured at sizes scaled to this machine.

What it shows:
  1) one layer at DeepSeek-V3.2's sizes (128 heads, a latent of 512 + 64, an indexer of 64 heads of 128, the top
     2,048 keys), by context S: a decode step (one new token over S cached ones) and a prefill of S tokens, dense
     MLA against DSA, the FLOPs and the bytes read (bf16: 2 bytes a number; in a prefill, a tile of 64 queries
     reads a key once, a gather reads it for each query that chose it), DSA's two parts apart (the indexer scores
     every key; the attention reads the topk it chose); where DSA's cost drops below dense's, and what the
     indexer's part is at the longest context.
  2) measured here at --heads query heads and --index-heads indexer heads (DeepSeek's widths, float32), the top
     --topk keys: one decode step and one prefill at each --contexts S, dense (flash_decode, flash_attention over
     the latent, the absorbed form) against DSA (index_topk, then sparse_attention), the time beside the FLOPs.
  3) the speed checks: index_topk for the last --queries queries of a --tokens context against its FLOPs at this
     machine's matmul rate, and sparse_attention of those queries over the keys it chose against flash_attention
     over a queries x topk problem of the same heads and widths (each target: within 1.3x).
  4) where index_topk's time goes, on one thread (tinyattn_np.sparse_profile: its engine copied, each NumPy call
     timed into its part): the scores' matmuls, the ReLU, the heads' weighted sum, the running top-k, and after
     each, the time so far as a multiple of the FLOPs at the matmul rate of one thread, timed beside it: how much
     of the target the matmuls alone, and the ReLU after them, leave to the rest.
The projections (x W) cost the same in both and are left out.

Run:  python scripts/sparse.py [--contexts 512 1024] [--heads 16] [--index-heads 16] [--topk 256]
                               [--tokens 2048] [--queries 128] [--repeats 3] [--json PATH]
The results page's speed checks, at DeepSeek-V3.2's heads and topk:
      python scripts/sparse.py --repeats 1 --tokens 16384 --queries 1024 --topk 2048 --heads 128 --index-heads 64
Every claim is checked (the forms agree where they should); the exit code is 1 if one fails. The speed targets
are printed, not checked: a busy machine would fail them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from tinyattn_np import flash_attention, flash_decode, index_topk, sparse_attention
from tinyattn_np.measure import alternating_medians_ms
from tinyattn_np.report import Checklist, add_seed_and_format, max_diff, positive, text_table
from tinyattn_np.sparse import sparse_decode
from tinyattn_np.sparse_profile import INDEX_PARTS, profile_index

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the modules this script shares sit beside it
import interrupts  # noqa: E402
import kernel_profile  # noqa: E402
import limits  # noqa: E402
import machine  # noqa: E402
import outputs  # noqa: E402

check = Checklist()  # every claim the script prints is checked; main() returns check.finish()
RANK, ROPE, INDEX_DIM = 512, 64, 128  # DeepSeek-V3.2: kv_lora_rank, qk_rope_head_dim, index_head_dim
LATENT = RANK + ROPE  # a token's latent: 576 numbers, the absorbed form's key; its first 512 the value
DEEPSEEK = SimpleNamespace(heads=128, index_heads=64, topk=2048, nope=128, v=128)
DEEPSEEK_CONTEXTS = [1024, 2048, 4096, 8192, 32768, 131072]
TARGET = 1.3  # the speed checks' targets
BLOCK_Q = 64  # queries that share a tile's reads in a prefill's arithmetic
SAME = 1e-4  # float32: sparse over every key against dense, relative (the same sums in another order)


# ---------------------------------------------------------------------------------------------------
# 1) the arithmetic


def decode_costs(S: int, heads: int, index_heads: int, topk: int, itemsize: float) -> dict[str, tuple[float, float]]:
    """(FLOPs, bytes read) of one decode step over S cached tokens: dense reads every latent; DSA's indexer reads
    every indexer key (2 H_I d_I FLOPs each), its attention the min(S, topk) latents chosen. The absorbed form: a
    key costs 2 H (576 + 512) FLOPs, scores and values."""
    chosen = min(S, topk)
    indexer = (2 * index_heads * INDEX_DIM * S, S * INDEX_DIM * itemsize)
    attention = (2 * heads * chosen * (LATENT + RANK), chosen * LATENT * itemsize)
    return {
        "dense": (2 * heads * S * (LATENT + RANK), S * LATENT * itemsize),
        "indexer": indexer,
        "attention": attention,
        "DSA": (indexer[0] + attention[0], indexer[1] + attention[1]),
    }


def prefill_costs(T: int, heads: int, index_heads: int, topk: int, itemsize: float) -> dict[str, tuple[float, float]]:
    """(FLOPs, bytes read) of a causal prefill of T tokens: query t sees t + 1 keys, and DSA's attention
    min(t + 1, topk) of them. Dense attention and the indexer read a key once for a block of BLOCK_Q queries (a
    tile); the sparse attention reads each query's own chosen keys (a gather: two queries share no read)."""
    pairs = T * (T + 1) // 2
    chosen = pairs - (T - topk) * (T - topk + 1) // 2 if T > topk else pairs  # Σ_t min(t + 1, topk)
    indexer = (2 * index_heads * INDEX_DIM * pairs, pairs / BLOCK_Q * INDEX_DIM * itemsize)
    attention = (2 * heads * chosen * (LATENT + RANK), chosen * LATENT * itemsize)
    return {
        "dense": (2 * heads * pairs * (LATENT + RANK), pairs / BLOCK_Q * LATENT * itemsize),
        "indexer": indexer,
        "attention": attention,
        "DSA": (indexer[0] + attention[0], indexer[1] + attention[1]),
    }


def naive_prefill_flops(T: int, m: SimpleNamespace) -> float:
    """A dense prefill's FLOPs in the naive form, DeepSeek's for prefill: a pair costs 2 H (192 + 128)."""
    return 2 * m.heads * (m.nope + ROPE + m.v) * T * (T + 1) // 2


def crossing(costs: Any, part: int, m: SimpleNamespace, dense: Any = None) -> int:
    """The smallest S (a whole token) at which DSA's FLOPs (part 0) or bytes (part 1) are below dense's (or below
    dense(S), given)."""
    low, high = 1, 1 << 24
    while low < high:
        mid = (low + high) // 2
        c = costs(mid, m.heads, m.index_heads, m.topk, 2)
        below = c["DSA"][part] < (c["dense"][part] if dense is None else dense(mid))
        low, high = (low, mid) if below else (mid + 1, high)
    return low


def print_arithmetic(args: argparse.Namespace) -> None:
    m = DEEPSEEK
    for what, costs, work, unit in (
        ("a decode step (one new token)", decode_costs, "GFLOP", "MB"),
        ("a prefill of S tokens", prefill_costs, "TFLOP", "GB"),
    ):
        body, per = [], {"GFLOP": 1e9, "TFLOP": 1e12, "MB": 1e6, "GB": 1e9}
        for S in DEEPSEEK_CONTEXTS:
            c = costs(S, m.heads, m.index_heads, m.topk, 2)
            flops = (f"{c[name][0] / per[work]:,.2f}" for name in ("dense", "indexer", "attention", "DSA"))
            reads = (f"{c[name][1] / per[unit]:,.2f}" for name in ("dense", "DSA"))
            ratios = (f"{c['dense'][0] / c['DSA'][0]:.1f}x", f"{c['indexer'][0] / c['DSA'][0]:.0%}")
            body.append([f"{S:,}", *flops, *reads, *ratios])
        print(
            f"\n1) {what}, one layer at DeepSeek-V3.2's sizes: {m.heads} heads, latent {RANK} + {ROPE},\n   "
            f"indexer {m.index_heads} x {INDEX_DIM}, top {m.topk:,}; bf16"
        )
        headers = ["S", f"{work}: dense", "indexer", "attention", "DSA", f"{unit} read: dense", "DSA"]
        headers += ["FLOPs dense/DSA", "indexer's"]
        print(text_table(body, headers, fmt=args.format))
        flops, read = crossing(costs, 0, m), crossing(costs, 1, m)
        print(f"   DSA does fewer FLOPs than dense from S = {flops:,}, reads fewer bytes from S = {read:,}")
    naive = crossing(prefill_costs, 0, m, lambda T: naive_prefill_flops(T, m))
    print(
        f"   dense is the absorbed form, as measured below; DeepSeek prefills in the naive form, 2 · {m.heads} · "
        f"(192 + 128) FLOPs\n   a pair, 3.4x fewer: against it DSA's prefill does fewer FLOPs from S = "
        f"{naive:,}"
    )
    c = decode_costs(131072, m.heads, m.index_heads, m.topk, 2)
    (flops, read), share = c["indexer"], (c["indexer"][0] / c["DSA"][0], c["indexer"][1] / c["DSA"][1])
    print(
        f"   at 128k a decode step's indexer does {flops / 1e9:.2f} GFLOP and reads {read / 1e6:.1f} MB: "
        f"{share[0]:.0%} of DSA's FLOPs and {share[1]:.0%} of its bytes;\n   the attention reads {m.topk:,} latents "
        "whatever S (the paper runs the indexer in FP8: half its bytes)"
    )


# ---------------------------------------------------------------------------------------------------
# 2) measured: a decode step and a prefill, dense against DSA


def inputs(S: int, queries: int, args: argparse.Namespace, rng: np.random.Generator) -> SimpleNamespace:
    """The latents and indexer keys of S tokens and the last `queries` tokens' absorbed and indexer queries."""

    def normal(*shape: int, scale: float = 1.0) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(np.float32)

    return SimpleNamespace(
        latent=normal(1, 1, S, LATENT),
        index_keys=normal(1, S, INDEX_DIM),
        q=normal(1, args.heads, queries, LATENT, scale=LATENT**-0.5),
        q_index=normal(1, args.index_heads, queries, INDEX_DIM, scale=INDEX_DIM**-0.5),
        weights=normal(1, queries, args.index_heads),
    )


def steps(S: int, args: argparse.Namespace, rng: np.random.Generator) -> dict[str, Any]:
    """The four calls timed at context S, each a function of nothing."""
    one, every = inputs(S, 1, args, rng), inputs(S, S, args, rng)
    scale = (DEEPSEEK.nope + ROPE) ** -0.5  # the attention's softmax scale, as DeepSeek's

    def dsa_prefill() -> np.ndarray:
        chosen = index_topk(every.q_index, every.index_keys, every.weights, args.topk)
        return sparse_attention(every.q, every.latent, every.latent[..., :RANK], chosen, scale=scale)

    def dsa_decode() -> np.ndarray:
        cached = one.latent[:, 0], one.index_keys, [S]  # the latents, the indexer keys, the length
        return sparse_decode(one.q, one.q_index, one.weights, *cached, args.topk, value_dim=RANK, scale=scale)[0]

    def dense_prefill() -> np.ndarray:
        return flash_attention(every.q, every.latent, every.latent[..., :RANK], causal=True, scale=scale)

    return {
        "decode dense": lambda: flash_decode(one.q, one.latent, one.latent[..., :RANK], scale=scale),
        "decode DSA": dsa_decode,
        "prefill dense": dense_prefill,
        "prefill DSA": dsa_prefill,
    }


def measure_context(S: int, args: argparse.Namespace, rate: float) -> dict[str, Any]:
    """Each step at context S, timed in turns; where topk covers every key, DSA checked equal to dense."""
    outputs.progress(f"S = {S:,}")
    calls = steps(S, args, np.random.default_rng(args.seed))
    if args.topk >= S:
        for kind in ("decode", "prefill"):
            dense, dsa = calls[f"{kind} dense"](), calls[f"{kind} DSA"]()
            diff = max_diff(dsa, dense) / np.max(np.abs(dense))
            check(
                diff <= SAME,
                f"S = {S:,}: DSA's {kind} reads every key (topk >= S), and equals dense (relative {diff:.1e})",
            )
    times = alternating_medians_ms(list(calls.values()), repeats=args.repeats, rounds=2, idle=machine.SETTLE_SECONDS)
    row: dict[str, Any] = {"context": S, **machine.beside_the_row("float32", rate)}
    for (name, ms), kind in zip(zip(calls, times, strict=True), ("decode",) * 2 + ("prefill",) * 2, strict=True):
        costs = (decode_costs if kind == "decode" else prefill_costs)(S, args.heads, args.index_heads, args.topk, 4)
        row[name] = {"ms": ms, "flops": costs["dense" if name.endswith("dense") else "DSA"][0]}
    return row


def print_measured(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    body = [
        [
            f"{row['context']:,}",
            *(f"{row[name]['ms']:,.1f}" for name in ("decode dense", "decode DSA")),
            f"{row['decode dense']['ms'] / row['decode DSA']['ms']:.1f}x",
            *(f"{row[name]['ms']:,.0f}" for name in ("prefill dense", "prefill DSA")),
            f"{row['prefill dense']['ms'] / row['prefill DSA']['ms']:.1f}x",
            f"{row['prefill dense']['flops'] / row['prefill DSA']['flops']:.1f}x",
        ]
        for row in rows
    ]
    print(
        f"\n2) measured here: {args.heads} heads, an indexer of {args.index_heads} x {INDEX_DIM}, the top "
        f"{args.topk:,}, float32; ms (median)"
    )
    headers = ["S", "decode dense", "DSA", "dense/DSA", "prefill dense", "DSA", "dense/DSA", "FLOPs dense/DSA"]
    print(machine.marked_table(body, rows, headers, args.format, lambda row: f"S={row['context']:,}"))


# ---------------------------------------------------------------------------------------------------
# 3) the speed checks


def speed_checks(args: argparse.Namespace, rate: float) -> dict[str, Any]:
    """index_topk against its FLOPs at the matmul rate; sparse_attention against flash over queries x topk. The
    matmul (2048 x 2048, every thread) is timed in turns with them: its rate is the one beside their times."""
    T, Q, k = args.tokens, args.queries, args.topk
    outputs.progress(f"speed checks: the last {Q:,} queries of {T:,} tokens, top {k:,}")
    x = inputs(T, Q, args, np.random.default_rng(args.seed))
    scale = (DEEPSEEK.nope + ROPE) ** -0.5
    chosen = index_topk(x.q_index, x.index_keys, x.weights, k)  # (1, Q, topk): the keys the timed attention reads
    first = np.broadcast_to(np.arange(k), (1, Q, k))  # every query the keys 0 .. topk-1: the dense problem exactly
    dense = flash_attention(x.q, x.latent[:, :, :k], x.latent[:, :, :k, :RANK], scale=scale)
    diff = max_diff(sparse_attention(x.q, x.latent, x.latent[..., :RANK], first, scale=scale), dense)
    check(
        diff / np.max(np.abs(dense)) <= SAME,
        f"sparse_attention over keys 0 .. {k - 1} equals flash_attention over "
        f"them (relative {diff / np.max(np.abs(dense)):.1e})",
    )
    square = np.random.default_rng(1).standard_normal((2048, 2048)).astype(np.float32)
    calls = [
        lambda: index_topk(x.q_index, x.index_keys, x.weights, k),
        lambda: sparse_attention(x.q, x.latent, x.latent[..., :RANK], chosen, scale=scale),
        lambda: flash_attention(x.q, x.latent[:, :, :k], x.latent[:, :, :k, :RANK], scale=scale),
        lambda: square @ square,
    ]
    ms = alternating_medians_ms(calls, repeats=args.repeats, rounds=2, idle=machine.SETTLE_SECONDS)
    seen = np.arange(T - Q + 1, T + 1)  # the keys each query sees: causal, bottom-right
    index_flops = 2 * args.index_heads * INDEX_DIM * int(seen[seen > k].sum())  # one who sees <= topk takes them all
    return {
        "tokens": T,
        "queries": Q,
        "topk": k,
        "index_ms": ms[0],
        "index_flops": index_flops,
        "sparse_ms": ms[1],
        "flash_ms": ms[2],
        "attention_flops": 2 * args.heads * Q * k * (LATENT + RANK),
        "turns_gflops": 2 * 2048**3 / ms[3] / 1e6,
        **machine.beside_the_row("float32", rate),
    }


def print_speed(result: dict[str, Any], args: argparse.Namespace) -> None:
    r = SimpleNamespace(**result)
    print(
        f"\n3) the speed checks: the last {r.queries:,} queries of a {r.tokens:,}-token context, the top {r.topk:,} "
        f"keys each;\n   {args.heads} heads (one kv head: the latent, {LATENT} wide, its first {RANK} the value), an "
        f"indexer of {args.index_heads} x {INDEX_DIM};\n   float32; the matmul, timed in turns with them: "
        f"{r.turns_gflops:.1f} GFLOP/s"
    )
    dense = f"flash_attention, {r.queries:,} x {r.topk:,}"
    body = []
    for name, ms, flops, against, target in [
        ("index_topk (causal)", r.index_ms, r.index_flops, "its FLOPs at the matmul rate", None),
        ("sparse_attention", r.sparse_ms, r.attention_flops, dense, r.flash_ms),
        ("flash_attention", r.flash_ms, r.attention_flops, "", None),
    ]:
        at_rate = flops / r.turns_gflops / 1e6  # ms
        ratio = (ms / target if target else ms / at_rate) if against else None
        judged = "not judged (*)" if result.get("busy") else _verdict(ratio or 0.0)  # no verdict from a busy row
        verdict = ["", ""] if ratio is None else [f"{ratio:.2f}x", judged]
        cells = [f"{ms:,.0f}", f"{flops / 1e9:,.1f}", f"{flops / ms / 1e6:,.1f}", f"{ms / at_rate:.2f}x"]
        body.append([name, *cells, against, *verdict])
    rows = [dict(result, call="the checks"), {}, {}]  # measured together: one note for all
    headers = ["call", "ms", "GFLOP", "GFLOP/s", "/ matmul", "the target: against", "ratio", f"within {TARGET}x"]
    print(machine.marked_table(body, rows, headers, args.format, lambda row: row["call"]))


def _verdict(ratio: float) -> str:
    return "yes" if ratio <= TARGET else "no"


# ---------------------------------------------------------------------------------------------------
# 4) where index_topk's time goes


def index_parts(args: argparse.Namespace) -> dict[str, Any]:
    """The speed checks' index_topk (the same inputs, from --seed) on one thread, part by part."""
    outputs.progress(f"index_topk's parts on one thread: {args.queries:,} queries of {args.tokens:,} tokens")
    x = inputs(args.tokens, args.queries, args, np.random.default_rng(args.seed))
    row = profile_index(
        x.q_index,
        x.index_keys,
        x.weights,
        args.topk,
        repeats=args.repeats,
        matmul_rate=lambda: machine.matmul_rate("float32", repeats=1),  # on one thread, as profile_index holds BLAS
    )
    check(row["same_bits"], "the profile's copy of index_topk's engine gives its indices")
    return {**row, "busy": machine.busy_reasons()}


def print_parts(row: dict[str, Any], args: argparse.Namespace) -> None:
    parts, rate, (matmuls, relu) = row["parts_ms"], row["matmul_gflops"], INDEX_PARTS[:2]
    at_rate = row["flops"] / rate / 1e6  # ms: the matmuls' FLOPs at the one-thread rate
    runs = kernel_profile.runs_said(args.repeats)
    print(
        f"\n4) where index_topk's time goes: the speed checks' queries on one thread, its engine copied part by part"
        f"\n   ({runs}); the matmul on one BLAS thread beside them: {rate:.1f} "
        f"GFLOP/s;\n   the scores' matmuls: {row['flops'] / 1e9:,.1f} GFLOP, {at_rate:,.0f} ms at that rate"
    )
    print(kernel_profile.parts_so_far(row, at_rate, args.format))
    floor = (parts[matmuls] + parts[relu]) / at_rate
    said = kernel_profile.floor_verdict(row, floor, TARGET)
    print(
        f"   the engine itself: {row['kernel_ms']:,.0f} ms on one thread; the copy gives its indices: "
        f"{'yes' if row['same_bits'] else 'NO'}\n   the matmuls alone take {parts[matmuls] / at_rate:.2f}x their "
        f"FLOPs at the rate, and with the ReLU after them {floor:.2f}x:\n   {said} the {TARGET}x target before the "
        f"heads' weighted sum and the top-k"
    )


# ---------------------------------------------------------------------------------------------------
# arguments, and the run estimated before it starts


def run_bytes(args: argparse.Namespace) -> float:
    """The arrays of the largest context's prefill and of the speed checks, float32, with their outputs."""
    S = max(args.contexts)
    prefill = S * (LATENT + INDEX_DIM + args.heads * (LATENT + 2 * RANK) + args.index_heads * (INDEX_DIM + 1))
    checks = args.tokens * (LATENT + INDEX_DIM) + args.queries * (args.heads * (LATENT + 2 * RANK) + 2 * args.topk)
    return 4.0 * max(prefill + S * args.topk * 2, checks + args.queries * args.index_heads * INDEX_DIM)


def run_flops(args: argparse.Namespace) -> float:
    """FLOPs of the whole run: each call timed 2 (rounds) x (repeats + 2 warm-up) times, the checks once more;
    section 4's index_topk 3 repeats + 1 times, counted twice, as it runs on one thread."""
    total = 0.0
    for S in args.contexts:
        for costs in (decode_costs, prefill_costs):
            c = costs(S, args.heads, args.index_heads, args.topk, 4)
            total += c["dense"][0] + c["DSA"][0]
    Q, T = args.queries, args.tokens
    index = 2 * args.index_heads * INDEX_DIM * Q * T
    checks = index + 2 * 2 * args.heads * Q * args.topk * (LATENT + RANK)
    parts = (3 * args.repeats + 1) * index * 2  # section 4: the engine and its copy, on one thread of two or more
    return (2 * (args.repeats + 2) + 1) * (total + checks) + parts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    size = positive(int, limits.MAX_TOKENS)
    p.add_argument(
        "--contexts",
        type=size,
        nargs="+",
        default=[512, 1024],
        metavar="S",
        help="contexts S of section 2 (default 512 1024)",
    )
    p.add_argument("--heads", type=positive(int, limits.MAX_HEADS), default=16, help="query heads (default 16)")
    p.add_argument(
        "--index-heads",
        type=positive(int, limits.MAX_HEADS),
        default=16,
        help="indexer heads (default 16; DeepSeek-V3.2's: 64)",
    )
    p.add_argument("--topk", type=size, default=256, help="keys each query reads (default 256; DeepSeek's: 2048)")
    p.add_argument("--tokens", type=size, default=2048, help="the speed checks' context (default 2048)")
    p.add_argument(
        "--queries", type=size, default=128, help="the speed checks' queries, the last of the context (default 128)"
    )
    p.add_argument(
        "--repeats",
        type=positive(int, limits.MAX_REPEATS),
        default=3,
        help="timed runs per figure and round (default 3)",
    )
    p.add_argument("--json", metavar="PATH", help="write every figure, the machine and the code version to PATH")
    add_seed_and_format(p, "the random latents, keys and queries")
    args = p.parse_args(argv)
    if args.queries > args.tokens or args.topk > args.tokens:
        p.error(f"--queries ({args.queries:,}) and --topk ({args.topk:,}) must be at most --tokens ({args.tokens:,})")
    problem = limits.memory_problem(run_bytes(args), "this run", "lower --contexts, --tokens, --queries or --heads")
    if problem:
        p.error(problem)
    outputs.check_output(p, "--json", args.json)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    info, lines = machine.header()
    print(lines)
    print_arithmetic(args)
    rate = machine.matmul_rate("float32")
    problem = limits.time_problem(run_flops(args), rate, "lower --contexts, --tokens, --queries or --repeats")
    if problem:
        sys.exit(f"sparse.py: error: {problem}")
    rows: list[dict[str, Any]] = []
    stopped = interrupts.measure_each(args.contexts, lambda S: measure_context(S, args, rate), rows)
    if rows:
        print_measured(rows, args)
    speed: list[dict[str, Any]] = []
    if not stopped:
        stopped = interrupts.measure_each([args], lambda a: speed_checks(a, rate), speed)
    if speed:
        print_speed(speed[0], args)
    parts: list[dict[str, Any]] = []
    if not stopped:
        stopped = interrupts.measure_each([args], index_parts, parts)
    if parts:
        print_parts(parts[0], args)
    if args.json:
        figures = {"machine": info, "matmul_gflops": rate, "args": vars(args), "rows": rows, "speed": speed}
        outputs.write_json(args.json, {**figures, "index_parts": parts}, stopped)
    done = len(rows) + len(speed) + len(parts)
    return interrupts.interrupted(done, len(args.contexts) + 2) if stopped else check.finish()


if __name__ == "__main__":
    sys.exit(interrupts.run_main(main))
