"""Per-block cost of a decode row's MoE feed-forward on the packed CPU engine, split into its parts
(session 38's script, with the routed experts' weighted sum in their native call added)."""
import sys
import time

import numpy as np

from infer.gguf_file import GGUFModel
from infer.model import load_transformer
from infer.moe import weighted_sum

m = load_transformer(GGUFModel(sys.argv[1]), packed=True)
nl = m.weights.native_layers
blocks = [m.weights.layer(i) for i in range(m.args.n_layers)]
rng = np.random.default_rng(0)
xs = rng.standard_normal((400, m.args.dim)).astype(np.float32)

def bench(fn, reps=400):
    ts = []
    for k in range(reps):
        t = time.perf_counter()
        fn(k)
        ts.append(time.perf_counter() - t)
    return float(np.median(ts[50:])) * 1e6

def whole(k):
    L = blocks[k % len(blocks)]
    h = nl.norm(xs[k:k+1], L.ffn_norm, m.args.norm_eps)
    L.experts(h, nl.swiglu)
def route(k):
    L = blocks[k % len(blocks)]
    L.experts.route(xs[k:k+1])
def router_product(k):
    L = blocks[k % len(blocks)]
    L.experts.router(xs[k:k+1])
chosen = [blocks[k % len(blocks)].experts.route(xs[k:k+1]) for k in range(400)]
def row(k):
    L = blocks[k % len(blocks)]
    L.experts.row_experts(xs[k], chosen[k][0][0])
def row_sum(k):
    L = blocks[k % len(blocks)]
    L.experts.row_sum(xs[k], chosen[k][0][0], chosen[k][1][0])
def norm(k):
    nl.norm(xs[k:k+1], blocks[0].ffn_norm, m.args.norm_eps)
outs = np.zeros((1, m.args.n_experts_used, m.args.dim), np.float32)
def wsum(k):
    weighted_sum(outs, chosen[k][1])
for name, fn in [("whole ffn", whole), ("norm", norm), ("route", route), ("router product", router_product),
                 ("row experts (native)", row), ("weighted sum", wsum),
                 ("row experts and their sum (native)", row_sum)]:
    print(f"{name:36s} {bench(fn):8.1f} us", flush=True)
