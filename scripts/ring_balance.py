"""ring.py's first section: the tiles per rank that the causal mask leaves, counted without running anything
(plain arithmetic, tinyattn_np.ring.tile_counts, on rank 0 alone): zigzag against contiguous for 2 .. 8 ranks,
then powers of two up to --max-ranks, the busiest rank over the mean.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from tinyattn_np.report import Checklist, text_table
from tinyattn_np.ring import tile_counts
from tinyattn_np.shards import LAYOUTS


def balance_section(args: argparse.Namespace, check: Checklist, report: dict[str, Any]) -> None:
    """1) tiles per rank, counted (plain arithmetic: rank 0 alone)."""
    causal, mask = not args.no_causal, "no mask" if args.no_causal else "causal"
    balance = balance_rows(args, causal)
    report["balance"] = balance
    print(f"\n1) tiles per rank ({mask}), counted: the busiest rank against the mean")
    print(balance_table(balance, args.format))
    print("   a tile is block x block, smaller where a chunk ends mid-block: compare ranks within one layout")
    if causal:
        worst = max(row["zigzag"]["max_over_mean"] for row in balance)
        check(worst <= 1.05, f"zigzag's busiest rank within 1.05x of the mean (worst {worst:.3f}x)")


def table_sizes(max_ranks: int) -> list[int]:
    """The rings of the tile-count table: 2 .. 8 ranks, then the powers of two and max_ranks itself (every
    size up to 1,024 would be a thousand rows and half an hour of counting)."""
    powers = [2**n for n in range(4, max_ranks.bit_length())]
    return sorted({*range(2, min(max_ranks, 8) + 1), *powers, max_ranks})


def balance_rows(args: argparse.Namespace, causal: bool) -> list[dict[str, Any]]:
    """For the rings of table_sizes: the busiest rank's tiles over the mean, zigzag and contiguous.

    T is --tokens rounded down to a multiple of 2·ranks, so that both layouts can split it."""
    rows = []
    for size in table_sizes(args.max_ranks):
        tokens = args.tokens - args.tokens % (2 * size)
        row: dict[str, Any] = {"ranks": size, "tokens": tokens}
        for layout in LAYOUTS:
            tiles = [
                r["tiles"]
                for r in tile_counts(tokens, size, layout=layout, causal=causal, block_q=args.block, block_k=args.block)
            ]
            row[layout] = {"tiles": tiles, "max_over_mean": max(tiles) / statistics.mean(tiles)}
        rows.append(row)
    return rows


def balance_table(rows: list[dict[str, Any]], fmt: str) -> str:
    body = [
        [
            str(row["ranks"]),
            f"{row['tokens']:,}",
            *(
                cell
                for layout in LAYOUTS
                for cell in (
                    f"{statistics.mean(row[layout]['tiles']):,.1f}",
                    f"{max(row[layout]['tiles']):,}",
                    f"{row[layout]['max_over_mean']:.3f}x",
                )
            ),
        ]
        for row in rows
    ]
    headers = ["ranks", "tokens", "zigzag mean", "max", "max/mean", "contiguous mean", "max", "max/mean"]
    return text_table(body, headers, fmt)
