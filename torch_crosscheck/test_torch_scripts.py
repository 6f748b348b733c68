"""The torch scripts run as a user runs them: report.py exits 0 (every comparison passes), quietly and in
one line about a missing GPU; gpu_scaling.py exits 0 without CUDA, saying so, and refuses bad flags;
gpu_scaling's and scripts/torch_naive.py's naive paths checked against SDPA on CPU, and torch_naive.py's
table."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

HERE = Path(__file__).resolve().parent


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(HERE / script), *args], capture_output=True, text=True, timeout=300)


def test_report_passes_and_lists_cuda_rows() -> None:
    """Two cases, not all: test_torch_cases.py runs every comparison already."""
    done = run("report.py", "--format", "github", "--only", "one_head")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "FAIL" not in done.stdout and "Warning" not in done.stderr, done.stderr  # torch's kernel notes are not news
    assert "| cpu      | math     | float32 " in done.stdout  # one row per SDPA kernel, named
    # torch's fused CPU kernel takes 4-D inputs only: one_head's (T, d) tensors have no flash row
    assert "| cpu      | flash    | float32 " in done.stdout and "not supported" in done.stdout
    assert "code: tinyattn_np " in done.stdout
    if torch.cuda.is_available():
        assert "| cuda " in done.stdout
    else:  # one line, not a row per case
        assert "| cuda " not in done.stdout
        assert re.search(
            r"^CUDA is absent \(torch.cuda.is_available\(\) is False\): 8 cuda rows of 1 cases skipped",
            done.stdout,
            re.MULTILINE,
        ), done.stdout


def test_report_ctrl_c_keeps_the_rows_so_far(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import report

    rows_for, calls = report.rows_for, []

    def twice(case, device):  # Ctrl-C during the second case
        calls.append(case)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return rows_for(case, device)

    monkeypatch.setattr(report, "rows_for", twice)
    assert report.main(["--only", "MultiHeadAttention H=6"]) == 130
    out = capsys.readouterr().out
    assert (
        "MultiHeadAttention H=6 Hkv=6 fused" in out
        and "MultiHeadAttention H=6 Hkv=6 unfused" not in out
        and re.search(r"^interrupted \(Ctrl-C\) after 1 of", out, re.M)
    )


def test_report_rows_with_no_key(capsys: pytest.CaptureFixture[str]) -> None:
    """Rows that see no key pass on our exact 0; torch's value there is shown, not compared."""
    from report import main

    assert main(["--only", "fully masked rows"]) == 0
    out = capsys.readouterr().out
    assert "torch, no-key rows" in out
    assert "sdpa bool mask, fully masked rows" in out and "sdpa bool mask  " not in out


