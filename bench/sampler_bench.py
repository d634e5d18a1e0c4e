"""Host sampling time per row of logits (what a server pays per sequence per token when the logits come
back to the host), for the configurations clients send: OpenAI's defaults (temperature 1, no filter),
llama-server's (top-k 40, top-p 0.95, min-p 0.05), a nucleus alone, greedy with ignore_eos (a bias),
greedy with a repetition penalty. Random rows of a 128k vocabulary (Llama 3's) by default.

    python -m bench.sampler_bench [--vocab 128256] [--rows 32] [--repeat 5] [--out sampler.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

from infer.sampler import Sampler, SamplerConfig

CONFIGS = {
    "openai-defaults": dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
    "llama-server-defaults": dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
    "top-p-0.95-alone": dict(temperature=0.8, top_k=0, top_p=0.95, min_p=0.0),
    "greedy-ignore-eos": dict(temperature=0.0, logit_bias=((2, float("-inf")),)),
    "greedy-repeat-penalty": dict(temperature=0.0, repeat_penalty=1.1),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sampler_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--rows", type=int, default=32, help="distinct rows (a server step's sequences)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--scale", type=float, default=3.0, help="standard deviation of the random logits")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    rows = [rng.normal(scale=args.scale, size=args.vocab).astype(np.float32) for _ in range(args.rows)]
    history = list(range(64))
    result: dict = {"command": "python -m bench.sampler_bench " + " ".join(sys.argv[1:] if argv is None else argv),
                    "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "machine": platform.processor()
                    or platform.machine(), "vocab": args.vocab, "rows": args.rows, "ms_per_row": {}}
    for name, fields in CONFIGS.items():
        sampler = Sampler(SamplerConfig(seed=1, **fields))  # type: ignore[arg-type]
        for row in rows[:2]:
            sampler.sample(row, history)
        began = time.perf_counter()
        for _ in range(args.repeat):
            for row in rows:
                sampler.sample(row, history)
        ms = (time.perf_counter() - began) / (args.repeat * args.rows) * 1e3
        result["ms_per_row"][name] = round(ms, 4)
        print(f"{name:24s} {ms:8.3f} ms a row ({ms * args.rows:7.1f} ms for {args.rows} rows)")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
