"""Speculative decoding on the CPU engine: tree attention against a reference computed path by
path, keeping only the accepted path in the KV cache, greedy output identical to the engine's own,
sampled output distributed as the target's, and prompt lookup.

Identity claims run the target in exact numerics (float64 sums: a tree pass and a plain pass give
the same bits whatever their shapes); float32 sums depend on the shape of the batch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from infer.engine import Engine, greedy
from infer.gguf_file import GGUFModel
from infer.layers import tree_layout
from infer.model import load_transformer
from infer.sampler import Sampler, SamplerConfig
from infer.speculative import LookupDrafter, ModelDrafter, Speculator, Tree, follow, lookup
from infer.synth import SHAPES, Shape, write_model
from tests.oracle.assets import smollm2_path

CTX = 256


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("spec") / "tiny-q8.gguf"
    write_model(path, Shape(**{**SHAPES["tiny"].__dict__, "n_layers": 3}), "q8_0", seed=4)
    return path


def random_tree(rng: np.random.Generator, n: int, vocab: int) -> Tree:
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
    return Tree([int(t) for t in rng.integers(3, vocab, n)], parents)


def test_tree_layout_depths_and_mask() -> None:
    depths, allowed = tree_layout(np.array([-1, 0, 0, 1, 3]), 2)
    assert depths.tolist() == [0, 1, 1, 2, 3]
    assert allowed.astype(int).tolist() == [[1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 0, 1, 0, 0],
                                            [1, 1, 1, 1, 0, 1, 0], [1, 1, 1, 1, 0, 1, 1]]
    with pytest.raises(ValueError, match="parents must come before"):
        tree_layout(np.array([-1, 2, 0]), 0)


@pytest.mark.parametrize("which", ["tiny", "smollm2"])
def test_tree_pass_equals_each_path_alone(which: str, tiny: Path) -> None:
    """Every node's logits from one tree pass equal those of a plain pass over the cache and the
    node's root-to-node path (exact numerics: bit for bit), and accepting a path leaves the cache
    as if the path had been run plainly."""
    path = tiny if which == "tiny" else smollm2_path("Q8_0")
    if not path.exists():
        pytest.skip(f"{path} missing")
    model = load_transformer(GGUFModel(path), exact=True)
    rng = np.random.default_rng(1)
    prompt = rng.integers(3, model.args.vocab_size, 9)
    tree = random_tree(rng, 12, model.args.vocab_size)
    cache = model.new_cache(CTX)
    model.forward(prompt, cache)
    got = model.forward_tree(np.array(tree.tokens), np.array(tree.parents), cache)
    assert cache.length == len(prompt)
    for node in range(len(tree.tokens)):
        chain = [node]
        while tree.parents[chain[-1]] >= 0:
            chain.append(tree.parents[chain[-1]])
        ref = model.new_cache(CTX)
        model.forward(prompt, ref)
        want = model.forward(np.array([tree.tokens[i] for i in reversed(chain)]), ref)
        np.testing.assert_array_equal(got[node], want)
    kept = [0, 1] + [i for i in range(2, 12) if tree.parents[i] == 1][:1]
    cache.accept(kept)
    nxt = model.forward(np.array([5]), cache)
    ref = model.new_cache(CTX)
    want_next = model.forward(np.concatenate([prompt, [tree.tokens[i] for i in kept], [5]]), ref)
    np.testing.assert_array_equal(nxt, want_next)
    assert cache.length == len(prompt) + len(kept) + 1


def test_follow_keeps_the_path_the_target_chooses() -> None:
    tree = Tree([7, 1, 2, 3, 4], [-1, 0, 0, 1, 1])
    logits = np.zeros((5, 10), np.float32)
    logits[0, 1] = logits[1, 4] = logits[4, 9] = 1.0  # 7 -> 1 -> 4 -> (9, not in the tree)
    assert follow(tree, logits, greedy, []) == ([0, 1, 4], 9)
    logits[0, 1], logits[0, 5] = 0.0, 1.0  # the target wants 5: nothing accepted
    assert follow(tree, logits, greedy, []) == ([0], 5)


class _RowCounting:
    """Tree logits that count the rows read one by one and offer every row's arg-max at once."""

    def __init__(self, rows: np.ndarray) -> None:
        self.rows, self.reads, self.argmax_calls = rows, 0, 0

    def __getitem__(self, node: int) -> np.ndarray:
        self.reads += 1
        return self.rows[node]

    def row_argmax(self, bias: tuple[tuple[int, float], ...] = ()) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        from infer.sampler import apply_logit_bias, argmax_rows

        self.argmax_calls += 1
        rows = self.rows.copy()
        for row in rows:
            apply_logit_bias(row, bias)
        return argmax_rows(rows)


