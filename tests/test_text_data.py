"""scripts/text_data.py and scripts/checkpoint.py, the modules that train.py, sample.py and attention.py
share: the tokenizers give the text back, the batches are windows one token apart, the validation windows
never change, a generator continues from its saved state, and a checkpoint is written whole or not at all."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from test_scripts import load

load("train.py")  # puts scripts/ on sys.path, where checkpoint.py finds text_data.py, as the programs do
text_data, checkpoint = sys.modules["text_data"], sys.modules["checkpoint"]  # the modules the scripts share

TEXT = "Holmes examined the telegram. Ça va: naïve café, 東京.\n"


@pytest.mark.parametrize("make", [lambda: text_data.CharTokenizer.fit(TEXT), text_data.ByteTokenizer])
def test_tokenizers_give_the_text_back(make):
    tokenizer = make()
    ids = tokenizer.encode(TEXT)
    assert ids.dtype == np.int32 and ids.max() < tokenizer.vocab_size
    assert tokenizer.decode(ids) == TEXT
    again = text_data.tokenizer_from(json.loads(json.dumps(tokenizer.describe())))  # as a checkpoint keeps it
    assert np.array_equal(again.encode(TEXT), ids)


def test_char_tokenizer_names_what_it_cannot_spell():
    tokenizer = text_data.CharTokenizer.fit("abc")
    assert tokenizer.vocab_size == 3 and list(tokenizer.encode("cab")) == [2, 0, 1]
    with pytest.raises(text_data.DataError, match=r"2 character\(s\) that the vocabulary lacks: 'd', 'é'"):
        tokenizer.encode("dé")


def test_a_byte_cut_inside_a_character_decodes_as_the_replacement_character():
    ids = text_data.ByteTokenizer().encode("é")  # two bytes
    assert len(ids) == 2 and text_data.ByteTokenizer().decode(ids[:1]) == "\ufffd"


def test_a_tokenizer_json(tmp_path):
    tokenizers = pytest.importorskip("tokenizers", reason="the tokenizers extra: pip install -e '.[tokenizers]'")
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator([TEXT * 20], trainer)
    path = tmp_path / "tokenizer.json"
    bpe.save(str(path))
    tokenizer = text_data.make_tokenizer(str(path), "")
    ids = tokenizer.encode(TEXT)
    assert len(ids) < len(TEXT) and tokenizer.decode(ids) == TEXT  # merges: fewer tokens than characters
    assert np.array_equal(text_data.tokenizer_from(tokenizer.describe()).encode(TEXT), ids)
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(text_data.DataError, match="not a tokenizer.json that the tokenizers package reads"):
        text_data.make_tokenizer(str(bad), "")
    saved = tokenizer.describe()  # a run that goes on from a checkpoint: --tokenizer may name the same file
    assert text_data.tokenizer_of(str(path), TEXT, saved, "run").describe() == saved
    with pytest.raises(
        text_data.DataError,
        match=r"the checkpoint in run has the 'tokenizer.json' tokenizer; "
        r"--tokenizer .*bad.json is another",
    ):
        text_data.tokenizer_of(str(bad), TEXT, saved, "run")


def test_a_run_from_a_checkpoint_keeps_its_tokenizer():
    """A new run fits --tokenizer (char when not given) to its text; one that goes on from a checkpoint takes the
    checkpoint's, and refuses a --tokenizer that names another rather than leave the flag unheard."""
    assert text_data.tokenizer_of(None, "ba", None, None).describe() == {"kind": "char", "chars": "ab"}
    assert text_data.tokenizer_of("byte", "ba", None, None).describe() == {"kind": "byte"}
    saved = text_data.CharTokenizer.fit("abc").describe()
    for choice in (None, "char"):  # the checkpoint's characters, not this text's
        assert text_data.tokenizer_of(choice, "ba", saved, "run").describe() == saved
    with pytest.raises(
        text_data.DataError,
        match="the checkpoint in run has the 'char' tokenizer; --tokenizer byte "
        "is another: leave --tokenizer out to go on with the checkpoint's",
    ):
        text_data.tokenizer_of("byte", "ba", saved, "run")


