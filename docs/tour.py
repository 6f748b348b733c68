# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # A tour of tinyattn_np
#
# Attention in NumPy, from one head to decoding with a KV cache, with pictures where a picture says more
# than a table: one head and its weights, the causal mask in its two alignments, multi-head attention,
# RoPE, flash attention and the tiles it skips, time and memory as T doubles, the gradients by hand and
# a training run, and generation with a cache. It runs in under ten seconds on two cores.
#
# `docs/tour.py` is this notebook as a plain script (jupytext's percent format): edit either, then
# `jupytext --sync docs/tour.py` brings the other along. To run it: `pip install -e ".[notebook]"` (Jupyter
# itself, and what runs the tour as a test), then `jupyter notebook docs/tour.ipynb`, or
# `pytest --nbmake docs/tour.ipynb` as CI does. The pages of `docs/` teach each topic in full, `docs/results/`
# has the measured tables, and the README has the reading order of the code.

# %%
import inspect
import time
import tracemalloc
from functools import partial

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.ticker import NullLocator
from threadpoolctl import threadpool_limits

from tinyattn_np import (
    KVCache,
    MultiHeadAttention,
    attention,
    attention_backward,
    causal_mask,
    draw_tile_plan,
    embed,
    flash_attention,
    flash_attention_backward,
    flash_attention_one_head,
    flash_decode,
    one_head,
    rope,
    score_matrix_bytes,
    tile_plan,
    tokenize,
    window_mask,
)

plt.rcParams.update({"figure.dpi": 100, "font.size": 10})
rng = np.random.default_rng(0)

# %% [markdown]
# ## 1. One head
#
# $\mathrm{softmax}(QK^\top/\sqrt{d})\,V$ for a single head, each step on its own line in `head.py`:
# q, k and v are three projections of the same tokens, the scores say how much each token looks at each
# other one, and the causal mask hides the future. The embeddings and weights are random and untrained:
# the picture shows the mechanics, not meaning.

# %%
tokens = tokenize("Holmes examined the telegram.")
x = embed(tokens, 64)  # (T, d_model): one fixed random vector per token
wq, wk, wv = (rng.standard_normal((64, 16), dtype=np.float32) / 8 for _ in range(3))  # (d_model, d_head)
out, weights = one_head(x, wq, wk, wv)  # out (T, d_head), weights (T, T), causal
print(tokens, x.shape, "->", out.shape)
print("rows sum to", weights.sum(axis=1))
print("one_head == attention():", np.allclose(out, attention(x @ wq, x @ wk, x @ wv, causal=True)))

fig, ax = plt.subplots(figsize=(4.5, 3.8))
image = ax.imshow(weights, cmap="viridis", vmin=0, vmax=1)
ax.set_xticks(range(len(tokens)), [repr(t) for t in tokens], rotation=45, ha="right")
ax.set_yticks(range(len(tokens)), [repr(t) for t in tokens])
ax.set_xlabel("key (the token looked at)")
ax.set_ylabel("query (the token looking)")
ax.set_title("attention weights of one head (random weights)")
fig.colorbar(image, ax=ax)
plt.show()

# %% [markdown]
# ## 2. Masks: two causal alignments and a window
#
# With L queries and S keys, "causal" can mean two things when L != S. Our functions align the mask
# bottom-right (the newest query sees every key: what decoding with a cache needs); torch's
# `is_causal=True` aligns it top-left. A sliding window keeps only the last w keys.

# %%
print("bottom-right, L=2, S=5: attention(causal=True)")
print(causal_mask(2, 5).astype(int))
print("top-left, L=2, S=5: torch's is_causal=True")
print(causal_mask(2, 5, align="top_left").astype(int))
print("causal window of 3 keys, L=S=6")
print(window_mask(6, window=3).astype(int))

# %% [markdown]
# ## 3. Multi-head attention
#
# One matmul makes q, k and v of every head (`w_qkv`, columns `[q heads | k heads | v heads]`); with
# grouped-query attention several query heads share one kv head, so `w_qkv` is narrower and the KV cache
# smaller. `fused=True` runs flash attention, `fused=False` the reference: the same result.