def test_a_greedy_walk_reads_the_arg_max_rows_not_the_rows() -> None:
    """An arg-max chooser (infer.engine.greedy, a greedy Sampler without penalty) takes its choices
    from row_argmax in one call; another chooser, or a row with NaN, reads the row itself (the
    greedy Sampler then raises as it does without a tree)."""
    from infer.sampler import NonFiniteLogits, Sampler, SamplerConfig

    tree = Tree([7, 1, 2, 3, 4], [-1, 0, 0, 1, 1])
    rows = np.zeros((5, 10), np.float32)
    rows[0, 1] = rows[1, 4] = rows[4, 9] = 1.0  # 7 -> 1 -> 4 -> (9, not in the tree)
    for chooser in (greedy, Sampler(SamplerConfig(temperature=0))):
        logits = _RowCounting(rows)
        assert follow(tree, logits, chooser, []) == ([0, 1, 4], 9)
        assert (logits.argmax_calls, logits.reads) == (1, 0)
    logits = _RowCounting(rows)  # not an arg-max: each visited row is read
    assert follow(tree, logits, lambda row, _seen: int(np.argmax(row)), []) == ([0, 1, 4], 9)
    assert (logits.argmax_calls, logits.reads) == (0, 3)
    penalized = Sampler(SamplerConfig(temperature=0, repeat_penalty=1.3))
    assert not penalized.argmax_only and not Sampler(SamplerConfig(temperature=0.7)).argmax_only
    rows[1, 2] = np.nan
    with pytest.raises(NonFiniteLogits):
        follow(tree, _RowCounting(rows), Sampler(SamplerConfig(temperature=0)), [])


def test_a_biased_greedy_walk_reads_the_arg_max_rows_with_the_bias_added() -> None:
    """A greedy Sampler with a logit bias (a server request's ignore_eos: a ban) takes its choices
    from row_argmax(bias) in one call, the same path and next token as reading each row; a row whose
    every token is banned goes to the sampler, which refuses it as it does without a tree."""
    from infer.sampler import Sampler, SamplerConfig

    tree = Tree([7, 1, 2, 3, 4], [-1, 0, 0, 1, 1])
    rows = np.zeros((5, 10), np.float32)
    rows[0, 1] = rows[1, 9] = 1.0
    rows[1, 4] = rows[4, 6] = 0.5  # with 9 banned, 7 -> 1 -> 4 -> 6 (not in the tree)
    banned = Sampler(SamplerConfig(temperature=0, logit_bias=((9, float("-inf")), (0, 0.25), (0, 0.125))))
    assert banned.biased_argmax_only and not banned.argmax_only
    logits = _RowCounting(rows)
    assert follow(tree, logits, banned.sample, []) == ([0, 1, 4], 6)
    assert (logits.argmax_calls, logits.reads) == (1, 0)
    boosted = Sampler(SamplerConfig(temperature=0, logit_bias=((2, 0.5), (2, 0.75))))  # 7 -> 2 (0 + 1.25 > 1)
    logits = _RowCounting(rows)
    assert follow(tree, logits, boosted.sample, []) == follow(tree, rows, boosted.sample, []) == ([0, 2], 2)  # row 2 is zeros: the boosted 2 again
    assert (logits.argmax_calls, logits.reads) == (1, 0)
    everything = Sampler(SamplerConfig(temperature=0, logit_bias=tuple((t, float("-inf")) for t in range(10))))
    logits = _RowCounting(rows)
    with pytest.raises(ValueError, match="every token is excluded"):
        follow(tree, logits, everything.sample, [])
    assert logits.reads == 1


