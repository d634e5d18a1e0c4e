"""Synthetic Llama-shaped GGUF models with random weights, for benchmarks at real scale without
downloads and for GPU-vs-CPU checks.

    python -m infer.synth --shape 8b --type q4_k_m -o llama8b-q4_k_m.gguf

Weights are random with sane scales (matrices ~ N(0, 1/in_features) in effect, norms near 1), so
activations stay finite through any number of layers. Large files are written fast: each tensor's
data is a pool of random quantized blocks written over and over (the pool holds up to POOL_BLOCKS
blocks, so small models are fully random). The vocabulary is a byte-level SentencePiece ("llama")
one: <unk>, <s>, </s>, the 256 byte tokens, the space piece, then filler pieces up to the shape's vocab size.

Mixture-of-experts shapes (`qwen3moe`, and `llama` with experts: Mixtral's layout) get a float32
router (`ffn_gate_inp`, never quantized, as llama.cpp's quantizer leaves it) and the experts' matrices
stacked (`ffn_{gate,up,down}_exps`); gpt-oss files add attention sinks, the output, router and expert
biases, and keep their experts MXFP4 whatever the type. Random routers send tokens to experts nearly uniformly;
`--router-skew S` makes some experts popular: expert e's router row is scaled by S^(-e / (n - 1)), so
expert 0's logits spread S times wider than the last one's and it wins the top k far more often (an
assumption for cache studies, not a property of trained models).
"""

from __future__ import annotations

import argparse
import struct
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quantize

from infer.arch import ARCHITECTURES

T = GGMLQuantizationType
ARCHS = ("llama", "qwen2", "qwen3", "gemma3", "qwen3moe", "qwen2moe", "gpt-oss")
POOL_BLOCKS = 1 << 16
# Expert stacks of up to this many weights get all their own random data, so that no two experts (nor
# the gate and up stacks) are copies of one pool, which would make routing irrelevant; larger ones a
# pool of their own, one block longer than POOL_BLOCKS, so consecutive experts start at other offsets
EXPERT_OWN_WEIGHTS = 1 << 24
ALIGNMENT = 32


@dataclass(frozen=True)
class Shape:
    n_layers: int
    dim: int
    ffn_dim: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    context_length: int = 8192
    rope_base: float = 500000.0
    norm_eps: float = 1e-5
    arch: str = "llama"
    head_dim: int = 0  # 0: dim / n_heads (Qwen3 sets its own: attention.key_length)
    sliding_window: int = 0  # attention.sliding_window when > 0 (Gemma 3: its local layers; Llama: every layer)
    n_experts: int = 0  # expert_count: > 0 makes every block's feed-forward a mixture of experts
    n_experts_used: int = 0  # expert_used_count: experts per token
    expert_ffn_dim: int = 0  # qwen3moe's expert_feed_forward_length (a llama file's experts are ffn_dim wide)
    shared_ffn_dim: int = 0  # qwen2moe's expert_shared_feed_forward_length (its shared expert's width)
    yarn_factor: float = 0.0  # > 0: rope.scaling.type yarn with this factor (gpt-oss)
    yarn_original_context: int = 0  # rope.scaling.original_context_length with yarn

    @property
    def head_size(self) -> int:
        return self.head_dim or self.dim // self.n_heads


