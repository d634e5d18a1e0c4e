"""gpt-oss on the CPU engines: its gating (the top k logits, weighted by their own softmax) and
clamped SwiGLU against their formulas, the packed engine (MXFP4 experts and attention sinks in the
native kernels) giving a row the same bits in any pass, the exact engine agreeing with it, and greedy
speculation giving plain decoding's text. Agreement with llama.cpp is
tests/infer/test_oracle_gpt_oss.py's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from infer import cpu_kernels
from infer.cli import main
from infer.gguf_file import GGUFModel
from infer.model import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT, load_transformer, swiglu_oai
from infer.moe import MixtureOfExperts
from infer.packed_weights import PackedLinear, PackedWeights, batch_invariant
from infer.synth import SHAPES, write_model
from tests.infer.test_packed_weights import check_pass_invariance


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gpt-oss") / "gpt-oss-q8_0.gguf"
    write_model(path, SHAPES["tiny-gpt-oss"], "q8_0", seed=2)
    return path


def test_gating_weights_the_top_k_logits_by_their_own_softmax() -> None:
    router = lambda h: h  # noqa: E731 - the logits are the input here
    moe = MixtureOfExperts(router, [], [], n_used=2, normalize=False, gating="softmax_weight",  # type: ignore[arg-type]
                           router_bias=np.array([0.0, 0.0, 3.0, 0.0], np.float32))
    logits = np.array([[1.0, 4.0, 0.5, 2.0], [0.0, -1.0, -2.5, 0.2]], np.float32)
    chosen, weights = moe.route(logits)
    assert chosen.tolist() == [[1, 2], [2, 3]]  # the bias moves expert 2 up: 3.5 and 0.5
    biased = logits + moe.router_bias
    for t in range(2):
        top = biased[t, chosen[t]].astype(np.float64)
        want = np.exp(top - top.max()) / np.exp(top - top.max()).sum()
        assert np.allclose(weights[t], want, rtol=1e-6) and abs(float(weights[t].sum()) - 1) < 1e-6


def test_clamped_swiglu_is_its_formula() -> None:
    gate = np.array([-30.0, -1.0, 0.0, 0.5, 6.9, 7.0, 12.0], np.float32)
    up = np.array([-9.0, -7.5, 0.0, 1.0, 7.2, -0.5, 3.0], np.float32)
    x = np.minimum(gate.astype(np.float64), SWIGLU_OAI_LIMIT)
    y = np.clip(up.astype(np.float64), -SWIGLU_OAI_LIMIT, SWIGLU_OAI_LIMIT)
    want = x / (1 + np.exp(-SWIGLU_OAI_ALPHA * x)) * (y + 1)
    for exact in (False, True):
        got = swiglu_oai(gate, up, exact)
        assert got.dtype == np.float32 and np.allclose(got, want, rtol=3e-7, atol=1e-12), exact


@pytest.mark.skipif(not cpu_kernels.available(), reason="native CPU kernels not built")
def test_packed_gpt_oss_does_not_depend_on_batching(gpt_oss: Path) -> None:
    """MXFP4 experts and the sinks' attention in the native kernels: a row's logits are the same bits
    token by token, as one prompt and beside another sequence, and agree with the exact engine."""
    model = load_transformer(GGUFModel(gpt_oss), packed=True)
    moe = model.weights.layer(0).experts
    assert isinstance(model.weights, PackedWeights) and model.weights.batch_invariant and batch_invariant(GGUFModel(gpt_oss))
    assert all(isinstance(p, PackedLinear) for p in (*moe.gate_up, *moe.down)) and moe.row_experts is None
    ids = np.random.default_rng(4).integers(3, 1024, 40)  # past the window of 16
    whole = check_pass_invariance(model, ids, 48, 20, 6, ids[:7])
    # the exact engine (float64 sums): most rows agree to float32 rounding; an expert choice on a near
    # tie may go the other way and move the rows after it by hundredths
    exact = load_transformer(GGUFModel(gpt_oss), exact=True)
    want = exact.forward(ids, exact.new_cache(48), all_logits=True)
    rows = np.abs(whole - want).max(axis=1)
    assert np.median(rows) <= 1e-5 * np.abs(want).max() and np.mean(whole.argmax(1) == want.argmax(1)) >= 0.95


@pytest.mark.skipif(not cpu_kernels.available(), reason="native CPU kernels not built")
@pytest.mark.parametrize("drafter", [["--lookup"], ["--draft-model", "SELF"]], ids=["lookup", "draft-model"])
def test_greedy_speculation_gives_the_plain_text(gpt_oss: Path, drafter: list[str]) -> None:
    prompt = "w1 w2 w3 w1 w2 w3 w1 w2 w3 w1"
    base = ["-m", str(gpt_oss), "-p", prompt, "-n", "24", "-t", "0"]
    plain = CliRunner().invoke(main, base)
    spec = CliRunner().invoke(main, base + [str(gpt_oss) if a == "SELF" else a for a in drafter])
    assert plain.exit_code == 0 and spec.exit_code == 0, plain.output + spec.output
    assert plain.stdout.strip() and spec.stdout == plain.stdout
