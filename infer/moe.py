"""A mixture-of-experts feed-forward on the CPU, as llama.cpp's `llm_build_moe_ffn` computes it for
qwen3moe and Mixtral-style llama files (softmax gating, normalised top-k weights, no weight scale):

    probs   = softmax(router @ h)                    (n_experts,) per token
    chosen  = the n_used most probable experts, most probable first
    weights = probs[chosen] / sum(probs[chosen])
    out     = sum_j weights[j] * down_j(silu(gate_j @ h) * (up_j @ h))     over j in chosen, in that order

qwen2moe leaves the top-k weights as they are (no division by their sum) and adds a shared expert,
which every token takes, scaled by a gate of its own (llama.cpp's qwen2moe graph, its sigmoid
computed as silu(g) / g):

    g       = h . gate_inp_shexp                     a float32 dot, one value per token
    out    += (silu(g) / g) * down_s(silu(gate_s @ h) * (up_s @ h))

Each expert's matrices are products like the dense ones (infer.model.Linear: the input rounded to
the activation format llama.cpp gives the weight type), run once per expert for every token routed
to it. Default numerics follow llama.cpp's CPU step by step in float32 (the softmax's sum in double,
the weights' sum in double rounded to float32, each expert's output times its weight, then added
in the top-k order); `exact` takes the softmax, the weights and the weighted sum in float64 and
rounds once, so a row's result does not depend on the batch it is in (infer.model's docstring).

gpt-oss (llama.cpp's openai-moe graph) routes otherwise ("softmax_weight" gating): the router's
logits plus a bias, the k largest of them, and their weights a softmax over those k logits alone (not
renormalised); each expert's gate, up and down outputs get biases of their own before the clamped
SwiGLU (infer.model.swiglu_oai) and after the down product.

`expert_shape` reads the expert keys as llama.cpp does for these architectures (`expert_count`,
`expert_used_count`, qwen3moe's `expert_feed_forward_length`, each a number or one per layer) for
infer.arch.ModelArgs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from infer.errors import UnsupportedModelError

if TYPE_CHECKING:  # infer.model and infer.arch import this module
    from infer.arch import Architecture
    from infer.gguf_file import GGUFModel
    from infer.model import Linear

Glu = Callable[[np.ndarray, np.ndarray], np.ndarray]  # (gate, up) -> the gated activation, float32
Stack = tuple[np.ndarray, str]  # an expert stack (n_experts, rows, cols) and its activation format
# llama.cpp clamps the top-k weights' sum to float16's smallest normal before dividing; with softmax
# gating the sum is at least 1 / n_experts, so it never binds (kept so the two read alike)
WEIGHTS_SUM_FLOOR = 6.103515625e-5


def router_softmax(logits: np.ndarray, exact: bool = False) -> np.ndarray:
    """ggml_soft_max of router logits (T, n_experts): exp(l - max) in float32, their sum in double,
    each exp times the float32 reciprocal of the sum. exact: float64 throughout."""
    if exact:
        wide = logits.astype(np.float64)
        exps = np.exp(wide - wide.max(axis=-1, keepdims=True))
        return exps / exps.sum(axis=-1, keepdims=True)
    exps = np.exp(logits - logits.max(axis=-1, keepdims=True))
    inverse = (1.0 / exps.sum(axis=-1, keepdims=True, dtype=np.float64)).astype(np.float32)
    return exps * inverse


def top_k(probs: np.ndarray, k: int) -> np.ndarray:
    """(T, k) expert ids, most probable first. Exact ties go to the lower id (a stable sort); ggml's
    argsort (std::sort) leaves their order unspecified, and for up to 16 experts its insertion sort
    keeps the lower id first too."""
    return np.argsort(-probs, axis=-1, kind="stable")[:, :k]


def expert_weights(probs: np.ndarray, chosen: np.ndarray, normalize: bool = True, exact: bool = False) -> np.ndarray:
    """The chosen experts' probabilities, divided by their sum when `normalize` (llama.cpp's norm_w:
    the sum taken in double and rounded to float32, clamped, then a float32 division)."""
    weights = np.take_along_axis(probs, chosen, axis=-1)
    if not normalize:
        return weights
    total = weights.sum(axis=-1, keepdims=True, dtype=np.float64)
    if not exact:
        total = total.astype(np.float32)
    return weights / np.maximum(total, total.dtype.type(WEIGHTS_SUM_FLOOR))


def weighted_sum(outs: np.ndarray, weights: np.ndarray, exact: bool = False) -> np.ndarray:
    """sum_j weights[:, j] * outs[:, j] over (T, k, dim) expert outputs: each product in float32,
    then added one after another in the top-k order (ggml_mul, then ggml_add per expert). exact: the
    same sum in float64, rounded once."""
    wide = np.float64 if exact else np.float32
    total = outs[:, 0].astype(wide) * weights[:, :1]
    for j in range(1, outs.shape[1]):
        total = total + outs[:, j].astype(wide) * weights[:, j : j + 1]
    return total.astype(np.float32, copy=False)


@dataclass
class SharedExpert:
    """A feed-forward every token takes beside its routed experts, scaled by a sigmoid gate (qwen2moe)."""

    gate: Linear  # (1, dim): ffn_gate_inp_shexp, a float32 vector as a one-row product
    gate_up: Linear  # (2 * width, dim): ffn_gate_shexp, then ffn_up_shexp
    down: Linear  # (dim, width): ffn_down_shexp

    @property
    def nbytes(self) -> int:
        return self.gate.nbytes + self.gate_up.nbytes + self.down.nbytes

    def __call__(self, h: np.ndarray, glu: Glu, exact: bool = False) -> np.ndarray:
        """(T, dim) float32: the gated feed-forward of h (T, dim) times each token's gate, which is
        ggml's silu(g) / g on a row of one value: g / (1 + expf(-g)) (expf correctly rounded here),
        then the float32 division by g."""
        gate = self.scale(self.gate(h)[:, 0].astype(np.float32))
        gate_up = self.gate_up(h)
        width = gate_up.shape[1] // 2
        return self.down(glu(gate_up[:, :width], gate_up[:, width:])) * gate[:, None]

    @staticmethod
    def scale(g: np.ndarray) -> np.ndarray:
        """silu(g) / g, float32: each token's factor from its gate value g."""
        return (g / (np.float32(1.0) + np.exp(-g.astype(np.float64)).astype(np.float32))) / g


