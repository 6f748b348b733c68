"""Generation: pick the next token from the logits, append it, repeat; with the caches or by recomputation.

One step, for each sequence:

    z = logits of the last position / temperature          (V,)   temperature 0: the argmax (greedy)
    keep the top_k largest z, then the smallest set of tokens whose probability adds up to top_p
    p = softmax(z) over the kept tokens
    next = the first token whose cumulative probability exceeds u, u ~ uniform[0, 1) from rng

The draw is the inverse of the cumulative distribution, one uniform number a step: the cached and the
recomputing paths, given the same rng, pick the same token unless u falls within rounding of a boundary.

Logits that are not finite: a row with exactly one +inf gives that token for certain (its probability is 1 in
the limit; the row's uniform number is still drawn). A row that holds NaN, or is -inf everywhere, or +inf at
several tokens defines no distribution and is refused with a ValueError that names the row and what it held,
whatever the temperature (torch's multinomial raises on such rows too). A temperature so small that a row's
largest logit over it overflows (to +inf, or to -inf in a row of negative logits) divides the logits less
their row's largest instead: that row's largest is then 0, and the others at most 0.

With the caches (use_cache=True) the prompt runs once (prefill) and each step runs one token through every
layer, attending to the keys and values the caches hold (each KVCache's attend), or, in a gated delta layer,
reading and updating the state its GatedDeltaCache holds. Without them, each step runs the whole sequence again.
Past the model's context both attend to the last `context` keys (gpt.py), so the two agree token for token at
any length.

API:
    sample_next(logits, *, temperature=1.0, top_k=None, top_p=None, rng=None) -> tokens (B,)
    generate(model, prompt, max_new_tokens, *, temperature=1.0, top_k=None, top_p=None, rng=None,
             use_cache=True) -> tokens: prompt followed by max_new_tokens new ones, prompt's shape ((T,) or (B, T))
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from ._checks import check_bool, check_count, check_positive_int, check_rng
from .gpt import GPT

__all__ = ["generate", "sample_next"]


def sample_next(
    logits: Any, *, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None, rng: Any = None
) -> NDArray[np.int64]:
    """The next token of each row of logits (B, V) -> (B,) int64.

    temperature: > 0 divides the logits (below 1 sharpens, above 1 flattens); 0 takes the argmax and draws
    nothing. top_k: keep the k largest logits (ties at the k-th are kept too). top_p in (0, 1]: keep the most
    probable tokens until their probability reaches top_p (nucleus sampling, Holtzman et al. 2020), at least one.
    rng: a Generator or an int seed; one uniform number is drawn per row.
    """
    logits, (temperature, top_k, top_p) = check_logits(logits), check_sampling(temperature, top_k, top_p)
    if temperature == 0.0:
        return logits.argmax(axis=-1)
    rng = check_rng(rng)
    with np.errstate(over="ignore"):  # a finite logit over a tiny temperature may overflow: taken care of here
        z = logits / temperature  # (B, V)
        if not np.isfinite(z.max(axis=-1)).all():  # a row's largest overflowed: shifted first, it is 0
            z = (logits - logits.max(axis=-1, keepdims=True)) / temperature
    if top_k is not None and top_k < z.shape[1]:
        kth = np.partition(z, -top_k, axis=-1)[:, -top_k, None]  # (B, 1): the k-th largest of each row
        z[z < kth] = -np.inf
    probs = np.exp(z - z.max(axis=-1, keepdims=True))  # (B, V)
    probs /= probs.sum(axis=-1, keepdims=True)
    if top_p is not None and top_p < 1.0:
        probs = nucleus(probs, top_p)
    cumulative = np.cumsum(probs, axis=-1)  # (B, V)
    u = rng.random(probs.shape[0]) * cumulative[:, -1]  # (B,): scaled by the total, 1 up to rounding
    picked = [np.searchsorted(row, draw, side="right") for row, draw in zip(cumulative, u, strict=True)]
    return np.minimum(np.array(picked, dtype=np.int64), probs.shape[1] - 1)


def check_logits(logits: Any) -> NDArray[np.float64]:
    """logits as float64 (B, V), V >= 1, each row a distribution: no NaN, some token above -inf, at most one
    +inf; else a ValueError naming the first row that is not. A row with one +inf becomes 0 at that token and
    -inf at every other: the certain token, as every path below (argmax, top-k, top-p, the draw) reads it."""
    logits = np.asarray(logits, dtype=np.float64)  # sampling in float64: the cumulative sum over V stays exact
    if logits.ndim != 2 or logits.shape[1] == 0:
        raise ValueError(f"logits must be (B, V) with V >= 1; got shape {logits.shape}")
    if np.isfinite(logits).all():
        return logits
    certain = np.isposinf(logits)  # (B, V)
    refused = np.isnan(logits).any(axis=-1) | np.isneginf(logits).all(axis=-1) | (certain.sum(axis=-1) > 1)  # (B,)
    if refused.any():
        row = int(np.argmax(refused))
        raise ValueError(f"row {row} of logits {row_problem(logits[row])}: no token can be drawn from it")
    return np.where(certain.any(axis=-1, keepdims=True), np.where(certain, 0.0, -np.inf), logits)  # (B, V)


def row_problem(row: NDArray[np.float64]) -> str:
    """What a row of logits that defines no distribution holds, in words."""
    nan, pos_inf = np.flatnonzero(np.isnan(row)), np.flatnonzero(np.isposinf(row))
    if nan.size:
        where = listed_tokens(nan)
        return f"holds NaN at {nan.size} of its {row.size} tokens ({where}), from a NaN weight or input upstream"
    if pos_inf.size:
        return f"is +inf at {pos_inf.size} tokens ({listed_tokens(pos_inf)}): each is certain, and nothing ranks them"
    return f"is -inf at all {row.size} tokens: every token is impossible"


def listed_tokens(ids: NDArray[np.intp]) -> str:
    """The token ids in words: token 3, or tokens 0, 2 (the first five, then ...)."""
    if ids.size == 1:
        return f"token {ids[0]}"
    return "tokens " + ", ".join(map(str, ids[:5])) + ", ..." * (ids.size > 5)


def nucleus(probs: NDArray[np.float64], top_p: float) -> NDArray[np.float64]:
    """probs (B, V) with every token outside the row's nucleus set to 0: sorted by probability, a token is
    kept while the tokens before it add up to less than top_p (so the most probable one always is)."""
    order = np.argsort(-probs, axis=-1, kind="stable")  # (B, V): most probable first
    sorted_probs = np.take_along_axis(probs, order, axis=-1)  # (B, V)
    before = np.cumsum(sorted_probs, axis=-1) - sorted_probs  # (B, V): the mass ahead of each token
    kept = np.zeros_like(probs)
    np.put_along_axis(kept, order, np.where(before < top_p, sorted_probs, 0.0), axis=-1)
    return kept / kept.sum(axis=-1, keepdims=True)


def check_sampling(temperature: Any, top_k: Any, top_p: Any) -> tuple[float, int | None, float | None]:
    """temperature a finite number >= 0, top_k a positive int or None, top_p in (0, 1] or None."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float, np.floating, np.integer)):
        raise TypeError(f"temperature must be a number; got {temperature!r}")
    if not np.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0: greedy); got {temperature}")
    if top_k is not None:
        top_k = check_positive_int(top_k, "top_k")
    if top_p is not None:
        if isinstance(top_p, bool) or not isinstance(top_p, (int, float, np.floating)) or not 0 < top_p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1]; got {top_p!r}")
        top_p = float(top_p)
    return float(temperature), top_k, top_p


