"""The placement plan: which tier holds every weight tensor of a model.

Tier A is device memory (no transfer per pass), tier B host RAM (one host-to-device copy per pass),
tier C storage (a read into host staging, then the copy). Each pass (one forward step over every
token in flight) touches every layer tensor exactly once, so every layer byte has the same value
per byte of fast memory: the plan's job is to fit as many bytes as possible in tier A, then in
tier B, and to keep the streamed pieces few and spread out. The policy, in order:

1. Always resident: the global tensors (embeddings, output head, output norm) and every 1-D
   tensor (norms, biases). They are small against the layers, and keeping them means a pass never
   waits for a vector.
2. A ring of `n_slots` device buffers, each as large as the largest streamed tensor, is reserved
   for streaming (only when something streams), plus on the GPU one layer scratch where arrived
   tensors are repacked into the kernels' planar form. Budget below (1)+(2) is refused with the
   minimum.
3. Whole layers go resident while they fit, spread evenly through the depth, so the copy engine
   always has streamed layers on both sides of a resident one to prefetch (a contiguous resident
   block would leave the copies idle while it computes).
4. The room left is filled with the attention group (q, k, v, o) of streamed layers, then with
   single feed-forward matrices, largest first: whole groups cut the number of streamed pieces.
5. Of the tensors left to stream, tier B takes as many as fit the RAM budget, in pass order;
   the rest are tier C.

The plan is a pure function of the tensor table and the budgets, so it is deterministic and
testable without any device. Device cost and streamed bytes are separate: on the GPU a resident
matrix occupies its planar size (a little more than the GGUF bytes), while a streamed one crosses
the link in its GGUF form and is repacked into a slot on arrival.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from infer.arch import LAYER_KINDS, parse_tensor_name

ATTENTION_KINDS = ("attn_q", "attn_k", "attn_v", "attn_output")
FFN_KINDS = ("ffn_gate", "ffn_up", "ffn_down")
DEFAULT_SLOTS = 4  # small models and small budgets; bench/streaming_bench.py uses 8 (see BENCH_SLOTS there)
SCRATCH_ALIGN = 256  # each tensor in the layer scratch starts on this boundary (the kernels' plane alignment)


class Tier(StrEnum):
    VRAM = "A"  # resident in device memory
    RAM = "B"  # host memory, copied to the device every pass
    STORAGE = "C"  # read from storage into host staging, then copied, every pass

    @property
    def label(self) -> str:
        return {"A": "A (VRAM)", "B": "B (RAM)", "C": "C (storage)"}[self.value]


class PlanError(ValueError):
    """The budgets cannot hold the model's minimum working set; the message gives the minimum."""

    def __init__(self, message: str, minimum: int) -> None:
        super().__init__(message)
        self.minimum = minimum  # device bytes for weights the plan needs at least


@dataclass(frozen=True)
class Tensor:
    """A weight tensor as the planner sees it: where its bytes are and what it costs on the device."""

    name: str
    offset: int  # byte offset in the GGUF
    nbytes: int  # bytes in the GGUF (what a transfer moves)
    ggml_type: int
    shape: tuple[int, ...]  # NumPy order: rows, then row length
    device_nbytes: int  # bytes it occupies on the device (planar form on the GPU)

    @property
    def layer(self) -> int | None:
        return parse_tensor_name(self.name)[0]

    @property
    def kind(self) -> str:
        return parse_tensor_name(self.name)[1]

    @property
    def is_vector(self) -> bool:
        return len(self.shape) == 1


@dataclass
class Plan:
    """Tier of every tensor plus the numbers the pipeline and the report need."""

    tensors: list[Tensor]  # pass order: globals used first, then layer by layer, then the head
    tier: dict[str, Tier]
    n_layers: int
    n_slots: int
    slot_nbytes: int  # bytes of one ring slot: the largest streamed tensor (0 when nothing streams)
    scratch_nbytes: int  # device bytes of the layer scratch streamed tensors are repacked into
    vram_budget: int
    ram_budget: int
    notes: list[str] = field(default_factory=list)

    def tensors_in(self, tier: Tier) -> list[Tensor]:
        return [t for t in self.tensors if self.tier[t.name] is tier]

    def bytes_in(self, tier: Tier) -> int:
        """Bytes a tier holds: device bytes for A, GGUF bytes for B and C."""
        if tier is Tier.VRAM:
            return sum(t.device_nbytes for t in self.tensors_in(tier))
        return sum(t.nbytes for t in self.tensors_in(tier))

    @property
    def streamed(self) -> list[Tensor]:
        """Tensors that cross the link every pass, in pass order."""
        return [t for t in self.tensors if self.tier[t.name] is not Tier.VRAM]

    @property
    def streamed_nbytes(self) -> int:
        return sum(t.nbytes for t in self.streamed)

    @property
    def vram_used(self) -> int:
        return self.bytes_in(Tier.VRAM) + self.n_slots * self.slot_nbytes + self.scratch_nbytes

    def layer_tiers(self, layer: int) -> dict[str, Tier]:
        return {t.kind: self.tier[t.name] for t in self.tensors if t.layer == layer}

    def resident_layers(self) -> list[int]:
        return [i for i in range(self.n_layers)
                if all(tier is Tier.VRAM for tier in self.layer_tiers(i).values())]


