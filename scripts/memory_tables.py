"""The tables scripts/memory.py prints, section by section, from the figures it works out: byte columns each in
one unit, the worked example in both unit families, the tiny model's score matrix beside our two peaks, one row
per model and what the bill read of each, long context, the ring's per-device bill, and the KV cache per token
side by side. Nothing here computes a figure: memory.py does, and hands each section's rows to its table.
"""

from __future__ import annotations

import argparse
from typing import Any

from tinyattn_np import format_bytes, to_unit
from tinyattn_np.report import column_unit, fit_table, format_sig, table_width, text_table


def in_units(
    rows: list[dict[str, Any]], columns: list[tuple[str, str]], units: str
) -> tuple[list[str], list[list[str]]]:
    """Byte columns, each in one unit: headers "title (unit)" and every row's cells as bare numbers in it."""
    unit = {key: column_unit([row[key] for row in rows], units) for key, _ in columns}
    headers = [f"{title} ({unit[key]})" for key, title in columns]
    return headers, [[format_sig(to_unit(row[key], unit[key])) for key, _ in columns] for row in rows]


# --- 1) the worked example ------------------------------------------------------------------------


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


def tiny_table(rows: list[dict[str, Any]], units: str, fmt: str) -> str:
    columns = [
        ("scores_fp32_bytes", "scores fp32"),
        ("scores_fp16_bytes", "scores fp16"),
        ("naive_peak_fp32_bytes", "attention() peak"),
        ("flash_peak_fp32_bytes", "flash peak"),
    ]
    headers, cells = in_units(rows, columns, units)
    # format_sig: a ratio below 1 prints as 0.667x, not a rounded "1x"
    ratios = [f"{format_sig(row['naive_peak_fp32_bytes'] / row['flash_peak_fp32_bytes'])}x" for row in rows]
    body = [
        [f"{row['tokens']:,}", *row_cells, ratio] for row, row_cells, ratio in zip(rows, cells, ratios, strict=True)
    ]
    return text_table(body, ["tokens", *headers, "naive / flash"], fmt)


# --- 3) one row per model, then what the bill read of each ----------------------------------------------


def models_table(bills: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """Parameters, weights, KV cache per token, the cache at each context, scores and FLOPs at the first."""
    first = args.tokens[0]
    rows = [
        {
            "weights": b["weights_bytes"],
            "token": b["kv_bytes_per_token"],
            "scores": b["contexts"][0]["score_matrix_bytes"],
            **{n: c["cache_bytes"] for n, c in zip(args.tokens, b["contexts"], strict=True)},
        }
        for b in bills
    ]
    columns = [
        ("weights", f"weights {args.dtype}"),
        ("token", f"KV/token {args.kv_dtype}"),
        *((n, f"cache at {n:,}") for n in args.tokens),
        ("scores", f"naive scores at {first:,}"),
    ]
    headers, cells = in_units(rows, columns, args.units)
    body = []
    for bill, row_cells in zip(bills, cells, strict=True):
        beyond = [bill["max_positions"] is not None and n > bill["max_positions"] for n in (*args.tokens, first)]
        flagged = [f"{cell} *" if flag else cell for cell, flag in zip(row_cells[2:], beyond, strict=True)]
        active = "?" if bill["active_parameters"] is None else format_sig(bill["active_parameters"] / 1e6)
        tflop = format_sig(bill["contexts"][0]["attention_flops"] / 1e12) + (" *" if beyond[-1] else "")
        body.append([bill["model"], format_sig(bill["parameters"] / 1e6), active, *row_cells[:2], *flagged, tflop])
    headers = ["model", "params (millions)", "active (millions)", *headers, f"attn TFLOP at {first:,}"]
    return fit_table(body, headers, args.format, table_width(args))


def model_lines(bills: list[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    """What the bill read of each model: its architecture in lines, then its cache per token by layer kind,
    the latent against the decompressed heads, and the fixed state of linear layers."""
    lines = []
    for bill in bills:
        lines.append(f"  {bill['model']} ({bill['architecture']})")
        lines += [f"     {line}" for line in bill["description"]]
        per_kind = [
            f"{kind.split('_')[0]} {format_bytes(b, args.units)}"
            for kind, b in bill["kv_bytes_per_token_by_kind"].items()
        ]
        cache = f"     K/V per token ({args.kv_dtype}, batch {args.batch}): {', '.join(per_kind) or 'none'}"
        decompressed = bill["kv_bytes_per_token_decompressed"]
        if decompressed is not None:
            ratio = decompressed / bill["kv_bytes_per_token"]
            cache += (
                f" (the latent); every head's key and value: {format_bytes(decompressed, args.units)} ({ratio:.1f}x)"
            )
        lines.append(cache)
        if bill["state_bytes"]:
            state = format_bytes(bill["state_bytes"], args.units)
            lines.append(f"     linear layers: a fixed state of {state} per sequence, whatever the context")
    return lines


# --- 4) long context --------------------------------------------------------------------------------


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


def ring_table(rows: list[dict[str, Any]], units: str) -> tuple[list[list[str]], list[str]]:
    """Section 5's body and headers (print_last_sections fits them)."""
    columns = [
        ("kv_shards", "K/V"),
        ("in_flight", "in flight"),
        ("score_tile", "tile"),
        ("weights", "weights"),
        ("total", "total"),
        ("sent_total", "sent"),
    ]
    headers, cells = in_units(rows, columns, units)
    body = [
        [str(row["devices"]), f"{row['tokens_per_device']:,}", *row_cells, "yes" if row["fits_h100"] else "no"]
        for row, row_cells in zip(rows, cells, strict=True)
    ]
    return body, ["devices", "tokens", *headers, "fits"]


# --- 6) the KV cache per token, side by side ----------------------------------------------------------


def side_by_side_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    tokens = rows[0]["tokens"] if rows else args.tokens[-1]
    columns = [("kv_bytes_per_token", "KV/token"), ("cache_bytes", f"cache at {tokens:,}")]
    headers, cells = in_units(rows, columns, args.units)
    body = []
    for row, row_cells in zip(rows, cells, strict=True):
        # "GQA 32/8": 32 query heads over 8 kv heads; "MLA 128": 128 heads decompress one latent
        heads = f"{row['query_heads']}" + (f"/{row['kv_heads']}" if row["attention"] in ("GQA", "MQA") else "")
        per_layer = f"{row['kv_numbers_per_token_and_layer']:,}"
        body.append([row["model"], f"{row['attention']} {heads}", row["layers"], per_layer, *row_cells])
    headers = ["model", "attention", "layers", "K/V per layer", *headers]
    return fit_table(body, headers, args.format, table_width(args))