# %%
mha = MultiHeadAttention(64, 8, 2, rope=True, rng=0)  # d_model 64: 8 query heads of 8 over 2 kv heads
x_batch = rng.standard_normal((2, 10, 64), dtype=np.float32)  # (B, T, C)
y_fused, y_reference = mha(x_batch), mha(x_batch, fused=False)
print("w_qkv", mha.w_qkv.shape, "w_out", mha.w_out.shape, "parameters", mha.num_parameters)
print("output", y_fused.shape, "max |fused - reference| =", float(np.abs(y_fused - y_reference).max()))

# %% [markdown]
# ## 4. RoPE: the score sees the distance
#
# RoPE turns each pair of channels of q and k by an angle proportional to the position, so the score of
# a query at m and a key at n depends on m - n only. The same q and k planted at many positions: the
# score is a function of the distance alone, the same curve wherever the pair sits.

# %%
q_vec, k_vec = rng.standard_normal((2, 1, 64))  # one query and one key, d = 64
distances = np.arange(0, 200)


def rope_score(m: np.ndarray, n: np.ndarray) -> np.ndarray:
    """q at positions m against k at positions n, pair by pair."""
    q_at = rope(np.repeat(q_vec, len(m), axis=0), positions=m)  # (len(m), 64)
    k_at = rope(np.repeat(k_vec, len(n), axis=0), positions=n)
    return (q_at * k_at).sum(axis=1) / 8


fig, ax = plt.subplots(figsize=(6, 3))
for start, style in ((0, dict(linewidth=5, alpha=0.4)), (1000, dict(linewidth=2)), (5000, dict(linestyle=":"))):
    scores = rope_score(start + distances, np.full(len(distances), start))
    ax.plot(distances, scores, label=f"key at {start}", **style)
ax.set_xlabel("distance m - n (tokens)")
ax.set_ylabel("score q·k / √d")
ax.set_title("RoPE: three positions, one curve (the lines lie on each other)")
ax.legend()
plt.show()

# %% [markdown]
# ## 5. Flash attention and its tiles
#
# Flash attention walks the score matrix in tiles and keeps a running max m, sum l and output o for each
# query (the online softmax), so it never holds L x S numbers. When a tile raises a row's max from m to
# m', what the row summed so far is rescaled by $e^{m - m'}$ before the tile is added; at the end
# out = o / l. First the algorithm itself, FlashAttention-2's Algorithm 1 for one head with a line per
# equation of the paper (`flash_attention_one_head`, derived step by step on `docs/online_softmax.md`),
# on 6 queries and 8 keys in 2 x 3 tiles: under the causal mask it skips the tiles past the diagonal.

# %%
small = np.random.default_rng(1)
q1, k1, v1 = (small.standard_normal((n, 16)) for n in (6, 8, 8))  # one head, float64: (L, E), (S, E), (S, Ev)
out1, lse1 = flash_attention_one_head(q1, k1, v1, causal=True, block_q=2, block_k=3)
print(draw_tile_plan(tile_plan(6, 8, 2, 3, causal=True)))  # '#' whole, '\' with the diagonal, '.' skipped
print("max |plain path - reference| =", float(np.abs(out1 - attention(q1, k1, v1, causal=True)).max()))
print(inspect.getsource(flash_attention_one_head))

# %% [markdown]
# `flash_attention` is the same algorithm, fast: the query heads of several kv heads share each tile
# step (one batched matmul), and worker threads take whole query blocks. Under the causal mask the tiles
# above the diagonal are skipped; under a sliding window, the tiles behind the band too. `tile_plan`
# lists the tiles that run.

# %%
print(
    "the fast path on the same head: max |flash - plain| =",
    float(np.abs(flash_attention(q1, k1, v1, causal=True) - out1).max()),
)
q = rng.standard_normal((4, 1024, 64), dtype=np.float32)  # (H, T, E)
k = rng.standard_normal((4, 1024, 64), dtype=np.float32)
v = rng.standard_normal((4, 1024, 64), dtype=np.float32)
print(
    "max |flash - reference| =",
    float(np.abs(flash_attention(q, k, v, causal=True) - attention(q, k, v, causal=True)).max()),
)
print(draw_tile_plan(tile_plan(1024, 1024, 128, 128, causal=True)))