def tensors_from(infos: Iterable[Any], device_nbytes: Callable[[Any], int] | None = None) -> list[Tensor]:
    """The planner's view of GGUF tensor records (name, offset, nbytes, ggml_type, NumPy-order
    shape); `device_nbytes(info)` gives each one's device size (default: its GGUF bytes)."""
    return [Tensor(i.name, i.offset, i.nbytes, i.ggml_type, tuple(i.shape),
                   int(device_nbytes(i)) if device_nbytes else i.nbytes) for i in infos]


def gpu_nbytes(info: Any) -> int:
    """Device bytes of a GGUF tensor on the GPU: its planar form for a matrix, float32 for a vector."""
    from infer.gpu.layout import format_of, plane_layout

    shape = tuple(info.shape)
    if len(shape) == 1:
        return int(shape[0]) * 4
    rows = 1
    for d in shape[:-1]:
        rows *= int(d)
    return plane_layout(format_of(info.ggml_type), rows, int(shape[-1])).nbytes


def span(layers: Iterable[int]) -> str:
    """"0-14" for a run of layer numbers, else them listed."""
    ids = sorted(layers)
    if ids and ids == list(range(ids[0], ids[-1] + 1)):
        return f"{ids[0]}-{ids[-1]}" if len(ids) > 1 else str(ids[0])
    return ", ".join(map(str, ids))


def planner_tensors(model: Any, device: str) -> list[Tensor]:
    """A GGUFModel's tensors with their device sizes for `device` (planar forms on the GPU; the token
    embedding takes no VRAM there unless the output reuses it: infer.gpu.weights.upload_embedding)."""
    tensors = tensors_from(model.tensors.values(), gpu_nbytes if device == "gpu" else None)
    if device == "gpu":
        from infer.arch import EXPERT_BLOCK_KINDS, TOKEN_EMBD, output_name

        host = set(EXPERT_BLOCK_KINDS)  # a block of experts' feed-forward: the CPU's (CpuExperts)
        if output_name(model) != TOKEN_EMBD:
            host.add(TOKEN_EMBD)
        tensors = [replace(t, device_nbytes=0) if t.kind in host or t.name in host else t for t in tensors]
    return tensors


def pass_order(tensors: Iterable[Tensor]) -> list[Tensor]:
    """Globals that come before the layers (embeddings), the layers in order with their tensors in
    the order the forward pass uses them, then the head."""
    kind_rank = {k: i for i, k in enumerate(LAYER_KINDS)}

    def key(t: Tensor) -> tuple[int, int, int, str]:
        if t.layer is not None:
            return (1, t.layer, kind_rank.get(t.kind, len(kind_rank)), t.name)
        return (0 if t.kind in ("token_embd", "rope_freqs") else 2, 0, 0, t.name)

    return sorted(tensors, key=key)


def _spread(count: int, total: int) -> list[int]:
    """`count` distinct indices in [0, total) spread evenly (deterministic)."""
    if count <= 0:
        return []
    if count >= total:
        return list(range(total))
    return sorted({int((j + 0.5) * total / count) for j in range(count)})


def minimum_vram(tensors: Sequence[Tensor], n_slots: int = DEFAULT_SLOTS, layer_scratch: bool = False) -> int:
    """Device bytes for weights below which no plan exists: the always-resident tensors, the ring
    slots and the scratch, sized for everything streaming."""
    pinned = sum(t.device_nbytes for t in tensors if t.layer is None or t.is_vector)
    matrices = [t for t in tensors if t.layer is not None and not t.is_vector]
    per_layer: dict[int, int] = {}
    for t in matrices:
        per_layer[t.layer] = per_layer.get(t.layer, 0) + _aligned(t.device_nbytes)  # type: ignore[index]
    scratch = max(per_layer.values(), default=0) if layer_scratch else 0
    return pinned + n_slots * max((t.nbytes for t in matrices), default=0) + scratch


