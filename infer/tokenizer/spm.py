"""`tokenizer.ggml.model == "llama"`: a sentencepiece BPE model rebuilt from the GGUF vocabulary.

The GGUF file keeps each piece's text, score and type; those are exactly the fields of
sentencepiece's ModelProto, so the model is rebuilt and handed to SentencePieceProcessor.
Normalization is switched off: llama.cpp does its own whitespace handling (a leading space on
each text fragment that starts the input or follows a special token, then " " -> "▁"), so the
escaped text is what sentencepiece sees.
"""

from __future__ import annotations

from .vocab import TokenizerError, TokenType, Vocab

SPACE_MARK = "\u2581"  # "▁", sentencepiece's visible space


class SpmSegmenter:
    """Turns one text fragment (no special tokens in it) into token ids."""

    def __init__(self, vocab: Vocab) -> None:
        try:
            import sentencepiece
            from sentencepiece import sentencepiece_model_pb2 as model_pb2
        except ImportError as err:  # protobuf is what is usually missing
            raise TokenizerError(f"the 'llama' tokenizer needs sentencepiece with protobuf ({err})") from None
        if TokenType.UNKNOWN not in vocab.types:
            raise TokenizerError("'llama' tokenizer without an unknown token (no token of type UNKNOWN)")
        proto = model_pb2.ModelProto()
        proto.trainer_spec.model_type = model_pb2.TrainerSpec.BPE
        proto.trainer_spec.byte_fallback = TokenType.BYTE in vocab.types
        proto.normalizer_spec.name = "identity"
        proto.normalizer_spec.add_dummy_prefix = False
        proto.normalizer_spec.remove_extra_whitespaces = False
        proto.normalizer_spec.escape_whitespaces = False
        for text, score, kind in zip(vocab.tokens, vocab.scores, vocab.types, strict=True):
            piece = proto.pieces.add()
            piece.piece = text
            piece.score = score
            # sentencepiece uses the GGUF numbering; UNDEFINED has no counterpart and acts as normal
            piece.type = kind if kind != TokenType.UNDEFINED else TokenType.NORMAL
        self._processor = sentencepiece.SentencePieceProcessor()
        try:
            self._processor.LoadFromSerializedProto(proto.SerializeToString())
        except (RuntimeError, OSError) as err:
            raise TokenizerError(f"sentencepiece rejects the GGUF vocabulary: {str(err).splitlines()[0]}") from None
        self._add_space_prefix = vocab.add_space_prefix

    def encode(self, text: str, after_special: bool) -> list[int]:
        """`after_special`: the fragment starts the input or follows a special token, which is where
        llama.cpp puts the leading space."""
        if self._add_space_prefix and after_special:
            text = " " + text
        return self._processor.EncodeAsIds(text.replace(" ", SPACE_MARK))


def spm_piece_bytes(vocab: Vocab, token_id: int) -> bytes:
    """The bytes a token stands for when it is not a control/unknown token."""
    text = vocab.tokens[token_id]
    kind = vocab.types[token_id]
    if kind == TokenType.BYTE:
        # "<0xAB>"
        return bytes([int(text[3:5], 16)])
    if kind in (TokenType.NORMAL, TokenType.UNDEFINED):
        return text.replace(SPACE_MARK, " ").encode()
    return text.encode()