SHAPES: dict[str, Shape] = {
    "tiny": Shape(n_layers=2, dim=256, ffn_dim=768, n_heads=4, n_kv_heads=2, vocab_size=1024, context_length=2048),
    "1b": Shape(n_layers=16, dim=2048, ffn_dim=8192, n_heads=32, n_kv_heads=8, vocab_size=128256),
    "8b": Shape(n_layers=32, dim=4096, ffn_dim=14336, n_heads=32, n_kv_heads=8, vocab_size=128256),
    "70b": Shape(n_layers=80, dim=8192, ffn_dim=28672, n_heads=64, n_kv_heads=8, vocab_size=128256),
    # the shapes of the speculative pair (Qwen2.5-Coder 0.5B and 1.5B, with their Q/K/V biases)
    "q05b": Shape(n_layers=24, dim=896, ffn_dim=4864, n_heads=14, n_kv_heads=2, vocab_size=151936,
                  context_length=32768, rope_base=1e6, norm_eps=1e-6, arch="qwen2"),
    "q15b": Shape(n_layers=28, dim=1536, ffn_dim=8960, n_heads=12, n_kv_heads=2, vocab_size=151936,
                  context_length=32768, rope_base=1e6, norm_eps=1e-6, arch="qwen2"),
    # mixtures of experts: Qwen3-30B-A3B's config.json (8 of 128 experts of width 768 per token), Mixtral
    # 8x7B's (2 of 8 of width 14336), and a small qwen3moe for tests
    "qwen3-30b-a3b": Shape(n_layers=48, dim=2048, ffn_dim=6144, n_heads=32, n_kv_heads=4, vocab_size=151936,
                           context_length=40960, rope_base=1e6, norm_eps=1e-6, arch="qwen3moe", head_dim=128,
                           n_experts=128, n_experts_used=8, expert_ffn_dim=768),
    "mixtral-8x7b": Shape(n_layers=32, dim=4096, ffn_dim=14336, n_heads=32, n_kv_heads=8, vocab_size=32000,
                          context_length=32768, rope_base=1e6, n_experts=8, n_experts_used=2),
    "tiny-moe": Shape(n_layers=2, dim=256, ffn_dim=768, n_heads=4, n_kv_heads=2, vocab_size=1024, context_length=2048,
                      rope_base=1e6, norm_eps=1e-6, arch="qwen3moe", head_dim=128, n_experts=16, n_experts_used=4,
                      expert_ffn_dim=256),
    # qwen2moe: Qwen2's attention, 2 of 8 routed experts (weights not renormalised) and a shared expert
    "tiny-qwen2moe": Shape(n_layers=2, dim=256, ffn_dim=768, n_heads=4, n_kv_heads=2, vocab_size=1024,
                           context_length=2048, rope_base=1e6, norm_eps=1e-6, arch="qwen2moe", n_experts=8,
                           n_experts_used=2, expert_ffn_dim=256, shared_ffn_dim=512),
    # gpt-oss-20b's config.json (4 of 32 experts of width 2880, MXFP4; every other layer a window of 128;
    # YaRN x32 over 4096 positions), and a small one for tests (a window of 16, YaRN x4 over 512)
    "gpt-oss-20b": Shape(n_layers=24, dim=2880, ffn_dim=2880, n_heads=64, n_kv_heads=8, vocab_size=201088,
                         context_length=131072, rope_base=150000.0, arch="gpt-oss", head_dim=64, sliding_window=128,
                         n_experts=32, n_experts_used=4, expert_ffn_dim=2880, yarn_factor=32.0,
                         yarn_original_context=4096),
    "tiny-gpt-oss": Shape(n_layers=2, dim=256, ffn_dim=256, n_heads=4, n_kv_heads=2, vocab_size=1024,
                          context_length=2048, rope_base=150000.0, arch="gpt-oss", head_dim=64, sliding_window=16,
                          n_experts=8, n_experts_used=4, expert_ffn_dim=256, yarn_factor=4.0,
                          yarn_original_context=512),
    # Qwen1.5-MoE-A2.7B's config.json: 4 of 60 experts of width 1408, a shared expert of width 5632
    "qwen1.5-moe-a2.7b": Shape(n_layers=24, dim=2048, ffn_dim=5632, n_heads=16, n_kv_heads=16, vocab_size=151936,
                               context_length=8192, rope_base=1e6, norm_eps=1e-6, arch="qwen2moe", n_experts=60,
                               n_experts_used=4, expert_ffn_dim=1408, shared_ffn_dim=5632),
}

