"""Incremental detokenization and stop strings on the tiny byte-level BPE tokenizer (multibyte
characters are split across tokens there: 'é' is two tokens, an emoji four)."""
import random

import pytest

from minedraft_ray.serve.detokenize import REPLACEMENT_CHAR, OutputText, TokenStrings
from minedraft_ray.testing.tiny import build_tokenizer

TEXTS = ["héllo 😀 世界 café", "日本語のテキスト🎉🎉 mixed with ASCII", "The quick brown fox jumps over the lazy dog.",
         "emoji at the end 👩‍👩‍👧", "ça va? ñandú — “quotes” …"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def stream(tok, ids, stop=(), prompt=(), runs=(1,), seed=0):
    """Feed ids in runs of random lengths (like accepted draft runs); returns (chunks, OutputText)."""
    rng = random.Random(seed)
    out = OutputText(tok, list(prompt), stop)
    chunks, i = [], 0
    while i < len(ids) and not out.stopped:
        n = rng.choice(runs)
        out.add(ids[i:i + n])
        i += n
        chunks.append(out.take()[0])
    out.finish()
    chunks.append(out.take()[0])
    return [c for c in chunks if c], out


@pytest.mark.parametrize("runs", [(1,), (1, 2, 3, 5)])
@pytest.mark.parametrize("text", TEXTS)
def test_multibyte_never_split(tok, text, runs):
    ids = tok.encode(text)
    assert any(REPLACEMENT_CHAR in tok.decode([i]) for i in ids) or text.isascii()  # the case is real
    chunks, out = stream(tok, ids, prompt=tok.encode("Prompt: "), runs=runs)
    assert "".join(chunks) == text == out.text
    for chunk in chunks:
        assert REPLACEMENT_CHAR not in chunk, chunks
        chunk.encode("utf-8")  # a lone surrogate would raise
    assert out.num_tokens == len(ids) and out.tokens_within(len(text)) == len(ids)


def test_random_tokens_match_full_decode(tok):
    rng = random.Random(0)
    vocab = len(tok)
    for trial in range(30):
        ids = [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 40))]
        chunks, out = stream(tok, ids, runs=(1, 2, 4), seed=trial)
        full = tok.decode(ids, skip_special_tokens=True)
        assert "".join(chunks) == out.text == full
        # only the final flush may end in an incomplete character
        assert all(not c.endswith(REPLACEMENT_CHAR) for c in chunks[:-1])


def test_eos_is_counted_but_not_printed(tok):
    ids = tok.encode("two plus two") + [tok.eos_token_id]
    chunks, out = stream(tok, ids)
    assert "".join(chunks) == "two plus two"
    assert out.num_tokens == len(ids) == out.tokens_within(len(out.text))


@pytest.mark.parametrize("runs", [(1,), (2, 3, 7)])
def test_stop_string_across_tokens(tok, runs):
    text = "The quick brown fox jumps over the lazy dog."
    ids = tok.encode(text)
    stop = "own fox j"
    chunks, out = stream(tok, ids, stop=[stop, "never"], runs=runs)
    kept = text[:text.index(stop)]
    assert out.stopped and out.text == kept == "".join(chunks)
    # the kept tokens are the fewest whose text covers the kept text
    n = out.num_tokens
    assert tok.decode(ids[:n]).startswith(kept) and len(tok.decode(ids[:n - 1])) < len(kept)
    assert out.tokens_within(len(kept)) == n


def test_earliest_stop_string_wins(tok):
    ids = tok.encode("a journey of a thousand miles begins")
    _, out = stream(tok, ids, stop=["miles", "of a", "journey of"], runs=(9,))
    assert out.text == "a "


def test_stop_string_at_the_start_keeps_nothing(tok):
    ids = tok.encode("Paris is the capital")
    chunks, out = stream(tok, ids, stop=["Par"])
    assert out.text == "" and chunks == [] and out.num_tokens == 0


def test_multibyte_stop_string(tok):
    text = "I am 😀 happy"
    chunks, out = stream(tok, tok.encode(text), stop=["😀"])
    assert out.text == "I am " == "".join(chunks)


def test_possible_stop_prefix_is_held_back(tok):
    out = OutputText(tok, [], stop=["fox!"])
    out.add(tok.encode("the brown fo"))
    assert out.take()[0] == "the brown "       # "fo" could start "fox!"
    out.add(tok.encode("x"))
    assert out.take()[0] == ""                 # "fox" still could
    out.add(tok.encode(" runs"))
    assert out.take()[0] == "fox runs"         # it was not
    out.finish()
    assert out.text == "the brown fox runs" and not out.stopped


def test_hold_back_is_released_at_the_end(tok):
    out = OutputText(tok, [], stop=["fox!"])
    out.add(tok.encode("the brown fox"))
    assert out.take()[0] == "the brown "
    out.finish()
    assert out.take()[0] == "fox"


def test_token_bytes_rebuild_multibyte_text(tok):
    strings = TokenStrings(tok)
    for text in TEXTS:
        ids = tok.encode(text)
        assert bytes(b for i in ids for b in strings.bytes(i)) == text.encode()
    assert strings.bytes(tok.eos_token_id) == list(tok.eos_token.encode())
    assert strings.text(tok.encode(" c")[0]) == " c"


def test_plain_decoder_equals_decode(tok):
    """The streaming fast path (the Rust decode without transformers' layers) gives decode's text for any ids,
    special ones included; a tokenizer that cleans up spaces keeps its own decode."""
    from minedraft_ray.serve.detokenize import IncrementalDetokenizer, plain_decoder

    decode = plain_decoder(tok)
    assert decode is not None and IncrementalDetokenizer(tok, []).decoder is not None   # the fast path is taken
    rng = random.Random(0)
    windows = [tok.encode(t) for t in TEXTS] + [[rng.randrange(len(tok)) for _ in range(rng.randint(1, 8))]
                                                 for _ in range(300)] + [list(tok.all_special_ids)]
    for ids in windows:
        for skip in (True, False):
            assert decode(ids, skip_special_tokens=skip) == tok.decode(ids, skip_special_tokens=skip), ids
    tok.clean_up_tokenization_spaces = True
    try:
        assert plain_decoder(tok) is None
    finally:
        tok.clean_up_tokenization_spaces = False
