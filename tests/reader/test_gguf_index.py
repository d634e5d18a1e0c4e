"""Our header parser (reading only through a backend) against the gguf package's own reader."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

from nvmedirect.reader import open_model
from nvmedirect.reader.gguf_index import GGUFFormatError, parse_gguf_header


def assert_same_tensors(path: Path) -> None:
    reference = GGUFReader(path)
    with open_model(path) as model:
        assert list(model.tensors) == [t.name for t in reference.tensors]
        for ref in reference.tensors:
            ours = model.tensors[ref.name]
            assert ours.type == ref.tensor_type
            assert list(ours.shape) == [int(d) for d in ref.shape]
            assert ours.offset == ref.data_offset
            assert ours.nbytes == ref.n_bytes
        return model.metadata


def test_smollm2_matches_gguf_reader(smollm2_path: Path) -> None:
    metadata = assert_same_tensors(smollm2_path)
    assert metadata["general.architecture"] == "llama"
    assert metadata["llama.block_count"] == 30
    assert len(metadata["tokenizer.ggml.tokens"]) == 49152
    assert len(metadata["tokenizer.ggml.merges"]) == 48900


def test_written_file_with_odd_alignment(tmp_path: Path) -> None:
    path = tmp_path / "odd.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.data_alignment = 64
    writer.add_uint32("general.alignment", 64)
    writer.add_array("test.floats", [1.5, 2.5])
    writer.add_array("test.strings", ["a", "bc"])
    rng = np.random.default_rng(0)
    writer.add_tensor("a", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("b", rng.standard_normal((7, 64)).astype(np.float16))
    q8 = rng.integers(0, 256, (4, 34 * 2), dtype=np.uint8)  # 4 rows of 64 Q8_0 values
    writer.add_tensor("c", q8, raw_dtype=GGMLQuantizationType.Q8_0)  # shape given in bytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    metadata = assert_same_tensors(path)
    assert metadata["test.strings"] == ["a", "bc"]
    assert metadata["test.floats"] == pytest.approx([1.5, 2.5])
    with open_model(path) as model:
        assert model.index.alignment == 64
        assert model.tensors["c"].nbytes == 4 * 2 * 34
        raw = path.read_bytes()
        for info in model.tensors.values():
            assert model.read_tensor(info.name).tobytes() == raw[info.offset:info.offset + info.nbytes]


def test_truncated_and_foreign_headers(smollm2_path: Path) -> None:
    head = smollm2_path.read_bytes()[:100_000]  # cuts the tokenizer in half

    def read(offset: int, nbytes: int) -> bytes:
        return head[offset:offset + nbytes]

    with pytest.raises(GGUFFormatError, match="truncated GGUF header"):
        parse_gguf_header(read, len(head))
    with pytest.raises(GGUFFormatError, match="magic"):
        parse_gguf_header(lambda o, n: b"\0" * n, 4096)


def test_string_arrays_across_fetches_and_their_faults(smollm2_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The vocabulary's strings are decoded in one loop (Cursor.strings): the same list however the
    header is fetched, and a bad length or byte inside the array is named, not a traceback."""
    import struct

    from gguf import GGUFReader

    from nvmedirect.reader import gguf_index

    raw = smollm2_path.read_bytes()
    field = GGUFReader(smollm2_path).fields["tokenizer.ggml.tokens"]
    want = [bytes(field.parts[i]).decode() for i in field.data]
    for fetch in (4093, 1 << 20):  # pieces that end inside lengths and inside strings
        monkeypatch.setattr(gguf_index, "_FETCH", fetch)
        index = parse_gguf_header(lambda o, n: raw[o:o + n], len(raw))
        assert index.metadata["tokenizer.ggml.tokens"] == want
    first = field.offset + sum(len(part) for part in field.parts[:field.data[0] - 1])  # the first length field
    third = first + sum(8 + len(t.encode()) for t in want[:2])  # the third token's length field
    for patch, problem in ((struct.pack("<Q", 1 << 40), "string of 1099511627776 bytes"),
                           (struct.pack("<Q", 1) + b"\xff", "not UTF-8")):
        bad = raw[:third] + patch + raw[third + len(patch):]
        with pytest.raises(GGUFFormatError, match=problem):
            parse_gguf_header(lambda o, n, bad=bad: bad[o:o + n], len(bad))
