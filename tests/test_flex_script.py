"""scripts/flex.py as a user runs it: a small table of every pattern with our paths and the reference (torch
is left out here: compiling torch's flex_attention takes tens of seconds; torch_crosscheck runs it), the
check against the reference, the baseline option, and its argument errors."""

from __future__ import annotations

import re

from test_scripts import ROOT, SCRIPTS, run

SCRIPT = str(SCRIPTS / "flex.py")


def test_a_small_run_prints_every_pattern_and_the_targets():
    result = run(SCRIPT, "--tokens", "512", "--heads", "2", "--repeats", "1", "--no-torch", "--baseline", str(ROOT))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "check: flex_attention equals the reference on every pattern at T = 512" in out
    assert "causal and window as mask_mods give the baseline's bits, forward and backward" in out
    assert "tile maps, one cell = 32 x 32 scores" in out
    for pattern, tiles in [("causal", "3/4"), ("8 documents", "2/4"), ("prefix-LM", "3/4"), ("window 1024", "3/4"),
                           ("alibi", "3/4"), ("softcap", "3/4")]:  # fmt: skip
        assert re.search(rf"^{re.escape(pattern)}( \*)?\s+{tiles}\s", out, re.MULTILINE), f"row {pattern}"  # * = busy
    for target in ["causal: flex/flash", "8 documents: flex/batch", "alibi: flex/causal flash", "softcap:"]:
        assert target in out
    assert "flash_attention(causal=True), the baseline's:" in out


def test_varlen_times_packed_documents_against_the_batch():
    result = run(SCRIPT, "--varlen", "--tokens", "256", "--heads", "1", "--head-dim", "8", "--repeats", "1")
    assert result.returncode == 0, result.stderr
    for documents in (8, 32):
        assert re.search(
            rf"^{documents}\s+32\s+[0-9.]+\s+[0-9.]+\s+[0-9.]+x \(not judged\)", result.stdout, re.MULTILINE
        )
    assert "judged from --tokens 2048 on" in result.stdout
    assert "tile maps" not in result.stdout  # --varlen times the packed documents only


def test_help_and_bad_arguments():
    assert "Attention patterns as mods" in run(SCRIPT, "--help").stdout
    for args, message in [(["--tokens", "100"], "--tokens must be a multiple of 16"),
                          (["--heads", "0"], "--heads must be at least 1"),
                          (["--baseline", "/nonexistent"], "no tinyattn_np/__init__.py there"),
                          (["--seed", "-1"], "must be an int >= 0")]:  # fmt: skip
        result = run(SCRIPT, *args)
        assert result.returncode == 2 and message in result.stderr, (args, result.stderr)
