"""Tokenizers built from a GGUF file's vocabulary, matching llama.cpp token for token.

`Tokenizer.from_gguf(metadata)` picks the implementation from `tokenizer.ggml.model`:
"llama" (sentencepiece BPE with byte fallback) or "gpt2" (byte-level BPE with the pre-tokenizer
that `tokenizer.ggml.pre` names). `StreamDecoder` turns generated ids into text as they come.
"""

from .core import Tokenizer
from .stream import StreamDecoder
from .vocab import TokenizerError, TokenType, Vocab

__all__ = ["StreamDecoder", "TokenType", "Tokenizer", "TokenizerError", "Vocab"]
