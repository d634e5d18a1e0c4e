"""The CPU as a compute tier of the streamed GPU engine: layers whose streamed matrices lie in host
RAM (tier B) are computed by the CPU for passes of few tokens, and streamed to the GPU otherwise.

Why: a streamed layer costs a copy of its bytes over the link every pass, whatever the pass holds.
For one token (plain decode) the CPU reads the same bytes from RAM faster than the link carries
them (a desktop: ~80 GB/s of RAM against ~25 GB/s of PCIe 4.0), and its cost grows with the tokens
while the copy's does not; so small passes go to the CPU and large ones (prompts, batches,
speculation trees) stream. The choice is measured at load: one layer's products on the CPU for 1
and for 8 rows, against the layer's bytes over the link bandwidth measured beside it.

The CPU and the link work at once: while the CPU computes its layers, the ring keeps copying the
other streamed layers ahead. So the CPU takes a share of the RAM layers, spread evenly among them,
sized so that its time and the link's time for the rest are about equal (`cpu_share`); a decode pass
then costs about the larger of the two instead of their sum. Passes of at most `max_rows` rows use
that split: up to the size where the CPU's share stops being cheaper than streaming every layer.

What crosses the link: activations, not weights. The CPU computes a layer's norms, matrix products
(the native kernels on the packed bytes where they lie: tier B's pinned arena or registered mapping,
the file's mapping for a matrix that is also resident) and gated activation; rope and attention
stay on the GPU beside the KV cache. Per layer: the hidden state to the host, Q/K/V to the device,
the attention output to the host, the new hidden state to the device (for a 70B, ~100 KB per token).

Numerics: the products are the CPU engine's, so a pass computed here differs from one streamed as
the two engines differ (about 1% in the logits at 8-bit types, docs/STREAMING.md). Where replies
must not depend on the load (a server whose passes change size with it), run with --cpu-tier off.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from infer import cpu_kernels
from infer.arch import ModelArgs
from infer.gguf_file import GGUFModel, TensorInfo
from infer.model import geglu
from infer.packed_weights import PackedWeights
from infer.tiers.plan import Plan, Tier, format_bytes, span
from infer.tiers.tier_b import HostTier

if TYPE_CHECKING:
    from infer.gpu.model import GpuTransformer
    from infer.gpu.passes import PassShape

MEASURE_ROWS = 8  # the second point of the cost line (the first: one row)


def eligible_layers(plan: Plan, model: GGUFModel) -> tuple[list[int], str | None]:
    """Layers the CPU may compute: some matrix in tier B, none in tier C (a tier C layer's bytes come
    through staging to the device; the rest of a tier C plan streams as before), every matrix of a
    type the native kernels take. (layers, why none) - the reason when the list is empty."""
    if not cpu_kernels.available():
        return [], "the native CPU kernels are not built (python native/build_cpu_kernels.py)"
    layers = []
    for i in range(plan.n_layers):
        mats = [t for t in plan.tensors if t.layer == i and not t.is_vector]
        if any(plan.tier[t.name] is Tier.RAM for t in mats) and \
                not any(plan.tier[t.name] is Tier.STORAGE for t in mats) and \
                all(t.ggml_type in cpu_kernels.SUPPORTED_TYPES for t in mats):
            layers.append(i)
    return layers, None if layers else "no layer has its streamed matrices all in RAM (tier B) in types the CPU kernels take"


class CpuLayers(PackedWeights):
    """The packed CPU engine's layers (infer.packed_weights) for `layers`, each matrix multiplied
    where its bytes lie: tier B's pinned arena or registered mapping, else the file's mapping (a
    matrix that is also resident on the GPU). Nothing is copied to huge pages: tier B holds them."""

    copies_to_huge_pages = False

    def __init__(self, model: GGUFModel, args: ModelArgs, plan: Plan, host: HostTier | None,
                 layers: list[int], threads: int | None = None) -> None:
        super().__init__(model, args, threads=threads)
        self.plan, self.host, self.layers = plan, host, frozenset(layers)

    def _bytes(self, info: TensorInfo) -> np.ndarray:
        if self.plan.tier.get(info.name) is Tier.RAM and self.host is not None and info.name in self.host:
            return self.host.view(info.name)
        return info.data

    def glu(self, gate_up: np.ndarray) -> np.ndarray:
        f = self.args.ffn_dim
        if self.args.arch_table.activation == "gelu_tanh":
            return geglu(gate_up[:, :f], gate_up[:, f:])
        return self.native_layers.swiglu(gate_up[:, :f], gate_up[:, f:])

    def norm(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        return self.native_layers.norm(x, weight, self.args.norm_eps)

    def products_seconds(self, i: int, rows: int, repeats: int = 3) -> float:
        """Best time of layer i's products (and norms) on `rows` random rows, after one warm-up."""
        a, L = self.args, self.layer(i)
        x = np.random.default_rng(rows).standard_normal((rows, a.dim)).astype(np.float32)
        att = np.random.default_rng(rows + 1).standard_normal((rows, a.q_dim)).astype(np.float32)
        best = float("inf")
        for k in range(repeats + 1):
            t0 = time.perf_counter()
            L.attn_qkv(self.norm(x, L.attn_norm))
            h = x + L.attn_output(att)
            L.ffn_down(self.glu(L.ffn_gate_up(self.norm(h, L.ffn_norm))))  # type: ignore[misc]
            if k:
                best = min(best, time.perf_counter() - t0)
        return best


