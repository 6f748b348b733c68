"""Text in, tokens out, and the batches a language model learns from: a module that train.py, sample.py and
attention.py share.

Three tokenizers, each with encode(text) -> int32 ids, decode(ids) -> text, vocab_size, and describe() ->
the dict a checkpoint keeps so that sample.py reads text the way training did:

    CharTokenizer   one token per distinct character of the training text (nanoGPT's shakespeare_char)
    ByteTokenizer   the 256 byte values of UTF-8: any text at all, three or four tokens for a rare character
    HFTokenizer     a Hugging Face tokenizer.json, through the `tokenizers` package (the tokenizers extra)

With no file, the text is this project's own pages, README.md and docs/*.md, read as they are now: a corpus
that ships with the code and was written for it, so that training works offline.

The batches are nanoGPT's: B windows of T + 1 tokens at random starts in the training part; x is a window's
first T tokens and y its last T, so that y[t] is the token after x[t]. The validation loss is taken on
fixed windows spread evenly over the validation part, the same at every evaluation.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import limits
import numpy as np

ROOT = Path(__file__).resolve().parents[1]  # the checkout: README.md and docs/ sit there
TOKENIZERS_HINT = "pip install -e '.[tokenizers]'"
CHUNK = 2**16  # characters encoded at a time: the encoders' arrays besides the tokens stay this small


class DataError(ValueError):
    """A data file or a text that cannot be used as it is; the message says what to change."""


# ---------------------------------------------------------------------------------------------------
# tokenizers


class CharTokenizer:
    """One token per distinct character: id i is the i-th character of `chars` (sorted)."""

    def __init__(self, chars: str):
        self.chars = chars
        self.ids = {c: i for i, c in enumerate(chars)}
        self.vocab_size = len(chars)

    @staticmethod
    def fit(text: str) -> CharTokenizer:
        return CharTokenizer("".join(sorted(set(text))))

    def encode(self, text: str) -> np.ndarray:
        """The ids of text's characters (n,), CHUNK characters at a time: each chunk's code points looked up
        in the sorted code points of the vocabulary, so that the peak is the int32 ids and one chunk's arrays."""
        points = np.array([ord(c) for c in self.chars], dtype=np.uint32)  # (V,), ascending: chars is sorted
        ids = np.empty(len(text), dtype=np.int32)  # (n,)
        for start in range(0, len(text), CHUNK):
            chunk = np.frombuffer(text[start : start + CHUNK].encode("utf-32-le"), dtype="<u4")  # (chunk,)
            found = np.searchsorted(points, chunk).clip(max=max(len(points) - 1, 0))  # (chunk,)
            if len(points) == 0 or (points[found] != chunk).any():
                self.refuse(text)
            ids[start : start + len(chunk)] = found
        return ids

    def refuse(self, text: str) -> None:
        """The DataError that names the characters of text that the vocabulary lacks."""
        missing = sorted(set(text) - self.ids.keys())
        shown = ", ".join(repr(c) for c in missing[:10]) + (f", {len(missing) - 10} more" if missing[10:] else "")
        raise DataError(
            f"the text has {len(missing)} character(s) that the vocabulary lacks: {shown}; the vocabulary is the "
            f"{self.vocab_size} characters of the training text: {''.join(self.chars)!r}"
        )

    def decode(self, ids: Any) -> str:
        return "".join(self.chars[i] for i in ids)

    def describe(self) -> dict[str, Any]:
        return {"kind": "char", "chars": self.chars}


class ByteTokenizer:
    """The UTF-8 bytes of the text: 256 ids, every text encodes. A token cut out of a character's bytes
    decodes as U+FFFD (the replacement character)."""

    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        """The UTF-8 bytes of text as ids (n bytes,), CHUNK characters at a time (the peak: the ids, a chunk)."""
        chunks = range(0, len(text), CHUNK)
        ids = np.empty(sum(len(text[i : i + CHUNK].encode("utf-8")) for i in chunks), dtype=np.int32)  # (n,)
        done = 0
        for start in chunks:
            chunk = np.frombuffer(text[start : start + CHUNK].encode("utf-8"), dtype=np.uint8)  # (bytes,)
            ids[done : done + len(chunk)] = chunk
            done += len(chunk)
        return ids

    def decode(self, ids: Any) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def describe(self) -> dict[str, Any]:
        return {"kind": "byte"}


