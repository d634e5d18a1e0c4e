"""The sampler's filters against llama.cpp's own sampler chain (penalties -> top-k -> top-p ->
min-p -> temperature), applied to the same random logits: the surviving tokens and their
probabilities must agree. (The final random draw cannot be compared: llama.cpp uses its own RNG.)"""

from __future__ import annotations

import numpy as np
import pytest

from infer.sampler import Sampler, SamplerConfig

VOCAB = 300


def _llama_cpp_candidates(logits: np.ndarray, history: list[int], config: SamplerConfig) -> dict[int, float]:
    import llama_cpp

    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    try:
        for sampler in (
            llama_cpp.llama_sampler_init_penalties(VOCAB, config.repeat_last_n, config.repeat_penalty, 0.0, 0.0),
            llama_cpp.llama_sampler_init_top_k(config.top_k),
            llama_cpp.llama_sampler_init_top_p(config.top_p, 1),
            llama_cpp.llama_sampler_init_min_p(config.min_p, 1),
            llama_cpp.llama_sampler_init_temp(config.temperature),
        ):
            llama_cpp.llama_sampler_chain_add(chain, sampler)
        for token in history:
            llama_cpp.llama_sampler_accept(chain, token)
        data = (llama_cpp.llama_token_data * VOCAB)(
            *(llama_cpp.llama_token_data(i, float(v), 0.0) for i, v in enumerate(logits))
        )
        candidates = llama_cpp.llama_token_data_array(data, VOCAB, -1, False)
        llama_cpp.llama_sampler_apply(chain, llama_cpp.ctypes.byref(candidates))
        kept = {data[i].id: data[i].logit for i in range(candidates.size)}
    finally:
        llama_cpp.llama_sampler_free(chain)
    ids = np.array(list(kept))
    scaled = np.array([kept[i] for i in ids], dtype=np.float64)
    probs = np.exp(scaled - scaled.max())
    return dict(zip(ids.tolist(), (probs / probs.sum()).tolist(), strict=True))


CONFIGS = [
    SamplerConfig(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, repeat_penalty=1.3, repeat_last_n=16),
    SamplerConfig(temperature=1.0, top_k=0, top_p=0.5, min_p=0.0, repeat_penalty=1.0),
    SamplerConfig(temperature=1.3, top_k=0, top_p=1.0, min_p=0.2, repeat_penalty=2.0, repeat_last_n=64),
    # nothing filtered: every penalized logit, negative ones included, is compared
    SamplerConfig(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.5, repeat_last_n=64),
    SamplerConfig(temperature=0.5, top_k=5, top_p=1.0, min_p=0.0, repeat_penalty=1.1, repeat_last_n=4),
]


@pytest.mark.oracle
@pytest.mark.parametrize("config", CONFIGS, ids=range(len(CONFIGS)))
def test_filters_keep_what_llama_cpp_keeps(config: SamplerConfig) -> None:
    rng = np.random.default_rng(7)
    for _ in range(20):
        logits = (rng.normal(size=VOCAB) * 3).astype(np.float32)
        # a history that hits the most likely tokens (so the penalty changes the outcome) and others
        history = [int(t) for t in np.argsort(-logits)[:6]] + rng.integers(0, VOCAB, size=30).tolist()
        ids, probs = Sampler(config).distribution(logits, history)
        ours = dict(zip(ids.tolist(), probs.tolist(), strict=True))
        theirs = _llama_cpp_candidates(logits, history, config)
        assert set(ours) == set(theirs)
        np.testing.assert_allclose([ours[i] for i in theirs], list(theirs.values()), rtol=1e-4, atol=1e-7)
