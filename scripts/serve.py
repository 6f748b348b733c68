"""A simulated server: continuous batching over a paged KV cache, and the memory paging saves.

What it shows:
  1) --requests requests arrive over time (a seeded Poisson process), each with a prompt length and an output
     length drawn from seeded uniform distributions, and a limit of --max-new new tokens. Every step the
     server admits waiting requests while the pool has room, prefills them (their first token), decodes one
     token for every other running request in one batched step (MultiHeadAttention over a PagedKVCache per
     layer: paged_decode), and retires the finished ones, whose blocks return to the pool. The workload runs
     twice under one memory budget (--blocks blocks of --block-size tokens): admitted as paging needs (blocks
     as tokens come), and as contiguous preallocation needs (each request reserves its whole maximum, prompt
     + max-new, at admission, as a KVCache of max_tokens would). The table: tokens per second, steps, requests
     at once, and the share of the held KV memory that holds no token: the vLLM paper's waste figure
     (Kwon et al. 2023, "Efficient Memory Management for Large Language Model Serving with PagedAttention").
  2) --samples parallel samples of one prompt of --sample-prompt tokens: forked from it (copy-on-write), each
     sampling --sample-tokens tokens at temperature 1 with its own seed. The KV memory with the prompt's
     blocks shared, against n separate copies (both measured in the pool) and memory.paged_kv_cache_bytes;
     one decode step over the samples by paged_decode and by cascade_decode (the prompt read once for all).

Checks (exit code 1, naming the failed ones): every request's tokens, and its logits to rounding, equal
running that request alone through a contiguous KVCache; the blocks in use equal memory.paged_kv_cache_bytes
of the lengths at every step; each sample equals that sample run alone; cascade_decode equals paged_decode.

Run:  python scripts/serve.py [--requests 24] [--blocks 96] [--block-size 16] [--samples 8] [--seed 0]
The weights are random and untrained: the tokens mean nothing; the memory and the scheduling are the point.
A run of 10 s or more first says how long it takes at least (each kind of call timed here); past 30 minutes, refused.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

from tinyattn_np import (
    KVCache,
    PagedKVCache,
    cascade_decode,
    format_bytes,
    kv_cache_bytes,
    paged_decode,
    paged_kv_cache_bytes,
)
from tinyattn_np.measure import time_calls
from tinyattn_np.report import (
    Checklist,
    add_seed_and_format,
    add_wide_argument,
    positive,
    table_width,
    text_table,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the modules this script shares sit beside it
import batching
import interrupts
import limits
import machine
import outputs
from tiny_decoder import TinyDecoder

check = Checklist()  # every claim the script prints is checked; main() returns check.finish()
MAX_WORK_TOKENS = 200_000  # requests x (prompt + max-new), plus the samples: past this, minutes
MAX_SIZES = {
    "layers": 16,
    "d_model": 1024,
    "heads": 512,
    "vocab": 100_000,
    "samples": 1024,
    "blocks": 2**20,
    "block_size": 4096,
}  # each flag's largest value: a simulation, not a server


# ---------------------------------------------------------------------------------------------------
# 1) continuous batching (batching.py)


def check_alone(model: TinyDecoder, requests: list[batching.Request], tol: float) -> float:
    """Every request's tokens must equal running it alone through a contiguous KVCache;
    the largest |logit diff|."""
    worst, same = 0.0, True
    for request in requests:
        tokens, logits = batching.run_alone(model, request.prompt, request.output_len)
        same &= tokens == request.tokens
        worst = max(worst, float(np.max(np.abs(logits - np.array(request.logits)))))
    check(same, f"every one of {len(requests)} requests generates the same tokens as when run alone")
    check(worst <= tol, f"... and the same logits to rounding (max |diff| {worst:.1e} <= {tol:g})")
    return worst


def batching_rows(model: TinyDecoder, args: argparse.Namespace, rng: np.random.Generator, rate: float) -> list[dict]:
    """Part 1: the workload under each scheme, the checks, a row of what was measured for each, printed."""
    workload, rows = batching.draw_workload(args, rng), []
    for scheme in ("paged", "contiguous"):
        # the same requests, fresh for each scheme
        requests = [batching.Request(*drawn) for drawn in workload]
        stats = batching.serve(model, requests, scheme, args)
        held, reserved, stored, match = (np.array(column) for column in zip(*stats["memory"], strict=True))
        check(
            bool(match.all()),
            f"{scheme}: the pool holds memory.paged_kv_cache_bytes of the lengths at every step",
        )
        if args.check:
            stats["max_diff"] = check_alone(model, requests, 1e-9 if args.dtype == "float64" else 1e-3)
        own = held if scheme == "paged" else reserved  # the memory this scheme holds
        rows.append(
            {
                "scheme": scheme,
                "steps": stats["steps"],
                "tokens": stats["tokens"],
                "tokens_per_s": stats["tokens"] / stats["seconds"],
                "mean_at_once": float(np.mean(stats["at_once"])),
                "most_at_once": int(max(stats["at_once"])),
                "preempted": stats["preempted"],
                "waste": 1 - stored.sum() / own.sum(),
                "waste_if_preallocated": 1 - stored.sum() / reserved.sum(),
                "peak_stored": int(stored.max()),
                "peak_held": int(own.max()),
                "max_diff": stats.get("max_diff"),
                **machine.beside_the_row(args.dtype, rate, n=machine.RATE_SIZE),
            }
        )
    print_batching(rows, args)
    print_bill(args)
    return rows


# ---------------------------------------------------------------------------------------------------
# 2) parallel samples of one prompt


def sample_all(model: TinyDecoder, caches: list[PagedKVCache], seqs: list[int], first: np.ndarray, args, seeds):
    """Each sequence samples --sample-tokens tokens with its own generator,
    all decoded in one batch per step."""
    rngs = [np.random.default_rng(seed) for seed in seeds]
    tokens = [[batching.sample(first, rng)] for rng in rngs]
    while len(tokens[0]) < args.sample_tokens:
        logits = model.logits(np.array([[t[-1]] for t in tokens]), caches, seqs)  # (n, V)
        for row, rng, out in zip(logits, rngs, tokens, strict=True):
            out.append(batching.sample(row, rng))
    return tokens


def parallel_samples(model: TinyDecoder, args: argparse.Namespace, rng: np.random.Generator) -> dict[str, Any]:
    """Part 2: n samples forked from one prompt against n separate copies of it; the bytes, the checks, the
    decode step by paged_decode and by cascade_decode."""
    n, size, mha = args.samples, args.block_size, model.blocks[0]
    prompt, seeds = rng.integers(0, args.vocab, args.sample_prompt), rng.integers(2**32, size=n)
    blocks = n * (-(-(args.sample_prompt + args.sample_tokens) // size) + 1)  # room for n copies
    # 1) shared: one prefill, then n - 1 forks of it (every layer alike)
    shared = model.paged_caches(blocks, size)
    parent = [cache.add_sequence() for cache in shared][0]
    first = model.logits(prompt[None], shared, [parent])[0]
    seqs = [parent] + [[cache.fork(parent) for cache in shared][0] for _ in range(n - 1)]
    tokens = sample_all(model, shared, seqs, first, args, seeds)
    # 2) copies: n prefills of the same prompt, the same samples
    copies = model.paged_caches(blocks, size)
    own = [[cache.add_sequence() for cache in copies][0] for _ in range(n)]
    for seq in own:
        model.logits(prompt[None], copies, [seq])
    check(sample_all(model, copies, own, first, args, seeds) == tokens, "the copies sample the same tokens")
    lengths = [shared[0].length(seq) for seq in seqs]
    formula = paged_kv_cache_bytes(
        lengths,
        block_size=size,
        layers=args.layers,
        kv_heads=mha.n_kv_heads,
        head_dim=mha.d_head,
        dtype=args.dtype,
        shared_prefix=args.sample_prompt,
    )
    shared_bytes, copies_bytes = (sum(cache.bytes_used for cache in caches) for caches in (shared, copies))
    check(
        shared_bytes == formula,
        "the shared pool holds memory.paged_kv_cache_bytes(..., shared_prefix=prompt)",
    )
    if args.check:
        alone = [
            batching.run_alone(model, prompt, args.sample_tokens, np.random.default_rng(seed))[0] for seed in seeds
        ]
        check(alone == tokens, f"each of the {n} samples equals that sample run alone")
    # 3) a decode step over the samples: every sequence's keys, or the shared prompt once for all (cascade)
    q = rng.standard_normal((n, mha.n_heads, 1, mha.d_head)).astype(model.dtype)
    diff = float(np.max(np.abs(paged_decode(q, shared[0], seqs) - cascade_decode(q, shared[0], seqs))))
    check(
        diff <= (1e-12 if args.dtype == "float64" else 1e-5),
        f"cascade_decode equals paged_decode ({diff:.1e})",
    )
    result = {
        "shared_bytes": shared_bytes,
        "copies_bytes": copies_bytes,
        "formula_bytes": formula,
        "lengths": lengths,
    }
    print_samples(result, args)
    return result


# ---------------------------------------------------------------------------------------------------
# the tables


def print_batching(rows: list[dict], args: argparse.Namespace) -> None:
    table = [
        [
            r["scheme"],
            f"{r['tokens_per_s']:,.0f}",
            f"{r['steps']:,}",
            f"{r['mean_at_once']:.1f}",
            str(r["most_at_once"]),
            str(r["preempted"]),
            f"{r['peak_held']:,}",
            f"{100 * r['waste']:.1f}%",
        ]
        for r in rows
    ]
    headers = ["admission", "tokens/s", "steps", "requests at once (mean)", "(most)", "preempted"]
    headers += ["KV slots held (peak)", "held, no token (waste)"]
    print(
        f"1) {args.requests} requests, prompts {args.min_prompt}-{args.max_prompt} tokens, outputs 1-{args.max_new} "
        f"(limit {args.max_new}), {args.rate} arrivals per step;\n   a budget of {args.blocks} blocks of "
        f"{args.block_size} tokens ({args.blocks * args.block_size:,} KV slots per layer); {args.layers} layers, "
        f"d_model {args.d_model}, "
        f"{args.heads} heads over {args.kv_heads} kv heads, {args.dtype}"
    )
    print(machine.marked_table(table, rows, headers, args.format, lambda r: r["scheme"], width=table_width(args)))
    paged = rows[0]
    print(
        "  the paged run's requests, step by step, preallocated at their limits instead: "
        f"{100 * paged['waste_if_preallocated']:.1f}% of the memory held\n  would hold no token "
        f"(paged: {100 * paged['waste']:.1f}%, at most block_size - 1 slots a request)"
    )
    print("  waste: 1 - (tokens in the cache) / (token slots held), summed over the steps; one layer (all are alike)")


def print_bill(args: argparse.Namespace) -> None:
    """The workload's bill on a real model, from the formulas: every request at its full length at once."""
    shape = dict(layers=32, kv_heads=8, head_dim=128, dtype="bf16")  # Llama-3-8B (models.PRESETS)
    workload = batching.draw_workload(args, np.random.default_rng(args.seed))
    paged = paged_kv_cache_bytes([len(p) + o for _, p, o in workload], block_size=16, **shape)
    reserved = kv_cache_bytes(sum(len(p) + args.max_new for _, p, _ in workload), **shape)
    print(
        f"  on Llama-3-8B (bf16), every request at its full length at once: paged in blocks of 16 "
        f"{format_bytes(paged)},\n  preallocated at prompt + limit {format_bytes(reserved)} "
        "(memory.paged_kv_cache_bytes, memory.kv_cache_bytes)"
    )


