"""Small uploads by the SMs (infer/gpu/uploads.py, NVMEDIRECT_SM_UPLOADS=1) on the NumPy stand-in
of CuPy: the kernel is the one launched, the bytes land, and greedy speculation on the GPU engine
(pass indexes and the tree cache's accepted nodes through it) gives plain decoding's tokens.
tests/gpu/test_uploads.py runs the kernel on a GPU."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from infer.synth import Shape, write_model

SHAPE = Shape(n_layers=3, dim=256, ffn_dim=512, n_heads=4, n_kv_heads=2, vocab_size=300, context_length=256)


@pytest.mark.parametrize("sms", [False, True])
def test_an_upload_lands_by_the_engine_or_by_the_sms(fake_cupy, monkeypatch: pytest.MonkeyPatch, sms: bool) -> None:  # noqa: ANN001
    from infer.gpu import kernels, uploads

    monkeypatch.setenv("NVMEDIRECT_SM_UPLOADS", "1" if sms else "0")
    host = np.arange(1000, dtype=np.int32)
    device = fake_cupy.zeros(1000, fake_cupy.int32)
    launched = kernels.record_launches()
    try:
        uploads.copy_from_host(device.data.ptr, host.ctypes.data, 4 * 999, fake_cupy.cuda.Stream())
    finally:
        kernels.stop_recording()
    np.testing.assert_array_equal(fake_cupy.asnumpy(device), np.r_[host[:999], 0])
    assert (("ops", "copy_words_from_host", ()) in launched) == sms
    if sms:
        with pytest.raises(ValueError, match="4-byte words"):
            uploads.copy_from_host(device.data.ptr, host.ctypes.data, 6, fake_cupy.cuda.Stream())


def test_a_host_stage_grows_and_keeps_each_put(fake_cupy, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    from infer.gpu import uploads

    monkeypatch.setenv("NVMEDIRECT_SM_UPLOADS", "1")
    stage, stream = uploads.HostStage(), fake_cupy.cuda.Stream()
    small = stage.put(np.array([5, -7, 9], np.int64), stream)
    np.testing.assert_array_equal(fake_cupy.asnumpy(small), [5, -7, 9])
    big = np.random.default_rng(0).integers(-(2**40), 2**40, 3000)
    np.testing.assert_array_equal(fake_cupy.asnumpy(stage.put(big, stream)), big)
    assert stage.nbytes >= big.nbytes
    with pytest.raises(ValueError, match="4- or 8-byte"):
        stage.put(np.zeros(3, np.int16), stream)


def test_speculation_with_uploads_by_the_sms_gives_plain_tokens(tmp_path: Path, fake_cupy,  # noqa: ANN001
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from infer.engine import greedy
    from infer.gguf_file import GGUFModel
    from infer.gpu import kernels, load_gpu_transformer
    from infer.speculative import ModelDrafter, Speculator

    target_file, draft_file = tmp_path / "m.gguf", tmp_path / "d.gguf"
    write_model(target_file, SHAPE, "q4_k_m", seed=8)
    write_model(draft_file, Shape(**{**SHAPE.__dict__, "n_layers": 1}), "q4_k_m", seed=8)
    prompt = [int(t) for t in np.random.default_rng(3).integers(3, SHAPE.vocab_size, 20)]
    monkeypatch.setenv("NVMEDIRECT_SM_UPLOADS", "0")
    model = load_gpu_transformer(GGUFModel(target_file), 128, batch=4, tree_nodes=16)
    want = list(model.generate(np.asarray(prompt), model.new_cache(128), 24))

    monkeypatch.setenv("NVMEDIRECT_SM_UPLOADS", "1")
    draft = load_gpu_transformer(GGUFModel(draft_file), 128, batch=4)
    spec = Speculator(model, ModelDrafter(draft, 128, depth=3, width=3), 10, 128)
    launched = kernels.record_launches()
    try:
        got = list(spec.generate(prompt, 24, greedy, cache=model.new_cache(128)))
    finally:
        kernels.stop_recording()
    assert got == want
    assert ("ops", "copy_words_from_host", ()) in launched  # the pass indexes went through the SMs


def test_a_tree_cache_keeps_the_same_nodes_through_the_sms(tmp_path: Path, fake_cupy,  # noqa: ANN001
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """GpuKVCache.accept of a path that skips nodes (a sibling kept): the same keys and values
    with its indices uploaded by the SMs as by the copy engine."""
    from infer.gguf_file import GGUFModel
    from infer.gpu import load_gpu_transformer

    file = tmp_path / "m.gguf"
    write_model(file, SHAPE, "q4_k_m", seed=8)
    model = load_gpu_transformer(GGUFModel(file), 128, batch=4, tree_nodes=16)
    cache = model.new_cache(128)
    model.forward(np.arange(3, 15), cache)
    model.verify_tree(np.array([20, 21, 22, 23, 24]), np.array([-1, 0, 0, 2, 2]), cache)
    caches = {}
    for sms in ("0", "1"):
        monkeypatch.setenv("NVMEDIRECT_SM_UPLOADS", sms)
        caches[sms] = model.new_cache(128)
        caches[sms].copy_from(cache)
        caches[sms].accept([0, 2, 4])
        assert caches[sms].length == cache.length + 3
    assert caches["1"].stage is not None and caches["0"].stage is None
    for group in ("full", "ring"):
        for part in ("keys", "values"):
            a, b = (getattr(getattr(caches[k], group), part) for k in ("0", "1"))
            np.testing.assert_array_equal(fake_cupy.asnumpy(a), fake_cupy.asnumpy(b))
    moved = fake_cupy.asnumpy(caches["1"].full.keys)[:, :, 12:15]
    kept = fake_cupy.asnumpy(cache.full.keys)[:, :, [12, 14, 16]]
    np.testing.assert_array_equal(moved, kept)
