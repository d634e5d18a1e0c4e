"""bench.spec_bench e2e (the H200 measurement of issue 14) run on the NumPy stand-in for CuPy with a
synthetic target/draft pair: the target streamed with about half its layer bytes in tier B, the
draft resident, and every speculative output the plain engine's. It proves the benchmark's
orchestration and the exactness of verify_tree's orchestration, not speed (tests/fake_cupy.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from infer.synth import Shape, write_model

SHAPE = Shape(n_layers=8, dim=256, ffn_dim=768, n_heads=4, n_kv_heads=2, vocab_size=600, context_length=512)


def test_e2e_outputs_identical_and_half_streamed(tmp_path: Path, fake_cupy: object,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from bench import spec_bench

    target, draft = tmp_path / "t-q4_k_m.gguf", tmp_path / "d-q4_k_m.gguf"
    write_model(target, SHAPE, "q4_k_m", seed=3)
    write_model(draft, SHAPE, "q4_k_m", seed=3)  # the same weights: a draft that is nearly always right
    monkeypatch.setattr(spec_bench, "humaneval_prompts", lambda n: (["def add(a, b):", "x = [1, 2, 3]\nfor"] * 20)[:n])
    result = spec_bench.e2e(spec_bench.main.__globals__["argparse"].Namespace(
        target=target, draft=draft, prompt_set="humaneval", prompts=2, tokens=12, shapes="4x2,auto,best:3x2,auto-best:3,self:3,skip=0.5:3", resident_fraction=0.75, draft_budget=None,
        ctx=128, slots=2))
    for name in ("4x2", "auto", "best:3x2", "auto-best:3", "self:3", "skip=0.5:3"):
        assert result["shapes"][name]["all_identical"], result["rows"]
    for name in ("4x2", "auto", "best:3x2", "auto-best:3"):
        assert result["shapes"][name]["tokens_per_pass"] > 1.5, name
    self_draft = result["shapes"]["self:3"]
    assert 0 < self_draft["draft_layers"] < SHAPE.n_layers
    assert self_draft["target_perplexity"] > 0 and self_draft["draft_perplexity"] > 0
    assert result["prompts"] == 2
    tiers = result["plan_bytes_by_tier"]
    assert tiers["RAM"] > 0 and tiers["VRAM"] > 0, tiers


def test_a_device_allocation_past_the_budget_is_one_line(fake_cupy, monkeypatch: pytest.MonkeyPatch,  # noqa: ANN001
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """A bench run whose device allocation fails under the VRAM budget prints one line and exits 2
    (the 3 GB verify run of 2026-12-02 ended in a CuPy traceback)."""
    import bench.spec_bench as spec_bench

    def out_of_memory(args: object) -> dict:
        raise fake_cupy.cuda.memory.OutOfMemoryError("Out of memory allocating 20,971,520 bytes")

    monkeypatch.setattr(spec_bench, "verify", out_of_memory)
    assert spec_bench.main(["verify", "--synth", "tiny:q4_k_m"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: out of device memory") and "raise the budget" in err[0]


def test_prose_prompts_are_chat_turns_of_the_recorded_requests() -> None:
    """The prose set is the 40 requests of bench/prompts/prose_questions.txt, each one user turn of the
    model's own chat template (Qwen's ChatML, with its default system turn), ready for the reply."""
    from bench import spec_bench
    from infer.gguf_file import GGUFModel
    from infer.tokenizer import Tokenizer
    from tests.oracle.assets import qwen05b_path

    path = qwen05b_path()
    if not path.exists():
        pytest.skip("Qwen2.5-Coder 0.5B missing: run scripts/fetch-models.sh")
    gguf = GGUFModel(path)
    tokenizer = Tokenizer.from_gguf(gguf.metadata)
    requests = spec_bench.prose_prompts(40)
    assert len(requests) == len(set(requests)) == 40
    ids = spec_bench.prompt_ids("prose", 40, tokenizer, gguf.metadata)
    text = tokenizer.decode(ids[7])  # the special tokens are not shown
    assert text.startswith("system\n") and text.endswith("\nuser\n" + requests[7] + "\nassistant\n")
    start = tokenizer.encode("<|im_start|>", special=True)
    assert len(start) == 1 and ids[7].count(start[0]) == 3  # special tokens parsed, not spelled out
    with pytest.raises(SystemExit, match="has 40 prompts"):
        spec_bench.prose_prompts(41)
