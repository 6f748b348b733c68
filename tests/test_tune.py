"""tune(): every rule it can choose gives the reference's result, one rule gives the same bits on every run, the
rule and the decode layout are kept for the process and in the cache, and a failed or interrupted tuning leaves
the constants and the default layout in force and no half-written file (every decode layout against the
reference: test_splitkv.py). The timings are replaced by fixed figures: nothing here depends on the machine's speed."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_close

from tinyattn_np import attention, attention_backward, flash_attention, flash_attention_backward, tune, untune
from tinyattn_np._tuning import (
    DECODE_LAYOUTS,
    DecodeLayout,
    TileRule,
    constant_rule,
    decode_layout,
    default_layout,
    default_tiles,
    tile_rule,
    use_decode_layout,
    use_tile_rule,
)
from tinyattn_np.peaks import flash_attention_backward_bytes

tune_module = importlib.import_module("tinyattn_np.tune")  # the module: tinyattn_np.tune is the function


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Each test with a cache directory of its own, a quiet machine, and the constants in force before and after."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(tune_module, "busy", lambda: None)
    untune()
    yield
    untune()


def fixed_timings(monkeypatch: pytest.MonkeyPatch, fastest_index: int = -1) -> list[int]:
    """time_candidates replaced: the call at fastest_index of each round takes 1 s, the others 2 s. Returns the
    list that counts the rounds measured."""
    rounds: list[int] = []

    def timings(calls: list, repeats: int) -> list[float]:
        rounds.append(len(calls))
        seconds = [2.0] * len(calls)
        seconds[fastest_index] = 1.0
        return seconds

    monkeypatch.setattr(tune_module, "time_candidates", timings)
    return rounds


def leftovers(tmp_path: Path) -> list[str]:
    folder = tmp_path / "cache" / "tinyattn_np"
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


# --- every rule tune() can choose ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_every_candidate_rule_gives_the_reference(rng, dtype):
    # GQA, causal, L != S and sizes that no tile side divides: ragged last tiles for every side
    q = rng.standard_normal((1, 4, 530, 16)).astype(dtype)
    k, v = (rng.standard_normal((1, 2, 600, 16)).astype(dtype) for _ in range(2))
    dout = rng.standard_normal(q.shape).astype(dtype)
    gold = attention(q, k, v, causal=True)
    gold_grads = attention_backward(q, k, v, dout, causal=True)
    seen = set()
    for rule in tune_module.candidate_rules(cores=2):
        use_tile_rule(rule)
        sizes = (rule.side, rule.scores_per_step, rule.backward_side)  # workers do not change the bits
        if sizes in seen:
            continue
        seen.add(sizes)
        out, lse = flash_attention(q, k, v, causal=True, return_lse=True)
        assert_close(out, gold, dtype, f"forward under {rule}")
        grads = flash_attention_backward(q, k, v, out, dout, lse, causal=True)
        for name, mine, want in zip("dq dk dv".split(), grads, gold_grads, strict=True):
            assert_close(mine, want, dtype, f"{name} under {rule}")
    assert len(seen) == len(tune_module.SIDES) ** 2 * len(tune_module.STEP_HEADS)


def test_the_candidates_hold_the_constants_and_halve_the_workers():
    assert constant_rule(2) in tune_module.candidate_rules(cores=2)
    assert constant_rule(16) in tune_module.candidate_rules(cores=16)
    assert {rule.workers for rule in tune_module.candidate_rules(cores=16)} == {8, 16}
    assert {rule.workers for rule in tune_module.candidate_rules(cores=1)} == {1}


def test_one_rule_gives_the_same_bits_on_every_run(rng):
    q, k, v = (rng.standard_normal((1, 4, 300, 32)).astype(np.float32) for _ in range(3))
    dout = rng.standard_normal(q.shape).astype(np.float32)
    use_tile_rule(TileRule(side=128, scores_per_step=128 * 128 * 2, backward_side=128, workers=1))
    first = flash_attention(q, k, v, causal=True, return_lse=True)
    first_grads = flash_attention_backward(q, k, v, first[0], dout, first[1], causal=True)
    for workers in (1, 2, 3):
        use_tile_rule(TileRule(side=128, scores_per_step=128 * 128 * 2, backward_side=128, workers=workers))
        again = flash_attention(q, k, v, causal=True, return_lse=True)
        grads = flash_attention_backward(q, k, v, again[0], dout, again[1], causal=True)
        for a, b in zip((*first, *first_grads), (*again, *grads), strict=True):
            np.testing.assert_array_equal(a, b)


def test_the_rule_in_force_sets_the_defaults_and_the_bills():
    rule = TileRule(side=128, scores_per_step=2**15, backward_side=512, workers=3)
    use_tile_rule(rule)
    assert tile_rule() == rule
    assert default_tiles(4096, 4096, 1) == (128, 128, 2)  # 2^15 scores: 2 kv heads of 128 x 128
    assert default_tiles(4096, 4096, 1, cores=2) == (256, 256, 4)  # given cores: the constants for them
    tuned = flash_attention_backward_bytes(4096, heads=4, head_dim=64)
    assert tuned == flash_attention_backward_bytes(4096, heads=4, head_dim=64, block_q=512, block_k=512, workers=3)
    untune()
    assert tile_rule() == constant_rule()


def test_a_rule_of_anything_but_positive_ints_is_refused():
    with pytest.raises(ValueError, match="side"):
        use_tile_rule(TileRule(side=0, scores_per_step=1, backward_side=1, workers=1))
    with pytest.raises(TypeError, match="workers"):
        use_tile_rule(TileRule(side=1, scores_per_step=1, backward_side=1, workers=1.5))  # type: ignore[arg-type]
    assert tile_rule() == constant_rule()


# --- tune(): measured, kept, cached ----------------------------------------------------------------------------


def test_tune_keeps_the_fastest_for_the_process_and_the_cache(monkeypatch, tmp_path):
    rounds = fixed_timings(monkeypatch, fastest_index=0)  # the first candidate of each round: 128, one head
    rule = tune(tokens=64, head_dim=8, repeats=1)
    workers = len({constant_rule().workers, max(1, constant_rule().workers // 2)})
    assert rounds == [9, workers, 3, len(DECODE_LAYOUTS)]
    assert rule.side == 128 and rule.scores_per_step == 128 * 128 and rule.backward_side == 128
    layout = DecodeLayout(2**13, keys_first=False)  # the first decode layout: small blocks, queries first
    assert tile_rule() == rule and decode_layout() == layout  # kept for the process
    stored = json.loads((tmp_path / "cache" / "tinyattn_np" / "tile_rules.json").read_text())
    assert stored == {tune_module.machine_key(): {**rule._asdict(), "decode_layout": layout._asdict()}}
    assert leftovers(tmp_path) == ["tile_rules.json"]  # no temporary file left beside it
    # the next process reads it: no measuring at all
    untune()
    assert decode_layout() == default_layout()
    monkeypatch.setattr(tune_module, "time_candidates", lambda *a: pytest.fail("measured despite the cache"))
    assert tune(tokens=64, head_dim=8, repeats=1) == rule == tile_rule()
    assert decode_layout() == layout


def test_a_rule_measured_on_a_busy_machine_holds_here_and_is_not_stored(monkeypatch, tmp_path):
    fixed_timings(monkeypatch, fastest_index=0)
    monkeypatch.setattr(tune_module, "busy", lambda: "the load average was 6.4 on 2 cores")
    with pytest.warns(UserWarning, match="load average was 6.4 on 2 cores; the rule measured holds for this process"):
        rule = tune(tokens=64, head_dim=8, repeats=1)
    assert tile_rule() == rule and rule.side == 128
    assert leftovers(tmp_path) == []


def test_busy_reads_the_load_average(monkeypatch):
    import os

    monkeypatch.undo()  # the real busy()
    monkeypatch.setattr(os, "getloadavg", lambda: (3.5, 0.0, 0.0))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert tune_module.busy() == "the load average was 3.5 on 2 cores"
    monkeypatch.setattr(os, "getloadavg", lambda: (1.9, 0.0, 0.0))
    assert tune_module.busy() is None


def test_a_candidate_must_clearly_beat_the_constants(monkeypatch):
    monkeypatch.setattr(tune_module, "time_candidates", lambda calls, repeats: [1.0] * len(calls))  # all alike
    assert tune(tokens=64, head_dim=8, repeats=1, cache=False) == constant_rule()
    assert decode_layout() == default_layout()


def test_cache_false_neither_reads_nor_writes(monkeypatch, tmp_path):
    fixed_timings(monkeypatch, fastest_index=0)
    tune(tokens=64, head_dim=8, repeats=1, cache=False)
    assert leftovers(tmp_path) == []


def test_a_damaged_cache_is_measured_again_and_rewritten(monkeypatch, tmp_path):
    folder = tmp_path / "cache" / "tinyattn_np"
    folder.mkdir(parents=True)
    key, whole = tune_module.machine_key(), {**constant_rule()._asdict(), "decode_layout": default_layout()._asdict()}
    no_layout = {**whole, "decode_layout": None}
    odd_layout = {**whole, "decode_layout": {"scores_per_block": 100, "keys_first": False}}  # not a candidate
    int_flag = {**whole, "decode_layout": {"scores_per_block": 2**13, "keys_first": 1}}
    entries = ({"side": -1}, constant_rule()._asdict(), no_layout, odd_layout, int_flag)  # the 2nd: no layout at all
    for damaged in ("{not json", "[1, 2]", *(json.dumps({key: entry}) for entry in entries)):
        (folder / "tile_rules.json").write_text(damaged)
        rounds = fixed_timings(monkeypatch, fastest_index=0)
        rule = tune(tokens=64, head_dim=8, repeats=1)
        assert len(rounds) == 4 and rule.side == 128
        stored = json.loads((folder / "tile_rules.json").read_text())[key]
        assert stored == {**rule._asdict(), "decode_layout": DECODE_LAYOUTS[0]._asdict()}


def test_other_machines_entries_stay(monkeypatch, tmp_path):
    folder = tmp_path / "cache" / "tinyattn_np"
    folder.mkdir(parents=True)
    other = {"another CPU; openblas Haswell; 64 cores": TileRule(512, 2**19, 256, 64)._asdict()}
    (folder / "tile_rules.json").write_text(json.dumps(other))
    fixed_timings(monkeypatch, fastest_index=0)
    rule = tune(tokens=64, head_dim=8, repeats=1)
    entry = {**rule._asdict(), "decode_layout": decode_layout()._asdict()}
    assert json.loads((folder / "tile_rules.json").read_text()) == {**other, tune_module.machine_key(): entry}


@pytest.mark.parametrize("bad", [{"tokens": 0}, {"head_dim": -1}, {"repeats": 1.5}, {"cache": 1}])
def test_bad_arguments_are_refused_before_anything_runs(bad):
    with pytest.raises((TypeError, ValueError), match=next(iter(bad))):
        tune(**bad)


# --- failing and interrupted ----------------------------------------------------------------------------------


def test_a_failing_tuning_warns_and_keeps_the_constants(monkeypatch, tmp_path):
    use_tile_rule(TileRule(128, 2**14, 128, 1))  # a rule from before: tune() starts from the constants

    def broken(calls: list, repeats: int) -> list[float]:
        raise MemoryError("no room for the test problem")

    monkeypatch.setattr(tune_module, "time_candidates", broken)
    with pytest.warns(UserWarning, match="tune\\(\\) failed .*MemoryError"):
        assert tune(tokens=64, head_dim=8, repeats=1) == constant_rule()
    assert tile_rule() == constant_rule()
    assert leftovers(tmp_path) == []


def test_ctrl_c_while_measuring_keeps_the_constants_and_writes_nothing(monkeypatch, tmp_path):
    use_tile_rule(TileRule(128, 2**14, 128, 1))
    calls = []

    def interrupted(candidates: list, repeats: int) -> list[float]:
        calls.append(1)
        if len(calls) == 2:  # in the second round: the first one's choice is made, not yet kept
            raise KeyboardInterrupt
        return [1.0] + [2.0] * (len(candidates) - 1)

    monkeypatch.setattr(tune_module, "time_candidates", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tune(tokens=64, head_dim=8, repeats=1)
    assert tile_rule() == constant_rule()
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("stop", [KeyboardInterrupt, OSError])
def test_a_write_stopped_halfway_leaves_the_old_file_whole(monkeypatch, tmp_path, stop):
    folder = tmp_path / "cache" / "tinyattn_np"
    folder.mkdir(parents=True)
    before = json.dumps({"another CPU; openblas Haswell; 64 cores": TileRule(512, 2**19, 256, 64)._asdict()})
    (folder / "tile_rules.json").write_text(before)
    fixed_timings(monkeypatch, fastest_index=0)

    def replace_stops(source: str, target: str) -> None:
        raise stop("stopped before the rename")

    monkeypatch.setattr(tune_module.os, "replace", replace_stops)
    if stop is KeyboardInterrupt:
        with pytest.raises(KeyboardInterrupt):
            tune(tokens=64, head_dim=8, repeats=1)
        assert tile_rule() == constant_rule()  # interrupted: the constants stay in force
    else:
        with pytest.warns(UserWarning, match="cannot be written"):
            rule = tune(tokens=64, head_dim=8, repeats=1)
        assert tile_rule() == rule  # measured: it holds for this process, only the file could not be written
    assert (folder / "tile_rules.json").read_text() == before
    assert leftovers(tmp_path) == ["tile_rules.json"]  # the temporary file is gone


def test_a_real_tuning_on_a_tiny_problem_chooses_a_candidate():
    """The one test that really measures: whatever the machine's speed, the rule is one of the candidates."""
    rule = tune(tokens=64, head_dim=8, repeats=1, cache=False)
    assert rule in tune_module.candidate_rules() and tile_rule() == rule
    assert decode_layout() in DECODE_LAYOUTS


