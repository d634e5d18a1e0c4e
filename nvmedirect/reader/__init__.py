"""Reading GGUF models for inference: one interface over files, block devices and the NVMe driver."""

from nvmedirect.host_memory import aligned_empty, pinned_empty
from nvmedirect.reader.base import ByteRange, ReadError, ReadHandle, StorageBackend
from nvmedirect.reader.file_backend import BlockDeviceBackend, DirectIOUnsupported, FileBackend
from nvmedirect.reader.gguf_index import GGUFIndex, TensorInfo
from nvmedirect.reader.model import ModelReader, open_backend, open_model

__all__ = [
    "BlockDeviceBackend", "ByteRange", "DirectIOUnsupported", "FileBackend", "GGUFIndex", "ModelReader",
    "ReadError", "ReadHandle", "StorageBackend", "TensorInfo", "aligned_empty", "open_backend", "open_model",
    "pinned_empty",
]