def prompts_for(model: object, n: int) -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [rng.integers(3, model.args.vocab_size, 12).tolist() for _ in range(n)]  # type: ignore[attr-defined]


def test_greedy_speculation_is_the_engines_own_output() -> None:
    """SmolLM2 Q4_0 drafting SmolLM2 Q8_0 (exact numerics): token for token what the target's own
    greedy loop gives, with several tokens per target pass; sampled with a seed, the same text as
    the target's own sampled loop with that seed."""
    target_path, draft_path = smollm2_path("Q8_0"), smollm2_path("Q4_0")
    if not (target_path.exists() and draft_path.exists()):
        pytest.skip("SmolLM2 Q8_0/Q4_0 missing: run scripts/fetch-models.sh")
    target = load_transformer(GGUFModel(target_path), exact=True)
    draft = load_transformer(GGUFModel(draft_path))
    from infer.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(GGUFModel(target_path).metadata)
    texts = ["The capital of France is", "def add(a, b):\n    return", "1, 2, 3, 4, 5,"]
    passes = generated = 0
    for text in texts:
        ids = tokenizer.encode(text)
        want = list(Engine(target, CTX).generate(ids, 24, greedy))
        spec = Speculator(target, ModelDrafter(draft, CTX, depth=4, width=2), 9, CTX)
        got = list(spec.generate(ids, 24, greedy))
        assert got == want, text
        passes, generated = passes + spec.stats.passes, generated + spec.stats.generated
        # sampled: the draws happen in the same order on the same logits, so a seed gives the same text
        config = SamplerConfig(temperature=0.8, seed=11)
        want = list(Engine(target, CTX).generate(ids, 16, Sampler(config).sample))
        got = list(Speculator(target, ModelDrafter(draft, CTX), 9, CTX).generate(ids, 16, Sampler(config).sample))
        assert got == want, text
    print(f"SmolLM2 Q4_0 -> Q8_0: {generated / passes:.2f} tokens per target pass")
    assert generated / passes > 1.5


def test_simulated_passes_walk_the_tree_as_the_speculator_does() -> None:
    """bench.spec_bench's curve replays the drafter's tree walk from the draft's rank of each token
    of the target's text: by hand, and against the real Speculator on SmolLM2 Q4_0 drafting Q8_0
    (both in exact numerics, so the draft's teacher-forced ranks are the ones it drafts with)."""
    from bench.spec_bench import draft_ranks, simulate_passes

    # depth 3, width 2: [top-1, top-1, runner-up leaf] + the target's token = 4, then a miss = 1,
    # then two chain tokens and the last token of the text
    assert simulate_passes([0, 0, 1, 0, 5, 0, 0, 7], 3, 2) == 3
    assert simulate_passes([0] * 8, 1, 1) == 4  # one drafted token + the target's own per pass
    assert simulate_passes([9] * 5, 4, 4) == 5  # nothing accepted: a token per pass
    target_path, draft_path = smollm2_path("Q8_0"), smollm2_path("Q4_0")
    if not (target_path.exists() and draft_path.exists()):
        pytest.skip("SmolLM2 Q8_0/Q4_0 missing: run scripts/fetch-models.sh")
    target = load_transformer(GGUFModel(target_path), exact=True)
    draft = load_transformer(GGUFModel(draft_path), exact=True)
    from infer.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(GGUFModel(target_path).metadata)
    ids = tokenizer.encode("def add(a, b):\n    return")
    want = list(Engine(target, CTX).generate(ids, 16, greedy))
    ranks = draft_ranks(draft, ids, want)
    for depth, width in [(1, 1), (4, 2), (3, 3)]:
        spec = Speculator(target, ModelDrafter(draft, CTX, depth, width), 1 + depth * width, CTX)
        assert list(spec.generate(ids, 16, greedy)) == want
        assert simulate_passes(ranks, depth, width) == spec.stats.passes, (depth, width)


def test_lookup_finds_the_latest_continuation(tiny: Path) -> None:
    assert lookup([5, 6, 7, 1, 5, 6, 8, 2, 5, 6], 3, 3) == [8, 2, 5]
    assert lookup([1, 2, 3], 3, 4) == []
    target = load_transformer(GGUFModel(tiny), exact=True)
    prompt = [11, 12, 13, 14, 15] * 4 + [11, 12]
    want = list(Engine(target, CTX).generate(prompt, 20, greedy))
    spec = Speculator(target, LookupDrafter(max_ngram=3, depth=6), 7, CTX)
    assert list(spec.generate(prompt, 20, greedy)) == want
    assert spec.stats.passes <= 20


