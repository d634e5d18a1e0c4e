"""Tokenizers of the real test models against llama.cpp (llama-cpp-python, vocab only).

SmolLM2 (gpt2 / smollm) and Qwen2.5 (gpt2 / qwen2) come from the cached GGUF files; the "llama"
(sentencepiece) path uses a small sentencepiece BPE model trained on botchan.txt in the test and
written as a vocabulary-only GGUF file, which llama.cpp loads like any other model.
"""

from __future__ import annotations

import ctypes
import io
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest

from infer.tokenizer import StreamDecoder, Tokenizer
from tests.oracle.assets import botchan_path, gemma3_path, qwen05b_path, smollm2_path

EDGE_CASES = [
    "", " ", "  ", "   x", "\t", "\t\tfoo\n\n", "\n", "\r\n", " \n \n", "Hello  world   ", "  leading", "trailing  ",
    "1234567890", "12 345 6789.01", "3.14159e10", "²³ ½ Ⅻ", "\u0661\u0662\u0663 ٤",
    "日本語のテキスト、中文字符。", "한국어 텍스트", "emoji 😀👍🏽 family 👨\u200d👩\u200d👧", "🦙🦙🦙",
    "e\u0301 cafe\u0301 n\u0303 a\u0308\u0304", "Ünïcödé ÀÉÎ ſ", "a\u00a0b\u2003c\u3000d", "\u200b\u200d", "x\x00y\x7f",
    "don't I'LL we've THEY'RE", "!!!???...", "$100 + 5% = <x> | ^~", "def f(x):\n    return x**2\n",
    "<|im_start|>user\nhi<|im_end|>\n", "<|endoftext|>", "a</s>b<reponame>c", "<tool_call>x</tool_call>",
    "<s>x</s>", "<unk>", "<sep>a<sep>", "<cls> b", "<|im_start|><|im_start|>", "<|im_end",
]


def _required_or_skip(path: Path) -> Path:
    if path.is_file():
        return path
    if "oracle" in os.environ.get("NVMEDIRECT_REQUIRE", ""):
        pytest.fail(f"{path} is missing: run scripts/deps/40-models.sh")
    pytest.skip(f"{path} not cached (scripts/deps/40-models.sh fetches it)")


def read_metadata(path: Path) -> dict[str, Any]:
    """The tokenizer.* and general.* keys of a GGUF file. GGUFReader needs 5-10 s for a 150k-token
    vocabulary, so the result is kept in the temp directory, keyed by the file's size and mtime."""
    from gguf import GGUFReader

    stat = path.stat()
    cached = Path(tempfile.gettempdir()) / "nvmedirect-tests" / f"{path.name}.{stat.st_size}.{stat.st_mtime_ns}.json"
    if cached.is_file():
        return json.loads(cached.read_text(encoding="utf-8"))
    reader = GGUFReader(path)
    metadata = {k: f.contents() for k, f in reader.fields.items() if k.startswith(("tokenizer.", "general."))}
    cached.parent.mkdir(parents=True, exist_ok=True)
    partial = cached.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps(metadata), encoding="utf-8")
    partial.replace(cached)
    return metadata


def _spm_gguf(directory: Path) -> Path:
    """A vocabulary-only 'llama' GGUF built from a sentencepiece BPE model trained on botchan.txt."""
    import gguf
    import sentencepiece
    from sentencepiece import sentencepiece_model_pb2 as model_pb2

    buffer = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        input=str(_required_or_skip(botchan_path())), model_writer=buffer, vocab_size=1000, model_type="bpe",
        byte_fallback=True, user_defined_symbols=["<sep>"], control_symbols=["<cls>"], minloglevel=2,
        normalization_rule_name="identity", remove_extra_whitespaces=False,
    )
    proto = model_pb2.ModelProto()
    proto.ParseFromString(buffer.getvalue())
    (directory / "botchan-bpe.model").write_bytes(buffer.getvalue())
    path = directory / "botchan-bpe-vocab.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    # the hyperparameters llama.cpp reads even when it loads only the vocabulary
    writer.add_context_length(64)
    writer.add_embedding_length(64)
    writer.add_block_count(1)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([p.piece for p in proto.pieces])
    writer.add_token_scores([p.score for p in proto.pieces])
    writer.add_token_types([p.type for p in proto.pieces])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


