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

from infer.gguf_file import GGUFModel
from infer.model import LayerWeights, Linear, Transformer, load_transformer
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


def _diff(layer: int, op: str, ours: np.ndarray, ref: np.ndarray) -> Row:
    ours, ref = np.asarray(ours, np.float64).reshape(ref.shape), ref.astype(np.float64)
    return Row(layer, op, float(np.linalg.norm(ours - ref) / max(np.linalg.norm(ref), 1e-30)),
               float(np.abs(ours - ref).max()), float(np.mean(ours == ref)))


def _identity(n: int, exact: bool) -> Linear:
    return Linear([(np.eye(n), "f32")], exact)


def _flat(t: np.ndarray, n: int) -> np.ndarray:
    return t.reshape(n, -1)


def compare(model: Transformer, tensors: dict[str, list[np.ndarray]], ids: list[int]) -> list[Row]:
    """Per-operation rows, each op fed llama.cpp's input of that op."""
    a, rows, n = model.args, [], len(ids)
    cos, sin = model.rope.angles(np.arange(n))
    x = tensors["embd"][-1].reshape(n, a.dim)
    rows.append(_diff(-1, "embedding", model.weights.embed(np.asarray(ids)), x))
    for i in range(a.n_layers):
        layer = model.weights.layer(i)
        t = {name: tensors[f"{name}-{i}"] for name in ("attn_norm", "Qcur", "Kcur", "Vcur", "kqv_out", "ffn_inp",
                                                      "ffn_norm", "ffn_gate", "ffn_up", "ffn_swiglu", "ffn_out",
                                                      "l_out") if f"{name}-{i}" in tensors}
        rows.append(_diff(i, "attn rms_norm", model.norm(x, layer.attn_norm), t["attn_norm"][-1]))
        h = _flat(t["attn_norm"][-1], n)
        qkv = layer.qkv(h)
        pre = [_flat(t[k][0], n) for k in ("Qcur", "Kcur", "Vcur")]  # the matrix products, before bias
        rows.append(_diff(i, "qkv matmul", qkv, np.concatenate(pre, axis=1)))
        if layer.bqkv is not None:
            biased = [_flat(t[k][1], n) for k in ("Qcur", "Kcur", "Vcur")]
            rows.append(_diff(i, "qkv + bias", np.concatenate(pre, axis=1) + layer.bqkv,
                              np.concatenate(biased, axis=1)))
        qkv_in = np.concatenate([_flat(t[k][-2 if k != "Vcur" else -1], n) for k in ("Qcur", "Kcur", "Vcur")], axis=1)
        rows.append(_diff(i, "rope q", model.rope.apply(qkv_in[:, : a.q_dim].reshape(n, a.n_heads, a.head_dim),
                                                         cos, sin), t["Qcur"][-1]))
        bare = LayerWeights(layer.attn_norm, _identity(qkv_in.shape[1], model.exact), None,
                            _identity(a.q_dim, model.exact), layer.ffn_norm, layer.gate_up, layer.down)
        attn = model._attention(qkv_in, bare, model.new_cache(n), i, 0, cos, sin)
        rows.append(_diff(i, "rope + attention", attn, t["kqv_out"][-1]))
        kqv = _flat(t["kqv_out"][-1], n)
        rows.append(_diff(i, "wo + residual", x + layer.wo(kqv), t["ffn_inp"][-1]))
        f = _flat(t["ffn_inp"][-1], n)
        rows.append(_diff(i, "ffn rms_norm", model.norm(f, layer.ffn_norm), t["ffn_norm"][-1]))
        g = layer.gate_up(_flat(t["ffn_norm"][-1], n))
        rows.append(_diff(i, "gate matmul", g[:, : a.ffn_dim], t["ffn_gate"][-1]))
        rows.append(_diff(i, "up matmul", g[:, a.ffn_dim :], t["ffn_up"][-1]))
        gate, up = _flat(t["ffn_gate"][-1], n), _flat(t["ffn_up"][-1], n)
        if "ffn_swiglu" in t:
            rows.append(_diff(i, "swiglu", gate / (1.0 + np.exp(-gate)) * up, t["ffn_swiglu"][-1]))
            rows.append(_diff(i, "down matmul", layer.down(_flat(t["ffn_swiglu"][-1], n)), t["ffn_out"][-1]))
        x = _flat(t["l_out"][-1], n)
    rows.append(_diff(a.n_layers, "output rms_norm", model.norm(x, model.weights.output_norm()),
                      tensors["result_norm"][-1]))
    rows.append(_diff(a.n_layers, "output matmul", model.weights.output()(_flat(tensors["result_norm"][-1], n)),
                      tensors["result_output"][-1]))
    return rows


def propagated(model: Transformer, tensors: dict[str, list[np.ndarray]], ids: list[int]) -> list[Row]:
    """Our whole forward pass against llama.cpp's hidden state after each layer."""
    n, rows = len(ids), []
    cache = model.new_cache(n)
    cos, sin = model.rope.angles(np.arange(n))
    x = model.weights.embed(np.asarray(ids))
    for i in range(model.args.n_layers):
        layer = model.weights.layer(i)
        x = x + model._attention(model.norm(x, layer.attn_norm), layer, cache, i, 0, cos, sin)
        x = x + model._feed_forward(model.norm(x, layer.ffn_norm), layer)
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
    tensors = trace(args.model, ids)
    model = load_transformer(GGUFModel(args.model), exact=args.exact)
    print(f"{args.model.name}: {len(ids)} tokens, {'exact' if args.exact else 'float32'} numerics")
    print(f"{'layer':>5}  {'operation':<20} {'rel. error':>11} {'max |diff|':>11} {'identical':>9}")
    for row in compare(model, tensors, ids) + propagated(model, tensors, ids):
        print(f"{row.layer:>5}  {row.op:<20} {row.rel:>11.3e} {row.max_abs:>11.3e} {row.identical:>9.4f}")


if __name__ == "__main__":
    main()
