"""The streaming pipeline on the GPU: resident tensors repacked once, streamed tensors copied each
pass through a ring of device slots, all ordered by CUDA events with no host synchronisation per
layer.

Streams and events (the ring's schedule is in ring.py):
- the copy stream runs every host-to-device copy: it waits on the slot's release event, copies the
  GGUF bytes of the next streamed tensor into the slot, records the slot's arrival event;
- the compute stream (CuPy's current stream while the forward pass runs) waits on the arrival
  event, repacks the tensor from its slot into the layer scratch in the kernels' planar form,
  records the release event, and then runs the layer's kernels on the scratch.
Repacking on arrival frees a slot after microseconds rather than after the layer's compute, so a
handful of slots keeps the link busy. The scratch is reused by the next layer: its repack is
queued on the same stream after this layer's kernels, so stream order protects it.

Data paths, chosen per tensor from the plan and reported:
  resident             tier A, repacked once at load
  pinned-RAM copy      tier B in a page-locked arena
  registered-mmap copy tier B in the file's mapping, page-locked with cudaHostRegister(ReadOnly)
  staged read          tier C read (O_DIRECT file, NVMe, or the mmap baseline) into pinned staging
"""

from __future__ import annotations

from collections.abc import Sequence

import cupy
import numpy as np

from infer.arch import OUTPUT_NORM, TOKEN_EMBD, ModelArgs, output_name, tensor_name
from infer.gguf_file import GGUFModel
from infer.gpu.layout import FLOAT_FORMATS, format_of, plane_layout
from infer.gpu.memory import arena
from infer.gpu.ops import GpuMatrix, repack_sub_blocks
from infer.gpu.weights import (
    MATRIX_KINDS,
    GpuLayer,
    MatrixFormat,
    assemble_layer,
    embedding_on_host,
    layer_formats,
    layer_vectors,
    upload_embedding,
    upload_tensor,
    upload_vector,
)
from infer.quants import activation_format
from infer.tiers.plan import SCRATCH_ALIGN, Plan, Tensor, Tier
from infer.tiers.ring import StagingReader, StreamRing
from infer.tiers.tier_b import HostTier
from infer.tiers.tier_c import StorageSource


class _EventToken:
    def __init__(self, event: cupy.cuda.Event) -> None:
        self.event = event

    def wait(self) -> None:
        self.event.synchronize()


class GpuTransport:
    """Device slots, the copy stream, and one arrival and one release event per slot."""

    def __init__(self, n_slots: int, slot_nbytes: int) -> None:
        self.slots = [cupy.empty(max(slot_nbytes, 1), dtype=cupy.uint8) for _ in range(n_slots)]
        self.copy_stream = cupy.cuda.Stream(non_blocking=True)
        self.arrival = [cupy.cuda.Event(disable_timing=True) for _ in range(n_slots)]
        # waiting on an event that was never recorded returns at once: a fresh slot is free
        self.released = [cupy.cuda.Event(disable_timing=True) for _ in range(n_slots)]
        # a pass captured as one CUDA graph (infer.gpu.stream_graph): a wait inside a capture may not
        # name an event recorded outside it, so a slot whose copy was queued before the capture is
        # ordered by the stream instead (begin_capture, and the previous graph's join)
        self.capturing = False
        self._outside = [True] * n_slots  # the slot's last copy was queued outside the capture under way
        self._joined = False  # the copy stream took part in the capture under way
        # made once (a wait takes an event as recorded when it is queued, so recording it again is safe)
        self._queued, self._rejoined, self._graph_done = (cupy.cuda.Event(disable_timing=True) for _ in range(3))

    def copy_in(self, slot: int, tensor: Tensor, host: np.ndarray, track: bool = True) -> _EventToken | None:
        self.copy_stream.wait_event(self.released[slot])
        cupy.cuda.runtime.memcpyAsync(self.slots[slot].data.ptr, host.ctypes.data, tensor.nbytes,
                                      cupy.cuda.runtime.memcpyHostToDevice, self.copy_stream.ptr)
        self.arrival[slot].record(self.copy_stream)
        self._outside[slot] = not self.capturing
        self._joined |= self.capturing
        if not track:  # tier B: no event made and recorded for each copy of a pass
            return None
        # for host staging reuse, waited on by the staging thread (blocking, not spinning)
        done = cupy.cuda.Event(block=True, disable_timing=True)
        done.record(self.copy_stream)
        return _EventToken(done)

    def wait_arrival(self, slot: int) -> None:
        if self.capturing and self._outside[slot]:
            return  # queued before the capture: the compute stream already waits for it (begin_capture)
        cupy.cuda.get_current_stream().wait_event(self.arrival[slot])

    def begin_capture(self, compute: cupy.cuda.Stream) -> None:
        """Before a pass is captured (outside the capture): the compute stream waits for every copy
        queued so far; the copies the capture queues are the capture's own."""
        self._queued.record(self.copy_stream)
        compute.wait_event(self._queued)
        self._outside = [True] * len(self.slots)
        self._joined = False
        self.capturing = True

    def end_capture(self, compute: cupy.cuda.Stream) -> None:
        """Last inside the capture: the copy stream's captured copies (the next pass's first pieces
        among them) joined back into the compute stream, so the graph ends after them and the next
        pass, captured or replayed, finds them landed."""
        self.capturing = False
        if self._joined:
            self._rejoined.record(self.copy_stream)
            compute.wait_event(self._rejoined)

    def after_graph(self, compute: cupy.cuda.Stream) -> None:
        """After a captured pass is launched: the copy stream's next copies wait for it (the slot
        releases recorded inside a graph are not visible to waits outside it)."""
        self._graph_done.record(compute)
        self.copy_stream.wait_event(self._graph_done)

    def record_release(self, slot: int) -> None:
        self.released[slot].record(cupy.cuda.get_current_stream())