MODELS = ["smollm2", "qwen05b", "gemma3", "spm-botchan"]


@pytest.fixture(scope="module", params=MODELS)
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Tokenizer]:
    if request.param == "smollm2":
        path = _required_or_skip(smollm2_path())
    elif request.param == "qwen05b":
        path = _required_or_skip(qwen05b_path())
    elif request.param == "gemma3":
        path = _required_or_skip(gemma3_path())
    else:
        path = _spm_gguf(tmp_path_factory.mktemp("spm"))
    return path, Tokenizer.from_gguf(read_metadata(path))


@pytest.fixture(scope="module")
def botchan_lines() -> list[str]:
    return _required_or_skip(botchan_path()).read_text(encoding="utf-8").splitlines(keepends=True)


def _oracle(path: Path) -> Any:
    import llama_cpp

    return llama_cpp.Llama(str(path), vocab_only=True, verbose=False)


@pytest.mark.oracle
def test_token_ids_match_llama_cpp(model: tuple[Path, Tokenizer], botchan_lines: list[str]) -> None:
    path, tokenizer = model
    llm = _oracle(path)
    mismatches = []
    texts = botchan_lines + EDGE_CASES
    for text in texts:
        for special in (True, False):
            # llama.cpp's add_bos=True means "add what the file asks for", our add_bos=None
            for ours_bos, theirs_bos in ((None, True), (False, False)):
                ours = tokenizer.encode(text, add_bos=ours_bos, special=special)
                theirs = llm.tokenize(text.encode(), add_bos=theirs_bos, special=special)
                if ours != theirs:
                    mismatches.append((text[:60], special, ours_bos, ours[:12], theirs[:12]))
    assert not mismatches, f"{len(mismatches)} of {4 * len(texts)} differ, first: {mismatches[:5]}"


@pytest.mark.oracle
def test_token_pieces_match_llama_cpp(model: tuple[Path, Tokenizer]) -> None:
    import llama_cpp

    path, tokenizer = model
    llm = _oracle(path)
    vocab = llm._model.vocab
    buffer = ctypes.create_string_buffer(256)
    differing = []
    for special in (False, True):
        for token_id in range(tokenizer.vocab_size):
            n = llama_cpp.llama_token_to_piece(vocab, token_id, buffer, len(buffer), 0, special)
            if tokenizer.token_bytes(token_id, special) != buffer.raw[:n]:
                differing.append((token_id, special, tokenizer.token_bytes(token_id, special), buffer.raw[:n]))
    assert not differing, f"{len(differing)} token pieces differ, first: {differing[:5]}"


@pytest.mark.oracle
def test_special_ids_match_llama_cpp(model: tuple[Path, Tokenizer]) -> None:
    import llama_cpp

    path, tokenizer = model
    llm = _oracle(path)  # keeps the vocabulary alive while its pointer is used
    vocab = llm._model.vocab
    assert tokenizer.bos_id == llama_cpp.llama_vocab_bos(vocab)
    assert tokenizer.eos_id == llama_cpp.llama_vocab_eos(vocab)
    theirs = {i for i in range(tokenizer.vocab_size) if llama_cpp.llama_vocab_is_eog(vocab, i)}
    assert tokenizer.eot_ids == theirs
    assert all(tokenizer.is_eog(i) for i in theirs)


def test_sentencepiece_rebuilt_from_gguf_encodes_like_the_original(
    tmp_path: Path, botchan_lines: list[str]
) -> None:
    import sentencepiece

    path = _spm_gguf(tmp_path)
    original = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "botchan-bpe.model"))
    tokenizer = Tokenizer.from_gguf(read_metadata(path))
    # text without special tokens: the original model and llama.cpp's rules agree there
    texts = botchan_lines + [t for t in EDGE_CASES if "<" not in t]
    differing = [t for t in texts if tokenizer.encode(t, add_bos=False, special=False) != original.encode(t)]
    assert not differing, f"{len(differing)} of {len(texts)} differ, first: {differing[:3]}"


