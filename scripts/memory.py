"""The memory and compute bill of attention, as tables: nothing here runs a model, it all is arithmetic.

What it prints, in order:
  1) the worked example of "Attention From Scratch": n = 8,192 tokens, fp16, one head and one layer,
     then 32 heads x 32 layers of Llama-3-8B, against the model's weights and an 80 GB H100
  2) the score-matrix column of "Train a Tiny GPT at Home, Part 2" (4 heads of 64, T = 256..32,768),
     with the peak memory of this project's attention() and flash_attention() beside it
  3) one row per model: parameters (total and active), weights, KV cache per token and the cache at each
     --tokens, naive scores and attention FLOPs at the first --tokens (a context beyond the model's
     max_position_embeddings is flagged); then what the bill read of each: its architecture, the cache
     per token by layer kind, latent against decompressed for latent attention, the fixed state of linear
     layers
  4) long context: 1M tokens against 8k is 125x the linear work and 15,625x the attention work
  5) ring attention: the per-device bill of --ring-model at 1M tokens split over 1 .. 64 devices
  6) the KV cache per token side by side: multi-head, grouped, multi-query, latent and hybrid attention

Run:  python scripts/memory.py [--preset NAME ...] [--config PATH ...] [--tokens 8192,32768,131072]
                               [--dtype bf16] [--kv-dtype bf16] [--batch 1] [--format simple]
                               [--units binary] [--wide] [--json PATH] [--architectures]
--preset takes a preset's name, --config a Hugging Face config.json (or its folder), --model either; all
three repeat, in the order given, and name the models of sections 3 and 6 (default: every preset). A config
is named by its own "_name_or_path", else by the path given; one the reader does not understand is refused
with the field it does not. A table wider than 120 columns is split into parts that repeat its first
column (--wide: print it whole). --json PATH writes every figure to PATH (--json alone, or --json -, prints
them as JSON instead of the tables). --architectures prints, instead of the bill, the model types of
transformers' causal-LM mapping that the config reader bills and those it refuses, each with why.

This file works out the figures and prints the sections; memory_tables.py beside it lays out their tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import textwrap
from pathlib import Path
from typing import Any

from tinyattn_np import DTYPES, bytes_per_element, naive_attention_bytes
from tinyattn_np.bill import model_bill
from tinyattn_np.hf_config import NOT_TEXT_DECODERS, REFUSED, census, load_model_shape
from tinyattn_np.memory import attention_flops, causal_entries, score_matrix_bytes
from tinyattn_np.models import ModelShape
from tinyattn_np.peaks import flash_attention_bytes, ring_attention_bytes
from tinyattn_np.presets import PRESETS
from tinyattn_np.report import (
    add_format_argument,
    add_wide_argument,
    fit_table,
    positive,
    table_width,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the modules this script shares sit beside it
import interrupts
import machine
import outputs
from memory_tables import (
    long_context_table,
    model_lines,
    models_table,
    ring_table,
    side_by_side_table,
    tiny_table,
    worked_example_table,
)

N_EXAMPLE = 8_192  # the worked example's sequence length
H100_BYTES = 81_559 * 2**20  # "H100 80GB HBM3": nvidia-smi reports 81,559 MiB
TINY_TOKENS = [256, 512, 1024, 2048, 4096, 8192, 16384, 32768]  # the first article's table rows
TINY_HEADS, TINY_HEAD_DIM = 4, 64
MAX_CONTEXT, MAX_BATCH = 2**40, 2**20  # formulas only, but past these no figure means anything
# section 6 without --preset, --config or --model: one model of each kind of attention
SIDE_BY_SIDE = [
    "llama-2-7b",
    "llama-3-8b",
    "falcon-7b",
    "deepseek-v3",
    "mistral-7b-v0.1",
    "gemma-2-9b",
    "gpt-oss-120b",
    "llama-4-scout",
    "qwen3-next-80b-a3b",
]


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


# --- 2) the quadratic bill of the tiny model, and our two paths -----------------------------------


def tiny_table_rows() -> list[dict[str, Any]]:
    """Section 2: score matrix bytes (fp32, fp16) and our estimated peaks, causal, fp32, 1 sequence; flash's
    with flash_attention()'s default workers (workers=None), as a call with no workers= runs and as scaling.py's
    "(est.)" column counts them."""
    sizes = dict(heads=TINY_HEADS, head_dim=TINY_HEAD_DIM, causal=True)
    return [
        {
            "tokens": n,
            "scores_fp32_bytes": score_matrix_bytes(n, heads=TINY_HEADS, dtype="fp32"),
            "scores_fp16_bytes": score_matrix_bytes(n, heads=TINY_HEADS, dtype="fp16"),
            "naive_peak_fp32_bytes": naive_attention_bytes(n, dtype="fp32", **sizes),
            "flash_peak_fp32_bytes": flash_attention_bytes(n, dtype="fp32", workers=None, **sizes),
        }
        for n in TINY_TOKENS
    ]


# --- 3) one row per model, then what the bill read of each ----------------------------------------------
# tinyattn_np.bill.model_bill's figures, a bill a model (bill() below); memory_tables.py lays them out


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


# --- 6) the KV cache per token, side by side ----------------------------------------------------------


def side_by_side_rows(models: list[ModelShape], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Section 6: per model, what each attention layer keeps per token, and the whole cache per token and at
    the last --tokens (K/V, or the latent, and the fixed state of linear layers)."""
    tokens = args.tokens[-1]
    return [
        {
            "model": m.name,
            "attention": m.attention_kind,
            "query_heads": m.heads,
            "kv_heads": m.kv_heads,
            "layers": m.layer_summary(),
            "kv_numbers_per_token_and_layer": m.kv_width,
            "kv_bytes_per_token": m.kv_cache_bytes(1, args.kv_dtype),
            "tokens": tokens,
            "cache_bytes": m.cache_bytes(tokens, args.kv_dtype),
        }
        for m in models
    ]


