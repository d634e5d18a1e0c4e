"""The experts of the blocks the CPU computes, streamed to the GPU for a pass's prompt rows (issue 26).

At a VRAM budget that holds only some blocks' experts, the CPU computes the others' feed-forward
(infer.tiers.cpu_tier.CpuExperts): right for decode, where a token reads 8 of 128 experts, wrong for
a prompt, whose 512 rows route to nearly every expert and would have the CPU multiply 4096 (row,
expert) pairs a block. For a pass of at least `min_rows` prompt rows, each such block's expert stacks
instead cross the link once (their GGUF bytes from the file's pages, page-locked in place), are
repacked on arrival into one planar staging block, and the GPU's grouped product
(infer.gpu.experts) computes the prompt rows: the pass then costs about the link's time for those
bytes, as llama.cpp's does for the layers it leaves in RAM. The pass's canonical rows (decode
tokens, the logits rows of a prompt) stay with the CPU, so a row whose logits are read gets the same
bits in any pass; prompt rows already take other products on the GPU (pmm), so their numbers were
never the canonical rows'.

In decode the same staging serves `fetch`: a token's first picks in such a block (infer.gpu.expert_split)
have only their experts' slices copied and repacked, each at its own place in the staging block,
while the CPU computes the token's other picks. Registering the span of those blocks' stacks keeps
their pages in RAM (they are the CPU's working set anyway).

Streams and events: the copy stream waits for the raw slot's release, copies a stack's bytes into
it and records its arrival; the compute stream waits for the arrival, repacks the stack into its
planar buffer and records the slot's release. The planar buffers are reused by the next streamed
block: its repacks are queued on the compute stream after this block's products, so stream order
protects them, and its copies overlap this block's products and the next block's attention.
"""

from __future__ import annotations

import weakref

import cupy

from infer.arch import ModelArgs, tensor_name
from infer.gguf_file import GGUFModel
from infer.gpu.experts import SHARED, STACKS, ExpertBlock, upload_piece
from infer.gpu.ops import GpuMatrix, repack_sub_blocks
from infer.tiers.pipeline import repack_into
from infer.tiers.plan import Tensor, format_bytes, gpu_nbytes, span, tensors_from
from infer.tiers.tier_b import HostTier


def _stack_tensors(model: GGUFModel, layers: list[int]) -> dict[tuple[int, str], Tensor]:
    wanted = {tensor_name(i, kind): (i, kind) for i in layers for kind in STACKS}
    return {wanted[t.name]: t for t in tensors_from(model.tensors.values(), gpu_nbytes) if t.name in wanted}


def _resident_kinds(model: GGUFModel, layer: int) -> list[str]:
    """The block's matrices kept in VRAM while its stacks stream: the router and a shared expert's."""
    return [kind for kind in ("ffn_gate_inp", *SHARED) if tensor_name(layer, kind) in model.tensors]


def stream_nbytes(model: GGUFModel, layers: list[int]) -> int:
    """Device bytes of an ExpertStream for `layers`: the raw slot, the planar buffers, and the
    routers and shared experts kept resident."""
    if not layers:
        return 0
    stacks = _stack_tensors(model, layers)
    slot = max(t.nbytes for t in stacks.values())
    planar = sum(max(t.device_nbytes for (_, k), t in stacks.items() if k == kind) for kind in STACKS)
    resident = sum(gpu_nbytes(model.tensor(tensor_name(i, kind))) for i in layers for kind in _resident_kinds(model, i))
    return slot + planar + resident