@dataclass
class CpuTier:
    """Layers `layers.layers` run on the CPU in passes of at most `max_rows` rows."""

    layers: CpuLayers
    max_rows: int

    def takes(self, rows: int) -> bool:
        return rows <= self.max_rows

    def run_layer(self, model: GpuTransformer, i: int, shape: PassShape) -> None:
        """Layer i of `model`'s pass, the products on the CPU: model.x in place (rows 0..shape.rows)."""
        from infer.gpu import attention

        a, s, n, stream = model.args, model.shape, shape.rows, model.stream
        L, G = self.layers.layer(i), model.weights.vectors(i)
        rows = np.empty((n, a.dim), np.float32)
        cupy_asnumpy(model.x[:n], stream, rows)
        live = model.index.live_rows  # a pass's null rows (its bucket's padding) are not computed
        x = rows[live]
        qkv = np.zeros((n, s.width), np.float32)  # a null row attends with zeros through the null cache
        qkv[live] = L.attn_qkv(self.layers.norm(x, L.attn_norm))
        if L.bqkv is not None:
            qkv[live] += L.bqkv
        model.qkv[:n].set(qkv, stream=stream)
        local = a.is_local(i)
        window = a.sliding_window if local else 0
        tables = model.rope_tables_local if local else model.rope_tables
        fields = model.index.fields_local if local else model.index.fields
        j = model.null_cache.layer(i)[1]
        attention.rope_rows(model.qkv, s, *tables, j, fields, n, G["q_norm"], G["k_norm"], a.norm_eps)
        attention.attention(model.qkv, s, j, fields, n, model.max_context, model.work, model.work_rows, model.att,
                            "f32", window=window, scale=a.scores_scale)
        att = np.empty((n, a.q_dim), np.float32)
        cupy_asnumpy(model.att[:n], stream, att)
        x += self._post(L.attn_output(att[live]), L.post_attn_norm)
        gate_up = L.ffn_gate_up(self.layers.norm(x, L.ffn_norm))  # type: ignore[misc]
        x += self._post(L.ffn_down(self.layers.glu(gate_up)), L.post_ffn_norm)  # type: ignore[misc]
        rows[live] = x
        model.x[:n].set(rows, stream=stream)
        stream.synchronize()  # rows (host) are freed on return: the copy out of them must be done

    def _post(self, out: np.ndarray, post_norm: np.ndarray | None) -> np.ndarray:
        return out if post_norm is None else self.layers.norm(out, post_norm)


class ExpertBlocks(PackedWeights):
    """The packed CPU engine's blocks of a mixture-of-experts model, for their feed-forward only:
    router, routed experts and shared expert multiplied where the file's bytes lie (its mapping;
    a RAM tier's copy is the expert tiering issue's work)."""

    copies_to_huge_pages = False


