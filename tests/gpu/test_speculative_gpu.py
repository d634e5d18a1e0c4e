"""Token trees on the GPU engine (resident and streamed weights): one tree pass gives each node the
logits of a plain pass over its path through the same batched products (within the prompt path's
bound: float16 operands), accepting a path keeps its keys and values, and speculative generation
runs with more than one token per target pass.

Run on the H200:  .venv/bin/python -m pytest -v tests/gpu/test_speculative_gpu.py
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from infer.engine import greedy
from infer.gguf_file import GGUFModel
from infer.speculative import ModelDrafter, Speculator, Tree
from infer.synth import Shape, write_model

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu
SHAPE = Shape(n_layers=6, dim=512, ffn_dim=1536, n_heads=8, n_kv_heads=2, vocab_size=2000, context_length=1024)
CTX = 512
BOUND = 3e-2  # the prompt path's bound against the CPU (tests/gpu/test_model.py)


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("spec") / "m-q4_k_m.gguf"
    write_model(p, SHAPE, "q4_k_m", seed=8)
    return p


def _models(path: Path):  # noqa: ANN202
    from infer.gpu import load_gpu_transformer
    from infer.tiers.session import StreamingConfig, build_streaming_engine

    yield "resident", load_gpu_transformer(GGUFModel(path), CTX), lambda: None
    session = build_streaming_engine(GGUFModel(path), StreamingConfig(enabled=True), CTX, "gpu", measure=False)
    yield "streamed", session.engine.model, session.close


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_tree_pass_equals_each_path(path: Path) -> None:
    rng = np.random.default_rng(2)
    prompt = rng.integers(3, SHAPE.vocab_size, 40)
    parents = [-1] + [int(rng.integers(max(0, i - 4), i)) for i in range(1, 24)]
    tree = Tree([int(t) for t in rng.integers(3, SHAPE.vocab_size, 24)], parents)
    for name, model, close in _models(path):
        try:
            model.gemv_prefill_max = 0  # plain passes through the batched products too
            cache = model.new_cache(CTX)
            model.forward(prompt, cache)
            got = model.forward_tree(np.array(tree.tokens), np.array(tree.parents), cache)
            agree = []
            for node in range(len(tree.tokens)):
                chain = [node]
                while tree.parents[chain[-1]] >= 0:
                    chain.append(tree.parents[chain[-1]])
                ref = model.new_cache(CTX)
                model.forward(prompt, ref)
                want = model.forward(np.array([tree.tokens[i] for i in reversed(chain)]), ref)
                assert _rel(got[node], want) < BOUND, (name, node)
                agree.append(got[node].argmax() == want.argmax())
            assert np.mean(agree) >= 0.9, name
            deepest = max(range(len(parents)), key=lambda i: len(_path(parents, i)))
            kept = _path(parents, deepest)
            cache.accept(kept)
            nxt = model.forward(np.array([9]), cache)
            ref = model.new_cache(CTX)
            want = model.forward(np.concatenate([prompt, [tree.tokens[i] for i in kept], [9]]), ref)
            assert _rel(nxt, want) < BOUND and cache.length == len(prompt) + len(kept) + 1, name
            print(f"{name}: tree of {len(parents)} nodes, top-1 agreement {np.mean(agree):.3f}")
        finally:
            close()


def _path(parents: list[int], node: int) -> list[int]:
    out = [node]
    while parents[out[-1]] >= 0:
        out.append(parents[out[-1]])
    return out[::-1]


def test_speculative_generation_on_the_gpu(path: Path) -> None:
    """A draft (the same weights with float32 activations) gets most of its chain accepted."""
    from infer.gpu import load_gpu_transformer

    target = load_gpu_transformer(GGUFModel(path), CTX)
    draft = load_gpu_transformer(GGUFModel(path), CTX, match_llama_cpp=False)
    prompt = list(np.random.default_rng(5).integers(3, SHAPE.vocab_size, 20))
    spec = Speculator(target, ModelDrafter(draft, CTX, depth=4, width=2), 9, CTX)
    out = list(spec.generate(prompt, 32, greedy))
    print(f"GPU speculation: {spec.stats.tokens_per_pass:.2f} tokens per pass")
    assert len(out) == 32 and spec.stats.tokens_per_pass > 1.5
