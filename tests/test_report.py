import argparse

import numpy as np
import pytest

from tinyattn_np import best_unit, format_bytes, to_unit
from tinyattn_np.report import (
    TABLE_WIDTH,
    add_wide_argument,
    fit_table,
    fold_lines,
    format_duration,
    matrix_table,
    positive,
    table,
    table_width,
    text_table,
)


def test_units_never_mix():
    assert format_bytes(134_217_728) == "128.0 MiB"
    assert format_bytes(134_217_728, "decimal") == "134.2 MB"
    assert format_bytes(512) == "512 B"
    assert to_unit(2**30, "GiB") == 1.0 and to_unit(10**9, "GB") == 1.0
    assert best_unit(1023) == "B" and best_unit(1024) == "KiB" and best_unit(1000, "decimal") == "KB"
    with pytest.raises(ValueError, match="unit must be one of"):
        to_unit(1, "mb")
    with pytest.raises(ValueError, match="units"):
        format_bytes(1, "metric")


def test_tables():
    text = table([["a", 1.5]], ["name", "x"], fmt="github")
    assert text.splitlines()[0].startswith("| name")
    with pytest.raises(ValueError, match="table format must be one of"):
        table([], ["x"], fmt="fancy-ish")
    weights = np.array([[1.0, 0.0], [0.25, 0.75]])
    text = matrix_table(weights, ["'a'", "'b'"])
    assert "0.750" in text and "1.000" in text
    with pytest.raises(ValueError, match="one row per label"):
        matrix_table(weights, ["a"])


def test_checklist_and_format_flag(capsys):
    from tinyattn_np.report import Checklist, add_format_argument

    check = Checklist()
    check(True, "one plus one is two")
    assert check.finish() == 0 and "all checks passed" in capsys.readouterr().out
    check(False, "pigs fly")
    assert check.finish() == 1
    captured = capsys.readouterr()
    assert "CHECK FAILED: pigs fly" in captured.out and "1 check(s) failed" in captured.err

    parser = argparse.ArgumentParser()
    add_format_argument(parser)
    assert parser.parse_args([]).format == "simple"
    assert parser.parse_args(["--format", "github"]).format == "github"
    with pytest.raises(SystemExit):
        parser.parse_args(["--format", "nope"])


def test_the_seed_and_format_flags_and_max_diff(capsys):
    from tinyattn_np.report import add_seed_and_format, max_diff

    parser = argparse.ArgumentParser()
    add_seed_and_format(parser, "the weights")
    assert vars(parser.parse_args([])) == {"seed": 0, "format": "simple"}
    assert vars(parser.parse_args(["--seed", "7", "--format", "github"])) == {"seed": 7, "format": "github"}
    assert "seed for the weights (an int >= 0; default 0)" in parser.format_help()
    with pytest.raises(SystemExit):
        parser.parse_args(["--seed", "-1"])
    assert "--seed: must be an int >= 0" in capsys.readouterr().err
    assert max_diff(np.float32([1, 2]), np.float64([1, 2.5])) == 0.5 and max_diff(np.zeros(0), np.zeros(0)) == 0.0


@pytest.mark.parametrize("text", ["0", "-3", "nan", "inf", "two"])
def test_positive_refuses_what_cannot_be_a_size_or_a_rate(text):
    with pytest.raises(argparse.ArgumentTypeError, match="must be a positive float"):
        positive(float)(text)


def test_positive_keeps_the_kind():
    assert positive(int)("12") == 12 and positive(float)("0.005") == 0.005
    with pytest.raises(argparse.ArgumentTypeError, match="must be a positive int; got '1.5'"):
        positive(int)("1.5")


def test_positive_with_a_cap_refuses_past_it_and_says_how_to_write_a_whole_number():
    assert positive(int, most=256)("256") == 256
    with pytest.raises(argparse.ArgumentTypeError, match="must be a positive int at most 256; got 257$"):
        positive(int, most=256)("257")
    digits = r"at most 256, written in digits \(such as 1000000000\); got '1e9'"
    with pytest.raises(argparse.ArgumentTypeError, match=digits):
        positive(int, most=256)("1e9")
    with pytest.raises(argparse.ArgumentTypeError, match=r"must be a positive int, written in digits \(such as 4096\)"):
        positive(int)("4096.0")
    with pytest.raises(argparse.ArgumentTypeError, match="must be a positive int; got '-1e9'"):
        positive(int)("-1e9")  # not a size at all: no digits to suggest
    with pytest.raises(argparse.ArgumentTypeError, match="must be a positive float at most 1.5; got 2.0"):
        positive(float, most=1.5)("2")


def test_fit_table_splits_a_wide_table_into_parts_led_by_the_first_column():
    headers = ["model", *(f"a column of figures {i}" for i in range(8))]
    rows = [["llama", *(f"{i}.0" for i in range(8))], ["gpt2", *(f"{10 * i}.5" for i in range(8))]]
    whole = fit_table(rows, headers, width=None)
    assert max(len(line) for line in whole.splitlines()) > 120  # too wide for a terminal
    parts = fit_table(rows, headers).split("\n\n")
    assert len(parts) == 2 and all(max(len(line) for line in part.splitlines()) <= TABLE_WIDTH for part in parts)
    for part in parts:  # each part: the first column, then its share of the others, in order
        assert [line.split()[0] for line in part.splitlines()[2:]] == ["llama", "gpt2"]
    cells = [line.split()[1:] for part in parts for line in part.splitlines()[2:3]]
    assert [c for part in cells for c in part] == [f"{i}.0" for i in range(8)]
    narrow = [row[:2] for row in rows]
    assert fit_table(narrow, headers[:2]) == text_table(narrow, headers[:2])  # a narrow one: as it is
    numbers = ([["a", 1.25]], ["name", "x"])
    assert fit_table(*numbers, floatfmt=".1f") == table(*numbers, floatfmt=".1f")


def test_format_duration_and_the_wide_flag():
    assert [format_duration(s) for s in (5.0, 65.0, 3725.0)] == ["5 s", "1 min 05 s", "1 h 02 min"]
    parser = argparse.ArgumentParser()
    add_wide_argument(parser)
    assert table_width(parser.parse_args([])) == TABLE_WIDTH and table_width(parser.parse_args(["--wide"])) is None


def test_fold_lines_cuts_long_lines_and_keeps_every_character():
    text = "a" * 250 + "\n\nshort\n" + "b" * 120 + "\n"
    folded = fold_lines(text, width=120)
    assert [len(line) for line in folded.split("\n")] == [120, 120, 10, 0, 5, 120, 0]
    assert folded.replace("\n", "") == text.replace("\n", "")
    assert fold_lines("") == "" and fold_lines("ab\ncd") == "ab\ncd"
