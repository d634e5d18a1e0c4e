"""The vocabulary a GGUF file stores under `tokenizer.ggml.*`, read into one immutable record.

Defaults for keys a file leaves out follow llama.cpp's loader, so a file tokenizes here the way
llama.cpp tokenizes it: which ids are BOS/EOS, whether BOS is added, which tokens end generation,
and which tokens count as control tokens even when the file marks them normal.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any


class TokenizerError(ValueError):
    """The GGUF metadata describes a tokenizer this engine cannot build. `str(err)` is one line."""


class TokenType(IntEnum):
    """`tokenizer.ggml.token_type` values (the same numbering sentencepiece uses)."""

    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


# Token texts llama.cpp recognizes when no metadata key names the token (facts from its
# llama-vocab.cpp). A recognized token is forced to CONTROL, so that plain text never produces it.
END_OF_TURN_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>",
    "_<EOT>", "[EOT]", "<end_of_utterance>",
)
END_OF_MESSAGE_TEXTS = ("<|eom_id|>",)
FIM_TEXTS = {  # fill-in-the-middle markers: metadata key suffix -> recognized texts
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<PRE>", "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<SUF>", "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<MID>", "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
FIM_ENDING_GENERATION = ("fim_pad", "fim_rep", "fim_sep")
# every token with one of these texts ends generation
END_OF_GENERATION_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
)

KEY = "tokenizer.ggml."


@dataclass(frozen=True)
class Vocab:
    model: str                  # "llama" (sentencepiece) or "gpt2" (byte-level BPE)
    pre: str                    # pre-tokenizer name ("default" when the file names none)
    tokens: tuple[str, ...]
    scores: tuple[float, ...]
    types: tuple[int, ...]      # TokenType per id, after llama.cpp's control-token overrides
    merges: tuple[str, ...]
    bos_id: int | None
    eos_id: int | None
    eot_id: int | None
    unk_id: int | None
    pad_id: int | None
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    eog_ids: frozenset[int]

    @property
    def size(self) -> int:
        return len(self.tokens)

    @classmethod
    def from_gguf(cls, metadata: Mapping[str, Any]) -> Vocab:
        model = metadata.get(KEY + "model")
        if model is None:
            raise TokenizerError(f"no tokenizer in the GGUF metadata ({KEY}model is missing)")
        if model not in ("llama", "gpt2"):
            raise TokenizerError(
                f"unsupported tokenizer model {KEY}model={model!r} (supported: 'llama', 'gpt2')"
            )
        tokens = _string_list(metadata, KEY + "tokens")
        if not tokens:
            raise TokenizerError(f"{KEY}tokens is empty")
        count = len(tokens)
        tokens = [text if text else f"[EMPTY_{i}]" for i, text in enumerate(tokens)]
        scores = _number_list(metadata, KEY + "scores", count, float, default=0.0)
        types = _number_list(metadata, KEY + "token_type", count, int, default=int(TokenType.NORMAL))
        merges = _string_list(metadata, KEY + "merges") if model == "gpt2" else []
        if model == "gpt2" and not merges:
            raise TokenizerError(f"{KEY}merges is missing or empty (a 'gpt2' tokenizer needs its BPE merges)")

        seen: dict[str, int] = {}
        for i, text in enumerate(tokens):
            if text in seen:
                raise TokenizerError(f"{KEY}tokens: token {i} repeats token {seen[text]} ({text!r})")
            seen[text] = i

        pre = metadata.get(KEY + "pre") or "default"
        if model == "llama":
            bos, eos, unk = 1, 2, 0
            add_bos, add_space_prefix = True, True
        else:
            bos, eos, unk = 11, 11, None
            add_bos = pre in ("llama3", "llama-v3", "llama-bpe", "falcon3")
            add_space_prefix = False
        bos = _token_id(metadata, "bos_token_id", bos, count)
        eos = _token_id(metadata, "eos_token_id", eos, count)
        unk = _token_id(metadata, "unknown_token_id", unk, count)
        pad = _token_id(metadata, "padding_token_id", None, count)
        add_bos = bool(metadata.get(KEY + "add_bos_token", add_bos))
        add_eos = bool(metadata.get(KEY + "add_eos_token", False))
        add_space_prefix = bool(metadata.get(KEY + "add_space_prefix", add_space_prefix))

        forced_control: list[int] = []

        def recognized(key: str, texts: tuple[str, ...]) -> int | None:
            found = _token_id(metadata, key + "_token_id", None, count)
            if found is None:
                found = next((seen[t] for t in texts if t in seen), None)
                if found is not None:
                    forced_control.append(found)
            return found

        eot = recognized("eot", END_OF_TURN_TEXTS)
        eom = recognized("eom", END_OF_MESSAGE_TEXTS)
        fim = {name: recognized(name, texts) for name, texts in FIM_TEXTS.items()}
        eog = {seen[t] for t in END_OF_GENERATION_TEXTS if t in seen}
        forced_control.extend(eog)
        eog |= {i for i in (eos, eot, eom, *(fim[name] for name in FIM_ENDING_GENERATION)) if i is not None}
        for i in forced_control:
            types[i] = int(TokenType.CONTROL)
        # o200k_harmony (gpt-oss): "<|end|>" closes a message, the reasoning one among them, and the
        # reply goes on; "<|return|>" and "<|call|>" end it. llama.cpp then drops "<|end|>" from the
        # tokens that end generation and shows it as text (user-defined); likewise beside "<|calls|>"
        # and "<|flush|>" (solar-open)
        texts = {tokens[i]: i for i in eog}
        if "<|end|>" in texts and (("<|return|>" in texts and "<|call|>" in texts) or
                                   (("<|call|>" in texts or "<|calls|>" in texts) and "<|flush|>" in texts)):
            eog.discard(texts["<|end|>"])
            types[texts["<|end|>"]] = int(TokenType.USER_DEFINED)
        named_unk = _token_id(metadata, "unknown_token_id", None, count)
        if named_unk is not None and int(TokenType.UNKNOWN) not in types:
            # the file names its unknown token without typing it (Gemma's GGUFs): sentencepiece
            # needs exactly one piece of type UNKNOWN, and this is the one the file means
            types[named_unk] = int(TokenType.UNKNOWN)

        return cls(
            model=model, pre=pre, tokens=tuple(tokens), scores=tuple(scores), types=tuple(types),
            merges=tuple(merges), bos_id=bos, eos_id=eos, eot_id=eot, unk_id=unk, pad_id=pad,
            add_bos=add_bos, add_eos=add_eos, add_space_prefix=add_space_prefix, eog_ids=frozenset(eog),
        )


def _string_list(metadata: Mapping[str, Any], key: str) -> list[str]:
    value = metadata.get(key)
    if value is None:
        return []
    if not isinstance(value, Sequence) or isinstance(value, str | bytes):
        raise TokenizerError(f"{key} must be an array of strings, not {type(value).__name__}")
    if not all(isinstance(v, str) for v in value):
        raise TokenizerError(f"{key} must be an array of strings")
    return list(value)


def _number_list(metadata: Mapping[str, Any], key: str, count: int, kind: type, default: float) -> list:
    value = metadata.get(key)
    if value is None:
        return [kind(default)] * count
    if not isinstance(value, Sequence) or isinstance(value, str | bytes):
        raise TokenizerError(f"{key} must be an array, not {type(value).__name__}")
    if len(value) != count:
        raise TokenizerError(f"{key} has {len(value)} entries but {KEY}tokens has {count}")
    return [kind(v) for v in value]


def _token_id(metadata: Mapping[str, Any], name: str, default: int | None, count: int) -> int | None:
    value = metadata.get(KEY + name)
    if value is None:
        return default if default is not None and default < count else None
    value = int(value)
    if value < 0 or value >= count:
        # llama.cpp ignores an out-of-range id too (with a warning) and keeps its default
        return default if default is not None and default < count else None
    return value