def make_plan(tensors: Sequence[Tensor], n_layers: int, vram_budget: int, ram_budget: int,
              n_slots: int = DEFAULT_SLOTS, layer_scratch: bool = False) -> Plan:
    """Places every tensor; `vram_budget` and `ram_budget` are the bytes free for weights (the
    KV cache, activations and staging already taken off, see budget.py).

    Streaming reserves `n_slots` ring slots, each holding one streamed tensor as it crossed the
    link (GGUF bytes), and with `layer_scratch` (the GPU) one scratch holding the device form of a
    layer's streamed tensors (they are repacked there on arrival, which frees their slots early)."""
    if n_slots < 2:
        raise ValueError(f"the ring needs at least 2 slots to overlap copies with compute, not {n_slots}")
    ordered = pass_order(tensors)
    pinned = [t for t in ordered if t.layer is None or t.is_vector]
    pinned_bytes = sum(t.device_nbytes for t in pinned)
    matrices = [t for t in ordered if t.layer is not None and not t.is_vector]
    total = pinned_bytes + sum(t.device_nbytes for t in matrices)

    tier = {t.name: Tier.VRAM for t in ordered}
    if total <= vram_budget:
        return Plan(ordered, tier, n_layers, n_slots, 0, 0, vram_budget, ram_budget, ["everything is resident"])

    def reserve(resident: set[str]) -> tuple[int, int]:
        streamed = [t for t in matrices if t.name not in resident]
        slot = max((t.nbytes for t in streamed), default=0)
        per_layer: dict[int, int] = {}
        for t in streamed:
            per_layer[t.layer] = per_layer.get(t.layer, 0) + _aligned(t.device_nbytes)  # type: ignore[index]
        scratch = max(per_layer.values(), default=0) if layer_scratch else 0
        return slot, scratch

    # The reserve depends on what streams, which depends on the room the reserve leaves: start from
    # nothing resident and grow while the reserve the result needs still fits (a few rounds at most).
    slot, scratch = reserve(set())
    minimum = pinned_bytes + n_slots * slot + scratch
    if vram_budget < minimum:
        raise PlanError(
            f"VRAM budget {format_bytes(vram_budget)} for weights is below the minimum {format_bytes(minimum)} "
            f"({format_bytes(pinned_bytes)} resident globals and norms + {n_slots} streaming slots of "
            f"{format_bytes(slot)}" + (f" + a layer scratch of {format_bytes(scratch)})" if scratch else ")"),
            minimum)
    resident: set[str] = set()
    for _ in range(4):
        candidate = _fill_vram(matrices, n_layers, vram_budget - pinned_bytes - n_slots * slot - scratch)
        need_slot, need_scratch = reserve(candidate)
        if need_slot > slot or need_scratch > scratch or (resident and candidate == resident):
            break
        resident, slot, scratch = candidate, need_slot, need_scratch
    for t in matrices:
        tier[t.name] = Tier.VRAM if t.name in resident else Tier.RAM
    ram_left = ram_budget
    for t in ordered:
        if tier[t.name] is Tier.RAM:
            if t.nbytes <= ram_left:
                ram_left -= t.nbytes
            else:
                tier[t.name] = Tier.STORAGE
    plan = Plan(ordered, tier, n_layers, n_slots, slot, scratch, vram_budget, ram_budget)
    plan.notes.append(f"{len(plan.resident_layers())} of {n_layers} layers wholly resident")
    return plan


def _aligned(nbytes: int) -> int:
    return -(-nbytes // SCRATCH_ALIGN) * SCRATCH_ALIGN


def _fill_vram(matrices: list[Tensor], n_layers: int, room: int) -> set[str]:
    """Names of the layer matrices kept resident in `room` device bytes (steps 3 and 4)."""
    by_layer: dict[int, list[Tensor]] = {}
    for t in matrices:
        by_layer.setdefault(t.layer, []).append(t)  # type: ignore[arg-type]
    layer_bytes = {i: sum(t.device_nbytes for t in ts) for i, ts in by_layer.items()}
    # How many whole layers fit, taking the biggest layers' sizes (Q4_K_M mixes types per layer).
    sizes = sorted(layer_bytes.values(), reverse=True)
    count, used = 0, 0
    while count < len(sizes) and used + sizes[count] <= room:
        used += sizes[count]
        count += 1
    chosen = [sorted(by_layer)[i] for i in _spread(count, len(by_layer))]
    resident = {t.name for i in chosen for t in by_layer[i]}
    left = room - sum(layer_bytes[i] for i in chosen)
    streamed_layers = [i for i in sorted(by_layer) if i not in chosen]
    for i in streamed_layers:  # step 4a: attention groups of streamed layers
        group = [t for t in by_layer[i] if t.kind in ATTENTION_KINDS]
        size = sum(t.device_nbytes for t in group)
        if group and size <= left:
            resident.update(t.name for t in group)
            left -= size
    singles = sorted((t for i in streamed_layers for t in by_layer[i] if t.name not in resident),
                     key=lambda t: (-t.device_nbytes, t.layer, t.name))
    for t in singles:  # step 4b: largest first
        if t.device_nbytes <= left:
            resident.add(t.name)
            left -= t.device_nbytes
    return resident


_UNITS = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def format_bytes(n: int) -> str:
    for unit, size in _UNITS:
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"
