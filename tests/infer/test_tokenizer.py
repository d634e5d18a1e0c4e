"""Tokenizer behaviour on small hand-made vocabularies: errors for unusable metadata, special-token
splitting rules, BOS/EOS, end-of-generation tokens, and the stream decoder."""

from __future__ import annotations

from typing import Any

import pytest

from infer.tokenizer import StreamDecoder, Tokenizer, TokenizerError, TokenType
from infer.tokenizer.bpe import BYTE_TO_CHAR

SPECIALS = ["<|start|>", "<|start|><|x|>", "<|eot_id|>", "<tool>"]


def _gpt2_metadata(**overrides: Any) -> dict[str, Any]:
    """A byte-level BPE vocabulary: the 256 byte characters, a few merges, then special tokens."""
    tokens = [BYTE_TO_CHAR[b] for b in range(256)]
    merges = ["h e", "l l", "he ll", "hell o", "Ġ w"]
    for merge in merges:
        tokens.append(merge.replace(" ", ""))
    tokens += SPECIALS
    types = [TokenType.NORMAL] * (len(tokens) - len(SPECIALS)) + [
        TokenType.CONTROL, TokenType.CONTROL, TokenType.NORMAL, TokenType.USER_DEFINED,
    ]
    metadata = {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [int(t) for t in types], "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": tokens.index("<|start|>"), "tokenizer.ggml.eos_token_id": 0,
    }
    return {**metadata, **overrides}


def _id(tokenizer: Tokenizer, text: str) -> int:
    return tokenizer.vocab.tokens.index(text)


def test_byte_level_bpe_applies_merges() -> None:
    tokenizer = Tokenizer.from_gguf(_gpt2_metadata())
    assert [tokenizer.token_text(i) for i in tokenizer.encode("hello world", add_bos=False)] == [
        "hello", "Ġw", "o", "r", "l", "d",
    ]


def test_control_tokens_are_parsed_only_with_special() -> None:
    tokenizer = Tokenizer.from_gguf(_gpt2_metadata())
    start = _id(tokenizer, "<|start|>")
    assert tokenizer.encode("<|start|>hello", add_bos=False, special=True) == [start, _id(tokenizer, "hello")]
    as_text = tokenizer.encode("<|start|>hello", add_bos=False, special=False)
    assert start not in as_text and tokenizer.decode(as_text) == "<|start|>hello"


def test_user_defined_tokens_are_matched_even_without_special() -> None:
    tokenizer = Tokenizer.from_gguf(_gpt2_metadata())
    tool = _id(tokenizer, "<tool>")
    assert tokenizer.encode("a<tool>b", add_bos=False, special=False) == [ord("a"), tool, ord("b")]
    assert tokenizer.decode([tool]) == "<tool>"  # user-defined tokens are content, not markup


def test_longer_special_token_wins_over_its_prefix() -> None:
    tokenizer = Tokenizer.from_gguf(_gpt2_metadata())
    ids = tokenizer.encode("<|start|><|x|><|start|>", add_bos=False, special=True)
    assert ids == [_id(tokenizer, "<|start|><|x|>"), _id(tokenizer, "<|start|>")]


def test_end_of_turn_text_is_forced_to_control_and_ends_generation() -> None:
    tokenizer = Tokenizer.from_gguf(_gpt2_metadata())
    eot = _id(tokenizer, "<|eot_id|>")  # stored as NORMAL, recognized by its text as llama.cpp does
    assert tokenizer.vocab.types[eot] == TokenType.CONTROL
    assert tokenizer.is_eog(eot) and tokenizer.is_eog(tokenizer.eos_id)
    assert tokenizer.eot_ids == {eot, 0}
    assert not tokenizer.is_eog(_id(tokenizer, "hello"))
    assert tokenizer.decode([eot]) == "" and tokenizer.decode([eot], special=True) == "<|eot_id|>"


def test_bos_and_eos_follow_the_file_unless_forced() -> None:
    plain = Tokenizer.from_gguf(_gpt2_metadata())
    start = plain.bos_id
    assert plain.encode("hello") == [_id(plain, "hello")]  # gpt2 default: no BOS
    assert plain.encode("hello", add_bos=True)[0] == start
    asks = Tokenizer.from_gguf(_gpt2_metadata(**{"tokenizer.ggml.add_bos_token": True,
                                                  "tokenizer.ggml.add_eos_token": True}))
    assert asks.encode("hello") == [start, _id(asks, "hello"), 0]
    assert asks.encode("hello", add_bos=False, add_eos=False) == [_id(asks, "hello")]
    assert asks.encode("") == [start, 0]
    # llama3-style pre-tokenizers add BOS by default, like llama.cpp
    llama3 = Tokenizer.from_gguf(_gpt2_metadata(**{"tokenizer.ggml.pre": "llama-bpe"}))
    assert llama3.encode("hello")[0] == start


