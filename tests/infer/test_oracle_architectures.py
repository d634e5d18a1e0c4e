"""Architectures and rope variants without a small real file on PyPI, against llama.cpp: Qwen3
(synthetic files of every weight type, and a two-layer copy of the real Qwen2.5-Coder-0.5B turned
into a Qwen3 with per-head Q/K norms), YaRN rope scaling (a copy of the real Qwen2.5-Coder-0.5B) and
the rope attention factor (a copy of SmolLM2).

The rules are test_oracle.py's (docs/INFERENCE.md):
- each operation of every layer fed llama.cpp's own input (its eval callback): elementwise ones
  (RMSNorm, the new per-head Q/K RMSNorm, rope) bit-identical, products and attention within
  float32 / float16 rounding (OP_BOUND);
- our logit error, mean and max, at most NOISE_FACTOR times llama.cpp's own batching noise on the
  same tokens (its one-batch logits against its token-by-token ones). The Q8_0 files and the copy of
  the real Q4_K_M file (whose narrow matrices are Q5_0 and Q8_0) meet it since those types' products
  sum in llama.cpp's order (native/cpu_qdot_common.h, ggml_order); before, they were expected failures.
Each logit test also shows the feature matters there: without it (no Q/K norms, no scaling) the
error is at least twice the bound, so a test cannot pass by ignoring what it checks.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFValueType

from infer.gguf_file import GGUFModel
from infer.model import Transformer, load_transformer
from infer.synth import Shape, write_model
from tests.infer.test_oracle import OP_BOUND
from tests.oracle import compare_ops
from tests.oracle.fixtures import botchan_text, model_path
from tests.oracle.gguf_edit import write_copy
from tests.oracle.reference import Reference
from tests.oracle.trace import trace

pytestmark = [pytest.mark.oracle, pytest.mark.slow]

NOISE_FACTOR = 2.0  # test_oracle.py's
TOKENS = 96
# Qwen3-0.6B's proportions, small: head size 128 with 4 heads over a width of 256 (q_dim 512 != width)
QWEN3 = Shape(n_layers=2, dim=256, ffn_dim=768, n_heads=4, n_kv_heads=2, vocab_size=1024, context_length=2048,
              rope_base=1e6, norm_eps=1e-6, arch="qwen3", head_dim=128)


def _errors(ours: np.ndarray, ref: Reference, ids: list[int]) -> tuple[np.ndarray, float, float, float, float]:
    """(llama.cpp's logits, our mean and max error, its mean and max batching noise)."""
    want = ref.logits(ids)
    noise = np.abs(ref.logits_token_by_token(ids) - want)
    error = np.abs(ours - want)
    return want, float(error.mean()), float(error.max()), float(noise.mean()), float(noise.max())


def _logits(model: Transformer, ids: list[int]) -> np.ndarray:
    return model.forward(np.array(ids), model.new_cache(len(ids) + 8), all_logits=True)


def beside_llama_cpp(path: Path) -> tuple[Transformer, list[int], np.ndarray, tuple]:
    """A synthetic file (a vocabulary of 1024 or more) through our default engine and llama.cpp on
    TOKENS random ids: (our model, the ids, our logits, _errors' (llama.cpp's logits, our mean and
    max error, its mean and max batching noise))."""
    ours = load_transformer(GGUFModel(path))
    ids = [int(t) for t in np.random.default_rng(0).integers(3, 1024, TOKENS)]
    got = _logits(ours, ids)
    ref = Reference(path, n_ctx=128)
    try:
        return ours, ids, got, _errors(got, ref, ids)
    finally:
        ref.close()


def _check(name: str, got: np.ndarray, without: np.ndarray, ref: Reference, ids: list[int]) -> None:
    want, mean, worst, noise_mean, noise_max = _errors(got, ref, ids)
    off = float(np.abs(without - want).mean())
    top1 = float(np.mean(got.argmax(-1) == want.argmax(-1)))
    print(f"\n{name}: |error| mean {mean:.5f} max {worst:.4f}; llama.cpp's batching noise mean {noise_mean:.5f} "
          f"max {noise_max:.4f}; without the feature mean {off:.4f}; top-1 agreement {top1:.3f}")
    assert off > 2 * max(NOISE_FACTOR * noise_mean, mean)  # the feature moves logits beyond the bound
    assert mean <= NOISE_FACTOR * noise_mean and worst <= NOISE_FACTOR * noise_max


class _WithoutQKNorm:
    """The layers of a provider with their Q/K norms dropped (what an engine that ignored them computes)."""

    def __init__(self, weights: object) -> None:
        self._weights = weights

    def layer(self, index: int) -> object:
        return replace(self._weights.layer(index), q_norm=None, k_norm=None)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self._weights, name)


def _without_qk_norm(model: Transformer) -> Transformer:
    return Transformer(model.args, _WithoutQKNorm(model.weights), model.rope.freq_factors)  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["f16", "q8_0", "q4_k_m"])