@pytest.mark.parametrize("stop_in_round", [1, 4])
@pytest.mark.parametrize("stop", [KeyboardInterrupt, MemoryError])
def test_a_tuning_stopped_in_any_round_leaves_the_defaults(monkeypatch, tmp_path, stop_in_round, stop):
    use_tile_rule(TileRule(128, 2**14, 128, 1))  # a rule and a layout from before: tune() starts from the defaults
    use_decode_layout(DECODE_LAYOUTS[-1])
    rounds = []

    def stopped(candidates: list, repeats: int) -> list[float]:
        rounds.append(1)
        if len(rounds) == stop_in_round:  # round 4: the decode layouts, with the tile rule already measured
            raise stop("stopped")
        return [1.0] + [2.0] * (len(candidates) - 1)

    monkeypatch.setattr(tune_module, "time_candidates", stopped)
    if stop is KeyboardInterrupt:
        with pytest.raises(KeyboardInterrupt):
            tune(tokens=64, head_dim=8, repeats=1)
    else:
        with pytest.warns(UserWarning, match="tune\\(\\) failed .*MemoryError"):
            assert tune(tokens=64, head_dim=8, repeats=1) == constant_rule()
    assert tile_rule() == constant_rule() and decode_layout() == default_layout()
    assert leftovers(tmp_path) == []


def test_measuring_the_decode_layouts_leaves_the_default_in_force(monkeypatch):
    """Each candidate puts its layout in force to be timed; the measurement ends with the default again."""
    seen = []

    def timings(calls: list, repeats: int) -> list[float]:
        for call in calls:
            call()
        return [2.0] * (len(calls) - 1) + [1.0]  # the last layout: large blocks, keys first

    monkeypatch.setattr(tune_module, "time_candidates", timings)
    monkeypatch.setattr(tune_module, "flash_decode", lambda q, k, v: seen.append(decode_layout()))  # the layout in
    # force while the step runs, not the step
    assert tune_module.measure_decode_layout(repeats=1) == DECODE_LAYOUTS[-1]
    assert seen == list(DECODE_LAYOUTS) and decode_layout() == default_layout()
