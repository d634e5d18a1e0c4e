"""Constrained decoding through llguidance, without a model: random logits drawn under a JSON
schema's constraint always spell JSON that matches it, the mask bans what would break it, and a
schema llguidance cannot compile is a GrammarError. On a BPE vocabulary (SmolLM2), a real
sentencepiece one (Gemma 3) and the synthetic models' byte-level sentencepiece vocabulary, whose
leading space once made every JSON request fail on the GPU machine's soak."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from infer.gguf_file import GGUFModel
from infer.grammar import GrammarError, json_constraint
from infer.sampler import Sampler, SamplerConfig
from infer.synth import SHAPES, write_model
from infer.tokenizer import Tokenizer
from tests.oracle.assets import gemma3_path, smollm2_path

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
                                           "ok": {"type": "boolean"}},
          "required": ["id", "tags", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module", params=["smollm2", "gemma3", "synthetic-spm"])
def tokenizer(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    if request.param == "synthetic-spm":
        path = tmp_path_factory.mktemp("synth") / "tiny.gguf"
        write_model(path, SHAPES["tiny"], "q8_0")
    else:
        path = smollm2_path("Q8_0") if request.param == "smollm2" else gemma3_path()
        if not path.exists():
            pytest.skip(f"{path} missing: run scripts/fetch-models.sh")
    return Tokenizer.from_gguf(GGUFModel(path).metadata)


def test_the_synthetic_vocabulary_puts_a_space_in_front(tmp_path: Path) -> None:
    """The case the parametrized tests guard: a vocabulary that adds sentencepiece's leading space
    (llguidance must tokenize forced text without it)."""
    path = tmp_path / "tiny.gguf"
    write_model(path, SHAPES["tiny"], "q8_0")
    tokenizer = Tokenizer.from_gguf(GGUFModel(path).metadata)
    assert tokenizer.vocab.add_space_prefix
    assert len(tokenizer.encode("{", add_bos=False)) == 2 and len(tokenizer.encode("{", add_bos=False, continues=True)) == 1


def _draw(tokenizer: Tokenizer, schema: dict | None, seed: int, limit: int = 200,
          temperature: float = 1.0) -> tuple[str, bool]:
    """Tokens drawn from random logits under the constraint until an end-of-generation token."""
    rng = np.random.default_rng(seed)
    constraint = json_constraint(tokenizer, schema)
    sampler = Sampler(SamplerConfig(temperature=temperature, top_k=0, top_p=1.0, min_p=0.0, seed=seed), constraint)
    ids: list[int] = []
    for _ in range(limit):
        token = sampler.sample(rng.normal(scale=3.0, size=tokenizer.vocab_size).astype(np.float32))
        if tokenizer.is_eog(token) or constraint.finished:
            if not tokenizer.is_eog(token):
                ids.append(token)
            return tokenizer.decode(ids), True
        ids.append(token)
    return tokenizer.decode(ids), False


def test_random_draws_under_a_schema_are_valid_json(tokenizer: Tokenizer) -> None:
    for seed in range(8):
        text, ended = _draw(tokenizer, SCHEMA, seed)
        assert ended, text
        value = json.loads(text)
        assert set(value) == {"id", "tags", "ok"} and isinstance(value["ok"], bool)
        assert 0 <= value["id"] <= 999 and len(value["tags"]) <= 3 and set(value["tags"]) <= {"a", "b"}


def test_any_object_without_a_schema(tokenizer: Tokenizer) -> None:
    ended = 0
    for seed in range(4):
        text, done = _draw(tokenizer, None, seed, limit=400)
        if done:
            ended += 1
            assert isinstance(json.loads(text), dict)
        else:  # random logits may keep writing a string: still a JSON prefix
            assert text.startswith("{")
    assert ended


def test_greedy_choices_under_any_object_are_json(tokenizer: Tokenizer) -> None:
    """The server soak's JSON request: greedy, response_format json_object."""
    for seed in range(3):
        text, done = _draw(tokenizer, None, seed, limit=60, temperature=0.0)
        assert text.startswith("{") and (not done or isinstance(json.loads(text), dict)), text


def test_the_mask_bans_what_would_break_the_schema(tokenizer: Tokenizer) -> None:
    constraint = json_constraint(tokenizer, SCHEMA)
    allowed = constraint.allowed(tokenizer.vocab_size + 64)  # padded logits past the vocabulary stay banned
    assert not allowed[tokenizer.vocab_size:].any()
    texts = {tokenizer.token_bytes(int(i)) for i in np.flatnonzero(allowed)}  # bytes: decode() drops a leading space
    assert texts and all(t.startswith(b"{") or b"{".startswith(t) for t in texts), sorted(texts)[:20]
    assert not any(allowed[i] for i in tokenizer.eot_ids)  # nothing may end an empty object


@pytest.mark.parametrize("schema", [{"type": "no-such-type"}, {"type": "object", "properties": 5}])
def test_a_schema_that_does_not_compile_is_a_grammar_error(tokenizer: Tokenizer, schema: dict) -> None:
    with pytest.raises(GrammarError, match="schema"):
        json_constraint(tokenizer, schema)


def test_an_llguidance_that_takes_one_end_token_still_works(monkeypatch: pytest.MonkeyPatch) -> None:
    """llguidance 1.6.1 (the newest wheel for glibc 2.28, the GPU machine's) takes eos_token as one
    id: a list there was a TypeError, each JSON request a 500. The tokenizer falls back to one id."""
    import llguidance

    real = llguidance.LLTokenizer
    given: list[object] = []

    def one_end_token(*args: object, eos_token: object = None, **kwargs: object) -> object:
        given.append(eos_token)
        if isinstance(eos_token, list):
            raise TypeError("argument 'eos_token': 'list' object cannot be interpreted as an integer")
        return real(*args, eos_token=eos_token, **kwargs)

    monkeypatch.setattr(llguidance, "LLTokenizer", one_end_token)
    fresh = Tokenizer.from_gguf(GGUFModel(smollm2_path("Q8_0")).metadata)  # not in the per-tokenizer cache
    text, ended = _draw(fresh, SCHEMA, seed=1)
    assert ended and set(json.loads(text)) == {"id", "tags", "ok"}
    assert isinstance(given[0], list) and given[1] == fresh.eos_id
