"""Perplexity chunk by chunk, ours against llama.cpp's, to tell a systematic difference from the
sampling noise of a few chunks.

    python -m tests.oracle.perplexity_chunks smollm2-Q4_K_M 36 [--out FILE.json]

Each chunk of 256 tokens of Botchan (llama.cpp's method: BOS first where the model adds one, the
second half scored) is evaluated as one batch on both sides. Prints the spread of the per-chunk
ratio and the ratio of the perplexities over the first 8 and over all chunks.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

from infer.api import LLM
from infer.perplexity import chunk_nll
from tests.oracle.fixtures import botchan_text, model_path
from tests.oracle.reference import Reference

CTX = 256


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="an oracle model name: smollm2-Q4_K_M, qwen05b, qwen15b, ...")
    parser.add_argument("chunks", type=int)
    parser.add_argument("--out", type=Path, help="write the figures and every chunk's ratio as JSON")
    args = parser.parse_args()
    ref = Reference(model_path(args.model))
    ours = LLM.load(model_path(args.model), ctx_size=2 * CTX)
    tokens = ref.tokenize(botchan_text())
    bos = ours.tokenizer.bos_id if ours.tokenizer.vocab.add_bos else None
    mean_nll = []
    for i in range(args.chunks):
        chunk = list(tokens[i * CTX : (i + 1) * CTX])
        if bos is not None:
            chunk[0] = bos
        mean_nll.append((chunk_nll(ours.logits(chunk), chunk).mean(), chunk_nll(ref.logits(chunk), chunk).mean()))
    ref.close()
    a, b = np.array(mean_nll).T
    ratio = np.exp(a - b) - 1

    def over(k: int) -> float:
        return math.exp(a[:k].mean() - b[:k].mean()) - 1

    result = {"model": args.model, "chunks": args.chunks, "ctx": CTX, "spread_of_chunk_ratio": float(ratio.std(ddof=1)),
              "first_8": over(8), "all": over(args.chunks), "per_chunk_ratio": ratio.tolist()}
    print(f"{args.model}: per-chunk ratio spread {result['spread_of_chunk_ratio']:.2%}; perplexity ratio - 1 over "
          f"the first 8 chunks {result['first_8']:+.2%}, over all {args.chunks} {result['all']:+.2%}")
    print("per chunk:", " ".join(f"{r:+.2%}" for r in ratio))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
