"""The two scripts run as a user runs them: report.py exits 0 (every comparison passes) and
gpu_scaling.py exits 0 without CUDA, saying so."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

HERE = Path(__file__).resolve().parent


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(HERE / script), *args], capture_output=True, text=True, timeout=300)


def test_report_passes_and_lists_cuda_rows() -> None:
    done = run("report.py", "--format", "github")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "| cuda " in done.stdout  # cuda rows are there, measured or "skipped (no CUDA)"
    assert "FAIL" not in done.stdout
    if not torch.cuda.is_available():
        assert "skipped (no CUDA)" in done.stdout


def test_report_help_and_bad_format() -> None:
    assert run("report.py", "--help").returncode == 0
    assert run("report.py", "--format", "no-such-format").returncode == 2  # argparse's usage error


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available: gpu_scaling measures instead")
def test_gpu_scaling_without_cuda_says_so_and_exits_0() -> None:
    done = run("gpu_scaling.py")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "CUDA is not available" in done.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA: torch.cuda.is_available() is False")
def test_gpu_scaling_small_run_on_cuda() -> None:
    done = run("gpu_scaling.py", "--max-tokens", "512", "--heads", "4", "--repeats", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "512" in done.stdout


def test_gpu_scaling_help() -> None:
    assert run("gpu_scaling.py", "--help").returncode == 0
