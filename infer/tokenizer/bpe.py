"""`tokenizer.ggml.model == "gpt2"`: byte-level BPE built with the `tokenizers` package.

The pre-tokenizer is not stored in GGUF, only its name (`tokenizer.ggml.pre`); the regexes below
are the ones llama.cpp applies for each name. Several regexes run one after another, each
splitting the pieces the previous one left (so "smollm" first isolates every digit). Special
tokens never reach this model: they are split off before (see specials.py).
"""

from __future__ import annotations

from .vocab import TokenizerError, TokenType, Vocab

_CONTRACTIONS_ANY_CASE = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3 = (_CONTRACTIONS_ANY_CASE
          + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2 = (_CONTRACTIONS_ANY_CASE
         + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# o200k (gpt-oss, Llama 4): words split at case changes, a contraction kept on its word, digits in threes
_CASED_CONTRACTION = "(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+" + _CASED_CONTRACTION
         + r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*" + _CASED_CONTRACTION
         + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")

_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]")
_DIGITS_THEN_GPT2 = (r"\p{N}", GPT2)

# tokenizer.ggml.pre -> (regexes, ignore_merges: a word that is itself a token is not merged)
PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool]] = {
    "default": (_DEFAULT, False),
    **{name: ((LLAMA3,), True) for name in ("llama3", "llama-v3", "llama-bpe", "falcon3")},
    **{name: ((LLAMA3,), False) for name in ("dbrx", "smaug-bpe")},
    **{name: ((QWEN2,), False) for name in ("qwen2", "stablelm2", "megrez")},
    **{name: ((GPT4O,), False) for name in ("gpt-4o", "llama4")},
    **{name: (_DIGITS_THEN_GPT2, False)
       for name in ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b")},
    # llama.cpp spells it "gpt-2"; "gpt2" is accepted as the same thing
    **{name: ((GPT2,), False)
       for name in ("gpt-2", "gpt2", "phi-2", "roberta-bpe", "mpt", "olmo", "jais", "jina-es", "jina-de",
                    "gigachat", "jina-v1-en", "jina-v2-es", "jina-v2-de", "jina-v2-code")},
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from each byte to a printable character (how BPE vocabularies store bytes)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


BYTE_TO_CHAR = _bytes_to_unicode()
CHAR_TO_BYTE = {c: b for b, c in BYTE_TO_CHAR.items()}


class BpeSegmenter:
    """Turns one text fragment (no special tokens in it) into token ids."""

    def __init__(self, vocab: Vocab) -> None:
        from tokenizers import Regex, models, pre_tokenizers
        from tokenizers import Tokenizer as HfTokenizer

        if vocab.pre not in PRE_TOKENIZERS:
            raise TokenizerError(
                f"unsupported pre-tokenizer tokenizer.ggml.pre={vocab.pre!r} "
                f"(supported: {', '.join(sorted(PRE_TOKENIZERS))})"
            )
        regexes, ignore_merges = PRE_TOKENIZERS[vocab.pre]
        token_ids = {text: i for i, text in enumerate(vocab.tokens)}
        merges = []
        for rank, line in enumerate(vocab.merges):
            # split at the first space after the first character, as llama.cpp does
            cut = line.find(" ", 1)
            if cut < 0:
                raise TokenizerError(f"tokenizer.ggml.merges[{rank}] is not two tokens: {line!r}")
            left, right = line[:cut], line[cut + 1:]
            # tokenizers refuses merges whose parts or result are not tokens; such a merge can
            # never produce a token anyway, and dropping it keeps the others' relative ranks
            if left in token_ids and right in token_ids and left + right in token_ids:
                merges.append((left, right))
        model = models.BPE(vocab=token_ids, merges=merges, ignore_merges=ignore_merges)
        self._tokenizer = HfTokenizer(model)
        self._tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(rx), behavior="isolated") for rx in regexes]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )

    def encode(self, text: str, after_special: bool) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids


def bpe_piece_bytes(vocab: Vocab, token_id: int) -> bytes:
    """The bytes a token stands for when it is not a control/unknown token."""
    text = vocab.tokens[token_id]
    if vocab.types[token_id] == TokenType.USER_DEFINED:
        return text.encode()  # stored as plain text, not byte-mapped
    try:
        return bytes(CHAR_TO_BYTE[c] for c in text)
    except KeyError:
        return text.encode()