def generate(
    model: GPT,
    prompt: Any,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    rng: Any = None,
    use_cache: bool = True,
) -> NDArray[np.int64]:
    """prompt (T,) or (B, T) token ids followed by max_new_tokens tokens drawn one at a time (sample_next).

    use_cache=True: one cache per layer (model.new_caches), the prompt run once, then one token a step.
    use_cache=False: the whole sequence again at every step. Both give the same tokens for the same rng (greedy:
    always)."""
    if not isinstance(model, GPT):
        raise TypeError(f"model must be a GPT; got {type(model).__name__}")
    tokens = np.asarray(prompt)
    unbatched = tokens.ndim == 1
    tokens = model.check_tokens(tokens[None] if unbatched else tokens, "prompt")  # (B, T0)
    new = check_count(max_new_tokens, "max_new_tokens")
    use_cache = check_bool(use_cache, "use_cache")
    check_sampling(temperature, top_k, top_p)
    rng = check_rng(rng) if temperature != 0 else None
    caches = model.new_caches(tokens.shape[0], tokens.shape[1] + new) if use_cache else None
    step_input = tokens  # what the next forward runs: the prompt, then one token (cache) or all (no cache)
    for step in range(new):
        last = model.hidden(step_input, caches)[:, -1]  # (B, C): the last position only
        logits = last @ model.params["wte"].T  # (B, V)
        try:
            chosen = sample_next(logits, temperature=temperature, top_k=top_k, top_p=top_p, rng=rng)  # (B,)
        except ValueError as err:  # the arguments were checked above: these logits are what is wrong
            raise ValueError(f"generate, new token {step + 1} of {new}: {err}") from None
        tokens = np.concatenate([tokens, chosen[:, None]], axis=1)  # (B, T + 1)
        step_input = chosen[:, None] if use_cache else tokens
    return tokens[0] if unbatched else tokens
