"""Our arithmetic against llama.cpp's, one operation at a time, on a real model.

Each operation of every layer is fed llama.cpp's own input (captured by tests.oracle.trace) and our
output is compared with llama.cpp's output of the same operation, so a difference is that
operation's own and does not carry what earlier layers did. A second table runs our whole forward
pass and compares its hidden state with llama.cpp's after every layer (the propagated difference).

    python -m tests.oracle.compare_ops MODEL.gguf [--tokens 64] [--exact]

Relative error is ||ours - llama.cpp|| / ||llama.cpp|| over all positions; "max" is the largest
absolute difference.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import numpy as np
from gguf.constants import GGMLQuantizationType

from infer.gguf_file import GGUFModel
from infer.model import LayerWeights, Linear, Transformer, geglu, load_transformer
from tests.oracle.fixtures import botchan_text
from tests.oracle.reference import Reference
from tests.oracle.trace import trace


@dataclasses.dataclass
class Row:
    layer: int
    op: str
    rel: float
    max_abs: float
    identical: float = 0.0  # share of values equal bit for bit
    allowance: float = 0.0  # relative error llama.cpp's float16 q8_1 block sums alone can explain (below)


# What kind of arithmetic each compared operation is (tests/infer/test_oracle.py bounds each kind).
KINDS = {
    "embedding": "elementwise", "attn rms_norm": "elementwise", "ffn rms_norm": "elementwise",
    "output rms_norm": "elementwise", "qkv + bias": "elementwise", "q/k rms_norm": "elementwise", "rope q": "elementwise", "rope k": "elementwise",
    "swiglu": "swiglu", "geglu": "elementwise", "rope + attention": "attention",
    "embedding x sqrt(width)": "elementwise", "wo + post-norm": "matmul", "post-norm + residual": "elementwise",
    "ffn post-norm": "elementwise",
    "qkv matmul": "matmul", "wo + residual": "matmul", "gate matmul": "matmul", "up matmul": "matmul",
    "down matmul": "matmul", "output matmul": "matmul",
}
# The tensors compare() reads from a trace.
TRACED = ["embd", "inp_scaled", "attn_norm", "Qcur", "Kcur", "Vcur", "Qcur_normed", "Kcur_normed", "kqv_out",
          "attn_post_norm", "sa_out", "ffn_inp", "ffn_norm", "ffn_gate", "ffn_up", "ffn_swiglu", "ffn_geglu", "ffn_out",
          "ffn_post_norm", "l_out", "result_norm", "result_output"]
_LAYER_TRACED = [name for name in TRACED if name not in ("embd", "inp_scaled", "result_norm", "result_output")]


def _diff(layer: int, op: str, ours: np.ndarray, ref: np.ndarray) -> Row:
    ours, ref = np.asarray(ours, np.float64).reshape(ref.shape), ref.astype(np.float64)
    return Row(layer, op, float(np.linalg.norm(ours - ref) / max(np.linalg.norm(ref), 1e-30)),
               float(np.abs(ours - ref).max()), float(np.mean(ours == ref)))


# Q4_1 and Q5_1 weights meet q8_1 activations in llama.cpp, whose block sum s = f16(d * sum(q)) is
# stored as a float16 and multiplies each weight block's minimum m. Ours multiplies m by the exact
# sum f16(d) * sum(q) of the rounded activations (deliberately: docs/INFERENCE.md). The two differ
# by at most 2^-10 |d sum(q)| per block (two float16 roundings), so output r may differ by up to
# 2^-10 sum_b |m_rb| |d_b sum(q_b)| on top of float32 rounding.
BLOCK_MIN_TYPES = (GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_1)


def _block_mins(model: GGUFModel, names: list[str]) -> np.ndarray | None:
    """(rows, cols / 32) float16 minimums of the stacked tensors (zero for other types), or None."""
    infos = [model.tensor(name) for name in names]
    if not any(info.ggml_type in BLOCK_MIN_TYPES for info in infos):
        return None
    parts = []
    for info in infos:
        rows, cols = info.shape
        if info.ggml_type in BLOCK_MIN_TYPES:
            blocks = np.asarray(info.data).reshape(rows * cols // 32, -1)
            parts.append(blocks[:, 2:4].copy().view(np.float16).astype(np.float64).reshape(rows, cols // 32))
        else:
            parts.append(np.zeros((rows, cols // 32)))
    return np.concatenate(parts)


def _allowance(model: GGUFModel, names: list[str], x: np.ndarray, ref: np.ndarray) -> float:
    mins = _block_mins(model, names)
    if mins is None:
        return 0.0
    blocks = x.reshape(x.shape[0], -1, 32).astype(np.float32)
    amax = np.abs(blocks).max(axis=2)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.rint(blocks * np.where(amax > 0, np.float32(127) / amax, 0)[..., None].astype(np.float32))
    sums = np.abs(amax.astype(np.float64) / 127 * q.sum(axis=2))  # |d sum(q)| per (position, block)
    bound = 2.0**-10 * (sums @ np.abs(mins).T)
    return float(np.linalg.norm(bound) / max(np.linalg.norm(ref.astype(np.float64)), 1e-30))


def _identity(n: int, exact: bool) -> Linear:
    return Linear([(np.eye(n), "f32")], exact)


def _flat(t: np.ndarray, n: int) -> np.ndarray:
    return t.reshape(n, -1)


def compare(model: Transformer, tensors: dict[str, list[np.ndarray]], ids: list[int]) -> list[Row]:
    """Per-operation rows, each op fed llama.cpp's input of that op."""
    a, rows, n = model.args, [], len(ids)
    gguf = model.weights.model

    def matmul(layer: int, op: str, ours: np.ndarray, ref: np.ndarray, names: list[str], x: np.ndarray) -> Row:
        return dataclasses.replace(_diff(layer, op, ours, ref), allowance=_allowance(gguf, names, x, ref))

    x = tensors["embd"][-1].reshape(n, a.dim)
    rows.append(_diff(-1, "embedding", model.weights.embed(np.asarray(ids)), x))
    if "inp_scaled" in tensors:  # Gemma
        rows.append(_diff(-1, "embedding x sqrt(width)", model._embed(np.asarray(ids)), tensors["inp_scaled"][-1]))
        x = tensors["inp_scaled"][-1].reshape(n, a.dim)
    for i in range(a.n_layers):
        layer = model.weights.layer(i)
        cos, sin = model._rope_of(i).angles(np.arange(n))
        t = {name: tensors[f"{name}-{i}"] for name in _LAYER_TRACED if f"{name}-{i}" in tensors}
        rows.append(_diff(i, "attn rms_norm", model.norm(x, layer.attn_norm), t["attn_norm"][-1]))
        h = _flat(t["attn_norm"][-1], n)
        qkv = layer.attn_qkv(h)
        pre = [_flat(t[k][0], n) for k in ("Qcur", "Kcur", "Vcur")]  # the matrix products, before bias
        p = f"blk.{i}."
        rows.append(matmul(i, "qkv matmul", qkv, np.concatenate(pre, axis=1), [p + f"attn_{x}.weight" for x in "qkv"], h))
        if layer.bqkv is not None:
            biased = [_flat(t[k][1], n) for k in ("Qcur", "Kcur", "Vcur")]
            rows.append(_diff(i, "qkv + bias", np.concatenate(pre, axis=1) + layer.bqkv,
                              np.concatenate(biased, axis=1)))
        qkv_in = np.concatenate([_flat(t[k][-2 if k != "Vcur" else -1], n) for k in ("Qcur", "Kcur", "Vcur")], axis=1)
        if layer.q_norm is not None:  # Qwen3: rope takes the normalised heads
            shaped = (n, -1, a.head_dim)
            q_pre, k_pre = (_flat(t[k][1 if layer.bqkv is None else 2], n) for k in ("Qcur", "Kcur"))
            normed = np.concatenate([model.norm(q_pre.reshape(shaped), layer.q_norm).reshape(n, -1),
                                     model.norm(k_pre.reshape(shaped), layer.k_norm).reshape(n, -1)], axis=1)
            want = np.concatenate([_flat(t[k][-1], n) for k in ("Qcur_normed", "Kcur_normed")], axis=1)
            rows.append(_diff(i, "q/k rms_norm", normed, want))
            qkv_in = np.concatenate([want, qkv_in[:, a.q_dim + a.kv_dim :]], axis=1)
        rope = model._rope_of(i)
        rows.append(_diff(i, "rope q", rope.apply(qkv_in[:, : a.q_dim].reshape(n, a.n_heads, a.head_dim), cos, sin),
                          t["Qcur"][-1]))
        k_in = qkv_in[:, a.q_dim : a.q_dim + a.kv_dim].reshape(n, a.n_kv_heads, a.head_dim)
        rows.append(_diff(i, "rope k", rope.apply(k_in, cos, sin), t["Kcur"][-1]))
        bare = LayerWeights(layer.attn_norm, _identity(qkv_in.shape[1], model.exact), None,
                            _identity(a.q_dim, model.exact), layer.ffn_norm, layer.ffn_gate_up, layer.ffn_down)
        attn = model._attention(qkv_in, bare, model.new_cache(n), i, 0, cos, sin)
        rows.append(_diff(i, "rope + attention", attn, t["kqv_out"][-1]))
        kqv = _flat(t["kqv_out"][-1], n)
        if layer.post_attn_norm is not None:  # Gemma: the attention output normed, then added
            rows.append(matmul(i, "wo + post-norm", model.norm(layer.attn_output(kqv), layer.post_attn_norm),
                               t["attn_post_norm"][-1], [p + "attn_output.weight"], kqv))
            rows.append(_diff(i, "post-norm + residual", _flat(t["attn_post_norm"][-1], n) + x, t["sa_out"][-1]))
            f = _flat(t["sa_out"][-1], n)
        else:
            rows.append(matmul(i, "wo + residual", x + layer.attn_output(kqv), t["ffn_inp"][-1], [p + "attn_output.weight"], kqv))
            f = _flat(t["ffn_inp"][-1], n)
        rows.append(_diff(i, "ffn rms_norm", model.norm(f, layer.ffn_norm), t["ffn_norm"][-1]))
        h = _flat(t["ffn_norm"][-1], n)
        g = layer.ffn_gate_up(h)
        rows.append(matmul(i, "gate matmul", g[:, : a.ffn_dim], t["ffn_gate"][-1], [p + "ffn_gate.weight"], h))
        rows.append(matmul(i, "up matmul", g[:, a.ffn_dim :], t["ffn_up"][-1], [p + "ffn_up.weight"], h))
        gate, up = _flat(t["ffn_gate"][-1], n), _flat(t["ffn_up"][-1], n)
        if "ffn_swiglu" in t:
            rows.append(_diff(i, "swiglu", gate / (1.0 + np.exp(-gate)) * up, t["ffn_swiglu"][-1]))
            sw = _flat(t["ffn_swiglu"][-1], n)
            rows.append(matmul(i, "down matmul", layer.ffn_down(sw), t["ffn_out"][-1], [p + "ffn_down.weight"], sw))
        if "ffn_geglu" in t:
            rows.append(_diff(i, "geglu", geglu(gate.astype(np.float32), up.astype(np.float32)), t["ffn_geglu"][-1]))
            gg = _flat(t["ffn_geglu"][-1], n)
            rows.append(matmul(i, "down matmul", layer.ffn_down(gg), t["ffn_out"][-1], [p + "ffn_down.weight"], gg))
        if layer.post_ffn_norm is not None:
            rows.append(_diff(i, "ffn post-norm", model.norm(_flat(t["ffn_out"][-1], n), layer.post_ffn_norm),
                              t["ffn_post_norm"][-1]))
            rows.append(_diff(i, "post-norm + residual", _flat(t["ffn_post_norm"][-1], n) + f, t["l_out"][-1]))
        x = _flat(t["l_out"][-1], n)
    rows.append(_diff(a.n_layers, "output rms_norm", model.norm(x, model.weights.output_norm()),
                      tensors["result_norm"][-1]))
    h = _flat(tensors["result_norm"][-1], n)
    head = "output.weight" if "output.weight" in gguf.tensors else "token_embd.weight"
    rows.append(matmul(a.n_layers, "output matmul", model.weights.output()(h), tensors["result_output"][-1], [head], h))
    return rows


