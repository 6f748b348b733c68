"""scripts/serve.py: a small simulated server runs, its outputs equal each request run alone, paging holds less
than preallocation and a shared prompt less than copies; a wrong decode is caught; bad flags are refused up
front; Ctrl-C stops with what was measured."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from test_scripts import load

ROOT = Path(__file__).resolve().parents[1]
SMALL = """--requests 8 --rate 2 --min-prompt 3 --max-prompt 20 --max-new 16 --blocks 16 --block-size 4 --samples 3
--sample-prompt 10 --sample-tokens 5 --layers 1 --d-model 16 --heads 2 --kv-heads 1 --vocab 32""".split()


def test_a_small_server_run_checks_everything_it_prints(tmp_path, capsys):
    path = tmp_path / "serve.json"
    assert load("serve.py").main([*SMALL, "--json", str(path)]) == 0
    text = capsys.readouterr().out
    assert "all checks passed" in text and "held, no token (waste)" in text and "3 copies of the prompt" in text
    report = json.loads(path.read_text())
    paged, contiguous = report["batching"]
    assert paged["scheme"] == "paged" and contiguous["scheme"] == "contiguous"
    assert paged["tokens"] == contiguous["tokens"]  # the same workload
    assert paged["waste"] < contiguous["waste"] and paged["mean_at_once"] > contiguous["mean_at_once"]
    assert paged["max_diff"] < 1e-9 and contiguous["max_diff"] < 1e-9  # equal to each request alone
    samples = report["samples"]
    assert samples["shared_bytes"] == samples["formula_bytes"] < samples["copies_bytes"]


def test_a_wrong_paged_decode_is_caught(monkeypatch, capsys):
    """The check against each request alone can fail: scale the cached part of every paged step by 1.01."""
    module = load("serve.py")
    import tinyattn_np.paged as paged

    decode_pages = paged.decode_pages

    def wrong(*args):
        out, lse = decode_pages(*args)
        return out * 1.01, lse

    monkeypatch.setattr(paged, "decode_pages", wrong)
    assert module.main([*SMALL, "--samples", "1"]) == 1
    assert "the same logits to rounding" in capsys.readouterr().err


def test_ctrl_c_stops_with_what_was_measured(monkeypatch, capsys, tmp_path):
    module = load("serve.py")

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(module, "parallel_samples", interrupted)
    path = tmp_path / "serve.json"
    assert module.main([*SMALL, "--json", str(path)]) == 130
    out = capsys.readouterr().out
    assert "held, no token (waste)" in out  # part 1 had finished: its table stays printed
    assert "interrupted (Ctrl-C) after 1 of 2 parts" in out
    saved = json.loads(path.read_text())
    assert saved["interrupted"] is True and len(saved["batching"]) == 2 and "samples" not in saved


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--seed", "-1"], "must be an int >= 0"),
        (["--requests", "0"], "must be a positive int; got 0"),
        (["--min-prompt", "50", "--max-prompt", "10"], "must be at most --max-prompt"),
        (["--d-model", "30", "--heads", "4"], "heads of an even size"),
        (["--blocks", "4"], "cannot hold one request"),
        (["--requests", "100000"], "this is a simulation"),
        (["--json", "/no/such/folder/x.json"], "folder that exists"),
    ],
)
def test_bad_flags_are_refused_up_front(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        load("serve.py").parse_args(argv)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


def test_sampling_is_seeded_and_greedy_without_a_generator():
    load("serve.py")
    module = sys.modules["batching"]  # serve.py's requests and their sampling
    logits = np.array([0.0, 3.0, 1.0])
    assert module.sample(logits, None) == 1
    draws = [module.sample(logits, np.random.default_rng(4)) for _ in range(3)]
    assert len(set(draws)) == 1  # the same seed, the same token


# --- serve.py says how long before it starts, and refuses a run past the limit --------------------


def test_serve_counts_every_call_of_its_model(machine: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """run_calls, counted from the flags before the run, against the calls a small run makes: the prefills and the
    contiguous steps exactly, the batched steps at least, and every decoded sequence."""
    serve = load("serve.py")
    flags = "--requests 5 --min-prompt 2 --max-prompt 12 --max-new 6 --blocks 64".split()
    flags += "--samples 3 --sample-prompt 10 --sample-tokens 4".split()
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
    machine: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    serve = load("serve.py")

    def stop(*args: object) -> None:
        raise KeyboardInterrupt  # the header: the run would start here

    monkeypatch.setattr(machine, "header", stop)
    flags = ["--requests", "300", "--max-prompt", "32", "--max-new", "32", "--blocks", "2000"]
    monkeypatch.setattr(serve, "seconds_per_call", lambda model, args: [0.002] * 4)
    with pytest.raises(KeyboardInterrupt):
        serve.main(flags)
    err = capsys.readouterr().err
    assert re.match(
        r"this run takes at least (\d+ min \d\d s|\d+ s); Ctrl-C stops it and keeps what was measured\n"
        r"  \([0-9,]+ calls of the model, each kind timed here\)\n$",
        err,
    ), err
    monkeypatch.setattr(serve, "seconds_per_call", lambda model, args: [0.1] * 4)
    refused = r"serve.py: error: this run needs at least [0-9,]+ minutes \([0-9,]+ calls of the model, each kind timed"
    with pytest.raises(SystemExit, match=refused + r" here\), over the 30-minute limit: lower --requests"):
        serve.main(flags)
