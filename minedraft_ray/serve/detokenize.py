"""Token ids -> text for one output: incremental detokenization, stop strings, what may be streamed.

Text is released only when it is complete: a decode that ends in U+FFFD (an incomplete UTF-8 character,
e.g. the first bytes of an emoji split across byte-level tokens) is held back until the next token
completes it, or until the output ends. Streamed and non-streamed responses are built from the same
`OutputText`, so their texts are equal by construction.

Stop strings are cut here, not in the engine: the text is truncated before the earliest stop string, and
the output keeps only the tokens needed to produce the kept text (the fewest leading tokens whose text
covers it: a token that straddles the stop string counts, later tokens do not). `completion_tokens` and
logprobs use that count. While streaming, a tail of the text that could be the start of a stop string is
held back until it is known not to be one.
"""
from __future__ import annotations

import bisect

import json
import re

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT = 5   # prompt tokens decoded with the output: SentencePiece spaces depend on the left context


def plain_decoder(tokenizer):
    """The Rust tokenizer's own `decode` when the tokenizer's `decode` is exactly it (a fast tokenizer that neither
    overrides decoding nor cleans up spaces), else None. Streaming decodes twice per token: the Python layers around
    the Rust call (input conversion, options) cost several times the decode of a short window."""
    try:
        from transformers import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:   # another transformers layout: its decode, as it is
        return None
    kind = type(tokenizer)
    if not isinstance(tokenizer, TokenizersBackend) or kind.decode is not PreTrainedTokenizerBase.decode or \
            kind._decode is not TokenizersBackend._decode or tokenizer.clean_up_tokenization_spaces:
        return None
    return tokenizer._tokenizer.decode


class IncrementalDetokenizer:
    """Decodes a growing list of token ids; `push` returns only newly completed text.

    Each step decodes ids[prefix_offset:] and ids[prefix_offset:read_offset] and returns the difference
    (vLLM's scheme): a short window, so a step costs O(tokens since the last release), not O(output)."""

    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.decoder = plain_decoder(tokenizer)
        self.ids = list(prompt_ids[-PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        decode = self.decoder or self.tokenizer.decode
        return decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        return self._release(final=False)

    def flush(self) -> str:
        """The held-back text, complete or not (the output has ended)."""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.read_offset == len(self.ids):
            return ""
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset:])
        if len(full_text) > len(prefix_text) and (final or not full_text.endswith(REPLACEMENT_CHAR)):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full_text[len(prefix_text):]
        if final:
            self.read_offset = len(self.ids)
        return ""


class OutputText:
    """One output's text: tokens in (`add`), streamable text out (`take`), cut at the first stop string.

    token_ends[i] is len(text) once token i's text has been released; tokens whose text is still held
    back wait in `pending`. After a stop string, `text`, `num_tokens` and `token_ends` describe only what
    is kept."""

    def __init__(self, tokenizer, prompt_ids: list[int], stop: list[str] | tuple[str, ...] = (),
                 stop_token_ids: tuple[int, ...] | frozenset[int] = ()):
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self.stop = tuple(s for s in stop if s)
        # the engine ends the output at a stop token id: that token counts, its text is left out (as vLLM)
        self.stop_token_ids = frozenset(stop_token_ids)
        self.stop_string: str | None = None   # the stop string that ended the output
        self.max_stop = max((len(s) for s in self.stop), default=0)
        self.text = ""
        self.token_ends: list[int] = []
        self.pending = 0            # tokens pushed whose text has not been released yet
        self.stopped = False        # a stop string ended the output
        self.finished = False
        self.sent = 0               # characters already handed out by `take`

    @property
    def num_tokens(self) -> int:
        return len(self.token_ends) + self.pending

    def add(self, token_ids: list[int]) -> bool:
        """Append tokens; returns True if a stop string has ended the output (later tokens are ignored)."""
        for tok in token_ids:
            if self.stopped:
                break
            self._append("" if tok in self.stop_token_ids else self.detok.push(tok), new_tokens=1)
        return self.stopped

    def finish(self) -> None:
        """The engine ended the output (EOS or max_tokens): release everything held back."""
        if not self.stopped:
            self._append(self.detok.flush(), new_tokens=0)
        if not self.stopped:  # tokens without text of their own (EOS) end where the text ends
            self.token_ends += [len(self.text)] * self.pending
            self.pending = 0
        self.finished = True

    def _append(self, delta: str, new_tokens: int) -> None:
        self.pending += new_tokens
        if not delta:
            return
        start = len(self.text)
        self.text += delta
        self.token_ends += [len(self.text)] * self.pending
        self.pending = 0
        if self.stop:
            self._find_stop(max(0, start - self.max_stop + 1))

    def _find_stop(self, search_from: int) -> None:
        hits = [(i, s) for i, s in ((self.text.find(s, search_from), s) for s in self.stop) if i >= 0]
        if not hits:
            return
        cut, self.stop_string = min(hits, key=lambda hit: hit[0])
        self.text = self.text[:cut]
        # keep the fewest leading tokens whose text reaches `cut`
        keep = next((i + 1 for i, end in enumerate(self.token_ends) if end >= cut), 0) if cut else 0
        self.token_ends = [min(end, cut) for end in self.token_ends[:keep]]
        self.pending = 0
        self.stopped = self.finished = True

    def _held_back(self) -> int:
        """Characters at the end of the text that could be the start of a stop string."""
        if self.finished or not self.stop:
            return 0
        tail = self.text[-(self.max_stop - 1):] if self.max_stop > 1 else ""
        for n in range(len(tail), 0, -1):
            if any(s.startswith(tail[-n:]) for s in self.stop):
                return n
        return 0

    def take(self) -> tuple[str, int]:
        """(text that may be streamed now, number of tokens whose text is fully included so far)."""
        end = len(self.text) - self._held_back()
        chunk = self.text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return chunk, self.tokens_within(self.sent)

    def tokens_within(self, chars: int) -> int:
        """Number of leading tokens whose text ends within the first `chars` characters."""
        return bisect.bisect_right(self.token_ends, chars)   # token_ends never decreases


# ---------------------------------------------------------------- token strings for logprobs

def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: byte value -> the printable character standing for it."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


_UNICODE_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _uses_byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    return '"ByteLevel"' in json.dumps(json.loads(backend.to_str()).get("decoder"))


class TokenStrings:
    """Per-token text and raw bytes (OpenAI logprobs' `token` and `bytes`), cached per id."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.byte_level = _uses_byte_level(tokenizer)
        self.special = set(tokenizer.all_special_ids)
        self._text: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}

    def text(self, token_id: int) -> str:
        if token_id not in self._text:
            self._text[token_id] = self.tokenizer.decode([token_id])
        return self._text[token_id]

    def bytes(self, token_id: int) -> list[int]:
        if token_id not in self._bytes:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            fallback = _BYTE_FALLBACK.fullmatch(piece or "")
            if fallback:
                raw = bytes([int(fallback.group(1), 16)])
            elif self.byte_level and token_id not in self.special and piece and all(c in _UNICODE_TO_BYTE for c in piece):
                raw = bytes(_UNICODE_TO_BYTE[c] for c in piece)
            else:
                raw = self.text(token_id).encode()
            self._bytes[token_id] = list(raw)
        return self._bytes[token_id]