class CpuExperts:
    """The feed-forward of every block of experts computed by the CPU, in every pass: the GPU keeps
    attention, the norms before it, the embeddings and the head, and holds no expert (as llama.cpp's
    `-ot exps=CPU`). Per block the hidden state crosses to the host and back (a row: 4 x dim bytes
    each way); the routed experts' bytes never cross the link. The products are the CPU engine's
    (infer.moe with the native kernels), so the logits differ from an all-CPU run only by the
    attention's GPU numerics."""

    def __init__(self, model: GGUFModel, args: ModelArgs, threads: int | None = None, why: str | None = None,
                 layers: list[int] | None = None) -> None:
        """why: why the experts are not on the GPU (said in the load report); layers: the blocks
        whose feed-forward this computes (default all; the others' experts are in VRAM)."""
        self.blocks = ExpertBlocks(model, args, threads=threads)
        self.args, self.why = args, why
        self.layers = list(range(args.n_layers)) if layers is None else list(layers)
        self._host: np.ndarray | None = None  # page-locked rows, reused by every block (run_ffn)
        # the CPU's own time in one-row passes (a decode step's blocks), from the rows' arrival on
        # the host to their copy back queued: what the bench sets against the RAM's roofline
        self.row_calls, self.row_seconds = 0, 0.0

    def describe(self) -> str:
        """One line for the load report: where the experts are and who computes them."""
        from infer.arch import EXPERT_BLOCK_KINDS, parse_tensor_name

        layers = set(self.layers)
        nbytes = sum(t.nbytes for t in self.blocks.model.tensors.values()
                     if parse_tensor_name(t.name)[1] in EXPERT_BLOCK_KINDS and parse_tensor_name(t.name)[0] in layers)
        threads = self.blocks.threads or cpu_kernels.default_threads()
        n, which = len(layers), "each block's feed-forward"
        if n < self.args.n_layers:
            which = f"the feed-forward of {n} of {self.args.n_layers} blocks ({span(layers)})"
        return (f"experts: {format_bytes(nbytes)} (routers, routed and shared experts) stay in RAM, in the file's "
                f"pages; the CPU computes {which} ({threads} threads), the GPU the rest"
                + (f" (not in VRAM: {self.why})" if self.why else ""))

    def run_ffn(self, model: GpuTransformer, i: int, shape: PassShape, rows: int | None = None) -> None:
        """Block i's feed-forward for the pass's rows (the first `rows` of them: the canonical ones
        when the GPU takes the prompt rows, infer.gpu.expert_stream): model.x in place."""
        n, stream = shape.rows if rows is None else rows, model.stream
        if n == 0:
            return
        L = self.blocks.layer(i)
        x = self._host_rows(n, model.capacity)
        cupy_asnumpy(model.x[:n], stream, x)
        started = time.perf_counter()
        live = model.index.live_rows  # null rows route too: computing them would read more experts
        if rows is not None:
            live = live[live < n]
        h = self.blocks.native_layers.norm(x[live], L.ffn_norm, self.args.norm_eps)
        x[live] += L.experts(h, self.blocks.native_layers.swiglu)  # type: ignore[misc]
        # no wait: the copy reads page-locked rows that nothing writes before the next block's copy
        # out, which the stream orders after this one
        model.x[:n].set(x, stream=stream)
        if n == 1:
            self.row_calls += 1
            self.row_seconds += time.perf_counter() - started

    def _host_rows(self, n: int, capacity: int) -> np.ndarray:
        """(n, dim) float32 page-locked host rows, the same memory for every block and pass: made
        once for the pass capacity, never replaced (a copy back out of it may still be in flight)."""
        if self._host is None:
            import cupyx

            self._host = cupyx.empty_pinned((max(capacity, n, 1), self.args.dim), np.float32)
        if n > len(self._host):
            raise ValueError(f"a pass of {n} rows exceeds the {len(self._host)} the CPU's blocks were sized for")
        return self._host[:n]

    def row_bytes(self) -> int:
        """Bytes the CPU reads for one token's feed-forward in its blocks: each block's router and
        shared expert, and the routed experts' share of its stacks (n_used of n_experts)."""
        from infer.arch import EXPERT_KINDS, SHARED_EXPERT_KINDS, parse_tensor_name

        layers, a, total = set(self.layers), self.args, 0
        for t in self.blocks.model.tensors.values():
            layer, kind = parse_tensor_name(t.name)
            if layer in layers and kind in EXPERT_KINDS:
                total += t.nbytes * a.n_experts_used // a.n_experts if kind.endswith("_exps") else t.nbytes
            elif layer in layers and kind in SHARED_EXPERT_KINDS:
                total += t.nbytes
        return total


def cupy_asnumpy(device_rows: object, stream: object, out: np.ndarray) -> None:
    """out = device_rows, waited for (the rows a pass computed on `stream`)."""
    import cupy

    cupy.asnumpy(device_rows, stream=stream, out=out)
    stream.synchronize()  # type: ignore[attr-defined]


