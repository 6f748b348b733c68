"""train_speed.py --row-blocks: the elementwise layers (layer_norm, gelu and their backwards) on each preset's
rows in blocks of 2^13 .. 2^20 elements, the sizes taking turns, and a step's worth of each (tune.row_block()
is the size the layers take; use_row_block sets one for the process).
"""

from __future__ import annotations

import argparse
from functools import partial
from typing import Any

import machine
import numpy as np
import outputs

from tinyattn_np import layers
from tinyattn_np.gpt import GPTConfig
from tinyattn_np.measure import alternating_medians_ms
from tinyattn_np.report import fit_table, table_width
from tinyattn_np.tune import row_block, use_row_block

BLOCKS = [2**power for power in range(13, 21)]


def time_presets(name: str, config: GPTConfig, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    """One preset's rows (its config, a batch of `batch` sequences): each layer's median ms per call at each
    block size, the sizes taking turns."""
    outputs.progress(f"{name}: layer_norm, gelu and their backwards at {len(BLOCKS)} block sizes, taking turns")
    n, L = batch * config.context, config.layers
    rng = np.random.default_rng(args.seed)
    x, dy = rng.standard_normal((2, n, config.width), dtype=np.float32)  # (N, C) each
    u, du = rng.standard_normal((2, n, config.hidden), dtype=np.float32)  # (N, H) each
    gain, bias = (
        np.ones(config.width, np.float32),
        np.zeros(config.width, np.float32) if config.bias else None,
    )
    norm_saved, gelu_saved = layers.layer_norm(x, gain, bias)[1], layers.gelu(u)[1]
    calls = {  # each layer: the call, its width, how many a step makes
        "layer_norm": (lambda: layers.layer_norm(x, gain, bias), config.width, 2 * L + 1),
        "layer_norm backward": (lambda: layers.layer_norm_backward(dy, norm_saved), config.width, 2 * L + 1),
        "gelu": (lambda: layers.gelu(u), config.hidden, L),
        "gelu backward": (lambda: layers.gelu_backward(du, gelu_saved), config.hidden, L),
    }
    rows = []
    try:
        for layer, (fn, width, per_step) in calls.items():
            ms = alternating_medians_ms([partial(in_blocks, b, fn) for b in BLOCKS], args.repeats, args.rounds)
            rows.append({"preset": name, "layer": layer, "rows": n, "width": width, "per_step": per_step, "ms": ms})
    finally:
        use_row_block(None)  # the block this machine takes again
    return {"preset": name, "layers": rows, "busy": machine.busy_reasons()}


def in_blocks(block: int, fn: Any) -> None:
    use_row_block(block)  # in force for this process: the layers read it at every call
    fn()


def print_rows(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    chosen = row_block()
    print(
        f"\n4) the elementwise layers in blocks of rows, float32: ms per call, the median of {args.rounds} turns of"
        f" {args.repeats} calls,\n   the sizes taking turns; * the size layers.py takes (the row block in force)"
    )
    headers = ["layer", *(f"2^{b.bit_length() - 1}" + ("*" if b == chosen else "") for b in BLOCKS)]
    body: list[list[str]] = []
    for preset in rows:
        for r in preset["layers"]:
            name = f"{r['preset']}: {r['layer']} ({r['rows']:,} x {r['width']:,})"
            body.append([name, *(f"{t:.3f}" for t in r["ms"])])
        step = [sum(r["per_step"] * r["ms"][i] for r in preset["layers"]) for i in range(len(BLOCKS))]
        body.append([f"{preset['preset']}: a step's norms and GELUs", *(f"{t:.2f}" for t in step)])
    print(fit_table(body, headers, fmt=args.format, width=table_width(args)))
    note = machine.busy_note(rows, lambda row: str(row["preset"]))  # a busy preset's rows, said under the table
    if note:
        print(note)
