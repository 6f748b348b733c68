"""What a run may ask of the machine, refused before it starts rather than killed in the middle: each size
flag's largest value (past it no run fits one machine), the memory a run needs against what this machine has
and has free, and its time, a lower bound at the matmul rate, against MAX_MINUTES."""

from __future__ import annotations

from outputs import progress

from tinyattn_np import best_unit, format_bytes, to_unit
from tinyattn_np.measure import memory_available, memory_total
from tinyattn_np.report import format_duration

# each size flag's largest value: past it no run of these scripts fits one machine, refused by the flag itself
MAX_TOKENS, MAX_HEADS, MAX_WORKERS, MAX_REPEATS = 2**22, 1024, 256, 1000
MAX_MINUTES = 30  # a run whose lower-bound time is longer is refused before it starts
SAY_SECONDS = 10  # a run whose lower-bound time is longer says how long before it starts


def memory_problem(needed: float, what: str, lower: str, detail: str = "") -> str | None:
    """Why `needed` bytes are too many for this machine (None when they fit): more than half of its memory,
    or more than is free now. The message: "{what} needs about {needed}{detail}, more than ...: {lower}"."""
    total, free = memory_total(), memory_available()
    if needed <= min(total / 2, free):
        return None
    unit = best_unit(total)  # the machine's unit, so that the two figures compare at a glance
    return (
        f"{what} needs about {to_unit(needed, unit):,.1f} {unit}{detail}, more than half of this machine's "
        f"{format_bytes(total)} or the {format_bytes(free)} free now: {lower}"
    )


def time_problem(flops: float, rate: float, lower: str, overhead_seconds: float = 0.0, how: str = "") -> str | None:
    """Why a run of `flops` (and `overhead_seconds` of Python bookkeeping, timed on a small case) cannot end
    within MAX_MINUTES even at the matmul rate; None when it can, and then, for a run of SAY_SECONDS or more,
    lines on stderr that say how long it takes at least. Nothing here runs at the matmul rate, so the time is
    a lower bound: a run refused is surely too long. how: what the time counts, where not FLOPs."""
    seconds = flops / (rate * 1e9) + overhead_seconds
    if not how:
        how = f"{flops:.2e} FLOP at this machine's {rate:.1f} GFLOP/s matmul rate"
        if overhead_seconds >= 1:
            how += f", and {format_duration(overhead_seconds)} of bookkeeping, timed on a small case here"
    if seconds > 60 * MAX_MINUTES:
        minutes = f"{seconds / 60:,.0f} minutes"
        return f"this run needs at least {minutes} ({how}), over the {MAX_MINUTES}-minute limit: {lower}"
    if seconds >= SAY_SECONDS:
        progress(
            f"this run takes at least {format_duration(seconds)}; Ctrl-C stops it and keeps what was measured\n"
            f"  ({how})"
        )
    return None
