"""Multi-head latent attention in numbers: what one DeepSeek-V3 layer caches a token, and one decode step in
the naive and the absorbed forms, beside this machine's two ceilings.

What it shows:
  1) the cache one token takes in one layer: DeepSeek-V3's heads (keys of 128 + 64 numbers, values of 128) as
     multi-head attention (every head's k and v), grouped-query with 8 kv heads (as Llama-3-70B has), multi-query
     (one kv head) and MLA (the latent: 512 + 64 numbers); Llama-3-70B's own layer beside them.
  2) this machine's ceilings: the matmul rate (GFLOP/s), the read bandwidth (GB/s), their ratio (the FLOPs per
     byte read above which a step is bound by arithmetic, below which by reading memory), the last-level cache.
  3) one decode step (one new token, B = 1) at each context S:
       naive      the new token's k_nope and v from its latent (c W_UKV), then flash_decode over every head's
                  k and v: the cache of multi-head attention, H (192 + 128) numbers a token
       absorbed   tinyattn_np.attend_latent: the query absorbed (q_nope W_UKᵀ), flash_decode over the latent
                  cache (one kv head of 576, the values a view of its first 512), then W_UV
       products   the absorbed step's two large products alone, q_lat Kᵀ and P V, two matmuls on all threads
       torch      (--torch) torch doing the absorbed step with its own matmuls and softmax
     with each step's FLOPs and bytes read, which ceiling binds (the larger of FLOPs / matmul rate and bytes /
     bandwidth) and the time against that bound. Both forms read W_UKV once a step. The naive form runs where its
     cache fits half this machine's memory (and what is free); past that, the absorbed form alone.
The projections that every token needs in either form (x W_DQ, W_UQ, W_DKV, W_O) do not depend on S: left out.

Run:  python scripts/mla.py [--contexts 1024 4096] [--heads 128] [--repeats 3] [--torch] [--json PATH]
Every claim is checked (the forms and torch give the same output); the exit code is 1 if one fails.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from tinyattn_np import attend_latent, decompress, flash_decode, format_bytes, latent_softmax_scale, split_ukv
from tinyattn_np.measure import read_bandwidth
from tinyattn_np.report import Checklist, add_seed_and_format, max_diff, positive, text_table

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the modules this script shares sit beside it
import interrupts
import limits
import machine
import outputs
import torch_import

check = Checklist()  # every claim the script prints is checked; main() returns check.finish()
D_NOPE, D_ROPE, D_V, RANK = (
    128,
    64,
    128,
    512,
)  # DeepSeek-V3: qk_nope_head_dim, qk_rope_head_dim, v_head_dim, kv_lora_rank
HEAD = D_NOPE + D_ROPE + D_V  # one head's key and value: 320 numbers
LATENT = RANK + D_ROPE  # the latent: 576 numbers
CHUNK = 2048  # the naive cache is decompressed this many tokens at a time
SAME = {
    "float32": 1e-5,
    "float64": 1e-12,
}  # the forms agree to this, relative (the same sums in another order)


# ---------------------------------------------------------------------------------------------------
# 1) the cache a token takes, 2) the machine's ceilings


def print_cache_table(args: argparse.Namespace) -> None:
    rows = [
        ("multi-head (MHA): every head's k and v", args.heads, args.heads * HEAD),
        ("grouped-query (GQA): 8 kv heads", 8, 8 * HEAD),
        ("multi-query (MQA): 1 kv head", 1, HEAD),
        ("latent (MLA): c_KV and k_rope", "-", LATENT),
        ("Llama-3-70B's own layer: 8 kv heads of 128", 8, 2 * 8 * 128),
    ]
    body = [[name, str(kv), f"{n:,}", f"{2 * n:,}", f"{4 * n:,}", f"{n / LATENT:.1f}x"] for name, kv, n in rows]
    print(
        f"1) the cache one token takes in one layer: {args.heads} heads, keys of {D_NOPE} + {D_ROPE} numbers "
        f"and values of {D_V}\n   (DeepSeek-V3's), a latent of {RANK} + {D_ROPE}"
    )
    headers = ["layout", "kv heads", "numbers", "bytes (bf16)", "bytes (float32)", "/ MLA"]
    print(text_table(body, headers, fmt=args.format))


def last_level_cache() -> int | None:
    """Bytes of the largest CPU cache that Linux reports (sysfs), None where it reports none."""
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = path.read_text().strip()
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes, default=None)


def ceilings(args: argparse.Namespace) -> SimpleNamespace:
    """The matmul rate and the read bandwidth now, their ratio, and the last-level cache
    (printed: section 2)."""
    rate, bandwidth = machine.matmul_rate(args.dtype), read_bandwidth(2**30)
    llc = last_level_cache()
    itemsize = np.dtype(args.dtype).itemsize
    print(
        f"\n2) this machine: {args.dtype} matmul (2048 x 2048) {rate:.1f} GFLOP/s; reading memory (1 GiB, two "
        f"threads) {bandwidth:.1f} GB/s:\n   a step is compute-bound above {rate / bandwidth:.1f} FLOPs per byte "
        "read, memory-bound below"
    )
    if llc:
        naive, latent = llc // (args.heads * HEAD * itemsize), llc // (LATENT * itemsize)
        print(
            f"   last-level cache {format_bytes(llc)}: the naive cache outgrows it past S = {naive:,} tokens, "
            f"the latent cache past S = {latent:,}"
        )
    return SimpleNamespace(rate=rate, bandwidth=bandwidth, llc=llc)


# ---------------------------------------------------------------------------------------------------
# 3) one decode step


def step_inputs(S: int, args: argparse.Namespace, rng: np.random.Generator, naive: bool) -> SimpleNamespace:
    """A layer's W_UKV, the cached latents of S tokens (the newest last), the new token's query, and, for the
    naive form, every head's k and v decompressed from the latents."""
    dtype, H = np.dtype(args.dtype), args.heads
    w_ukv = (rng.standard_normal((RANK, H * (D_NOPE + D_V))) / np.sqrt(RANK)).astype(dtype)  # (r, H·(dn + dv))
    latent = rng.standard_normal((1, 1, S, LATENT), dtype=np.float64).astype(dtype)  # (1, 1, S, r + dr)
    q_nope = rng.standard_normal((1, H, 1, D_NOPE), dtype=np.float64).astype(dtype)  # (1, H, 1, dn)
    q_rope = rng.standard_normal((1, H, 1, D_ROPE), dtype=np.float64).astype(dtype)  # (1, H, 1, dr)
    inputs = SimpleNamespace(
        w_ukv=w_ukv,
        latent=latent,
        q_nope=q_nope,
        q_rope=q_rope,
        scale=latent_softmax_scale(D_NOPE + D_ROPE),
        k=None,
        v=None,
    )
    if naive:  # the multi-head cache, a chunk of tokens at a time: no chunk's k and v as large as the whole
        inputs.k = np.empty((1, H, S, D_NOPE + D_ROPE), dtype)  # (1, H, S, dn + dr)
        inputs.v = np.empty((1, H, S, D_V), dtype)  # (1, H, S, dv)
        for start in range(0, S, CHUNK):
            k, v = decompress(latent[:, :, start : start + CHUNK], w_ukv, H, D_NOPE)
            inputs.k[:, :, start : start + CHUNK], inputs.v[:, :, start : start + CHUNK] = k, v
    return inputs


