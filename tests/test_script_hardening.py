"""What a user hit running the scripts, each fixed and held here: runs too large for the machine are refused
up front, a loss gone NaN stops training with a cure, Ctrl-C keeps what was measured, ring.py says when it
ran one rank, memory.py names configs by their file, busy machines mark their rows, tracked pictures are not
overwritten by accident, and every benchmark says which code printed it.

The Ctrl-C tests start a script, wait for it to report its first row, send SIGINT, and read what it printed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from test_scripts import load

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
HAS_MPI4PY = importlib.util.find_spec("mpi4py") is not None


@pytest.fixture
def common(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """scripts/common.py as the scripts import it, with no idle waits and a fixed 100 GFLOP/s matmul rate.
    Patched before a test loads a script: a script binds common's names as it loads."""
    load("scaling.py")
    module = sys.modules["common"]
    monkeypatch.setattr(module, "SETTLE_SECONDS", 0.0)
    monkeypatch.setattr(module, "matmul_rate", lambda dtype, n=2048, repeats=5: 100.0)
    monkeypatch.setattr(module, "load_average", lambda: 0.0)
    return module


def environment() -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")


def interrupt(tmp_path: Path, args: list[str], after: str, timeout: float = 90) -> tuple[int, str, str]:
    """Run `python args`, send SIGINT once `after` (a regex) shows in its output, and return (exit code,
    stdout, stderr). SIGINT is set to its default in the child: a shell may start a test with it ignored."""
    out_path, err_path = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        process = subprocess.Popen(
            [sys.executable, *args], cwd=ROOT, env=environment(), stdout=out, stderr=err,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )  # fmt: skip
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


# --- 18: Ctrl-C prints what was measured, says so in one line, exits 130 ---------------------------


def test_ctrl_c_in_scaling_keeps_the_rows_measured(tmp_path: Path) -> None:
    figures = tmp_path / "scaling.json"
    flags = ["--min-tokens", "64", "--max-tokens", "8192", "--repeats", "3", "--workers", "1", "--json", str(figures)]
    code, out, err = interrupt(tmp_path, ["scripts/scaling.py", *flags], after=r"T = 128\n")
    assert code == 130 and "Traceback" not in err, err
    assert re.search(r"^64 ", out, re.MULTILINE), out  # the row measured before Ctrl-C, in the table
    assert re.search(r"^interrupted \(Ctrl-C\) after [12] of 8 rows", out, re.MULTILINE), out
    saved = json.loads(figures.read_text())
    assert saved["interrupted"] is True and saved["results"][0]["tokens"] == 64


def test_ctrl_c_in_train_keeps_the_table_so_far(tmp_path: Path) -> None:
    figures = tmp_path / "train.json"
    flags = ["--task", "copy", "--steps", "5000", "--no-check", "--json", str(figures)]
    code, out, err = interrupt(tmp_path, ["scripts/train.py", *flags], after=r"step 10/5000")
    assert code == 130 and "Traceback" not in err, err
    assert re.search(r"^0 +- +[0-9.]+ +[0-9.]+%$", out, re.MULTILINE), out  # the step-0 row
    assert "interrupted (Ctrl-C) after" in out and "of 201 table rows" in out
    saved = json.loads(figures.read_text())
    assert saved["interrupted"] is True and saved["rows"][0]["step"] == 0 and saved["stopped"] == "Ctrl-C"


def test_ctrl_c_in_decode_keeps_the_rows_so_far(tmp_path: Path) -> None:
    figures = tmp_path / "decode.json"
    flags = ["--tokens", "3000", "--json", str(figures)]
    code, out, err = interrupt(tmp_path, ["scripts/decode.py", *flags], after=r"context \d+: row measured")
    assert code == 130 and "Traceback" not in err, err
    assert "1) 3000 tokens after a 8-token prompt" in out and "interrupted (Ctrl-C) after" in out
    assert json.loads(figures.read_text())["rows"][0]["context"] == 8 + 3000 // 8


