"""`ntransformer` end to end on the real SmolLM2 file: generation, chat through stdin, benchmark,
perplexity (against llama.cpp), streaming equal to resident, and --device gpu without a GPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from infer.cli import main
from tests.oracle.assets import botchan_path
from tests.oracle.fixtures import model_path, require_asset

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return model_path("smollm2-Q4_1")


def invoke(args: list[str], stdin: str | None = None) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, args, input=stdin)
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


def test_capital_of_france(smollm2: Path) -> None:
    code, out, err = invoke(["-m", str(smollm2), "-p", "The capital of France is", "-n", "16", "-t", "0"])
    print(out)
    assert code == 0, err
    assert "Paris" in out
    assert "tok/s" in err and "loaded" in err  # informational lines stay on stderr


def test_exact_numerics_generate_the_same_greedy_text_batched_or_not(smollm2: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--exact loads the CPU engine with float64 sums; its greedy ids do not depend on how the
    prompt is batched (the default float32 numerics may)."""
    from infer import api

    loaded = []
    real_load = api.LLM.load

    def spy(*args: object, **kwargs: object) -> api.LLM:
        llm = real_load(*args, **kwargs)
        loaded.append(llm)
        return llm

    monkeypatch.setattr(api.LLM, "load", spy)
    code, out, err = invoke(["-m", str(smollm2), "-p", "1, 2, 3, 4,", "-n", "8", "-t", "0", "--json", "--exact"])
    assert code == 0, err
    assert loaded and loaded[-1].transformer.exact
    ids = json.loads(out)["ids"]
    llm = loaded[-1]
    llm.engine.prefill_batch = 1  # the prompt token by token this time
    again = list(llm.generate_ids(llm.tokenize("1, 2, 3, 4,"), 8, stop_at_eog=False))
    assert again == ids


def test_json_output_carries_text_and_ids(smollm2: Path) -> None:
    code, out, _ = invoke(["-m", str(smollm2), "-p", "1, 2, 3, 4,", "-n", "8", "-t", "0", "--json"])
    assert code == 0
    record = json.loads(out)
    assert len(record["ids"]) == record["generated_tokens"] == 8
    assert record["text"].startswith(" 5")


def test_chat_holds_a_two_turn_conversation(smollm2: Path) -> None:
    first, second = "What is the capital of France? Answer in one word.", "Repeat my previous question."
    args = ["-m", str(smollm2), "--chat", "-t", "0", "-n", "40"]
    code, out, err = invoke(args, stdin=f"{first}\n{second}\n")
    print(out)
    assert code == 0, err
    first_reply, _, second_reply = out.partition("\n")
    assert "Paris" in first_reply and second_reply.strip()
    # the second answer depends on the first turn: asked alone, the same question gets another one
    code, alone, _ = invoke(args, stdin=f"{second}\n")
    assert code == 0 and alone.strip() and alone.strip() != second_reply.strip()


@pytest.mark.oracle
def test_gemma3_chat_speaks_in_gemmas_turns() -> None:
    """Gemma 3 270M's file has no chat template: --chat writes Gemma's turns (tests/infer/test_chat.py
    checks them against llama.cpp's), so its first reply is the greedy continuation of that text.
    The file is the pretrained model, not the instruction-tuned one: its replies are not answers."""
    from infer.api import LLM

    gemma3 = model_path("gemma3")
    question = "What is the capital of France?"
    code, out, err = invoke(["-m", str(gemma3), "--chat", "-t", "0", "-n", "12", "--device", "cpu"],
                            stdin=f"{question}\nAnd of Italy?\n")
    assert code == 0, err
    llm = LLM.load(gemma3, ctx_size=512)
    turn = llm.tokenizer.encode(f"<start_of_turn>user\n{question}<end_of_turn>\n<start_of_turn>model\n",
                                add_bos=True, special=True)
    first = llm.detokenize(list(llm.generate_ids(turn, 12)))
    print(out)
    assert first.strip() and out.startswith(first.strip())
    assert len(out.strip()) > len(first.strip())  # and a second reply


