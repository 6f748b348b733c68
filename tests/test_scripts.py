"""The demo scripts run with their defaults, print what the README quotes, and exit 1 when a check fails.

Each script runs in a fresh interpreter (sys.executable), with this checkout first on PYTHONPATH so that
the tree under test is the one imported. torch is optional: the attention script is run once with torch
hidden, whether or not it is installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
BENCHMARKS = ["scaling.py", "torch_naive.py", "tiles.py", "scaling_backward.py"]

# Runs a script as __main__ with `import torch` failing, as on a machine without torch.
WITHOUT_TORCH = (
    "import runpy, sys; sys.modules['torch'] = None; sys.argv = sys.argv[1:]; "
    "runpy.run_path(sys.argv[0], run_name='__main__')"
)


def run(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def passed(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert "all checks passed" in result.stdout
    return result.stdout


@pytest.fixture(scope="module")
def attention_out() -> str:
    return passed(run(str(SCRIPTS / "attention.py")))


@pytest.fixture(scope="module")
def position_out() -> str:
    return passed(run(str(SCRIPTS / "position.py")))


def test_attention_script_sections(attention_out: str) -> None:
    for n in range(1, 7):
        assert re.search(rf"^{n}\) ", attention_out, re.MULTILINE), f"section {n}) missing"
    assert "['Holmes', ' examined', ' the', ' telegram', '.']" in attention_out
    assert re.search(r"^'Holmes'\s+1\.000(\s+0\.000){4}\s*$", attention_out, re.MULTILINE), "first weight row"
    assert "= 262,144 params" in attention_out
    assert "output (1, 5, 256)" in attention_out
    assert re.search(r"1 0 0 0 0\s+1 1 1 1 0\n\s+1 1 0 0 0\s+1 1 1 1 1", attention_out), "alignment grids"
    assert re.search(r"run, diagonal \(masked\)\s+8", attention_out)
    assert re.search(r"skipped \(wholly in the future\)\s+28", attention_out)


def test_attention_script_torch_line_matches_what_is_installed(attention_out: str) -> None:
    has_torch = importlib.util.find_spec("torch") is not None
    assert ("torch F.scaled_dot_product_attention(is_causal=True)" in attention_out) == has_torch
    assert ("torch checks skipped" in attention_out) == (not has_torch)


def test_attention_script_without_torch() -> None:
    out = passed(run("-c", WITHOUT_TORCH, str(SCRIPTS / "attention.py")))
    assert "torch checks skipped (here and in 4): torch is not installed; its CPU build adds them:\n" in out
    assert "   bash torch_crosscheck/install_torch_cpu.sh\n" in out  # the one install line, from common.py


def test_position_script_sections(position_out: str) -> None:
    for n in range(1, 6):
        assert re.search(rf"^{n}\) ", position_out, re.MULTILINE), f"section {n}) missing"
    assert "shuffle [3, 0, 4, 1, 2] in -> same shuffle out" in position_out
    assert "no position: max difference in the final '.' vector = 0.000000" in position_out
    rotary = re.search(r"RoPE: +max difference in the final '\.' vector = ([0-9.]+)", position_out)
    assert rotary and float(rotary.group(1)) > 0
    scores = dict(re.findall(r"^\((\d+, \d+)\)\s+\d+\s+(-?[0-9.]+)\s*$", position_out, re.MULTILINE))
    assert scores["10, 3"] == scores["110, 103"] == scores["507, 500"] != scores["10, 9"]
    assert "ValueError: positions must lie in [0, 1024)" in position_out


def test_position_script_other_seed_and_format() -> None:
    out = passed(run(str(SCRIPTS / "position.py"), "--seed", "7", "--format", "github"))
    assert re.search(r"^\| \(10, 3\)\s+\|", out, re.MULTILINE), "github table rows start with |"


@pytest.mark.parametrize("script", ["attention.py", "position.py", *BENCHMARKS, "decode.py", "train.py", "ring.py"])
def test_help(script: str) -> None:
    result = run(str(SCRIPTS / script), "--help")
    assert result.returncode == 0, result.stderr
    assert "--seed" in result.stdout and "--format" in result.stdout
    if script not in ("attention.py", "position.py"):  # the demos print checks, not figures
        assert "--json PATH" in result.stdout


def test_unknown_format_is_refused() -> None:
    result = run(str(SCRIPTS / "position.py"), "--format", "no-such-format")
    assert result.returncode == 2 and "invalid choice" in result.stderr


def load(script: str) -> ModuleType:
    """A script as a module (scripts/ is not a package; each script puts its folder on sys.path for common.py)."""
    spec = importlib.util.spec_from_file_location(f"script_{Path(script).stem}", SCRIPTS / script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_failed_check_exits_1_and_names_it(capsys: pytest.CaptureFixture[str]) -> None:
    position = load("position.py")
    rope = position.rope
    position.rope = lambda x, **kw: rope(x, **kw) * 1.01  # a "rotation" that stretches by 1 %
    assert position.main([]) == 1
    assert "RoPE (interleaved pairs (2i, 2i+1)) preserves every vector's norm" in capsys.readouterr().err


# --- the attention benchmarks: tiny runs prove the scripts work; the benchmarks themselves are never timed here


@pytest.fixture
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    """No idle waits, no 2048 x 2048 matmul, a quiet machine: the tables' shape is under test, not the timings.
    It patches common.py before the test loads a script (a script binds common's names as it loads)."""
    load("scaling.py")  # imports scripts/common.py as the module `common`
    common = sys.modules["common"]
    monkeypatch.setattr(common, "SETTLE_SECONDS", 0.0)
    monkeypatch.setattr(common, "load_average", lambda: 0.0)
    monkeypatch.setattr(common, "matmul_rate", lambda dtype, n=2048, repeats=5: 100.0)


def test_scaling_small_run_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "scaling.json"
    flags = ["--min-tokens", "64", "--max-tokens", "128", "--repeats", "1", "--mem-budget", "0.00001"]
    result = run("scripts/scaling.py", *flags, "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert "check: naive == flash on 64 tokens" in result.stdout
    assert re.search(r"^code: tinyattn_np \S+, (git [0-9a-f]{4,}(-dirty)?|not a git checkout)$", result.stdout, re.M)
    assert "skipped (needs" in result.stdout  # the tiny budget turns the naive rows into the OOM row
    figures = json.loads(out.read_text())
    assert [r["tokens"] for r in figures["results"]] == [64, 128]
    assert figures["results"][0]["naive_ms"] is None and figures["results"][0]["flash_ms"] > 0
    assert figures["machine"]["cores"] >= 1 and figures["interrupted"] is False
    assert figures["code"] in result.stdout


def test_scaling_no_causal_and_bad_flags(quick: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert load("scaling.py").main(["--min-tokens", "64", "--max-tokens", "64", "--repeats", "1", "--no-causal"]) == 0
    out = capsys.readouterr().out
    assert "no mask" in out and "causal/no-mask" not in out
    bad = run("scripts/scaling.py", "--min-tokens", "512", "--max-tokens", "256")
    assert bad.returncode == 2 and "--min-tokens (512) must not exceed" in bad.stderr


@pytest.mark.parametrize(
    "flags,command",
    [
        (["--torch-naive"], "python scripts/torch_naive.py"),
        (["--sweep-blocks", "4096"], "python scripts/tiles.py --tokens 4096"),
        (["--backward", "--torch"], "python scripts/scaling_backward.py"),
    ],
)
def test_scaling_flags_of_other_scripts_name_them(
    flags: list[str], command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        load("scaling.py").parse_args(flags)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err == f"scaling.py: error: {flags[0]} is a script of its own: {command}\n"  # one line


@pytest.mark.parametrize("script", ["attention.py", "position.py", *BENCHMARKS, "decode.py", "train.py"])
def test_negative_seed_is_refused_without_a_traceback(script: str) -> None:
    result = run(str(SCRIPTS / script), "--seed", "-1")
    assert result.returncode == 2, result.stderr
    assert "--seed: must be an int >= 0" in result.stderr and "Traceback" not in result.stderr


def _parser_of(script: str, monkeypatch: pytest.MonkeyPatch) -> argparse.ArgumentParser:
    """The script's ArgumentParser, caught when its main() asks it to parse."""
    caught: list[argparse.ArgumentParser] = []

    def catch(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        caught.append(self)
        raise SystemExit(0)

    module = load(script)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", catch)
    with pytest.raises(SystemExit):
        module.main([])
    return caught[0]


# the programs, not the modules they share (copy_task.py, training.py, ...: no __main__ of their own; common.py's
# only says that it is no program)
PROGRAMS = sorted(
    path.name
    for path in SCRIPTS.glob("*.py")
    if 'if __name__ == "__main__":' in path.read_text() and path.name != "common.py"
)


def test_no_program_imports_another() -> None:
    """Programs share modules (common.py, copy_task.py, training.py, ...), never each other's code."""
    programs = {name.removesuffix(".py") for name in PROGRAMS}
    found = []
    for path in sorted(SCRIPTS.glob("*.py")):
        for line in path.read_text().splitlines():
            words = line.replace(",", " ").split()
            if words[:1] in (["import"], ["from"]) and len(words) > 1 and words[1] in programs:
                found.append(f"{path.name}: {line.strip()}")
    assert PROGRAMS and "common.py" not in PROGRAMS and not found, found


@pytest.mark.parametrize("script", PROGRAMS)
def test_every_flag_has_help(script: str, monkeypatch: pytest.MonkeyPatch) -> None:
    parser = _parser_of(script, monkeypatch)
    missing = [a.option_strings for a in parser._actions if a.option_strings and not a.help]
    assert not missing, f"{script}: flags without help text: {missing}"


@pytest.mark.parametrize(
    "script,flags,message",
    [
        ("scaling.py", ["--max-tokens", "4194304"], "GiB for q, k, v and flash alone, more than half"),
        ("scaling.py", ["--heads", "1024", "--max-tokens", "1048576"], "lower --max-tokens, --heads or --head-dim"),
        ("scaling.py", ["--head-dim", "1024", "--max-tokens", "4194304"], "lower --max-tokens, --heads or --head-dim"),
        ("scaling.py", ["--min-tokens", "2000000000"], "--min-tokens: must be a positive int at most 4,194,304; got"),
        ("scaling.py", ["--mem-budget", "nan"], "--mem-budget: must be a positive float; got nan"),
        ("scaling.py", ["--mem-budget", "inf"], "--mem-budget: must be a positive float; got inf"),
        ("scaling.py", ["--json", "/no/such/folder/x.json"], "the folder /no/such/folder does not exist"),
        ("scaling.py", ["--repeats", "0"], "--repeats: must be a positive int; got 0"),
        ("scaling.py", ["--torch-3d"], "--torch-3d needs --torch"),
        ("tiles.py", ["--tokens", "4194304"], "lower --tokens, --heads or --head-dim"),
        ("torch_naive.py", ["--max-tokens", "4194304"], "lower --max-tokens, --heads or --head-dim"),
        ("scaling_backward.py", ["--workers", "0"], "--workers: must be a positive int; got 0"),
    ],
)
def test_benchmarks_refuse_up_front(
    script: str, flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        load(script).parse_args(flags)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_scaling_json_to_a_folder_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        load("scaling.py").parse_args(["--json", str(tmp_path)])
    assert "is a folder: give a file name in it" in capsys.readouterr().err


def test_scaling_plot_without_matplotlib(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    scaling = load("scaling.py")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    with pytest.raises(SystemExit):
        scaling.parse_args(["--plot", str(tmp_path / "x.png")])
    assert "--plot needs matplotlib" in capsys.readouterr().err


@pytest.mark.parametrize("script", BENCHMARKS)
def test_benchmarks_refuse_a_run_that_cannot_finish(script: str) -> None:
    """run_flops prices the whole run; common.start_benchmark refuses it past MAX_MINUTES at the matmul rate."""
    module = load(script)
    common = sys.modules["common"]
    longest = ["--tokens" if script == "tiles.py" else "--max-tokens", "65536"]
    args = module.parse_args(["--repeats", "1000", *longest])  # --repeats at its cap: 1,000
    sizes = [args.tokens] if script == "tiles.py" else common.doubling(args.min_tokens, args.max_tokens)
    problem = common.time_problem(module.run_flops(args, sizes, True), 100.0, "lower --max-tokens or --repeats")
    assert problem and re.search(r"needs at least [0-9,]+ minutes .* lower --max-tokens or --repeats", problem)
    default = module.parse_args([])
    sizes = [default.tokens] if script == "tiles.py" else common.doubling(default.min_tokens, default.max_tokens)
    assert common.time_problem(module.run_flops(default, sizes, True), 10.0, "") is None  # the default fits


def test_a_run_too_long_is_refused_before_its_first_row(monkeypatch: pytest.MonkeyPatch) -> None:
    load("scaling.py")
    monkeypatch.setattr(sys.modules["common"], "matmul_rate", lambda dtype, n=2048, repeats=5: 1e-6)
    with pytest.raises(SystemExit, match=r"error: this run needs at least [0-9,]+ minutes"):
        load("scaling.py").main(["--min-tokens", "64", "--max-tokens", "64", "--repeats", "1"])


def test_scaling_rounds_rows_beside_a_skipped_naive_row(capsys: pytest.CaptureFixture[str]) -> None:
    scaling = load("scaling.py")
    args = scaling.parse_args([])
    row = dict(
        tokens=1024, score_matrix_bytes=2**24, naive_estimate_bytes=19 * 2**20, naive_ms=None, naive_peak_bytes=None,
        flash_ms=12.3456789, flash_peak_bytes=3.3e6, flash_estimate_bytes=3.2e6, flops=4.5e9,
        matmul_gflops=91.234567, flash_no_mask_ms=20.987654, busy=[],
    )  # fmt: skip
    scaling.print_table([row, dict(row, tokens=512, naive_ms=1.23456, naive_peak_bytes=5.0e6)], args, True)
    out = capsys.readouterr().out
    assert "skipped (needs 19.0 MiB)" in out and "12.35" in out
    assert not re.search(r"\d\.\d{3,}", out), out  # no unrounded float next to the skipped row
    assert "*" not in out  # a quiet machine: no row marked


def test_scaling_small_run_in_process_prints_every_section(quick: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert load("scaling.py").main(["--min-tokens", "64", "--max-tokens", "128", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    for needle in ("check: naive == flash", "machine: ", "code: ", "float32 matmul, 2048 x 2048: 100.0 GFLOP/s",
                   "naive budget", "time growth per doubling", "useful FLOPs"):  # fmt: skip
        assert needle in out, needle
    labels = [line.split()[0] for line in out.splitlines() if line[:3] in ("64 ", "128")]
    assert labels == ["64", "128"] * (len(labels) // 2) and labels, out  # each part of a split table: both rows


def test_tiles_small_run(quick: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every tile shape, heads per step and worker count at a tiny T, the default marked, the model lines."""
    figures = tmp_path / "tiles.json"
    assert load("tiles.py").main(["--tokens", "64", "--repeats", "1", "--json", str(figures)]) == 0
    out = capsys.readouterr().out
    for side in (128, 256, 512, 1024):
        assert len(re.findall(rf"^{side} x {side}( \(default\))?\s", out, re.MULTILINE)) == 3, f"{side}: three rows"
    assert out.count("(default)") == 1
    assert "fastest here:" in out and "on 16 cores: 512 x 512" in out
    assert "model: held_16 = 217 µs per step" in out
    rows = json.loads(figures.read_text())["results"]
    assert len(rows) == 12 and all(r["predicted_16_ms"] > 0 for r in rows)


def test_tiles_profile_splits_both_kernels(quick: None, capsys: pytest.CaptureFixture[str]) -> None:
    """--profile: a table each for the forward and the backward, every part named, the copy the kernels' bits."""
    assert load("tiles.py").main(["--profile", "--tokens", "96", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "forward: T=96" in out and "backward: T=96" in out
    assert out.count("matmul on one BLAS thread beside them (100.0 GFLOP/s, the best of 1)") == 2
    for part in ("matmuls", "exponentials", "reductions and rescaling", "masking", "copies and set-up",
                 "Python between them", "in all"):  # fmt: skip
        assert len(re.findall(rf"^{part}\s", out, re.MULTILINE)) == 2, part
    assert out.count("the profile's copy gives the kernel's bits: yes") == 2


def test_tiles_profile_keeps_the_forward_after_ctrl_c(
    quick: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    tiles, figures = load("tiles.py"), tmp_path / "profile.json"

    def interrupted(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(tiles, "profile_backward", interrupted)
    assert tiles.main(["--profile", "--tokens", "96", "--repeats", "1", "--json", str(figures)]) == 130
    out = capsys.readouterr().out
    assert "forward: T=96" in out and "backward: T=96" not in out and "after 1 of 2 tables" in out
    saved = json.loads(figures.read_text())
    assert saved["interrupted"] is True and "forward" in saved and "backward" not in saved


def test_tiles_model_pieces() -> None:
    tiles = load("tiles.py")
    assert tiles.makespan([8, 1, 7, 2, 6, 3], 3) == 9  # longest first: 8+1, 7+2, 6+3
    assert tiles.makespan([5, 5, 5], 1) == 15
    # T = 512 in 256 x 256 tiles, causal: block 0 runs 1 tile, block 1 runs 2; 4 heads 2 at a time: 2 items each
    assert sorted(tiles.sweep_items(512, 256, 4, 2, True)) == [1, 1, 2, 2]


def test_scaling_backward_small_run(quick: None, capsys: pytest.CaptureFixture[str]) -> None:
    """The backward's table at a tiny size (what scaling.py --backward printed)."""
    assert load("scaling_backward.py").main(["--min-tokens", "64", "--max-tokens", "128", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "flash_attention_backward: 1 sequence, 4 heads x 64" in out and "bwd/fwd" in out and "peak/est." in out
    assert [line.split()[0] for line in out.splitlines() if line[:3] in ("64 ", "128")] == ["64", "128"]
    assert "backward FLOPs = 2·(3E + 2Ev) per unmasked score" in out


def test_torch_naive_without_torch_names_the_install_line() -> None:
    result = run("-c", WITHOUT_TORCH, str(SCRIPTS / "torch_naive.py"), "--max-tokens", "256")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().endswith("install its CPU build with: bash torch_crosscheck/install_torch_cpu.sh")


# --- scripts/memory.py's output -------------------------------------------------------------------


def test_memory_ratio_below_one_and_core_count_note(capsys: pytest.CaptureFixture[str]) -> None:
    memory = load("memory.py")
    row = dict(tokens=256, scores_fp32_bytes=1, scores_fp16_bytes=1, naive_peak_fp32_bytes=2, flash_peak_fp32_bytes=3)
    assert "0.667x" in memory.tiny_table([row], "binary", "simple")  # not "1x"
    assert memory.main([]) == 0
    assert "flash_attention()'s peak depends on the core count" in capsys.readouterr().out


def test_torch_naive_says_slower_where_torch_fused_is_slower(capsys: pytest.CaptureFixture[str]) -> None:
    torch_naive = load("torch_naive.py")
    assert torch_naive.faster(3.52) == "3.5x faster" and torch_naive.faster(0.25) == "4.0x slower"
    row = dict(tokens=64, score_matrix_bytes=2**14, naive_ms=1.0, flash_ms=1.0, busy=[])
    rows = [dict(row, torch_naive_ms=1.0, torch_ms=4.0), dict(row, tokens=128, torch_naive_ms=7.0, torch_ms=2.0)]
    torch_naive.print_table(rows, torch_naive.parse_args([]), types.SimpleNamespace(causal=True, threads=2))
    out = capsys.readouterr().out
    assert "torch fused is 4.0x slower to 3.5x faster than torch naive here" in out, out