def tile_grid(n: int, block: int, **mask: object) -> np.ndarray:
    """0 skipped, 1 a tile with a mask edge (diagonal), 2 a full tile."""
    grid = np.zeros((n // block, n // block))
    for tile in tile_plan(n, n, block, block, **mask):
        grid[tile.q_start // block, tile.k_start // block] = 2 if tile.kind == "full" else 1
    return grid


fig, axes = plt.subplots(1, 2, figsize=(8, 4))
for ax, (title, mask) in zip(
    axes,
    [("causal", {"causal": True}), ("causal, window of 1,024 keys", {"causal": True, "window": 1024})],
    strict=True,
):
    grid = tile_grid(4096, 256, **mask)
    ax.imshow(grid, cmap="Greys", vmin=0, vmax=2.5)
    ax.set_title(f"{title}: {int((grid > 0).sum())} of {grid.size} tiles run")
    ax.set_xlabel("key tile")
    ax.set_ylabel("query tile")
fig.suptitle("T = 4,096 in 256 x 256 tiles: black runs whole, grey has a mask edge, white is skipped")
plt.show()

# %% [markdown]
# ## 6. Time and memory as T doubles
#
# The reference builds the (H, T, T) scores: its memory grows 4x per doubling of T. Flash's grows
# linearly. Both still do T² arithmetic, so their time grows towards 4x per doubling. Measured here,
# now, on whatever machine runs this notebook, on one core each (`scripts/scaling.py` prints the full
# table, on every core).


# %%
def best_seconds(fn, repeats: int = 5) -> float:
    """The fastest of a few runs after a warm-up: the least disturbed by whatever else the machine does."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def traced_peak_bytes(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


sizes = [256, 512, 1024, 2048, 4096]
rows = []
with threadpool_limits(1):  # one core for each path: the picture shows the algorithms, not the threads
    for T in sizes:
        q, k, v = (rng.standard_normal((4, T, 64), dtype=np.float32) for _ in range(3))  # 4 heads of 64
        reference = partial(attention, q, k, v, causal=True)
        flash = partial(flash_attention, q, k, v, causal=True, workers=1)
        ms = (best_seconds(reference) * 1e3, best_seconds(flash) * 1e3)
        mib = (traced_peak_bytes(reference) / 2**20, traced_peak_bytes(flash) / 2**20)
        rows.append((*ms, *mib))
        print(f"T={T:5d}  reference {ms[0]:6.1f} ms {mib[0]:6.1f} MiB   flash {ms[1]:6.1f} ms {mib[1]:4.1f} MiB")
rows = np.array(rows)

fig, (ax_time, ax_memory) = plt.subplots(1, 2, figsize=(9, 3.6))
ax_time.loglog(sizes, rows[:, 0], "o-", label="attention() (reference)")
ax_time.loglog(sizes, rows[:, 1], "o-", label="flash_attention()")
ax_time.loglog(sizes, rows[-1, 0] * (np.array(sizes) / sizes[-1]) ** 2, "k:", label="∝ T²")
ax_time.set_ylabel("time (ms), best of 5")
ax_memory.loglog(sizes, rows[:, 2], "o-", label="attention() (reference)")
ax_memory.loglog(sizes, rows[:, 3], "o-", label="flash_attention()")
ax_memory.loglog(
    sizes, [score_matrix_bytes(T, heads=4, dtype="fp32") / 2**20 for T in sizes], "k:", label="score matrix"
)
ax_memory.set_ylabel("traced peak (MiB)")
for ax in (ax_time, ax_memory):
    ax.set_xticks(sizes, [str(T) for T in sizes])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("tokens T")
    ax.legend()
fig.suptitle("4 heads of 64, float32, causal, one core")
plt.show()

# %% [markdown]
# ## 7. The backward, by hand
#
# No autograd: `backward.py` writes each gradient out. Given dO, with P the softmax weights:
# dV = Pᵀ dO, dP = dO Vᵀ, dS = P ∘ (dP − rowsum(dO ∘ O)), dQ = scale · dS K, dK = scale · dSᵀ Q.
# Flash's backward (FlashAttention-2's Algorithm 2) recomputes P tile by tile from the forward's
# logsumexp instead of keeping it. Both are checked here against a central difference.

# %%
q, k, v, dout = (rng.standard_normal((2, 64, 16)) for _ in range(4))  # float64 for the check
out, lse = flash_attention(q, k, v, causal=True, return_lse=True)
dq, dk, dv = flash_attention_backward(q, k, v, out, dout, lse, causal=True)
gold = attention_backward(q, k, v, dout, causal=True)
print(
    "max |flash backward - reference backward| =",
    max(float(np.abs(a - b).max()) for a, b in zip((dq, dk, dv), gold, strict=True)),
)

eps = 1e-6  # loss = sum(out · dout); nudge one entry of k both ways
k_up, k_down = k.copy(), k.copy()
k_up[1, 5, 3] += eps
k_down[1, 5, 3] -= eps
numeric = ((attention(q, k_up, v, causal=True) - attention(q, k_down, v, causal=True)) * dout).sum() / (2 * eps)
print(f"dK[1, 5, 3]: by hand {dk[1, 5, 3]:.8f}, central difference {numeric:.8f}")

# %% [markdown]
# ## 8. A model that learns
#
# The smallest task that needs attention: 8 random tokens, then the same 8 again. In the second copy
# the next token is the one 7 positions back, and no single token says which it is: only attention to the
# right earlier position can. The model is token embeddings (no position table), one
# `MultiHeadAttention` with RoPE and a residual, and an output projection; the loss is cross-entropy over
# the second copy. `MultiHeadAttention.forward` returns what its `backward` needs (`fused=True` would
# run flash attention and its backward: the same gradients, but at 16 tokens the reference path is
# faster); Adam is written out below (Kingma & Ba 2015). `scripts/train.py --task copy` trains the same
# model with every option (`scripts/copy_task.py`, `scripts/copy_model.py`).

# %%
VOCAB, LENGTH, D_MODEL = 12, 8, 32
model_rng = np.random.default_rng(1)
layer = MultiHeadAttention(D_MODEL, 2, rope=True, rng=model_rng)
params = {
    "embed": model_rng.standard_normal((VOCAB, D_MODEL)).astype(np.float32),  # (V, C)
    "w_qkv": layer.w_qkv,  # the layer's own arrays: updating them in place trains the layer
    "w_out": layer.w_out,
    "w_head": model_rng.uniform(-0.2, 0.2, (D_MODEL, VOCAB)).astype(np.float32),  # (C, V)
}
scored = np.arange(LENGTH, 2 * LENGTH - 1)  # positions of the second copy whose next token is known


def batch_of(n: int) -> np.ndarray:
    first = model_rng.integers(0, VOCAB, (n, LENGTH))
    return np.concatenate([first, first], axis=1)  # (n, 2·LENGTH)


def forward(tokens: np.ndarray) -> tuple[np.ndarray, object, np.ndarray, np.ndarray]:
    """h (B, T, C) after the layer, what its backward needs, the probabilities (B, P, V), the targets (B, P)."""
    h = params["embed"][tokens]  # (B, T, C)
    attended, saved = layer.forward(h, fused=False)  # causal; at 16 tokens the reference is the faster path
    h = h + attended  # the residual
    logits = h[:, scored] @ params["w_head"]  # (B, P, V)
    logits -= logits.max(axis=-1, keepdims=True)  # softmax without overflow
    probs = np.exp(logits) / np.exp(logits).sum(axis=-1, keepdims=True)
    return h, saved, probs, tokens[:, scored + 1]


def evaluate(tokens: np.ndarray) -> tuple[float, float]:
    """Cross-entropy and accuracy of the most likely next token, over the scored positions."""
    _, _, probs, targets = forward(tokens)
    picked = np.take_along_axis(probs, targets[..., None], axis=-1)
    return float(-np.log(picked).mean()), float((probs.argmax(axis=-1) == targets).mean())


def loss_and_grads(tokens: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
    """The cross-entropy, and the gradient of every parameter: the forward's lines in reverse."""
    h, saved, probs, targets = forward(tokens)
    picked = np.take_along_axis(probs, targets[..., None], axis=-1)  # (B, P, 1)
    dlogits = probs.copy()
    np.put_along_axis(dlogits, targets[..., None], picked - 1, axis=-1)
    dlogits /= targets.size  # d loss / d logits = (softmax - one_hot) / n
    grads = {"w_head": np.einsum("bpc,bpv->cv", h[:, scored], dlogits)}
    dh = np.zeros_like(h)
    dh[:, scored] = dlogits @ params["w_head"].T
    dx, grads["w_qkv"], grads["w_out"] = layer.backward(dh, saved)
    grads["embed"] = np.zeros_like(params["embed"])
    np.add.at(grads["embed"], tokens, dh + dx)  # the residual carries dh past the layer
    return float(-np.log(picked).mean()), grads


moments = {name: (np.zeros_like(w), np.zeros_like(w)) for name, w in params.items()}
lr, beta1, beta2, history = 0.01, 0.9, 0.999, []
held_out = batch_of(256)
started = time.perf_counter()
# one BLAS thread: these matrices are tiny, and handing each product to a second thread costs more
# than the product (many times more when the machine is busy)
with threadpool_limits(1):
    for step in range(1, 301):
        loss, grads = loss_and_grads(batch_of(32))
        for name, w in params.items():  # Adam: running means of g and g², corrected for their zero start
            m, s = moments[name]
            m[:] = beta1 * m + (1 - beta1) * grads[name]
            s[:] = beta2 * s + (1 - beta2) * grads[name] ** 2
            w -= lr * (m / (1 - beta1**step)) / (np.sqrt(s / (1 - beta2**step)) + 1e-8)
        if step % 10 == 0:
            history.append((step, loss, *evaluate(held_out)))
seconds, accuracy = time.perf_counter() - started, history[-1][3]
print(f"300 steps in {seconds:.1f} s; held-out accuracy {accuracy:.0%} (chance {1 / VOCAB:.0%})")

steps, train_loss, held_loss, held_accuracy = np.array(history).T
fig, (ax_loss, ax_accuracy) = plt.subplots(1, 2, figsize=(9, 3.2))
ax_loss.plot(steps, train_loss, label="train batch")
ax_loss.plot(steps, held_loss, label="held out")
ax_loss.set_ylabel("cross-entropy")
ax_loss.legend()
ax_accuracy.plot(steps, held_accuracy)
ax_accuracy.axhline(1 / VOCAB, color="grey", linestyle=":", label="chance")
ax_accuracy.set_ylabel("held-out accuracy")
ax_accuracy.legend()
for ax in (ax_loss, ax_accuracy):
    ax.set_xlabel("Adam step")
fig.suptitle("the training curve")
plt.show()

# %% [markdown]
# What did it learn? The attention weights of one held-out sequence: in the second copy each query looks
# at the token after its own first occurrence, 7 back (the red dashes run just left of those keys).

# %%
sequence = held_out[:1]  # (1, T)
q, k, v = layer.split_heads(params["embed"][sequence])  # as the layer sees them, turned by RoPE
_, trained_weights = attention(q, k, v, causal=True, return_weights=True)  # (1, H, T, T)
fig, axes = plt.subplots(1, 2, figsize=(8, 3.8))
for head, ax in enumerate(axes):
    ax.imshow(trained_weights[0, head], cmap="viridis", vmin=0, vmax=1)
    second_copy = np.arange(LENGTH, 2 * LENGTH)  # query positions; 7 back is the key to copy
    ax.plot(second_copy - (LENGTH - 1) - 0.6, second_copy, "r--", linewidth=1.2)  # just left of that key
    ax.set_title(f"head {head}")
    ax.set_xlabel("key position")
    ax.set_ylabel("query position")
fig.suptitle("after training: the weight sits 7 back in the second copy")
plt.show()

# %% [markdown]
# ## 9. Decoding with a KV cache
#
# Generation adds one token at a time. With a cache, each step computes only the new token's k and v,
# appends them, and attends one query against everything cached, bottom-right causal. The result is the
# same, token for token, as running the whole sequence at once. `flash_decode` splits the cached keys
# over the cores for one such step and merges the parts exactly.

# %%
decoder = MultiHeadAttention(64, 4, 2, rope=True, rng=0)  # 4 query heads of 16 over 2 kv heads
x_seq = rng.standard_normal((1, 12, 64), dtype=np.float32)  # (B, T, C)
cache = KVCache(1, 2, 12, 16)  # batch, kv_heads, max_tokens, head_dim
steps_out = [decoder(x_seq[:, :4], cache=cache)]  # the prompt at once
steps_out += [decoder(x_seq[:, t : t + 1], cache=cache) for t in range(4, 12)]  # then one token a step
whole = decoder(x_seq)
print("cached steps == the whole sequence:", np.allclose(np.concatenate(steps_out, axis=1), whole, atol=1e-5))
print("tokens cached:", len(cache), " cache bytes:", cache.nbytes)

q_step = rng.standard_normal((8, 1, 64))  # (Hq, 1, E): one new token
k_cache, v_cache = (rng.standard_normal((2, 8192, 64)) for _ in range(2))  # (Hkv, S, E)
split = flash_decode(q_step, k_cache, v_cache, kv_splits=8)
print(
    "flash_decode (8 chunks, merged) vs attention():", float(np.abs(split - attention(q_step, k_cache, v_cache)).max())
)
