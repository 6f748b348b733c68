"""sampling.py: generation with the caches equals recomputation token for token (greedy and seeded sampling,
past the context too; a GPT of softmax attention alone, and a hybrid one whose gated delta layers decode through
their state), and each sampling rule keeps the tokens it should, drawn with the right frequencies."""

from __future__ import annotations

import numpy as np
import pytest

from tinyattn_np.gpt import GPT, GPTConfig
from tinyattn_np.sampling import generate, sample_next


@pytest.fixture(scope="module", params=[None, "LLA"], ids=["softmax attention", "hybrid LLA"])
def model(request) -> GPT:
    config = GPTConfig(
        vocab=13, context=8, layers=3 if request.param else 2, heads=2, width=16, bias=True, layer_pattern=request.param
    )
    model = GPT(config, rng=4)
    model.params["wte"] *= 20  # sharper logits than at initialisation, so that the tokens vary
    return model


@pytest.mark.parametrize(
    "sampling",
    [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.8, top_k=4), dict(top_p=0.7)],
    ids=["greedy", "temperature 1", "top-k", "top-p"],
)
def test_cached_generation_equals_recomputation(model, sampling):
    """20 new tokens after a 3-token prompt: past the context of 8, where both attend to a window."""
    prompt = np.array([[1, 5, 2], [7, 7, 0]])
    cached = generate(model, prompt, 20, rng=11, use_cache=True, **sampling)
    recomputed = generate(model, prompt, 20, rng=11, use_cache=False, **sampling)
    assert cached.shape == (2, 23)
    np.testing.assert_array_equal(cached, recomputed)
    np.testing.assert_array_equal(cached[:, :3], prompt)
    assert len(np.unique(cached[:, 3:])) > 1  # the test would not see a wrong token if every token were one


def test_a_prompt_longer_than_the_context_is_continued_the_same_way(model):
    prompt = np.arange(11) % 13  # context 8: the prefill itself runs through the window
    for sampling in (dict(temperature=0.0), dict(temperature=1.0, top_k=5)):
        cached = generate(model, prompt, 6, rng=3, use_cache=True, **sampling)
        np.testing.assert_array_equal(cached, generate(model, prompt, 6, rng=3, use_cache=False, **sampling))


def test_a_seed_gives_the_same_tokens_and_another_seed_others(model):
    first = generate(model, [3, 1], 30, rng=1)
    np.testing.assert_array_equal(first, generate(model, [3, 1], 30, rng=1))
    assert not np.array_equal(first, generate(model, [3, 1], 30, rng=2))
    assert first.shape == (32,)


def test_no_new_tokens_gives_the_prompt(model):
    np.testing.assert_array_equal(generate(model, [4, 2], 0), [4, 2])


def test_greedy_takes_the_argmax():
    logits = np.array([[0.1, 3.0, -1.0], [2.0, 0.0, 1.0]])
    np.testing.assert_array_equal(sample_next(logits, temperature=0.0), [1, 0])
    np.testing.assert_array_equal(sample_next(logits, top_k=1, rng=0), [1, 0])


def test_draws_follow_the_softmax():
    logits = np.log(np.array([[0.5, 0.3, 0.2]]))
    rng = np.random.default_rng(0)
    draws = np.array([sample_next(logits, rng=rng)[0] for _ in range(20_000)])
    # 20,000 draws: the standard error of a frequency is at most 0.0036
    np.testing.assert_allclose(np.bincount(draws, minlength=3) / draws.size, [0.5, 0.3, 0.2], atol=0.015)


def test_temperature_flattens_and_sharpens():
    logits = np.log(np.array([[0.8, 0.2]]))
    rng = np.random.default_rng(1)
    hot = np.mean([sample_next(logits, temperature=100.0, rng=rng)[0] for _ in range(4000)])
    cold = np.mean([sample_next(logits, temperature=0.25, rng=rng)[0] for _ in range(4000)])
    assert 0.45 < hot < 0.55  # almost uniform
    assert cold < 0.01  # 0.2⁴ / (0.8⁴ + 0.2⁴) = 0.004