def naive_step(inputs: SimpleNamespace) -> np.ndarray:
    """The new token's k_nope and v from its latent into the multi-head cache,
    then attention over every head's."""
    kv = (inputs.latent[0, 0, -1, :RANK] @ inputs.w_ukv).reshape(-1, D_NOPE + D_V)  # (H, dn + dv)
    inputs.k[0, :, -1, :D_NOPE], inputs.v[0, :, -1] = kv[:, :D_NOPE], kv[:, D_NOPE:]
    q = np.concatenate([inputs.q_nope, inputs.q_rope], axis=-1)  # (1, H, 1, dn + dr)
    return flash_decode(q, inputs.k, inputs.v, scale=inputs.scale)  # (1, H, 1, dv)


def absorbed_step(inputs: SimpleNamespace) -> np.ndarray:
    return attend_latent(inputs.q_nope, inputs.q_rope, inputs.latent, inputs.w_ukv, scale=inputs.scale)[0]


def products_alone(inputs: SimpleNamespace) -> Any:
    """The absorbed step's two large products and nothing else, into buffers made once: q_lat Kᵀ, then P V."""
    H, S = inputs.q_nope.shape[1], inputs.latent.shape[2]
    keys = inputs.latent[0, 0]  # (S, r + dr)
    q_lat = np.ones((H, LATENT), keys.dtype)  # (H, r + dr)
    scores, out = np.empty((H, S), keys.dtype), np.empty((H, RANK), keys.dtype)

    def run() -> None:
        np.matmul(q_lat, keys.T, out=scores)  # (H, r + dr) @ (r + dr, S)
        np.matmul(scores, keys[:, :RANK], out=out)  # (H, S) @ (S, r): the values, a view of the keys

    return run


