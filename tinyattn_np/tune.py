"""Tile sizes, heads per step and workers chosen by measuring this machine, not by one machine's constants.

Basics: flash_attention and flash_attention_backward take the sizes nobody gave them from tile_rule():
the constants (constant_rule), or the rule tune() measured here.

    >>> import tinyattn_np
    >>> rule = tinyattn_np.tune()    # doctest: +SKIP
    >>> tinyattn_np.untune()         # the constants again

Details. tune() times flash_attention and its backward on a short problem (T = 2,048, 4 heads x 64, float32,
causal, random inputs; a few seconds), the candidates interleaved and each the fastest of `repeats` calls:
    1) the forward's square tiles of 128, 256 or 512, with 1, 2 or 4 kv heads per tile step, on a worker per core;
    2) with that tile, the workers: one per core, or half as many;
    3) the backward's square tiles of 128, 256 or 512 on those workers;
    4) flash_decode's layout (DECODE_LAYOUTS: blocks of 2^13, 2^15 or 2^17 scores, stored queries first
       or keys first) on one decode step: 32 query heads over 8 kv heads of 128, 16,384 cached keys, float32.
A candidate replaces the constants' own choice only when it is faster by more than CLEAR_MARGIN, so that noise
does not move the defaults. The rule is kept for this process (use_tile_rule, use_decode_layout)
and, with cache=True, in the user's cache directory ($XDG_CACHE_HOME or ~/.cache, tinyattn_np/tile_rules.json),
keyed by the CPU model, the BLAS library and its kernel set, and the core count: the next process on this machine
reads it instead of measuring. The file is written whole or not at all (a temporary file, then a rename), and not
at all when the machine was busy (a load average above the cores): that rule holds for the process only, with a
warning.

Off: do not call tune(), or call untune(); a block_q, block_k, kv_heads_per_step or workers that a call passes
always wins over the rule. The rule in force is tile_rule(), the decode layout in force decode_layout(), the row block
of the elementwise layers row_block() (set by use_row_block); each is offered here. A tuning that fails (any
exception) warns and leaves the constants and the default layout in force; Ctrl-C during it leaves them in force
too, and stops the program as usual.

The bits: the tile sizes set the order of the sums, so a tuned process may differ from an untuned one in the last
bits (within the dtype's tolerance of the reference; tests/test_tune.py holds every candidate to it, and every
decode layout). Any one rule gives the same bits on every run and for any number of workers.
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ._checks import check_bool, check_positive_int
from ._tuning import (
    DECODE_LAYOUTS,
    DecodeLayout,
    TileRule,
    backward_side,
    constant_rule,
    decode_layout,
    default_layout,
    default_tiles,
    in_layout,
    row_block,
    tile_rule,
    use_decode_layout,
    use_row_block,
    use_tile_rule,
)
from .backward import flash_attention_backward
from .flash import flash_attention
from .measure import cpu_model, machine_info, time_calls
from .splitkv import flash_decode

# The knobs tune() sets live in _tuning, where the engines read them; a program reaches them here (the scripts
# print the rule in force, time each decode layout and row block): every name this module imports from _tuning
# is offered as it is.
__all__ = [
    "DECODE_LAYOUTS",
    "DecodeLayout",
    "TileRule",
    "backward_side",
    "constant_rule",
    "decode_layout",
    "default_layout",
    "default_tiles",
    "in_layout",
    "row_block",
    "tile_rule",
    "use_decode_layout",
    "use_row_block",
    "use_tile_rule",
    "CLEAR_MARGIN",
    "SIDES",
    "STEP_HEADS",
    "busy",
    "cache_file",
    "candidate_rules",
    "machine_key",
    "measure_decode_layout",
    "tune",
    "untune",
]

SIDES = (128, 256, 512)  # square tiles, forward and backward
STEP_HEADS = (1, 2, 4)  # kv heads per tile step at the tuning problem's shape: scores_per_step = side² · heads
CLEAR_MARGIN = 0.05  # a candidate must beat the constants' own choice by more than this to replace it


def machine_key() -> str:
    """What a rule is measured for: 'CPU model; BLAS library version kernel set; N cores'."""
    blas = ", ".join(f"{b['internal_api']} {b['version']} {b['architecture']}" for b in machine_info()["blas"])
    return f"{cpu_model()}; {blas or 'no BLAS found'}; {os.cpu_count() or 1} cores"


def cache_file() -> Path:
    """$XDG_CACHE_HOME/tinyattn_np/tile_rules.json, or ~/.cache/tinyattn_np/tile_rules.json."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "tinyattn_np" / "tile_rules.json"


