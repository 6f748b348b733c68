"""The memory and compute bill of attention, as tables: nothing here runs a model, it all is arithmetic.

What it prints, in order:
  1) the worked example of "Attention From Scratch": n = 8,192 tokens, fp16, one head and one layer,
     then 32 heads x 32 layers of Llama-3-8B, against the model's weights and an 80 GB H100
  2) the score-matrix column of "Train a Tiny GPT at Home, Part 2" (4 heads of 64, T = 256..32,768),
     with the peak memory of this project's attention() and flash_attention() beside it
  3) one row per model: weights, KV cache per token and at each --tokens, naive scores and attention
     FLOPs at the first --tokens; a context beyond the model's max_position_embeddings is flagged
  4) long context: 1M tokens against 8k is 125x the linear work and 15,625x the attention work

  5) ring attention: the per-device bill of --ring-model at 1M tokens split over 1 .. 64 devices

Run:  python scripts/memory.py [--model NAME|PATH ...] [--tokens 8192,32768,131072] [--dtype bf16]
                               [--kv-dtype bf16] [--batch 1] [--format simple] [--units binary] [--json PATH]
--model takes a preset name or a Hugging Face config.json (or the folder that holds one); a config is
named by its own "_name_or_path", else by the path given. --json PATH writes every figure to PATH
(--json alone, or --json -, prints them as JSON instead of the tables).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

from tinyattn_np.memory import (
    DTYPES,
    attention_flops,
    bytes_per_element,
    causal_entries,
    flash_attention_bytes,
    naive_attention_bytes,
    ring_attention_bytes,
    score_matrix_bytes,
)
from tinyattn_np.models import PRESETS, ModelShape, load_model_shape, model_bill
from tinyattn_np.report import add_format_argument, column_unit, format_bytes, format_sig, text_table, to_unit

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py sits beside this script, however it is started
import common  # noqa: E402

N_EXAMPLE = 8_192  # the worked example's sequence length
H100_BYTES = 81_559 * 2**20  # "H100 80GB HBM3": nvidia-smi reports 81,559 MiB
TINY_TOKENS = [256, 512, 1024, 2048, 4096, 8192, 16384, 32768]  # the first article's table rows
TINY_HEADS, TINY_HEAD_DIM = 4, 64


# --- 1) the worked example ------------------------------------------------------------------------


def worked_example() -> list[dict[str, Any]]:
    """The rows of section 1 as plain numbers: what, elements (or None), bytes."""
    llama = PRESETS["llama-3-8b"]
    one = score_matrix_bytes(N_EXAMPLE, dtype="fp16")
    every = score_matrix_bytes(N_EXAMPLE, heads=llama.heads, layers=llama.layers, dtype="fp16")
    return [
        {"what": "scores, 1 head, 1 layer, fp16", "elements": N_EXAMPLE**2, "bytes": one},
        {
            "what": f"scores, {llama.heads} heads x {llama.layers} layers (Llama-3-8B)",
            "elements": llama.heads * llama.layers * N_EXAMPLE**2,
            "bytes": every,
        },
        {"what": "Llama-3-8B weights, bf16", "elements": llama.num_parameters, "bytes": llama.weights_bytes("bf16")},
        {"what": "one H100 80GB (nvidia-smi: 81,559 MiB)", "elements": None, "bytes": H100_BYTES},
    ]


def worked_example_table(rows: list[dict[str, Any]], fmt: str) -> str:
    """Both unit families side by side, each in its own labelled column: the article quotes both."""
    body = [
        [
            row["what"],
            "" if row["elements"] is None else f"{row['elements']:,}",
            f"{row['bytes']:,}",
            format_bytes(row["bytes"], "decimal"),
            format_bytes(row["bytes"], "binary"),
        ]
        for row in rows
    ]
    return text_table(body, ["n = 8,192", "elements", "bytes", "decimal", "binary"], fmt)


# --- 2) the quadratic bill of the tiny model, and our two paths -----------------------------------


def tiny_table_rows(workers: int) -> list[dict[str, Any]]:
    """Section 2: score matrix bytes (fp32, fp16) and our estimated peaks, causal, fp32, 1 sequence."""
    sizes = dict(heads=TINY_HEADS, head_dim=TINY_HEAD_DIM, causal=True)
    return [
        {
            "tokens": n,
            "scores_fp32_bytes": score_matrix_bytes(n, heads=TINY_HEADS, dtype="fp32"),
            "scores_fp16_bytes": score_matrix_bytes(n, heads=TINY_HEADS, dtype="fp16"),
            "naive_peak_fp32_bytes": naive_attention_bytes(n, dtype="fp32", **sizes),
            "flash_peak_fp32_bytes": flash_attention_bytes(n, dtype="fp32", workers=workers, **sizes),
        }
        for n in TINY_TOKENS
    ]


def tiny_table(rows: list[dict[str, Any]], units: str, fmt: str) -> str:
    columns = [
        ("scores_fp32_bytes", "scores fp32"),
        ("scores_fp16_bytes", "scores fp16"),
        ("naive_peak_fp32_bytes", "attention() peak"),
        ("flash_peak_fp32_bytes", "flash_attention() peak"),
    ]
    unit = {key: column_unit([row[key] for row in rows], units) for key, _ in columns}
    headers = ["tokens", *(f"{title} ({unit[key]})" for key, title in columns), "naive / flash"]
    body = [
        [
            f"{row['tokens']:,}",
            *(format_sig(to_unit(row[key], unit[key])) for key, _ in columns),
            # format_sig: a ratio below 1 prints as 0.667x, not a rounded "1x"
            f"{format_sig(row['naive_peak_fp32_bytes'] / row['flash_peak_fp32_bytes'])}x",
        ]
        for row in rows
    ]
    return text_table(body, headers, fmt)


# --- 3) one row per model --------------------------------------------------------------------------


def models_table(bills: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """Weights, KV cache per token and at each context, scores and FLOPs at the first context."""
    first = args.tokens[0]

    def flagged(text: str, bill: dict[str, Any], n: int) -> str:
        beyond = bill["max_positions"] is not None and n > bill["max_positions"]
        return f"{text} *" if beyond else text

    def unit_of(values: list[int]) -> str:
        return column_unit(values, args.units)

    u_weights = unit_of([b["weights_bytes"] for b in bills])
    u_token = unit_of([b["kv_bytes_per_token"] for b in bills])
    u_kv = [unit_of([b["contexts"][i]["kv_cache_bytes"] for b in bills]) for i in range(len(args.tokens))]
    u_scores = unit_of([b["contexts"][0]["score_matrix_bytes"] for b in bills])
    headers = [
        "model",
        "params (millions)",
        f"weights {args.dtype} ({u_weights})",
        f"KV/token {args.kv_dtype} ({u_token})",
        *(f"KV at {n:,} ({u})" for n, u in zip(args.tokens, u_kv, strict=True)),
        f"naive scores at {first:,} ({u_scores})",
        f"attn TFLOP at {first:,}",
    ]
    body = []
    for bill in bills:
        contexts = bill["contexts"]
        body.append(
            [
                bill["model"],
                format_sig(bill["parameters"] / 1e6),
                format_sig(to_unit(bill["weights_bytes"], u_weights)),
                format_sig(to_unit(bill["kv_bytes_per_token"], u_token)),
                *(
                    flagged(format_sig(to_unit(c["kv_cache_bytes"], u)), bill, c["tokens"])
                    for c, u in zip(contexts, u_kv, strict=True)
                ),
                flagged(format_sig(to_unit(contexts[0]["score_matrix_bytes"], u_scores)), bill, first),
                flagged(format_sig(contexts[0]["attention_flops"] / 1e12), bill, first),
            ]
        )
    return text_table(body, headers, args.format)


def model_notes(models: list[ModelShape]) -> list[str]:
    """One line per model whose sliding window caps its KV cache."""
    notes = []
    for m in models:
        if m.sliding_window is not None:
            layers = m.layers if m.window_layers is None else m.window_layers
            notes.append(
                f"  {m.name}: sliding window of {m.sliding_window:,} tokens on {layers} of {m.layers} layers "
                "caps their KV cache"
            )
    return notes


# --- 4) long context --------------------------------------------------------------------------------


def long_context_rows() -> list[dict[str, Any]]:
    """How much more work a long context is: linear (tokens), attention (L·S), causal attention."""
    rows = []
    for short, long in ((8_000, 1_000_000), (8_192, 1_048_576)):
        dense = [attention_flops(n, heads=1, head_dim=1) for n in (short, long)]
        rows.append(
            {
                "from_tokens": short,
                "to_tokens": long,
                "linear_ratio": long / short,
                "attention_ratio": dense[1] / dense[0],
                "causal_attention_ratio": causal_entries(long) / causal_entries(short),
            }
        )
    return rows


def long_context_table(rows: list[dict[str, Any]], fmt: str) -> str:
    body = [
        [
            f"{row['from_tokens']:,} -> {row['to_tokens']:,}",
            f"{row['linear_ratio']:,.0f}x",
            f"{row['attention_ratio']:,.0f}x",
            f"{row['causal_attention_ratio']:,.1f}x",
        ]
        for row in rows
    ]
    headers = ["tokens", "linear work (MLP, projections)", "attention work (L·S)", "causal attention"]
    return text_table(body, headers, fmt)


# --- 5) ring attention: how many devices a long context needs -----------------------------------------

RING_TOKENS = 1_048_576  # "1M tokens", 2^20: splits evenly over 1 .. 64 devices, and into zigzag's 2·P chunks
RING_DEVICES = [1, 2, 4, 8, 16, 32, 64]


def ring_rows(model: ModelShape, dtype: str, kv_dtype: str) -> list[dict[str, Any]]:
    """Per device, with the model's context of RING_TOKENS split over P devices (ring_attention_bytes):
    every layer's K/V shard, the two in-flight K/V blocks of the layer being computed, one score tile,
    and the weights, which context parallelism keeps whole on every device."""
    weights = model.weights_bytes(dtype)
    rows = []
    for devices in RING_DEVICES:
        ring = ring_attention_bytes(
            RING_TOKENS, devices, kv_heads=model.kv_heads, head_dim=model.head_dim, layers=model.layers, dtype=kv_dtype
        )
        total = ring["kv_shards"] + ring["in_flight"] + ring["score_tile"] + weights
        rows.append({"devices": devices, **ring, "weights": weights, "total": total, "fits_h100": total <= H100_BYTES})
    return rows


def ring_table(rows: list[dict[str, Any]], units: str, fmt: str) -> str:
    columns = [
        ("kv_shards", "K/V shards, every layer"),
        ("in_flight", "in-flight K/V blocks"),
        ("score_tile", "score tile"),
        ("weights", "weights"),
        ("total", "total"),
        ("sent_total", "sent per forward"),
    ]
    unit = {key: column_unit([row[key] for row in rows], units) for key, _ in columns}
    headers = ["devices", "tokens each", *(f"{title} ({unit[key]})" for key, title in columns), "fits one H100 80GB"]
    body = [
        [
            str(row["devices"]),
            f"{row['tokens_per_device']:,}",
            *(format_sig(to_unit(row[key], unit[key])) for key, _ in columns),
            "yes" if row["fits_h100"] else "no",
        ]
        for row in rows
    ]
    return text_table(body, headers, fmt)


# --- the command line ---------------------------------------------------------------------------------


def parse_tokens(text: str) -> list[int]:
    """'8192,32768' -> [8192, 32768]; each a positive int."""
    try:
        tokens = [int(part.replace("_", "")) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tokens must be comma-separated integers; got {text!r}") from None
    if not tokens or any(n < 1 for n in tokens):
        raise argparse.ArgumentTypeError(f"--tokens must be positive integers; got {text!r}")
    return tokens


def parse_dtype(text: str) -> str:
    try:
        bytes_per_element(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Memory and compute bill of attention: score matrix, naive vs flash, KV cache, FLOPs.",
        epilog=f"presets: {', '.join(PRESETS)}. dtypes: {', '.join(DTYPES)}.",
    )
    parser.add_argument(
        "--model", action="append", metavar="NAME|PATH",
        help="a preset or a Hugging Face config.json, or its folder (repeatable; default: every preset); a config "
        "is named by its own _name_or_path, else by the path given",
    )  # fmt: skip
    parser.add_argument(
        "--tokens", type=parse_tokens, default=[8192, 32768, 131072], metavar="N,N,...",
        help="context lengths for the model table; scores and FLOPs use the first "
        "(default: 8192,32768,131072)",
    )  # fmt: skip
    parser.add_argument("--dtype", type=parse_dtype, default="bf16", help="weights and scores (default: bf16)")
    parser.add_argument("--kv-dtype", type=parse_dtype, default=None, help="KV cache (default: --dtype)")
    parser.add_argument("--batch", type=int, default=1, help="sequences at once (default: 1)")
    add_format_argument(parser)
    parser.add_argument(
        "--units",
        default="binary",
        choices=("binary", "decimal"),
        help="binary: KiB, MiB, GiB (powers of 1024); decimal: KB, MB, GB (default: binary)",
    )
    parser.add_argument(
        "--ring-model", default="llama-3-8b", metavar="NAME|PATH",
        help="the model of section 5, ring attention at 1M tokens (default: llama-3-8b)",
    )  # fmt: skip
    parser.add_argument(
        "--json", nargs="?", const="-", metavar="PATH",
        help="write every figure to PATH as JSON, bytes as integers (--json alone or --json -: print the JSON "
        "instead of the tables)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.batch < 1:
        parser.error(f"--batch must be a positive int; got {args.batch}")
    args.kv_dtype = args.kv_dtype or args.dtype
    common.check_output(parser, "--json", args.json)
    return args


def load_model(source: str) -> ModelShape:
    """A preset, or a config.json (or its folder) named by its own _name_or_path, else by the path given: two
    configs in one folder are two rows, not two rows named after the folder."""
    if source.lower() in PRESETS:
        return load_model_shape(source)
    path = Path(source)
    if not path.exists():
        raise ValueError(f"--model {source}: no such file, and not a preset ({', '.join(PRESETS)})")
    model = load_model_shape(path)
    config = path / "config.json" if path.is_dir() else path
    if json.loads(config.read_text(encoding="utf-8")).get("_name_or_path"):
        return model  # the config names itself
    return dataclasses.replace(model, name=source)


def bill(args: argparse.Namespace, models: list[ModelShape], ring_model: ModelShape) -> dict[str, Any]:
    """Every figure of the five sections, as plain numbers (the JSON of --json)."""
    workers = os.cpu_count() or 1  # flash_attention's default
    bills = [model_bill(m, args.tokens, dtype=args.dtype, kv_dtype=args.kv_dtype, batch=args.batch) for m in models]
    return {
        "worked_example": worked_example(),
        "tiny_model": {
            "heads": TINY_HEADS, "head_dim": TINY_HEAD_DIM, "causal": True, "workers": workers,
            "rows": tiny_table_rows(workers),
        },
        "models": {"dtype": args.dtype, "kv_dtype": args.kv_dtype, "batch": args.batch, "rows": bills},
        "long_context": long_context_rows(),
        "ring": {"model": ring_model.name, "tokens": RING_TOKENS, "kv_dtype": args.kv_dtype,
                 "rows": ring_rows(ring_model, args.dtype, args.kv_dtype)},
    }  # fmt: skip


def print_first_sections(report: dict[str, Any], args: argparse.Namespace) -> None:
    """Sections 1 and 2: the worked example, and the tiny model's score matrix beside our two peaks."""
    workers = report["tiny_model"]["workers"]
    print('1) The score matrix at n = 8,192 ("Attention From Scratch"): fp16, batch 1')
    print(worked_example_table(report["worked_example"], args.format))
    print()
    print(f'2) The tiny model ("Train a Tiny GPT at Home"): 1 sequence, {TINY_HEADS} heads of {TINY_HEAD_DIM}, causal;')
    print(
        f"   scores = {TINY_HEADS}·T² elements. The peaks estimate what our code allocates (fp32, {workers} workers);"
    )
    print("   tests/test_memory.py checks them against tracemalloc up to T = 4,096.")
    print(
        f"   flash_attention()'s peak depends on the core count: each of its workers (default: one per core, "
        f"{workers} here)"
    )
    print("   holds its own score tile. The score columns and attention()'s peak are the same on any machine.")
    print(tiny_table(report["tiny_model"]["rows"], args.units, args.format))


