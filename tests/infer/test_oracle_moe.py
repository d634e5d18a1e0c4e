"""Mixture-of-experts files against llama.cpp: synthetic qwen3moe and Mixtral-style llama files
(infer.synth; no MoE GGUF small enough ships on PyPI), which llama.cpp loads and runs here.

The rules are test_oracle_architectures.py's (docs/INFERENCE.md):
- each step of every block's expert feed-forward fed llama.cpp's own input (tests.oracle.compare_moe):
  the choice of experts, their weights and the weighted sum bit-identical, products and the
  softmax within float32 rounding (OP_BOUND);
- our logit error, mean and max, at most NOISE_FACTOR times llama.cpp's own batching noise on the
  same tokens. Routing makes small differences discontinuous: a token whose k-th and (k+1)-th experts
  are nearly tied can be routed to either by a rounding (llama.cpp's own two batchings do it too, on
  one of the files below), and its logits then move by tenths. Where the bar is not met the failure
  lists the tokens routed otherwise than llama.cpp and how many sit on such a near tie (llama.cpp's
  own margin under MARGIN). The Q8_0 files meet it since their products sum in llama.cpp's order
  (native/cpu_qdot_common.h, ggml_order); before, qwen3moe's was an expected failure.
Each logit test also shows the weights' normalisation matters: without it (the top k's softmax
probabilities as they are) the error is at least twice the bound.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from infer.gguf_file import GGUFModel
from infer.model import DequantizedWeights, Transformer, load_transformer
from infer.synth import SHAPES, Shape, write_model
from tests.infer.test_oracle import OP_BOUND
from tests.infer.test_oracle_architectures import NOISE_FACTOR, TOKENS, _errors, _logits, beside_llama_cpp
from tests.oracle import compare_moe
from tests.oracle.reference import Reference
from tests.oracle.trace import trace

pytestmark = [pytest.mark.oracle, pytest.mark.slow]

QWEN3MOE = SHAPES["tiny-moe"]  # Qwen3-30B-A3B's proportions, small: 4 of 16 experts of width 256
MIXTRAL = Shape(n_layers=2, dim=256, ffn_dim=512, n_heads=4, n_kv_heads=2, vocab_size=1024, context_length=2048,
                rope_base=1e6, n_experts=8, n_experts_used=2)  # Mixtral's 2 of 8, small
QWEN2MOE = SHAPES["tiny-qwen2moe"]  # Qwen1.5-MoE's layout, small: 2 of 8 experts of width 256, a shared one of 512
MARGIN = 0.01  # a near tie: llama.cpp's k-th expert probability within 1% above its (k+1)-th


def _write(name: str, kind: str, tmp_path: Path) -> Path:
    path = tmp_path / f"{name}-{kind}.gguf"
    write_model(path, {"qwen3moe": QWEN3MOE, "qwen2moe": QWEN2MOE}.get(name, MIXTRAL), kind, seed=3)
    return path


def _variant(model: Transformer, **changes: object) -> Transformer:
    """The same file read with ModelArgs changed (what an engine that got that feature wrong computes)."""
    args = replace(model.args, **changes)
    return Transformer(args, DequantizedWeights(model.weights.model, args), model.rope.freq_factors)


@pytest.mark.parametrize("kind", ["f16", "q8_0", "q4_k_m"])
@pytest.mark.parametrize("name", ["qwen3moe", "mixtral"])
def test_synthetic_moe_matches_llama_cpp(name: str, kind: str, tmp_path: Path) -> None:
    path = _write(name, kind, tmp_path)
    ours = load_transformer(GGUFModel(path))
    assert ours.args.n_experts == (16 if name == "qwen3moe" else 8) and ours.weights.layer(0).experts is not None
    ids = [int(t) for t in np.random.default_rng(0).integers(3, 1024, TOKENS)]
    got = _logits(ours, ids)
    ref = Reference(path, n_ctx=128)  # llama.cpp loads the file
    try:
        want, mean, worst, noise_mean, noise_max = _errors(got, ref, ids)
    finally:
        ref.close()
    off = float(np.abs(_logits(_variant(ours, expert_weights_norm=False), ids) - want).mean())
    top1 = float(np.mean(got.argmax(-1) == want.argmax(-1)))
    label = f"synthetic {name} {kind}"
    print(f"\n{label}: |error| mean {mean:.5f} max {worst:.4f}; llama.cpp's batching noise mean {noise_mean:.5f} "
          f"max {noise_max:.4f}; without normalised weights mean {off:.4f}; top-1 agreement {top1:.3f}")
    assert off > 2 * max(NOISE_FACTOR * noise_mean, mean)
    if mean <= NOISE_FACTOR * noise_mean and worst <= NOISE_FACTOR * noise_max:
        return
    moved = compare_moe.reroutes(ours, trace(path, ids, n_ctx=128, names=["ffn_moe_probs"]), ids)
    for r in moved:  # what the failure is made of
        print(f"  rerouted: block {r.layer} token {r.token}: ours {r.ours}, llama.cpp {r.theirs}, its margin {r.margin:.2e}")
    raise AssertionError(f"{label}: logit error {mean:.4f} / {worst:.3f} > {NOISE_FACTOR} x llama.cpp's noise "
                         f"{noise_mean:.4f} / {noise_max:.3f}; {len(moved)} of {ours.args.n_layers * len(ids)} token "
                         f"routings differ from llama.cpp's, {sum(r.margin < MARGIN for r in moved)} of them at near ties")


@pytest.mark.parametrize("name,kind", [("qwen3moe", "f16"), ("qwen3moe", "q4_k_m"), ("mixtral", "q8_0")])
def test_moe_operations_match_llama_cpp(name: str, kind: str, tmp_path: Path) -> None:
    """Each step of both blocks' expert feed-forward fed llama.cpp's own input: the choice of experts,
    the normalised weights and their weighted sum bit for bit, the rest within OP_BOUND."""
    path = _write(name, kind, tmp_path)
    ours = load_transformer(GGUFModel(path))
    ids = [int(t) for t in np.random.default_rng(1).integers(3, 1024, 64)]
    rows = compare_moe.compare(ours, trace(path, ids, n_ctx=64, names=compare_moe.TRACED), len(ids))
    assert {r.op for r in rows} == set(compare_moe.KINDS)
    for row in rows:
        bound = OP_BOUND[compare_moe.KINDS[row.op]]
        assert row.rel <= bound, f"{row.op} in block {row.layer}: relative error {row.rel:.2e}"


def _qwen2moe_run(kind: str, tmp_path: Path) -> tuple[Transformer, list[int], np.ndarray, tuple]:
    """The synthetic qwen2moe file of `kind` through our engine and llama.cpp: (our model, the token
    ids, our logits, _errors' (llama.cpp's logits, our mean and max error, its mean and max noise))."""
    return beside_llama_cpp(_write("qwen2moe", kind, tmp_path))


# qwen2moe at 8 bits and below: llama.cpp's two batchings give the same bits on these files (noise 0 at
# Q8_0, 1.8e-7 at Q4_K_M), so the rule asks for bit-identity. Every step of the feed-forward fed
# llama.cpp's input matches (test_qwen2moe_operations_match_llama_cpp) except in the last bits of
# two: the router's softmax (our exp is not ggml's SIMD expf) and the shared expert's one-row
# float32 gate product (llama.cpp takes ggml_vec_dot_f32's 4 x 8 lanes for one row, the llamafile
# tile's 8 lanes for more: ours always the latter). The probabilities are the expert weights here
# (not renormalised), and 8-bit rounding of the next products amplifies the last bits:
# Q8_0 0.0017 / 0.035, Q4_K_M 0.0048 / 0.075 (2026-12-06), top-1 1.000 / 0.990.
_BIT_IDENTITY = pytest.mark.xfail(strict=True, reason="the rule asks bit-identity here (llama.cpp's noise ~0); "
                                  "softmax exp and one-row float32 products differ in the last bits")


@pytest.mark.parametrize("kind", ["f16", pytest.param("q8_0", marks=_BIT_IDENTITY),
                                  pytest.param("q4_k_m", marks=_BIT_IDENTITY)])
def test_synthetic_qwen2moe_matches_llama_cpp(kind: str, tmp_path: Path) -> None:
    _ours, _ids, got, (want, mean, worst, noise_mean, noise_max) = _qwen2moe_run(kind, tmp_path)
    top1 = float(np.mean(got.argmax(-1) == want.argmax(-1)))
    print(f"\nsynthetic qwen2moe {kind}: |error| mean {mean:.5f} max {worst:.4f}; llama.cpp's batching noise mean "
          f"{noise_mean:.5f} max {noise_max:.4f}; top-1 agreement {top1:.3f}")
    assert mean <= NOISE_FACTOR * noise_mean and worst <= NOISE_FACTOR * noise_max


@pytest.mark.parametrize("kind", ["f16", "q8_0", "q4_k_m"])
def test_qwen2moe_features_move_the_logits(kind: str, tmp_path: Path) -> None:
    """Each of qwen2moe's differences is computed, not ignored: leaving out the shared expert, or
    renormalising the top-k weights as qwen3moe does, moves the logits by over twice both our error
    and the rule's bound."""
    ours, ids, _got, (want, mean, _worst, noise_mean, _noise_max) = _qwen2moe_run(kind, tmp_path)
    assert ours.args.shared_ffn_dim == 512 and not ours.args.expert_weights_norm
    assert ours.weights.layer(0).experts.shared is not None
    for changes in ({"shared_ffn_dim": 0}, {"expert_weights_norm": True}):
        off = float(np.abs(_logits(_variant(ours, **changes), ids) - want).mean())
        print(f"\nqwen2moe {kind} with {changes}: error mean {off:.4f} (ours {mean:.5f})")
        assert off > 2 * max(NOISE_FACTOR * noise_mean, mean)


@pytest.mark.parametrize("kind", ["f16", "q8_0", "q4_k_m"])
def test_qwen2moe_operations_match_llama_cpp(kind: str, tmp_path: Path) -> None:
    """Each step of both blocks' feed-forward fed llama.cpp's input: the choice of experts, their
    (unnormalised) weights, the weighted sum, the shared expert's gate, its scaling and the sum with
    the routed experts bit for bit, products and softmax within OP_BOUND."""
    path = _write("qwen2moe", kind, tmp_path)
    ours = load_transformer(GGUFModel(path))
    ids = [int(t) for t in np.random.default_rng(1).integers(3, 1024, 64)]
    rows = compare_moe.compare(ours, trace(path, ids, n_ctx=64, names=compare_moe.TRACED), len(ids))
    kinds = {**compare_moe.KINDS, **compare_moe.SHARED_KINDS}
    assert {r.op for r in rows} == set(kinds) - {"weights normalised"}
    for row in rows:
        bound = OP_BOUND[kinds[row.op]]
        assert row.rel <= bound, f"{row.op} in block {row.layer}: relative error {row.rel:.2e}"