class HFTokenizer:
    """A Hugging Face tokenizer.json (byte-pair merges and their pre-tokenizer), read by `tokenizers`."""

    def __init__(self, source: str):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise DataError(f"a tokenizer.json needs the tokenizers package: {TOKENIZERS_HINT}") from None
        self.source = source  # the file's whole text: the checkpoint keeps it
        try:
            self.tokenizer = Tokenizer.from_str(source)
        except Exception as err:  # tokenizers raises its own Exception for a bad file
            raise DataError(f"not a tokenizer.json that the tokenizers package reads: {err}") from None
        self.vocab_size = self.tokenizer.get_vocab_size()

    def encode(self, text: str) -> np.ndarray:
        return np.array(self.tokenizer.encode(text).ids, dtype=np.int32)  # (n,)

    def decode(self, ids: Any) -> str:
        return str(self.tokenizer.decode([int(i) for i in ids]))

    def describe(self) -> dict[str, Any]:
        return {"kind": "tokenizer.json", "json": self.source}


Tokenizer = CharTokenizer | ByteTokenizer | HFTokenizer


def make_tokenizer(choice: str, text: str) -> Tokenizer:
    """--tokenizer: 'char' (fitted to text), 'byte', or the path of a tokenizer.json."""
    if choice == "char":
        return CharTokenizer.fit(text)
    if choice == "byte":
        return ByteTokenizer()
    path = Path(choice)
    if path.suffix != ".json":
        raise DataError(f"--tokenizer must be char, byte or the path of a tokenizer.json; got {choice!r}")
    return HFTokenizer(read_utf8(path, "--tokenizer"))


def tokenizer_of(choice: str | None, text: str, saved: dict[str, Any] | None, folder: str | None) -> Tokenizer:
    """A run's tokenizer: --tokenizer's (choice; None: char) fitted to a new run's text, or the one the checkpoint
    in folder describes (saved) for a run that goes on from it, which a --tokenizer given must name."""
    if not saved:
        return make_tokenizer(choice or "char", text)
    kind = saved.get("kind")
    if choice is not None:
        a_file = choice not in ("char", "byte") and kind == "tokenizer.json"  # the same file's text, then
        if choice != kind and not (a_file and read_utf8(Path(choice), "--tokenizer") == saved.get("json")):
            raise DataError(
                f"the checkpoint in {folder} has the {kind!r} tokenizer; --tokenizer {choice} is another: "
                "leave --tokenizer out to go on with the checkpoint's"
            )
    return tokenizer_from(saved)


def encoding_memory(text: str, tokenizer: Tokenizer) -> int:
    """The most memory that tokenizer.encode(text) takes, in bytes, by arithmetic: the int32 ids (a token a
    character, or a byte, at most 4 a character) and one chunk's arrays. A tokenizer.json is bounded likewise
    by 4 bytes a character, the `tokenizers` package's own memory aside."""
    bytes_per_character = 1 if isinstance(tokenizer, CharTokenizer) or text.isascii() else 4  # UTF-8's, at most
    return 4 * bytes_per_character * len(text) + 32 * CHUNK  # int32 ids; a chunk's code points and lookups


def check_encoding(text: str, tokenizer: Tokenizer, where: str) -> None:
    """Refuse, before it starts, an encoding of text whose ids would not fit this machine's memory."""
    needed, detail = encoding_memory(text, tokenizer), f" ({where}: {len(text):,} characters)"
    problem = limits.memory_problem(needed, "encoding the text into tokens", "give a shorter text", detail)
    if problem:
        raise DataError(problem)


def default_prompt(tokenizer: Tokenizer) -> tuple[np.ndarray, str]:
    """The prompt of sample.py and of train.py's sample when none is given, and what it is: a newline, or,
    where the vocabulary has none (a text of one line), its first token."""
    try:
        return tokenizer.encode("\n"), "a newline"
    except DataError:
        return np.zeros(1, dtype=np.int64), f"{tokenizer.decode([0])!r}, the vocabulary's first token"


