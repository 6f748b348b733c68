"""Which tokens each of P processes holds (zigzag and contiguous): shard and unshard undo each other,
the chunks of each rank, and bad input named."""

import numpy as np
import pytest

from tinyattn_np.shards import chunks_of, n_chunks, shard, unshard


def test_zigzag_gives_each_rank_one_early_and_one_late_chunk() -> None:
    tokens = np.arange(8)[:, None]  # (T, 1): each row is its own position
    assert shard(tokens, 0, 2)[:, 0].tolist() == [0, 1, 6, 7]  # chunks 0 and 3 of 4
    assert shard(tokens, 1, 2)[:, 0].tolist() == [2, 3, 4, 5]  # chunks 1 and 2
    assert shard(tokens, 1, 2, layout="contiguous")[:, 0].tolist() == [4, 5, 6, 7]
    assert chunks_of(1, 4) == (1, 6) and chunks_of(1, 4, "contiguous") == (1,)
    assert n_chunks(4) == 8 and n_chunks(4, "contiguous") == 4


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_unshard_undoes_shard(layout: str, size: int, rng: np.random.Generator) -> None:
    x = rng.standard_normal((2, 3, 2 * size * 5, 4))  # (B, H, T, E)
    parts = [shard(x, rank, size, layout=layout) for rank in range(size)]
    assert all(p.shape == (2, 3, 10, 4) for p in parts)
    np.testing.assert_array_equal(unshard(parts, layout=layout), x)


def test_shard_errors_name_what_is_wrong() -> None:
    x = np.zeros((2, 10, 4))
    with pytest.raises(ValueError, match=r"x has 10 tokens .* cannot split into 8 equal chunks; use a multiple of 8"):
        shard(x, 0, 4)
    with pytest.raises(ValueError, match=r"rank must lie in \[0, size\) = \[0, 2\); got 2"):
        shard(x, 2, 2)
    with pytest.raises(ValueError, match="layout must be one of 'zigzag', 'contiguous'; got 'striped'"):
        shard(x, 0, 2, layout="striped")
    with pytest.raises(ValueError, match="at least 2 dims"):
        shard(np.zeros(8), 0, 2)
    with pytest.raises(TypeError, match="size must be a positive int"):
        shard(x, 0, 2.0)  # type: ignore[arg-type]


def test_unshard_errors_name_what_is_wrong() -> None:
    with pytest.raises(TypeError, match="non-empty list"):
        unshard([])
    with pytest.raises(ValueError, match="one shape"):
        unshard([np.zeros((4, 2)), np.zeros((6, 2))])
    with pytest.raises(ValueError, match=r"parts\[0\] has 3 tokens"):
        unshard([np.zeros((3, 2))])