def print_last_sections(report: dict[str, Any], args: argparse.Namespace, models: list[ModelShape],
                        ring_model: ModelShape) -> None:  # fmt: skip
    """Sections 3 to 5: one row per model, long context, and the ring's per-device bill."""
    bills, ring = report["models"]["rows"], report["ring"]["rows"]
    print(
        f"3) Models: batch {args.batch}; scores = every head and layer at once; "
        "TFLOP = QKᵀ and PV, causal (a sliding window: its band only)"
    )
    print(models_table(bills, args))
    if any(c["beyond_max_positions"] for b in bills for c in b["contexts"]):
        print("  * longer than the model's max_position_embeddings: it was not trained for that context")
    for note in model_notes(models):
        print(note)
    print()
    print("4) Long context: linear work grows with T, attention work with T²")
    print(long_context_table(report["long_context"], args.format))
    print()
    print(f"5) Ring attention (tinyattn_np/ring.py): {ring_model.name} at {RING_TOKENS:,} tokens split over P devices;")
    print(f"   per device: K/V {args.kv_dtype}, weights {args.dtype} (whole on every device), one fp32 score tile,")
    print("   and the layer's two K/V blocks in flight (the one in hand, also being sent, and the next)")
    print(ring_table(ring, args.units, args.format))
    fitting = [row["devices"] for row in ring if row["fits_h100"]]
    needed = f"{fitting[0]} devices" if fitting else f"more than {RING_DEVICES[-1]} devices"
    print(f"   the smallest ring here in which every device fits in one H100 80GB (81,559 MiB): {needed}")
    if ring_model.sliding_window is not None:
        print(f"   {ring_model.name}'s sliding window is not counted: every layer is taken as full attention")
    if ring_model.max_positions is not None and RING_TOKENS > ring_model.max_positions:
        print(
            f"   {ring_model.name} was trained for {ring_model.max_positions:,} positions: "
            "this is the memory arithmetic of the context, not a claim that the model handles it"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        models = [load_model(source) for source in (args.model or list(PRESETS))]
        ring_model = load_model(args.ring_model)
    except (ValueError, TypeError) as err:
        print(f"memory.py: {err}", file=sys.stderr)
        return 2
    report = bill(args, models, ring_model)
    if args.json == "-":
        print(json.dumps({**report, "code": common.code_version()}, indent=2))
        return 0
    print_first_sections(report, args)
    print()
    print_last_sections(report, args, models, ring_model)
    if args.json:
        common.write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(common.run_main(main))
