"""Turning generated tokens into text one token at a time without printing half a character.

A byte-level BPE token can end in the middle of a UTF-8 sequence (an emoji is often two or three
tokens), and so can a sentencepiece byte-fallback token. The decoder keeps such an unfinished tail
until the next token completes it.
"""

from __future__ import annotations

from .core import Tokenizer


def _incomplete_tail(data: bytes) -> int:
    """How many bytes at the end of `data` start a UTF-8 sequence that is not finished yet."""
    # a sequence is at most 4 bytes: look back at most 3 for its lead byte
    for back in range(1, min(3, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 == 0x80:  # continuation byte: keep looking for the lead byte
            continue
        needed = 2 if byte & 0xE0 == 0xC0 else 3 if byte & 0xF0 == 0xE0 else 4 if byte & 0xF8 == 0xF0 else 1
        return back if needed > back else 0
    return 0


class StreamDecoder:
    """`push(id)` returns the text that became complete with that token; `flush()` returns what is
    left (an unfinished sequence then becomes U+FFFD). Control tokens produce no text unless
    `special`. Unlike Tokenizer.decode, no leading space is removed: a generated continuation's
    first space belongs to it."""

    def __init__(self, tokenizer: Tokenizer, special: bool = False) -> None:
        self._tokenizer = tokenizer
        self._special = special
        self._pending = b""

    def push(self, token_id: int) -> str:
        data = self._pending + self._tokenizer.token_bytes(token_id, self._special)
        keep = _incomplete_tail(data)
        ready, self._pending = (data[:-keep], data[-keep:]) if keep else (data, b"")
        return ready.decode("utf-8", errors="replace")

    def flush(self) -> str:
        data, self._pending = self._pending, b""
        return data.decode("utf-8", errors="replace")
