"""Hit rates of the expert cache's policies (issue 26) on routings of stated skews, replayed through
infer.tiers.expert_policy:

    python -m bench.expert_cache [--layers 48 --experts 128 --used 8] [--tokens 4000] \\
        [--shares 0.1,0.25,0.5] [--zipf 0.5,1.0] [--model MOE.gguf --record 512] [--out r.json]

Routings, one token at a time (decode), each layer choosing `used` distinct experts:
- `uniform`: every expert equally likely, what random weights route like (the cache's worst case);
- `zipf-S`: expert popularity falling as 1 / rank ** S, each layer ranking its experts in its own random
  order. The skew is an assumption (no real router's statistics are at hand here), stated by S;
  `zipf-S-drift-D` draws the rankings anew every D tokens (a change of topic: the case for forgetting);
- `model`: the routings of a mixture-of-experts GGUF (--model), recorded by decoding a random text of
  --record tokens with the packed CPU engine.
The first half of each trace calibrates, the second is measured: `lru` and `lfru` replay the first half
to warm up; `static` holds the first half's most used experts and never changes (the plan's "expected
hit rate" is its prediction, printed beside it as `expected`); `seeded` is a new run given the first
half's statistics (preloaded, then the default lfru). Shares are of all layers' experts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from infer.tiers.expert_policy import HALF_LIFE_CAPACITIES, ExpertResidency, ExpertUse

Trace = list[tuple[int, list[int]]]  # (layer, experts) per routing, in order


def uniform_trace(layers: int, experts: int, used: int, tokens: int, rng: np.random.Generator) -> Trace:
    return [(layer, [int(e) for e in rng.choice(experts, used, replace=False)])
            for _ in range(tokens) for layer in range(layers)]


def zipf_trace(layers: int, experts: int, used: int, tokens: int, skew: float, rng: np.random.Generator,
               drift: int = 0) -> Trace:
    """Popularity 1 / rank ** skew in each layer's own random order of its experts, drawn anew every
    `drift` tokens when drift > 0 (a change of topic)."""
    weights = 1.0 / np.arange(1, experts + 1) ** skew
    probs = np.empty((layers, experts))
    trace: Trace = []
    for t in range(tokens):
        if t == 0 or (drift and t % drift == 0):
            for p in probs:
                p[rng.permutation(experts)] = weights / weights.sum()
        trace += [(layer, [int(e) for e in rng.choice(experts, used, replace=False, p=probs[layer])])
                  for layer in range(layers)]
    return trace


def model_trace(path: Path, tokens: int) -> tuple[Trace, tuple[int, int, int]]:
    """Routings of `tokens` decode steps of a random text through the packed engine (experts from the
    file's mapping; the routing does not depend on where they are held)."""
    from infer.gguf_file import GGUFModel
    from infer.model import load_transformer
    from infer.moe import MixtureOfExperts

    model = load_transformer(GGUFModel(path))
    args = model.args
    if not args.n_experts:
        raise SystemExit(f"{path.name} has no experts")
    trace: Trace = []
    route = MixtureOfExperts.route

    def recording(self: MixtureOfExperts, h: np.ndarray, exact: bool = False) -> tuple[np.ndarray, np.ndarray]:
        chosen, weights = route(self, h, exact)  # one token a pass: the layers route in turn
        trace.append((len(trace) % args.n_layers, [int(e) for e in chosen[0]]))
        return chosen, weights

    text = np.random.default_rng(0).integers(3, args.vocab_size, tokens)
    cache = model.new_cache(tokens + 1)
    MixtureOfExperts.route = recording  # type: ignore[method-assign]
    try:
        for token in text:
            model.forward(np.array([token]), cache)
    finally:
        MixtureOfExperts.route = route  # type: ignore[method-assign]
    return trace, (args.n_layers, args.n_experts, args.n_experts_used)


def replay(trace: Trace, shape: tuple[int, int, int], capacity: int, policy: str,
           half_life: float | None = None) -> float:
    """The hit rate of the second half of `trace` after the first warmed the cache up."""
    half = len(trace) // 2
    calibration = ExpertUse.empty(shape[0], shape[1])
    for layer, experts in trace[:half]:
        calibration.add(layer, experts)
    if policy == "static":
        held = set(calibration.hottest(capacity))
        hits = sum((layer, e) in held for layer, experts in trace[half:] for e in experts)
    elif policy == "seeded":  # a new run given the first half's statistics: preloaded, then lfru
        cache = ExpertResidency(capacity, "lfru", calibration, half_life=half_life)
        cache.preload()
        hits = 0
        for layer, experts in trace[half:]:
            missing, _ = cache.admit(layer, experts)
            hits += len(experts) - len(missing)
    else:
        cache = ExpertResidency(capacity, policy, half_life=half_life)
        for layer, experts in trace[:half]:
            cache.admit(layer, experts)
        hits = 0
        for layer, experts in trace[half:]:
            missing, _ = cache.admit(layer, experts)
            hits += len(experts) - len(missing)
    return hits / sum(len(experts) for _, experts in trace[half:])


def measure(name: str, trace: Trace, shape: tuple[int, int, int], shares: list[float],
            half_lives: list[float]) -> list[dict[str, Any]]:
    rows = []
    calibration = ExpertUse.empty(shape[0], shape[1])
    for layer, experts in trace[: len(trace) // 2]:
        calibration.add(layer, experts)
    for share in shares:
        capacity = max(shape[2], int(share * shape[0] * shape[1]))
        row: dict[str, Any] = {"trace": name, "share": share, "capacity": capacity,
                               "expected": round(calibration.expected_hit_rate(capacity), 4)}
        row["static"] = round(replay(trace, shape, capacity, "static"), 4)
        row["lru"] = round(replay(trace, shape, capacity, "lru"), 4)
        row["seeded"] = round(replay(trace, shape, capacity, "seeded", HALF_LIFE_CAPACITIES * capacity), 4)
        for h in half_lives:
            row[f"lfru-{h:g}"] = round(replay(trace, shape, capacity, "lfru", h * capacity), 4)
        rows.append(row)
        print("  ".join(f"{k} {v}" for k, v in row.items()), file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.expert_cache", description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=48, help="synthetic traces: layers (Qwen3-30B-A3B: 48)")
    parser.add_argument("--experts", type=int, default=128, help="synthetic traces: experts per layer")
    parser.add_argument("--used", type=int, default=8, help="synthetic traces: experts per token")
    parser.add_argument("--tokens", type=int, default=4000,
                        help="synthetic traces: tokens (half calibrate); 0: only --model's routings")
    parser.add_argument("--shares", default="0.1,0.25,0.5", help="cache sizes, as shares of all experts")
    parser.add_argument("--zipf", default="0.5,1.0", help="skews S of the zipf traces ('' for none)")
    parser.add_argument("--drift", type=int, default=250,
                        help="also each zipf trace with its rankings drawn anew every DRIFT tokens (0: not)")
    parser.add_argument("--half-lives", default=f"1,{HALF_LIFE_CAPACITIES:g},16",
                        help="lfru's half-lives, in routings per capacity")
    parser.add_argument("--model", type=Path, help="also the routings of this mixture-of-experts GGUF")
    parser.add_argument("--record", type=int, default=512, help="--model: tokens decoded (half calibrate)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    shares = [float(s) for s in args.shares.split(",")]
    half_lives = [float(h) for h in args.half_lives.split(",")]
    rng = np.random.default_rng(args.seed)
    shape = (args.layers, args.experts, args.used)
    began = time.perf_counter()
    rows = measure("uniform", uniform_trace(*shape, args.tokens, rng), shape, shares, half_lives) if args.tokens else []
    for skew in (float(s) for s in args.zipf.split(",") if s.strip() and args.tokens):
        rows += measure(f"zipf-{skew:g}", zipf_trace(*shape, args.tokens, skew, rng), shape, shares, half_lives)
        if args.drift:
            rows += measure(f"zipf-{skew:g}-drift-{args.drift}", zipf_trace(*shape, args.tokens, skew, rng, args.drift),
                            shape, shares, half_lives)
    model = None
    if args.model:
        trace, model_shape = model_trace(args.model, args.record)
        rows += measure(f"model {args.model.name}", trace, model_shape, shares, half_lives)
        model = {"file": args.model.name, "layers": model_shape[0], "experts": model_shape[1],
                 "used": model_shape[2], "tokens": args.record}
    result = {"layers": args.layers, "experts": args.experts, "used": args.used, "tokens": args.tokens, "drift": args.drift,
              "model": model, "seconds": round(time.perf_counter() - began, 1), "rows": rows,
              "command": " ".join(["python -m bench.expert_cache", *(argv if argv is not None else sys.argv[1:])])}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