@dataclass
class MixtureOfExperts:
    """A block's feed-forward of experts: the router and each expert's products, float32 (or exact
    float64) like infer.model's dense ones."""

    router: Linear  # (n_experts, dim): ffn_gate_inp
    gate_up: list[Linear]  # per expert (2 * width, dim): its slices of ffn_gate_exps, then ffn_up_exps
    down: list[Linear]  # per expert (dim, width): its slice of ffn_down_exps
    n_used: int  # experts per token
    normalize: bool = True  # the top-k weights divided by their sum
    shared: SharedExpert | None = None  # qwen2moe's, added to the routed experts' sum
    # gpt-oss: "softmax_weight" gating (infer.arch.Architecture.gating) and float32 biases added to
    # the router's logits (n_experts,), each expert's gate and up outputs (n_experts, 2 * width) and
    # its down output (n_experts, dim), as llama.cpp's ggml_add / ggml_add_id do
    gating: str = "softmax"
    router_bias: np.ndarray | None = None
    gate_up_bias: np.ndarray | None = None
    down_bias: np.ndarray | None = None
    # one token's experts in one native call, the same bits as gate_up, the native SwiGLU and down
    # (infer.cpu_kernels.RoutedExperts; the packed engine's, whose glu is that SwiGLU)
    row_experts: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None
    # the same call summing the experts' outputs by their weights too (RoutedExperts.weighted_sum: a
    # decode row's routed experts in one native call, no Python between its products and its sum)
    row_sum: Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray] | None = None

    @classmethod
    def from_stacks(cls, router: Linear, gate: Stack, up: Stack, down: Stack,
                    linear: Callable[[list[Stack]], Linear], n_used: int, normalize: bool = True,
                    shared: SharedExpert | None = None, **biases: object) -> MixtureOfExperts:
        """From the dequantized stacks; `linear(parts)` makes one product of (matrix, format) parts;
        `biases`: gating and the bias fields (gpt-oss)."""
        (gates, gate_fmt), (ups, up_fmt), (downs, down_fmt) = gate, up, down
        return cls(router, [linear([(g, gate_fmt), (u, up_fmt)]) for g, u in zip(gates, ups, strict=True)],
                   [linear([(d, down_fmt)]) for d in downs], n_used, normalize, shared, **biases)  # type: ignore[arg-type]

    @property
    def n_experts(self) -> int:
        return len(self.down)

    @property
    def nbytes(self) -> int:
        shared = self.shared.nbytes if self.shared is not None else 0
        biases = sum(b.nbytes for b in (self.router_bias, self.gate_up_bias, self.down_bias) if b is not None)
        return self.router.nbytes + shared + biases + sum(product.nbytes for product in (*self.gate_up, *self.down))

    def route(self, h: np.ndarray, exact: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """(T, k) chosen expert ids, most probable first, and their weights, for the normed input h (T, dim)."""
        logits = self.router(h)
        if self.router_bias is not None:
            logits = logits + self.router_bias
        if self.gating == "softmax_weight":  # the top k logits, weighted by their own softmax (gpt-oss)
            chosen = top_k(logits, self.n_used)
            return chosen, router_softmax(np.take_along_axis(logits, chosen, axis=-1), exact)
        probs = router_softmax(logits, exact)
        chosen = top_k(probs, self.n_used)
        return chosen, expert_weights(probs, chosen, self.normalize, exact)

    def __call__(self, h: np.ndarray, glu: Glu, exact: bool = False) -> np.ndarray:
        """(T, dim) float32: the feed-forward of h (T, dim): the routed experts' sum, then the shared
        expert's output added (ggml_add, float32)."""
        out = self.routed(h, glu, exact)
        return out if self.shared is None else out + self.shared(h, glu, exact)

    def routed(self, h: np.ndarray, glu: Glu, exact: bool = False) -> np.ndarray:
        """(T, dim) float32: the routed experts' gated products of h (T, dim), weighted and summed."""
        chosen, weights = self.route(h, exact)
        if len(h) == 1 and not exact and self.row_sum is not None:
            return self.row_sum(h[0], chosen[0], weights[0])[None]
        outs = np.empty((*chosen.shape, h.shape[1]), np.float32)  # (T, k, dim) in the top-k order
        self.run_experts(outs, h, chosen, np.unique(chosen), glu)
        return weighted_sum(outs, weights, exact)

    def run_experts(self, outs: np.ndarray, h: np.ndarray, chosen: np.ndarray, experts: np.ndarray, glu: Glu) -> None:
        """outs[t, j] for every (token t, top-k slot j) routed to one of `experts`: each expert once,
        for all its tokens (the order of the experts changes no result)."""
        if len(h) == 1:  # a decode step: no grouping to do (the same products on the same row)
            wanted = set(experts.tolist())
            if self.row_experts is not None:
                slots = [s for s, e in enumerate(chosen[0].tolist()) if e in wanted]
                outs[0, slots] = self.row_experts(h[0], chosen[0, slots])
                return
            for slot, expert in enumerate(chosen[0].tolist()):
                if expert in wanted:
                    outs[0, slot] = self._expert(expert, h, glu)[0]
            return
        for expert in experts:
            rows, slots = np.nonzero(chosen == expert)
            outs[rows, slots] = self._expert(expert, h[rows], glu)

    def _expert(self, expert: int, h: np.ndarray, glu: Glu) -> np.ndarray:
        """(T, dim) float32: one expert's gated products of h (T, dim), with its biases where it has them."""
        gate_up = self.gate_up[expert](h)
        if self.gate_up_bias is not None:
            gate_up = gate_up + self.gate_up_bias[expert]
        width = gate_up.shape[1] // 2
        out = self.down[expert](glu(gate_up[:, :width], gate_up[:, width:]))
        return out if self.down_bias is None else out + self.down_bias[expert]


MAX_EXPERTS = 1024  # llama.cpp's LLAMA_MAX_EXPERTS


def expert_shape(model: GGUFModel, arch: str, table: Architecture, n_layers: int, ffn_dim: int) -> tuple[int, int, int]:
    """(experts, experts used per token, an expert's hidden width) as llama.cpp reads them for this
    architecture; (0, 0, 0) for a dense feed-forward. Keys llama.cpp ignores here, set to a value
    that would mean other gating, are refused with the key named rather than ignored."""
    def uniform(name: str) -> int:  # a count, or one per layer (llama.cpp's get_key_or_arr) all equal
        full = f"{arch}.{name}"
        value = model.metadata.get(full, 0)
        values = value if isinstance(value, list) else [value]
        if not values or any(isinstance(v, bool) or not isinstance(v, int) for v in values) or \
                (isinstance(value, list) and len(values) != n_layers):
            raise UnsupportedModelError(model.path, f"expected a count (or one per layer), found {value!r}", f"key {full}")
        if len(set(values)) > 1:
            raise UnsupportedModelError(model.path, f"per-layer values {values} are not supported (only one for "
                                        "every layer)", f"key {full}")
        return int(values[0])

    def refuse(name: str, problem: str) -> UnsupportedModelError:
        return UnsupportedModelError(model.path, problem, f"key {arch}.{name}")

    n_experts = uniform("expert_count") if table.experts != "never" else 0
    if n_experts <= 0:
        if table.experts == "always":
            raise refuse("expert_count", f"{arch} needs experts (llama.cpp refuses an expert count of {n_experts})")
        return 0, 0, 0
    if n_experts > MAX_EXPERTS:
        raise refuse("expert_count", f"{n_experts} experts exceed llama.cpp's {MAX_EXPERTS}")
    used = uniform("expert_used_count")
    if not 0 < used <= n_experts:
        raise refuse("expert_used_count", f"{used} experts per token do not fit 1..{n_experts}")

    def value(name: str, kind: type, default: object) -> object:
        full = f"{arch}.{name}"
        return model.require(full, kind) if full in model.metadata else default

    gating = value("expert_gating_func", int, 1)
    if gating != 1:
        raise refuse("expert_gating_func", f"expert gating {gating} is not supported (only 1, softmax: what "
                     f"llama.cpp computes for {arch})")
    if float(value("expert_weights_scale", float, 1.0)) not in (0.0, 1.0):  # type: ignore[arg-type]
        raise refuse("expert_weights_scale", "scaled expert weights are not supported (llama.cpp does not scale "
                     f"them for {arch})")
    if table.expert_weights_norm and value("expert_weights_norm", bool, True) is not True:
        raise refuse("expert_weights_norm", f"unnormalised expert weights are not supported (llama.cpp "
                     f"normalises the top {used} for {arch})")
    if int(value("expert_group_count", int, 0)) > 1:  # type: ignore[call-overload]
        raise refuse("expert_group_count", "expert groups are not supported")
    if table.experts == "optional":  # Mixtral's llama files: each expert is feed_forward_length wide
        width = ffn_dim
    else:  # qwen3moe: its own key, else llama.cpp's n_ff / n_expert_used
        width = uniform("expert_feed_forward_length") or ffn_dim // used
    if width <= 0:
        raise refuse("expert_feed_forward_length", "no expert width (neither this key nor feed_forward_length)")
    return n_experts, used, width
