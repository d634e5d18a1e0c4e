"""The streaming pipeline on the CPU: the same plan, ring and tier B/C code as on the GPU, with
"device memory" simulated by small budgets, so CI proves that streaming computes exactly what the
resident engine computes.

What stands for what:
- tier A: layer tensors dequantized once and kept (as a resident GPU matrix is repacked once);
- ring slots: host byte buffers; the "copy engine" is one worker thread that copies tier B/C bytes
  into a slot after the slot's previous occupant was released;
- consuming a streamed tensor: dequantize it out of its slot (the GPU repacks it into the layer
  scratch), then release the slot.
With `packed` (the CPU's default engine, infer.packed_weights) the matrices are not dequantized:
tier A's stay in the mapped file, a streamed one's bytes are copied out of its slot (the slot is then
free), and the native kernels multiply them, so the streamed engine computes what the packed resident
engine computes, bit for bit.
The forward pass sees an ordinary WeightProvider.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from infer import cpu_kernels, quants
from infer.arch import OUTPUT_NORM, TOKEN_EMBD, ModelArgs, layer_vectors, output_name
from infer.gguf_file import GGUFModel
from infer.model import LayerWeights, Linear
from infer.tiers.plan import Plan, Tensor, Tier
from infer.tiers.ring import StagingReader, StreamRing
from infer.tiers.tier_b import HostTier
from infer.tiers.tier_c import StorageSource

# a layer's fused products (infer.model.LayerWeights), each its matrices stacked row-wise in this order
PRODUCTS = (("attn_q", "attn_k", "attn_v"), ("attn_output",), ("ffn_gate", "ffn_up"), ("ffn_down",))


class CpuTransport:
    """Ring slots in host memory filled by a single copy thread."""

    def __init__(self, n_slots: int, slot_nbytes: int) -> None:
        self.slots = [np.zeros(max(slot_nbytes, 1), np.uint8) for _ in range(n_slots)]
        self._engine = ThreadPoolExecutor(1, thread_name_prefix="sim-copy")
        self._arrival: list[Future | None] = [None] * n_slots
        self._released = [threading.Event() for _ in range(n_slots)]
        for event in self._released:
            event.set()

    def copy_in(self, slot: int, tensor: Tensor, host: np.ndarray, track: bool = True) -> _FutureToken:
        released = self._released[slot]
        if not released.is_set():  # the ring's invariant, checked: never refill a slot in use
            raise RuntimeError(f"slot {slot} refilled with {tensor.name} before its previous tensor was released")
        released.clear()
        prior = self._arrival[slot]

        def copy() -> None:
            if prior is not None:
                prior.result()
            self.slots[slot][: tensor.nbytes] = host[: tensor.nbytes]

        future = self._engine.submit(copy)
        self._arrival[slot] = future
        return _FutureToken(future)

    def wait_arrival(self, slot: int) -> None:
        future = self._arrival[slot]
        if future is None:
            raise RuntimeError(f"slot {slot} was acquired before anything was copied into it")
        future.result()

    def record_release(self, slot: int) -> None:
        self._released[slot].set()

    def close(self) -> None:
        self._engine.shutdown(wait=True)


class _FutureToken:
    def __init__(self, future: Future) -> None:
        self._future = future

    def wait(self) -> None:
        self._future.result()


class StreamingCpuWeights:
    """A WeightProvider whose layer tensors come from tiers A, B and C as the plan says."""

    def __init__(self, model: GGUFModel, args: ModelArgs, plan: Plan, host: HostTier | None,
                 source: StorageSource | None, n_staging: int = 3, match_llama_cpp: bool = True,
                 exact: bool = False, packed: bool = False) -> None:
        self.model = model
        self.args = args
        self.plan = plan
        self.match_llama_cpp = match_llama_cpp
        self.exact = exact  # matrices as exact float64 (infer.model.Linear's exact numerics)
        self._matrix = np.float64 if exact else np.float32
        self.transport = CpuTransport(plan.n_slots, plan.slot_nbytes)
        c_pieces = [t for t in plan.streamed if plan.tier[t.name] is Tier.STORAGE]
        if c_pieces and source is None:
            raise ValueError("the plan puts tensors in tier C but no storage source was given")
        self.staging = StagingReader(source, c_pieces, n_staging) if c_pieces else None  # type: ignore[arg-type]
        self.ring = StreamRing(plan, self.transport, host, self.staging)
        self._by_layer: dict[int, list[Tensor]] = {}
        for t in plan.tensors:
            if t.layer is not None:
                self._by_layer.setdefault(t.layer, []).append(t)
        self._resident: dict[str, np.ndarray] = {}
        self._output: Any = None
        self._resident_products: dict[tuple[int, int], Any] = {}  # packed products wholly in tier A, made once
        self.passes = 0
        self.packed = packed and match_llama_cpp and not exact
        if self.packed:  # as infer.packed_weights.PackedWeights: native norms, rope and attention too
            from infer.cpu_layers import NativeLayers

            self.native_layers = NativeLayers()
            cpu_kernels.single_threaded_blas()
        self.ring.start()

    # -- tensors -----------------------------------------------------------------------------------

    def _values(self, t: Tensor) -> np.ndarray:
        dtype = self._matrix if len(t.shape) == 2 else np.float32  # norms and biases stay float32
        if self.plan.tier[t.name] is Tier.VRAM:
            if t.name not in self._resident:
                self._resident[t.name] = self.model.tensor(t.name).dequantize(dtype)
            return self._resident[t.name]
        slot = self.ring.acquire(t.name)
        try:
            raw = self.transport.slots[slot][: t.nbytes]
            return quants.dequantize(raw, t.ggml_type, t.shape, dtype)  # a new array: the slot is free after
        finally:
            self.ring.release(slot)

    def _raw(self, t: Tensor) -> np.ndarray:
        """A matrix's packed bytes: tier A's in the mapped file, a streamed one's copied out of its slot."""
        if self.plan.tier[t.name] is Tier.VRAM:
            return self.model.tensor(t.name).data
        slot = self.ring.acquire(t.name)
        try:
            return self.transport.slots[slot][: t.nbytes].copy()
        finally:
            self.ring.release(slot)

    def _packs(self, tensors: list[Tensor]) -> bool:
        """Whether a fused product of these matrices is packed (every type one the kernels take)."""
        return self.packed and all(t.ggml_type in cpu_kernels.SUPPORTED_TYPES for t in tensors)

    def warm(self, progress: Callable[[int, int], None] | None = None) -> None:
        """Dequantizes the tier A tensors and the output matrix now, not during the first pass (on
        a large model that is most of the load); progress(done, total) after each."""
        resident = [t for t in self.plan.tensors if t.layer is not None and self.plan.tier[t.name] is Tier.VRAM
                    and not (len(t.shape) == 2 and self._packs([t]))]  # packed ones stay in the file
        total = len(resident) + 1
        for done, t in enumerate(resident, start=1):
            self._values(t)
            if progress is not None:
                progress(done, total)
        self.output()
        self.output_norm()
        if progress is not None:
            progress(total, total)

    def _fmt_of(self, ggml_type: int) -> str:
        return quants.activation_format(ggml_type) if self.match_llama_cpp else "f32"

    def is_resident(self, index: int) -> bool:
        """Whether all of layer `index` is in tier A (a self-draft may read it out of pass order)."""
        return all(self.plan.tier[t.name] is Tier.VRAM for t in self._by_layer[index])

    def layer(self, index: int) -> LayerWeights:
        if index == 0:
            self.passes += 1
        tensors = self._by_layer[index]
        kinds = {t.kind: t for t in tensors}
        groups = [[kinds[kind] for kind in product] for product in PRODUCTS]
        packs = {t.kind: self._packs(group) for group in groups for t in group}
        got: dict[str, Any] = {}
        for t in tensors:  # in pass order: the ring hands the streamed tensors out in it
            if len(t.shape) == 1:
                got[t.kind] = self._values(t)
            elif packs[t.kind]:
                got[t.kind] = (self._raw(t), t.ggml_type, t.shape[0], t.shape[1])
            else:
                got[t.kind] = (self._values(t), self._fmt_of(t.ggml_type))
        products = []
        for g, group in enumerate(groups):
            parts = [got[t.kind] for t in group]
            if not packs[group[0].kind]:
                products.append(Linear(parts, self.exact))
            elif all(self.plan.tier[t.name] is Tier.VRAM for t in group):
                if (index, g) not in self._resident_products:
                    from infer.packed_weights import PackedLinear

                    self._resident_products[index, g] = PackedLinear(parts)
                products.append(self._resident_products[index, g])
            else:
                from infer.packed_weights import PackedLinear

                products.append(PackedLinear(parts))
        vectors = {kind: v for kind, v in got.items() if isinstance(v, np.ndarray)}
        attn_qkv, attn_output, ffn_gate_up, ffn_down = products
        return LayerWeights.assemble(layer_vectors(self.args, index, vectors), attn_qkv=attn_qkv,
                                     attn_output=attn_output, ffn_gate_up=ffn_gate_up, ffn_down=ffn_down)

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        info = self.model.tensor(TOKEN_EMBD)
        return quants.dequantize_rows(info.data, info.ggml_type, self.args.dim, tokens)

    def output_norm(self) -> np.ndarray:
        if OUTPUT_NORM not in self._resident:
            self._resident[OUTPUT_NORM] = self.model.tensor(OUTPUT_NORM).dequantize()
        return self._resident[OUTPUT_NORM]

    def output(self) -> Any:
        if self._output is None:
            info = self.model.tensor(output_name(self.model))
            if self.packed and info.ggml_type in cpu_kernels.SUPPORTED_TYPES:
                from infer.packed_weights import PackedLinear

                self._output = PackedLinear([(info.data, info.ggml_type, info.shape[0], info.shape[1])])
            else:
                self._output = Linear([(info.dequantize(self._matrix), self._fmt_of(info.ggml_type))], self.exact)
        return self._output

    def bytes_moved(self) -> dict[Tier, int]:
        return dict(self.ring.moved)

    def close(self) -> None:
        self.ring.close()
        self.transport.close()
