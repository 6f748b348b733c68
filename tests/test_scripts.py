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
import signal
import subprocess
import sys
import time
import tracemalloc
import types
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

import tinyattn_np as ta

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
    assert "   bash torch_crosscheck/install_torch_cpu.sh\n" in out  # the one install line, from torch_import.py


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
def test_help(script: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Each script's --help, in this process (a real process runs flex.py's)."""
    with pytest.raises(SystemExit) as stop:
        load(script).main(["--help"])
    out = capsys.readouterr().out
    assert stop.value.code == 0 and "--seed" in out and "--format" in out, out
    if script not in ("attention.py", "position.py"):  # the demos print checks, not figures
        assert "--json PATH" in out


def test_unknown_format_is_refused() -> None:
    result = run(str(SCRIPTS / "position.py"), "--format", "no-such-format")
    assert result.returncode == 2 and "invalid choice" in result.stderr


def load(script: str) -> ModuleType:
    """A script as a module (scripts/ is not a package; each script puts its folder on sys.path for the modules
    it shares)."""
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
    It patches machine.py before the test loads a script (a script binds machine's names as it loads)."""
    load("scaling.py")  # imports scripts/machine.py as the module `machine`
    machine = sys.modules["machine"]
    monkeypatch.setattr(machine, "SETTLE_SECONDS", 0.0)
    monkeypatch.setattr(machine, "load_average", lambda: 0.0)
    monkeypatch.setattr(machine, "matmul_rate", lambda dtype, n=2048, repeats=5: 100.0)


