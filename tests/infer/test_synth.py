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


def test_moe_shapes_match_the_published_models() -> None:
    q = SHAPES["qwen3-30b-a3b"]  # Qwen3-30B-A3B's config.json
    assert (q.arch, q.n_layers, q.dim, q.n_heads, q.n_kv_heads, q.head_dim, q.vocab_size) == (
        "qwen3moe", 48, 2048, 32, 4, 128, 151936)
    assert (q.n_experts, q.n_experts_used, q.expert_ffn_dim, q.ffn_dim) == (128, 8, 768, 6144)
    m = SHAPES["mixtral-8x7b"]  # Mixtral-8x7B's: a llama file with 2 of 8 experts of the dense width
    assert (m.arch, m.n_layers, m.dim, m.ffn_dim, m.n_heads, m.n_kv_heads, m.vocab_size) == (
        "llama", 32, 4096, 14336, 32, 8, 32000)
    assert (m.n_experts, m.n_experts_used) == (8, 2)
    # llama.cpp's Q4_K_M: the experts' down stack takes ffn_down's extra bits; 8-expert files Q8_0 K and V
    assert tensor_type("q4_k_m", "ffn_down_exps", 0, 48, 768).name == "Q6_K"
    assert tensor_type("q4_k_m", "ffn_gate_exps", 5, 48).name == "Q4_K"
    assert tensor_type("q4_k_m", "ffn_gate_inp", 5, 48).name == "F32"
    assert tensor_type("q4_k_m", "attn_k", 5, 32, n_experts=8).name == "Q8_0"


@pytest.mark.parametrize("kind", ["f16", "q4_k_m"])
def test_moe_file_holds_distinct_experts(tmp_path: Path, kind: str) -> None:
    """Every expert (and the gate and up stacks) its own random weights, so that routing matters; the
    router float32, as llama.cpp's quantizer leaves it."""
    path = tmp_path / f"moe-{kind}.gguf"
    assert main(["--shape", "tiny-moe", "--type", kind, "-o", str(path)]) == 0
    model = GGUFModel(path)
    args = ModelArgs.from_gguf(model)
    assert (args.arch, args.n_experts, args.n_experts_used, args.expert_ffn_dim) == ("qwen3moe", 16, 4, 256)
    assert model.tensor("blk.0.ffn_gate_inp.weight").type_name == "F32"
    gate, up = (model.tensor(f"blk.1.ffn_{x}_exps.weight").dequantize() for x in ("gate", "up"))
    assert gate.shape == (16, 256, 256) and not np.array_equal(gate, up)
    assert all(not np.array_equal(gate[0], gate[e]) for e in range(1, 16))
    assert abs(float(gate.std()) - 1 / 16) < 0.2 / 16


def test_moe_cli_refuses_a_shape_without_experts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--shape", "tiny", "--arch", "qwen3moe", "-o", str(tmp_path / "x.gguf")]) == 2
    assert "qwen3moe needs experts" in capsys.readouterr().err


def test_gpt_oss_shape_matches_the_published_model(tmp_path: Path) -> None:
    """gpt-oss-20b's config.json: 20.9B parameters, 3.6B active (4 of 32 experts; with the output
    matrix); the experts MXFP4 in every file kind, the rest of the kind's types; the tiny one's file
    reads back with the window on the first layer of each pair."""
    g = SHAPES["gpt-oss-20b"]
    q_dim, kv_dim = g.n_heads * g.head_dim, g.n_kv_heads * g.head_dim
    attention = 2 * g.dim * q_dim + 2 * g.dim * kv_dim
    expert = 3 * g.dim * g.expert_ffn_dim
    embeddings = 2 * g.vocab_size * g.dim
    total = g.n_layers * (attention + g.n_experts * expert) + embeddings
    active = g.n_layers * (attention + g.n_experts_used * expert) + g.vocab_size * g.dim
    assert abs(total / 20.9e9 - 1) < 0.01 and abs(active / 3.6e9 - 1) < 0.02, (total, active)
    assert tensor_type("q4_k_m", "ffn_down_exps_mxfp4", 0, 24, 2880).name == "MXFP4"
    assert tensor_type("q4_k_m", "attn_q", 0, 24, 2880).name == "Q5_0"  # 2880 is no whole K-quant block
    path = tmp_path / "gpt-oss.gguf"
    assert main(["--shape", "tiny-gpt-oss", "--type", "q4_k_m", "-o", str(path)]) == 0
    model = GGUFModel(path)
    args = ModelArgs.from_gguf(model)
    assert (args.arch, args.local_layers, args.sliding_window, args.rope_scaling.kind) == (
        "gpt-oss", (True, False), 16, "yarn")
    assert model.tensor("blk.0.ffn_up_exps.weight").type_name == "MXFP4"
    assert model.tensor("blk.0.ffn_up_exps.bias").shape == (8, 256)
    assert model.tensor("blk.1.attn_sinks.weight").shape == (4,)