def test_decode_inverts_encode(model: tuple[Path, Tokenizer], botchan_lines: list[str]) -> None:
    _, tokenizer = model
    texts = botchan_lines[:300] + EDGE_CASES
    if tokenizer.vocab.model == "llama":
        # llama.cpp puts a space in front of text that follows a special token (here the
        # user-defined <sep>, matched even with special=False), so such text does not round-trip
        texts = [t for t in texts if "<sep>" not in t]
    for text in texts:
        assert tokenizer.decode(tokenizer.encode(text, add_bos=False, special=False)) == text


def test_special_tokens_decode_only_when_asked(model: tuple[Path, Tokenizer]) -> None:
    _, tokenizer = model
    markup = tokenizer.token_text(tokenizer.eos_id)
    ids = tokenizer.encode(f"Hi{markup}", add_bos=False, special=True)
    assert ids[-1] == tokenizer.eos_id
    assert tokenizer.decode(ids) == "Hi"
    assert tokenizer.decode(ids, special=True) == f"Hi{markup}"
    # written as text with special=False, it is ordinary text and decodes to itself
    plain = tokenizer.encode(f"Hi{markup}", add_bos=False, special=False)
    assert tokenizer.eos_id not in plain
    assert tokenizer.decode(plain) == f"Hi{markup}"


def test_stream_decoder_holds_back_split_characters(model: tuple[Path, Tokenizer]) -> None:
    _, tokenizer = model
    text = "Llamas 🦙 and 👨\u200d👩\u200d👧 say 日本語"
    ids = tokenizer.encode(text, add_bos=False)
    decoder = StreamDecoder(tokenizer)
    pieces = [decoder.push(i) for i in ids] + [decoder.flush()]
    assert "\ufffd" not in "".join(pieces)
    expected = text if not tokenizer.vocab.add_space_prefix else " " + text
    assert "".join(pieces) == expected
    # some emoji takes more than one token, so some push returned nothing while it waited
    assert any(p == "" for p in pieces[:-1])


def test_pre_tokenizer_named_by_the_file_decides_the_split() -> None:
    metadata = read_metadata(_required_or_skip(smollm2_path()))

    def pieces(pre: str, text: str) -> list[str]:
        tokenizer = Tokenizer.from_gguf({**metadata, "tokenizer.ggml.pre": pre})
        return [tokenizer.token_text(i) for i in tokenizer.encode(text)]

    # GPT-2's regex ("smollm" adds digit splitting) leaves a newline run in pieces; Qwen2's keeps it whole
    assert pieces("smollm", "Hi!!\n\nYou") == ["Hi", "!!", "Ċ", "Ċ", "You"]
    assert pieces("qwen2", "Hi!!\n\nYou") == ["Hi", "!!", "ĊĊ", "You"]


def test_gpt_4o_pre_tokenizer_splits_at_case_changes_and_keeps_contractions() -> None:
    """gpt-oss's files name "gpt-4o" (o200k): words split where a capital follows small letters, a
    contraction stays on its word and digits go in threes, unlike Qwen2's regex (llama.cpp's
    LLAMA_VOCAB_PRE_TYPE_GPT4O)."""
    metadata = read_metadata(_required_or_skip(smollm2_path()))

    def pieces(pre: str, text: str) -> list[str]:
        tokenizer = Tokenizer.from_gguf({**metadata, "tokenizer.ggml.pre": pre})
        return [tokenizer.token_text(i) for i in tokenizer.encode(text)]

    from tokenizers import Regex, pre_tokenizers

    from infer.tokenizer.bpe import GPT4O

    split = pre_tokenizers.Split(Regex(GPT4O), behavior="isolated")
    text = "HelloWorld don't 12345 a/b\n\n"
    assert [p for p, _ in split.pre_tokenize_str(text)] == ["Hello", "World", " don't", " ", "123", "45", " a", "/b",
                                                            "\n\n"]
    assert "".join(pieces("gpt-4o", text)) == "".join(pieces("qwen2", text))  # the file's tokenizer takes the name
