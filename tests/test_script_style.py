"""The scripts read like the library: a program per topic and shared code in modules named for their concern
(machine.py, outputs.py, benchmark.py, ...) instead of copies, the training loop in one file read top to
bottom, no function over 60 lines of code, no file over 500 lines, and the same flags on every benchmark.

Lines of code: the lines of a function that hold code, not its docstring, comments or blank lines; a nested
function counts inside its parent (the parent is as long to read either way).
"""

from __future__ import annotations

import ast
import io
import os
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest
from test_scripts import PROGRAMS, load

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "scripts").glob("*.py"))
TORCH_SCRIPTS = [ROOT / "torch_crosscheck" / name for name in ("report.py", "gpu_scaling.py")]
MAX_FUNCTION_LINES, MAX_FILE_LINES = 60, 500


def code_lines(source: str) -> set[int]:
    """Line numbers that hold code: a token other than a comment, a newline or a docstring."""
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            value = body[0].value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                docstrings.update(range(body[0].lineno, (body[0].end_lineno or body[0].lineno) + 1))
    lines: set[int] = set()
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in skip:
            lines.update(range(token.start[0], token.end[0] + 1))
    return lines - docstrings


def function_lengths(source: str) -> dict[str, int]:
    """Lines of code of every top-level function and method (nested functions inside their parent)."""
    code = code_lines(source)
    lengths = {}
    for node in ast.parse(source).body:
        functions = [node] if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else []
        if isinstance(node, ast.ClassDef):
            functions = [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for function in functions:
            span = range(function.lineno, (function.end_lineno or function.lineno) + 1)
            lengths[function.name] = sum(1 for line in span if line in code)
    return lengths


def test_the_line_counter_counts_code_only() -> None:
    source = (
        'def f(x):\n    """Doc\n    string."""\n    # a comment\n\n    y = (x +\n         1)\n\n'
        "    def g():\n        return y\n    return g\n"
    )
    assert function_lengths(source) == {"f": 6}  # def, y = (two lines), def g, return y, return g


@pytest.mark.parametrize("path", SCRIPTS + TORCH_SCRIPTS, ids=lambda p: p.name)
def test_no_function_over_60_lines_and_no_file_over_500(path: Path) -> None:
    source = path.read_text(encoding="utf-8")
    assert len(source.splitlines()) <= MAX_FILE_LINES, f"{path.name}: {len(source.splitlines())} lines"
    long = {name: n for name, n in function_lengths(source).items() if n > MAX_FUNCTION_LINES}
    assert not long, f"{path.name}: functions over {MAX_FUNCTION_LINES} lines of code: {long}"


GENERIC_NAMES = {"common", "utils", "util", "helpers", "misc", "shared", "lib", "tools", "base"}


def script_imports(path: Path) -> set[str]:
    """The scripts/ modules a file imports (import x, from x import y), at the top or inside a function."""
    stems = {p.stem for p in SCRIPTS}
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names & stems


def test_each_script_is_a_program_or_a_module_of_one_concern() -> None:
    """The purpose rule: a file of scripts/ is a program of one topic (a main() run by `if __name__ ==
    "__main__":`) or a module that runs nothing, named for its concern (no common.py or utils.py), whose
    docstring says what it holds, and which some program uses (directly or through another module)."""
    programs = {p.stem for p in SCRIPTS if 'if __name__ == "__main__":' in p.read_text(encoding="utf-8")}
    modules = {p.stem for p in SCRIPTS} - programs
    wrong = [f"{name}.py: a name for no concern" for name in sorted(modules | programs) if name in GENERIC_NAMES]
    for path in SCRIPTS:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if not ast.get_docstring(tree):
            wrong.append(f"{path.name}: no docstring says what it holds")
        if path.stem in programs and not any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body):
            wrong.append(f"{path.name}: a program without main()")
    used, todo = set(), [name for name in programs]
    while todo:
        for name in script_imports(ROOT / "scripts" / f"{todo.pop()}.py") - used:
            used.add(name)
            todo.append(name)
    wrong += [f"{name}.py: no program uses it" for name in sorted(modules - used)]
    assert not wrong, "\n".join(wrong)


def test_the_training_loop_reads_in_one_sitting() -> None:
    """scripts/train.py is the loop a learner reads top to bottom: under 300 lines, with the step's library calls
    in it (the batch, the loss and its gradients, the clipping, the learning-rate schedule, AdamW's step, the
    validation and the checkpoint), its flags, printing and processes in the modules beside it."""
    source = (ROOT / "scripts" / "train.py").read_text(encoding="utf-8")
    assert len(source.splitlines()) < 300, f"train.py: {len(source.splitlines())} lines"
    calls = ["random_batch(", "loss_and_grads", "accumulated_grads(", "clip_grad_norm(", "warmup_cosine_lr("]
    calls += ["optimizer.step(", "model.loss(", "save_run(", "GPT(", "AdamW("]
    missing = [call for call in calls if call not in source]
    assert not missing, f"train.py does not show {missing}"
    assert "argparse.ArgumentParser(" not in source and 'print(f"{run.step:>7}' not in source