# --- the command line ---------------------------------------------------------------------------------


def parse_tokens(text: str) -> list[int]:
    """'8192,32768' -> [8192, 32768]; each a positive int, at most MAX_CONTEXT."""
    try:
        tokens = [int(part.replace("_", "")) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tokens must be comma-separated integers; got {text!r}") from None
    if not tokens or any(n < 1 or n > MAX_CONTEXT for n in tokens):
        raise argparse.ArgumentTypeError(f"--tokens must be positive integers at most {MAX_CONTEXT:,}; got {text!r}")
    return tokens


def parse_dtype(text: str) -> str:
    try:
        bytes_per_element(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def add_model_sources(parser: argparse.ArgumentParser) -> None:
    """--preset, --config and --model, each repeatable: args.sources lists (flag, text) in the order given."""
    for flag, what, metavar in (
        ("--preset", "a preset", "NAME"),
        ("--config", "a Hugging Face config.json, or its folder", "PATH"),
        ("--model", "a preset or a config.json", "NAME|PATH"),
    ):
        parser.add_argument(
            flag,
            action="append",
            dest="sources",
            metavar=metavar,
            type=lambda text, flag=flag: (flag, text),
            help=f"{what} (repeatable; --preset, --config and --model in the order given; default: every preset)",
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Memory and compute bill of attention: score matrix, naive vs flash, KV cache, FLOPs.",
        epilog=f"presets: {', '.join(PRESETS)}. dtypes: {', '.join(DTYPES)}.",
    )
    add_model_sources(parser)
    parser.add_argument(
        "--tokens",
        type=parse_tokens,
        default=[8192, 32768, 131072],
        metavar="N,N,...",
        help="context lengths for the model table; scores and FLOPs use the first, section 6 the last "
        "(default: 8192,32768,131072)",
    )
    parser.add_argument("--dtype", type=parse_dtype, default="bf16", help="weights and scores (default: bf16)")
    parser.add_argument("--kv-dtype", type=parse_dtype, default=None, help="KV cache and state (default: --dtype)")
    parser.add_argument("--batch", type=positive(int, MAX_BATCH), default=1, help="sequences at once (default: 1)")
    add_format_argument(parser)
    parser.add_argument(
        "--units",
        default="binary",
        choices=("binary", "decimal"),
        help="binary: KiB, MiB, GiB (powers of 1024); decimal: KB, MB, GB (default: binary)",
    )
    add_wide_argument(parser)
    parser.add_argument(
        "--ring-model",
        default="llama-3-8b",
        metavar="NAME|PATH",
        help="the model of section 5, ring attention at 1M tokens (default: llama-3-8b)",
    )
    parser.add_argument(
        "--json",
        nargs="?",
        const="-",
        metavar="PATH",
        help="write every figure to PATH as JSON, bytes as integers (--json alone or --json -: print the JSON "
        "instead of the tables)",
    )
    parser.add_argument(
        "--architectures",
        action="store_true",
        help="list the model types of transformers' causal-LM mapping that the config reader bills, and those it "
        "refuses, with why",
    )
    args = parser.parse_args(argv)
    args.kv_dtype = args.kv_dtype or args.dtype
    outputs.check_output(parser, "--json", args.json)
    return args


def load_model(source: str, flag: str = "--model") -> ModelShape:
    """A preset, or a config.json (or its folder) named by its own _name_or_path, else by the path given: two
    configs in one folder are two rows, not two rows named after the folder."""
    if flag != "--config" and source.lower() in PRESETS:
        return load_model_shape(source)
    if flag == "--preset":
        raise ValueError(f"--preset {source}: not a preset; the presets are {', '.join(PRESETS)}")
    path = Path(source)
    if not path.exists():
        raise ValueError(
            f"{flag} {source}: no such file"
            + (f", and not a preset ({', '.join(PRESETS)})" if flag == "--model" else "")
        )
    model = load_model_shape(path)
    config = path / "config.json" if path.is_dir() else path
    if json.loads(config.read_text(encoding="utf-8")).get("_name_or_path"):
        return model  # the config names itself
    return dataclasses.replace(model, name=source)


def load_models(args: argparse.Namespace) -> tuple[list[ModelShape], list[ModelShape], ModelShape]:
    """(section 3's models, section 6's, the ring's): the ones asked for, else every preset and SIDE_BY_SIDE."""
    asked = [load_model(source, flag) for flag, source in args.sources or []]
    ring_model = load_model(args.ring_model, "--ring-model")
    if ring_model.latent is not None or ring_model.linear is not None:
        raise ValueError(
            f"--ring-model {args.ring_model}: the ring passes K and V of kv_heads heads around, and "
            f"{ring_model.name} has {'latent' if ring_model.latent else 'linear'} attention"
        )
    if asked:
        return asked, asked, ring_model
    return list(PRESETS.values()), [PRESETS[name] for name in SIDE_BY_SIDE], ring_model


def bill(
    args: argparse.Namespace, models: list[ModelShape], side: list[ModelShape], ring_model: ModelShape
) -> dict[str, Any]:
    """Every figure of the six sections, as plain numbers (the JSON of --json)."""
    cores = os.cpu_count() or 1  # flash_attention's default workers: one per core, at most one per 2^18 scores
    bills = [model_bill(m, args.tokens, dtype=args.dtype, kv_dtype=args.kv_dtype, batch=args.batch) for m in models]
    return {
        "worked_example": worked_example(),
        "tiny_model": {
            "heads": TINY_HEADS,
            "head_dim": TINY_HEAD_DIM,
            "causal": True,
            "cores": cores,
            "rows": tiny_table_rows(),
        },
        "models": {"dtype": args.dtype, "kv_dtype": args.kv_dtype, "batch": args.batch, "rows": bills},
        "long_context": long_context_rows(),
        "ring": {
            "model": ring_model.name,
            "tokens": RING_TOKENS,
            "kv_dtype": args.kv_dtype,
            "rows": ring_rows(ring_model, args.dtype, args.kv_dtype),
        },
        "side_by_side": {"kv_dtype": args.kv_dtype, "rows": side_by_side_rows(side, args)},
    }


def print_first_sections(report: dict[str, Any], args: argparse.Namespace) -> None:
    """Sections 1 and 2: the worked example, and the tiny model's score matrix beside our two peaks."""
    cores = report["tiny_model"]["cores"]
    print('1) The score matrix at n = 8,192 ("Attention From Scratch"): fp16, batch 1')
    print(worked_example_table(report["worked_example"], args.format))
    print()
    print(f'2) The tiny model ("Train a Tiny GPT at Home"): 1 sequence, {TINY_HEADS} heads of {TINY_HEAD_DIM}, causal;')
    print(f"   scores = {TINY_HEADS}·T² elements. The peaks estimate what our code allocates (fp32), checked against")
    print("   tracemalloc up to T = 4,096 (tests/test_peaks.py); flash's with flash_attention()'s default workers, as")
    print(
        f"   scaling.py's (est.) column: one per core ({cores} here) but at most one per 2^18 scores, fewer at small T."
    )
    print("   Each worker holds its own score tile: the flash column depends on the core count, the others do not.")
    print(tiny_table(report["tiny_model"]["rows"], args.units, args.format))


def print_last_sections(report: dict[str, Any], args: argparse.Namespace, ring_model: ModelShape) -> None:
    """Sections 3 to 6: one row per model and what the bill read, long context, the ring's per-device bill,
    and the KV cache per token side by side."""
    bills, ring = report["models"]["rows"], report["ring"]["rows"]
    print(f"3) Models: batch {args.batch}; active = the weights one token runs (all but the experts it skips); cache =")
    print("   K/V (the latent for MLA) + the fixed state of linear layers; scores = every head and softmax layer at")
    print("   once; TFLOP = QKᵀ and PV of the softmax layers, causal (a window: its band; a chunk: its blocks)")
    print(models_table(bills, args))
    if any(c["beyond_max_positions"] for b in bills for c in b["contexts"]):
        print("  * longer than the model's max_position_embeddings: it was not trained for that context")
    print("\n".join(model_lines(bills, args)))
    print()
    print("4) Long context: linear work grows with T, attention work with T²")
    print(long_context_table(report["long_context"], args.format))
    print()
    print(f"5) Ring attention (tinyattn_np/ring.py): {ring_model.name} at {RING_TOKENS:,} tokens split over P devices;")
    print(
        f"   per device: its tokens, every layer's K/V shard of them ({args.kv_dtype}), the layer's two K/V blocks in"
    )
    print(
        f"   flight (the one in hand, also being sent, and the next), one fp32 score tile, the weights ({args.dtype},"
    )
    print("   whole on every device) and their total; sent: what a device sends per forward; fits: in one H100 80GB")
    print(fit_table(*ring_table(ring, args.units), args.format, table_width(args)))
    fitting = [row["devices"] for row in ring if row["fits_h100"]]
    needed = f"{fitting[0]} devices" if fitting else f"more than {RING_DEVICES[-1]} devices"
    print(f"   the smallest ring here in which every device fits in one H100 80GB (81,559 MiB): {needed}")
    if ring_model.sliding_window is not None or ring_model.attention_chunk is not None:
        print(f"   {ring_model.name}'s windows and chunks are not counted: every layer is taken as full attention")
    if ring_model.max_positions is not None and RING_TOKENS > ring_model.max_positions:
        print(
            f"   {ring_model.name} was trained for {ring_model.max_positions:,} positions: this is the memory "
            "arithmetic of the context,\n   not a claim that the model handles it"
        )
    print()
    print(f"6) The KV cache per token, side by side ({args.kv_dtype}). attention: GQA 32/8 is 32 query heads over 8")
    print("   kv heads; K/V per layer: the numbers each attention layer keeps for a token (2 · kv heads · head_dim, or")
    print("   MLA's latent); a window or a chunk caps its layers at that many tokens; linear layers keep a fixed state")
    print("   instead (in the cache column)")
    print(side_by_side_table(report["side_by_side"]["rows"], args))


def print_architectures() -> None:
    """--architectures: the census of the config reader, as torch_crosscheck/test_torch_architectures.py counts it."""
    counts = census()
    print(counts["summary"])
    wrap = dict(width=116, subsequent_indent="  ", break_on_hyphens=False)
    print(textwrap.fill("billed: " + ", ".join(counts["billed_types"]), **wrap))
    print("refused, each with why:")
    for model_type in counts["refused"]:
        print(textwrap.fill(f"{model_type}: {REFUSED[model_type]}", 116, initial_indent="  ", subsequent_indent="    "))
    print(textwrap.fill("not text decoders: " + ", ".join(sorted(NOT_TEXT_DECODERS)), **wrap))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.architectures:
        print_architectures()
        return 0
    try:
        models, side, ring_model = load_models(args)
    except (ValueError, TypeError) as err:
        print(f"memory.py: {err}", file=sys.stderr)
        return 2
    report = bill(args, models, side, ring_model)
    if args.json == "-":
        print(json.dumps({**report, "code": machine.code_version()}, indent=2))
        return 0
    print_first_sections(report, args)
    print()
    print_last_sections(report, args, ring_model)
    if args.json:
        outputs.write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(interrupts.run_main(main))
