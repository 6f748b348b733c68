"""Generate text from a checkpoint that train.py wrote, one token at a time, through the KV cache (and, for a
hybrid model that train.py --layer-pattern made, the gated delta layers' states).

    python scripts/sample.py run                                   # 200 tokens after a newline
    python scripts/sample.py run --prompt "ROMEO:" --tokens 500 --temperature 0.7 --top-k 20
    python scripts/sample.py run --no-cache                        # every step runs the whole sequence again
    python scripts/sample.py run --compare --tokens 1024           # both ways: the same tokens, and their speeds
    python scripts/sample.py run --samples 3 --prompt-file p.txt   # 3 samples after the text of a file

A step: the logits of the last position, divided by --temperature (0: the most likely token), cut to the
--top-k most likely tokens and to the smallest set whose probability reaches --top-p, and one token drawn
from what is left (tinyattn_np.sampling). With the cache, the prompt runs once and each step runs one new
token through the layers, attending to the keys and values kept from before; without it, each step runs
the whole sequence again. Past the model's context both attend to the last `context` tokens, so they give
the same tokens for the same --seed, and --compare checks that they do. --samples N draws N samples after
the same prompt at once, as one batch of N rows, each row's token drawn at every step (nanoGPT's
--num_samples; its --start=FILE:prompt.txt is --prompt-file prompt.txt here).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the modules this script shares sit beside it
import os_tweaks

if __name__ == "__main__":  # train.py's settings of a program, made before NumPy loads (os_tweaks.py says why)
    os_tweaks.speed_up()
# ruff: noqa: E402  (the imports below come after that setting on purpose)
import checkpoint
import interrupts
import machine
import numpy as np
import outputs
import text_data

from tinyattn_np.report import add_seed_and_format, fold_lines, positive
from tinyattn_np.sampling import generate

MAX_TOKENS = 100_000
MAX_SAMPLES = 1_000
MAX_PROMPT_BYTES = 100_000  # a prompt runs through the model whole before the first new token: past this, minutes


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
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument(
        "--prompt",
        help="the text to go on from (default: a newline, or the vocabulary's first token where it has none)",
    )
    prompt.add_argument("--prompt-file", metavar="PATH", help="the text to go on from, read from a UTF-8 file")
    p.add_argument("--tokens", type=positive(int), default=200, help="new tokens to generate (default 200)")
    p.add_argument(
        "--samples",
        type=positive(int),
        default=1,
        help="samples after the same prompt, drawn at once as a batch of that many rows (default 1)",
    )
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
    add_seed_and_format(p, "the draws")
    args = p.parse_args(argv)
    if args.tokens > MAX_TOKENS:
        p.error(f"--tokens must be at most {MAX_TOKENS:,}; got {args.tokens:,}")
    if args.samples > MAX_SAMPLES:
        p.error(f"--samples must be at most {MAX_SAMPLES:,}; got {args.samples:,}")
    if args.no_cache and args.compare:
        p.error("--compare runs both ways already: leave out --no-cache")
    outputs.check_output(p, "--json", args.json)
    return args


def timed_generation(model: Any, prompt: np.ndarray, args: argparse.Namespace, use_cache: bool) -> dict[str, Any]:
    """The tokens after the prompt, (samples, tokens), and the time they took ('tokens' and 'seconds')."""
    started = time.perf_counter()
    rows = np.tile(prompt, (args.samples, 1))  # (samples, T0): the same prompt in every row
    out = generate(
        model,
        rows,
        args.tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        rng=args.seed,
        use_cache=use_cache,
    )
    seconds = time.perf_counter() - started
    return {
        "tokens": out[:, len(prompt) :],
        "seconds": seconds,
        "tokens_per_s": args.samples * args.tokens / seconds,
    }


def speed_line(run: dict[str, Any], use_cache: bool, args: argparse.Namespace, hybrid: bool = False) -> str:
    caches = "the KV caches and the gated delta states" if hybrid else "the KV cache"
    how = f"with {caches}" if use_cache else "without a cache (the whole sequence at every step)"
    count = f"{args.samples} x {args.tokens:,}" if args.samples > 1 else f"{args.tokens:,}"
    return f"{count} tokens in {run['seconds']:.2f} s {how}: {run['tokens_per_s']:,.1f} tokens/s"


def first_difference(a: np.ndarray, b: np.ndarray) -> tuple[int, int] | None:
    """(sample, token) of the first token where a and b (samples, tokens) differ,
    None where they are equal."""
    differ = np.argwhere(a != b)
    return (int(differ[0][0]), int(differ[0][1])) if differ.size else None


def encoded_prompt(tokenizer: Any, args: argparse.Namespace) -> np.ndarray:
    """The prompt's tokens (T0,): --prompt, or the text of --prompt-file, or by default a newline (the
    vocabulary's first token where it has none: a text of one line). A DataError names the flag: a file that
    cannot be read as UTF-8, characters the vocabulary lacks, a text of no token."""
    if args.prompt is None and args.prompt_file is None:
        return text_data.default_prompt(tokenizer)[0]
    flag = "--prompt" if args.prompt_file is None else f"--prompt-file {args.prompt_file}"
    size = len(args.prompt.encode("utf-8")) if args.prompt_file is None else file_size(args.prompt_file)
    if size > MAX_PROMPT_BYTES:
        raise text_data.DataError(
            f"{flag} holds {size:,} bytes; a prompt may hold at most {MAX_PROMPT_BYTES:,} (the whole prompt runs "
            "through the model before the first new token): give its last part"
        )
    text = args.prompt if args.prompt_file is None else text_data.read_utf8(Path(args.prompt_file), "--prompt-file")
    try:
        prompt = tokenizer.encode(text)
    except text_data.DataError as err:
        raise text_data.DataError(f"{flag}: {err}") from None
    if len(prompt) == 0:
        raise text_data.DataError(f"{flag} must hold at least one token; got an empty text")
    return prompt


def file_size(path: str) -> int:
    """The size of the file at path in bytes (0 where it cannot be read: reading it then says why)."""
    try:
        return Path(path).stat().st_size
    except OSError:
        return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        model, tokenizer, meta, _ = checkpoint.load_model(args.checkpoint)
        prompt = encoded_prompt(tokenizer, args)  # (T0,)
    except (checkpoint.CheckpointError, text_data.DataError) as err:
        print(f"sample.py: error: {err}", file=sys.stderr)
        return 2
    c = model.config
    if args.compare:  # a timing to compare: which machine and which code printed it, and the BLAS setting
        print(f"{machine.header()[1]}\n{os_tweaks.describe()}")
    print(f"checkpoint: {args.checkpoint}")  # a line of its own: a path may be long
    print(
        f"  step {meta['step']}, validation loss {last_val_loss(meta)}; GPT ({meta['preset']}), {c.layers} "
        f"layer{'s' * (c.layers != 1)}, width {c.width}, context {c.context}, vocabulary {c.vocab:,}"
        + (f", layer pattern {c.layer_pattern}" if c.layer_pattern else "")
    )
    runs = {}
    try:
        with warnings.catch_warnings():  # NumPy's overflow warnings: the one error below says what went wrong
            warnings.filterwarnings("ignore", r"(overflow|invalid value) encountered", RuntimeWarning)
            for use_cache in [True, False] if args.compare else [not args.no_cache]:
                runs[use_cache] = timed_generation(model, prompt, args, use_cache)
    except ValueError as err:  # logits no token can be drawn from: weights that overflow, say
        print(f"sample.py: error: {err}", file=sys.stderr)
        return 1
    texts = [tokenizer.decode(np.concatenate([prompt, row])) for row in next(iter(runs.values()))["tokens"]]
    print(
        f"temperature {args.temperature:g}, top-k {args.top_k or '-'}, top-p {args.top_p or '-'}, seed {args.seed} "
        "(lines over 120 characters folded):"
    )
    print("-" * 80 + "".join(f"\n{fold_lines(text)}\n" + "-" * 80 for text in texts))
    for use_cache, run in runs.items():
        print(speed_line(run, use_cache, args, hybrid=c.delta_layers > 0))
    busy = machine.busy_reasons()
    if busy:
        print(f"* timed on a busy machine: {'; '.join(busy)}")
    code = compared(runs, args, busy) if args.compare else 0
    if args.json:
        figures = {
            "args": vars(args),
            "text": texts[0],
            "texts": texts,
            "step": meta["step"],
            "machine": machine.header()[0],
        }
        figures["runs"] = {
            ("cache" if k else "no_cache"): {"seconds": v["seconds"], "tokens_per_s": v["tokens_per_s"]}
            for k, v in runs.items()
        }
        outputs.write_json(args.json, figures)
    return code


def compared(runs: dict[bool, dict[str, Any]], args: argparse.Namespace, busy: list[str]) -> int:
    """--compare's last line: how much faster the cache was (on a quiet machine: nothing is concluded from
    times taken on a busy one), and whether both ways drew the same tokens; the exit code, 1 where greedy
    decoding (which has no boundary to fall on) drew different ones."""
    cached, recomputed = runs[True], runs[False]
    differ = first_difference(cached["tokens"], recomputed["tokens"])
    agree = f"the two agree on all {args.samples * args.tokens:,} tokens"
    if differ is not None:
        sample, token = differ
        where = f" of sample {sample + 1}" if args.samples > 1 else ""
        agree = (
            f"the two agree on the first {token:,} tokens{where}, then differ (a draw within rounding of a boundary)"
        )
    faster = f"the cache is {recomputed['seconds'] / cached['seconds']:.1f}x faster"
    print(f"{machine.concluded([{'busy': busy}], faster)}; {agree}")
    return 0 if differ is None or args.temperature > 0 else 1


def last_val_loss(meta: dict[str, Any]) -> str:
    rows = [row for row in meta.get("rows", []) if row.get("val_loss") is not None]
    return f"{rows[-1]['val_loss']:.4f} at step {rows[-1]['step']}" if rows else "not measured"


if __name__ == "__main__":
    sys.exit(interrupts.run_main(main))
