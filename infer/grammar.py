"""Constrained decoding: output held to JSON (any object, or one JSON Schema), through llguidance.

llguidance (the grammar engine llama.cpp and vLLM can use) computes, before each token, the set of
vocabulary entries that keep the text inside the grammar; `infer.sampler.Sampler` bans the rest
(their logits go to -inf) and tells the grammar which token it chose. When the grammar is complete
the only allowed tokens are the end-of-generation ones, so generation stops there.

    constraint = json_constraint(tokenizer, {"type": "object", "properties": {...}})
    sampler = Sampler(config, constraint)
"""

from __future__ import annotations

import json
import threading
import weakref
from typing import Any

import numpy as np

from infer.tokenizer import Tokenizer, TokenType

_LL_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Tokenizer -> LLTokenizer
_LOCK = threading.Lock()


class GrammarError(ValueError):
    """A schema llguidance cannot compile, or a grammar that reached a state it cannot leave."""


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as err:  # a dependency of the package; absent only in a broken install
        raise GrammarError("constrained decoding needs the llguidance package (pip install llguidance)") from err
    return llguidance


class _Encoder:
    """The tokenizer llguidance calls for text it must tokenize (it never sees a BOS)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_id if tokenizer.eos_id is not None else min(tokenizer.eot_ids, default=0)
        self.bos_token_id = tokenizer.bos_id
        vocab = tokenizer.vocab
        self.tokens: list[bytes] = []
        self.special_token_ids: list[int] = []
        for i, kind in enumerate(vocab.types):
            text = vocab.tokens[i]
            # markup tokens (and user-defined ones written like markup) are no text: llguidance's
            # rule marks them with a leading 0xff so no grammar can produce them as characters
            if kind in (TokenType.CONTROL, TokenType.UNKNOWN) or (
                    kind == TokenType.USER_DEFINED and text.startswith("<") and text.endswith(">")):
                self.tokens.append(b"\xff" + text.encode())
                self.special_token_ids.append(i)
            else:
                self.tokens.append(tokenizer.token_bytes(i))

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            raise TypeError("takes str")  # llguidance probes with bytes, then passes str
        # the text continues the answer: no sentencepiece leading space, or llguidance would force
        # a space token before the '{' of a JSON answer and then refuse that very token
        return self.tokenizer.encode(text, add_bos=False, add_eos=False, special=False, continues=True)


def ll_tokenizer(tokenizer: Tokenizer) -> Any:
    """llguidance's view of `tokenizer` (built once per tokenizer: it walks the whole vocabulary)."""
    ll = _llguidance()
    with _LOCK:
        built = _LL_TOKENIZERS.get(tokenizer)
        if built is None:
            eog = sorted(tokenizer.eot_ids | ({tokenizer.eos_id} if tokenizer.eos_id is not None else set()))
            wrapper = ll.TokenizerWrapper(_Encoder(tokenizer))
            try:
                built = ll.LLTokenizer(wrapper, n_vocab=tokenizer.vocab_size, eos_token=eog or None)
            except TypeError:  # older llguidance takes one end token (1.6.1, the newest wheel for glibc 2.28)
                one = tokenizer.eos_id if tokenizer.eos_id is not None else (eog[0] if eog else None)
                built = ll.LLTokenizer(wrapper, n_vocab=tokenizer.vocab_size, eos_token=one)
            _LL_TOKENIZERS[tokenizer] = built
    return built


class GrammarConstraint:
    """A `infer.sampler.Constraint` over one llguidance grammar."""

    def __init__(self, tokenizer: Tokenizer, grammar: str) -> None:
        ll = _llguidance()
        self._matcher = ll.LLMatcher(ll_tokenizer(tokenizer), grammar, log_level=0)
        if self._matcher.is_error():
            raise GrammarError(self._matcher.get_error())
        self._vocab = tokenizer.vocab_size

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing more."""
        return self._matcher.is_stopped()

    def allowed(self, vocab_size: int) -> np.ndarray:
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        if self._matcher.is_error():
            raise GrammarError(f"the grammar failed: {self._matcher.get_error()}")
        mask = np.unpackbits(bits, bitorder="little")[: self._vocab].astype(bool)
        out = np.zeros(vocab_size, dtype=bool)  # logits past the vocabulary (padding) stay banned
        n = min(vocab_size, mask.size)
        out[:n] = mask[:n]
        return out

    def accept(self, token: int) -> None:
        if not self._matcher.consume_token(token):
            raise GrammarError(f"token {token} breaks the grammar: {self._matcher.get_error()}")


def json_constraint(tokenizer: Tokenizer, schema: dict[str, Any] | None = None) -> GrammarConstraint:
    """Output that is one JSON value matching `schema` (None: any JSON object, OpenAI's json_object)."""
    ll = _llguidance()
    try:
        grammar = ll.LLMatcher.grammar_from_json_schema(
            json.dumps({"type": "object"} if schema is None else schema),
            defaults={"whitespace_flexible": False})  # compact JSON: no runs of blank lines to wander into
    except (ValueError, TypeError) as err:
        raise GrammarError(f"the JSON schema cannot be used: {err}") from None
    error = ll.LLMatcher.validate_grammar(grammar, ll_tokenizer(tokenizer))
    if error and not error.startswith("WARNING"):
        raise GrammarError(f"the JSON schema cannot be used: {error}")
    return GrammarConstraint(tokenizer, grammar)
