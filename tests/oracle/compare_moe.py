"""Our mixture-of-experts arithmetic against llama.cpp's, one operation at a time (as
tests.oracle.compare_ops does for the dense operations): each step of every block's expert
feed-forward (infer.moe) is fed llama.cpp's own input of that step, captured by tests.oracle.trace.
A second table runs our whole forward pass and counts the tokens routed to other experts than
llama.cpp routed them to, with llama.cpp's margin at each (how far its k-th expert's probability
was above the next one's).

    python -m tests.oracle.compare_moe MODEL.gguf [--tokens 64]
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from pathlib import Path

import numpy as np

from infer.gguf_file import GGUFModel
from infer.model import Transformer, load_transformer
from infer.moe import MixtureOfExperts, expert_weights, router_softmax, top_k, weighted_sum
from tests.oracle.compare_ops import Row, _diff
from tests.oracle.trace import trace

TRACED = ["ffn_norm", "ffn_moe_logits", "ffn_moe_probs", "ffn_moe_weights", "ffn_moe_weights_norm", "ffn_moe_gate",
          "ffn_moe_up", "ffn_moe_swiglu", "ffn_moe_down", "ffn_moe_out",
          # qwen2moe's shared expert (llama.cpp's qwen2moe graph)
          "ffn_shexp_gate_inp", "ffn_shexp_gate", "ffn_shexp", "ffn_shexp_out", "ffn_out"]
# What arithmetic each step is (test_oracle.py's OP_BOUND bounds each kind): the softmax's exp is
# float32 rounding like SiLU's; the choice, the weights and their weighted sum follow llama.cpp's
# float32 steps bit for bit
KINDS = {"router matmul": "matmul", "router softmax": "swiglu", "expert choice": "elementwise",
         "weights normalised": "elementwise", "expert gate matmul": "matmul", "expert up matmul": "matmul",
         "expert swiglu": "swiglu", "expert down matmul": "matmul", "weighted sum": "elementwise"}
# qwen2moe's shared expert: its gate's dot (a one-row float32 product), the gate silu(g) / g (g / (1 +
# expf(-g)) in float32, expf correctly rounded), its gated feed-forward (products and SwiGLU: the
# products' bound), the gate times it and the sum with the routed experts' (float32, bit for bit)
SHARED_KINDS = {"shared gate matmul": "matmul", "shared gate": "elementwise", "shared expert": "matmul",
                "shared expert gated": "elementwise", "routed plus shared": "elementwise"}


def compare(model: Transformer, tensors: dict[str, list[np.ndarray]], n: int) -> list[Row]:
    """Per-step rows of every block's expert feed-forward, each step fed llama.cpp's input (the
    experts' products with llama.cpp's choice of experts, which the "expert choice" row shows is ours)."""
    rows: list[Row] = []
    for i in range(model.args.n_layers):
        moe = model.weights.layer(i).experts
        assert moe is not None, f"block {i} has no experts"
        t = {name: tensors[f"{name}-{i}"][-1] for name in TRACED if f"{name}-{i}" in tensors}
        h = t["ffn_norm"].reshape(n, -1)
        rows.append(_diff(i, "router matmul", moe.router(h), t["ffn_moe_logits"]))
        rows.append(_diff(i, "router softmax", router_softmax(t["ffn_moe_logits"].reshape(n, -1)), t["ffn_moe_probs"]))
        probs = t["ffn_moe_probs"].reshape(n, -1)
        chosen = top_k(probs, moe.n_used)  # llama.cpp's probabilities of our choice: its own if we chose alike
        rows.append(_diff(i, "expert choice", np.take_along_axis(probs, chosen, -1), t["ffn_moe_weights"]))
        if moe.normalize:
            weights = t["ffn_moe_weights_norm"].reshape(n, -1)
            rows.append(_diff(i, "weights normalised", expert_weights(probs, chosen, moe.normalize), weights))
        else:  # qwen2moe: the chosen probabilities as they are (the "expert choice" row)
            weights = t["ffn_moe_weights"].reshape(n, -1)
        gate_up = _per_expert(chosen, np.repeat(h[:, None], moe.n_used, 1), lambda e, x, m=moe: m.gate_up[e](x))
        width = gate_up.shape[-1] // 2
        rows.append(_diff(i, "expert gate matmul", gate_up[..., :width], t["ffn_moe_gate"]))
        rows.append(_diff(i, "expert up matmul", gate_up[..., width:], t["ffn_moe_up"]))
        rows.append(_diff(i, "expert swiglu", model._glu(t["ffn_moe_gate"], t["ffn_moe_up"]), t["ffn_moe_swiglu"]))
        rows.append(_diff(i, "expert down matmul", _per_expert(chosen, t["ffn_moe_swiglu"], lambda e, x, m=moe: m.down[e](x)),
                          t["ffn_moe_down"]))
        rows.append(_diff(i, "weighted sum", weighted_sum(t["ffn_moe_down"], weights), t["ffn_moe_out"]))
        if moe.shared is not None:
            rows += _shared_rows(model, moe, t, h, i, n)
    return rows


def _shared_rows(model: Transformer, moe: MixtureOfExperts, t: dict[str, np.ndarray], h: np.ndarray, i: int,
                 n: int) -> list[Row]:
    shared = moe.shared
    assert shared is not None
    g = t["ffn_shexp_gate_inp"].reshape(n)
    rows = [_diff(i, "shared gate matmul", shared.gate(h)[:, 0], g)]
    rows.append(_diff(i, "shared gate", shared.scale(g), t["ffn_shexp_gate"].reshape(n)))
    gate_up = shared.gate_up(h)
    width = gate_up.shape[1] // 2
    rows.append(_diff(i, "shared expert", shared.down(model._glu(gate_up[:, :width], gate_up[:, width:])),
                      t["ffn_shexp"].reshape(n, -1)))
    rows.append(_diff(i, "shared expert gated", t["ffn_shexp"].reshape(n, -1) * t["ffn_shexp_gate"].reshape(n, 1),
                      t["ffn_shexp_out"].reshape(n, -1)))
    rows.append(_diff(i, "routed plus shared", t["ffn_moe_out"].reshape(n, -1) + t["ffn_shexp_out"].reshape(n, -1),
                      t["ffn_out"].reshape(n, -1)))
    return rows


def _per_expert(chosen: np.ndarray, inputs: np.ndarray, product: Callable[[int, np.ndarray], np.ndarray]) -> np.ndarray:
    """(T, k, out): product(expert, rows) of each (token, slot)'s input (T, k, in), grouped by expert
    as llama.cpp's mul_mat_id groups them."""
    outs: np.ndarray | None = None
    for expert in np.unique(chosen):
        tokens, slots = np.nonzero(chosen == expert)
        y = product(int(expert), np.ascontiguousarray(inputs[tokens, slots], np.float32))
        if outs is None:
            outs = np.empty((*chosen.shape, y.shape[1]), np.float32)
        outs[tokens, slots] = y
    assert outs is not None
    return outs


