"""Print one table: every crosscheck case on every device, SDPA kernel and dtype, tinyattn_np vs torch.

    python torch_crosscheck/report.py [--format github] [--only "fully masked"]

One row per (case, device, kernel, dtype). Columns:

    case        what is compared (Case.name)
    device      cpu or cuda
    kernel      the SDPA kernel torch was held to (torch.nn.attention.sdpa_kernel): math or flash on
                CPU; math, mem-efficient, flash or cudnn on CUDA; "-" where torch's side calls no SDPA
    dtype       float64, float32, float16 or bfloat16
    max abs error   over the rows that see a key; marked * where torch is off the exact value and ours is
                not (a case with an exact witness, cases.Outcome.torch_off): that row passes
    tolerance   what the case allows (cases.tolerance)
    torch, no-key rows   torch's value of largest magnitude on rows that see no key ("-": no such row);
                recorded, never failed on: ours must be exactly 0 there (-inf for a logsumexp)
    result      pass, FAIL, "not supported" (torch has no such kernel for this case), or skipped (no CUDA)

Without a GPU, one line says that CUDA is absent and how many rows that skips. Exits 1 if any comparison
fails, 130 on Ctrl-C (after printing the rows done so far), 0 otherwise.

To add rows: write cases as cases.Case objects (run(device, dtype) -> cases.Outcome) in a module of
this folder, and add that list in all_cases() below.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))  # the scripts' shared modules
from interrupts import interrupted, measure_each, run_main  # noqa: E402
from machine import code_version  # noqa: E402
from torch_import import load_torch  # noqa: E402

from tinyattn_np.report import add_format_argument, table  # noqa: E402

TORCH_OFF_MARK = "*"
HEADERS = ["case", "device", "kernel", "dtype", "max abs error", "tolerance", "torch, no-key rows", "result"]
NOT_SUPPORTED = "not supported"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Compare tinyattn_np with torch (SDPA, once per SDPA kernel, nn.Linear, RoPE references) "
        "on CPU and CUDA, print one table, exit 1 on any failure."
    )
    parser.add_argument(
        "--only", metavar="TEXT", default="", help="run only the cases whose name contains TEXT (default: all)"
    )
    add_format_argument(parser)
    args = parser.parse_args(argv)
    names = [case.name for case in all_cases()]
    if not any(args.only in name for name in names):
        parser.error(f"--only {args.only!r} matches no case; the cases are: {', '.join(names)}")
    return args


def all_cases() -> list[Any]:
    """Every case the report runs, in table order."""
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)  # cases.py, beside this file, when run as a script
    from cases import CASES
    from grad_cases import GRAD_CASES  # the hand-written gradients against torch autograd

    return [*CASES, *GRAD_CASES]


def rows_for(case: Any, device: str) -> tuple[list[list[Any]], int]:
    """The table rows of one case on one device (one per kernel and dtype), and how many failed."""
    from cases import kernels_for, run_case

    rows, failed = [], 0
    for kernel in kernels_for(case, device):
        for dtype in case.dtypes:
            row = [case.name, device, kernel or "-", dtype]
            try:
                result = run_case(case, device, dtype, kernel)
            except Exception as exc:  # a crash is a failure with its reason in the table, not a traceback
                rows.append([*row, f"error: {type(exc).__name__}: {exc}"[:60], "", "", "FAIL"])
                failed += 1
                continue
            if result is None:
                rows.append([*row, "", "", "", NOT_SUPPORTED])
                continue
            verdict = "pass" if result.passed else "FAIL"
            error = f"{result.error:.2e}" + (TORCH_OFF_MARK if result.torch_off else "")
            rows.append([*row, error, result.tolerance, result.torch_unseen, verdict])
            failed += not result.passed
    return rows, failed


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch, _ = load_torch(flag="report.py")
    from cases import DEVICES, kernels_for

    cuda = torch.cuda.is_available()
    cases = [case for case in all_cases() if args.only in case.name]
    runs = [(case, device) for device in DEVICES if device != "cuda" or cuda for case in cases]
    start = time.perf_counter()
    done: list[tuple[list[list[Any]], int]] = []
    with warnings.catch_warnings():  # torch's notes on why it picked no fused kernel: the table's "not supported"
        warnings.filterwarnings("ignore", message=".*sdp_utils", category=UserWarning)
        stopped = measure_each(runs, lambda run: rows_for(*run), done)
    seconds = time.perf_counter() - start
    rows = [row for case_rows, _ in done for row in case_rows]

    gpu = torch.cuda.get_device_name(0) if cuda else "none"
    print(f"torch {torch.__version__}, CPU {platform.machine()} ({torch.get_num_threads()} threads), GPU: {gpu}")
    print(f"code: {code_version()}")
    if not cuda:
        skipped = sum(len(kernels_for(case, "cuda")) * len(case.dtypes) for case in cases)
        print(
            f"CUDA is absent (torch.cuda.is_available() is False): {skipped} cuda rows of {len(cases)} cases "
            "skipped; on a GPU machine: bash torch_crosscheck/run_on_gpu.sh LOG_DIR"
        )
    # the error column holds text ("error: ...") too, so its numbers come formatted already
    print(table(rows, HEADERS, fmt=args.format, floatfmt=["", "", "", "", ".2e", ".2e", "", ""]))
    # torch's value on rows that see no key, where it is not what ours is (0, or -inf for a logsumexp)
    odd = [f"{r[0]} | {r[1]} {r[2]} {r[3]}: {r[6]}" for r in rows if r[6] not in ("", "-", "0", "-inf")]
    if odd:
        print(f"torch returned something else on rows that see no key (recorded, not compared) in {len(odd)} rows:")
        print("\n".join(f"  {line}" for line in odd))
    if any(str(row[4]).endswith(TORCH_OFF_MARK) for row in rows):
        print(
            f"{TORCH_OFF_MARK} torch's value is off the exact one (the formula in np.longdouble) by more than the "
            "tolerance, and ours is within it"
        )
    counts = {result: sum(row[-1] == result for row in rows) for result in ("pass", "FAIL", NOT_SUPPORTED)}
    print(
        f"{counts['pass']} passed, {counts['FAIL']} failed, {counts[NOT_SUPPORTED]} not supported by that torch "
        f"kernel in {seconds:.1f} s"
    )
    if stopped:
        return interrupted(len(done), len(runs), "cases")
    return 1 if sum(failed for _, failed in done) else 0


if __name__ == "__main__":
    sys.exit(run_main(main))
