"""Several GPUs of one host as a pipeline (issue 30): each GPU a stage holding a contiguous range of
the layers (the first also the token embedding, the last the output norm and head), a pass running
stage after stage with its rows' hidden states handed over between them.

- `split_layers` chooses the ranges: contiguous, each within its GPU's budget, the slowest stage as
  fast as it can be (a stage's time per pass is taken as its bytes read over its GPU's speed);
- a `StageLink` hands the hidden states of a pass's rows from one stage to the next: NCCL between
  GPUs (`NcclLink`, CuPy's `cupy.cuda.nccl`), or a device-to-device copy (`CopyLink`: between GPUs
  as a peer copy, and on ONE GPU, where two stages stand in for two GPUs in tests);
- `PipelineTransformer` is the model the engine sees (forward, forward_batch, trees: the
  infer.gpu.front calls): each pass's rows laid out once, filled into every stage's index with the
  stage's own KV cache (`StagedCache`), the stages' layers queued in order, the last stage's head.

A row's hidden state crosses as float32 bits, so every row's logits are the bits of the one-GPU
engine (tested). A large pass runs as micro-batches in row order where the stages have GPUs of
their own (PipelineTransformer.micro_batches). Streamed stages: infer.tiers.staged_session; a
mixture of experts: each stage places its own blocks' experts (load_gpu_transformer). Not yet:
generation loops on the device (the engine drives the pipeline from the host).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol

import cupy
import numpy as np

from infer.gguf_file import GGUFModel
from infer.gpu.cache import GpuKVCache
from infer.gpu.front import PassFront
from infer.gpu.model import GpuTransformer
from infer.gpu.passes import PassShape, Row
from infer.tiers.budget import VramAccount
from infer.tiers.stage_plan import plan_stages


class StageLink(Protocol):
    """Moves the hidden states of a pass's rows from one stage's buffer to the next one's, ordered
    after the sending stage's layers and before the receiving stage's."""

    def hand_over(self, src: GpuTransformer, dst: GpuTransformer, rows: int) -> None: ...

    def close(self) -> None: ...


class CopyLink:
    """The hand-over as a device copy: a peer copy between two GPUs, or a plain copy where both
    stages share one GPU (the stand-in for two GPUs in tests)."""

    def __init__(self) -> None:
        # (sent, received) a pair of shares, made once: a wait takes the event as recorded when it
        # is queued, so recording it again for the next pass is safe
        self._events: dict[tuple[int, int], tuple[cupy.cuda.Event, cupy.cuda.Event]] = {}

    def _pair(self, src: GpuTransformer, dst: GpuTransformer) -> tuple[cupy.cuda.Event, cupy.cuda.Event]:
        key = (id(src), id(dst))
        if key not in self._events:  # an event is recorded on a stream of its own device
            with cupy.cuda.Device(src.device_id):
                sent = cupy.cuda.Event(disable_timing=True)
            with cupy.cuda.Device(dst.device_id):
                received = cupy.cuda.Event(disable_timing=True)
            self._events[key] = (sent, received)
        return self._events[key]

    def close(self) -> None:
        self._events.clear()

    def hand_over(self, src: GpuTransformer, dst: GpuTransformer, rows: int) -> None:
        sent, received = self._pair(src, dst)
        with cupy.cuda.Device(src.device_id):
            sent.record(src.stream)  # after the sender's layers
        with cupy.cuda.Device(dst.device_id):
            dst.stream.wait_event(sent)
            nbytes = rows * src.x.shape[1] * src.x.itemsize
            if src.device_id == dst.device_id:
                cupy.cuda.runtime.memcpyAsync(dst.x.data.ptr, src.x.data.ptr, nbytes,
                                              cupy.cuda.runtime.memcpyDeviceToDevice, dst.stream.ptr)
            else:
                cupy.cuda.runtime.memcpyPeerAsync(dst.x.data.ptr, dst.device_id, src.x.data.ptr, src.device_id,
                                                  nbytes, dst.stream.ptr)
            received.record(dst.stream)
        with cupy.cuda.Device(src.device_id):
            src.stream.wait_event(received)  # the sender's next pass overwrites x only after the copy


class NcclLink:
    """The hand-over through NCCL (one process driving every GPU: one communicator per device,
    made together; each hand-over a send and a receive in one group).

    NCCL takes device memory outside CuPy's pool (its buffers for each pair of GPUs, its kernels),
    first at a pair's first send and receive. So the link is made before the stages are planned
    and connects every ordered pair at once: each GPU's VRAM account then finds that memory already
    in use ("CUDA context and other processes") and the budget holds it, rather than NCCL failing
    for memory in the middle of a pass."""

    def __init__(self, gpus: Sequence[int]) -> None:
        from cupy.cuda import nccl

        self.nccl = nccl
        self.rank = {g: r for r, g in enumerate(gpus)}
        self.comms = nccl.NcclCommunicator.initAll(list(gpus))
        self.connect()

    def connect(self) -> None:
        """One float sent between every ordered pair of the GPUs: NCCL sets up (and allocates) each
        pair's connection now."""
        nccl, gpus = self.nccl, list(self.rank)
        cells = {}
        for g in gpus:
            with cupy.cuda.Device(g):
                cells[g] = cupy.zeros(1, cupy.float32)
        for src in gpus:
            for dst in gpus:
                if src == dst:
                    continue
                nccl.groupStart()
                with cupy.cuda.Device(src):
                    self.comms[self.rank[src]].send(cells[src].data.ptr, 1, nccl.NCCL_FLOAT32, self.rank[dst],
                                                    cupy.cuda.get_current_stream().ptr)
                with cupy.cuda.Device(dst):
                    self.comms[self.rank[dst]].recv(cells[dst].data.ptr, 1, nccl.NCCL_FLOAT32, self.rank[src],
                                                    cupy.cuda.get_current_stream().ptr)
                nccl.groupEnd()
        for g in gpus:
            with cupy.cuda.Device(g):
                cupy.cuda.get_current_stream().synchronize()

    def close(self) -> None:
        """Frees NCCL's memory (its communicators); the link is not used after."""
        for comm in self.comms:
            comm.destroy()
        self.comms = []

    def hand_over(self, src: GpuTransformer, dst: GpuTransformer, rows: int) -> None:
        nccl = self.nccl
        count = rows * src.x.shape[1]
        s, d = self.rank[src.device_id], self.rank[dst.device_id]
        nccl.groupStart()
        with cupy.cuda.Device(src.device_id):
            self.comms[s].send(src.x.data.ptr, count, nccl.NCCL_FLOAT32, d, src.stream.ptr)
        with cupy.cuda.Device(dst.device_id):
            self.comms[d].recv(dst.x.data.ptr, count, nccl.NCCL_FLOAT32, s, dst.stream.ptr)
        nccl.groupEnd()