def test_benchmark_reports_tokens_per_second(smollm2: Path) -> None:
    code, out, _ = invoke(["-m", str(smollm2), "--benchmark", "-n", "8", "--json", "--device", "cpu"])
    assert code == 0
    record = json.loads(out)
    assert record["tg_tokens"] == 8 and record["pp_tokens"] == 128
    assert record["tg_tok_s"] > 0 and record["pp_tok_s"] > 0 and record["peak_rss_bytes"] > 0
    code, out, _ = invoke(["-m", str(smollm2), "--benchmark", "-n", "4", "--device", "cpu"])
    # one table: one figure per measurement (the old output printed two different speeds)
    assert code == 0 and out.count("tok/s") == 2 and "pp128:" in out and "tg4:" in out


def test_streaming_prints_the_same_text_as_resident(smollm2: Path) -> None:
    args = ["-m", str(smollm2), "-p", "The capital of France is", "-n", "8", "-t", "0", "--device", "cpu"]
    code, resident, _ = invoke(args)
    assert code == 0
    code, streamed, err = invoke([*args, "--streaming"])
    assert code == 0, err
    assert streamed.strip() == resident.strip()
    # plain --streaming on a model that fits picks small budgets so every tier carries weights
    for tier in ("tier A (VRAM)", "tier B (RAM)", "tier C (storage)"):
        line = next(x for x in err.splitlines() if tier in x)
        assert " 0 tensors" not in line, line


def test_gpu_device_is_refused_clearly(smollm2: Path) -> None:
    from infer.gpu import gpu_available

    if gpu_available():
        pytest.skip("a GPU is present: --device gpu runs instead of being refused")
    code, _, err = invoke(["-m", str(smollm2), "--device", "gpu", "-p", "Hello", "-n", "2"])
    assert code == 4 and len(err.strip().splitlines()) == 1 and "GPU" in err


def test_usage_errors_exit_2(smollm2: Path, tmp_path: Path) -> None:
    assert invoke(["-p", "Hello"])[0] == 2  # no model
    assert invoke(["-m", str(smollm2)])[0] == 2  # nothing to do
    assert invoke(["-m", str(smollm2), "-p", "x", "--top-p", "0"])[0] == 2
    assert invoke(["perplexity", "-m", str(smollm2), "-f", str(tmp_path / "none.txt")])[0] == 2


@pytest.mark.oracle
def test_perplexity_command_tokenizes_like_llama_cpp(smollm2: Path) -> None:
    """The command tokenizes the whole file as llama.cpp does (same token count) and reports the
    engine's perplexity of those tokens (the API's number, the same float32 arithmetic: equal). How
    close the engine's perplexity is to llama.cpp's is tests/infer/test_oracle.py's question, over
    enough chunks for its 1% bar: two chunks would leave about +-1% of rounding noise."""
    from infer.api import LLM
    from tests.oracle.reference import Reference

    text_file = require_asset(botchan_path())
    code, out, err = invoke(["perplexity", "-m", str(smollm2), "-f", str(text_file), "-c", "256", "--chunks", "2",
                             "--json"])
    assert code == 0, err
    record = json.loads(out)
    ref = Reference(smollm2)
    try:
        tokens = ref.tokenize(text_file.read_bytes().decode("utf-8"))
    finally:
        ref.close()
    assert record["tokens"] == len(tokens)  # our tokenizer agrees with llama.cpp's on the whole text
    expected = LLM.load(smollm2, ctx_size=256).perplexity(tokens, ctx=256, max_chunks=2)
    print(f"\nperplexity command {record['perplexity']:.4f}, the API {expected.perplexity:.4f}")
    assert record["chunks"] == 2
    assert record["perplexity"] == pytest.approx(expected.perplexity, rel=1e-12)