def choose(model: GGUFModel, args: ModelArgs, plan: Plan, host: HostTier | None, mode: str | int,
           link_bytes_per_s: float, capacity: int, threads: int | None = None) -> tuple[CpuTier | None, str]:
    """The CPU tier for `mode` (parse_mode's), or None; and the line that says what was chosen and why."""
    if mode == "off":
        return None, "CPU tier: off (--cpu-tier off): every streamed layer crosses the link"
    layers, why = eligible_layers(plan, model)
    if not layers:
        return None, f"CPU tier: not used: {why}"
    cpu = CpuLayers(model, args, plan, host, layers, threads)
    n_threads = threads or cpu_kernels.default_threads()
    what = f"{len(layers)} layers with matrices in RAM"
    if isinstance(mode, int):
        rows = min(mode, capacity)
        _build(cpu)
        return CpuTier(cpu, rows), f"CPU tier: {what} computed by the CPU ({n_threads} threads) in passes of " \
                                       f"<= {rows} tokens (--cpu-tier {mode}); streamed in larger ones"
    if link_bytes_per_s <= 0:
        return None, "CPU tier: not used: the link was not measured (--cpu-tier N forces it)"
    first = layers[0]
    layer_bytes = sum(t.nbytes for t in plan.tensors if t.layer == first and plan.tier[t.name] is not Tier.VRAM)
    link_s = layer_bytes / link_bytes_per_s
    one, many = cpu.products_seconds(first, 1), cpu.products_seconds(first, MEASURE_ROWS)
    n, count = len(layers), cpu_share(len(layers), one, link_s)
    measured = (f"a layer's {format_bytes(layer_bytes)}: CPU {one * 1e3:.1f} ms for 1 token, "
                f"{many * 1e3:.1f} ms for {MEASURE_ROWS}; link {link_s * 1e3:.1f} ms")
    if count == 0:
        return None, f"CPU tier: not used: the link is so much faster than the CPU that it takes every layer ({measured})"
    # with `count` layers on the CPU a pass gains while their time stays under streaming all n
    rows = crossover_rows(one, many, n * link_s / count, capacity)
    cpu.layers = frozenset(spread(layers, count))
    _build(cpu)
    split_s, stream_s = max(count * one, (n - count) * link_s), n * link_s
    return CpuTier(cpu, rows), (
        f"CPU tier: {count} of the {what} computed by the CPU ({n_threads} threads) in passes of <= {rows} "
        f"tokens while the link streams the other {n - count}; every one streamed in larger passes "
        f"({measured}; predicted {split_s * 1e3:.0f} ms of a token's pass for these layers against "
        f"{stream_s * 1e3:.0f} ms streaming them all)")


def cpu_share(n_layers: int, one_row_s: float, link_s: float) -> int:
    """How many of n_layers streamed layers the CPU should compute in a one-token pass, so that it
    and the link (copying the others meanwhile) finish together: the count k minimizing
    max(k * one_row_s, (n_layers - k) * link_s)."""
    if one_row_s <= 0:
        return n_layers
    best = n_layers * link_s / (one_row_s + link_s)
    candidates = {max(0, min(n_layers, int(best))), max(0, min(n_layers, int(best) + 1))}
    return min(sorted(candidates), key=lambda k: (max(k * one_row_s, (n_layers - k) * link_s), k))


def spread(layers: list[int], count: int) -> list[int]:
    """`count` of `layers` spread evenly over them (so the link always has a streamed layer to copy
    ahead while the CPU works)."""
    n = len(layers)
    return [layers[(2 * j + 1) * n // (2 * count)] for j in range(count)]


def _build(cpu: CpuLayers) -> None:
    for i in cpu.layers:  # now, not in the first pass
        cpu.layer(i)


def crossover_rows(one_row_s: float, many_rows_s: float, link_s: float, capacity: int,
                   many: int = MEASURE_ROWS) -> int:
    """The most rows (up to `capacity`) for which the CPU's time, on the line through (1, one_row_s)
    and (many, many_rows_s), is at most the link's; 0 when not even one row."""
    if one_row_s > link_s:
        return 0
    per_row = max(many_rows_s - one_row_s, 0.0) / (many - 1)
    if per_row == 0:
        return capacity
    return int(min(capacity, 1 + (link_s - one_row_s) // per_row))

