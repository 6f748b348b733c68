"""A tiny tokenizer and fixed token embeddings, so the demos can run on real words without a trained
model.

tokenize() splits text the way GPT-2's pre-tokenizer does before byte-pair merges (Radford et al. 2019,
the released encoder.py): a word keeps the space in front of it, punctuation stands apart.
    "Holmes examined the telegram."  ->  ['Holmes', ' examined', ' the', ' telegram', '.']
embed() gives each token string one vector that depends only on the string and a seed, so the same
word gets the same vector in every sentence (as a trained embedding table would).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ._checks import ACCEPTED_DTYPES, check_count, check_positive_int

__all__ = ["embed", "token_vector", "tokenize"]

# GPT-2's pattern with \p{L} (letters) and \p{N} (numbers) spelled with the stdlib's re:
# [^\W\d_] is "a word character that is not a digit or underscore", i.e. a letter.
_PRETOKENIZE = re.compile(r"""'(?:[sdmt]|ll|ve|re)| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+""")


def tokenize(text: str) -> list[str]:
    """Split text into word-like tokens; joining them gives the text back exactly."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str; got {type(text).__name__}")
    return _PRETOKENIZE.findall(text)


def token_vector(token: str, dim: int, *, seed: int = 0) -> NDArray[np.float64]:
    """A fixed N(0, 1) vector of size dim for one token string: the same (token, dim, seed) always
    gives the same vector, on any machine (the string is hashed with BLAKE2b, not Python's hash())."""
    if not isinstance(token, str):
        raise TypeError(f"token must be a str; got {type(token).__name__}")
    dim = check_positive_int(dim, "dim")
    seed = check_count(seed, "seed")  # an int >= 0: 1.5 or "1" would hash as a different key than 1
    digest = hashlib.blake2b(token.encode("utf-8"), digest_size=8, key=str(seed).encode()).digest()
    return np.random.default_rng(int.from_bytes(digest, "little")).standard_normal(dim)


def embed(tokens: Sequence[str], dim: int = 256, *, seed: int = 0, dtype: Any = np.float32) -> NDArray[np.floating]:
    """(T, dim) embeddings for T tokens, one fixed vector per distinct token string; dtype float16, 32 or 64."""
    if isinstance(tokens, str):
        raise TypeError("tokens must be a sequence of token strings, not one str: call tokenize() first")
    if not isinstance(tokens, Sequence):
        raise TypeError(f"tokens must be a sequence of token strings (a list); got {type(tokens).__name__}")
    dim = check_positive_int(dim, "dim")
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype must be float16, float32 or float64; got {dtype!r}") from None
    if dtype not in ACCEPTED_DTYPES:  # an int dtype would truncate every N(0, 1) entry to -1, 0 or 1
        raise TypeError(f"dtype must be float16, float32 or float64; got {dtype}")
    table = {token: token_vector(token, dim, seed=seed) for token in set(tokens)}
    return np.array([table[t] for t in tokens], dtype=dtype).reshape(len(tokens), dim)
