import argparse

import numpy as np
import pytest

from tinyattn_np.report import best_unit, format_bytes, matrix_table, positive, table, to_unit


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


@pytest.mark.parametrize("text", ["0", "-3", "nan", "inf", "two"])
def test_positive_refuses_what_cannot_be_a_size_or_a_rate(text):
    with pytest.raises(argparse.ArgumentTypeError, match="must be a positive float"):
        positive(float)(text)


def test_positive_keeps_the_kind():
    assert positive(int)("12") == 12 and positive(float)("0.005") == 0.005
    with pytest.raises(argparse.ArgumentTypeError, match="must be a positive int; got '1.5'"):
        positive(int)("1.5")
