"""Drafting ahead on the GPU engine run on the NumPy stand-in for CuPy (tests/fake_cupy.py):
GpuTransformer.draft_branches (the branches in slots past the sequence's, moved on by sample_rows
without their base) gives the CPU loop's rows and leaves the sequence's cache as it was; speculation
drafting ahead makes the trees and text of drafting without. The real GPU runs the same checks in
tests/gpu/test_speculative_gpu.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.spec.test_draft_ahead import with_and_without_ahead
from tests.tiers.test_tiers_gpu_glue import CTX, SHAPE, gpu_session, model_path  # noqa: F401 (a fixture)


@pytest.mark.parametrize(("width", "lead"), [(1, 0), (3, 2)])
def test_gpu_glue_draft_branches_are_the_host_loop(model_path: Path, fake_cupy: object, width: int,  # noqa: F811
                                                   lead: int) -> None:
    from infer.draft_ahead import host_branches

    s = gpu_session(model_path, 0.4, 0.3)
    try:
        m = s.engine.model
        want = [int(t) for t in np.random.default_rng(11).integers(3, SHAPE.vocab_size, 9)]
        common = len(want) - lead
        device_cache, host_cache = m.new_cache(CTX), m.new_cache(CTX)
        for cache in (device_cache, host_cache):
            m.forward(np.asarray(want[:common]), cache)
        branches = [(5, len(want)), (7, len(want) - 2), (9, len(want) - 5)]
        got = m.draft_branches(device_cache, want[common:], branches, 4, width).ranked()
        expect, kept = host_branches(m, host_cache, want, common, branches, 4, width)
        assert np.array_equal(got, expect.ranked())
        assert device_cache.length == len(want)  # the lead fed; the branches' slots are past the sequence's
        fresh = m.new_cache(CTX)
        m.forward(np.asarray(want), fresh)
        assert np.array_equal(m.forward(np.array([3]), device_cache), m.forward(np.array([3]), fresh))
        with pytest.raises(ValueError, match="do not fit"):
            m.draft_branches(device_cache, [], branches, CTX, width)
    finally:
        s.close()


def test_gpu_glue_speculation_drafting_ahead_is_drafting_without(model_path: Path, fake_cupy: object) -> None:  # noqa: F811
    """The streamed target's file, resident, drafts (random weights agree with nothing else), so
    most walks end at the chain's end (or at a leaf, where a near tie falls the other way): with the
    branches drafted ahead, the same trees, passes and text as without, trees taken from the
    branches. A view of the target itself (a self-draft, its stream and buffers) drafts nothing ahead."""
    from infer.gguf_file import GGUFModel
    from infer.gpu import load_gpu_transformer
    from infer.layerskip import skipping
    from infer.speculative import ModelDrafter, Speculator

    s = gpu_session(model_path, 0.4, 0.3)
    try:
        m = s.engine.model
        draft = load_gpu_transformer(GGUFModel(model_path), CTX)
        assert Speculator(m, ModelDrafter(skipping(m, {0}), CTX, 3, 2, ahead=True), 7, CTX).drafter.ahead is None  # type: ignore[attr-defined]
        prompt = [int(t) for t in np.random.default_rng(12).integers(3, SHAPE.vocab_size, 7)]
        runs = with_and_without_ahead(m, draft, prompt, 24, 3, 2, CTX)
        assert runs[True].tokens == runs[False].tokens and runs[True].trees == runs[False].trees
        assert runs[True].tokens == m.generate(np.asarray(prompt), m.new_cache(CTX), 24)
        ahead = runs[True].ahead
        assert ahead.launched == len(runs[True].trees) and ahead.hits > len(runs[True].trees) // 2, ahead.as_dict()
    finally:
        s.close()
