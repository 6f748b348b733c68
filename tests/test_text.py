import numpy as np
import pytest

from tinyattn_np import embed, token_vector, tokenize


def test_gpt2_style_pretokenizing():
    assert tokenize("Holmes examined the telegram.") == ["Holmes", " examined", " the", " telegram", "."]
    assert tokenize("I'll pay 221 pounds!!") == ["I", "'ll", " pay", " 221", " pounds", "!!"]
    text = "Watson,  look:\n the  snake_bite?"
    assert "".join(tokenize(text)) == text


def test_same_word_same_vector_across_sentences():
    # a leading space makes both names " Holmes" and " Moriarty" in either order: the same four tokens
    a = embed(tokenize(" Holmes shot Moriarty."), 32)
    b = embed(tokenize(" Moriarty shot Holmes."), 32)
    assert a.shape == (4, 32) and a.dtype == np.float32
    np.testing.assert_array_equal(a[0], b[2])  # " Holmes"
    np.testing.assert_array_equal(a[3], b[3])  # "."
    assert not np.array_equal(a[0], a[1])
    # without it the first word has no space in front: "Holmes" and " Holmes" are different tokens
    assert tokenize("Holmes shot Moriarty.")[0] == "Holmes"


def test_vectors_depend_on_seed_and_are_stable():
    v0 = token_vector(" the", 8, seed=0)
    np.testing.assert_array_equal(v0, token_vector(" the", 8, seed=0))
    assert not np.array_equal(v0, token_vector(" the", 8, seed=1))
    assert not np.array_equal(v0, token_vector("the", 8, seed=0))


def test_bad_input():
    with pytest.raises(TypeError, match="text must be a str"):
        tokenize(b"bytes")
    with pytest.raises(TypeError, match="call tokenize"):
        embed("Holmes", 8)
    with pytest.raises(ValueError, match="dim"):
        embed(["a"], 0)
    assert embed([], 4).shape == (0, 4)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (dict(dtype=np.int32), TypeError, "dtype must be float16, float32 or float64; got int32"),
        (dict(dtype="nonsense"), TypeError, "dtype must be float16, float32 or float64; got 'nonsense'"),
        (dict(seed=1.5), TypeError, "seed must be an int >= 0; got 1.5"),
        (dict(seed=-1), ValueError, "seed must be an int >= 0; got -1"),
        (dict(tokens=None), TypeError, "tokens must be a sequence of token strings"),
        (dict(tokens={"a", "b"}), TypeError, "tokens must be a sequence of token strings .a list.; got set"),
    ],
)
def test_embed_refuses_what_it_would_get_wrong(kwargs, error, message):
    """An int dtype used to truncate every N(0, 1) entry to -1, 0 or 1; a set has no order to embed in."""
    with pytest.raises(error, match=message):
        embed(**{"tokens": ["a", "b"], "dim": 4, **kwargs})
    assert embed(["a"], 4, dtype=np.float16).dtype == np.float16