def test_synthetic_qwen3_matches_llama_cpp(kind: str, tmp_path: Path) -> None:
    path = tmp_path / f"qwen3-{kind}.gguf"
    write_model(path, QWEN3, kind, seed=3)
    ours = load_transformer(GGUFModel(path))
    assert ours.args.arch == "qwen3" and ours.args.q_dim == 512 and ours.weights.layer(0).q_norm is not None
    ids = [int(t) for t in np.random.default_rng(0).integers(3, QWEN3.vocab_size, TOKENS)]
    ref = Reference(path, n_ctx=128)
    try:
        _check(f"synthetic qwen3 {kind}", _logits(ours, ids), _logits(_without_qk_norm(ours), ids), ref, ids)
    finally:
        ref.close()


def _qwen3_from_qwen25(tmp_path: Path) -> Path:
    """Qwen2.5-Coder-0.5B's first two blocks as a Qwen3: Q/K/V biases dropped, per-head Q and K norms
    added (weights around 1, as trained ones are), the keys renamed."""
    rng = np.random.default_rng(5)
    norms = {f"blk.{i}.attn_{x}_norm.weight": (1 + 0.25 * rng.standard_normal(64)).astype(np.float32)
             for i in range(2) for x in "qk"}
    return write_copy(model_path("qwen05b"), tmp_path / "qwen3-from-qwen25.gguf", n_layers=2,
                      metadata={"general.architecture": ("qwen3", GGUFValueType.STRING)},
                      drop_pattern=r"\.attn_[qkv]\.bias$", extra_tensors=norms)


def _prose(ref: Reference) -> list[int]:
    return ref.tokenize(botchan_text()[5000:9000])[:TOKENS]


def test_qwen3_made_from_a_real_qwen25_matches_llama_cpp(tmp_path: Path) -> None:
    path = _qwen3_from_qwen25(tmp_path)
    ours = load_transformer(GGUFModel(path))
    assert ours.args.arch == "qwen3" and ours.weights.layer(1).bqkv is None
    ref = Reference(path, n_ctx=128)
    try:
        ids = _prose(ref)
        _check("qwen3 from Qwen2.5-Coder-0.5B", _logits(ours, ids), _logits(_without_qk_norm(ours), ids), ref, ids)
    finally:
        ref.close()


@pytest.mark.parametrize("original", [256, 32768])
def test_yarn_rope_scaling_matches_llama_cpp(original: int, tmp_path: Path) -> None:
    """Qwen2.5's long-context recipe (yarn, factor 4) on two blocks of the real 0.5B. An original
    context of 256 puts the ramp between interpolated and kept dimensions among the pairs that turn
    within 96 positions; at 32768 (the real files' value) the attention scale dominates."""
    source = model_path("qwen05b")
    path = write_copy(source, tmp_path / "yarn.gguf", n_layers=2, metadata={
        "qwen2.rope.scaling.type": ("yarn", GGUFValueType.STRING),
        "qwen2.rope.scaling.factor": (4.0, GGUFValueType.FLOAT32),
        "qwen2.rope.scaling.original_context_length": (original, GGUFValueType.UINT32)})
    ours = load_transformer(GGUFModel(path))
    assert ours.args.rope_scaling.kind == "yarn" and ours.args.rope_scaling.original_context == original
    plain = load_transformer(GGUFModel(write_copy(source, tmp_path / "plain.gguf", n_layers=2)))
    ref = Reference(path, n_ctx=128)
    try:
        ids = _prose(ref)
        _check(f"yarn x4 from {original}", _logits(ours, ids), _logits(plain, ids), ref, ids)
    finally:
        ref.close()


def test_rope_attention_factor_matches_llama_cpp(tmp_path: Path) -> None:
    """`rope.scaling.attn_factor` scales every rotation's cos and sin (queries and keys), with or
    without a scaling type."""
    source = model_path("smollm2-F16")
    path = write_copy(source, tmp_path / "attn-factor.gguf", n_layers=2, metadata={
        "llama.rope.scaling.attn_factor": (1.3, GGUFValueType.FLOAT32)})
    ours = load_transformer(GGUFModel(path))
    plain = load_transformer(GGUFModel(write_copy(source, tmp_path / "plain.gguf", n_layers=2)))
    ref = Reference(path, n_ctx=128)
    try:
        ids = _prose(ref)
        _check("attention factor 1.3", _logits(ours, ids), _logits(plain, ids), ref, ids)
    finally:
        ref.close()


@pytest.mark.parametrize("which", ["real-copy", "synthetic-q4_k_m"])
def test_qwen3_operations_match_llama_cpp(which: str, tmp_path: Path) -> None:
    """Each operation of both blocks fed llama.cpp's own input: the per-head Q/K RMSNorm and rope
    bit for bit, the rest within OP_BOUND."""
    if which == "real-copy":
        path = _qwen3_from_qwen25(tmp_path)
    else:
        path = tmp_path / "qwen3-q4_k_m.gguf"
        write_model(path, QWEN3, "q4_k_m", seed=3)
    ours = load_transformer(GGUFModel(path))
    ids = [int(t) for t in np.random.default_rng(1).integers(3, min(ours.args.vocab_size, 30000), 32)]
    rows = compare_ops.compare(ours, trace(path, ids, names=compare_ops.TRACED), ids)
    assert {"q/k rms_norm", "rope q", "rope k"} <= {r.op for r in rows}
    for row in rows:
        bound = OP_BOUND[compare_ops.KINDS[row.op]]
        assert row.rel <= bound + row.allowance, f"{row.op} in layer {row.layer}: relative error {row.rel:.2e}"