@pytest.mark.skipif(not HAS_MPI4PY, reason='mpi4py is missing: pip install -e ".[distributed]"')
def test_ctrl_c_in_ring_with_one_rank(tmp_path: Path) -> None:
    flags = ["--tokens", "16384", "--repeats", "3", "--json", str(tmp_path / "ring.json")]
    code, out, err = interrupt(tmp_path, ["scripts/ring.py", *flags], after=r"1\) tiles per rank")
    assert code == 130 and "Traceback" not in err, err
    assert "interrupted (Ctrl-C) after 0 of 2 layouts" in out
    assert json.loads((tmp_path / "ring.json").read_text())["interrupted"] is True


@pytest.mark.parametrize("script", ["tiles.py", "scaling_backward.py"])
def test_ctrl_c_in_a_benchmark_keeps_rows_and_json(
    script: str, common: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
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
    assert re.search(r"^interrupted \(Ctrl-C\) after 1 of (12|3) rows", out, re.MULTILINE), out
    saved = json.loads(figures.read_text())
    assert saved["interrupted"] is True and len(saved["results"]) == 1


@pytest.mark.parametrize(("script", "section"), [("attention.py", "tile_demo"), ("position.py", "norm_demo"),
                                                 ("memory.py", "print_last_sections")])  # fmt: skip
def test_ctrl_c_in_a_demo_is_one_line_and_130(
    script: str, section: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    module = load(script)

    def stop(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(module, section, stop)
    assert sys.modules["common"].run_main(lambda: module.main([])) == 130
    captured = capsys.readouterr()
    assert captured.err == "interrupted (Ctrl-C) before anything was measured\n"  # one line, no traceback
    assert "1) " in captured.out  # what was printed before stays printed


# --- 13: the whole run estimated up front ----------------------------------------------------------


def test_decode_refuses_a_model_larger_than_the_machine(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        load("decode.py").parse_args(["--d-model", "4096", "--vocab", "1000000", "--tokens", "2"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "this run needs about" in err and "lower --d-model, --vocab, --layers or --tokens" in err


def test_decode_refuses_a_run_longer_than_the_limit(common: ModuleType) -> None:
    decode = load("decode.py")
    with pytest.raises(SystemExit, match=r"decode.py: error: this run needs at least [0-9,]+ minutes"):
        decode.main(["--tokens", "4000", "--d-model", "1024", "--layers", "16"])
    assert decode.run_flops(decode.parse_args([])) / 100e9 < 60  # the default: seconds at 100 GFLOP/s


def test_train_refuses_every_size_flag_at_its_maximum(common: ModuleType) -> None:
    train = load("train.py")
    flags = ["--task", "copy", "--length", "256", "--batch", "4096", "--d-model", "1024", "--layers", "8"]
    with pytest.raises(SystemExit, match=r"train.py: error: this run needs about [0-9,.]+ GiB \(the weights"):
        train.main(flags)
    with pytest.raises(SystemExit, match=r"needs at least [0-9,]+ minutes .* lower --batch"):
        train.main(["--task", "copy", "--steps", "1000000", "--batch", "4096", "--length", "8", "--no-check"])


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
    ring = load("ring.py")
    assert ring.table_sizes(8) == [2, 3, 4, 5, 6, 7, 8]
    assert ring.table_sizes(1024) == [2, 3, 4, 5, 6, 7, 8, 16, 32, 64, 128, 256, 512, 1024]
    assert ring.table_sizes(20) == [2, 3, 4, 5, 6, 7, 8, 16, 20]


def test_ring_refuses_a_run_longer_than_the_limit() -> None:
    ring = load("ring.py")
    problem = ring.check_against_size(ring.parse_args(["--tokens", "262144", "--block", "1"]), 1)
    assert problem and re.search(r"needs at least [0-9,]+ minutes .* s of bookkeeping", problem), problem
    assert ring.check_against_size(ring.parse_args([]), 2) is None


# --- 14: a loss gone NaN stops training with a cure, and the figures are written ------------------


def test_train_stops_at_the_first_non_finite_loss(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    figures = tmp_path / "train.json"
    flags = ["--task", "copy", "--lr", "1e8", "--steps", "50", "--no-check", "--json", str(figures)]
    assert load("train.py").main(flags) == 1
    captured = capsys.readouterr()
    assert "Lower --lr (now 1e+08" in captured.err and "Traceback" not in captured.err
    assert "RuntimeWarning" not in captured.err  # NumPy's overflow warnings: the one message says it
    saved = json.loads(figures.read_text())
    assert saved["rows"][0]["step"] == 0 and "training cannot go on" in saved["stopped"]
    assert saved["interrupted"] is False


# --- 19: ring.py without mpiexec says it ran one rank --------------------------------------------


@pytest.mark.skipif(not HAS_MPI4PY, reason='mpi4py is missing: pip install -e ".[distributed]"')
def test_ring_alone_says_it_ran_one_rank_and_how_to_run_more() -> None:
    flags = ["--tokens", "512", "--block", "64", "--repeats", "1", "--max-ranks", "2"]
    done = subprocess.run([sys.executable, "scripts/ring.py", *flags], cwd=ROOT, env=environment(),
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("ran 1 rank: a ring of one is plain flash attention") == 2  # at the top and the end
    assert "mpiexec -n 4 python scripts/ring.py\n\nall checks passed" in done.stdout


# --- 20: memory.py names a config by its file or its own name ------------------------------------

CONFIG = {
    "model_type": "llama", "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_hidden_layers": 2, "vocab_size": 1000, "intermediate_size": 512, "max_position_embeddings": 4096,
}  # fmt: skip


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


# --- 22: a busy machine marks the rows it measured -------------------------------------------------


def test_busy_reasons(common: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    cores = os.cpu_count() or 1
    assert common.busy_reasons(100.0, 100.0) == [] and common.busy_reasons(81.0, 100.0) == []
    assert common.busy_reasons(79.0, 100.0) == ["matmul rate 79.0 GFLOP/s, -21% from the run's first"]
    assert common.busy_reasons(150.0, 100.0) == ["matmul rate 150.0 GFLOP/s, +50% from the run's first"]
    monkeypatch.setattr(common, "load_average", lambda: cores + 0.04)  # prints as "{cores}.0": not over
    assert common.busy_reasons() == []
    monkeypatch.setattr(common, "load_average", lambda: cores + 1.5)
    assert common.busy_reasons() == [f"load average {cores + 1.5:.1f} on {cores} cores"]


def test_scaling_marks_a_row_measured_on_a_busy_machine(
    common: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    rates = iter([200.0, 190.0, 90.0])  # the header's, then one per row: the second row's machine got busy
    monkeypatch.setattr(common, "matmul_rate", lambda dtype, n=2048, repeats=5: next(rates))
    assert load("scaling.py").main(["--min-tokens", "64", "--max-tokens", "128", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^64 +[0-9]", out, re.MULTILINE) and re.search(r"^128 \* +[0-9]", out, re.MULTILINE), out
    assert "* measured on a busy machine: compare these rows with care" in out
    assert "  T=128: matmul rate 90.0 GFLOP/s, -55% from the run's first" in out


# --- 23: pictures: readable, and a tracked one is only replaced on purpose --------------------------


@pytest.mark.parametrize(("script", "picture"), [("scaling.py", "docs/scaling.png"), ("train.py", "docs/train.png")])
def test_plot_refuses_to_overwrite_a_tracked_picture(
    script: str, picture: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib", reason="--plot needs the plot extra: pip install -e '.[plot]'")
    module = load(script)
    monkeypatch.chdir(ROOT)
    if not sys.modules["common"].git_tracks(picture):
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
    common: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tinyattn_np

    package = tmp_path / "tinyattn_np"
    package.mkdir()
    (package / "__init__.py").write_text("")
    monkeypatch.setattr(tinyattn_np, "__file__", str(package / "__init__.py"))
    assert common.code_version() == f"tinyattn_np {tinyattn_np.__version__}, not a git checkout"
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "x"], check=True)
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert common.code_version() == f"tinyattn_np {tinyattn_np.__version__}, git {head}"
    (package / "__init__.py").write_text("# changed\n")
    assert common.code_version() == f"tinyattn_np {tinyattn_np.__version__}, git {head}-dirty"
