"""The tokenizer the engine uses: text <-> token ids, as llama.cpp does it for the same GGUF file."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from .bpe import BpeSegmenter, bpe_piece_bytes
from .specials import SpecialSplitter
from .spm import SpmSegmenter, spm_piece_bytes
from .vocab import TokenizerError, TokenType, Vocab

# token types whose text is markup, not content: shown only when asked for (llama.cpp's `special`)
_HIDDEN_UNLESS_SPECIAL = (TokenType.CONTROL, TokenType.UNKNOWN)
# token types that have no text at all (llama.cpp renders them as nothing)
_WITHOUT_TEXT = (TokenType.UNUSED, TokenType.UNDEFINED)


class Tokenizer:
    """Build with `Tokenizer.from_gguf(metadata)`; `metadata` maps GGUF keys to Python values."""

    def __init__(self, vocab: Vocab) -> None:
        self.vocab = vocab
        self._splitter = SpecialSplitter(vocab)
        if vocab.model == "llama":
            self._segmenter: SpmSegmenter | BpeSegmenter = SpmSegmenter(vocab)
            piece_bytes = spm_piece_bytes
        else:
            self._segmenter = BpeSegmenter(vocab)
            piece_bytes = bpe_piece_bytes
        # bytes of every token, computed once: decoding is then a join
        self._content = [
            b"" if kind in _WITHOUT_TEXT or kind in _HIDDEN_UNLESS_SPECIAL else piece_bytes(vocab, i)
            for i, kind in enumerate(vocab.types)
        ]
        self._markup = {
            i: vocab.tokens[i].encode() for i, kind in enumerate(vocab.types) if kind in _HIDDEN_UNLESS_SPECIAL
        }

    @classmethod
    def from_gguf(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        return cls(Vocab.from_gguf(metadata))

    # --- ids -------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.vocab.size

    @property
    def bos_id(self) -> int | None:
        return self.vocab.bos_id

    @property
    def eos_id(self) -> int | None:
        return self.vocab.eos_id

    @property
    def eot_ids(self) -> frozenset[int]:
        """Every id that ends generation: EOS, EOT, EOM and the end markers llama.cpp recognizes."""
        return self.vocab.eog_ids

    def is_eog(self, token_id: int) -> bool:
        return token_id in self.vocab.eog_ids

    def token_text(self, token_id: int) -> str:
        """The token as the vocabulary stores it (e.g. 'Ġthe', '▁the', '<|im_end|>')."""
        return self.vocab.tokens[self._check(token_id)]

    # --- text -> ids -----------------------------------------------------------------------

    def encode(
        self, text: str, add_bos: bool | None = None, special: bool = True, add_eos: bool | None = None,
        continues: bool = False,
    ) -> list[int]:
        """Token ids of `text`.

        add_bos / add_eos: None follows the file (`tokenizer.ggml.add_bos_token` / `add_eos_token`,
        with llama.cpp's defaults), True or False forces it. special: special and control tokens
        written in the text (e.g. '<|im_start|>') become those tokens; with False they are
        tokenized as plain text. User-defined tokens are matched either way, as in llama.cpp.
        continues: the text goes on from earlier tokens (a grammar's forced text inside an answer),
        so sentencepiece's leading space is not put in front of it.
        """
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            raise TokenizerError(f"text is not valid Unicode ({err.reason} at character {err.start})") from None
        add_bos = self.vocab.add_bos if add_bos is None else add_bos
        add_eos = self.vocab.add_eos if add_eos is None else add_eos
        ids: list[int] = []
        if add_bos:
            ids.append(self._required(self.vocab.bos_id, "BOS"))
        after_special = not continues
        for fragment in self._splitter.split(text, special):
            if isinstance(fragment, int):
                ids.append(fragment)
                after_special = True
            else:
                ids.extend(self._segmenter.encode(fragment, after_special))
                after_special = False
        if add_eos:
            ids.append(self._required(self.vocab.eos_id, "EOS"))
        return ids

    # --- ids -> text -----------------------------------------------------------------------

    def token_bytes(self, token_id: int, special: bool = False) -> bytes:
        """The bytes one token contributes to text. Control and unknown tokens contribute nothing
        unless `special` (then their written form, e.g. b'<|im_end|>')."""
        token_id = self._check(token_id)
        if special and token_id in self._markup:
            return self._markup[token_id]
        return self._content[token_id]

    def decode_bytes(self, ids: Iterable[int], special: bool = False) -> bytes:
        data = b"".join(self.token_bytes(i, special) for i in ids)
        if self.vocab.add_space_prefix and data.startswith(b" "):
            # the space encode() put in front of the text (sentencepiece's dummy prefix)
            data = data[1:]
        return data

    def decode(self, ids: Iterable[int], special: bool = False) -> str:
        """Text of `ids`; bytes that are not valid UTF-8 (a token sequence cut inside a character)
        become U+FFFD. For a 'llama' tokenizer the leading space that encode() adds is removed, so
        decode(encode(text)) == text."""
        return self.decode_bytes(ids, special).decode("utf-8", errors="replace")

    # --- helpers ---------------------------------------------------------------------------

    def _check(self, token_id: int) -> int:
        if not 0 <= token_id < self.vocab.size:
            raise TokenizerError(f"token id {token_id} is outside the vocabulary (0..{self.vocab.size - 1})")
        return token_id

    @staticmethod
    def _required(token_id: int | None, name: str) -> int:
        if token_id is None:
            raise TokenizerError(f"the vocabulary has no {name} token to add")
        return token_id