def test_stream_decoder_waits_for_complete_characters() -> None:
    tokenizer = Tokenizer.from_gguf(_gpt2_metadata())
    llama = "🦙".encode()  # four bytes; in this vocabulary token id b stands for byte b
    decoder = StreamDecoder(tokenizer)
    out = [decoder.push(b) for b in b"a" + llama + b"b"]
    assert out == ["a", "", "", "", "🦙", "b"]
    assert decoder.flush() == ""
    # a sequence cut short is flushed as one replacement character
    assert decoder.push(llama[0]) == ""
    assert decoder.flush() == "\ufffd"


def test_stream_decoder_hides_control_tokens_unless_asked() -> None:
    tokenizer = Tokenizer.from_gguf(_gpt2_metadata())
    eot = _id(tokenizer, "<|eot_id|>")
    assert StreamDecoder(tokenizer).push(eot) == ""
    assert StreamDecoder(tokenizer, special=True).push(eot) == "<|eot_id|>"


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"tokenizer.ggml.model": "bert"}, "unsupported tokenizer model tokenizer.ggml.model='bert'"),
        ({"tokenizer.ggml.model": None}, "no tokenizer"),
        ({"tokenizer.ggml.pre": "deepseek-coder"}, "unsupported pre-tokenizer tokenizer.ggml.pre='deepseek-coder'"),
        ({"tokenizer.ggml.tokens": []}, "tokens is empty"),
        ({"tokenizer.ggml.token_type": [1, 1]}, "token_type has 2 entries"),
        ({"tokenizer.ggml.merges": None}, "merges is missing"),
        ({"tokenizer.ggml.merges": ["nospace"]}, "not two tokens"),
        ({"tokenizer.ggml.tokens": "abc"}, "must be an array of strings"),
    ],
)
def test_unusable_metadata_is_one_line_error(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(TokenizerError) as err:
        Tokenizer.from_gguf(_gpt2_metadata(**overrides))
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_repeated_token_is_refused() -> None:
    metadata = _gpt2_metadata()
    metadata["tokenizer.ggml.tokens"] = metadata["tokenizer.ggml.tokens"][:-1] + ["hello"]
    with pytest.raises(TokenizerError, match="repeats token"):
        Tokenizer.from_gguf(metadata)


def test_sentencepiece_vocabulary_needs_an_unknown_token() -> None:
    tokens = ["<s>", "</s>", "▁a", "a"]
    metadata = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
                "tokenizer.ggml.scores": [0.0, 0.0, -1.0, -2.0], "tokenizer.ggml.token_type": [3, 3, 1, 1]}
    with pytest.raises(TokenizerError, match="unknown token"):
        Tokenizer.from_gguf(metadata)


def test_text_with_lone_surrogate_is_refused() -> None:
    with pytest.raises(TokenizerError, match="not valid Unicode"):
        Tokenizer.from_gguf(_gpt2_metadata()).encode("a\ud800b")


def test_token_id_outside_the_vocabulary_is_refused() -> None:
    tokenizer = Tokenizer.from_gguf(_gpt2_metadata())
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        tokenizer.decode([tokenizer.vocab_size])



def _with_specials(specials: list[str]) -> dict[str, Any]:
    """_gpt2_metadata with these control tokens in place of SPECIALS ("<|start|>" first)."""
    base = _gpt2_metadata()
    n = len(SPECIALS)
    return _gpt2_metadata(**{"tokenizer.ggml.tokens": base["tokenizer.ggml.tokens"][:-n] + specials,
                             "tokenizer.ggml.token_type": base["tokenizer.ggml.token_type"][:-n]
                             + [int(TokenType.CONTROL)] * len(specials)})


def test_harmony_messages_end_without_ending_the_reply() -> None:
    """gpt-oss's o200k_harmony: "<|end|>" closes a message (its reasoning first), "<|return|>" and
    "<|call|>" end generation; with all three llama.cpp takes "<|end|>" off the list and shows it as
    text. Without "<|call|>" it still ends generation."""
    tokenizer = Tokenizer.from_gguf(_with_specials(["<|start|>", "<|end|>", "<|return|>", "<|call|>"]))
    end, ret, call = (_id(tokenizer, t) for t in ("<|end|>", "<|return|>", "<|call|>"))
    assert tokenizer.is_eog(ret) and tokenizer.is_eog(call) and not tokenizer.is_eog(end)
    assert tokenizer.vocab.types[end] == TokenType.USER_DEFINED and tokenizer.decode([end]) == "<|end|>"
    plain = Tokenizer.from_gguf(_with_specials(["<|start|>", "<|end|>", "<|return|>", "<|other|>"]))
    assert plain.is_eog(_id(plain, "<|end|>"))
