"""Tokens a pass of the real Qwen pair (1.5B target, 0.5B draft) on HumanEval prompts, on the CPU:
the CLI's Speculator, each prompt alone, against the server's scheduler with a DraftPool, all of them
together, for one draft tree shape (session 39). Run from the repository's root:

    python docs/results/2026-12-08/session39/accept_cmp.py PROMPTS DEPTH WIDTH TOKENS

with the pair joined into /tmp/pair/target.gguf and /tmp/pair/draft.gguf (scripts/gpu-spec-e2e.sh's
pieces, concatenated and cut at the target's size)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

from bench.spec_bench import humaneval_prompts  # noqa: E402
from infer.engine import greedy  # noqa: E402
from infer.gguf_file import GGUFModel  # noqa: E402
from infer.model import load_transformer  # noqa: E402
from infer.scheduler import Request, Scheduler, as_sampler  # noqa: E402
from infer.spec_serve import DraftPool  # noqa: E402
from infer.speculative import ModelDrafter, Speculator  # noqa: E402
from infer.tokenizer import Tokenizer  # noqa: E402

CTX = 1024
target_file = GGUFModel("/tmp/pair/target.gguf")
target = load_transformer(target_file, packed=True)
draft = load_transformer(GGUFModel("/tmp/pair/draft.gguf"), packed=True)
tokenizer = Tokenizer.from_gguf(target_file.metadata)
n_prompts, depth, width, tokens = (int(a) for a in sys.argv[1:5])
prompts = [tokenizer.encode(p) for p in humaneval_prompts(n_prompts)]
tree = 1 + depth * width
alone = []
for p in prompts:
    spec = Speculator(target, ModelDrafter(draft, CTX, depth=depth, width=width), tree, CTX)
    out = list(spec.generate(list(p), tokens, greedy))
    alone.append((spec.stats.passes, spec.stats.accepted, len(out)))
print("cli  (passes, accepted, tokens):", alone, "tokens/pass", sum(a[2] for a in alone) / sum(a[0] for a in alone))
pool = DraftPool(target, lambda: ModelDrafter(draft, CTX, depth=depth, width=width), tree, CTX)
requests = [Request(list(p), tokens, as_sampler(greedy)) for p in prompts]
scheduler = Scheduler(target, CTX, n_prompts, speculation=pool)
scheduler.run(requests)
print("serve accepted", scheduler.stats.accepted_tokens, "drafted", scheduler.stats.draft_tokens,
      "tokens", sum(len(r.generated) for r in requests))
speculators = list(pool._speculators.values())
print("serve per speculator (passes, accepted):", [(s.stats.passes, s.stats.accepted) for s in speculators],
      "tokens/pass", sum(len(r.generated) for r in requests) / sum(s.stats.passes for s in speculators))
