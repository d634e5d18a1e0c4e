"""Writing edited copies of GGUF files for tests: fewer layers (a one-layer model shows numeric
differences without the amplification of 30 layers), changed metadata, dropped tensors."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter


def write_copy(source: Path, target: Path, n_layers: int | None = None,
               metadata: dict[str, tuple[Any, ...]] | None = None,
               drop_tensors: tuple[str, ...] = (), extra_tensors: dict[str, np.ndarray] | None = None,
               reverse_tensor_order: bool = False, drop_pattern: str | None = None,
               drop_keys: tuple[str, ...] = ()) -> Path:
    """Copies `source` to `target`, keeping only blocks < n_layers, replacing or adding `metadata`
    (key -> (value, type)), leaving out the tensors named in `drop_tensors` or matching the regular
    expression `drop_pattern`, leaving out the keys in `drop_keys`, and adding `extra_tensors` (name -> float32 array);
    reverse_tensor_order stores the tensors last to first. A new `general.architecture` in
    `metadata` also renames the old architecture's keys ("qwen2.block_count" -> "qwen3.block_count")."""
    reader = GGUFReader(source)
    overrides = dict(metadata or {})
    arch_value = overrides.pop("general.architecture", (None,))[0]
    old_arch = str(reader.fields["general.architecture"].contents())
    arch = arch_value or old_arch
    writer = GGUFWriter(target, arch)
    for field_key, field in reader.fields.items():
        key = f"{arch}.{field_key[len(old_arch) + 1:]}" if field_key.startswith(f"{old_arch}.") else field_key
        if key.startswith("GGUF.") or key == "general.architecture" or key in overrides or key in drop_keys:
            continue
        value = field.contents()
        if n_layers is not None and key.endswith(".block_count"):
            value = n_layers
        sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY and len(field.types) > 1 else None
        writer.add_key_value(key, value, field.types[0], sub_type=sub_type)
    for key, (value, vtype, *sub) in overrides.items():  # (value, type) or (list, ARRAY, item type)
        writer.add_key_value(key, value, vtype, sub_type=sub[0] if sub else None)
    for tensor in reversed(reader.tensors) if reverse_tensor_order else reader.tensors:
        block = re.match(r"blk\.(\d+)\.", tensor.name)
        if tensor.name in drop_tensors or (drop_pattern and re.search(drop_pattern, tensor.name)) or \
                (block and n_layers is not None and int(block.group(1)) >= n_layers):
            continue
        writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
    for name, values in (extra_tensors or {}).items():
        writer.add_tensor(name, np.asarray(values, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target