def test_sampled_tokens_follow_the_targets_distribution(tiny: Path) -> None:
    """Sampled (temperature 0.2, so that most draws share their first token), the second generated
    token, drawn by following a draft tree, has the target's distribution given the first:
    chi-square test of 1500 draws at significance 0.001 over the tokens the target gives at least
    1% (the others pooled)."""
    from scipy import stats

    target = load_transformer(GGUFModel(tiny))
    draft = load_transformer(GGUFModel(tiny), match_llama_cpp=False)  # close to the target, not equal
    prompt = [5, 17, 33]
    config = SamplerConfig(temperature=0.2, top_k=0, top_p=1.0, min_p=0.0)
    counts: dict[int, dict[int, int]] = {}
    accepted = 0
    for seed in range(1500):
        spec = Speculator(target, ModelDrafter(draft, 16, depth=2, width=3), 7, 16)
        first, second = list(spec.generate(prompt, 2, Sampler(SamplerConfig(**{**config.__dict__, "seed": seed})).sample))
        counts.setdefault(first, {}).setdefault(second, 0)
        counts[first][second] += 1
        accepted += spec.stats.accepted
    first = max(counts, key=lambda t: sum(counts[t].values()))
    cache = target.new_cache(CTX)
    logits = target.forward(np.array([*prompt, first]), cache)
    ids, probs = Sampler(config).distribution(logits)
    p = dict(zip(ids.tolist(), probs.tolist(), strict=True))
    n = sum(counts[first].values())
    big = [t for t in p if p[t] >= 0.01]
    observed = [counts[first].get(t, 0) for t in big] + [n - sum(counts[first].get(t, 0) for t in big)]
    expected = [n * p[t] for t in big] + [n * (1 - sum(p[t] for t in big))]
    result = stats.chisquare(observed, expected)
    print(f"second token after {first}: {n} draws, {len(big)} tokens, chi-square p = {result.pvalue:.3f}; "
          f"{accepted} draft tokens accepted over the 1500 runs")
    assert n >= 300 and accepted > 100  # the walk went through the tree, not only past it
    assert result.pvalue > 0.001


