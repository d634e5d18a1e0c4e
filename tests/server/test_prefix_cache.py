"""The prefix cache (issue 27): a chat that resends its history runs only the new turn, and the
answers are those of a server without the cache. Two conversations interleave over two slots, so
each turn must find the cache its own history is in. SmolLM2 Q8_0 with --exact (float64 sums) and on
the packed native engine, the CPU's default: on both a sequence's logits do not depend on how its
positions were split into passes, so the cache is on by default."""

from __future__ import annotations

from pathlib import Path

import pytest

from infer import cpu_kernels
from tests.server.test_server import KEY, Served, model  # noqa: F401 - the model fixture

TURNS = ["Hi! Who are you?", "Name a colour.", "And a fruit?", "Which is sweeter?", "Thanks, bye."]


def _replay(server: Served) -> list[str]:
    """Two conversations, turn by turn in alternation, each resending its whole history."""
    client = server.client()
    histories: list[list[dict[str, str]]] = [[{"role": "system", "content": f"You are assistant {c}."}] for c in "AB"]
    answers = []
    for turn in TURNS:
        for history in histories:
            history.append({"role": "user", "content": turn})
            reply = client.chat.completions.create(model="m", messages=history, max_tokens=12, temperature=0)
            history.append({"role": "assistant", "content": reply.choices[0].message.content})
            answers.append(reply.choices[0].message.content)
    return answers


@pytest.mark.slow
@pytest.mark.parametrize("exact", [True, False], ids=["exact", "packed"])
def test_a_resent_history_reuses_its_cache_and_answers_the_same(model: Path, exact: bool) -> None:  # noqa: F811
    if not exact and not cpu_kernels.available():
        pytest.skip("the native CPU kernels are not built (scripts/bootstrap.sh builds them)")
    cached = Served(model, "--max-batch", "2", "--api-key", KEY, exact=exact)
    try:
        with_cache = _replay(cached)
        hits = cached.metric('ntransformer_prefix_cache_requests_total{result="hit"}')
        reused = cached.metric('ntransformer_prefix_cache_tokens_total{kind="reused"}')
        computed = cached.metric('ntransformer_prefix_cache_tokens_total{kind="computed"}')
    finally:
        assert cached.stop() == 0
    plain = Served(model, "--max-batch", "2", "--api-key", KEY, "--no-prefix-cache", exact=exact)
    try:
        without = _replay(plain)
        assert plain.metric('ntransformer_prefix_cache_requests_total{result="hit"}') == 0
        plain_computed = plain.metric('ntransformer_prefix_cache_tokens_total{kind="computed"}')
    finally:
        assert plain.stop() == 0
    assert with_cache == without
    # every turn after a conversation's first finds its own history (2 x 4 turns); B's first turn
    # does not take A's cache for the few tokens of template they open with; what was reused is what
    # was not run again (the replies run again: only prompt rows are kept, docs/SERVER.md)
    assert hits == 2 * (len(TURNS) - 1)
    assert reused + computed == plain_computed and reused > computed


def test_the_chat_replay_bench_compares_cache_on_and_off(model: Path, tmp_path: Path) -> None:  # noqa: F811
    """bench.server_bench --chat-turns: the same replay with and without the cache; same answers."""
    import json

    from bench import server_bench

    out = tmp_path / "chat.json"
    assert server_bench.main(["--model", str(model), "--device", "cpu", "--exact", "--chat-turns", "3",
                              "--tokens", "4", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["answers_identical"] and len(result["prefix_cache"]["ttft_s"]) == 3
    assert result["prefix_cache"]["prefix_tokens_reused"] > 0 == result["no_prefix_cache"]["prefix_tokens_reused"]
    assert result["ttft_ratio_on_off"] > 0


def test_the_cache_is_on_by_default_only_where_it_changes_no_answer() -> None:
    """The GPU, the exact CPU engine and the packed native one give a position the same numbers however
    a prompt is split into passes; the NumPy engine's float32 BLAS products do not, so there the cache
    is off unless asked for."""
    from types import SimpleNamespace

    from infer.server.scheduler import split_invariant

    assert split_invariant(SimpleNamespace(device="gpu"))  # type: ignore[arg-type]
    assert split_invariant(SimpleNamespace(device="cpu", exact=True))  # type: ignore[arg-type]
    assert not split_invariant(SimpleNamespace(device="cpu", exact=False))  # type: ignore[arg-type]
    packed = SimpleNamespace(batch_invariant=True)
    assert split_invariant(SimpleNamespace(device="cpu", exact=False, weights=packed))  # type: ignore[arg-type]
    mixed = SimpleNamespace(batch_invariant=False)  # a matrix the kernels do not take
    assert not split_invariant(SimpleNamespace(device="cpu", exact=False, weights=mixed))  # type: ignore[arg-type]