def test_scaling_small_run_writes_json(quick: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "scaling.json"
    flags = ["--min-tokens", "64", "--max-tokens", "128", "--repeats", "1", "--mem-budget", "0.00001"]
    assert load("scaling.py").main([*flags, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "check: naive == flash on 64 tokens" in printed
    assert re.search(r"^code: tinyattn_np \S+, (git [0-9a-f]{4,}(-dirty)?|not a git checkout)$", printed, re.M)
    assert "skipped (needs" in printed  # the tiny budget turns the naive rows into the OOM row
    figures = json.loads(out.read_text())
    assert [r["tokens"] for r in figures["results"]] == [64, 128]
    assert figures["results"][0]["naive_ms"] is None and figures["results"][0]["flash_ms"] > 0
    assert figures["machine"]["cores"] >= 1 and figures["interrupted"] is False
    assert figures["code"] in printed


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


# the programs, not the modules they share (copy_task.py, machine.py, ...: no __main__ of their own)
PROGRAMS = sorted(path.name for path in SCRIPTS.glob("*.py") if 'if __name__ == "__main__":' in path.read_text())


def test_no_program_imports_another() -> None:
    """Programs share modules (machine.py, copy_task.py, checkpoint.py, ...), never each other's code."""
    programs = {name.removesuffix(".py") for name in PROGRAMS}
    found = []
    for path in sorted(SCRIPTS.glob("*.py")):
        for line in path.read_text().splitlines():
            words = line.replace(",", " ").split()
            if words[:1] in (["import"], ["from"]) and len(words) > 1 and words[1] in programs:
                found.append(f"{path.name}: {line.strip()}")
    assert PROGRAMS and "machine.py" not in PROGRAMS and not found, found


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
    """run_flops prices the whole run; benchmark.start_benchmark refuses it past MAX_MINUTES at the matmul rate."""
    module = load(script)
    benchmark, limits = sys.modules["benchmark"], sys.modules["limits"]
    longest = ["--tokens" if script == "tiles.py" else "--max-tokens", "65536"]
    args = module.parse_args(["--repeats", "1000", *longest])  # --repeats at its cap: 1,000
    sizes = [args.tokens] if script == "tiles.py" else benchmark.doubling(args.min_tokens, args.max_tokens)
    problem = limits.time_problem(module.run_flops(args, sizes, True), 100.0, "lower --max-tokens or --repeats")
    assert problem and re.search(r"needs at least [0-9,]+ minutes .* lower --max-tokens or --repeats", problem)
    default = module.parse_args([])
    sizes = [default.tokens] if script == "tiles.py" else benchmark.doubling(default.min_tokens, default.max_tokens)
    assert limits.time_problem(module.run_flops(default, sizes, True), 10.0, "") is None  # the default fits


def test_a_run_too_long_is_refused_before_its_first_row(monkeypatch: pytest.MonkeyPatch) -> None:
    load("scaling.py")
    monkeypatch.setattr(sys.modules["machine"], "matmul_rate", lambda dtype, n=2048, repeats=5: 1e-6)
    with pytest.raises(SystemExit, match=r"error: this run needs at least [0-9,]+ minutes"):
        load("scaling.py").main(["--min-tokens", "64", "--max-tokens", "64", "--repeats", "1"])


def test_scaling_rounds_rows_beside_a_skipped_naive_row(capsys: pytest.CaptureFixture[str]) -> None:
    scaling = load("scaling.py")
    args = scaling.parse_args([])
    row = dict(
        tokens=1024,
        tiles="256 x 256",
        score_matrix_bytes=2**24,
        naive_estimate_bytes=19 * 2**20,
        naive_ms=None,
        naive_peak_bytes=None,
        flash_ms=12.3456789,
        flash_peak_bytes=3.3e6,
        flash_estimate_bytes=3.2e6,
        flops=4.5e9,
        matmul_gflops=91.234567,
        flash_no_mask_ms=20.987654,
        busy=[],
    )
    scaling.print_table([row, dict(row, tokens=512, naive_ms=1.23456, naive_peak_bytes=5.0e6)], args, True)
    out = capsys.readouterr().out
    assert "skipped (needs 19.0 MiB)" in out and "12.35" in out
    assert not re.search(r"\d\.\d{3,}", out), out  # no unrounded float next to the skipped row
    assert "*" not in out  # a quiet machine: no row marked


def test_scaling_small_run_in_process_prints_every_section(quick: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert load("scaling.py").main(["--min-tokens", "64", "--max-tokens", "128", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    for needle in (
        "check: naive == flash",
        "machine: ",
        "code: ",
        "float32 matmul, 2048 x 2048: 100.0 GFLOP/s",
        "naive budget",
        "time growth per doubling",
        "useful FLOPs",
    ):
        assert needle in out, needle
    labels = [line.split()[0] for line in out.splitlines() if line[:3] in ("64 ", "128")]
    assert labels == ["64", "128"] * (len(labels) // 2) and labels, out  # each part of a split table: both rows


def test_tiles_small_run(quick: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every tile shape, heads per step and worker count at a tiny T, the default marked, the model lines."""
    figures = tmp_path / "tiles.json"
    assert load("tiles.py").main(["--tokens", "64", "--repeats", "1", "--json", str(figures), "--wide"]) == 0
    out = capsys.readouterr().out
    for side in (64, 128, 256, 512, 1024):  # the sides, and the default's for a causal T = 64: 64
        assert len(re.findall(rf"^{side} x {side}( \(default\))?\s", out, re.MULTILINE)) == 3, f"{side}: three rows"
    assert out.count("(default)") == 1 and re.search(r"^64 x 64 \(default\)\s+4\s", out, re.MULTILINE)
    assert "fastest here:" in out and "on 16 cores: 64 x 64" in out
    assert "model: held_16 = 217 µs per step" in out
    rows = json.loads(figures.read_text())["results"]
    assert len(rows) == 15 and all(r["predicted_16_ms"] > 0 for r in rows)


def test_tiles_profile_splits_both_kernels(quick: None, capsys: pytest.CaptureFixture[str]) -> None:
    """--profile: a table each for the forward, the backward, the decode step and the MLA step, every part named,
    the copy the kernels' bits, and each kernel's time as a multiple of its products'."""
    assert load("tiles.py").main(["--profile", "--tokens", "96", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "forward: T=96" in out and "backward: T=96" in out
    assert "decode step: 1 query of 4 heads x 64 against T=96 keys" in out
    assert "MLA decode step: 128 heads over T=96 latents of 512 + 64, absorbed" in out
    assert out.count("matmul on one BLAS thread beside them (100.0 GFLOP/s, the best of 1)") == 4
    for part in (
        "matmuls",
        "exponentials",
        "reductions and rescaling",
        "masking",
        "copies and set-up",
        "Python between them",
        "in all",
    ):
        assert len(re.findall(rf"^{part}\s", out, re.MULTILINE)) == 4, part
    assert out.count("the profile's copy gives the kernel's bits: yes") == 4
    assert (
        len(
            re.findall(
                r"^in all: [0-9.]+x its products \(the time between them [0-9]+% of theirs; (within|over) "
                r"the aim of 1.25x\)$",
                out,
                re.MULTILINE,
            )
        )
        == 4
    ), out


def test_tiles_profile_keeps_the_forward_after_ctrl_c(
    quick: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    tiles, figures = load("tiles.py"), tmp_path / "profile.json"

    def interrupted(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(sys.modules["kernel_profile"], "profile_backward", interrupted)
    assert tiles.main(["--profile", "--tokens", "96", "--repeats", "1", "--json", str(figures)]) == 130
    out = capsys.readouterr().out
    assert "forward: T=96" in out and "backward: T=96" not in out and "after 1 of 4 tables" in out
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


def fake_torch(log: list[str]) -> Any:
    """A torch_runner for the benchmarks without torch: each call of the runner's function logs 't'."""
    return lambda threads: (lambda *arrays: lambda: log.append("t"), "fake 0.0")


def logged(fn: Any, log: list[str]) -> Any:
    """fn, logging 'f' at each call."""
    return lambda *args, **kwargs: (log.append("f"), fn(*args, **kwargs))[1]


@pytest.mark.parametrize(
    "script,kernel,runner",
    [
        ("scaling.py", "flash_attention", "torch_runner"),
        ("scaling_backward.py", "flash_attention_backward", "torch_backward_runner"),
    ],
)
def test_flash_and_torch_take_turns(
    quick: None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    script: str,
    kernel: str,
    runner: str,
) -> None:
    """With --torch, flash's figure and torch's are timed in turns: --rounds turns of two warm-ups and --repeats
    runs each, flash's and torch's alternating, so that a machine whose speed drifts slows both alike."""
    bench, log = load(script), []
    monkeypatch.setattr(bench, runner, fake_torch(log))
    monkeypatch.setattr(bench, kernel, logged(getattr(bench, kernel), log))
    assert bench.main(["--min-tokens", "64", "--max-tokens", "64", "--repeats", "2", "--rounds", "3", "--torch"]) == 0
    assert "".join(log[:24]) == "fffftttt" * 3, log  # nothing logs before the turns: the forward is not logged
    out = capsys.readouterr().out
    assert "of 3 turns of 2 runs each" in out and "flash/torch" in out, out


def test_torch_naive_without_torch_names_the_install_line() -> None:
    result = run("-c", WITHOUT_TORCH, str(SCRIPTS / "torch_naive.py"), "--max-tokens", "256")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().endswith("install its CPU build with: bash torch_crosscheck/install_torch_cpu.sh")


# Runs a script as __main__ with the packages named in argv[1] (comma-separated) not importable.
WITHOUT = (
    "import runpy, sys; [sys.modules.__setitem__(name, None) for name in sys.argv[1].split(',')]; "
    "sys.argv = sys.argv[2:]; runpy.run_path(sys.argv[0], run_name='__main__')"
)
MISSING = [  # (packages hidden, the script and its flags, what the line names)
    ("torch", ["torch_naive.py", "--max-tokens", "256"], "torch_naive.py needs torch"),
    ("torch", ["train_speed.py", "--torch"], "--torch needs torch"),
    ("torch", ["scaling.py", "--torch", "--max-tokens", "256"], "--torch needs torch"),
    ("mpi4py", ["train.py", "--data-parallel", "--steps", "1"], "--data-parallel needs mpi4py"),
    ("mpi4py", ["train_parallel.py", "--steps", "1"], "needs mpi4py"),
    ("mpi4py", ["ring.py", "--tokens", "64"], "needs mpi4py"),
    ("matplotlib", ["scaling.py", "--plot", "{tmp}/x.png"], "--plot needs matplotlib"),
    ("tokenizers", ["train.py", "--tokenizer", "{tmp}/tokenizer.json", "--steps", "1"], "needs the tokenizers"),
]


@pytest.mark.parametrize(("hidden", "command", "named"), MISSING, ids=[f"{c[0]} without {h}" for h, c, _ in MISSING])
def test_a_missing_optional_package_is_one_line_and_exit_2_in_every_script(
    hidden: str, command: list[str], named: str, tmp_path: Path
) -> None:
    """One rule (outputs.needs): the line names the flag and what to install, and the exit code is 2, as
    argparse's usage errors: the flags asked for what this install lacks."""
    (tmp_path / "tokenizer.json").write_text("{}")
    flags = [flag.format(tmp=tmp_path) for flag in command[1:]]
    result = run("-c", WITHOUT, hidden, str(SCRIPTS / command[0]), *flags)
    assert result.returncode == 2, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "error: " in lines[0] and named in lines[0] and "Traceback" not in result.stderr, lines


# --- scripts/memory.py's output -------------------------------------------------------------------


def test_memory_ratio_below_one_and_core_count_note(capsys: pytest.CaptureFixture[str]) -> None:
    memory = load("memory.py")
    row = dict(tokens=256, scores_fp32_bytes=1, scores_fp16_bytes=1, naive_peak_fp32_bytes=2, flash_peak_fp32_bytes=3)
    assert "0.667x" in memory.tiny_table([row], "binary", "simple")  # not "1x"
    assert memory.main([]) == 0
    assert "the flash column depends on the core count" in capsys.readouterr().out


def test_memory_and_scaling_print_one_flash_peak_and_the_docs_print_it_on_two_cores(
    quick: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """memory.py's flash-peak column and scaling.py's (est.) column are one estimate: peaks.flash_attention_bytes
    for 4 heads of 64, causal, fp32, with flash_attention()'s default workers (one per core, at most one per 2^18
    scores), as a call without workers= runs. docs/memory.md prints it on 2 cores: 0.528 MiB at 256 tokens, where
    2 workers forced would count a second tile that the default call never makes."""
    from tinyattn_np.peaks import flash_attention_bytes

    rows = {row["tokens"]: row for row in load("memory.py").tiny_table_rows()}
    figures = tmp_path / "scaling.json"
    assert (
        load("scaling.py").main(
            ["--min-tokens", "256", "--max-tokens", "512", "--repeats", "1", "--json", str(figures)]
        )
        == 0
    )
    for row in json.loads(figures.read_text())["results"]:
        assert row["flash_estimate_bytes"] == rows[row["tokens"]]["flash_peak_fp32_bytes"], row["tokens"]
    section = (ROOT / "docs" / "memory.md").read_text(encoding="utf-8").split("2) The tiny model")[1].split("3) ")[0]
    printed = dict(re.findall(r"^([0-9,]+) +[0-9.,]+ +[0-9.,]+ +[0-9.,]+ +([0-9.,]+) ", section, re.MULTILINE))
    assert len(printed) == 8, section
    for tokens, mib in printed.items():
        T = int(tokens.replace(",", ""))
        on_two_cores = max(1, min(2, 4 * T * T // 2**18))  # the default's workers on 2 cores
        estimate = flash_attention_bytes(T, heads=4, head_dim=64, causal=True, dtype="fp32", workers=on_two_cores)
        assert f"{estimate / 2**20:#.3g}".rstrip(".") == mib or f"{estimate / 2**20:,.0f}" == mib, (tokens, mib)


def test_torch_naive_says_slower_where_torch_fused_is_slower(capsys: pytest.CaptureFixture[str]) -> None:
    torch_naive = load("torch_naive.py")
    assert torch_naive.faster(3.52) == "3.5x faster" and torch_naive.faster(0.25) == "4.0x slower"
    row = dict(tokens=64, score_matrix_bytes=2**14, naive_ms=1.0, flash_ms=1.0, busy=[])
    rows = [dict(row, torch_naive_ms=1.0, torch_ms=4.0), dict(row, tokens=128, torch_naive_ms=7.0, torch_ms=2.0)]
    torch_naive.print_table(rows, torch_naive.parse_args([]), types.SimpleNamespace(causal=True, threads=2))
    out = capsys.readouterr().out
    assert "torch fused is 4.0x slower to 3.5x faster than torch naive here" in out, out


# --- Ctrl-C prints what was measured, says so in one line, exits 130 ------------------------------


def environment() -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")


def interrupt(tmp_path: Path, args: list[str], after: str, timeout: float = 90) -> tuple[int, str, str]:
    """Run `python args`, send SIGINT once `after` (a regex) shows in its output, and return (exit code,
    stdout, stderr). SIGINT is set to its default in the child: a shell may start a test with it ignored."""
    out_path, err_path = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        process = subprocess.Popen(
            [sys.executable, *args],
            cwd=ROOT,
            env=environment(),
            stdout=out,
            stderr=err,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        deadline = time.monotonic() + timeout
        while not re.search(after, out_path.read_text() + err_path.read_text()):
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                pytest.fail(f"{args[0]} never printed {after!r}:\n{out_path.read_text()}\n{err_path.read_text()}")
            time.sleep(0.02)
        process.send_signal(signal.SIGINT)
        try:
            code = process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            pytest.fail(f"{args[0]} went on after Ctrl-C:\n{out_path.read_text()}\n{err_path.read_text()}")
    return code, out_path.read_text(), err_path.read_text()


def test_ctrl_c_in_scaling_keeps_the_rows_measured(tmp_path: Path) -> None:
    figures = tmp_path / "scaling.json"
    flags = ["--min-tokens", "64", "--max-tokens", "8192", "--repeats", "3", "--workers", "1", "--json", str(figures)]
    code, out, err = interrupt(tmp_path, ["scripts/scaling.py", *flags], after=r"T = 128\n")
    assert code == 130 and "Traceback" not in err, err
    assert re.search(r"^64 ", out, re.MULTILINE), out  # the row measured before Ctrl-C, in the table
    assert re.search(r"^interrupted \(Ctrl-C\) after [12] of 8 rows", out, re.MULTILINE), out
    saved = json.loads(figures.read_text())
    assert saved["interrupted"] is True and saved["results"][0]["tokens"] == 64


HAS_MPI4PY = importlib.util.find_spec("mpi4py") is not None


@pytest.mark.skipif(not HAS_MPI4PY, reason='mpi4py is missing: pip install -e ".[distributed]"')
def test_ctrl_c_in_ring_with_one_rank(tmp_path: Path) -> None:
    flags = ["--tokens", "16384", "--repeats", "3", "--json", str(tmp_path / "ring.json")]
    code, out, err = interrupt(tmp_path, ["scripts/ring.py", *flags], after=r"1\) tiles per rank")
    assert code == 130 and "Traceback" not in err, err
    assert "interrupted (Ctrl-C) after 0 of 2 layouts" in out
    assert json.loads((tmp_path / "ring.json").read_text())["interrupted"] is True


@pytest.mark.parametrize("script", ["tiles.py", "scaling_backward.py"])
def test_ctrl_c_in_a_benchmark_keeps_rows_and_json(
    script: str,
    machine: ModuleType,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    module = load(script)
    measure, calls = module.measure_row, []

    def twice(*args: object) -> object:  # Ctrl-C during the second row
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return measure(*args)

    monkeypatch.setattr(module, "measure_row", twice)
    sizes = ["--tokens", "64"] if script == "tiles.py" else ["--min-tokens", "64", "--max-tokens", "256"]
    figures = tmp_path / "figures.json"
    assert module.main([*sizes, "--repeats", "1", "--json", str(figures)]) == 130
    out = capsys.readouterr().out
    assert re.search(r"^interrupted \(Ctrl-C\) after 1 of (15|3) rows", out, re.MULTILINE), out
    saved = json.loads(figures.read_text())
    assert saved["interrupted"] is True and len(saved["results"]) == 1


@pytest.mark.parametrize(
    ("script", "section"),
    [("attention.py", "tile_demo"), ("position.py", "norm_demo"), ("memory.py", "print_last_sections")],
)
def test_ctrl_c_in_a_demo_is_one_line_and_130(
    script: str, section: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    module = load(script)

    def stop(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(module, section, stop)
    assert sys.modules["interrupts"].run_main(lambda: module.main([])) == 130
    captured = capsys.readouterr()
    assert captured.err == "interrupted (Ctrl-C) before anything was measured\n"  # one line, no traceback
    assert "1) " in captured.out  # what was printed before stays printed


# --- the whole run estimated up front -------------------------------------------------------------


@pytest.mark.parametrize(
    "flags", [["--batch", "256", "--length", "24"], ["--batch", "64", "--length", "24", "--no-fused"]]
)
def test_train_memory_estimate_is_near_what_tracemalloc_sees(flags: list[str]) -> None:
    train = load("copy_task.py")
    args = train.parse_args(["--steps", "2", "--eval-every", "1", *flags])
    tracemalloc.start()
    try:
        train.train(args, progress=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    estimate = train.run_bill(args)[0]
    assert 0.8 < estimate / peak < 2.5, (estimate, peak)


def test_ring_table_of_1024_ranks_counts_a_few_rings_only() -> None:
    load("ring.py")
    balance = sys.modules["ring_balance"]  # ring.py's section 1
    assert balance.table_sizes(8) == [2, 3, 4, 5, 6, 7, 8]
    assert balance.table_sizes(1024) == [2, 3, 4, 5, 6, 7, 8, 16, 32, 64, 128, 256, 512, 1024]
    assert balance.table_sizes(20) == [2, 3, 4, 5, 6, 7, 8, 16, 20]


def test_ring_refuses_a_run_longer_than_the_limit() -> None:
    ring = load("ring.py")
    problem = ring.check_against_size(ring.parse_args(["--tokens", "262144", "--block", "1"]), 1)
    assert problem and re.search(r"needs at least [0-9,]+ minutes .* of bookkeeping, timed on a small case", problem)
    assert ring.check_against_size(ring.parse_args([]), 2) is None


# --- ring.py without mpiexec says it ran one rank -------------------------------------------------


@pytest.mark.skipif(not HAS_MPI4PY, reason='mpi4py is missing: pip install -e ".[distributed]"')
def test_ring_alone_says_it_ran_one_rank_and_how_to_run_more() -> None:
    flags = ["--tokens", "512", "--block", "64", "--repeats", "1", "--max-ranks", "2"]
    done = subprocess.run(
        [sys.executable, "scripts/ring.py", *flags],
        cwd=ROOT,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("ran 1 rank: a ring of one is plain flash attention") == 2  # at the top and the end
    assert "mpiexec -n 4 python scripts/ring.py\n\nall checks passed" in done.stdout


# --- memory.py names a config by its file or its own name -----------------------------------------


CONFIG = {
    "model_type": "llama",
    "hidden_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 1000,
    "intermediate_size": 512,
    "max_position_embeddings": 4096,
}


def test_memory_names_two_configs_of_one_folder_by_their_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "a"
    folder.mkdir()
    (folder / "x.json").write_text(json.dumps(CONFIG))
    (folder / "y.json").write_text(json.dumps({**CONFIG, "num_hidden_layers": 4}))
    (folder / "z.json").write_text(json.dumps({**CONFIG, "_name_or_path": "org/tiny-llama"}))
    sources = [str(folder / name) for name in ("x.json", "y.json", "z.json")]
    figures = tmp_path / "memory.json"
    assert load("memory.py").main([f"--model={s}" for s in sources] + ["--json", str(figures)]) == 0
    out = capsys.readouterr().out
    assert "3) Models" in out  # --json PATH writes the file and still prints the tables
    names = [row["model"] for row in json.loads(figures.read_text())["models"]["rows"]]
    assert names == [sources[0], sources[1], "org/tiny-llama"]


def test_memory_says_no_such_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert load("memory.py").main(["--model", "a/x.json"]) == 2
    assert "--model a/x.json: no such file" in capsys.readouterr().err


def test_memory_json_alone_still_prints_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert load("memory.py").main(["--json", "--model", "gpt2"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert len(printed["models"]["rows"]) == 1 and printed["code"].startswith("tinyattn_np ")


# --- a busy machine marks the rows it measured ----------------------------------------------------


def test_busy_reasons(machine: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    cores = os.cpu_count() or 1
    assert machine.busy_reasons(100.0, 100.0) == [] and machine.busy_reasons(81.0, 100.0) == []
    assert machine.busy_reasons(79.0, 100.0) == ["matmul rate 79.0 GFLOP/s, -21% from the run's first"]
    assert machine.busy_reasons(150.0, 100.0) == ["matmul rate 150.0 GFLOP/s, +50% from the run's first"]
    monkeypatch.setattr(machine, "load_average", lambda: cores + 0.04)  # prints as "{cores}.0": not over
    assert machine.busy_reasons() == []
    monkeypatch.setattr(machine, "load_average", lambda: cores + 1.5)
    assert machine.busy_reasons() == [f"load average {cores + 1.5:.1f} on {cores} cores"]


def test_scaling_marks_a_row_measured_on_a_busy_machine(
    machine: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    rates = iter([200.0, 190.0, 90.0])  # the header's, then one per row: the second row's machine got busy
    monkeypatch.setattr(machine, "matmul_rate", lambda dtype, n=2048, repeats=5: next(rates))
    assert load("scaling.py").main(["--min-tokens", "64", "--max-tokens", "128", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^64 +[0-9]", out, re.MULTILINE) and re.search(r"^128 \* +[0-9]", out, re.MULTILINE), out
    assert "* measured on a busy machine: compare these rows with care" in out
    assert "  T=128: matmul rate 90.0 GFLOP/s, -55% from the run's first" in out


# --- pictures: readable, and a tracked one is only replaced on purpose ----------------------------


@pytest.mark.parametrize(("script", "picture"), [("scaling.py", "docs/scaling.png"), ("train.py", "docs/train.png")])
def test_plot_refuses_to_overwrite_a_tracked_picture(
    script: str, picture: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib", reason="--plot needs the plot extra: pip install -e '.[plot]'")
    module = load(script)
    monkeypatch.chdir(ROOT)
    if not sys.modules["outputs"].git_tracks(picture):
        pytest.skip(f"{picture} is not tracked by git here (not a git checkout)")
    with pytest.raises(SystemExit):
        module.parse_args(["--plot", picture])
    assert f"--plot {picture}: git tracks this picture; add --overwrite to replace it" in capsys.readouterr().err
    assert module.parse_args(["--plot", picture, "--overwrite"]).plot == picture  # on purpose: allowed


def test_train_plot_is_readable_at_a_glance(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="--plot needs the plot extra: pip install -e '.[plot]'")
    import matplotlib.image

    train = load("copy_task.py")
    tokens = np.arange(24) % 16
    weights = np.tril(np.ones((24, 24))) / np.arange(1, 25)[:, None]
    path = tmp_path / "train.png"
    train.plot(weights, weights, tokens, 12, str(path), "title")
    height, width = matplotlib.image.imread(path).shape[:2]
    assert width >= 1200 and height >= 600, (width, height)
    tracked = ROOT / "docs" / "train.png"
    if tracked.exists():  # the committed picture was drawn by this code
        assert matplotlib.image.imread(tracked).shape[1] >= 1200


# --- the code version every benchmark prints ------------------------------------------------------


def test_code_version_names_the_commit_and_a_dirty_tree(
    machine: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tinyattn_np

    package = tmp_path / "tinyattn_np"
    package.mkdir()
    (package / "__init__.py").write_text("")
    monkeypatch.setattr(tinyattn_np, "__file__", str(package / "__init__.py"))
    assert machine.code_version() == f"tinyattn_np {tinyattn_np.__version__}, not a git checkout"
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "x"], check=True)
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert machine.code_version() == f"tinyattn_np {tinyattn_np.__version__}, git {head}"
    (package / "__init__.py").write_text("# changed\n")
    assert machine.code_version() == f"tinyattn_np {tinyattn_np.__version__}, git {head}-dirty"


# --- every size flag has a cap, refused by the flag before anything is allocated ------------------


CAPS = [
    ("serve.py", ["--requests", "1e20"], "argument --requests: must be a positive int at most 200,000; got '1e20'"),
    ("serve.py", ["--layers", "1000"], "argument --layers: must be a positive int at most 16; got 1,000"),
    ("serve.py", ["--vocab", "1e7"], "argument --vocab: must be a positive int at most 100,000, written in digits"),
    ("serve.py", ["--samples", "5000"], "argument --samples: must be a positive int at most 1,024"),
    ("serve.py", ["--rate", "1e-300"], "--rate must be at least 0.001"),
    ("serve.py", ["--requests", "2000"], "--requests x (--max-prompt + --max-new) + --samples x (--sample-prompt"),
    ("decode.py", ["--repeats", "1e20"], "argument --repeats: must be a positive int at most 1,000"),
    ("decode.py", ["--step", "--context", "100000000"], "argument --context: must be a positive int at most 4,194,304"),
    ("decode.py", ["--window", "100000"], "argument --window: must be a positive int at most 4,096"),
    ("decode.py", ["--head-dim", "100000"], "argument --head-dim: must be a positive int at most 1,024"),
    ("scaling.py", ["--workers", "1000000"], "argument --workers: must be a positive int at most 256"),
    ("scaling.py", ["--block-q", "100000000"], "argument --block-q: must be a positive int at most 4,194,304"),
    ("scaling.py", ["--kv-heads-per-step", "100000"], "argument --kv-heads-per-step: must be a positive int at most"),
    (
        "scaling.py",
        ["--repeats", "1e9"],
        "must be a positive int at most 1,000, written in digits (such as 1000000000)",
    ),
    ("scaling.py", ["--mem-budget", "1e300"], "argument --mem-budget: must be a positive float at most"),
    ("scaling_backward.py", ["--workers", "1000000"], "argument --workers: must be a positive int at most 256"),
    ("torch_naive.py", ["--workers", "1000000000000000"], "argument --workers: must be a positive int at most 256"),
    ("ring.py", ["--repeats", "100000"], "--repeats must be at most 1,000; got 100,000"),
    ("ring.py", ["--block", "100000000"], "--block must be at most 4,194,304; got 100,000,000"),
    ("ring.py", ["--head-dim", "100000"], "--head-dim must be at most 1,024; got 100,000"),
    ("sequence_parallel.py", ["--workers", "1000"], "argument --workers: must be a positive int at most 256"),
    ("sequence_parallel.py", ["--heads", "100000"], "argument --heads: must be a positive int at most 1,024"),
    ("sequence_parallel.py", ["--model-tokens", "1e20"], "argument --model-tokens: must be a positive int at most"),
    ("mla.py", ["--heads", "100000"], "argument --heads: must be a positive int at most 1,024"),
    ("mla.py", ["--contexts", "256", "1e9"], "argument --contexts: must be a positive int at most 4,194,304"),
    ("sparse.py", ["--index-heads", "100000"], "argument --index-heads: must be a positive int at most 1,024"),
    ("sparse.py", ["--queries", "8192"], "--queries (8,192) and --topk (256) must be at most --tokens (2,048)"),
    ("memory.py", ["--batch", "1e9"], "argument --batch: must be a positive int at most 1,048,576, written in digits"),
    ("memory.py", ["--tokens", "8192,1e30"], "--tokens must be comma-separated integers; got '8192,1e30'"),
    ("memory.py", ["--tokens", "10000000000000"], "--tokens must be positive integers at most 1,099,511,627,776"),
]


@pytest.mark.parametrize(("script", "flags", "message"), CAPS, ids=[f"{s} {' '.join(f)}" for s, f, _ in CAPS])
def test_a_size_past_its_cap_is_one_line_naming_the_flag(
    script: str, flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    module = load(script)
    tracemalloc.start()
    try:
        with pytest.raises(SystemExit) as stop:
            module.parse_args(flags)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert stop.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # argparse's usage lines, then the one error line
    assert message in last, last
    assert peak < 2**24, f"{peak:,} bytes allocated before the refusal"  # nothing of the run's size


# --- serve.py says how long before it starts, and refuses a run past the limit --------------------


def test_a_run_of_seconds_says_nothing_and_one_of_minutes_says_how_long(
    machine: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    limits = sys.modules["limits"]
    assert limits.time_problem(5e11, 100.0, "lower --x") is None  # 5 s at 100 GFLOP/s: nothing to say
    assert capsys.readouterr().err == ""
    assert limits.time_problem(6.5e12, 100.0, "lower --x", overhead_seconds=30.0) is None
    assert capsys.readouterr().err == (
        "this run takes at least 1 min 35 s; Ctrl-C stops it and keeps what was measured\n"
        "  (6.50e+12 FLOP at this machine's 100.0 GFLOP/s matmul rate, and 30 s of bookkeeping, timed on a small "
        "case here)\n"
    )


# --- scripts/flex.py as a user runs it ------------------------------------------------------------


SCRIPT = str(SCRIPTS / "flex.py")


def test_a_small_run_prints_every_pattern_and_the_targets():
    result = run(SCRIPT, "--tokens", "512", "--heads", "2", "--repeats", "1", "--baseline", str(ROOT))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "check: flex_attention equals the reference on every pattern at T = 512" in out
    assert "causal and window as mask_mods give the baseline's bits, forward and backward" in out
    assert "tile maps, one cell = 32 x 32 scores" in out
    for pattern, tiles in [
        ("causal", "3/4"),
        ("8 documents", "2/4"),
        ("prefix-LM", "3/4"),
        ("window 128", "3/4"),
        ("alibi", "3/4"),
        ("softcap", "3/4"),
    ]:
        assert re.search(rf"^{re.escape(pattern)}( \*)?\s+{tiles}\s", out, re.MULTILINE), f"row {pattern}"  # * = busy
    for target in ["causal: flex/flash", "8 documents: flex/batch", "alibi: flex/causal flash", "softcap:"]:
        assert target in out
    assert "flash_attention(causal=True), the baseline's:" in out
    assert "the targets are set for T = 16,384: at T = 512 the ratios are shown, not judged" in out
    assert "MISSED" not in out and "met)" not in out and "torch" not in out.split("tile maps")[1]  # torch: --torch


def test_the_default_window_is_a_fraction_of_t_so_its_row_is_not_causal():
    flex = load("flex.py")
    assert flex.parse_args([]).tokens == 1024  # the default run: seconds on 2 cores
    assert flex.parse_args(["--tokens", "16384"]).window == 1024  # docs/results/flex.md's table
    for argv, window in [([], 256), (["--tokens", "512"], 128), (["--window", "100"], 100)]:
        args = flex.parse_args(argv)
        assert args.window == window
        mods, T = sys.modules["flex_patterns"].patterns(args), args.tokens
        window_mask = ta.create_mask(mods[f"window {window}"][0], None, None, T, T)
        assert not np.array_equal(window_mask, ta.create_mask(mods["causal"][0], None, None, T, T))


def test_round_robin_idles_only_after_a_library_whose_threads_spin(monkeypatch: pytest.MonkeyPatch) -> None:
    flex, order = load("flex.py"), []
    monkeypatch.setattr(flex.time, "sleep", lambda seconds: order.append("idle"))
    names = ["causal", "torch causal", "alibi", "flash causal", "matmul"]
    times = flex.round_robin({name: lambda name=name: order.append(name) for name in names}, repeats=2)
    assert set(times) == set(names)
    # after torch's call and after the matmul (BLAS's threads): an idle; after our workers' calls: none
    one_round = ["causal", "torch causal", "idle", "alibi", "flash causal", "matmul"]
    assert order == (one_round + ["idle"]) * 2 + one_round


def test_a_window_that_covers_t_is_said_to_equal_causal(capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["--tokens", "64", "--heads", "1", "--head-dim", "8", "--repeats", "1", "--window", "64", "--no-reference"]
    assert load("flex.py").main(flags) == 0
    assert "window 64 >= T = 64: every earlier key is in it, so its row is causal's" in capsys.readouterr().out


def test_varlen_times_packed_documents_against_the_batch():
    result = run(SCRIPT, "--varlen", "--tokens", "256", "--heads", "1", "--head-dim", "8", "--repeats", "1")
    assert result.returncode == 0, result.stderr
    for documents in (8, 32):
        assert re.search(
            rf"^{documents}( \*)?\s+32\s+[0-9.]+\s+[0-9.]+\s+[0-9.]+x \(not judged\)", result.stdout, re.MULTILINE
        )
    assert "judged from --tokens 2048 on" in result.stdout
    assert "tile maps" not in result.stdout  # --varlen times the packed documents only


def test_help_and_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert "Attention patterns as mods" in run(SCRIPT, "--help").stdout
    result = run(SCRIPT, "--tokens", "100")  # a real process: exit 2 and one line, no traceback
    assert result.returncode == 2 and "--tokens must be a multiple of 16" in result.stderr
    assert "Traceback" not in result.stderr
    flex = load("flex.py")
    for args, message in [
        (["--tokens", "100"], "--tokens must be a multiple of 16"),
        (["--heads", "0"], "--heads: must be a positive int"),
        (["--heads", "100000"], "--heads: must be a positive int at most 1,024"),
        (["--head-dim", "100000"], "--head-dim"),
        (["--window", "10000000"], "--window"),
        (["--workers", "100000"], "--workers"),
        (["--tokens", "100000000"], "--tokens"),
        (["--repeats", "1e20"], "--repeats"),
        (["--tokens", "131072", "--heads", "1024"], "lower --tokens, --heads or --head-dim"),
        (["--baseline", "/nonexistent"], "no tinyattn_np/__init__.py there"),
        (["--seed", "-1"], "must be an int >= 0"),
    ]:
        with pytest.raises(SystemExit) as stop:  # argparse's error: usage, the message, exit 2
            flex.parse_args(args)
        err = capsys.readouterr().err
        assert stop.value.code == 2 and message in err, (args, err)


# --- sparse.py -------------------------------------------------------------------------------------------


def parts_so_far(out: str, names: list[str]) -> list[float]:
    """A profile's table (kernel_profile.parts_so_far) read back: its parts in order, the given ones then the
    copies and Python, and the time so far of each, growing."""
    found = re.findall(r"^(\S.*?)\s+[\d,.]+\s+\d+%\s+([\d.]+)x$", out, re.MULTILINE)
    assert [name for name, _ in found] == [*names, "copies and set-up", "Python between them"], out
    so_far = [float(x) for _, x in found]
    assert so_far == sorted(so_far) and so_far[0] > 0, so_far
    return so_far


def test_sparse_script_prints_the_arithmetic_the_measured_steps_the_speed_checks_and_the_parts(machine, capsys) -> None:
    flags = ["--contexts", "256", "--topk", "256", "--tokens", "512", "--queries", "32", "--repeats", "1"]
    code = load("sparse.py").main(flags)  # topk = S: the sparse steps read every key and are checked equal to dense
    out = capsys.readouterr().out
    assert code == 0 and "all checks passed" in out, out
    for n in (1, 2, 3, 4):
        assert re.search(rf"^{n}\) ", out, re.MULTILINE), f"section {n}) missing"
    # DeepSeek-V3.2's sizes: a decode step costs 2 · 128 · 1,088 FLOPs a latent dense, 2 · 64 · 128 an indexer key
    assert "DSA does fewer FLOPs than dense from S = 2,177, reads fewer bytes from S = 2,634" in out
    assert "indexer does 2.15 GFLOP and reads 33.6 MB: 79% of DSA's FLOPs and 93% of its bytes" in out
    assert re.search(r"^index_topk \(causal\)\s.*its FLOPs at the matmul rate", out, re.MULTILINE)
    assert re.search(r"^sparse_attention\s.*flash_attention, 32 x 256", out, re.MULTILINE)
    # 4) the parts in order, the time so far growing, and the floor said against the target from the same figures
    so_far = parts_so_far(out, ["matmuls", "ReLU", "the heads' weighted sum", "the running top-k"])
    floor = re.search(r"with the ReLU after them ([\d.]+)x:\n   (above|within) the 1.3x target", out)
    assert floor and float(floor[1]) == so_far[1] and floor[2] == ("above" if so_far[1] > 1.3 else "within")
    assert "the copy gives its indices: yes" in out
