"""gpt-oss against llama.cpp: a synthetic file of gpt-oss's layout (infer.synth's tiny-gpt-oss: MXFP4
experts with biases, attention sinks, Q/K/V and output biases, a sliding window on every other layer,
YaRN; no gpt-oss GGUF small enough ships on PyPI), which llama.cpp loads and runs here.

The rule is test_oracle_architectures.py's (docs/INFERENCE.md): our logit error, mean and max, at most
NOISE_FACTOR times llama.cpp's own batching noise on the same tokens. A second test shows each of the
architecture's features is computed, not ignored: leaving any one out moves the logits by more than
twice both our error and that bound.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from infer.model import DequantizedWeights, LayerWeights, Transformer
from infer.rope_scaling import RopeScaling
from infer.synth import SHAPES, write_model
from tests.infer.test_oracle_architectures import NOISE_FACTOR, _logits, beside_llama_cpp

pytestmark = [pytest.mark.oracle, pytest.mark.slow]

KINDS = ["f16", "q8_0", "q4_k_m"]  # the attention's and output's type; the experts are MXFP4 in each
# gpt-oss-20b's attention as it is (64 heads of 64 over 8 KV heads, width 2880, YaRN x32 over 4096
# positions) with a window of 32 and small experts (4 of 8 of width 256): an 80 MB file
ATTENTION_20B = dataclasses.replace(SHAPES["gpt-oss-20b"], n_layers=2, vocab_size=1024, n_experts=8,
                                    expert_ffn_dim=256, sliding_window=32, context_length=8192)


def _run(kind: str, tmp_path: Path, shape: str = "tiny") -> tuple[Transformer, list[int], np.ndarray, tuple]:
    """The synthetic gpt-oss file's matrices in `kind` through our engine and llama.cpp: (our model,
    the token ids, our logits, _errors' (llama.cpp's logits, our mean and max error, its noise))."""
    path = tmp_path / f"gpt-oss-{shape}-{kind}.gguf"
    write_model(path, SHAPES["tiny-gpt-oss"] if shape == "tiny" else ATTENTION_20B, kind, seed=5)
    return beside_llama_cpp(path)  # TOKENS ids: past the windows of 16 and 32


@pytest.mark.parametrize(("shape", "kind"), [("tiny", kind) for kind in KINDS] + [("20b-attention", "q8_0")])
def test_synthetic_gpt_oss_matches_llama_cpp(shape: str, kind: str, tmp_path: Path) -> None:
    ours, _ids, got, (want, mean, worst, noise_mean, noise_max) = _run(kind, tmp_path, shape)
    assert ours.args.arch == "gpt-oss" and ours.args.local_layers == (True, False)
    assert ours.weights.layer(0).sinks is not None and ours.weights.layer(0).experts.gating == "softmax_weight"
    top1 = float(np.mean(got.argmax(-1) == want.argmax(-1)))
    print(f"\nsynthetic gpt-oss {shape} {kind}: |error| mean {mean:.5f} max {worst:.4f}; llama.cpp's batching noise mean "
          f"{noise_mean:.5f} max {noise_max:.4f}; top-1 agreement {top1:.3f}")
    assert mean <= NOISE_FACTOR * noise_mean and worst <= NOISE_FACTOR * noise_max


class _Without(DequantizedWeights):
    """The file's weights with one of gpt-oss's features taken out of every block."""

    def __init__(self, weights: DequantizedWeights, change: dict[str, object], experts: dict[str, object]) -> None:
        super().__init__(weights.model, weights.args)
        self.change, self.expert_change = change, experts

    def layer(self, index: int) -> LayerWeights:
        layer = super().layer(index)
        experts = dataclasses.replace(layer.experts, **self.expert_change)  # type: ignore[arg-type]
        return dataclasses.replace(layer, experts=experts, **self.change)  # type: ignore[arg-type]


def _silu_glu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    return (gate / (1.0 + np.exp(-gate)) * up).astype(np.float32)


VARIANTS = {
    "no sinks": ({"sinks": None}, {}, {}),
    "no output bias": ({"bo": None}, {}, {}),
    "no expert biases": ({}, {"router_bias": None, "gate_up_bias": None, "down_bias": None}, {}),
    "softmax gating": ({}, {"gating": "softmax"}, {}),
    "no sliding window": ({}, {}, {"local_layers": (False, False)}),
    "no yarn": ({}, {}, {"rope_scaling": RopeScaling()}),
    "plain swiglu": ({}, {}, {}),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gpt_oss_features_move_the_logits(variant: str, tmp_path: Path) -> None:
    ours, ids, _got, (want, mean, _worst, noise_mean, _noise_max) = _run("q8_0", tmp_path)
    layer_change, expert_change, args_change = VARIANTS[variant]
    args = dataclasses.replace(ours.args, **args_change)
    other = Transformer(args, _Without(DequantizedWeights(ours.weights.model, args), layer_change, expert_change),
                        ours.rope.freq_factors)
    if variant == "plain swiglu":
        other._glu = _silu_glu  # type: ignore[method-assign]
    off = float(np.abs(_logits(other, ids) - want).mean())
    print(f"\ngpt-oss with {variant}: error mean {off:.4f} (ours {mean:.5f}, bound {NOISE_FACTOR * noise_mean:.5f})")
    assert off > 2 * max(NOISE_FACTOR * noise_mean, mean)
