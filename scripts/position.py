"""Attention cannot read word order until position is added; RoPE adds it as a rotation.

What it shows, in numbered sections:
  1) the shuffle test: without a mask and without position, shuffling the tokens shuffles the outputs
     the same way and changes nothing else
  2) "Holmes shot Moriarty." vs "Moriarty shot Holmes.": the final '.' gets the same vector from both
     without position (difference 0 up to rounding), and different vectors with RoPE
  3) RoPE scores depend only on the distance: the same q and k placed 7 apart at (10, 3), (110, 103) and
     (507, 500) give one score; 1 apart at (10, 9) gives another
  4) RoPE is a rotation: it leaves the length of every vector unchanged
  5) a learned position table has a fixed number of rows and refuses a position past its end

Run:  python scripts/position.py [--seed 0] [--format simple]
Every claim above is checked in code; the exit code is 1 (and the failed checks are named) if one fails.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from tinyattn_np import LearnedPositions, attention, embed, rope, tokenize
from tinyattn_np.report import Checklist, add_seed_and_format, table

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the modules this script shares sit beside it
import interrupts

D_MODEL, D_HEAD = 256, 64
SHUFFLE = [3, 0, 4, 1, 2]  # token i of the shuffled sentence is token SHUFFLE[i] of the original

check = Checklist()  # every claim the script prints is checked; main() returns check.finish()


def attend(
    x: np.ndarray, wq: np.ndarray, wk: np.ndarray, wv: np.ndarray, *, causal: bool, use_rope: bool
) -> np.ndarray:
    """One head: x (T, d_model) -> (T, d_head). With use_rope, q and k (never v) are rotated by position."""
    q, k, v = x @ wq, x @ wk, x @ wv  # (T, d_head) each
    if use_rope:
        q, k = rope(q), rope(k)  # token t turned by the angles t·θ_i; v carries content and stays put
    return attention(q, k, v, causal=causal)  # (T, d_head)


def shuffle_demo(weights: tuple[np.ndarray, ...], seed: int) -> None:
    sentence = "Holmes examined the telegram."
    print(f"1) shuffle test on {sentence!r}: no mask, no position")
    tokens = tokenize(sentence)
    x = embed(tokens, D_MODEL, seed=seed)  # (5, 256)
    out = attend(x, *weights, causal=False, use_rope=False)  # (5, 64)
    out_shuffled = attend(x[SHUFFLE], *weights, causal=False, use_rope=False)  # (5, 64), rows in shuffled order
    print(f"   tokens in:  {[tokens[i] for i in SHUFFLE]} (shuffle {SHUFFLE})")
    diff = float(np.abs(out[SHUFFLE] - out_shuffled).max())
    print(f"   shuffle {SHUFFLE} in -> same shuffle out: max |out[shuffle] - out(shuffled)| = {diff:.1e}")
    same = bool(np.allclose(out[SHUFFLE], out_shuffled, atol=1e-6))
    check(same, "no mask, no position: shuffle in, same shuffle out")

    # with the causal mask, token t sees t + 1 tokens: the count leaks a little order, so the test fails
    masked = attend(x, *weights, causal=True, use_rope=False)[SHUFFLE]
    masked_shuffled = attend(x[SHUFFLE], *weights, causal=True, use_rope=False)
    print(
        f"   with the causal mask the same test differs by {np.abs(masked - masked_shuffled).max():.3f}:"
        " each position sees a different number of tokens"
    )


def final_token(sentence: str, weights: tuple[np.ndarray, ...], seed: int, use_rope: bool) -> np.ndarray:
    x = embed(tokenize(sentence), D_MODEL, seed=seed)  # (T, 256)
    return attend(x, *weights, causal=True, use_rope=use_rope)[-1]  # (64,): the output at '.'


def who_shot_whom_demo(weights: tuple[np.ndarray, ...], seed: int) -> None:
    # A leading space on both: 'Holmes' at the start of a text and ' Holmes' after a space are different
    # tokens (GPT-2 keeps the space with the word), and the test needs the same four tokens in both.
    a, b = " Holmes shot Moriarty.", " Moriarty shot Holmes."
    print(f"\n2) {a.strip()!r} vs {b.strip()!r}: the final '.' (causal mask, one head)")
    print(f"   tokens: {tokenize(a)} vs {tokenize(b)}")
    plain = float(np.abs(final_token(a, weights, seed, False) - final_token(b, weights, seed, False)).max())
    rotary = float(np.abs(final_token(a, weights, seed, True) - final_token(b, weights, seed, True)).max())
    print(f"   no position: max difference in the final '.' vector = {plain:.6f} ({plain:.1e})")
    print(f"   RoPE:        max difference in the final '.' vector = {rotary:.6f}")
    print("   the last token sees every token, and a weighted sum does not care about their order;")
    print("   RoPE makes the scores depend on where each token sits, so the two sentences come apart")
    check(plain < 1e-6, "without position the final '.' is the same for both sentences")
    check(rotary > 1e-3, "with RoPE the final '.' differs between the two sentences")


def rope_score(q: np.ndarray, k: np.ndarray, m: int, n: int) -> float:
    """The scaled score of q at position m against k at position n, after RoPE. q, k (d,)."""
    q_m = rope(q[None], positions=[m])[0]  # (d,)
    k_n = rope(k[None], positions=[n])[0]  # (d,)
    return float(q_m @ k_n / np.sqrt(q.shape[-1]))


def relative_demo(rng: np.random.Generator, fmt: str) -> None:
    print(f"\n3) RoPE score of one q and one k (d={D_HEAD}, float64) planted at different positions")
    q, k = rng.standard_normal((2, D_HEAD))  # (64,) each
    pairs = [(10, 3), (110, 103), (507, 500), (10, 9)]
    scores = [rope_score(q, k, m, n) for m, n in pairs]
    rows = [[f"({m}, {n})", m - n, s] for (m, n), s in zip(pairs, scores, strict=True)]
    print(table(rows, ["positions (q, k)", "distance", "score q·k/√d"], fmt=fmt, floatfmt=".6f"))
    seven_apart, one_apart = scores[:3], scores[3]
    spread = max(seven_apart) - min(seven_apart)
    print(f"   7 apart: the three scores differ by at most {spread:.1e}; 1 apart: {one_apart:.4f}")
    print("   a rotation by mθ dotted with one by nθ leaves only (m - n)θ: the score sees the distance")
    check(spread < 1e-9, "RoPE scores 7 apart at (10,3), (110,103), (507,500) are equal")
    check(abs(one_apart - seven_apart[0]) > 1e-3, "the RoPE score 1 apart at (10,9) is a different one")


def norm_demo(rng: np.random.Generator, fmt: str) -> None:
    T = 4096
    print(f"\n4) RoPE keeps lengths: {T} random vectors of {D_HEAD} (float32) at positions 0 .. {T - 1}")
    x = rng.standard_normal((T, D_HEAD)).astype(np.float32)  # (4096, 64)
    rows = []
    for interleaved, name in ((True, "interleaved pairs (2i, 2i+1)"), (False, "half-split pairs (i, i+d/2)")):
        rotated = rope(x, interleaved=interleaved)  # (4096, 64)
        before, after = np.linalg.norm(x, axis=-1), np.linalg.norm(rotated, axis=-1)  # (4096,) each
        change = float(np.max(np.abs(after - before) / before))
        rows.append([name, change])
        check(change < 1e-5, f"RoPE ({name}) preserves every vector's norm")
    print(table(rows, ["convention", "max relative change of |x|"], fmt=fmt, floatfmt=".1e"))


def learned_demo(rng: np.random.Generator) -> None:
    n_rows = 1024
    print(f"\n5) learned absolute positions: a table of {n_rows} rows x {D_HEAD}")
    positions = LearnedPositions(n_rows, D_HEAD, rng=rng)
    print(f"   positions 0 .. {n_rows - 1} -> {positions(np.arange(n_rows)).shape}")
    try:
        positions(np.array([n_rows]))
    except ValueError as err:
        print(f"   position {n_rows}: ValueError: {err}")
    else:
        check(False, f"LearnedPositions({n_rows}, ...) refuses position {n_rows}")
    far = rope(rng.standard_normal((1, D_HEAD)), positions=[100_000])  # (1, 64)
    print(f"   RoPE has no table: position 100,000 is just another angle -> {far.shape}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Attention is blind to word order (the shuffle test, 'Holmes shot Moriarty.' vs "
        "'Moriarty shot Holmes.') until position is added; RoPE scores depend only on distance and keep "
        "norms; a learned table refuses positions past its end. Every claim is checked (exit 1 if one fails).",
    )
    add_seed_and_format(parser, "the random weights and vectors")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    # one random head shared by sections 1 and 2; 1/√d_model keeps q, k, v near unit variance
    weights = tuple((rng.standard_normal((D_MODEL, D_HEAD)) / np.sqrt(D_MODEL)).astype(np.float32) for _ in range(3))

    shuffle_demo(weights, args.seed)
    who_shot_whom_demo(weights, args.seed)
    relative_demo(rng, args.format)
    norm_demo(rng, args.format)
    learned_demo(rng)

    return check.finish()


if __name__ == "__main__":
    sys.exit(interrupts.run_main(main))
