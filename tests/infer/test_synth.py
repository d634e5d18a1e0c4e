"""infer.synth writes GGUF files the CPU engine loads and runs, with llama.cpp's Q4_K_M type mix,
a vocabulary of exactly the shape's size, and weights of the intended scale."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from infer.gguf_file import GGUFModel
from infer.model import ModelArgs, load_transformer
from infer.synth import FILE_TYPES, SHAPES, Shape, main, tensor_type, write_model
from infer.tokenizer import Tokenizer

SMALL = Shape(n_layers=8, dim=256, ffn_dim=512, n_heads=4, n_kv_heads=2, vocab_size=300, context_length=256)


@pytest.mark.parametrize("kind", sorted(FILE_TYPES))
def test_file_loads_and_runs_in_the_cpu_engine(tmp_path: Path, kind: str) -> None:
    path = tmp_path / f"m-{kind}.gguf"
    size = write_model(path, SMALL, kind, seed=3)
    assert path.stat().st_size == size
    model = GGUFModel(path)
    args = ModelArgs.from_gguf(model)
    assert (args.n_layers, args.dim, args.ffn_dim, args.n_heads, args.n_kv_heads, args.vocab_size) == (
        8, 256, 512, 4, 2, 300)
    for i in range(SMALL.n_layers):
        for base in ("attn_q", "attn_v", "ffn_down"):
            assert model.tensor(f"blk.{i}.{base}.weight").ggml_type == tensor_type(kind, base, i, 8)
    w = model.tensor("blk.3.ffn_gate.weight").dequantize()
    assert abs(float(w.std()) - 1 / np.sqrt(256)) < 0.2 / np.sqrt(256)
    assert abs(float(w.mean())) < 0.1 / np.sqrt(256)
    transformer = load_transformer(model)
    logits = transformer.forward(np.array([1, 17, 250, 4]), transformer.new_cache(16), all_logits=True)
    assert logits.shape == (4, 300) and np.isfinite(logits).all() and logits.std() > 0.1


def test_q4_k_m_mix_follows_llama_cpp() -> None:
    kinds = [tensor_type("q4_k_m", "ffn_down", i, 32).name for i in range(32)]
    assert kinds.count("Q6_K") == 16  # half the layers, as llama.cpp's use_more_bits picks
    assert tensor_type("q4_k_m", "output", 0, 32).name == "Q6_K"
    assert tensor_type("q4_k_m", "attn_q", 5, 32).name == "Q4_K"


def test_vocabulary_tokenizes(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    write_model(path, SMALL, "q8_0")
    tok = Tokenizer.from_gguf(GGUFModel(path).metadata)
    assert tok.vocab_size == 300
    ids = tok.encode("héllo")
    assert tok.decode(ids) == "héllo"


def test_shapes_match_the_published_models() -> None:
    s8, s70 = SHAPES["8b"], SHAPES["70b"]
    assert (s8.n_layers, s8.dim, s8.ffn_dim, s8.n_heads, s8.n_kv_heads, s8.vocab_size) == (32, 4096, 14336, 32, 8, 128256)
    assert (s70.n_layers, s70.dim, s70.ffn_dim, s70.n_heads, s70.n_kv_heads) == (80, 8192, 28672, 64, 8)
    q05, q15 = SHAPES["q05b"], SHAPES["q15b"]  # Qwen2.5-Coder-0.5B/1.5B's config.json
    assert (q05.n_layers, q05.dim, q05.ffn_dim, q05.n_heads, q05.n_kv_heads) == (24, 896, 4864, 14, 2)
    assert (q15.n_layers, q15.dim, q15.ffn_dim, q15.n_heads, q15.n_kv_heads) == (28, 1536, 8960, 12, 2)
    assert q05.vocab_size == q15.vocab_size == 151936
    # rows of 896 are no whole K-quant blocks: llama.cpp's Qwen2.5-0.5B Q4_K_M file has Q5_0 and Q8_0 there
    assert tensor_type("q4_k_m", "ffn_gate", 0, 24, 896).name == "Q5_0"
    assert tensor_type("q4_k_m", "output", 0, 24, 896).name == "Q8_0"
    assert tensor_type("q4_k_m", "ffn_down", 0, 24, 4864).name == "Q6_K"


def test_cli_rejects_bad_type(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--type", "q3_k", "-o", str(tmp_path / "x.gguf")])
    assert main(["--shape", "tiny", "--type", "q4_0", "-o", str(tmp_path / "t.gguf")]) == 0
    assert "wrote" in capsys.readouterr().out
