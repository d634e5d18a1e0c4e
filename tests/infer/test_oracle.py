"""The CPU engine against llama.cpp on real models: logits, greedy continuations, perplexity.

Both sides see the same token ids (llama.cpp's tokenization, so these tests check the engine, not
the tokenizer) and the same batching: a prompt is one batch from an empty context, since
llama.cpp's own logits change with the batch split.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFValueType

from infer.api import LLM
from infer.gguf_file import GGUFModel
from infer.model import Transformer, load_transformer
from tests.oracle.fixtures import botchan_text, model_path
from tests.oracle.gguf_edit import write_copy
from tests.oracle.reference import Reference

pytestmark = [pytest.mark.oracle, pytest.mark.slow]

MODELS = ["smollm2-F16", "smollm2-Q8_0", "smollm2-Q4_0", "smollm2-Q4_1", "smollm2-Q4_K_M", "smollm2-Q5_K_M",
          "smollm2-Q6_K", "qwen05b"]
STRICT = {"smollm2-F16", "smollm2-Q8_0"}  # 8 bits or more: near-identical results are required
PROMPT_TOKENS = 128
PPL_CTX = 256
PPL_CHUNKS = int(os.environ.get("NVMEDIRECT_PPL_CHUNKS", "8"))


@dataclasses.dataclass
class Pair:
    name: str
    ours: LLM
    ref: Reference


@pytest.fixture(scope="module", params=MODELS)
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    path = model_path(request.param)
    ours = LLM.load(path, ctx_size=512)
    ref = Reference(path, n_ctx=512)
    yield Pair(request.param, ours, ref)
    ref.close()


def prose_prompt(ref: Reference) -> list[int]:
    return ref.tokenize(botchan_text()[5000:9000])[:PROMPT_TOKENS]


def top1_agreement(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean(a.argmax(axis=1) == b.argmax(axis=1)))


def test_logits_agree_with_llama_cpp(pair: Pair) -> None:
    """Top-1 agreement, counted two ways. Plain: the same argmax. Within noise: our top-1 token is
    one llama.cpp itself scores within its own batching noise of its top-1 logit, that noise being
    the largest logit change between llama.cpp's one-batch and token-by-token evaluations of this
    prompt. (Quantized activations make near-ties flip on rounding differences far below what
    matters: llama.cpp disagrees with itself on them.)"""
    ids = prose_prompt(pair.ref)
    assert len(ids) == PROMPT_TOKENS
    ours, ref = pair.ours.logits(ids), pair.ref.logits(ids)
    ref_by_token = pair.ref.logits_token_by_token(ids)
    noise = float(np.abs(ref - ref_by_token).max())
    diff = np.abs(ours - ref)
    plain = top1_agreement(ours, ref)
    self_agreement = top1_agreement(ref_by_token, ref)
    picked = ref[np.arange(len(ids)), ours.argmax(axis=1)]
    within_noise = float(np.mean(picked >= ref.max(axis=1) - noise))
    print(f"\n{pair.name}: {len(ids)} positions, |logit diff| max {diff.max():.4f} mean {diff.mean():.5f}; "
          f"top-1 agreement {plain:.4f} (llama.cpp with itself across batchings: {self_agreement:.4f}), "
          f"within llama.cpp's batching noise {noise:.3f}: {within_noise:.4f}")
    required = 0.99 if pair.name in STRICT else 0.95
    assert within_noise >= required
    # Plain agreement: the rate, or llama.cpp's agreement with itself where that is lower
    # (less one position of slack: which near-ties flip is chance).
    assert plain >= min(required, self_agreement) - 1 / len(ids)


@pytest.mark.parametrize("pair", ["smollm2-F16", "qwen05b"], indirect=True)  # one file per architecture
def test_rope_pairing_is_the_one_llama_cpp_uses(pair: Pair) -> None:
    """Rotating the other pairs of dimensions (adjacent vs NeoX halves) must lose the agreement:
    this is what tells which pairing each architecture uses in GGUF."""
    ids = prose_prompt(pair.ref)[:64]
    good = pair.ours.transformer
    flipped = Transformer(dataclasses.replace(good.args, rope_neox=not good.args.rope_neox), good.weights)
    logits = flipped.forward(np.array(ids), flipped.new_cache(len(ids)), all_logits=True)
    agreement = top1_agreement(logits, pair.ref.logits(ids))
    print(f"\n{pair.name}: with the other rope pairing top-1 agreement is {agreement:.3f}")
    assert agreement < 0.6


@pytest.mark.parametrize("pair", sorted(STRICT), indirect=True)  # identical text is required at 8+ bits
def test_greedy_continuation_is_identical(pair: Pair) -> None:
    prompt = pair.ref.tokenize("Once upon a time, in a small village by the sea,")
    expected = pair.ref.greedy(prompt, 32)
    got = list(pair.ours.generate_ids(prompt, 32, stop_at_eog=False))
    print(f"\n{pair.name}: {pair.ours.detokenize(got)!r}")
    assert got == expected


def reference_perplexity(ref: Reference, tokens: list[int], bos: int | None, chunks: int = PPL_CHUNKS) -> float:
    """llama.cpp's method written out again, on llama.cpp's logits, independently of infer.perplexity."""
    nll, count = 0.0, 0
    for i in range(chunks):
        chunk = tokens[i * PPL_CTX : (i + 1) * PPL_CTX]
        if bos is not None:
            chunk[0] = bos
        logits = ref.logits(chunk).astype(np.float64)
        for j in range(PPL_CTX // 2, PPL_CTX - 1):
            row = logits[j]
            nll += math.log(np.exp(row - row.max()).sum()) + row.max() - row[chunk[j + 1]]
            count += 1
    return math.exp(nll / count)


def reference_cache_dir() -> Path | None:
    """Where llama.cpp's perplexities are kept between runs; None when NVMEDIRECT_ORACLE_CACHE=0."""
    if os.environ.get("NVMEDIRECT_ORACLE_CACHE", "1") == "0":
        return None
    return Path(os.environ.get("NVMEDIRECT_CACHE", Path.home() / ".cache" / "nvmedirect")) / "oracle"


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