class StagedCache:
    """A sequence's KV cache across the stages: each stage's cache (on its GPU, `devices`) holds its
    layers' keys and values; the length and what a pass wrote are the same in all. The last
    stage's holds the token history."""

    def __init__(self, parts: Sequence[GpuKVCache], devices: Sequence[int]) -> None:
        self.parts, self.devices = list(parts), list(devices)

    @property
    def length(self) -> int:
        return self.parts[0].length

    @length.setter
    def length(self, value: int) -> None:
        for part in self.parts:
            part.length = value

    @property
    def max_tokens(self) -> int:
        return self.parts[0].max_tokens

    @property
    def tokens(self) -> cupy.ndarray:
        return self.parts[-1].tokens

    @property
    def lost(self) -> int:
        return max(part.lost for part in self.parts)  # only a stage with local layers keeps a ring

    def wrote(self, end: int) -> None:
        for part in self.parts:
            part.wrote(end)

    def can_rewind(self, length: int) -> bool:
        return all(part.can_rewind(length) for part in self.parts)

    def accept(self, nodes: Sequence[int]) -> None:
        for part, device in zip(self.parts, self.devices, strict=True):
            with cupy.cuda.Device(device):
                part.accept(nodes)

    def copy_from(self, other: StagedCache) -> None:
        for mine, theirs, device in zip(self.parts, other.parts, self.devices, strict=True):
            with cupy.cuda.Device(device):
                mine.copy_from(theirs)


MICRO_BATCHES = 2  # a large pass's micro-batches where the stages have GPUs of their own
MICRO_ROWS = 64  # rows a micro-batch holds at least (fewer: one pass; a decode step is one row a sequence)