def repack_into(raw: cupy.ndarray, t: Tensor, out: cupy.ndarray) -> GpuMatrix:
    """The planar matrix of GGUF bytes `raw` (device), written into `out` (device, on the current
    stream). Float formats are plain copies."""
    rows, cols = int(np.prod(t.shape[:-1])), int(t.shape[-1])
    fmt = format_of(t.ggml_type)
    layout = plane_layout(fmt, rows, cols)
    buffer = out[: layout.nbytes]
    if fmt in FLOAT_FORMATS:
        buffer[...] = raw[: layout.nbytes]
    else:
        repack_sub_blocks(raw, t.ggml_type, layout, buffer.data.ptr, 0, layout.n_subblocks)
    return GpuMatrix(fmt, rows, cols, layout, buffer, t.nbytes, activation_format(t.ggml_type), streamed=True)


class StreamedWeights:
    """The GPU weight provider of a streamed model (infer.gpu.weights.GpuWeightSource): tier A
    tensors uploaded once as ResidentWeights uploads them, tier B and C matrices copied through the
    ring and repacked into the layer scratch when `layer(i)` asks for them. Call layer() in layer
    order on the compute stream and use the result before asking for the next layer (the scratch
    is reused)."""

    def __init__(self, model: GGUFModel, args: ModelArgs, plan: Plan, host: HostTier | None,
                 source: StorageSource | None, n_staging: int = 4, layers: Sequence[int] | None = None) -> None:
        """layers: only these blocks (a stage of a pipeline across GPUs, infer.gpu.stages; the plan
        then places that stage's tensors): the embedding with the first, the output with the last."""
        self.model, self.args, self.plan = model, args, plan
        self.stage = tuple(range(args.n_layers)) if layers is None else tuple(sorted(layers))
        first, last = 0 in self.stage, args.n_layers - 1 in self.stage
        self.transport = GpuTransport(plan.n_slots, plan.slot_nbytes)
        c_pieces = [t for t in plan.streamed if plan.tier[t.name] is Tier.STORAGE]
        if c_pieces and source is None:
            raise ValueError("the plan puts tensors in tier C but no storage source was given")
        self.staging = StagingReader(source, c_pieces, n_staging) if c_pieces else None  # type: ignore[arg-type]
        self.ring = StreamRing(plan, self.transport, host, self.staging)
        self.scratch = cupy.empty(max(plan.scratch_nbytes, 1), dtype=cupy.uint8)
        self._streamed: list[list[Tensor]] = [[] for _ in range(args.n_layers)]  # pass order
        self._scratch_at: dict[str, int] = {}
        for t in plan.tensors:
            if t.layer is not None and plan.tier[t.name] is not Tier.VRAM:
                self._streamed[t.layer].append(t)
        for ts in self._streamed:
            at = 0
            for t in ts:
                self._scratch_at[t.name] = at
                at += -(-t.device_nbytes // SCRATCH_ALIGN) * SCRATCH_ALIGN
            if at > self.scratch.nbytes:
                raise RuntimeError(f"layer scratch of {self.scratch.nbytes} bytes cannot hold {at}")
        host = embedding_on_host(model)
        resident = [t for t in plan.tensors if plan.tier[t.name] is Tier.VRAM]
        self.token_embd: GpuMatrix | None = None
        self.output_norm: cupy.ndarray | None = None
        self.output: GpuMatrix | None = None
        with arena(sum(t.device_nbytes for t in resident), len(resident)):  # not a 2 MiB page each
            if first or (last and not host):
                self.token_embd = upload_embedding(model) if host else upload_tensor(model, TOKEN_EMBD)
            if last:
                self.output_norm = upload_vector(model, OUTPUT_NORM)
                self.output = upload_tensor(model, output_name(model)) if host else self.token_embd
            self._vectors = {i: layer_vectors(model, args, i) for i in self.stage}
            self._resident = {i: {kind: upload_tensor(model, tensor_name(i, kind)) for kind in MATRIX_KINDS
                                  if plan.tier[tensor_name(i, kind)] is Tier.VRAM} for i in self.stage}
        self._whole = {i: assemble_layer(self._vectors[i], self._resident[i]) for i in self.stage
                       if not self._streamed[i]}
        self._formats = {i: layer_formats(model, i) for i in self.stage}
        # uploads ran on the legacy default stream, which the non-blocking compute stream does not
        # wait for: finish them before any pass starts
        cupy.cuda.Device().synchronize()
        cupy.get_default_memory_pool().free_all_blocks()  # the uploads' temporaries: VRAM the plan did not count
        self.ring.start()

    def layer(self, index: int) -> GpuLayer:
        whole = self._whole.get(index)
        if whole is not None:
            return whole
        fetched = dict(self._resident[index])
        for t in self._streamed[index]:
            slot = self.ring.acquire(t.name)
            fetched[t.kind] = repack_into(self.transport.slots[slot][: t.nbytes], t,
                                           self.scratch[self._scratch_at[t.name]:])
            self.ring.release(slot)
        return assemble_layer(self._vectors[index], fetched)

    def is_resident(self, index: int) -> bool:
        return not self._streamed[index]

    # ------------------------------------------------------------------ a pass as one CUDA graph (infer.gpu.stream_graph)
    def capturable(self) -> bool:
        """A pass can be captured: tier B only (tier C's reads wait on the host), every layer streamed
        by the GPU (none left to the CPU tier)."""
        return self.staging is None and not self.ring.left_out

    def pass_phase(self) -> int:
        """The slot the next pass's first piece lands in: a captured pass replays only at its phase."""
        return self.ring.consumed % self.ring.n_slots

    def leave_to_cpu(self, layers: frozenset[int]) -> None:
        """From this pass on, layers `layers` are computed by the CPU (infer.tiers.cpu_tier): their
        streamed tensors are not copied. Call between passes, on the compute stream."""
        self.ring.select(layers)

    def vectors(self, index: int) -> dict[str, cupy.ndarray | None]:
        """Layer `index`'s vectors on the device (arch.layer_vectors names)."""
        return self._vectors[index]

    def formats(self, index: int) -> dict[str, MatrixFormat]:
        return self._formats[index]

    def bytes_per_token(self) -> tuple[int, int]:
        """(device bytes, GGUF bytes) of the matrices one decode step reads: the planar size of a
        matrix whether resident or repacked into the scratch."""
        mats = [t for t in self.plan.tensors if t.layer is not None and not t.is_vector]
        head = (self.output.nbytes, self.output.source_nbytes) if self.output is not None else (0, 0)
        return sum(t.device_nbytes for t in mats) + head[0], sum(t.nbytes for t in mats) + head[1]

    def bytes_moved(self) -> dict[Tier, int]:
        return dict(self.ring.moved)

    def close(self) -> None:
        # prefetches for a next pass may still be reading host memory that is about to be freed
        self.transport.copy_stream.synchronize()
        self.ring.close()
        self.transport.copy_stream.synchronize()