def test_projection_joins_acceptance_and_pass_time(tmp_path: Path) -> None:
    """bench.spec_bench project: tokens per pass of each shape over the time of the smallest
    measured verification pass that holds its tree, plus the draft's steps; the draft-step
    allowance for the goal is what would leave exactly the goal."""
    import json

    from bench.spec_bench import main

    (tmp_path / "a.json").write_text(json.dumps({"draft": "d", "target": "t", "shapes": [
        {"depth": 2, "width": 2, "nodes": 5, "tokens_per_pass": 2.0},
        {"depth": 8, "width": 4, "nodes": 33, "tokens_per_pass": 5.0},
        {"depth": 64, "width": 16, "nodes": 1025, "tokens_per_pass": 9.0}]}))
    (tmp_path / "v.json").write_text(json.dumps({"model": "m", "passes": [
        {"nodes": 1, "pass_seconds": 0.4}, {"nodes": 8, "pass_seconds": 0.4}, {"nodes": 64, "pass_seconds": 0.5}]}))
    out = tmp_path / "p.json"
    assert main(["project", "--acceptance", str(tmp_path / "a.json"), "--verify", str(tmp_path / "v.json"),
                 "--draft-step-seconds", "0.01", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["plain_tok_s"] == 2.5 and "projection" in result["label"]
    rows = result["rows"]
    assert [r["verify_nodes"] for r in rows] == [8, 64]  # no measured pass holds 1025 nodes
    assert rows[0]["projected_tok_s"] == round(2.0 / (0.4 + 2 * 0.01), 3)
    assert rows[1]["projected_tok_s"] == round(5.0 / (0.5 + 8 * 0.01), 3) == result["best"]["projected_tok_s"]
    assert rows[1]["draft_step_seconds_for_10_tok_s"] == 0.0
    assert rows[0]["draft_step_seconds_for_10_tok_s"] < 0  # 2 tokens per 0.4 s pass cannot reach 10 tok/s


def test_projection_takes_the_measured_shapes_of_an_e2e_run(tmp_path: Path) -> None:
    """An e2e result as the acceptance: its DxW shapes with their measured tokens per pass (auto,
    which has no one shape, left out); one with only auto is refused with one line."""
    import json

    from bench.spec_bench import main

    e2e = {"draft": "d", "target": "t", "shapes": {"auto": {"tokens_per_pass": 9.9}, "10x1": {"tokens_per_pass": 7.0},
                                                   "4x2": {"tokens_per_pass": 4.0}, "best:3x5": {"tokens_per_pass": 3.5},
                                                   "auto-best:4": {"tokens_per_pass": 5.0}}}
    (tmp_path / "e.json").write_text(json.dumps(e2e))
    (tmp_path / "v.json").write_text(json.dumps({"model": "m", "passes": [
        {"nodes": 1, "pass_seconds": 0.4}, {"nodes": 16, "pass_seconds": 0.5}]}))
    out = tmp_path / "p.json"
    assert main(["project", "--acceptance", str(tmp_path / "e.json"), "--verify", str(tmp_path / "v.json"),
                 "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["tree"], r["depth"], r["width"], r["nodes"], r["verify_nodes"]) for r in rows] == [
        ("chain", 10, 1, 11, 16), ("chain", 4, 2, 9, 16), ("best", 3, 5, 16, 16)]
    assert rows[0]["projected_tok_s"] == round(7.0 / 0.5, 3) and rows[0]["measured_end_to_end"]
    (tmp_path / "auto.json").write_text(json.dumps({**e2e, "shapes": {"auto": {"tokens_per_pass": 9.9}}}))
    with pytest.raises(SystemExit, match="no fixed tree shape"):
        main(["project", "--acceptance", str(tmp_path / "auto.json"), "--verify", str(tmp_path / "v.json")])


def _simulated_pass(rng: np.random.Generator, q: float, leaf: list[float], depth: int, width: int) -> tuple[int, int]:
    """(chain kept, leaf rank kept or 0) of one pass whose target agrees with the draft's top token with
    chance q at each step, and where it does not, picks the draft's rank r >= 1 with chance leaf[r - 1]."""
    chain = 0
    while chain < depth and rng.random() < q:
        chain += 1
    if chain == depth:
        return chain, 0
    r = int(rng.choice(len(leaf) + 1, p=[*leaf, 1 - sum(leaf)])) + 1  # len(leaf) + 1: beyond every leaf
    return chain, r if r < width else 0


def _rate(depth: int, width: int, q: float, leaf: list[float], step: float, a: float, b: float,
          fixed: float = 0.0) -> float:
    tokens = sum(q**i for i in range(depth + 1)) + sum(leaf[: width - 1]) * (1 - q**depth)
    return tokens / (fixed + depth * step + a + b * (1 + depth * width))


@pytest.mark.parametrize("q, leaf, step, a, b, fixed", [
    (0.9, [0.3, 0.1, 0.05], 1e-3, 10e-3, 0.0, 0.0),  # leaves free, a deep chain pays
    (0.6, [0.3, 0.15, 0.1, 0.05], 2e-3, 5e-3, 1e-4, 0.0),  # a weak draft, rows that cost: short and a little wide
    (0.7, [0.35, 0.15, 0.1, 0.05, 0.03], 1.2e-3, 7.5e-3, 0.0, 0.0),  # prose on the streamed pair: wide, shallow
    (0.97, [0.2, 0.05], 0.5e-3, 20e-3, 0.0, 0.0),
    (0.8, [0.4, 0.2], 1e-3, 2e-3, 3e-4, 0.0),  # every row costs: width 1
    # a drafting round's own costs beside its steps (the H200's 2.5 ms against 1.1 ms a step,
    # 2026-12-03): charged to the steps they make depth look dear
    (0.93, [0.3, 0.1, 0.05], 1.1e-3, 8e-3, 0.0, 12e-3),
    (0.75, [0.35, 0.15, 0.1, 0.05, 0.03], 0.4e-3, 7.5e-3, 0.0, 6e-3),
])
def test_shape_tuner_picks_the_shape_the_measurements_favour(q: float, leaf: list[float], step: float, a: float,
                                                             b: float, fixed: float) -> None:
    """The tuner's shape maximises expected tokens per second under the measured acceptance (each chain
    step kept with chance q, a failed step's token at draft rank r with chance leaf[r-1]) and costs
    (drafting `fixed` + a step each, verify a + b per node) within 90% of the optimum computed in
    closed form; it moves there from its start, including to widths it never offered (extrapolated,
    then measured)."""
    from infer.spec_tuner import ShapeTuner

    rng = np.random.default_rng(0)
    tuner = ShapeTuner(depth=3, max_depth=32, width=2, max_width=8, max_nodes=65, every=8)
    for _ in range(1500):
        d, w = tuner.depth, tuner.width
        chain, rank = _simulated_pass(rng, q, leaf, d, w)
        tuner.observe(d, w, 1 + d * w, chain, rank, fixed + d * step, a + b * (1 + d * w))
    shapes = [(d, w) for d in range(1, 33) for w in range(1, 9) if 1 + d * w <= 65]
    best = max(shapes, key=lambda s: _rate(*s, q, leaf, step, a, b, fixed))
    got = (tuner.depth, tuner.width)
    assert _rate(*got, q, leaf, step, a, b, fixed) >= 0.9 * _rate(*best, q, leaf, step, a, b, fixed), (got, best)


def test_shape_tuner_separates_a_rounds_fixed_drafting_cost_from_its_steps() -> None:
    """Drafting seconds observed at several depths give the line (fixed, per step), not their mean per
    step; with one depth only, everything is charged per step."""
    from infer.spec_tuner import ShapeTuner

    tuner = ShapeTuner(depth=4, max_depth=16, width=4, max_nodes=65, every=1000)
    tuner.observe(4, 4, 17, 2, 0, 2.5e-3 + 4 * 1.1e-3, 8e-3)
    assert tuner.draft_line() == (0.0, pytest.approx((2.5e-3 + 4.4e-3) / 4))
    for depth in (2, 8, 16, 4):
        tuner.observe(depth, 4, 1 + 4 * depth, 1, 0, 2.5e-3 + depth * 1.1e-3, 8e-3)
    fixed, step = tuner.draft_line()
    assert fixed == pytest.approx(2.5e-3) and step == pytest.approx(1.1e-3)
    assert tuner.seconds(16, 4) == pytest.approx(2.5e-3 + 16 * 1.1e-3 + 8e-3)


def test_chain_and_leaf_reads_the_drafters_tree() -> None:
    from infer.spec_tuner import chain_and_leaf

    parents = [-1, 0, 0, 0, 1, 1, 1, 4, 4, 4]  # a 3 x 3 ModelDrafter tree: chain 1, 4, 7; leaves by rank
    assert chain_and_leaf(parents, [0]) == (0, 0)
    assert chain_and_leaf(parents, [0, 2]) == (0, 1)
    assert chain_and_leaf(parents, [0, 1, 4, 9]) == (2, 2)
    assert chain_and_leaf(parents, [0, 1, 4, 7]) == (3, 0)


def test_speculator_with_tuner_is_plain_greedy() -> None:
    """With the shape tuner (SmolLM2 Q4_0 drafting Q8_0) the output is still the target's own greedy text."""
    from infer.spec_tuner import ShapeTuner

    target = load_transformer(GGUFModel(smollm2_path("Q8_0")), exact=True)
    draft = load_transformer(GGUFModel(smollm2_path("Q4_0")))
    prompt = [1, 504, 3458, 282, 4649, 314]
    want = list(Engine(target, CTX).generate(prompt, 40, greedy))
    tuner = ShapeTuner(depth=2, max_depth=8, width=2, max_width=4, max_nodes=17, every=2)
    spec = Speculator(target, ModelDrafter(draft, CTX, 2, 2), 17, CTX, tuner)
    assert list(spec.generate(prompt, 40, greedy)) == want
    assert 1 <= tuner.depth <= 8 and 1 <= tuner.width <= 4 and tuner.passes == spec.stats.passes
