"""Attention weights drawn in characters, one per weight, a row per query: what a terminal can show of a head.
The copy task (copy_task.py) draws a head before and after training; attention.py --checkpoint a trained GPT's.
"""

from __future__ import annotations

import numpy as np

SHADES = " .:-=+*#%@"  # the heat map's characters, light to heavy


def heat_map(weights: np.ndarray, tokens: np.ndarray, symbols: str) -> str:
    """One character per weight (SHADES, light to heavy), a row per query, labelled with its token. A weight
    of 0 is a space; any other at least a dot: a row spread evenly over more than ten keys (each under 0.1,
    as at the random start) is a row of dots, not a blank row."""
    labels = "".join(symbols[t] for t in tokens)
    lines = ["       keys " + labels]  # 12 characters, as the row labels below
    for i, row in enumerate(weights):
        shades = [min(int(w * len(SHADES)), len(SHADES) - 1) for w in row[: i + 1]]  # 0 .. 9: tenths of weight
        cells = "".join(SHADES[max(shade, 1) if w > 0 else 0] for shade, w in zip(shades, row, strict=False))
        lines.append(f"{i:3d} {labels[i]}  |    {cells}")
    return "\n".join(lines)