def test_the_torch_install_hint_lives_in_one_constant() -> None:
    hint = "bash torch_crosscheck/install_torch_cpu.sh"
    home = (ROOT / "scripts" / "torch_import.py").read_text(encoding="utf-8")
    assert f'TORCH_INSTALL_HINT = "{hint}"' in home
    for path in [*SCRIPTS, *TORCH_SCRIPTS]:
        text = path.read_text(encoding="utf-8")
        assert "pip install torch" not in text, f"{path.name} has its own torch install line"
        if path.name != "torch_import.py":
            assert hint not in text, f"{path.name} repeats the hint instead of using torch_import.TORCH_INSTALL_HINT"


SHARED = {  # a helper the scripts share -> the one file that defines it
    "max_diff": "report.py",  # tinyattn_np.report, beside the Checklist it serves
    "load_torch": "torch_import.py",
    "matmul_rate": "machine.py",
    "settled_median_ms": "machine.py",
    "progress": "outputs.py",
    "code_version": "machine.py",
    "doubling": "benchmark.py",
}


@pytest.mark.parametrize("name", sorted(SHARED))
def test_shared_helpers_are_defined_once(name: str) -> None:
    files = [*SCRIPTS, *TORCH_SCRIPTS, *sorted((ROOT / "tinyattn_np").glob("*.py"))]
    defined = [p.name for p in files if re.search(rf"^def {name}\(", p.read_text(), re.M)]
    assert defined == [SHARED[name]], f"{name} is defined in {defined}"


# --- the project speaks of itself, and its output fits a terminal ----------------------------------

SPOKEN = [
    *SCRIPTS,
    *sorted((ROOT / "tinyattn_np").glob("*.py")),
    *sorted((ROOT / "torch_crosscheck").glob("*.py")),
    *sorted((ROOT / "docs").rglob("*.md")),
    ROOT / "docs" / "tour.py",
]


def test_no_script_page_or_module_speaks_of_issues() -> None:
    """Help texts, outputs and pages say what the code does, never which issue asked for it ("the issue's
    table", "Issue 19's targets"): the scripts' help is their source's docstrings and help= strings."""
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in SPOKEN
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if re.search(r"\bissues?\b", line, re.IGNORECASE)
    ]
    assert not found, "\n".join(found)


# Each program's smallest run (its default where that takes seconds): what a user meets first. The MPI
# programs run as processes of their own (MPI starts once per process); the others in this one, quickly.
SMALLEST_RUNS = {
    "attention.py": [], "position.py": [], "memory.py": [],
    "decode.py": ["--tokens", "24"],
    "decode.py --step": ["--step", "--context", "1024", "--repeats", "1"],
    "serve.py": ["--requests", "4", "--max-prompt", "16", "--max-new", "6", "--samples", "2", "--sample-prompt", "12",
                 "--sample-tokens", "3"],
    "scaling.py": ["--min-tokens", "64", "--max-tokens", "128", "--repeats", "1"],
    "scaling_backward.py": ["--min-tokens", "64", "--max-tokens", "128", "--repeats", "1"],
    "torch_naive.py": ["--min-tokens", "64", "--max-tokens", "128", "--repeats", "1"],
    "tiles.py": ["--tokens", "256", "--repeats", "1"],
    "flex.py": ["--tokens", "256", "--repeats", "1"],
    "linear.py": ["--tokens", "64", "--heads", "2", "--head-dim", "16", "--chunk-sizes", "16", "--contexts", "32",
                  "--repeats", "1"],
    "mla.py": ["--contexts", "256", "--heads", "8", "--repeats", "1"],
    "sparse.py": ["--contexts", "256", "--topk", "128", "--tokens", "512", "--queries", "32", "--repeats", "1"],
    "train.py": ["--steps", "20"],
    "train.py --task copy": ["--task", "copy", "--steps", "40"],
    "attention.py --checkpoint": ["--checkpoint", "{checkpoint}"],
    "tiles.py --profile": ["--profile", "--tokens", "256", "--repeats", "1"],
    "train_speed.py": ["--presets", "tiny", "--tokens", "64", "--repeats", "1"],
    "sample.py": ["{checkpoint}", "--tokens", "16"],  # a checkpoint of train.py --steps 2, made first
    "ring.py": ["--tokens", "512", "--block", "64", "--repeats", "1", "--max-ranks", "2"],
    "sequence_parallel.py": ["--tokens", "512", "--repeats", "1"],
    "train_parallel.py": ["--steps", "4"],
}  # fmt: skip
MPI_PROGRAMS = {"ring.py", "sequence_parallel.py", "train_parallel.py"}
NEEDS = {
    "torch_naive.py": "torch",
    "ring.py": "mpi4py",
    "sequence_parallel.py": "mpi4py",
    "train_parallel.py": "mpi4py",
}
WIDTH = 120  # tinyattn_np.report.TABLE_WIDTH: a terminal's width


