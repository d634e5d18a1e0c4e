"""Acceptance of the real pair on one HumanEval prompt: the CLI's Speculator alone vs the serve
scheduler's path (DraftPool, one request and with 8 requests), same tree shape."""
import sys, time
import numpy as np
sys.path.insert(0, "/work/main")
from infer.gguf_file import GGUFModel
from infer.model import load_transformer
from infer.tokenizer import Tokenizer
from infer.engine import greedy
from infer.speculative import ModelDrafter, Speculator
from infer.spec_serve import DraftPool
from infer.scheduler import Request, Scheduler, as_sampler
from bench.spec_bench import humaneval_prompts

CTX = 1024
tg = GGUFModel("/tmp/pair/target.gguf")
target = load_transformer(tg, packed=True)
draft = load_transformer(GGUFModel("/tmp/pair/draft.gguf"), packed=True)
tok = Tokenizer.from_gguf(tg.metadata)
n_req = int(sys.argv[1]); depth, width = int(sys.argv[2]), int(sys.argv[3]); N = int(sys.argv[4])
prompts = [tok.encode(p) for p in humaneval_prompts(n_req)]
tree = 1 + depth * width
# CLI path, each prompt alone
acc_cli = []
for p in prompts:
    spec = Speculator(target, ModelDrafter(draft, CTX, depth=depth, width=width), tree, CTX)
    out = list(spec.generate(list(p), N, greedy))
    acc_cli.append((spec.stats.passes, spec.stats.accepted, len(out)))
print("cli  (passes, accepted, tokens):", acc_cli, "tokens/pass", sum(a[2] for a in acc_cli) / sum(a[0] for a in acc_cli))
pool = DraftPool(target, lambda: ModelDrafter(draft, CTX, depth=depth, width=width), tree, CTX)
reqs = [Request(list(p), N, as_sampler(greedy)) for p in prompts]
sched = Scheduler(target, CTX, n_req, speculation=pool)
sched.run(reqs)
print("serve accepted", sched.stats.accepted_tokens, "drafted", sched.stats.draft_tokens,
      "tokens", sum(len(r.generated) for r in reqs))
specs = list(pool._speculators.values())
print("serve per speculator (passes, accepted):", [(s.stats.passes, s.stats.accepted) for s in specs],
      "tokens/pass", sum(len(r.generated) for r in reqs) / sum(s.stats.passes for s in specs))
