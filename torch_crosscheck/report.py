"""Print one table: every crosscheck case (cases.py) on every device and dtype, tinyattn_np vs torch.

    python torch_crosscheck/report.py [--format github]

Columns: case, device, dtype, max abs error, tolerance, result. Without a GPU every case still gets a
cuda row, marked "skipped (no CUDA)". Exits 1 if any comparison fails, 0 otherwise.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

from tinyattn_np.report import add_format_argument, table

HEADERS = ["case", "device", "dtype", "max abs error", "tolerance", "result"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Compare tinyattn_np with torch (SDPA, nn.Linear, RoPE references) on CPU and CUDA, "
        "print one table, exit 1 on any failure."
    )
    add_format_argument(parser)
    return parser.parse_args(argv)


def rows_for(case, device: str, cuda: bool) -> tuple[list[list[str]], int]:
    """The table rows of one case on one device, and how many of them failed."""
    if device == "cuda" and not cuda:
        return [[case.name, device, ", ".join(case.dtypes), "skipped (no CUDA)", "", "skipped"]], 0
    rows, failed = [], 0
    for dtype in case.dtypes:
        try:
            result = case.run(device, dtype)
        except Exception as exc:  # a crash is a failure with its reason in the table, not a traceback
            rows.append([case.name, device, dtype, f"error: {type(exc).__name__}: {exc}"[:60], "", "FAIL"])
            failed += 1
            continue
        rows.append([case.name, device, dtype, f"{result.error:.2e}", result.tolerance,
                     "pass" if result.passed else "FAIL"])  # fmt: skip
        failed += not result.passed
    return rows, failed


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # cases.py, beside this file
    import torch
    from cases import CASES, DEVICES

    cuda = torch.cuda.is_available()
    start = time.perf_counter()
    rows, failed = [], 0
    for device in DEVICES:
        for case in CASES:
            case_rows, case_failed = rows_for(case, device, cuda)
            rows += case_rows
            failed += case_failed
    seconds = time.perf_counter() - start

    gpu = torch.cuda.get_device_name(0) if cuda else "none"
    print(f"torch {torch.__version__}, CPU {platform.machine()} ({torch.get_num_threads()} threads), GPU: {gpu}")
    # the error column holds text ("skipped (no CUDA)") too, so its numbers come formatted already
    print(table(rows, HEADERS, fmt=args.format, floatfmt=["", "", "", ".2e", ".2e", ""]))
    counts = {result: sum(row[-1] == result for row in rows) for result in ("pass", "FAIL", "skipped")}
    print(f"{counts['pass']} passed, {counts['FAIL']} failed, {counts['skipped']} cases skipped (no CUDA) "
          f"in {seconds:.1f} s")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
