"""infer.layerskip on a real small model (SmolLM2 Q8_0, CPU): the calibration's similarities, the
layers a threshold leaves out, the skipping view (shared weights, own cache), and greedy
speculation drafted by it emitting the target's own text."""

from __future__ import annotations

import numpy as np
import pytest

from infer.engine import Engine, greedy
from infer.gguf_file import GGUFModel
from infer.layerskip import calibrate, layer_similarity, self_draft_layers, skipping, streamed_layers
from infer.model import load_transformer
from infer.speculative import ModelDrafter, Speculator
from tests.oracle.assets import smollm2_path


@pytest.fixture(scope="module")
def target():  # noqa: ANN201
    path = smollm2_path("Q8_0")
    if not path.exists():
        pytest.skip("SmolLM2 Q8_0 missing: run scripts/fetch-models.sh")
    return load_transformer(GGUFModel(path), exact=True)


def test_similarity_and_calibration(target) -> None:  # noqa: ANN001
    rng = np.random.default_rng(1)
    sims = layer_similarity(target, list(rng.integers(10, 4000, 64)))
    assert sims.shape == (30,) and np.isfinite(sims).all() and (sims <= 1 + 1e-9).all()
    loose, tight = calibrate(sims, 0.5), calibrate(sims, 0.99)
    assert set(tight) <= set(loose) and len(loose) < 30
    assert calibrate(sims, 1e-9) == [i for i in range(30) if i != int(np.argmin(sims))]  # never every layer
    with pytest.raises(ValueError):
        calibrate(sims, 0.0)
    assert streamed_layers(target) == set() and self_draft_layers(target, None, None, True) == set()


def test_skipping_view_shares_weights_and_differs(target) -> None:  # noqa: ANN001
    view = skipping(target, [3, 4, 5])
    assert view.weights is target.weights and target.skip == frozenset() and view.skip == {3, 4, 5}
    ids = np.array([1, 504, 3458, 282])
    full, part = target.forward(ids, target.new_cache(16)), view.forward(ids, view.new_cache(16))
    assert full.shape == part.shape and not np.array_equal(full, part)
    with pytest.raises(ValueError):
        skipping(target, range(30))
    with pytest.raises(ValueError):
        skipping(target, [30])


def test_self_draft_speculation_is_the_plain_text(target) -> None:  # noqa: ANN001
    prompt = [1, 504, 3458, 282, 4649, 314, 2]
    want = list(Engine(target, 256).generate(prompt, 24, greedy))
    view = skipping(target, [10, 11, 12, 13, 14])
    spec = Speculator(target, ModelDrafter(view, 256, 4, 1, cache=view.new_cache(256)), 5, 256)
    assert list(spec.generate(prompt, 24, greedy)) == want
    assert spec.stats.passes < 24  # the draft gets some tokens accepted


def test_draft_ppl_bench_reports_the_cost(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench.spec_bench draft-ppl: the whole target's perplexity, and each self-draft's (higher when
    layers are left out), with the layers it kept."""
    from bench import spec_bench

    path = smollm2_path("Q8_0")
    if not path.exists():
        pytest.skip("SmolLM2 Q8_0 missing: run scripts/fetch-models.sh")
    monkeypatch.setattr(spec_bench, "humaneval_prompts",
                        lambda n: ["def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n"] * n)
    result = spec_bench.draft_ppl(spec_bench.argparse.Namespace(target=path, skip="10,11,12", thresholds=[0.99],
                                                               prompts=8, ctx=32, chunks=2))
    whole, skipped = result["rows"][0], result["rows"][1]
    assert whole["layers"] == 30 and skipped["layers"] == 27 and skipped["left_out"] == [10, 11, 12]
    assert skipped["perplexity"] > whole["perplexity"] > 1
    assert len(result["rows"]) == 3 and len(result["similarity"]) == 30