def print_samples(result: dict, args: argparse.Namespace) -> None:
    saved = result["copies_bytes"] - result["shared_bytes"]
    table = [
        ["shared prompt (fork, copy-on-write)", format_bytes(result["shared_bytes"])],
        [f"{args.samples} copies of the prompt", format_bytes(result["copies_bytes"])],
        ["saved", f"{format_bytes(saved)} ({100 * saved / result['copies_bytes']:.0f}%)"],
        ["memory.paged_kv_cache_bytes(..., shared_prefix)", format_bytes(result["formula_bytes"])],
    ]
    print(
        f"2) {args.samples} samples of one {args.sample_prompt}-token prompt, {args.sample_tokens} tokens each "
        f"(temperature 1, a seed each), KV memory of all {args.layers} layers"
    )
    print(text_table(table, ["KV cache", "bytes held"], args.format))


# ---------------------------------------------------------------------------------------------------
# the whole run, estimated before it starts


def run_calls(args: argparse.Namespace) -> list[int]:
    """[prefills, decode steps through a contiguous KVCache, batched decode steps through the paged caches,
    the sequences those steps decode beyond one a step] of the whole run, from the flags and the workload they
    draw. Both schemes serve every request (a prefill, then a token a step, batched) and --check runs each
    request alone again; part 2 prefills its prompt 1 + n times, decodes n samples twice (batched) and with
    --check runs each alone. Preemption's recomputing is left out, and a scheme's batched steps are counted as
    its longest output's (at least that many): a lower bound."""
    outputs = [new for _, _, new in batching.draw_workload(args, np.random.default_rng(args.seed))]
    n, new, checks = args.samples, args.sample_tokens, int(args.check)
    steps = max(outputs) - 1  # batched decode steps of a scheme, at least
    # the tokens they decode: every output's but its first (the prefill's)
    decoded = sum(outputs) - len(outputs)
    return [
        (2 + 2 * checks) * len(outputs) + 1 + n + checks * n,
        checks * (2 * decoded + n * (new - 1)),
        2 * steps + 2 * (new - 1),
        2 * (decoded - steps) + 2 * (n - 1) * (new - 1),
    ]