def torch_step(inputs: SimpleNamespace) -> Any:
    """The absorbed step in torch, with its own matmuls: absorb, scores, softmax, P V, W_UV."""
    torch, _ = torch_import.load_torch()
    w_uk, w_uv = (torch.from_numpy(w) for w in split_ukv(inputs.w_ukv, inputs.q_nope.shape[1], D_NOPE))
    keys = torch.from_numpy(inputs.latent[0, 0])  # (S, r + dr)
    q_nope, q_rope = torch.from_numpy(inputs.q_nope[0]), torch.from_numpy(inputs.q_rope[0])  # (H, 1, ·)

    def run() -> Any:
        q_lat = torch.cat([q_nope @ w_uk.transpose(-1, -2), q_rope], dim=-1)[:, 0]  # (H, r + dr)
        weights = torch.softmax(q_lat @ keys.T * inputs.scale, dim=-1)  # (H, S)
        return ((weights @ keys[:, :RANK])[:, None] @ w_uv)[None]  # (1, H, 1, dv)

    return run


def step_costs(S: int, H: int, itemsize: int) -> dict[str, tuple[float, float]]:
    """(FLOPs, bytes read) of each step at context S: the matmuls' FLOPs;
    the bytes of the cache and of W_UKV."""
    w_ukv = RANK * H * (D_NOPE + D_V) * itemsize  # read once a step by either form
    two_products = 2 * H * S * LATENT + 2 * H * S * RANK
    absorbed = (2 * H * D_NOPE * RANK + two_products + 2 * H * RANK * D_V, w_ukv + S * LATENT * itemsize)
    return {
        "naive": (2 * RANK * H * (D_NOPE + D_V) + 2 * H * S * HEAD, w_ukv + H * S * HEAD * itemsize),
        "absorbed": absorbed,
        "products": (two_products, S * LATENT * itemsize),
        "torch": absorbed,
    }


def measure_context(S: int, args: argparse.Namespace, run: SimpleNamespace) -> dict[str, Any]:
    """Each step at context S: checked against the absorbed form's output, then timed."""
    outputs.progress(f"S = {S:,}")
    skipped = naive_fits(S, args)
    inputs = step_inputs(S, args, np.random.default_rng(args.seed), naive=skipped is None)
    steps = {"naive": lambda: naive_step(inputs)} if skipped is None else {}
    steps.update(absorbed=lambda: absorbed_step(inputs), products=products_alone(inputs))
    if args.torch:
        steps["torch"] = torch_step(inputs)
    gold = absorbed_step(inputs)  # (1, H, 1, dv)
    for name in ("naive", "torch"):
        if name in steps:
            out = np.asarray(steps[name]())  # torch's tensor as an array (shared memory)
            diff = max_diff(out, gold) / np.max(np.abs(gold))
            check(
                diff <= SAME[args.dtype],
                f"S = {S:,}: the {name} step equals the absorbed one (relative {diff:.1e})",
            )
    row: dict[str, Any] = {
        "context": S,
        "naive_skipped": skipped,
        **machine.beside_the_row(args.dtype, run.rate),
    }
    costs = step_costs(S, args.heads, np.dtype(args.dtype).itemsize)
    for name, step in steps.items():
        flops, read = costs[name]
        row[name] = {"ms": machine.settled_median_ms(step, args.repeats), "flops": flops, "bytes": read}
    return row


def print_rows(rows: list[dict[str, Any]], args: argparse.Namespace, run: SimpleNamespace) -> None:
    body, marks = [], []
    for row in rows:
        for name in ("naive", "absorbed", "products", "torch"):
            if name not in row:
                continue
            ms, flops, read = row[name]["ms"], row[name]["flops"], row[name]["bytes"]
            compute_ms, memory_ms = flops / run.rate / 1e6, read / run.bandwidth / 1e6
            bound = "compute" if compute_ms >= memory_ms else "memory"
            body.append(
                [
                    f"{row['context']:,}",
                    name,
                    f"{ms:.2f}",
                    f"{flops / 1e9:.2f}",
                    f"{read / 1e6:,.1f}",
                    f"{flops / read:.1f}",
                    bound,
                    f"{ms / max(compute_ms, memory_ms):.2f}x",
                ]
            )
            marks.append(row)
    print(
        f"\n3) one decode step, {args.heads} heads, {args.dtype}: the time, the step's FLOPs and bytes read, and the "
        "bound:\n   the larger of FLOPs / matmul rate and bytes / bandwidth"
    )
    headers = ["S", "step", "ms (median)", "GFLOP", "MB read", "FLOP/byte", "bound", "/ bound"]
    print(text_table(machine.mark_busy(body, marks), headers, fmt=args.format))
    note = machine.busy_note(rows, lambda r: f"S={r['context']:,}")  # one line a context, not a step
    if note:
        print(note)
    for row in rows:
        said = [f"absorbed {row['absorbed']['ms'] / row['products']['ms']:.2f}x its two products alone"]
        if "torch" in row:
            said.append(f"{row['absorbed']['ms'] / row['torch']['ms']:.2f}x torch's absorbed step")
        if "naive" in row:
            said.append(f"naive {row['naive']['ms'] / row['absorbed']['ms']:.2f}x absorbed")
        else:
            said.append(f"naive not run: {row['naive_skipped']}")
        print(f"   S = {row['context']:,}: {machine.concluded([row], '; '.join(said))}")


