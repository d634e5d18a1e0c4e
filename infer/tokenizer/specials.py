"""Splitting text at special tokens written in it, before the ordinary tokenizer sees it.

llama.cpp does this in one fixed order, and the order decides what happens when special tokens
overlap: every special token, longest text first, cuts each still-unsplit piece at each of its
occurrences, left to right. User-defined tokens are always cut out; control and unknown tokens
only when the caller asks to parse specials.
"""

from __future__ import annotations

import re

from .vocab import TokenType, Vocab

# A piece of the input: a str still to be tokenized, or an int that is already a token id.
Fragment = str | int


class SpecialSplitter:
    def __init__(self, vocab: Vocab) -> None:
        kinds = (TokenType.CONTROL, TokenType.USER_DEFINED, TokenType.UNKNOWN)
        specials = [i for i, kind in enumerate(vocab.types) if kind in kinds]
        # longest UTF-8 text first (llama.cpp compares byte lengths); ids break ties so the order is fixed
        specials.sort(key=lambda i: (-len(vocab.tokens[i].encode()), i))
        self._all = [(i, vocab.tokens[i]) for i in specials]
        self._user_defined = [(i, t) for i, t in self._all if vocab.types[i] == TokenType.USER_DEFINED]
        # one regex per mode, used only to skip the splitting loop for text without any special token
        self._probe_all = _probe(self._all)
        self._probe_user_defined = _probe(self._user_defined)

    def split(self, text: str, parse_special: bool) -> list[Fragment]:
        if not text:
            return []
        specials, probe = (
            (self._all, self._probe_all) if parse_special else (self._user_defined, self._probe_user_defined)
        )
        if probe is None or probe.search(text) is None:
            return [text]
        fragments: list[Fragment] = [text]
        for token_id, token_text in specials:
            if token_text not in text:
                continue
            fragments = _cut(fragments, token_id, token_text)
        return fragments


def _cut(fragments: list[Fragment], token_id: int, token_text: str) -> list[Fragment]:
    out: list[Fragment] = []
    for fragment in fragments:
        if isinstance(fragment, int):
            out.append(fragment)
            continue
        start = 0
        while (found := fragment.find(token_text, start)) >= 0:
            if found > start:
                out.append(fragment[start:found])
            out.append(token_id)
            start = found + len(token_text)
        if start < len(fragment):
            out.append(fragment[start:])
    return out


def _probe(specials: list[tuple[int, str]]) -> re.Pattern[str] | None:
    if not specials:
        return None
    return re.compile("|".join(re.escape(text) for _, text in specials))
