"""Generate text from a checkpoint that train.py wrote, one token at a time, through the KV cache.

    python scripts/sample.py run                                   # 200 tokens after a newline
    python scripts/sample.py run --prompt "ROMEO:" --tokens 500 --temperature 0.7 --top-k 20
    python scripts/sample.py run --no-cache                        # every step runs the whole sequence again
    python scripts/sample.py run --compare --tokens 1024           # both ways: the same tokens, and their speeds

A step: the logits of the last position, divided by --temperature (0: the most likely token), cut to the
--top-k most likely tokens and to the smallest set whose probability reaches --top-p, and one token drawn
from what is left (tinyattn_np.sampling). With the cache, the prompt runs once and each step runs one new
token through the layers, attending to the keys and values kept from before; without it, each step runs
the whole sequence again. Past the model's context both attend to the last `context` tokens, so they give
the same tokens for the same --seed, and --compare checks that they do.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the modules this script shares sit beside it
import checkpoint  # noqa: E402
import common  # noqa: E402
import text_data  # noqa: E402

from tinyattn_np.report import fold_lines, positive  # noqa: E402
from tinyattn_np.sampling import generate  # noqa: E402

MAX_TOKENS = 100_000


def top_p(text: str) -> float:
    """argparse type for --top-p: a number in (0, 1]."""
    value = positive(float)(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1]; got {value}")
    return float(value)


def temperature(text: str) -> float:
    """argparse type for --temperature: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number >= 0; got {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0 (0: the most likely token); got {value}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", metavar="DIR", help="a folder that train.py --out DIR wrote")
    p.add_argument("--prompt", default="\n", help="the text to go on from (default: a newline)")
    p.add_argument("--tokens", type=positive(int), default=200, help="new tokens to generate (default 200)")
    p.add_argument(
        "--temperature",
        type=temperature,
        default=0.8,
        help="divides the logits: below 1 sharper, above 1 flatter, 0 the most likely token (default 0.8)",
    )
    p.add_argument("--top-k", type=positive(int), default=None, help="draw from the k most likely tokens only")
    p.add_argument(
        "--top-p",
        type=top_p,
        default=None,
        help="draw from the most likely tokens whose probability adds up to p (nucleus sampling)",
    )
    p.add_argument("--no-cache", action="store_true", help="recompute the whole sequence at every step")
    p.add_argument(
        "--compare",
        action="store_true",
        help="generate with the cache and without it: the same tokens, and both speeds",
    )
    p.add_argument("--json", metavar="PATH", help="write the text, the speeds, the machine and the code version")
    common.add_seed_and_format(p, "the draws")
    args = p.parse_args(argv)
    if args.tokens > MAX_TOKENS:
        p.error(f"--tokens must be at most {MAX_TOKENS:,}; got {args.tokens:,}")
    if args.no_cache and args.compare:
        p.error("--compare runs both ways already: leave out --no-cache")
    common.check_output(p, "--json", args.json)
    return args


def timed_generation(model: Any, prompt: np.ndarray, args: argparse.Namespace, use_cache: bool) -> dict[str, Any]:
    """The tokens after the prompt, and the time they took ('tokens' and 'seconds')."""
    started = time.perf_counter()
    out = generate(model, prompt, args.tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                   rng=args.seed, use_cache=use_cache)  # fmt: skip
    seconds = time.perf_counter() - started
    return {"tokens": out[len(prompt) :], "seconds": seconds, "tokens_per_s": args.tokens / seconds}


def speed_line(run: dict[str, Any], use_cache: bool, tokens: int) -> str:
    how = "with the KV cache" if use_cache else "without a cache (the whole sequence at every step)"
    return f"{tokens:,} tokens in {run['seconds']:.2f} s {how}: {run['tokens_per_s']:,.1f} tokens/s"


def first_difference(a: np.ndarray, b: np.ndarray) -> int | None:
    """The index of the first token where a and b differ, None where they are equal."""
    differ = np.flatnonzero(a != b)
    return int(differ[0]) if differ.size else None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        model, tokenizer, meta, _ = checkpoint.load_model(args.checkpoint)
        prompt = tokenizer.encode(args.prompt)  # (T0,)
    except (checkpoint.CheckpointError, text_data.DataError) as err:
        print(f"sample.py: error: {'--prompt: ' if isinstance(err, text_data.DataError) else ''}{err}", file=sys.stderr)
        return 2
    if len(prompt) == 0:
        print("sample.py: error: --prompt must hold at least one token; got an empty text", file=sys.stderr)
        return 2
    c = model.config
    if args.compare:  # a timing to compare: which machine and which code printed it
        print(common.header()[1])
    print(f"checkpoint: {args.checkpoint}")  # a line of its own: a path may be long
    print(f"  step {meta['step']}, validation loss {last_val_loss(meta)}; GPT ({meta['preset']}), {c.layers} layers, "
          f"width {c.width}, context {c.context}, vocabulary {c.vocab:,}")  # fmt: skip
    runs = {}
    for use_cache in [True, False] if args.compare else [not args.no_cache]:
        runs[use_cache] = timed_generation(model, prompt, args, use_cache)
    text = tokenizer.decode(np.concatenate([prompt, next(iter(runs.values()))["tokens"]]))
    print(f"temperature {args.temperature:g}, top-k {args.top_k or '-'}, top-p {args.top_p or '-'}, seed {args.seed} "
          "(lines over 120 characters folded):")  # fmt: skip
    print("-" * 80 + f"\n{fold_lines(text)}\n" + "-" * 80)
    for use_cache, run in runs.items():
        print(speed_line(run, use_cache, args.tokens))
    busy = common.busy_reasons()
    if busy:
        print(f"* timed on a busy machine: {'; '.join(busy)}")
    code = 0
    if args.compare:
        cached, recomputed = runs[True], runs[False]
        differ = first_difference(cached["tokens"], recomputed["tokens"])
        agree = f"the two agree on all {args.tokens:,} tokens"
        if differ is not None:
            agree = f"the two agree on the first {differ:,} tokens, then differ (a draw within rounding of a boundary)"
        print(f"the cache is {recomputed['seconds'] / cached['seconds']:.1f}x faster; {agree}")
        code = 0 if differ is None or args.temperature > 0 else 1  # greedy has no boundary to fall on
    if args.json:
        figures = {"args": vars(args), "text": text, "step": meta["step"], "machine": common.header()[0]}
        figures["runs"] = {("cache" if k else "no_cache"): {"seconds": v["seconds"], "tokens_per_s": v["tokens_per_s"]}
                           for k, v in runs.items()}  # fmt: skip
        common.write_json(args.json, figures)
    return code


def last_val_loss(meta: dict[str, Any]) -> str:
    rows = [row for row in meta.get("rows", []) if row.get("val_loss") is not None]
    return f"{rows[-1]['val_loss']:.4f} at step {rows[-1]['step']}" if rows else "not measured"


if __name__ == "__main__":
    sys.exit(common.run_main(main))