def candidate_rules(cores: int | None = None) -> list[TileRule]:
    """Every rule tune() can choose on `cores` cores (default: this machine's), the constants among them."""
    cores = cores or os.cpu_count() or 1
    workers = sorted({cores, max(1, cores // 2)})
    rules = {
        TileRule(side, side * side * heads, backward_side, n)
        for side in SIDES
        for heads in STEP_HEADS
        for backward_side in SIDES
        for n in workers
    }
    return sorted(rules | {constant_rule(cores)})


def untune() -> None:
    """The constants and the default decode layout again, for this process (the cache file stays)."""
    use_tile_rule(None)
    use_decode_layout(None)


def tune(*, tokens: int = 2048, head_dim: int = 64, repeats: int = 3, cache: bool = True) -> TileRule:
    """Choose flash_attention's and its backward's default sizes, and flash_decode's layout, by measuring them
    here; the rule now in force (the layout: decode_layout()).

    With cache=True, a rule stored for this machine (machine_key) is read instead of measured, and a rule
    measured is stored. The problem measured: T = tokens, 4 heads x head_dim, float32, causal; the decode step
    of the module doc.
    """
    sizes = {"tokens": tokens, "head_dim": head_dim, "repeats": repeats}
    tokens, head_dim, repeats = (check_positive_int(value, name) for name, value in sizes.items())
    cache = check_bool(cache, "cache")
    untune()  # the constants, until a rule is ready: an interrupted or failed tuning leaves them in force
    key, path = machine_key(), cache_file() if cache else None
    chosen = read_rule(path, key) if path is not None else None
    if chosen is None:
        busy_before = busy()
        try:
            chosen = measure_rule(tokens, head_dim, repeats), measure_decode_layout(repeats)
        except Exception as err:  # noqa: BLE001 (a failed measurement must not stop the caller: the constants stay)
            warnings.warn(
                f"tune() failed ({err!r}): flash_attention and flash_decode keep their defaults", stacklevel=2
            )
            return tile_rule()
        load = busy_before or busy()
        if load:  # other work took cores from the measurement: good for now, not for the next process
            warnings.warn(f"tune(): {load}; the rule measured holds for this process and is not stored", stacklevel=2)
        elif path is not None:
            store_rule(path, key, *chosen)
    rule, layout = chosen
    use_tile_rule(rule)
    use_decode_layout(layout)
    return rule


def busy() -> str | None:
    """Why this machine was too busy for a measurement to keep (None when it was not): a load average (processes
    running or waiting for a core over the last minute, ours included) above the cores."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # no load average on this system
        return None
    cores = os.cpu_count() or 1
    return f"the load average was {load:.1f} on {cores} cores" if load > cores else None


def measure_rule(tokens: int, head_dim: int, repeats: int) -> TileRule:
    """The three rounds of the module doc on random inputs: the forward's tile and heads per step, the workers,
    the backward's tile; each round keeps the constants' choice unless a candidate is clearly faster."""
    rng = np.random.default_rng(0)
    shape = (1, max(STEP_HEADS), tokens, head_dim)  # as many heads as a step may take
    q, k, v = (rng.standard_normal(shape, dtype=np.float32) for _ in range(3))
    base = constant_rule()

    def forward(side: int, per_step: int, workers: int) -> Callable[[], object]:
        return lambda: flash_attention(
            q, k, v, causal=True, block_q=side, block_k=side, kv_heads_per_step=per_step, workers=workers
        )

    base_heads = max(1, base.scores_per_step // base.side**2)
    side, per_step = fastest(
        {(s, h): forward(s, h, base.workers) for s in SIDES for h in STEP_HEADS}, (base.side, base_heads), repeats
    )
    workers = fastest(
        {n: forward(side, per_step, n) for n in sorted({base.workers, max(1, base.workers // 2)})},
        base.workers,
        repeats,
    )
    out, lse = flash_attention(q, k, v, causal=True, return_lse=True)
    dout = rng.standard_normal(out.shape, dtype=np.float32)

    def backward(side: int) -> Callable[[], object]:
        return lambda: flash_attention_backward(
            q, k, v, out, dout, lse, causal=True, block_q=side, block_k=side, workers=workers
        )

    backward_side = fastest({s: backward(s) for s in SIDES}, base.backward_side, repeats)
    return TileRule(side, side * side * per_step, backward_side, workers)


def measure_decode_layout(repeats: int) -> DecodeLayout:
    """Round 4 of the module doc: flash_decode under each of DECODE_LAYOUTS on one decode step of random inputs,
    the default layout kept unless another is clearly faster. The layout in force is the default after it."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 32, 1, 128), dtype=np.float32)  # 32 query heads, one new token each
    k, v = (rng.standard_normal((1, 8, 16384, 128), dtype=np.float32) for _ in range(2))  # 8 kv heads, 64 MiB each

    def step(layout: DecodeLayout) -> Callable[[], object]:
        return lambda: in_layout(layout, flash_decode, q, k, v)  # the candidate in force while it is timed

    return fastest({layout: step(layout) for layout in DECODE_LAYOUTS}, default_layout(), repeats)


def fastest(calls: dict[Any, Callable[[], object]], base: Any, repeats: int) -> Any:
    """The key of the fastest call, or `base` unless another beats it by more than CLEAR_MARGIN. The calls are
    interleaved, one of each in turn, so that a change in the machine's load falls on all of them alike."""
    seconds = time_candidates(list(calls.values()), repeats)
    best = dict(zip(calls, seconds, strict=True))
    winner = min(best, key=best.__getitem__)
    return winner if base not in best or best[winner] < (1 - CLEAR_MARGIN) * best[base] else base


def time_candidates(calls: list[Callable[[], object]], repeats: int) -> list[float]:
    """Each call's fastest of `repeats` runs, in seconds, after one untimed run of each; run in turns."""
    for call in calls:
        call()
    best = [float("inf")] * len(calls)
    for _ in range(repeats):
        for i, call in enumerate(calls):
            best[i] = min(best[i], time_calls(call, repeats=1, warmup=0)[0])
    return best


def read_rule(path: Path, key: str) -> tuple[TileRule, DecodeLayout] | None:
    """The rule and decode layout stored for key, or None: no file, no entry, or an entry that is not a rule of
    positive ints with one of DECODE_LAYOUTS."""
    try:
        entry = json.loads(path.read_text(encoding="utf-8"))[key]
        rule = TileRule(**{name: entry[name] for name in TileRule._fields})
        layout = DecodeLayout(**{name: entry["decode_layout"][name] for name in DecodeLayout._fields})
    except (OSError, ValueError, KeyError, TypeError):
        return None
    fine = all(isinstance(value, int) and not isinstance(value, bool) and value > 0 for value in rule)
    fine = fine and isinstance(layout.keys_first, bool) and layout in DECODE_LAYOUTS
    return (rule, layout) if fine else None


def store_rule(path: Path, key: str, rule: TileRule, layout: DecodeLayout) -> None:
    """Add key's rule to the cache file (write_whole). A cache that cannot be written warns: the rule still holds
    in this process."""
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        entries = {}
    entry = {**rule._asdict(), "decode_layout": layout._asdict()}
    entries = {**(entries if isinstance(entries, dict) else {}), key: entry}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_whole(path, json.dumps(entries, indent=2, sort_keys=True))
    except OSError as err:
        warnings.warn(
            f"tune(): the cache {path} cannot be written ({err}); the rule holds for this process only", stacklevel=3
        )


def write_whole(path: Path, text: str) -> None:
    """path holds text, or what it held before: a temporary file beside it, renamed over it once written, and
    removed whatever stops the writing (an error, Ctrl-C)."""
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