class ExpertStream:
    """Blocks `layers`' expert stacks, streamed in by `block(i)` for passes of at least `min_rows`
    prompt rows."""

    def __init__(self, model: GGUFModel, args: ModelArgs, layers: list[int], min_rows: int) -> None:
        if not layers:
            raise ValueError("no block's experts to stream")
        self.model, self.args, self.layers, self.min_rows = model, args, list(layers), min_rows
        self.stacks = _stack_tensors(model, self.layers)
        self.host = HostTier(model, list(self.stacks.values()), "registered")  # page-locked in place: no copy
        self.slot = cupy.empty(max(t.nbytes for t in self.stacks.values()), cupy.uint8)
        self.planar = {kind: cupy.empty(max(t.device_nbytes for (_, k), t in self.stacks.items() if k == kind), cupy.uint8)
                       for kind in STACKS}
        self.resident = {(i, kind): upload_piece(model, i, kind) for i in self.layers for kind in _resident_kinds(model, i)}
        self.copy_stream = cupy.cuda.Stream(non_blocking=True)
        self.arrived = cupy.cuda.Event(disable_timing=True)
        self.released = cupy.cuda.Event(disable_timing=True)  # never recorded: the slot starts free
        self.streamed_bytes = 0  # over the link so far (the benchmark's figure)
        # unregister before the mapping goes: a later mapping at the same addresses would otherwise
        # be taken by CUDA for these pinned pages (a copy into it lands in the old ones)
        self._unregister = weakref.finalize(self, self.host.close)

    @property
    def nbytes(self) -> int:
        return int(self.slot.nbytes + sum(b.nbytes for b in self.planar.values())
                   + sum(m.nbytes for m in self.resident.values()))

    def describe(self) -> str:
        """One line for the load report."""
        link = sum(t.nbytes for t in self.stacks.values()) / len(self.layers)
        return (f"experts of the CPU's {len(self.layers)} blocks ({span(self.layers)}) stream to the GPU for passes "
                f"of >= {self.min_rows} prompt rows ({format_bytes(link)} a block over the link, "
                f"{format_bytes(self.nbytes)} of VRAM to stage them; {self.host.mode} host pages)")

    def takes(self, prompt_rows: int) -> bool:
        return prompt_rows >= self.min_rows

    def block(self, i: int) -> ExpertBlock:
        """Block i's experts on the device, queued on the current stream (valid until the next call)."""
        compute = cupy.cuda.get_current_stream()
        matrices: dict[str, GpuMatrix] = {}
        for kind in STACKS:
            t = self.stacks[(i, kind)]
            host = self.host.view(t.name)
            self.copy_stream.wait_event(self.released)
            cupy.cuda.runtime.memcpyAsync(self.slot.data.ptr, host.ctypes.data, t.nbytes,
                                          cupy.cuda.runtime.memcpyHostToDevice, self.copy_stream.ptr)
            self.arrived.record(self.copy_stream)
            compute.wait_event(self.arrived)
            matrices[kind] = repack_into(self.slot[: t.nbytes], t, self.planar[kind])
            self.released.record(compute)
            self.streamed_bytes += t.nbytes
        return self._block(i, matrices)

    def fetch(self, i: int, experts: list[int]) -> ExpertBlock:
        """Block i's experts `experts` only (sorted ids), each slice copied and repacked where the
        whole stack's would be, queued on the current stream: a product may read those experts'
        rows of the returned block, no other (valid until the next call)."""
        from infer.gpu.layout import format_of, plane_layout
        from infer.quants import activation_format

        compute = cupy.cuda.get_current_stream()
        matrices: dict[str, GpuMatrix] = {}
        for kind in STACKS:
            t = self.stacks[(i, kind)]
            host = self.host.view(t.name)
            E, rows, cols = (int(d) for d in t.shape)
            fmt = format_of(t.ggml_type)
            layout = plane_layout(fmt, E * rows, cols)
            piece, n_sb = t.nbytes // E, rows * cols // 32
            self.copy_stream.wait_event(self.released)
            for e in experts:
                cupy.cuda.runtime.memcpyAsync(self.slot.data.ptr + e * piece, host.ctypes.data + e * piece, piece,
                                              cupy.cuda.runtime.memcpyHostToDevice, self.copy_stream.ptr)
            self.arrived.record(self.copy_stream)
            compute.wait_event(self.arrived)
            for e in experts:
                repack_sub_blocks(self.slot[e * piece :], t.ggml_type, layout, self.planar[kind].data.ptr, e * n_sb, n_sb)
            self.released.record(compute)
            self.streamed_bytes += piece * len(experts)
            matrices[kind] = GpuMatrix(fmt, E * rows, cols, layout, self.planar[kind][: layout.nbytes], t.nbytes,
                                       activation_format(t.ggml_type), streamed=True)
        return self._block(i, matrices)

    def _block(self, i: int, matrices: dict[str, GpuMatrix]) -> ExpertBlock:
        shared = [self.resident.get((i, kind)) for kind in SHARED]
        return ExpertBlock(self.resident[(i, "ffn_gate_inp")], *(matrices[k] for k in STACKS), shared[0],
                           None if shared[1] is None else [shared[1], shared[2]], shared[3])  # type: ignore[list-item]

    def close(self) -> None:
        self._unregister()


def min_prompt_rows(args: ModelArgs) -> int:
    """Prompt rows from which a pass streams the CPU's blocks: where the pairs cover every expert
    twice on average (n * k >= 2 * E), the CPU would read about all of a block's experts anyway and
    multiply each of them for several rows, while the link carries the block once; at least 16."""
    return max(16, -(-2 * args.n_experts // max(args.n_experts_used, 1)))