def propagated(model: Transformer, tensors: dict[str, list[np.ndarray]], ids: list[int]) -> list[Row]:
    """Our whole forward pass against llama.cpp's hidden state after each layer."""
    n, rows = len(ids), []
    states: list[np.ndarray] = []
    model.forward_batch([(np.asarray(ids), model.new_cache(n))], hidden=states)
    for i, x in enumerate(states[1:]):
        rows.append(_diff(i, "l_out", x, tensors[f"l_out-{i}"][-1]))
    logits = model.weights.output()(model.norm(x, model.weights.output_norm()))
    rows.append(_diff(model.args.n_layers, "logits", logits, tensors["logits"][-1]))
    agree = float(np.mean(logits.argmax(1) == tensors["logits"][-1].argmax(1)))
    rows.append(Row(model.args.n_layers, f"top-1 agreement {agree:.4f}", 0.0, 0.0))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--exact", action="store_true", help="our exact (float64) numerics")
    args = parser.parse_args()
    ref = Reference(args.model, n_ctx=512)
    ids = ref.tokenize(botchan_text()[5000:9000])[: args.tokens]
    ref.close()
    tensors = trace(args.model, ids, names=TRACED)
    model = load_transformer(GGUFModel(args.model), exact=args.exact)
    print(f"{args.model.name}: {len(ids)} tokens, {'exact' if args.exact else 'float32'} numerics")
    print(f"{'layer':>5}  {'operation':<20} {'rel. error':>11} {'max |diff|':>11} {'identical':>9} {'q8_1 allowance':>14}")
    for row in compare(model, tensors, ids) + propagated(model, tensors, ids):
        print(f"{row.layer:>5}  {row.op:<20} {row.rel:>11.3e} {row.max_abs:>11.3e} {row.identical:>9.4f} "
              f"{row.allowance:>14.3e}")


if __name__ == "__main__":
    main()