def seconds_per_call(model: TinyDecoder, args: argparse.Namespace) -> list[float]:
    """The seconds each kind of run_calls' calls takes, the least of a few timed here with the run's model at
    the workload's mean context: matmuls, cache reads and the Python between them."""
    block = args.block_size
    prompt = (args.min_prompt + args.max_prompt) // 2
    tokens, one, four = (
        np.zeros((1, prompt), np.int64),
        np.zeros((1, 1), np.int64),
        np.zeros((4, 1), np.int64),
    )
    fastest = lambda call: min(time_calls(call, 5, 1))  # noqa: E731  (the least a call takes)

    def contiguous() -> list[KVCache]:
        return model.caches(prompt + 8)

    prefill = fastest(lambda: model.logits(tokens, contiguous()))
    caches = contiguous()
    model.logits(tokens, caches)
    decode = fastest(lambda: model.logits(one, caches))
    paged = model.paged_caches(4 * (-(-(prompt + 16) // block) + 1), block)  # room for the 12 steps timed
    seqs = [[cache.add_sequence() for cache in paged][0] for _ in range(4)]
    model.logits(np.zeros((4, prompt), np.int64), paged, seqs)
    first = fastest(lambda: model.logits(one, paged, seqs[:1]))
    return [prefill, decode, first, max(fastest(lambda: model.logits(four, paged, seqs)) - first, 0.0) / 3]


def check_time(model: TinyDecoder, args: argparse.Namespace, rate: float) -> None:
    """Refuse a run that cannot end within limits.MAX_MINUTES;
    say how long one of 10 s or more takes at least."""
    calls = run_calls(args)
    seconds = sum(n * each for n, each in zip(calls, seconds_per_call(model, args), strict=True))
    lower = "lower --requests, --max-new, --samples, --layers, --d-model or --vocab, or add --no-check"
    how = f"{sum(calls[:3]):,} calls of the model, each kind timed here"
    problem = limits.time_problem(0.0, rate, lower, seconds, how=how)
    if problem:
        sys.exit(f"serve.py: error: {problem}")


# --- arguments -------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    tokens = positive(int, MAX_WORK_TOKENS)
    cap = {name: positive(int, most) for name, most in MAX_SIZES.items()}
    add("--requests", type=tokens, default=24, help="requests in the workload (default 24)")
    add(
        "--rate",
        type=positive(float, 1000),
        default=1.0,
        help="mean arrivals per step, at least 0.001 (default 1.0)",
    )
    add("--min-prompt", type=tokens, default=8, help="shortest prompt, tokens (default 8)")
    add("--max-prompt", type=tokens, default=96, help="longest prompt, tokens (default 96)")
    add("--max-new", type=tokens, default=96, help="each request's limit of new tokens (default 96)")
    add("--blocks", type=cap["blocks"], default=96, help="the memory budget: blocks in the pool (default 96)")
    add("--block-size", type=cap["block_size"], default=16, help="tokens per block (default 16, as vLLM)")
    add("--samples", type=cap["samples"], default=8, help="parallel samples of one prompt (default 8)")
    add("--sample-prompt", type=tokens, default=200, help="the samples' prompt, tokens (default 200)")
    add("--sample-tokens", type=tokens, default=24, help="tokens each sample draws (default 24)")
    add("--layers", type=cap["layers"], default=2, help="attention layers (default 2)")
    add("--d-model", type=cap["d_model"], default=64, help="model width (default 64)")
    add("--heads", type=cap["heads"], default=4, help="query heads (default 4)")
    add("--kv-heads", type=cap["heads"], default=2, help="key/value heads (default 2)")
    add("--vocab", type=cap["vocab"], default=256, help="vocabulary size (default 256)")
    add(
        "--dtype",
        choices=["float32", "float64"],
        default="float64",
        help="dtype of weights and caches (default float64, so that 'equal when run alone' holds to 1e-9)",
    )
    add("--no-check", dest="check", action="store_false", help="skip running every request alone to compare")
    add("--json", metavar="PATH", help="also write the figures, the machine and the code version to PATH")
    add_wide_argument(p)
    add_seed_and_format(p, "the model, the workload and the samples")
    args = p.parse_args(argv)
    check_args(p, args)
    return args


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What the flags must satisfy together, and the memory of the run's model and pools, refused up front."""
    if args.rate < 0.001:  # arrivals 1,000 steps apart on average: past that, the steps would be mostly idle
        p.error(f"--rate must be at least 0.001; got {args.rate}")
    if args.min_prompt > args.max_prompt:
        p.error(f"--min-prompt ({args.min_prompt}) must be at most --max-prompt ({args.max_prompt})")
    if args.d_model % args.heads or (args.d_model // args.heads) % 2 or args.heads % args.kv_heads:
        p.error("--d-model must split into --heads heads of an even size (RoPE), --heads into --kv-heads groups")
    if -(-(args.max_prompt + args.max_new) // args.block_size) + 1 > args.blocks:
        p.error(f"--blocks ({args.blocks}) cannot hold one request of --max-prompt + --max-new tokens: raise it")
    work = args.requests * (args.max_prompt + args.max_new) + args.samples * (args.sample_prompt + args.sample_tokens)
    if work > MAX_WORK_TOKENS:
        p.error(
            f"--requests x (--max-prompt + --max-new) + --samples x (--sample-prompt + --sample-tokens) must be at "
            f"most {MAX_WORK_TOKENS:,} tokens of work (this is a simulation); got {work:,}"
        )
    slots = max(args.blocks * args.block_size, 2 * args.samples * (args.sample_prompt + args.sample_tokens))
    needed = 3 * args.layers * slots * 2 * (args.d_model // args.heads) * args.kv_heads * 8  # part 2's pools at most
    # the model: table, w_qkv, w_out
    needed += 8 * (args.vocab + args.layers * 4 * args.d_model) * args.d_model
    problem = limits.memory_problem(
        needed, "the model and pools of this run", "lower --blocks, --samples, --layers, --d-model or --vocab"
    )
    if problem:
        p.error(problem)
    outputs.check_output(p, "--json", args.json)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # the busy-machine check's first figure
    rate = machine.matmul_rate(args.dtype, n=machine.RATE_SIZE, repeats=3)
    rng = np.random.default_rng(args.seed)
    model = TinyDecoder(args, rng)
    check_time(model, args, rate)
    info, lines = machine.header()
    print(lines)
    figures = {"args": vars(args), "machine": info, "matmul_gflops": rate}
    parts = {
        "batching": lambda: batching_rows(model, args, np.random.default_rng(args.seed), rate),
        "samples": lambda: parallel_samples(model, args, rng),
    }

    def run_part(name: str) -> str:
        """Each part prints its table when it ends; Ctrl-C keeps those already printed."""
        figures[name] = parts[name]()
        return name

    done: list[str] = []
    stopped = interrupts.measure_each(parts, run_part, done)
    if args.json is not None:
        outputs.write_json(args.json, figures, stopped)
    return interrupts.interrupted(len(done), len(parts), "parts") if stopped else check.finish()


if __name__ == "__main__":
    sys.exit(interrupts.run_main(main))
