"""GGUFModel on a small synthetic file: metadata as plain Python values, tensor records and views,
and independence from the order in which the file stores its tensors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from infer.gguf_file import GGUFModel
from infer.model import load_transformer
from infer.synth import Shape, write_model
from tests.oracle.gguf_edit import write_copy

TINY = Shape(n_layers=2, dim=256, ffn_dim=512, n_heads=4, n_kv_heads=2, vocab_size=300, context_length=128)


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_model(p, TINY, "q4_k_m", seed=2)
    return p


def test_metadata_is_plain_python(path: Path) -> None:
    meta = GGUFModel(path).metadata
    assert meta["general.architecture"] == "llama"
    assert isinstance(meta["llama.block_count"], int) and meta["llama.block_count"] == 2
    assert isinstance(meta["llama.attention.layer_norm_rms_epsilon"], float)
    tokens = meta["tokenizer.ggml.tokens"]
    assert isinstance(tokens, list) and len(tokens) == 300 and all(isinstance(t, str) for t in tokens)
    assert isinstance(meta["tokenizer.ggml.scores"][0], float)
    assert not any(key.startswith("GGUF.") for key in meta)


def test_tensor_records_view_the_file(path: Path) -> None:
    model = GGUFModel(path)
    info = model.tensor("blk.0.attn_q.weight")
    assert info.shape == (256, 256)  # NumPy order: (out_features, in_features)
    raw = path.read_bytes()[info.offset : info.offset + info.nbytes]
    assert info.data.tobytes() == raw
    assert info.dequantize().shape == (256, 256)


def test_tensor_order_in_the_file_does_not_matter(path: Path, tmp_path: Path) -> None:
    reversed_path = write_copy(path, tmp_path / "reversed.gguf", reverse_tensor_order=True)
    forward, backward = GGUFModel(path), GGUFModel(reversed_path)
    assert list(forward.tensors) == list(reversed(list(backward.tensors)))
    ids = np.array([5, 17, 200, 3, 99])
    logits = []
    for model in (forward, backward):
        transformer = load_transformer(model)
        logits.append(transformer.forward(ids, transformer.new_cache(8), all_logits=True))
    np.testing.assert_array_equal(logits[0], logits[1])