# ---------------------------------------------------------------------------------------------------
# arguments, and the whole run estimated before it starts


def naive_fits(S: int, args: argparse.Namespace) -> str | None:
    """Why the naive form does not run at S
    (its cache and this step's arrays too large), None when it does."""
    itemsize = np.dtype(args.dtype).itemsize
    naive = args.heads * S * HEAD * itemsize + CHUNK * args.heads * (D_NOPE + D_V + HEAD) * itemsize
    return limits.memory_problem(naive + absorbed_bytes(S, args), f"the naive cache at S={S:,}", "absorbed form only")


def absorbed_bytes(S: int, args: argparse.Namespace) -> int:
    """The absorbed steps' arrays: the latents, W_UKV, the products' scores and torch's
    (scores and weights)."""
    itemsize = np.dtype(args.dtype).itemsize
    return (S * LATENT + RANK * args.heads * (D_NOPE + D_V) + (1 + 2 * args.torch) * args.heads * S) * itemsize


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--contexts",
        type=positive(int, limits.MAX_TOKENS),
        nargs="+",
        default=[1024, 4096],
        metavar="S",
        help="cached tokens S of each decode step (default 1024 4096)",
    )
    p.add_argument(
        "--heads",
        type=positive(int, limits.MAX_HEADS),
        default=128,
        help="query heads H (default 128, DeepSeek-V3's)",
    )
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32", help="dtype (default float32)")
    p.add_argument(
        "--repeats",
        type=positive(int, limits.MAX_REPEATS),
        default=3,
        help="timed runs per figure (default 3)",
    )
    p.add_argument("--torch", action="store_true", help="add torch doing the absorbed step with its own matmuls")
    p.add_argument("--json", metavar="PATH", help="write every figure, the machine and the code version to PATH")
    add_seed_and_format(p, "the random latents, weights and queries")
    args = p.parse_args(argv)
    problem = limits.memory_problem(
        absorbed_bytes(max(args.contexts), args), f"S={max(args.contexts):,}", "lower --contexts or --heads"
    )
    if problem:
        p.error(problem)
    outputs.check_output(p, "--json", args.json)
    if args.torch:
        torch_import.load_torch()  # now, not after the first rows
    return args


def run_flops(args: argparse.Namespace) -> float:
    """FLOPs of the whole run: each step once to check, twice to warm up and --repeats times, and the naive
    cache's decompression (2 r H (dn + dv) a token) where the naive form runs."""
    total = 0.0
    for S in args.contexts:
        costs, naive = step_costs(S, args.heads, 4), naive_fits(S, args) is None
        steps = ["absorbed", "products", *(["naive"] if naive else []), *(["torch"] if args.torch else [])]
        total += (args.repeats + 3) * sum(costs[name][0] for name in steps)
        total += naive * 2 * S * RANK * args.heads * (D_NOPE + D_V)
    return total


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch = torch_import.load_torch()[0] if args.torch else None
    info, lines = machine.header(*((torch.__version__, torch.get_num_threads()) if torch else ()))
    print(lines)
    print_cache_table(args)
    run = ceilings(args)
    problem = limits.time_problem(run_flops(args), run.rate, "lower --contexts, --heads or --repeats")
    if problem:
        sys.exit(f"mla.py: error: {problem}")
    rows: list[dict[str, Any]] = []
    stopped = interrupts.measure_each(args.contexts, lambda S: measure_context(S, args, run), rows)
    if rows:
        print_rows(rows, args, run)
    if args.json:
        figures = {
            "machine": info,
            "matmul_gflops": run.rate,
            "read_gb_per_s": run.bandwidth,
            "args": vars(args),
        }
        outputs.write_json(args.json, {**figures, "last_level_cache_bytes": run.llc, "rows": rows}, stopped)
    return interrupts.interrupted(len(rows), len(args.contexts)) if stopped else check.finish()


if __name__ == "__main__":
    sys.exit(interrupts.run_main(main))