@functools.cache
def llama_cpp_identity() -> dict[str, object]:
    """The llama-cpp-python version and a digest of each of its compiled libraries."""
    import llama_cpp

    libraries = sorted((Path(llama_cpp.__file__).parent / "lib").glob("*.so*"))
    return {"version": llama_cpp.__version__, "libraries_sha256": {lib.name: file_sha256(lib) for lib in libraries}}


def cached_reference_perplexity(pair: Pair, tokens: list[int], bos: int | None) -> float:
    """reference_perplexity, remembered on disk: llama.cpp's number depends only on what the key
    covers (the model file's bytes, llama-cpp-python's version and compiled libraries, the token ids,
    the BOS id, the chunking, the Reference class and reference_perplexity's source), so any change
    to one of them computes it again. Our engine's side is never cached; the bar is unchanged."""
    directory = reference_cache_dir()
    if directory is None:
        return reference_perplexity(pair.ref, tokens, bos)
    key_parts = {
        "model_sha256": file_sha256(model_path(pair.name)),
        "llama_cpp": llama_cpp_identity(),
        "tokens_sha256": hashlib.sha256(json.dumps(tokens).encode()).hexdigest(),
        "bos": bos, "ctx": PPL_CTX, "chunks": PPL_CHUNKS, "n_ctx": pair.ref.n_ctx,
        "code_sha256": hashlib.sha256((inspect.getsource(reference_perplexity)
                                       + inspect.getsource(Reference)).encode()).hexdigest(),
    }
    key = hashlib.sha256(json.dumps(key_parts, sort_keys=True).encode()).hexdigest()[:32]
    path = directory / f"perplexity-{key}.json"
    try:
        entry = json.loads(path.read_text())
        if entry["key"] == key_parts:
            return float(entry["perplexity"])
    except (OSError, ValueError, KeyError):
        pass
    value = reference_perplexity(pair.ref, tokens, bos)
    directory.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"key": key_parts, "model": pair.name, "perplexity": value}, indent=1))
    tmp.replace(path)
    return value


def test_perplexity_within_one_percent(pair: Pair) -> None:
    tokens = pair.ref.tokenize(botchan_text())
    assert len(tokens) >= PPL_CHUNKS * PPL_CTX
    bos = pair.ours.tokenizer.bos_id if pair.ours.tokenizer.vocab.add_bos else None
    expected = cached_reference_perplexity(pair, tokens, bos)
    got = pair.ours.perplexity(tokens, ctx=PPL_CTX, max_chunks=PPL_CHUNKS)
    print(f"\n{pair.name}: perplexity {got.perplexity:.4f}, llama.cpp {expected:.4f} "
          f"({PPL_CHUNKS} chunks of {PPL_CTX})")
    assert got.chunks == PPL_CHUNKS
    assert abs(got.perplexity / expected - 1) < 0.01


def test_rope_frequency_factors_and_linear_scaling_match_llama_cpp(tmp_path: Path) -> None:
    """A two-layer SmolLM2 with a `rope_freqs` tensor (as Llama 3.1 files carry) and linear rope
    scaling in its metadata; llama.cpp must see the same model we do."""
    source = model_path("smollm2-F16")
    factors = np.linspace(1.0, 8.0, 32, dtype=np.float32)
    path = write_copy(source, tmp_path / "rope.gguf", n_layers=2, metadata={
        "llama.rope.scaling.type": ("linear", GGUFValueType.STRING),
        "llama.rope.scaling.factor": (2.5, GGUFValueType.FLOAT32),
    }, extra_tensors={"rope_freqs.weight": factors})
    ours = LLM.load(path, ctx_size=256)
    assert ours.transformer.rope.freq_factors is not None and ours.args.rope_linear_scale == 2.5
    ref = Reference(path, n_ctx=256)
    try:
        ids = prose_prompt(ref)[:96]
        expected = ref.logits(ids)
        plain = load_transformer(GGUFModel(write_copy(source, tmp_path / "plain.gguf", n_layers=2)))
    finally:
        ref.close()
    got = ours.logits(ids)
    unscaled = plain.forward(np.array(ids), plain.new_cache(256), all_logits=True)
    print(f"\nrope variants: |logit diff| max {np.abs(got - expected).max():.4f}, "
          f"without the variants {np.abs(unscaled - expected).max():.4f}")
    assert np.abs(got - expected).max() < 0.1
    assert np.abs(unscaled - expected).max() > 1.0  # the variants matter at these positions
