"""Small uploads by the SMs (infer/gpu/uploads.py, NVMEDIRECT_SM_UPLOADS=1) on a GPU: the kernel
against NumPy on random words, with the copy engine busy and idle, and a streamed model's prompt,
tree (a sibling kept) and decode steps giving the copy engine's bits.

Run on the H200:  .venv/bin/python -m pytest -v tests/gpu/test_uploads.py
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from infer.synth import write_model

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("busy", [False, True])
@pytest.mark.parametrize("words", [1, 255, 10_001, 300_000])
def test_the_upload_kernel_moves_numpys_words(words: int, busy: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    from infer.gpu import uploads

    monkeypatch.setenv("NVMEDIRECT_SM_UPLOADS", "1")
    rng = np.random.default_rng(words)
    pinned = cupy.cuda.alloc_pinned_memory(4 * words)
    host = np.frombuffer(pinned, np.uint32, words)
    host[:] = rng.integers(0, 2**32, words, dtype=np.uint64).astype(np.uint32)
    device = cupy.zeros(words + 1, cupy.uint32)
    copies, stream = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    if busy:  # 256 MB of bulk host-to-device copies queued first, as a ring's refills are
        bulk_pinned = cupy.cuda.alloc_pinned_memory(64 << 20)
        bulk = cupy.empty(64 << 20, cupy.uint8)
        for _ in range(4):
            cupy.cuda.runtime.memcpyAsync(bulk.data.ptr, bulk_pinned.ptr, 64 << 20,
                                          cupy.cuda.runtime.memcpyHostToDevice, copies.ptr)
    uploads.copy_from_host(device.data.ptr, host.ctypes.data, 4 * words, stream)
    stream.synchronize()
    np.testing.assert_array_equal(cupy.asnumpy(device[:words]), host)
    assert int(device[words]) == 0  # not a word past the end
    copies.synchronize()


def test_a_streamed_tree_round_gives_the_copy_engines_bits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.gpu.test_streaming import SHAPE, open_session

    path = tmp_path / "m.gguf"
    write_model(path, SHAPE, "q4_k_m", seed=5)
    prompt = np.random.default_rng(6).integers(3, SHAPE.vocab_size, 40)
    tree, parents = np.array([20, 21, 22, 23, 24]), np.array([-1, 0, 0, 2, 2])
    runs = {}
    for sms in ("0", "1"):
        monkeypatch.setenv("NVMEDIRECT_SM_UPLOADS", sms)
        s = open_session(path, 0.3, 1.5, tier_b="pinned")
        try:
            m = s.engine.model
            cache = m.new_cache(320)
            out = [m.forward(prompt, cache)]
            out.append(m.verify_tree(tree, parents, cache).to_host())
            cache.accept([0, 2, 4])
            out += [m.forward(np.array([t]), cache) for t in (5, 77, 1999)]
            runs[sms] = [np.asarray(o) for o in out]
        finally:
            s.close()
    for a, b in zip(runs["0"], runs["1"], strict=True):
        np.testing.assert_array_equal(a, b)