def test_top_k_and_top_p_keep_their_tokens_only():
    probs = np.array([[0.05, 0.4, 0.1, 0.3, 0.15]])
    rng = np.random.default_rng(2)
    top_k = {int(sample_next(np.log(probs), top_k=2, rng=rng)[0]) for _ in range(500)}
    assert top_k == {1, 3}
    # 0.4 + 0.3 = 0.7 < 0.75, so the nucleus needs the third most probable (0.15) too
    top_p = {int(sample_next(np.log(probs), top_p=0.75, rng=rng)[0]) for _ in range(500)}
    assert top_p == {1, 3, 4}
    assert {int(sample_next(np.log(probs), top_p=0.01, rng=rng)[0]) for _ in range(50)} == {1}


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(temperature=-1.0), ValueError, "temperature must be a finite number >= 0"),
        (dict(temperature="hot"), TypeError, "temperature must be a number"),
        (dict(top_k=0), ValueError, "top_k must be a positive int"),
        (dict(top_p=0.0), ValueError, "top_p must be a number in \\(0, 1\\]"),
        (dict(top_p=1.5), ValueError, "top_p must be a number in \\(0, 1\\]"),
    ],
)
def test_bad_sampling_arguments_are_refused_by_name(model, kwargs, error, match):
    with pytest.raises(error, match=match):
        generate(model, [1], 3, **kwargs)
    with pytest.raises(error, match=match):
        sample_next(np.zeros((1, 4)), **kwargs)


def test_bad_prompts_and_counts_are_refused_by_name(model):
    with pytest.raises(ValueError, match="prompt holds token 13, outside the vocabulary"):
        generate(model, [13], 2)
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 0"):
        generate(model, [1], -1)
    with pytest.raises(TypeError, match="model must be a GPT"):
        generate("model", [1], 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="logits must be \\(B, V\\)"):
        sample_next(np.zeros(4))


# --- logits that are not finite ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "sampling", [dict(temperature=0.0), dict(), dict(top_k=2), dict(top_p=0.5)], ids=["greedy", "t=1", "top-k", "top-p"]
)
@pytest.mark.parametrize(
    ("row", "match"),
    [
        ([-np.inf, -np.inf, -np.inf, -np.inf], "row 1 of logits is -inf at all 4 tokens"),
        ([np.nan, np.nan, np.nan, np.nan], "row 1 of logits holds NaN at 4 of its 4 tokens"),
        ([0.0, np.nan, 2.0, 1.0], "row 1 of logits holds NaN at 1 of its 4 tokens \\(token 1\\)"),
        ([np.inf, 0.0, np.inf, 1.0], "row 1 of logits is \\+inf at 2 tokens \\(tokens 0, 2\\)"),
    ],
    ids=["all -inf", "all NaN", "one NaN", "two +inf"],
)
def test_a_row_that_gives_no_distribution_is_refused_by_its_number(row, match, sampling):
    """torch's multinomial raises on such a row; a token drawn from it would be a number's accident."""
    logits = np.array([[0.0, 1.0, 2.0, 3.0], row])
    with pytest.raises(ValueError, match=match):
        sample_next(logits, rng=0, **sampling)


@pytest.mark.parametrize(
    "sampling",
    [dict(temperature=0.0), dict(), dict(temperature=5.0, top_k=3), dict(top_p=0.01), dict(top_k=1, top_p=0.9)],
)
def test_one_inf_logit_is_the_certain_token(sampling):
    """exp(+inf) outweighs every finite logit: the token's probability is 1, whatever the temperature or filter."""
    logits = np.array([[5.0, 4.0, np.inf, 4.5, -np.inf], [np.inf, 9.0, 9.0, -np.inf, 0.0]])
    rng = np.random.default_rng(0)
    for _ in range(50):
        np.testing.assert_array_equal(sample_next(logits, rng=rng, **sampling), [2, 0])


@pytest.mark.parametrize("temperature", [1e-300, 1e-308, 5e-324])
def test_a_tiny_temperature_is_the_argmax_not_an_overflow(temperature):
    """logits / 1e-308 overflows to +inf at several tokens, or to -inf at every one of a row of negative logits;
    the draw is taken of the shifted logits, whose largest is 0: the largest logit's token, as temperature 0 gives."""
    logits = np.array([[10.0, 9.0, 10.5, -3.0], [2.0, 1.0, 0.0, 1.9], [-10.0, -20.0, -9.5, -15.0]])
    for seed in range(20):
        np.testing.assert_array_equal(sample_next(logits, temperature=temperature, rng=seed), [2, 0, 2])


def test_generate_refuses_a_model_whose_logits_are_nan_and_says_which_token(model):
    broken = GPT(model.config, model.params)
    broken.params["h.1.mlp.w_proj"][0, 0] = np.nan
    for sampling in (dict(temperature=0.0), dict(temperature=1.0, top_k=3)):
        with pytest.raises(ValueError, match="new token 1 of 5: row 0 of logits holds NaN at 13 of its 13 tokens"):
            generate(broken, [1, 2], 5, rng=0, **sampling)