@dataclasses.dataclass
class Reroute:
    layer: int
    token: int
    ours: tuple[int, ...]
    theirs: tuple[int, ...]
    margin: float  # llama.cpp's k-th probability minus its (k+1)-th, relative to the k-th


class _Recording:
    """A block's experts that remember each pass's choice (T, k)."""

    def __init__(self, moe: MixtureOfExperts) -> None:
        self.moe, self.chosen = moe, np.empty((0, moe.n_used), np.int64)

    def __call__(self, h: np.ndarray, glu: object, exact: bool = False) -> np.ndarray:
        self.chosen = self.moe.route(h, exact)[0]
        return self.moe(h, glu, exact)  # type: ignore[arg-type]


def reroutes(model: Transformer, tensors: dict[str, list[np.ndarray]], ids: list[int]) -> list[Reroute]:
    """Our whole forward pass over `ids` (one batch): the (layer, token)s whose chosen experts (as a
    set) differ from llama.cpp's in its own pass."""
    n, found = len(ids), []
    recorders = []
    for i in range(model.args.n_layers):
        layer = model.weights.layer(i)  # the cached layer: the forward below uses the recorder
        recorders.append(_Recording(layer.experts))  # type: ignore[arg-type]
        layer.experts = recorders[-1]  # type: ignore[assignment]
    try:
        model.forward(np.asarray(ids), model.new_cache(n), all_logits=True)
    finally:
        for i, recorder in enumerate(recorders):
            model.weights.layer(i).experts = recorder.moe
    for i, recorder in enumerate(recorders):
        probs = tensors[f"ffn_moe_probs-{i}"][-1].reshape(n, -1)
        k = recorder.moe.n_used
        order = top_k(probs, k + 1) if k < probs.shape[1] else top_k(probs, k)
        for t in range(n):
            ours, theirs = tuple(sorted(recorder.chosen[t])), tuple(sorted(order[t, :k]))
            if ours != theirs:
                kth, nxt = probs[t, order[t, k - 1]], probs[t, order[t, k]]
                found.append(Reroute(i, t, ours, theirs, float((kth - nxt) / kth)))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.oracle.compare_moe", description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args(argv)
    model = load_transformer(GGUFModel(args.model))
    ids = [int(t) for t in np.random.default_rng(1).integers(3, model.args.vocab_size, args.tokens)]
    tensors = trace(args.model, ids, n_ctx=max(64, args.tokens), names=TRACED)
    print(f"{'layer':>5}  {'operation':<34} {'rel error':>10} {'max abs':>10} {'identical':>9}")
    for row in compare(model, tensors, len(ids)):
        print(f"{row.layer:>5}  {row.op:<34} {row.rel:>10.2e} {row.max_abs:>10.2e} {row.identical:>9.3f}")
    moved = reroutes(model, tensors, ids)
    print(f"\nwhole pass: {len(moved)} of {model.args.n_layers * len(ids)} token routings differ from llama.cpp's")
    for r in moved:
        print(f"  layer {r.layer} token {r.token}: ours {r.ours}, llama.cpp {r.theirs}, its margin {r.margin:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
