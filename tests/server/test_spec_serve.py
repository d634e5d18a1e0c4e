"""`serve --draft-model` / `--lookup` on SmolLM2 Q8_0 (CPU, --exact): concurrent greedy clients get
the replies of the server without a draft, token for token, while every pass verifies the trees of
all running requests; /metrics counts the drafted and kept tokens; bad combinations exit 2 with one
line before anything listens."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.server.test_server import PROMPTS, REPO, Served, model  # noqa: F401 - the model fixture

N = 16


def _replies(server: Served, prompts: list[str]) -> list[str | None]:
    """Each prompt asked by its own client at once (half streamed), greedy."""
    client = server.client("x")
    out: list[str | None] = [None] * len(prompts)

    def ask(i: int) -> None:
        if i % 2:
            out[i] = client.completions.create(model="m", prompt=prompts[i], max_tokens=N, temperature=0).choices[0].text
        else:
            out[i] = "".join(c.choices[0].text for c in client.completions.create(
                model="m", prompt=prompts[i], max_tokens=N, temperature=0, stream=True) if c.choices)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_speculative_replies_equal_the_plain_server(model: Path) -> None:  # noqa: F811
    prompts = PROMPTS[:6] + ["one two three one two three one two three one two", "a b c d a b c d a b c d a b"]
    plain = Served(model, "--max-batch", "8")
    try:
        want = _replies(plain, prompts)
        plain_passes = plain.metric("ntransformer_pass_seconds_count")
    finally:
        assert plain.stop() == 0
    for flags in (["--draft-model", str(model), "--draft-tree", "5"], ["--draft-model", str(model), "--draft-shape", "3x1"],
                  ["--lookup"]):
        served = Served(model, "--max-batch", "8", *flags)
        try:
            assert _replies(served, prompts) == want, flags
            drafted = served.metric('ntransformer_draft_tokens{kind="drafted"}')
            kept = served.metric('ntransformer_draft_tokens{kind="accepted"}')
            assert drafted > 0 and 0 < kept <= drafted, (flags, drafted, kept)
            if flags[0] == "--draft-model":  # the target drafting for itself: its chain (2 of 4 nodes) kept
                assert served.metric("ntransformer_pass_seconds_count") <= 0.6 * plain_passes
            assert served.metric("ntransformer_active_requests") == 0
        finally:
            assert served.stop() == 0


@pytest.mark.parametrize("flags, says", [
    (["--lookup", "--draft-model", "{model}"], "two drafters"),
    (["--draft-tree", "5"], "add one of them"),
    (["--draft-shape", "4x2"], "add one of them"),
    (["--draft-model", "{model}", "--draft-shape", "4x0"], "DEPTHxWIDTH"),
    (["--lookup", "--draft-shape", "4x2"], "not with --lookup or --draft-tree"),
    (["--lookup", "--no-exact"], "needs an engine whose logits do not depend"),
    (["--draft-model", "{other}"], "vocabulary differs"),
])
def test_serve_refuses_bad_speculation_flags_with_one_line(model: Path, tmp_path: Path, flags: list[str],  # noqa: F811
                                                            says: str) -> None:
    from infer.synth import SHAPES, write_model

    other = tmp_path / "other.gguf"
    write_model(other, SHAPES["tiny"], "q8_0", seed=1)
    exact = [] if "--no-exact" in flags else ["--exact"]
    flags = [f.format(model=model, other=other) for f in flags if f != "--no-exact"]
    env = {**os.environ, "NVMEDIRECT_CPU_PRODUCTS": "numpy"}  # the engine speculation refuses without --exact
    done = subprocess.run([sys.executable, "-c", "from infer.cli import main; main()", "serve", "-m", str(model),
                           "--device", "cpu", *exact, *flags], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=env)
    assert done.returncode == 2, done.stderr
    assert says in done.stderr and "Traceback" not in done.stderr and done.stderr.strip().count("\n") == 0