def _gemma3() -> Path:
    from tests.oracle.fixtures import require_asset

    return require_asset(Path.home() / ".cache" / "nvmedirect" / "models" / "gemma-3-270m-q4_k_m.gguf")


def test_gemma3_270m_past_its_sliding_window_matches_llama_cpp() -> None:
    """Gemma 3 270M over 700 tokens: five of every six layers attend to a 512-token window with their
    own rotary base, so the last 188 positions see only part of the text (test_oracle.py checks its
    first 128 positions, its operations, perplexity and greedy text)."""
    path = _gemma3()
    ours = load_transformer(GGUFModel(path))
    assert ours.args.sliding_window == 512 and sum(ours.args.local_layers) == 15
    ref = Reference(path, n_ctx=1024)
    try:
        ids = ref.tokenize(botchan_text()[5000:60000])[:700]
        assert len(ids) == 700
        got = _logits(ours, ids)
        want, mean, worst, noise_mean, noise_max = _errors(got, ref, ids)
    finally:
        ref.close()
    print(f"\ngemma3 700 tokens: |error| mean {mean:.4f} max {worst:.3f}; noise {noise_mean:.4f} / {noise_max:.3f}")
    assert mean <= NOISE_FACTOR * noise_mean and worst <= NOISE_FACTOR * noise_max
    # without the window the same positions are further off: the window is what llama.cpp computes
    unbounded = Transformer(replace(ours.args, local_layers=()), ours.weights, ours.rope.freq_factors)
    tail = slice(600, 700)
    far = float(np.abs(_logits(unbounded, ids)[tail] - want[tail]).mean())
    near = float(np.abs(got[tail] - want[tail]).mean())
    print(f"positions 600-699: |error| {near:.4f} with the window, {far:.4f} without")
    assert far > 2 * near


# Gemma 3's proportions, small: 7 layers (local 0-4 and 6, global 5), a 16-token window, head size 64
GEMMA3 = Shape(n_layers=7, dim=256, ffn_dim=768, n_heads=4, n_kv_heads=1, vocab_size=1024, context_length=2048,
               rope_base=1e6, norm_eps=1e-6, arch="gemma3", head_dim=64, sliding_window=16)


def test_synthetic_gemma3_matches_llama_cpp(tmp_path: Path) -> None:
    """Random Gemma 3 weights in float16 over 96 tokens, six times the window: GeGLU, post-norms, the
    embedding scale, Q/K norms, and local layers with their own rotary base."""
    path = tmp_path / "gemma3-f16.gguf"
    write_model(path, GEMMA3, "f16", seed=4)
    ours = load_transformer(GGUFModel(path))
    assert ours.args.local_layers == (True,) * 5 + (False, True) and ours.args.sliding_window == 16
    ids = [int(t) for t in np.random.default_rng(1).integers(3, GEMMA3.vocab_size, TOKENS)]
    unbounded = Transformer(replace(ours.args, local_layers=()), ours.weights, ours.rope.freq_factors)
    ref = Reference(path, n_ctx=128)
    try:
        _check("synthetic gemma3 f16", _logits(ours, ids), _logits(unbounded, ids), ref, ids)
    finally:
        ref.close()


def test_gemma3_27b_attention_scale_matches_llama_cpp(tmp_path: Path) -> None:
    """Gemma 3 27B scales its queries by 1 / sqrt(width / heads) instead of 1 / sqrt(head size):
    llama.cpp picks that scale for 62-layer Gemma 3 files. A random 62-layer file whose head size
    (64) is not width / heads (32), in float16: our logits follow llama.cpp's, and with the head
    size's scale they do not."""
    shape = replace(GEMMA3, n_layers=62, dim=128, ffn_dim=256, vocab_size=512)
    path = tmp_path / "gemma3-62-f16.gguf"
    write_model(path, shape, "f16", seed=5)
    ours = load_transformer(GGUFModel(path))
    assert ours.args.attn_scale == 1 / np.sqrt(32) and ours.args.head_dim == 64
    ids = [int(t) for t in np.random.default_rng(2).integers(3, shape.vocab_size, 48)]
    by_head_size = Transformer(replace(ours.args, attn_scale=0.0), ours.weights, ours.rope.freq_factors)
    ref = Reference(path, n_ctx=64)
    try:
        _check("synthetic gemma3 27b scale f16", _logits(ours, ids), _logits(by_head_size, ids), ref, ids)
    finally:
        ref.close()

