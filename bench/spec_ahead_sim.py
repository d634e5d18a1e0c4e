"""What drafting the next tree during the target's pass (infer/draft_ahead.py) can give, simulated
from the draft's teacher-forced ranks along the target's greedy text (`bench.spec_bench curve
--keep-ranks`) and a round's costs, for chain-with-leaves trees.

A round at position p: the chain is kept while the text's token is the draft's top-1 (up to depth
D); a token of rank 1..W-1 is a leaf, kept, and ends the walk; then the target's own token. The
round costs verify + round + (D - ready) * step, where `ready` is how many of its chain steps were
drafted during the previous pass: min(D, steps - 1) when that pass's walk ended at a branch (the
chain's end, or a leaf of rank <= --leaf-rank) and the target's token after it was the draft's
top-1 there, else 0. Drafting ahead is taken to cost nothing (the branches hidden behind the
verify): an upper bound, which the H200 did not reach (docs/SPECULATIVE.md).

    python -m bench.spec_ahead_sim --ranks curve-prose.json --shapes 4x4,8x4 --verify-ms 7.7 --step-ms 0.85
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path


def simulate(ranks: Sequence[Sequence[int]], depth: int, width: int, leaf_rank: int, steps: int, verify_ms: float,
             round_ms: float, step_ms: float) -> dict[str, float]:
    """Tokens a round, ms a round and the share of rounds whose chain was ready, over every text."""
    tokens = rounds = hits = 0
    ms = 0.0
    for r in ranks:
        n, p, ready = len(r), 0, 0
        while p < n:
            kept, leaf = 0, 0
            while kept < depth and p + kept < n:
                rank = r[p + kept]
                if rank >= width:
                    break
                kept += 1
                if rank > 0:
                    leaf = rank
                    break
            at = p + kept  # the target's own token
            ms += verify_ms + round_ms + (depth - ready) * step_ms
            tokens += min(kept + 1, n - p)
            rounds += 1
            hits += ready > 0
            branch = (kept == depth and not leaf) or 0 < leaf <= leaf_rank
            ready = min(depth, steps - 1) if branch and at < n and r[at] == 0 else 0
            p = at + 1
    return {"tokens_per_round": tokens / rounds, "ms_per_round": ms / rounds, "ready_share": hits / rounds,
            "tokens_per_ms": tokens / ms}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.spec_ahead_sim", description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=Path, required=True, help="bench.spec_bench curve --keep-ranks output")
    parser.add_argument("--shapes", default="4x4,8x4,16x4", help="DxW chain-with-leaves trees")
    parser.add_argument("--verify-ms", type=float, default=7.7)
    parser.add_argument("--round-ms", type=float, default=0.5, help="a round's own drafting cost")
    parser.add_argument("--step-ms", type=float, default=0.85, help="a draft step")
    parser.add_argument("--plain-ms", type=float, default=7.48, help="the target's plain decode step")
    parser.add_argument("--steps", type=int, default=6, help="steps a branch (the guess of the target's token, then the chain)")
    parser.add_argument("--leaf-rank", type=int, default=3, help="leaves of rank <= this are branches")
    args = parser.parse_args(argv)
    data = json.loads(args.ranks.read_text())
    ranks = data["ranks"] if isinstance(data, dict) else [d["ranks"] for d in data]
    out = {"ranks": str(args.ranks), "texts": len(ranks), "costs_ms": {"verify": args.verify_ms, "round": args.round_ms,
                                                                        "step": args.step_ms, "plain": args.plain_ms},
           "shapes": {}}
    for shape in args.shapes.split(","):
        depth, width = (int(v) for v in shape.split("x"))
        costs = (args.verify_ms, args.round_ms, args.step_ms)
        plain = simulate(ranks, depth, width, 0, 0, *costs)
        ahead = simulate(ranks, depth, width, args.leaf_rank, min(args.steps, depth + 1), *costs)
        out["shapes"][shape] = {"tokens_per_round": round(plain["tokens_per_round"], 3),
                                "speedup": round(plain["tokens_per_ms"] * args.plain_ms, 3),
                                "speedup_drafting_ahead": round(ahead["tokens_per_ms"] * args.plain_ms, 3),
                                "rounds_with_the_chain_ready": round(ahead["ready_share"], 3)}
    out["command"] = " ".join(["python -m bench.spec_ahead_sim", *(argv if argv is not None else sys.argv[1:])])
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
