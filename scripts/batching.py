"""Continuous batching over a paged KV cache, as serve.py simulates it: requests that arrive over time, the
two admission rules under one memory budget (paging: blocks as tokens come; contiguous preallocation: each
request's whole maximum at admission), and the server's loop (preempt, admit and prefill, decode one batch,
retire); and a request run alone through a contiguous KVCache, the reference every batched request must equal.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
from tiny_decoder import TinyDecoder

from tinyattn_np import PagedKVCache, paged_kv_cache_bytes

# ---------------------------------------------------------------------------------------------------
# a request alone: the reference


def sample(logits: np.ndarray, rng: np.random.Generator | None) -> int:
    """The next token: greedy without rng, else drawn at temperature 1 from softmax(logits)."""
    if rng is None:
        return int(np.argmax(logits))
    p = np.exp(logits - logits.max())
    return int(rng.choice(len(p), p=p / p.sum()))


def run_alone(model: TinyDecoder, prompt: np.ndarray, n_new: int, rng: np.random.Generator | None = None):
    """One request on its own through a contiguous KVCache per layer:
    its tokens and the logits behind each."""
    caches = model.caches(len(prompt) + n_new)
    logits = model.logits(prompt[None], caches)[0]  # (V,)
    tokens, all_logits = [], []
    while len(tokens) < n_new:
        tokens.append(sample(logits, rng))
        all_logits.append(logits)
        if len(tokens) < n_new:
            logits = model.logits(np.array([[tokens[-1]]]), caches)[0]
    return tokens, np.array(all_logits)


# ---------------------------------------------------------------------------------------------------
# 1) continuous batching


class Request:
    """One request: when it arrives, its prompt (token ids), how many tokens it generates (its end of sequence,
    at most --max-new), and as it runs its sequence id (the same in every layer's cache), tokens and logits."""

    def __init__(self, arrival: int, prompt: np.ndarray, output_len: int):
        self.arrival, self.prompt, self.output_len = arrival, prompt, output_len
        self.seq = -1
        self.tokens: list[int] = []
        self.logits: list[np.ndarray] = []

    @property
    def length(self) -> int:
        """Tokens in the cache: the prompt and every generated token but the newest (not yet fed back)."""
        return len(self.prompt) + max(len(self.tokens) - 1, 0)

    def record(self, logits: np.ndarray) -> None:
        self.tokens.append(sample(logits, None))
        self.logits.append(logits)


def draw_workload(args: argparse.Namespace, rng: np.random.Generator) -> list[tuple[int, np.ndarray, int]]:
    """(arrival step, prompt, output length) of each request: Poisson arrivals at --rate per step, prompt
    lengths uniform in [--min-prompt, --max-prompt], outputs uniform in [1, --max-new]. A request rarely uses
    its whole limit of --max-new tokens, and its limit is what preallocation must reserve."""
    gaps = rng.exponential(1 / args.rate, args.requests)
    arrivals = np.floor(np.cumsum(gaps) - gaps[0]).astype(int)
    prompts = rng.integers(args.min_prompt, args.max_prompt + 1, args.requests)
    outputs = rng.integers(1, args.max_new + 1, args.requests)
    return [
        (int(t), rng.integers(0, args.vocab, int(p)), int(o))
        for t, p, o in zip(arrivals, prompts, outputs, strict=True)
    ]


def admits(scheme: str, request: Request, running: list[Request], cache: PagedKVCache, args: Any) -> bool:
    """Whether the scheme has room for one more request now.

    paged: blocks for its prompt, and one to spare for each running request's next token. contiguous: its
    whole maximum, prompt + max-new tokens (in whole blocks of the same pool), beside what the running ones
    reserved: what a KVCache of max_tokens per request holds, within the same budget."""
    if scheme == "paged":
        return cache.blocks_free >= -(-len(request.prompt) // args.block_size) + len(running) + 1
    reserved = sum(-(-(len(r.prompt) + args.max_new) // args.block_size) for r in [*running, request])
    return reserved <= args.blocks


def serve(model: TinyDecoder, requests: list[Request], scheme: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run every request to its end under one scheme's admission rule (the same kernel for both); what was
    measured. Each step: arrivals join the queue; if the running requests' next tokens need more blocks
    than are free, the latest admitted is preempted (its blocks freed, recomputed later: vLLM's recompute);
    waiting ones are admitted and prefilled; the others decode one token each, in one batch."""
    caches = model.paged_caches(args.blocks, args.block_size)
    pending, waiting, running = sorted(requests, key=lambda r: r.arrival), [], []
    stats: dict[str, Any] = {"steps": 0, "seconds": 0.0, "preempted": 0, "at_once": [], "memory": []}
    while pending or waiting or running:
        while pending and pending[0].arrival <= stats["steps"]:
            waiting.append(pending.pop(0))
        t0 = time.perf_counter()
        while sum(caches[0].blocks_needed(r.seq, 1) for r in running) > caches[0].blocks_free:
            waiting.insert(0, release(running.pop(), caches))  # 1) preempt the latest admitted
            stats["preempted"] += 1
        new = []
        while waiting and admits(scheme, waiting[0], running + new, caches[0], args):
            # 2) admit and prefill: the prompt into pages, its first token
            new.append(request := waiting.pop(0))
            request.seq = caches[0].add_sequence()
            assert all(cache.add_sequence() == request.seq for cache in caches[1:])  # the layers agree
            request.record(model.logits(request.prompt[None], caches, [request.seq])[0])
        if running:  # 3) one decode step, in one batch, for every request that was already running
            last = np.array([[r.tokens[-1]] for r in running])  # (B, 1)
            for request, logits in zip(running, model.logits(last, caches, [r.seq for r in running]), strict=True):
                request.record(logits)
        running += new
        stats["seconds"] += time.perf_counter() - t0
        stats["memory"].append(memory_now(running, caches[0], args))
        stats["at_once"].append(len(running))
        for request in [r for r in running if len(r.tokens) == r.output_len]:  # 4) retire the finished
            running.remove(request)
            release(request, caches)
        stats["steps"] += 1
    stats["tokens"] = sum(r.output_len for r in requests)
    return stats


def release(request: Request, caches: list[PagedKVCache]) -> Request:
    """Free a request's sequence in every layer's cache; a preempted request starts again from its prompt."""
    for cache in caches:
        cache.free(request.seq)
    if len(request.tokens) < request.output_len:
        request.tokens, request.logits = [], []
    return request


def memory_now(running: list[Request], cache: PagedKVCache, args: argparse.Namespace) -> tuple[int, int, int, bool]:
    """Token slots of one layer at this step: held by paging (its blocks), reserved by preallocation (each
    request's maximum), holding a token; and whether the pool holds memory.paged_kv_cache_bytes of the lengths."""
    lengths = [r.length for r in running]
    formula = paged_kv_cache_bytes(
        lengths,
        block_size=args.block_size,
        layers=1,
        kv_heads=args.kv_heads,
        head_dim=args.d_model // args.heads,
        dtype=args.dtype,
    )
    reserved = sum(len(r.prompt) + args.max_new for r in running)
    return cache.blocks_used * args.block_size, reserved, sum(lengths), cache.bytes_used == formula