def runs(layers: Sequence[int]) -> list[range]:
    """The runs of consecutive layers in a sorted share: (0, 1, 2, 6, 7) -> [0-2, 6-7]."""
    out: list[range] = []
    for i in layers:
        if out and out[-1].stop == i:
            out[-1] = range(out[-1].start, i + 1)
        else:
            out.append(range(i, i + 1))
    return out


class PipelineTransformer(PassFront):
    """A model whose layers run on several GPUs (module docstring), seen by the engine as one model:
    new_cache, forward, forward_batch (sequences, prompt chunks and token trees in one pass),
    forward_batch_argmax, verify_tree. `stages`: one model a GPU share (GpuTransformer with its
    layers: one run, or several interleaved with the other GPUs' runs); a pass runs the runs
    (`parts`) in layer order, each on its GPU, handing the hidden states over between GPUs."""

    device = "gpu"

    def __init__(self, stages: Sequence[GpuTransformer], link: StageLink, micro_batches: int | None = None) -> None:
        self.stages, self.link = list(stages), link
        # (stage, its run of layers), in layer order
        self.parts = sorted(((k, r) for k, s in enumerate(self.stages) for r in runs(s.stage)), key=lambda p: p[1].start)
        n = self.stages[0].args.n_layers if self.stages else 0
        covered = [i for _, r in self.parts for i in r]
        if not self.stages or covered != list(range(n)):
            raise ValueError("the stages must hold every layer once, from the embedding to the head")
        self.head = self.stages[self.parts[-1][0]]  # the GPU of the last layer: the head's
        self.args = self.head.args
        self.capacity = min(s.capacity for s in self.stages)
        self.max_context = min(s.max_context for s in self.stages)
        self.passes = 0
        # micro-batches of a large pass: where the stages have GPUs of their own, two keep both busy
        # (not where a GPU holds several runs: its buffers serve each of them in turn)
        distinct = len({s.device_id for s in self.stages}) == len(self.stages) > 1 and len(self.parts) == len(self.stages)
        self.micro = micro_batches if micro_batches is not None else (MICRO_BATCHES if distinct else 1)
        if len(self.parts) > len(self.stages):
            self.micro = 1

    def close(self) -> None:
        """Frees the link's own memory (NCCL's); the stages' buffers go with the objects."""
        for stage in self.stages:
            with cupy.cuda.Device(stage.device_id):
                stage.stream.synchronize()  # no hand-over still queued
        self.link.close()

    @property
    def logits_rows(self) -> int:
        return self.head.logits_rows

    @property
    def logits(self) -> cupy.ndarray:
        return self.head.logits

    @property
    def stream(self) -> cupy.cuda.Stream:
        return self.head.stream

    @property
    def device_id(self) -> int:  # type: ignore[override]
        return self.head.device_id

    def new_cache(self, max_tokens: int) -> StagedCache:
        parts = []
        for stage in self.stages:
            with cupy.cuda.Device(stage.device_id):
                parts.append(stage.new_cache(max_tokens))
        return StagedCache(parts, [s.device_id for s in self.stages])

    def reserve_tree(self, nodes: int) -> None:
        if nodes > self.capacity:
            raise ValueError(f"a tree of {nodes} nodes exceeds the pass capacity of {self.capacity} rows")
        with cupy.cuda.Device(self.head.device_id):
            self.head.reserve_tree(nodes)

    @property
    def accounts(self) -> list[VramAccount]:
        """Each stage's VRAM plan (infer.tiers.budget.VramAccount), in stage order."""
        return [s.account for s in self.stages]

    def weight_bytes_per_token(self) -> int:
        return sum(s.weight_bytes_per_token() for s in self.stages)

    def run_pass(self, rows: Sequence[Row], out_rows: Sequence[int], to_host: bool = True) -> np.ndarray | cupy.ndarray:
        """One pass: the rows laid out once; each stage's index filled with its own caches, its
        layers queued after the previous stage's hand-over; the last stage's head. A pass of many
        rows goes as micro-batches (micro_batches()), so that a stage works on one while the next
        stage works on the one before."""
        parts = self.micro_batches(len(rows), to_host)
        self.passes += 1
        last = self.head
        if len(parts) == 1:
            slots, shape, laid = last.lay_out(rows, out_rows)
            self._queue(slots, shape, laid)
            with cupy.cuda.Device(last.device_id):
                return last.finish_pass(laid, to_host)
        wanted: list[tuple[list[int], np.ndarray]] = []  # (positions in out_rows, their logits' pinned rows)
        for lo, hi in parts:
            mine = [j for j, r in enumerate(out_rows) if lo <= r < hi]
            slots, shape, laid = last.lay_out(rows[lo:hi], [out_rows[j] - lo for j in mine])
            self._queue(slots, shape, laid)
            if mine:
                with cupy.cuda.Device(last.device_id):
                    wanted.append((mine, last.queue_logits(laid)))
        with cupy.cuda.Device(last.device_id):
            last.stream.synchronize()
        out = np.empty((len(out_rows), self.args.vocab_size), np.float32)
        for mine, logits in wanted:
            out[mine] = logits
        return out

    def micro_batches(self, rows: int, to_host: bool) -> list[tuple[int, int]]:
        """The row ranges a pass of `rows` rows runs as: `micro` ranges of at least MICRO_ROWS rows
        each when the stages have GPUs of their own (one range otherwise, or when the logits stay on
        the device). A row attends only to rows before it (a sequence's earlier positions, a tree
        node's ancestors), so ranges in row order keep every row's inputs, and its bits."""
        k = min(self.micro, rows // MICRO_ROWS)
        if k < 2 or not to_host:
            return [(0, rows)]
        bounds = [rows * i // k for i in range(k + 1)]
        return list(zip(bounds, bounds[1:], strict=False))

    def _queue(self, slots: Sequence[Row | None], shape: PassShape, out_rows: Sequence[int]) -> None:
        """A pass's rows through every stage (queued, not waited for): each stage's index filled
        with its own caches, then the runs of layers in order, each after the hand-over from the
        GPU of the run before."""
        for k, stage in enumerate(self.stages):
            with cupy.cuda.Device(stage.device_id):
                mine = [None if r is None else dataclasses.replace(r, cache=r.cache.parts[k]) for r in slots]
                with stage.stream:
                    stage.fill_pass(mine, shape, out_rows if stage is self.head else [])
        before = None
        for k, part in self.parts:
            stage = self.stages[k]
            if before is not None:
                self.link.hand_over(before, stage, shape.rows)
            with cupy.cuda.Device(stage.device_id):
                stage.run_layers(part)
            before = stage


def load_gpu_stages(model: GGUFModel, gpus: Sequence[int], vram_budgets: Sequence[str | int | None],
                    max_context: int | None = None, prefill_chunk: int = 512, batch: int = 1,
                    tree_nodes: int = 0, link: str = "auto",
                    progress: Callable[[int, int], None] | None = None,
                    enforce_budget: bool = False, planned: dict[str, int] | None = None,
                    experts: str | int = "auto", expert_stream: str | int = "auto") -> PipelineTransformer:
    """`model` split across `gpus` (each with its VRAM budget): the stages planned (plan_stages,
    balanced by the layers' bytes, each GPU's room its budget less its KV cache and pass buffers),
    each loaded on its GPU (load_gpu_transformer with its layers), joined by `link` ("nccl",
    "copy", or "auto": NCCL between distinct GPUs, a copy when they are one). A split that cannot
    fit raises VramBudgetError. enforce_budget: each GPU's memory pool capped at its stage's plan
    (not where stages share a GPU: the stand-in of tests). planned: device memory already taken on
    the first GPU in its budget (a draft model loaded there), shown in its stage's plan. experts,
    expert_stream (a mixture of experts): as load_gpu_transformer, each stage placing its own
    blocks' experts in its GPU's budget."""
    from infer.arch import check_model, refuse_cpu_only
    from infer.gpu import gpu_pass_nbytes, load_gpu_transformer
    from infer.gpu import memory as gpu_memory
    from infer.tiers.budget import VramBudgetError

    args = check_model(model)
    refuse_cpu_only(args, model.path, "the GPU engine")
    missing = missing_gpu(gpus)
    if missing:
        raise ValueError(missing)
    if len(gpus) > args.n_layers:
        raise ValueError(f"{len(gpus)} GPUs for {args.n_layers} layers: at most one GPU a layer")
    context = max_context or min(args.context_length, 4096)
    hand = choose_link(gpus, link)  # first: NCCL's memory is then in each account (NcclLink)
    try:
        rooms = []
        for g, budget in zip(gpus, vram_budgets, strict=True):
            with cupy.cuda.Device(g):
                account = gpu_memory.new_account(budget, f"{model.path.name} on GPU {g}")
            # the whole model's pass buffers (formats of every layer, the head's): an upper bound a stage
            taken = sum((planned or {}).values()) if g == gpus[0] and not rooms else 0  # the first stage's GPU holds it
            rooms.append(account.pool_limit - taken - gpu_pass_nbytes(model, args, prefill_chunk, context,
                                                                      max(batch, tree_nodes)))
        try:
            stages = plan_stages(model, args, gpus, rooms, context, prefill_chunk, batch)
        except ValueError:
            room = ", ".join(f"GPU {g} {r / 2**30:.2f} GiB" for g, r in zip(gpus, rooms, strict=True))
            raise VramBudgetError(f"{model.path.name} does not fit the budget{'s' if len(gpus) > 1 else ''} of "
                                  f"{', '.join(f'GPU {g}' for g in gpus)} split by layers "
                                  f"(room for layers and their KV caches: {room}): raise --vram-budget, lower "
                                  "-c/--ctx-size, or add a GPU") from None
        loaded: list[GpuTransformer] = []
        total = args.n_layers + len(stages)  # each stage: its embedding or head step, then its layers
        for stage, budget in zip(stages, vram_budgets, strict=True):
            before = sum(len(s.stage) + 1 for s in loaded)

            def step(done: int, _total: int, before: int = before) -> None:  # one bar over every stage's uploads
                if progress is not None:
                    progress(before + done, total)

            with cupy.cuda.Device(stage.gpu):
                # each GPU's pool capped at its stage's plan (not where stages share a GPU: the stand-in)
                loaded.append(load_gpu_transformer(model, context, budget, prefill_chunk, batch, tree_nodes=tree_nodes,
                                                   progress=step, layers=stage.layers,
                                                   planned=planned if not loaded else None, experts=experts,
                                                   expert_stream=expert_stream,
                                                   enforce_budget=enforce_budget and len(set(gpus)) == len(gpus)))
        return PipelineTransformer(loaded, hand)
    except BaseException:
        hand.close()
        raise


def missing_gpu(gpus: Sequence[int]) -> str | None:
    """What of `gpus` CuPy does not see, in one line (None: every one is there)."""
    count = cupy.cuda.runtime.getDeviceCount()
    missing = [g for g in gpus if g >= count]
    if not missing:
        return None
    return (f"--gpus {','.join(map(str, gpus))}: GPU {missing[0]} is not there "
            f"({count} GPU{'s' if count != 1 else ''} visible to CuPy)")


LINKS = ("auto", "nccl", "copy")
NCCL_SEND_RECV = 2700  # NCCL 2.7: point-to-point send and receive


def choose_link(gpus: Sequence[int], link: str = "auto") -> StageLink:
    """The hand-over for stages on `gpus`: "nccl", "copy", or "auto" (NCCL between distinct GPUs
    where CuPy has an NCCL of 2.7 or later that starts, else device copies). "nccl" that cannot
    start is a ValueError of one line."""
    if link not in LINKS:
        raise ValueError(f"the hand-over between stages is one of {', '.join(LINKS)}, not {link!r}")
    distinct = len(set(gpus)) == len(gpus) > 1
    if link == "copy" or (link == "auto" and not distinct):
        return CopyLink()
    why = nccl_problem()
    if why is None:
        try:
            return NcclLink(gpus)
        except Exception as err:  # the driver, the topology: NCCL's own errors
            why = f"NCCL did not start on GPUs {', '.join(map(str, gpus))} ({type(err).__name__}: {err})"
    if link == "nccl":
        raise ValueError(why)
    return CopyLink()


def nccl_problem() -> str | None:
    """Why NCCL cannot hand over between stages here (None: it can)."""
    try:
        from cupy.cuda import nccl
    except ImportError as err:
        return f"CuPy has no NCCL ({err})"
    if hasattr(nccl, "available") and not nccl.available:
        return "CuPy was built without NCCL"
    version = nccl.get_version() if hasattr(nccl, "get_version") else NCCL_SEND_RECV
    if version < NCCL_SEND_RECV:
        return f"NCCL {version} has no point-to-point send and receive (2.7 or later)"
    return None