def test_every_program_has_a_smallest_run() -> None:
    assert sorted({run.split()[0] for run in SMALLEST_RUNS}) == PROGRAMS


def machine_under(monkeypatch: pytest.MonkeyPatch, load: float) -> None:
    """No idle waits, a fixed matmul rate and the given load average: the output is under test, not timings."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import machine

    monkeypatch.setattr(machine, "SETTLE_SECONDS", 0.0)
    monkeypatch.setattr(machine, "load_average", lambda: load)
    monkeypatch.setattr(machine, "matmul_rate", lambda dtype, n=2048, repeats=5: 100.0)


@pytest.fixture
def quiet_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """No load: the width of the output is under test, and a benchmark's conclusions are drawn."""
    machine_under(monkeypatch, 0.0)


# Programs whose output does not fit yet, each being changed by its own owner now: a strict xfail, so that
# the mark must go once the output fits.
NOT_YET: dict[str, str] = {}


def smallest_run(run: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of a program's smallest run (SMALLEST_RUNS): the MPI programs as processes of
    their own, the others in this process."""
    script, flags = run.split()[0], SMALLEST_RUNS[run]
    if "{checkpoint}" in flags:  # sample.py and attention.py read what train.py wrote
        assert load("train.py").main(["--steps", "2", "--out", str(tmp_path / "run")]) == 0
        capsys.readouterr()
        flags = [str(tmp_path / "run") if flag == "{checkpoint}" else flag for flag in flags]
    if script in NEEDS:
        pytest.importorskip(NEEDS[script], reason=f"{script} needs {NEEDS[script]}")
    if script in MPI_PROGRAMS:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        done = subprocess.run(
            [sys.executable, f"scripts/{script}", *flags],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        return done.returncode, done.stdout, done.stderr
    code = load(script).main(flags)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    "run",
    [
        pytest.param(run, marks=pytest.mark.xfail(reason=NOT_YET[run], strict=True)) if run in NOT_YET else run
        for run in sorted(SMALLEST_RUNS)
    ],
)
def test_output_fits_a_terminal(
    run: str, quiet_machine: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = smallest_run(run, tmp_path, capsys)
    assert code == 0, out + err
    wide = [f"{len(line)}: {line}" for line in (out + err).splitlines() if len(line) > WIDTH]
    assert not wide, f"{run}: lines over {WIDTH} columns (--wide prints tables whole):\n" + "\n".join(wide)
    if run in CONCLUSIONS:  # on a quiet machine a benchmark draws its conclusion
        assert re.search(CONCLUSIONS[run], out), out


# The benchmarks: every program that times something, but those under MPI (their rows are marked by the same
# machine.busy_reasons on rank 0; the load cannot be faked in another process).
BENCHMARK_RUNS = sorted(
    run
    for run in SMALLEST_RUNS
    if run.split()[0] not in {"attention.py", "position.py", "memory.py", *MPI_PROGRAMS} and "--checkpoint" not in run
)
CONCLUSIONS = {  # a benchmark's conclusion, drawn on a quiet machine and never from a busy row
    "mla.py": r"x its two products alone",
    "scaling.py": r"time growth per doubling: naive",
    "tiles.py": r"fastest here: \d",
    "linear.py": r"faster than the recurrence",
    "decode.py --step": r"x the floor \(target",
    "torch_naive.py": r"than torch naive here",
}


@pytest.fixture
def busy_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine loaded far above its core count: every row a benchmark measures is measured beside other work."""
    machine_under(monkeypatch, 99.0)


@pytest.mark.parametrize("run", BENCHMARK_RUNS)
def test_a_benchmark_on_a_busy_machine_says_so_and_concludes_nothing(
    run: str, busy_machine: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Under a load above the core count every benchmark marks what it measured (its rows '*', or its one
    figure) and says why, and draws no conclusion from it (machine.concluded): no fastest, no growth, no
    ratio judged against a target, no form 'x' times another."""
    code, out, err = smallest_run(run, tmp_path, capsys)
    assert code == 0, out + err
    assert re.search(r"(measured|timed) on a busy machine", out) and "load average 99.0" in out, out
    if run in CONCLUSIONS:
        assert not re.search(CONCLUSIONS[run], out) and "no conclusion drawn: measured on a busy machine" in out, out
