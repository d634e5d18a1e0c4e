"""The streaming pipeline on the CPU: the same plan, ring and tier B/C code as on the GPU, with
"device memory" simulated by small budgets, so CI proves that streaming computes exactly what the
resident engine computes.

What stands for what:
- tier A: layer tensors dequantized once and kept (as a resident GPU matrix is repacked once);
- ring slots: host byte buffers; the "copy engine" is one worker thread that copies tier B/C bytes
  into a slot after the slot's previous occupant was released;
- consuming a streamed tensor: dequantize it out of its slot (the GPU repacks it into the layer
  scratch), then release the slot.
The forward pass sees an ordinary WeightProvider.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from infer import quants
from infer.arch import OUTPUT_NORM, TOKEN_EMBD, ModelArgs, layer_vectors, output_name
from infer.gguf_file import GGUFModel
from infer.model import LayerWeights, Linear
from infer.tiers.plan import Plan, Tensor, Tier
from infer.tiers.ring import StagingReader, StreamRing
from infer.tiers.tier_b import HostTier
from infer.tiers.tier_c import StorageSource


class CpuTransport:
    """Ring slots in host memory filled by a single copy thread."""

    def __init__(self, n_slots: int, slot_nbytes: int) -> None:
        self.slots = [np.zeros(max(slot_nbytes, 1), np.uint8) for _ in range(n_slots)]
        self._engine = ThreadPoolExecutor(1, thread_name_prefix="sim-copy")
        self._arrival: list[Future | None] = [None] * n_slots
        self._released = [threading.Event() for _ in range(n_slots)]
        for event in self._released:
            event.set()

    def copy_in(self, slot: int, tensor: Tensor, host: np.ndarray) -> Future:
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
                 exact: bool = False) -> None:
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
        self._output: Linear | None = None
        self.passes = 0
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

    def warm(self, progress: Callable[[int, int], None] | None = None) -> None:
        """Dequantizes the tier A tensors and the output matrix now, not during the first pass (on
        a large model that is most of the load); progress(done, total) after each."""
        resident = [t for t in self.plan.tensors if t.layer is not None and self.plan.tier[t.name] is Tier.VRAM]
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
        values = {t.kind: (self._values(t), self._fmt_of(t.ggml_type)) for t in self._by_layer[index]}  # pass order
        vectors = layer_vectors(self.args, index, {kind: v for kind, (v, _) in values.items() if v.ndim == 1})
        return LayerWeights.assemble(
            vectors,
            attn_qkv=Linear([values["attn_q"], values["attn_k"], values["attn_v"]], self.exact),
            attn_output=Linear([values["attn_output"]], self.exact),
            ffn_gate_up=Linear([values["ffn_gate"], values["ffn_up"]], self.exact),
            ffn_down=Linear([values["ffn_down"]], self.exact),
        )

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        info = self.model.tensor(TOKEN_EMBD)
        return quants.dequantize_rows(info.data, info.ggml_type, self.args.dim, tokens)

    def output_norm(self) -> np.ndarray:
        if OUTPUT_NORM not in self._resident:
            self._resident[OUTPUT_NORM] = self.model.tensor(OUTPUT_NORM).dequantize()
        return self._resident[OUTPUT_NORM]

    def output(self) -> Linear:
        if self._output is None:
            info = self.model.tensor(output_name(self.model))
            self._output = Linear([(info.dequantize(self._matrix), self._fmt_of(info.ggml_type))], self.exact)
        return self._output

    def bytes_moved(self) -> dict[Tier, int]:
        return dict(self.ring.moved)

    def close(self) -> None:
        self.ring.close()
        self.transport.close()