def test_report_records_what_torch_returns_on_rows_with_no_key(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kernel that returns non-zero values on a row with no key (as cuDNN does on CUDA) passes and is
    listed; ours not exactly 0 there fails."""
    import numpy as np
    import report
    from cases import Case, Outcome

    unseen = np.array([[False], [True]])  # (L=2, 1): row 1 sees no key

    def run_with(mine_row_1: float, torch_row_1: float):
        mine, gold = np.array([[0.5, 0.25], [mine_row_1, 0.0]]), np.array([[0.5, 0.25], [torch_row_1, -1.5]])
        return lambda device, dtype: Outcome(mine, gold, 1e-6, unseen)

    cases = [
        Case("like cuDNN on a fully masked row", run_with(0.0, 0.8), ("float32",)),
        Case("ours not zero on a fully masked row", run_with(1e-30, 0.0), ("float32",)),
    ]
    monkeypatch.setattr(report, "all_cases", lambda: cases)
    assert report.main(["--only", "like cuDNN"]) == 0
    out = capsys.readouterr().out
    rows = 2 + 4 * torch.cuda.is_available()  # one per kernel: math and flash on CPU, four on CUDA
    assert f"torch returned something else on rows that see no key (recorded, not compared) in {rows} rows:" in out
    assert "like cuDNN on a fully masked row | cpu math float32: -1.5" in out
    assert report.main(["--only", "ours not zero"]) == 1
    assert "FAIL" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flags", "message"),
    [(["--format", "no-such-format"], "--format"), (["--only", "no such case"], "matches no case")],
)
def test_report_refuses_bad_flags(flags: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    from report import parse_args

    with pytest.raises(SystemExit) as exited:
        parse_args(flags)
    assert exited.value.code == 2  # argparse's usage error, no traceback
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available: gpu_scaling measures instead")
def test_gpu_scaling_without_cuda_says_so_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    from gpu_scaling import main

    assert main([]) == 0
    assert "CUDA is not available" in capsys.readouterr().out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA: torch.cuda.is_available() is False")
@pytest.mark.parametrize("flags", [[], ["--no-causal", "--memory-limit-gib", "1"]])
def test_gpu_scaling_small_run_on_cuda(flags: list[str]) -> None:
    done = run("gpu_scaling.py", "--max-tokens", "512", "--repeats", "1", *flags)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "check: naive == fused" in done.stdout
    assert "naive MiB / score matrix" in done.stdout


def test_gpu_scaling_help(capsys: pytest.CaptureFixture[str]) -> None:
    from gpu_scaling import parse_args

    with pytest.raises(SystemExit) as exited:
        parse_args(["--help"])
    assert exited.value.code == 0
    assert "--memory-limit-gib" in capsys.readouterr().out


@pytest.mark.parametrize(
    "flags",
    [
        ["--max-tokens", "0"],
        ["--heads", "-1"],
        ["--memory-limit-gib", "nan"],
        ["--memory-limit-gib", "0"],
        ["--max-tokens", str(2**40)],
        ["--repeats", "0"],
    ],
)
def test_gpu_scaling_refuses_bad_flags(flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from gpu_scaling import parse_args

    with pytest.raises(SystemExit) as exited:
        parse_args(flags)
    assert exited.value.code == 2  # argparse's usage error, no traceback
    assert f"error: {flags[0]}" in capsys.readouterr().err


@pytest.mark.parametrize("causal", [True, False])
def test_gpu_scaling_naive_path_is_attention(causal: bool) -> None:
    """The article's naive path (masked_fill, softmax, @ v) computes what SDPA computes; on CPU in float64."""
    from gpu_scaling import fused, naive

    q, k, v = (
        torch.randn(1, 4, 33, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(i)) for i in range(3)
    )
    assert torch.allclose(naive(q, k, v, causal), fused(q, k, v, causal), rtol=0, atol=1e-12)
    assert not torch.allclose(naive(q, k, v, True), naive(q, k, v, False))  # the mask does something


def test_gpu_scaling_token_counts() -> None:
    from gpu_scaling import growth, token_counts

    assert token_counts(2048) == [256, 512, 1024, 2048]
    assert token_counts(3000) == [256, 512, 1024, 2048]
    assert token_counts(100) == [100]
    assert growth([1.0, 3.5, 14.0]) == "3.50x, 4.00x"
    assert growth([1.0]) == "-"


# --- scripts/torch_naive.py: the article's CPU table (torch naive vs torch fused) beside ours


def load_torch_naive(monkeypatch: pytest.MonkeyPatch | None = None):
    """scripts/torch_naive.py as a module; with monkeypatch, no idle waits and no 2048 x 2048 matmul (the
    table's shape is under test, not the timings), patched in machine.py before the script binds its names."""
    import importlib.util

    path = HERE.parent / "scripts" / "torch_naive.py"
    if monkeypatch is not None:
        sys.path.insert(0, str(path.parent))
        import machine

        monkeypatch.setattr(machine, "SETTLE_SECONDS", 0.0)
        monkeypatch.setattr(machine, "matmul_rate", lambda dtype, n=2048, repeats=5: 100.0)
        monkeypatch.setattr(machine, "load_average", lambda: 0.0)
    spec = importlib.util.spec_from_file_location("torch_naive_script", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("causal", [True, False])
def test_torch_naive_is_attention(causal: bool) -> None:
    """The article's naive torch code computes what SDPA computes (float64, CPU)."""
    torch_naive = load_torch_naive()
    q, k, v = (
        torch.randn(1, 4, 40, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(i)) for i in range(3)
    )
    gold = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    assert torch.allclose(torch_naive.torch_naive(q, k, v, causal), gold, rtol=0, atol=1e-12)


def test_torch_naive_bytes_is_three_score_matrices_and_the_mask() -> None:
    torch_naive = load_torch_naive()
    scores = 4 * 1024 * 1024 * 4  # 4 heads, T = 1024, float32
    assert torch_naive.torch_naive_bytes(1024, 4, "float32", True) == 3 * scores + 1024 * 1024  # 3.06x
    assert torch_naive.torch_naive_bytes(1024, 4, "float32", False) == 2 * scores


def test_torch_naive_prints_the_articles_table(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    torch_naive = load_torch_naive(monkeypatch)
    figures = tmp_path / "torch_naive.json"
    flags = ["--min-tokens", "128", "--max-tokens", "256", "--repeats", "1", "--format", "github"]
    assert torch_naive.main([*flags, "--json", str(figures)]) == 0
    out = capsys.readouterr().out
    assert "check: naive == flash on 64 tokens" in out and "check: torch naive == torch fused on 64 tokens" in out
    assert "The article's CPU table" in out and "torch naive ms" in out and "torch fused ms" in out
    assert "| 128 " in out and "| 256 " in out and "torch fused is " in out and "code: tinyattn_np " in out
    rows = json.loads(figures.read_text())["results"]
    assert [r["tokens"] for r in rows] == [128, 256] and all(r["torch_naive_ms"] > 0 for r in rows)


def test_torch_naive_ctrl_c_keeps_the_rows_so_far(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    torch_naive = load_torch_naive(monkeypatch)
    measure, calls = torch_naive.measure_row, []

    def twice(*args):  # Ctrl-C during the second row
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return measure(*args)

    monkeypatch.setattr(torch_naive, "measure_row", twice)
    assert torch_naive.main(["--min-tokens", "64", "--max-tokens", "256", "--repeats", "1"]) == 130
    out = capsys.readouterr().out
    assert re.search(r"^64 ", out, re.MULTILINE) and "interrupted (Ctrl-C) after 1 of 3 rows" in out


def test_report_marks_rows_where_torch_is_off_the_exact_value(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A row where torch is off the exact witness and ours is on it passes, marked, with the footnote."""
    import numpy as np
    import report
    from cases import Case, Outcome

    exact = np.array([4.527751820283849])
    case = Case("torch off", lambda device, dtype: Outcome(exact, exact + 7e-10, 2e-14, exact=exact), ("float64",))
    monkeypatch.setattr(report, "all_cases", lambda: [case])
    assert report.main(["--only", "torch off"]) == 0
    out = capsys.readouterr().out
    assert "7.00e-10*" in out and "* torch's value is off the exact one" in out
