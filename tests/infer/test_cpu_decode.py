"""The packed engine's one-call decode (infer.cpu_decode, native/cpu_decode.c) and its SwiGLU: a
token decoded in one native call gets the bits the batched recipe gives it, on a real model and on
synthetic files with QKV biases (qwen2) and per-head q/k norms (qwen3); the models it does not take
decode as before."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from infer import cpu_kernels, cpu_layers
from infer.errors import NonFiniteActivations
from infer.gguf_file import GGUFModel
from infer.layerskip import skipping
from infer.model import load_transformer
from infer.synth import SHAPES, write_model
from tests.oracle.fixtures import model_path

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="native CPU kernels not built")


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def _implementations() -> list[str]:
    return [n for n, runs in (("avx512", cpu_kernels.cpu_has_avx512()), ("avx2", cpu_kernels.cpu_has_avx2()),
                              ("portable", True)) if runs]


def test_swiglu_is_within_two_ulps_of_float64(rng: np.random.Generator) -> None:
    gate = np.concatenate([rng.standard_normal(5000) * 4, np.linspace(-86, 86, 999),
                           [0.0, -0.0, 1e-30, -1e-30, 88.0, -88.0]]).astype(np.float32)
    up = rng.standard_normal(gate.size).astype(np.float32)
    got = cpu_layers.swiglu(gate, up)
    g = gate.astype(np.float64)
    want = (g / (1.0 + np.exp(-g)) * up).astype(np.float32)
    ulp = np.spacing(np.abs(want)).astype(np.float64)
    assert np.all(np.abs(got.astype(np.float64) - want) <= 2 * ulp + 1e-38)


def test_swiglu_at_the_edges() -> None:
    gate = np.array([-200.0, -100.0, 100.0, 200.0, np.inf, -np.inf, np.nan], np.float32)
    up = np.full(gate.size, 3.0, np.float32)
    got = cpu_layers.swiglu(gate, up)
    assert np.all(np.abs(got[:2]) < 1e-30) and np.all(np.isfinite(got[:2]))  # silu(-x) ~ 0, no overflow
    assert got[2] == 300.0 and got[3] == 600.0 and got[4] == np.inf
    assert not np.isfinite(got[5]) and np.isnan(got[6])  # not hidden: the next product refuses them


def test_swiglu_is_the_same_on_every_path(rng: np.random.Generator) -> None:
    gate = (rng.standard_normal(1237) * 6).astype(np.float32)  # a tail past the 8-lane blocks
    up = rng.standard_normal(1237).astype(np.float32)
    results = {}
    for name in _implementations():
        cpu_kernels.set_implementation(name)
        results[name] = _bits(cpu_layers.swiglu(gate, up))
    first = next(iter(results.values()))
    assert all(np.array_equal(r, first) for r in results.values()), list(results)


def _synthetic(tmp_path: Path, arch: str, kind: str) -> Path:
    path = tmp_path / f"{arch}-{kind}.gguf"
    write_model(path, SHAPES["tiny"], kind, seed=5, arch=arch)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("decode")
    return {"smollm2 q4_k_m": model_path("smollm2-Q4_K_M"), "qwen2 q4_k_m": _synthetic(tmp, "qwen2", "q4_k_m"),
            "qwen3 q8_0": _synthetic(tmp, "qwen3", "q8_0"), "llama q4_0": _synthetic(tmp, "llama", "q4_0")}


@pytest.mark.parametrize("name", ["smollm2 q4_k_m", "qwen2 q4_k_m", "qwen3 q8_0", "llama q4_0"])
def test_one_call_decode_is_the_batched_pass_bit_for_bit(models: dict[str, Path], name: str) -> None:
    model = load_transformer(GGUFModel(models[name]), packed=True)
    assert model._decode_layers() is not None, "the one-call decode should take this model"
    ids = [int(t) for t in np.random.default_rng(1).integers(3, model.args.vocab_size, 12)]
    whole = model.forward(np.array(ids), model.new_cache(32), all_logits=True)
    cache = model.new_cache(32)
    model.forward(np.array(ids[:4]), cache)
    for j in range(4, len(ids)):  # one token a call: the native decode
        got = model.forward(np.array([ids[j]]), cache)
        assert np.array_equal(_bits(got), _bits(whole[j])), f"{name}: token {j}"
    assert cache.length == len(ids)
    # and beside another sequence (forward_batch's recipe), the same bits
    other, cache2 = model.new_cache(32), model.new_cache(32)
    model.forward(np.array(ids[:4]), cache2)
    pair = model.forward_batch([(np.array([ids[4]]), cache2), (np.array(ids[:3]), other)])
    assert np.array_equal(_bits(pair[0]), _bits(whole[4]))


def test_the_models_it_leaves_alone(models: dict[str, Path], tmp_path: Path) -> None:
    path = models["smollm2 q4_k_m"]
    assert load_transformer(GGUFModel(path), packed=False)._decode_layers() is None  # the NumPy engine
    assert load_transformer(GGUFModel(path), exact=True)._decode_layers() is None
    gemma = _synthetic(tmp_path, "gemma3", "q8_0")  # post-norms, GeGLU
    assert load_transformer(GGUFModel(gemma), packed=True)._decode_layers() is None


def test_a_layer_skipping_view_decodes_its_own_layers(models: dict[str, Path]) -> None:
    model = load_transformer(GGUFModel(models["smollm2 q4_k_m"]), packed=True)
    ids = np.arange(200, 210)
    model.forward(ids[:2], model.new_cache(16))  # the full model's decode made first
    assert model._decode_layers().indices == list(range(model.args.n_layers))
    view = skipping(model, [3, 7])
    whole = view.forward(ids, view.new_cache(16), all_logits=True)
    cache = view.new_cache(16)
    view.forward(ids[:5], cache)
    got = view.forward(ids[5:6], cache)
    assert view._decode_layers().indices == [i for i in range(model.args.n_layers) if i not in (3, 7)]
    assert np.array_equal(_bits(got), _bits(whole[5]))
    assert model._decode_layers().indices == list(range(model.args.n_layers))


def test_nan_activations_end_in_one_clear_error(models: dict[str, Path]) -> None:
    model = load_transformer(GGUFModel(models["llama q4_0"]), packed=True)
    cache = model.new_cache(8)
    model.forward(np.array([5, 6]), cache)
    decode = model._decode_layers()
    x = np.full(model.args.dim, np.nan, np.float32)
    cos, sin = model.rope.angles(np.array([cache.length]))
    with pytest.raises(NonFiniteActivations):
        decode(x, cache, cache.length, cos, sin)
    with pytest.raises(ValueError, match="outside a cache of 8"):
        decode(np.zeros(model.args.dim, np.float32), cache, 8, cos, sin)


STRESS = """
import sys
import numpy as np
from infer.gguf_file import GGUFModel
from infer.model import load_transformer
model = load_transformer(GGUFModel(sys.argv[1]), packed=True)
model.weights.native_layers.threads = int(sys.argv[2])
ids = np.random.default_rng(0).integers(3, 1000, 400)
first = None
for _ in range(int(sys.argv[3])):
    cache = model.new_cache(420)
    model.forward(ids[:2], cache)
    out = np.stack([model.forward(ids[j : j + 1], cache) for j in range(2, len(ids))]).view(np.uint32)
    first = out if first is None else first
    assert np.array_equal(out, first), "a decode gave other bits"
print("ok")
"""


@pytest.mark.parametrize("threads", [3, 4])
def test_products_issued_back_to_back_from_c_stay_exact(models: dict[str, Path], threads: int) -> None:
    """The one-call decode issues the pool's tasks back to back from C. A worker finishing the
    previous task could claim a chunk against its counter with the next task's fields (fixed in
    native/cpu_qdot_pool.c), which crashed, gave NaN or other bits within ~100 runs of this. Run
    in a child process, so a crash fails the test rather than the suite."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", STRESS, str(models["llama q4_0"]), str(threads), "100"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and result.stdout.strip() == "ok", (result.returncode, result.stderr[-2000:])
