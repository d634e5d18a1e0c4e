"""The packed CPU engine's weights on huge pages (infer.host_memory): the copy holds the file's bytes
at the file's alignment, when it is made and when not, and the engine's logits do not change."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from infer import cpu_kernels, host_memory
from infer.gguf_file import GGUFModel
from infer.host_memory import HugePageCopy
from infer.model import load_transformer
from tests.oracle.fixtures import model_path


def _file(tmp_path: Path, nbytes: int) -> tuple[Path, np.ndarray]:
    data = np.random.default_rng(3).integers(0, 256, nbytes, dtype=np.uint8)
    path = tmp_path / "blob.bin"
    data.tofile(path)
    return path, data


def test_the_copy_holds_the_files_bytes_of_each_range(tmp_path: Path) -> None:
    path, data = _file(tmp_path, (5 << 20) + 12345)
    ranges = [(4096 + 17, 100_000), (7, 3), (3 << 20, (2 << 20) + 12000)]  # any order, gaps between
    copy = HugePageCopy(path, ranges, threads=3)
    assert copy.nbytes == sum(n for _, n in ranges)
    for offset, n in ranges + [(4096 + 17 + 5, 1000), (3 << 20, 0)]:
        view = copy.view(offset, n)
        np.testing.assert_array_equal(view, data[offset:offset + n])
        if n:  # each range at a cache line (an empty view's address means nothing)
            assert (view.ctypes.data - (offset - max(o for o, _ in ranges if o <= offset))) % 64 == 0
    with pytest.raises(ValueError, match="read-only"):
        copy.view(7, 2)[0] = 1
    for offset, n in ((6, 2), (8, 3), (4096 + 17 + 99_999, 2), ((5 << 20) + 12000, 1)):  # outside, or across an end
        with pytest.raises(ValueError, match="not inside one copied range"):
            copy.view(offset, n)


def test_a_range_larger_than_a_chunk_is_read_in_pieces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_memory, "READ_CHUNK", 1 << 16)  # many pieces over two threads
    path, data = _file(tmp_path, (3 << 20) + 7)
    copy = HugePageCopy(path, [(1, data.size - 1)], threads=2)
    np.testing.assert_array_equal(copy.view(1, data.size - 1), data[1:])


def test_a_file_shorter_than_the_range_is_an_error(tmp_path: Path) -> None:
    path, data = _file(tmp_path, 1 << 20)
    with pytest.raises(OSError, match="the file ended at byte 1048576"):
        HugePageCopy(path, [(0, data.size + 4096)])


@pytest.mark.skipif(not host_memory.transparent_huge_pages(), reason="the kernel offers no transparent huge pages")
def test_the_kernel_places_the_copy_on_huge_pages(tmp_path: Path) -> None:
    path, data = _file(tmp_path, 8 << 20)
    copy = HugePageCopy(path, [(0, data.size)])
    assert copy.huge_bytes() >= 4 << 20  # at least the two whole 2 MiB pages inside any 8 MiB placement


def test_when_the_copy_is_made(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_memory, "transparent_huge_pages", lambda: True)
    monkeypatch.setattr(host_memory, "available_memory", lambda: 10 << 30)
    monkeypatch.delenv("NVMEDIRECT_HUGE_PAGES", raising=False)
    assert host_memory.should_copy(5 << 30)
    assert not host_memory.should_copy((5 << 30) + 1)  # more than half of what is available: stays mapped
    assert not host_memory.should_copy(0)
    monkeypatch.setenv("NVMEDIRECT_HUGE_PAGES", "off")
    assert not host_memory.should_copy(1 << 20)
    monkeypatch.setenv("NVMEDIRECT_HUGE_PAGES", "yes")
    with pytest.raises(ValueError, match="NVMEDIRECT_HUGE_PAGES='yes'"):
        host_memory.should_copy(1 << 20)
    monkeypatch.setenv("NVMEDIRECT_HUGE_PAGES", "auto")
    monkeypatch.setattr(host_memory, "transparent_huge_pages", lambda: False)
    assert not host_memory.should_copy(1 << 20)


@pytest.mark.skipif(not cpu_kernels.available(), reason="native CPU kernels not built")
def test_the_engine_on_the_copy_gives_the_same_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Same bytes, same kernels: the logits of a prompt and of decoded tokens are the same bits with
    the weights copied to huge pages and read from the map."""
    path = model_path("smollm2-Q4_K_M")
    monkeypatch.setattr(host_memory, "transparent_huge_pages", lambda: True)  # the copy even where THP is off
    gguf = GGUFModel(path)
    copied = load_transformer(gguf, packed=True)
    assert copied.weights.huge_pages is not None
    monkeypatch.setenv("NVMEDIRECT_HUGE_PAGES", "off")
    mapped = load_transformer(GGUFModel(path), packed=True)
    assert mapped.weights.huge_pages is None
    layer = copied.weights.layer(3).ffn_down.parts[0][0]
    assert not np.shares_memory(layer, gguf.data)
    tokens = np.array([1, 504, 3287, 314, 260, 1345, 28, 411, 253, 2401])
    results = []
    for model in (copied, mapped):
        cache = model.new_cache(32)
        prompt = model.forward(tokens[:-2], cache, all_logits=True)
        steps = [model.forward(tokens[i:i + 1], cache) for i in (8, 9)]
        results.append((prompt, *steps))
    for a, b in zip(*results, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.skipif(not cpu_kernels.available(), reason="native CPU kernels not built")
def test_the_copy_takes_the_embeddings_only_when_they_are_the_output(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A file with its own output matrix reads embedding rows from the map and multiplies the output:
    only the latter is copied. SmolLM2 ties them: the embeddings are its output product."""
    from infer.synth import SHAPES, write_model

    monkeypatch.setattr(host_memory, "transparent_huge_pages", lambda: True)
    path = tmp_path / "tiny.gguf"
    write_model(path, SHAPES["tiny"], "q8_0", seed=4)
    untied = GGUFModel(path)
    copy = load_transformer(untied, packed=True).weights.huge_pages
    assert copy is not None
    out, embd = untied.tensors["output.weight"], untied.tensors["token_embd.weight"]
    np.testing.assert_array_equal(copy.view(out.offset, out.nbytes), out.data)
    with pytest.raises(ValueError, match="not inside one copied range"):
        copy.view(embd.offset, embd.nbytes)
    tied = GGUFModel(model_path("smollm2-Q4_K_M"))
    assert "output.weight" not in tied.tensors
    embd = tied.tensors["token_embd.weight"]
    copy = load_transformer(tied, packed=True).weights.huge_pages
    np.testing.assert_array_equal(copy.view(embd.offset, embd.nbytes), embd.data)


def test_slots_are_handed_out_aligned_and_taken_back() -> None:
    """An arena of 3 slots of 1000 bytes: each at a 64-byte boundary, apart from the others, the
    lowest first; a fourth is refused until one comes back, and that one is handed out again."""
    from infer.host_memory import HugePageSlots

    slots = HugePageSlots(3, 1000)
    taken = [slots.take() for _ in range(3)]
    assert [s for s, _ in taken] == [0, 1, 2] and slots.free == 0
    for _, place in taken:
        assert place.nbytes == 1000 and place.ctypes.data % 64 == 0
        place[:] = 7
    assert taken[1][1].ctypes.data - taken[0][1].ctypes.data == slots.stride == 1024
    with pytest.raises(ValueError, match="all 3 slots are taken"):
        slots.take()
    slots.give(1)
    again, place = slots.take()
    assert again == 1 and place.ctypes.data == taken[1][1].ctypes.data
    with pytest.raises(ValueError, match="holds nothing"):
        HugePageSlots(0, 10)
