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


# --- Ctrl-C prints what was measured, says so in one line, exits 130 -------------------------------


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


# --- the whole run estimated up front --------------------------------------------------------------


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
    assert problem and re.search(r"needs at least [0-9,]+ minutes .* of bookkeeping, timed on a small case", problem)
    assert ring.check_against_size(ring.parse_args([]), 2) is None


# --- a loss gone NaN stops training with a cure, and the figures are written ----------------------


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


# --- ring.py without mpiexec says it ran one rank ------------------------------------------------


@pytest.mark.skipif(not HAS_MPI4PY, reason='mpi4py is missing: pip install -e ".[distributed]"')
def test_ring_alone_says_it_ran_one_rank_and_how_to_run_more() -> None:
    flags = ["--tokens", "512", "--block", "64", "--repeats", "1", "--max-ranks", "2"]
    done = subprocess.run([sys.executable, "scripts/ring.py", *flags], cwd=ROOT, env=environment(),
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("ran 1 rank: a ring of one is plain flash attention") == 2  # at the top and the end
    assert "mpiexec -n 4 python scripts/ring.py\n\nall checks passed" in done.stdout


# --- memory.py names a config by its file or its own name ----------------------------------------

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


# --- a busy machine marks the rows it measured -----------------------------------------------------


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


# --- pictures: readable, and a tracked one is only replaced on purpose ------------------------------


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


# --- every size flag has a cap, refused by the flag before anything is allocated --------------------

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


# --- serve.py says how long before it starts, and refuses a run past the limit ----------------------


def test_serve_counts_every_call_of_its_model(common: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """run_calls, counted from the flags before the run, against the calls a small run makes: the prefills and the
    contiguous steps exactly, the batched steps at least, and every decoded sequence."""
    serve = load("serve.py")
    flags = ["--requests", "5", "--min-prompt", "2", "--max-prompt", "12", "--max-new", "6", "--blocks", "64",
             "--samples", "3", "--sample-prompt", "10", "--sample-tokens", "4"]  # fmt: skip
    monkeypatch.setattr(serve, "seconds_per_call", lambda model, args: [0.0] * 4)  # no calls to calibrate
    counted = [0, 0, 0, 0]  # prefills, contiguous steps, batched steps, their sequences beyond one a step
    logits = serve.TinyDecoder.logits

    def count(self: object, tokens: np.ndarray, caches: list[object], seq_ids: list[int] | None = None) -> object:
        batch, new = tokens.shape
        if new > 1:
            counted[0] += 1
        elif seq_ids is None:
            counted[1] += 1
        else:
            counted[2], counted[3] = counted[2] + 1, counted[3] + batch - 1
        return logits(self, tokens, caches, seq_ids)

    monkeypatch.setattr(serve.TinyDecoder, "logits", count)
    assert serve.main(flags) == 0
    calls = serve.run_calls(serve.parse_args(flags))
    assert counted[:2] == calls[:2] and counted[2] >= calls[2], (counted, calls)
    assert counted[2] + counted[3] == calls[2] + calls[3], (counted, calls)  # every sequence of every step


def test_serve_says_how_long_before_it_starts_and_refuses_past_the_limit(
    common: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    serve = load("serve.py")

    def stop(*args: object) -> None:
        raise KeyboardInterrupt  # the header: the run would start here

    monkeypatch.setattr(common, "header", stop)
    flags = ["--requests", "300", "--max-prompt", "32", "--max-new", "32", "--blocks", "2000"]
    monkeypatch.setattr(serve, "seconds_per_call", lambda model, args: [0.002] * 4)
    with pytest.raises(KeyboardInterrupt):
        serve.main(flags)
    err = capsys.readouterr().err
    assert re.match(r"this run takes at least (\d+ min \d\d s|\d+ s); Ctrl-C stops it and keeps what was measured\n"
                    r"  \([0-9,]+ calls of the model, each kind timed here\)\n$", err), err  # fmt: skip
    monkeypatch.setattr(serve, "seconds_per_call", lambda model, args: [0.1] * 4)
    refused = r"serve.py: error: this run needs at least [0-9,]+ minutes \([0-9,]+ calls of the model, each kind timed"
    with pytest.raises(SystemExit, match=refused + r" here\), over the 30-minute limit: lower --requests"):
        serve.main(flags)


def test_a_run_of_seconds_says_nothing_and_one_of_minutes_says_how_long(
    common: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    assert common.time_problem(5e11, 100.0, "lower --x") is None  # 5 s at 100 GFLOP/s: nothing to say
    assert capsys.readouterr().err == ""
    assert common.time_problem(6.5e12, 100.0, "lower --x", overhead_seconds=30.0) is None
    assert capsys.readouterr().err == (
        "this run takes at least 1 min 35 s; Ctrl-C stops it and keeps what was measured\n"
        "  (6.50e+12 FLOP at this machine's 100.0 GFLOP/s matmul rate, and 30 s of bookkeeping, timed on a small "
        "case here)\n"
    )