def tokenizer_from(described: dict[str, Any]) -> Tokenizer:
    """The tokenizer that describe() described (as a checkpoint keeps it)."""
    kind = described.get("kind")
    if kind == "char":
        return CharTokenizer(described["chars"])
    if kind == "byte":
        return ByteTokenizer()
    if kind == "tokenizer.json":
        return HFTokenizer(described["json"])
    raise DataError(f"unknown tokenizer in the checkpoint: {kind!r}")


# ---------------------------------------------------------------------------------------------------
# the text


def read_utf8(path: Path, flag: str) -> str:
    """The file's text; a DataError that names the flag for a missing, unreadable or non-UTF-8 file."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"{flag} {path}: no such file") from None
    except IsADirectoryError:
        raise DataError(f"{flag} {path} is a folder: give a text file") from None
    except UnicodeDecodeError as err:
        raise DataError(f"{flag} {path} is not UTF-8 text (byte {err.start}: {err.reason})") from None
    except OSError as err:
        raise DataError(f"{flag} {path}: cannot read it ({err.strerror})") from None


def project_pages() -> list[Path]:
    """README.md and docs/*.md of this checkout, in that order."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def load_text(path: str | None) -> tuple[str, str]:
    """(text, where it came from): the file at path, or this project's pages joined (README.md first)."""
    if path is not None:
        text = read_utf8(Path(path), "--data")
        if not text:
            raise DataError(f"--data {path} is empty: give a text file with something in it")
        return text, path
    pages = project_pages()
    text = "\n".join(read_utf8(page, "the project's page") for page in pages)
    return text, f"this project's README.md and {len(pages) - 1} pages of docs/"


def fingerprint(text: str) -> str:
    """The first 16 hex digits of the text's SHA-256: a checkpoint notes which text it trained on."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------------
# tokens for training


@dataclass
class Data:
    """A run's text as tokens: the tokenizer, where the text came from and its fingerprint, and its tokens
    split into the first 1 - validation to train on and the rest to validate on (never trained on)."""

    tokenizer: Tokenizer
    source: str
    fingerprint: str
    validation: float
    train: np.ndarray  # (n_train,) token ids
    val: np.ndarray  # (n_val,)


def split(tokens: np.ndarray, context: int, validation: float, where: str) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation): the first 1 - validation of the tokens, then the rest. Each part must hold a
    window of context + 1 tokens; a DataError says how many there are and what to change."""
    n_val = int(round(len(tokens) * validation))  # the validation part is the text's end
    train, val = tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val :]  # (n - n_val,), (n_val,)
    if min(len(train), len(val)) < context + 1:
        raise DataError(
            f"{where} is too short for the context: {len(tokens):,} tokens give {len(train):,} to train on and "
            f"{len(val):,} to validate on ({validation:.0%}), and each part needs at least {context + 1} (the "
            "context and the token after it); give a longer text, or a preset with a shorter context"
        )
    return train, val


def random_batch(rng: np.random.Generator, tokens: np.ndarray, batch: int, context: int) -> tuple[np.ndarray, ...]:
    """(x, y), each (batch, context): windows at random starts, y one token ahead of x."""
    starts = rng.integers(0, len(tokens) - context, size=batch)  # (B,): a window of T + 1 fits from each
    windows = tokens[starts[:, None] + np.arange(context + 1)]  # (B, T + 1)
    return windows[:, :-1], windows[:, 1:]


def fixed_batches(tokens: np.ndarray, windows: int, batch: int, context: int) -> list[tuple[np.ndarray, ...]]:
    """The validation set: up to `windows` windows at starts spread evenly over tokens, in batches of at most
    `batch`; the same every time it is asked for."""
    count = min(windows, len(tokens) - context)
    starts = np.linspace(0, len(tokens) - context - 1, count).round().astype(np.int64)  # (n,)
    rows = tokens[starts[:, None] + np.arange(context + 1)]  # (n, T + 1)
    return [(rows[i : i + batch, :-1], rows[i : i + batch, 1:]) for i in range(0, count, batch)]


def rng_state(rng: np.random.Generator) -> str:
    """The generator's whole state as JSON text (PCG64's 128-bit integers stay exact in JSON)."""
    return json.dumps(rng.bit_generator.state)


def rng_from(state: str) -> np.random.Generator:
    """A generator that continues exactly where the one rng_state() read stopped."""
    bit_generator = np.random.PCG64()
    bit_generator.state = json.loads(state)
    return np.random.Generator(bit_generator)
