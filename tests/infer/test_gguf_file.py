"""GGUFModel on a small synthetic file: metadata as plain Python values, tensor records and views,
and independence from the order in which the file stores its tensors."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from gguf import GGUFReader, GGUFValueType

from infer.cli import main as cli_main
from infer.gguf_file import GGUFModel
from infer.model import load_transformer
from infer.synth import Shape, write_model
from tests.oracle.gguf_edit import write_copy

TINY = Shape(n_layers=2, dim=256, ffn_dim=512, n_heads=4, n_kv_heads=2, vocab_size=300, context_length=128)


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_model(p, TINY, "q4_k_m", seed=2)
    return p


def test_metadata_is_plain_python(path: Path) -> None:
    meta = GGUFModel(path).metadata
    assert meta["general.architecture"] == "llama"
    assert isinstance(meta["llama.block_count"], int) and meta["llama.block_count"] == 2
    assert isinstance(meta["llama.attention.layer_norm_rms_epsilon"], float)
    tokens = meta["tokenizer.ggml.tokens"]
    assert isinstance(tokens, list) and len(tokens) == 300 and all(isinstance(t, str) for t in tokens)
    assert isinstance(meta["tokenizer.ggml.scores"][0], float)
    assert not any(key.startswith("GGUF.") for key in meta)


def test_tensor_records_view_the_file(path: Path) -> None:
    model = GGUFModel(path)
    info = model.tensor("blk.0.attn_q.weight")
    assert info.shape == (256, 256)  # NumPy order: (out_features, in_features)
    raw = path.read_bytes()[info.offset : info.offset + info.nbytes]
    assert info.data.tobytes() == raw
    assert info.dequantize().shape == (256, 256)


def test_tensor_order_in_the_file_does_not_matter(path: Path, tmp_path: Path) -> None:
    reversed_path = write_copy(path, tmp_path / "reversed.gguf", reverse_tensor_order=True)
    forward, backward = GGUFModel(path), GGUFModel(reversed_path)
    assert list(forward.tensors) == list(reversed(list(backward.tensors)))
    ids = np.array([5, 17, 200, 3, 99])
    logits = []
    for model in (forward, backward):
        transformer = load_transformer(model)
        logits.append(transformer.forward(ids, transformer.new_cache(8), all_logits=True))
    np.testing.assert_array_equal(logits[0], logits[1])


# -- tensor data past 4 GiB, with general.alignment set (sparse files: the gap costs no disk) ------
FOUR_GIB = 1 << 32


def _moved_data(source: Path, target: Path, shift_for: Callable[[int], int]) -> Path:
    """A copy of `source` (general.alignment set) whose tensor data starts `shift_for(data_offset)`
    bytes later: every tensor offset moves by that much and the gap is a hole."""
    aligned = write_copy(source, target.with_suffix(".aligned"), metadata={"general.alignment": (32, GGUFValueType.UINT32)})
    reader = GGUFReader(aligned, "r+")
    data_offset = int(reader.data_offset)
    shift = shift_for(data_offset)
    for tensor in reader.tensors:
        tensor.field.parts[5][0] += shift
    reader.data.flush()
    del reader
    raw = aligned.read_bytes()
    with open(target, "wb") as out:
        out.write(raw[:data_offset])
        out.seek(data_offset + shift)
        out.write(raw[data_offset:])
    return target


def _same_tensors(moved: Path, original: Path) -> None:
    want, got = GGUFModel(original), GGUFModel(moved)
    assert got.tensors.keys() == want.tensors.keys()
    for name, info in want.tensors.items():
        assert got.tensors[name].offset > FOUR_GIB - 1 and bytes(got.tensors[name].data) == bytes(info.data), name


def _greedy(path: Path) -> str:
    result = CliRunner().invoke(cli_main, ["-m", str(path), "-p", "hello", "-n", "4", "-t", "0", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    return result.stdout


@pytest.mark.parametrize("case", ["past_4_gib", "exactly_at_4_gib"])
def test_tensor_data_beyond_4_gib_with_alignment(path: Path, tmp_path: Path, case: str) -> None:
    # (a) every tensor lies past 4 GiB; (b) the first starts at exactly 2^32, where a 32-bit sum
    # wraps to 0 and the tensor would be read from the file's first bytes
    shift = (lambda _: FOUR_GIB) if case == "past_4_gib" else (lambda data_offset: FOUR_GIB - data_offset)
    moved = _moved_data(path, tmp_path / f"{case}.gguf", shift)
    assert moved.stat().st_size > FOUR_GIB
    _same_tensors(moved, path)
    assert _greedy(moved) == _greedy(path)