# llama.cpp's file_type numbers (LLAMA_FTYPE_*) for general.file_type
FILE_TYPES = {"f16": 1, "q4_0": 2, "q8_0": 7, "q4_k_m": 15,
              # one type for every matrix (the output too): each weight type on a whole model
              "q4_1": 3, "q5_0": 8, "q5_1": 9, "q5_k": 17, "q6_k": 18, "bf16": 32}
_ONE_TYPE = {"q4_1": T.Q4_1, "q5_0": T.Q5_0, "q5_1": T.Q5_1, "q5_k": T.Q5_K, "q6_k": T.Q6_K, "bf16": T.BF16}


def _more_bits(layer: int, n_layers: int) -> bool:
    """The layers where llama.cpp's Q4_K_M keeps attn_v and ffn_down at Q6_K."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


# llama.cpp's types for rows that are not whole 256-weight K-quant blocks (e.g. a width of 896)
K_FALLBACK = {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}


def tensor_type(kind: str, name: str, layer: int, n_layers: int, cols: int = 256, n_experts: int = 0) -> int:
    """The GGML type of a matrix of rows of `cols` weights in a file of `kind` (norms and expert
    routers are always F32; gpt-oss's experts always MXFP4, as its published files keep them)."""
    if name == "ffn_gate_inp":
        return T.F32
    if name.endswith("_exps_mxfp4"):
        return T.MXFP4
    chosen = _tensor_type(kind, name, layer, n_layers, n_experts)
    return K_FALLBACK.get(chosen, chosen) if cols % 256 else chosen


def _tensor_type(kind: str, name: str, layer: int, n_layers: int, n_experts: int = 0) -> int:
    if kind in _ONE_TYPE:
        return _ONE_TYPE[kind]
    if kind == "f16":
        return T.F16
    if kind == "q8_0":
        return T.Q8_0
    if kind == "q4_0":
        return T.Q6_K if name == "output" else T.Q4_0
    if kind == "q4_k_m":
        if name == "output":
            return T.Q6_K
        if n_experts == 8 and name in ("attn_k", "attn_v"):  # llama.cpp's bump for 8-expert (Mixtral) files
            return T.Q8_0
        if n_experts == 8 and name == "attn_output":
            return T.Q5_K
        if name in ("attn_v", "ffn_down", "ffn_down_exps") and _more_bits(layer, n_layers):
            return T.Q6_K
        return T.Q4_K
    raise ValueError(f"unknown model type '{kind}' (known: {', '.join(FILE_TYPES)})")


def _k_quant_blocks(ggml_type: int, n: int, rng: np.random.Generator, sigma: float) -> np.ndarray:
    """Random K-quant blocks whose weights have mean ~0 and standard deviation ~sigma."""
    from infer.gpu.layout import integer_form

    size = GGML_QUANT_SIZES[T(ggml_type)][1]
    blocks = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    one = np.array([1.0], np.float16).view(np.uint8)
    if ggml_type == T.Q6_K:
        blocks[:, 208:210] = one
        q, scale, _ = integer_form(blocks, ggml_type)
        unit = float(np.std(np.repeat(scale, 16, axis=1).reshape(-1) * q.reshape(-1)))
        blocks[:, 208:210] = np.array([sigma / unit], np.float16).view(np.uint8)
        return blocks
    blocks[:, 0:2] = one
    blocks[:, 2:4] = one
    q, scale, offset = integer_form(blocks, ggml_type)  # w = sc*q - m with d = dmin = 1
    sq = (scale[:, :1] * q).reshape(-1)
    m = np.repeat(-offset, 32)
    ratio = float(sq.mean() / max(m.mean(), 1e-9))  # dmin/d that centres the weights
    d = sigma / float(np.std(sq - ratio * m))
    blocks[:, 0:2] = np.array([d], np.float16).view(np.uint8)
    blocks[:, 2:4] = np.array([d * ratio], np.float16).view(np.uint8)
    return blocks


def random_blocks(ggml_type: int, n_blocks: int, rng: np.random.Generator, sigma: float) -> np.ndarray:
    """(n_blocks, type_size) uint8: valid random data of a GGML type with weights of scale sigma."""
    block, size = GGML_QUANT_SIZES[T(ggml_type)]
    if ggml_type in (T.Q4_K, T.Q5_K, T.Q6_K):
        return _k_quant_blocks(ggml_type, n_blocks, rng, sigma)
    values = rng.standard_normal((n_blocks, block), dtype=np.float32) * np.float32(sigma)
    if ggml_type == T.F32:
        return values.view(np.uint8)
    return np.ascontiguousarray(quantize(values, T(ggml_type))).view(np.uint8).reshape(n_blocks, size)


# ---------------------------------------------------------------- GGUF writing (format v3)
_U32, _I32, _F32, _BOOL, _STR, _ARR, _U64 = 4, 5, 6, 7, 8, 9, 10


def _str(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _kv(key: str, value: object) -> bytes:
    if isinstance(value, bool):
        return _str(key) + struct.pack("<I?", _BOOL, value)
    if isinstance(value, int):
        return _str(key) + struct.pack("<II", _U32, value)
    if isinstance(value, float):
        return _str(key) + struct.pack("<If", _F32, value)
    if isinstance(value, str):
        return _str(key) + struct.pack("<I", _STR) + _str(value)
    if isinstance(value, np.ndarray):
        kind = {np.dtype(np.float32): _F32, np.dtype(np.int32): _I32}[value.dtype]
        return _str(key) + struct.pack("<IIQ", _ARR, kind, len(value)) + value.astype("<" + value.dtype.str[1:]).tobytes()
    if isinstance(value, list):
        return _str(key) + struct.pack("<IIQ", _ARR, _STR, len(value)) + b"".join(_str(s) for s in value)
    raise TypeError(f"no GGUF encoding for {type(value).__name__}")


def vocabulary(size: int) -> tuple[list[str], np.ndarray, np.ndarray]:
    """A byte-level SentencePiece vocabulary of exactly `size` pieces: tokens, scores, types."""
    if size < 259:
        raise ValueError(f"vocab size {size} is below the 259 control and byte tokens")
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += ["\u2581"] + [f"\u2581w{i}" for i in range(size - len(tokens) - 1)]  # "\u2581" is the space
    types = np.full(size, 1, np.int32)  # normal
    types[0], types[1:3], types[3:259] = 2, 3, 6  # unknown, control, byte
    scores = np.zeros(size, np.float32)
    scores[259:] = -np.arange(size - 259, dtype=np.float32)
    return tokens, scores, types


@dataclass
class _Tensor:
    name: str
    dims: tuple[int, ...]  # GGUF order: row length first
    ggml_type: int
    nbytes: int
    write: Callable[[object], None]


def _matrix_writer(ggml_type: int, rows: int, cols: int, rng: np.random.Generator,
                   pools: dict[tuple[int, float, str], np.ndarray],
                   expert_stack: str = "") -> tuple[int, Callable[[object], None]]:
    """expert_stack: the kind of an expert stack (its own data or pool: EXPERT_OWN_WEIGHTS)."""
    block, size = GGML_QUANT_SIZES[T(ggml_type)]
    n_blocks = rows * cols // block
    sigma = 1.0 / np.sqrt(cols)
    own = EXPERT_OWN_WEIGHTS // block if expert_stack else POOL_BLOCKS
    if n_blocks <= own:  # small tensors: all their own random data
        pool = random_blocks(ggml_type, n_blocks, rng, sigma).reshape(-1)
    else:  # large ones: a shared pool per type and scale (and expert stack), written over and over
        key = (int(ggml_type), round(float(sigma), 8), expert_stack)
        if key not in pools:
            pools[key] = random_blocks(ggml_type, POOL_BLOCKS + bool(expert_stack), rng, sigma).reshape(-1)
        pool = pools[key]
    pool_blocks = pool.size // size

    def write(f: object) -> None:
        if pool_blocks >= n_blocks:
            f.write(pool[: n_blocks * size].tobytes())  # type: ignore[attr-defined]
            return
        data = memoryview(pool)
        for _ in range(n_blocks // pool_blocks):
            f.write(data)  # type: ignore[attr-defined]
        f.write(data[: (n_blocks % pool_blocks) * size])  # type: ignore[attr-defined]

    return n_blocks * size, write


def _norm_writer(n: int, rng: np.random.Generator, mean: float, std: float = 0.1) -> tuple[int, Callable[[object], None]]:
    values = (mean + std * rng.standard_normal(n)).astype("<f4")
    return values.nbytes, lambda f: f.write(values.tobytes())  # type: ignore[attr-defined]


def _router_writer(n_experts: int, dim: int, rng: np.random.Generator,
                   skew: float) -> tuple[int, Callable[[object], None]]:
    """A float32 router (n_experts, dim) ~ N(0, 1/dim), expert e's row times skew^(-e / (n - 1))."""
    scales = float(skew) ** (-np.arange(n_experts) / max(n_experts - 1, 1))
    values = (rng.standard_normal((n_experts, dim)) / np.sqrt(dim) * scales[:, None]).astype("<f4")
    return values.nbytes, lambda f: f.write(values.tobytes())  # type: ignore[attr-defined]


def write_model(path: str | Path, shape: Shape, kind: str, seed: int = 0, name: str | None = None,
                arch: str | None = None, router_skew: float = 1.0) -> int:
    """Writes a random Llama-shaped GGUF; returns its size in bytes. arch (default the shape's):
    "qwen2" adds Q/K/V biases, "qwen3" per-head Q and K norms (readers apply NeoX-style rotary
    pairs to both), "gemma3" those norms and the post-attention and post-FFN norms (its readers add
    GeGLU, the embedding scale and, with a sliding window, five local layers of every six),
    "qwen3moe" the Q/K norms and experts, "qwen2moe" Qwen2's biases, experts and a shared expert. A shape with experts writes them in place of the dense
    feed-forward (qwen3moe, or llama: Mixtral's layout); router_skew: see the module docstring."""
    arch = arch or shape.arch
    if arch not in ARCHS:
        raise ValueError(f"unknown architecture '{arch}' (known: {', '.join(ARCHS)})")
    experts = ARCHITECTURES[arch].experts  # infer.arch's table: never, optional or always
    if (experts == "always" and not shape.n_experts) or (experts == "never" and shape.n_experts):
        raise ValueError(f"{arch} {'needs' if experts == 'always' else 'takes no'} experts (shapes with experts: "
                         f"{', '.join(n for n, sh in SHAPES.items() if sh.n_experts)})")
    if shape.n_experts and not 0 < shape.n_experts_used <= shape.n_experts:
        raise ValueError(f"{shape.n_experts_used} experts per token of {shape.n_experts}")
    if router_skew <= 0:
        raise ValueError(f"a router skew of {router_skew:g} is not positive")
    if kind not in FILE_TYPES:
        raise ValueError(f"unknown model type '{kind}' (known: {', '.join(FILE_TYPES)})")
    rng = np.random.default_rng(seed)
    s = shape
    head_dim = s.head_size
    tokens, scores, types = vocabulary(s.vocab_size)
    meta: dict[str, object] = {
        "general.architecture": arch,
        "general.name": name or f"synthetic-llama-{s.n_layers}x{s.dim}-{kind}",
        "general.file_type": FILE_TYPES[kind],
        f"{arch}.context_length": s.context_length,
        f"{arch}.embedding_length": s.dim,
        f"{arch}.block_count": s.n_layers,
        f"{arch}.feed_forward_length": s.ffn_dim,
        f"{arch}.attention.head_count": s.n_heads,
        f"{arch}.attention.head_count_kv": s.n_kv_heads,
        f"{arch}.rope.freq_base": float(s.rope_base),
        f"{arch}.rope.dimension_count": head_dim,
        f"{arch}.attention.layer_norm_rms_epsilon": float(s.norm_eps),
        f"{arch}.vocab_size": s.vocab_size,
        **({f"{arch}.attention.key_length": head_dim, f"{arch}.attention.value_length": head_dim}
           if s.head_dim or arch in ("qwen3", "gemma3", "qwen3moe", "gpt-oss") else {}),
        **({f"{arch}.attention.sliding_window": s.sliding_window} if s.sliding_window else {}),
        **({f"{arch}.expert_count": s.n_experts, f"{arch}.expert_used_count": s.n_experts_used}
           if s.n_experts else {}),
        **({f"{arch}.expert_feed_forward_length": s.expert_ffn_dim} if arch in ("qwen3moe", "qwen2moe", "gpt-oss")
           else {}),
        **({f"{arch}.rope.scaling.type": "yarn", f"{arch}.rope.scaling.factor": float(s.yarn_factor),
            f"{arch}.rope.scaling.original_context_length": s.yarn_original_context} if s.yarn_factor else {}),
        **({f"{arch}.expert_shared_feed_forward_length": s.shared_ffn_dim} if s.shared_ffn_dim else {}),
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": False,
    }
    pools: dict[tuple[int, float, str], np.ndarray] = {}
    tensors: list[_Tensor] = []

    def matrix(tname: str, base: str, layer: int, rows: int, cols: int, stacked: int = 0) -> None:
        """A (rows, cols) matrix, or `stacked` of them (the experts' (stacked, rows, cols))."""
        ggml_type = tensor_type(kind, base, layer, s.n_layers, cols, s.n_experts)
        if base == "token_embd" and kind == "q4_k_m":
            ggml_type = K_FALLBACK[T.Q4_K] if cols % 256 else T.Q4_K
        nbytes, write = _matrix_writer(ggml_type, rows * max(stacked, 1), cols, rng, pools, base if stacked else "")
        tensors.append(_Tensor(tname, (cols, rows, stacked) if stacked else (cols, rows), ggml_type, nbytes, write))

    def norm(tname: str, n: int = s.dim, mean: float = 1.0, std: float = 0.1, dims: tuple[int, ...] = ()) -> None:
        nbytes, write = _norm_writer(n, rng, mean, std)
        tensors.append(_Tensor(tname, dims or (n,), T.F32, nbytes, write))

    q_dim, kv_dim = s.n_heads * head_dim, s.n_kv_heads * head_dim
    matrix("token_embd.weight", "token_embd", 0, s.vocab_size, s.dim)
    for i in range(s.n_layers):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight")
        matrix(p + "attn_q.weight", "attn_q", i, q_dim, s.dim)
        matrix(p + "attn_k.weight", "attn_k", i, kv_dim, s.dim)
        matrix(p + "attn_v.weight", "attn_v", i, kv_dim, s.dim)
        if arch in ("qwen2", "qwen2moe", "gpt-oss"):
            norm(p + "attn_q.bias", q_dim, 0.0)
            norm(p + "attn_k.bias", kv_dim, 0.0)
            norm(p + "attn_v.bias", kv_dim, 0.0)
        if arch in ("qwen3", "gemma3", "qwen3moe"):
            norm(p + "attn_q_norm.weight", head_dim)
            norm(p + "attn_k_norm.weight", head_dim)
        matrix(p + "attn_output.weight", "attn_output", i, s.dim, q_dim)
        if arch == "gpt-oss":  # sinks spread like attention logits, so they take a real share
            norm(p + "attn_sinks.weight", s.n_heads, 0.0, 1.0)
            norm(p + "attn_output.bias", s.dim, 0.0)
        if arch in ("gemma3", "gpt-oss"):  # gpt-oss: the FFN's input norm, under this name
            norm(p + "post_attention_norm.weight")
        if arch != "gpt-oss":
            norm(p + "ffn_norm.weight")
        if s.n_experts:
            width = s.expert_ffn_dim if arch in ("qwen3moe", "qwen2moe", "gpt-oss") else s.ffn_dim
            nbytes, write = _router_writer(s.n_experts, s.dim, rng, router_skew)
            tensors.append(_Tensor(p + "ffn_gate_inp.weight", (s.dim, s.n_experts), T.F32, nbytes, write))
            fp4 = "_mxfp4" if arch == "gpt-oss" else ""
            if fp4:
                norm(p + "ffn_gate_inp.bias", s.n_experts, 0.0)
            for stack, rows, cols in (("gate", width, s.dim), ("up", width, s.dim), ("down", s.dim, width)):
                matrix(p + f"ffn_{stack}_exps.weight", f"ffn_{stack}_exps{fp4}", i, rows, cols, s.n_experts)
                if fp4:
                    norm(p + f"ffn_{stack}_exps.bias", rows * s.n_experts, 0.0, dims=(rows, s.n_experts))
            if ARCHITECTURES[arch].shared_expert:
                norm(p + "ffn_gate_inp_shexp.weight", s.dim, 0.0)  # around 0: gates near 1/2, some either way
                matrix(p + "ffn_gate_shexp.weight", "ffn_gate", i, s.shared_ffn_dim, s.dim)
                matrix(p + "ffn_up_shexp.weight", "ffn_up", i, s.shared_ffn_dim, s.dim)
                matrix(p + "ffn_down_shexp.weight", "ffn_down", i, s.dim, s.shared_ffn_dim)
        else:
            matrix(p + "ffn_gate.weight", "ffn_gate", i, s.ffn_dim, s.dim)
            matrix(p + "ffn_up.weight", "ffn_up", i, s.ffn_dim, s.dim)
            matrix(p + "ffn_down.weight", "ffn_down", i, s.dim, s.ffn_dim)
        if arch == "gemma3":
            norm(p + "post_ffw_norm.weight")
    norm("output_norm.weight")
    matrix("output.weight", "output", 0, s.vocab_size, s.dim)

    header = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(meta)))
    for key, value in meta.items():
        header += _kv(key, value)
    offset = 0
    for t in tensors:
        header += _str(t.name) + struct.pack("<I", len(t.dims)) + struct.pack(f"<{len(t.dims)}Q", *t.dims)
        header += struct.pack("<IQ", int(t.ggml_type), offset)
        offset += -(-t.nbytes // ALIGNMENT) * ALIGNMENT
    header += b"\0" * (-len(header) % ALIGNMENT)
    with open(path, "wb") as f:
        f.write(header)
        for t in tensors:
            t.write(f)
            f.write(b"\0" * (-t.nbytes % ALIGNMENT))
        return f.tell()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infer.synth", description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--type", dest="kind", choices=sorted(FILE_TYPES), default="q4_k_m")
    parser.add_argument("--layers", type=int, help="override the shape's layer count")
    parser.add_argument("--vocab", type=int, help="override the shape's vocab size")
    parser.add_argument("--arch", choices=ARCHS, help="default: the shape's (qwen2 for q05b, q15b)")
    parser.add_argument("--router-skew", type=float, default=1.0,
                        help="experts only: expert e's router row scaled by S^(-e/(n-1)) (1: uniform routing)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("-o", "--output", required=True, help="GGUF file to write")
    args = parser.parse_args(argv)
    shape = SHAPES[args.shape]
    if args.layers:
        shape = Shape(**{**shape.__dict__, "n_layers": args.layers})
    if args.vocab:
        shape = Shape(**{**shape.__dict__, "vocab_size": args.vocab})
    start = time.perf_counter()
    try:
        size = write_model(args.output, shape, args.kind, args.seed, arch=args.arch, router_skew=args.router_skew)
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}: {size / 1e9:.2f} GB in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