def test_batches_are_windows_one_token_apart():
    tokens = np.arange(100, dtype=np.int32)
    train, val = text_data.split(tokens, context=8, validation=0.2, where="it")
    assert len(train) == 80 and val[0] == 80  # the validation part is the end
    x, y = text_data.random_batch(np.random.default_rng(0), train, 5, 8)
    assert x.shape == y.shape == (5, 8) and np.array_equal(y, x + 1) and y.max() < 80
    fixed = text_data.fixed_batches(val, windows=7, batch=4, context=8)
    assert [len(x) for x, _ in fixed] == [4, 3] and fixed[0][0][0, 0] == 80 and fixed[-1][1][-1, -1] == 99
    again = text_data.fixed_batches(val, windows=7, batch=4, context=8)
    assert all(np.array_equal(a[0], b[0]) for a, b in zip(fixed, again, strict=True))


def test_split_refuses_a_text_too_short_for_the_context():
    with pytest.raises(text_data.DataError, match="too short for the context: 30 tokens give 27 to train on and 3"):
        text_data.split(np.arange(30), context=8, validation=0.1, where="it")


def test_a_generator_continues_from_its_saved_state():
    rng = np.random.default_rng(7)
    rng.integers(0, 10, 5)
    state = text_data.rng_state(rng)
    assert np.array_equal(text_data.rng_from(state).random(4), rng.random(4))


def test_a_checkpoint_is_replaced_whole(tmp_path):
    first = {"w": np.arange(3.0)}
    checkpoint.save(tmp_path, first, {"step": 1})
    checkpoint.save(tmp_path, {"w": np.arange(4.0)}, {"step": 2, "note": "é"})
    arrays, meta = checkpoint.load(tmp_path)
    assert np.array_equal(arrays["w"], np.arange(4.0)) and meta["step"] == 2 and meta["note"] == "é"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-000000002.npz", "checkpoint.json"]


def test_a_checkpoint_cut_off_while_written_leaves_the_last_whole_one(tmp_path, monkeypatch):
    checkpoint.save(tmp_path, {"w": np.arange(3.0)}, {"step": 1})

    def power_cut(path, data):  # the JSON never lands
        if path.name == "checkpoint.json":
            raise OSError("No space left on device")
        (path.parent / path.name).write_bytes(data)

    monkeypatch.setattr(checkpoint, "write_atomically", power_cut)
    with pytest.raises(OSError):
        checkpoint.save(tmp_path, {"w": np.arange(9.0)}, {"step": 2})
    monkeypatch.undo()
    arrays, meta = checkpoint.load(tmp_path)
    assert meta["step"] == 1 and np.array_equal(arrays["w"], np.arange(3.0))


@pytest.mark.parametrize("make", [text_data.CharTokenizer.fit, lambda text: text_data.ByteTokenizer()])
def test_encoding_a_long_text_takes_little_more_than_its_tokens(make):
    """A text of 2,000,000 characters: the int32 tokens are 8 MB, and the encoder's peak stays within them and
    a chunk's arrays (the peak that encoding_memory estimates), where a list of Python ints would take 15x
    the text."""
    import tracemalloc

    text = ("the cat sat on a mat, and the dog ran to it. " * 50_000)[:2_000_000]
    tokenizer = make(text)
    tracemalloc.start()
    ids = tokenizer.encode(text)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert ids.dtype == np.int32 and len(ids) == len(text)
    assert peak <= text_data.encoding_memory(text, tokenizer) <= 4 * len(text) + 4 * 2**20, peak


def test_a_text_whose_tokens_would_not_fit_is_refused_before_it_is_encoded(monkeypatch):
    limits = sys.modules["limits"]
    monkeypatch.setattr(limits, "memory_available", lambda: 1e6)
    monkeypatch.setattr(limits, "memory_total", lambda: 2e6)
    text = "x" * 1_000_000
    with pytest.raises(text_data.DataError, match=r"encoding the text into tokens needs about [0-9.]+ MiB"):
        text_data.check_encoding(text, text_data.CharTokenizer.fit(text), "--data big.txt")
