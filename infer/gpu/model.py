"""The Llama/Qwen2/Qwen3 forward pass on the GPU: one layer recipe for the N rows of a pass, whatever they
are — a sequence's next token (decode), one token of each of many sequences (a batch), a prompt
chunk, a token tree's nodes, or a mix — over weights from a provider (infer.gpu.weights): all
resident in VRAM, or streamed through the 3-tier pipeline.

A pass reads each weight once for all its rows: the products take the rows' 8-bit activations at
once (infer/kernels/qmm.cu), the attention kernels each row's own cache, position and span. Every
kernel computes a row in an order that does not depend on the pass, so a row's logits are the same
bits alone, in a batch of any size, as a tree node or as a scored prompt position (docs/GPU.md).
Prompt rows (prompt tokens whose logits nobody reads) take float16 tensor-core products instead
(infer/kernels/pmm.cu), in a region of the pass of their own; their bits do not depend on the pass
either.

The rows of a pass live on the device (infer.gpu.passes.PassIndex); the pass's launches are
captured as CUDA graphs per row bucket (runs of resident layers, each streamed layer, the head)
and replayed. The generation loops (infer/gpu/generation.py, a mixin) sample on the device and
feed the sampled token to the next step without the host (`advance`), so only token ids come back.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import cupy
import cupyx
import numpy as np

from infer.arch import POST_NORM_KINDS, ModelArgs, RopeScaling
from infer.gpu import attention, kernels, ops, products, stream_graph
from infer.gpu.activations import Inputs, layer_inputs
from infer.gpu.attention import AttentionShape
from infer.gpu.cache import GpuKVCache
from infer.gpu.experts import GpuExperts, NextNorm
from infer.gpu.front import PassFront
from infer.gpu.generation import DeviceGeneration
from infer.gpu.graphs import GraphCache
from infer.gpu.ops import GpuMatrix
from infer.gpu.passes import PassIndex, PassShape, Row, bucket_of, pass_layout
from infer.gpu.weights import GpuLayer, GpuWeightSource
from infer.layers import Rope
from infer.tiers.budget import VramAccount

if TYPE_CHECKING:
    from infer.tiers.cpu_tier import CpuExperts, CpuTier

F32 = cupy.float32
EMBED = -1  # segment item: the token embedding
ATTENTION_WORK_BYTES = 32 << 20  # attention partials of this many bytes of rows at a time
LOGITS_ROWS = 64  # rows of logits one head pass holds (a scored prompt comes in blocks of it)


def attention_work_rows(shape: AttentionShape, capacity: int, max_context: int) -> int:
    per_row = attention.attention_work_nbytes(shape, 1, max_context)
    return max(1, min(capacity, ATTENTION_WORK_BYTES // per_row))


def pass_buffers_nbytes(args: ModelArgs, formats: list[dict], output_act: str, capacity: int, max_context: int,
                        logits_rows: int = LOGITS_ROWS, head: bool = True) -> int:
    """Device bytes of a GpuTransformer's pass buffers (what __init__ allocates besides the rotary
    tables): for the VRAM plan (`head`: the logits' buffers, a pipeline's last stage's)."""
    a = args
    shape = _shape(a, Rope(a, None))
    wanted = [w for f in formats for w in layer_inputs(a, f)]
    rows = capacity
    post = rows * a.dim if has_post_norms(a) else 0  # a block's output before its post-norm (Gemma)
    hidden = 4 * ((rows + 1) * a.dim + rows * (shape.width + a.q_dim + 2 * a.ffn_dim) + post)
    work = attention.attention_work_nbytes(shape, attention_work_rows(shape, capacity, max_context), max_context)
    head = Inputs.planned_nbytes(logits_rows, [("out", output_act, a.dim)]) + 4 * logits_rows * a.vocab_size if head else 0
    index = PassIndex.nbytes_for(capacity)
    return (hidden + Inputs.planned_nbytes(rows, wanted) + work + head + index + GpuKVCache.nbytes_for(a, 1, 1)
            + products.SPLIT_SCRATCH_BYTES)


def has_post_norms(a: ModelArgs) -> bool:
    return any(kind in a.arch_table.required for kind in POST_NORM_KINDS)


def _shape(a: ModelArgs, rope: Rope) -> AttentionShape:
    return AttentionShape(a.n_heads, a.n_kv_heads, a.head_dim, rope.n_pairs, a.rope_neox)


class GpuTransformer(PassFront, DeviceGeneration):
    """new_cache(max_tokens), forward(tokens, cache, all_logits) and forward_batch(batch) -> NumPy
    logits, as infer.model.Transformer; verify_tree for token trees; generate_iter, draft_chain and
    decode_batch decode on the device."""

    device = "gpu"
    skip: frozenset[int] = frozenset()  # layers left out (infer.layerskip: a self-draft), none by default
    cpu_tier: CpuTier | None = None  # streamed layers the CPU computes in small passes (infer.tiers.cpu_tier)
    cpu_experts: CpuExperts | None = None  # a mixture of experts: the blocks' feed-forward on the CPU (same)
    gpu_experts: GpuExperts | None = None  # or on the GPU, its experts in VRAM (infer.gpu.experts)

    def __init__(self, args: ModelArgs, weights: GpuWeightSource, rope_freq_factors: np.ndarray | None,
                 max_context: int, prefill_chunk: int = 512, logits_rows: int = LOGITS_ROWS,
                 layers: Sequence[int] | None = None) -> None:
        """layers: only these blocks (a GPU's share of a pipeline across GPUs, infer.gpu.stages: one
        run of layers or several): the GPU with block 0 embeds the tokens, the one with the last
        block runs the head; a pass's hidden states come and go through `x`."""
        self.args = args
        self.weights = weights
        self.stage = tuple(range(args.n_layers)) if layers is None else tuple(sorted(layers))
        self.device_id = cupy.cuda.Device().id  # the GPU its buffers and weights are on
        self.embeds, self.heads = 0 in self.stage, args.n_layers - 1 in self.stage
        self.capacity = prefill_chunk  # rows a pass holds: a prompt chunk, a batch, a tree
        self.prefill_chunk = prefill_chunk
        self.max_context = max_context
        self.rope = Rope(args, rope_freq_factors)
        # Gemma: the embeddings times sqrt(width), as the CPU engine computes it
        self.embed_scale = float(np.sqrt(np.float32(args.dim))) if args.arch_table.embed_scale else 1.0
        self.shape = _shape(args, self.rope)
        self.shape.check()
        self.account: VramAccount | None = None  # the VRAM budget it was planned in, when loaded with one
        self.passes = 0  # passes run: device logits of pass k are valid while this is k
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.graphs = GraphCache(self.stream)
        for name in kernels.SOURCES:  # compiled before any capture (products: the model's formats only)
            if name not in ("qmm", "pmm"):
                kernels.module(name)
        matrices = {(f.fmt, f.cols) for i in self.stage for f in weights.formats(i).values()}
        if self.heads:
            matrices.add((weights.output.fmt, weights.output.cols))  # type: ignore[union-attr]
        products.prepare_kernels(matrices)
        attention.prepare(self.shape)
        a, C = args, prefill_chunk
        cos, sin = self.rope.angles(np.arange(max_context))
        with self.stream:
            self.rope_tables = (cupy.asarray(cos.astype(np.float32)), cupy.asarray(sin.astype(np.float32)))
            self.rope_tables_local = self.rope_tables
            if args.rope_base_local:  # Gemma 3's local layers: their own base, unscaled (infer.model)
                local = Rope(dataclasses.replace(args, rope_base=args.rope_base_local, rope_scaling=RopeScaling()), None)
                cos, sin = local.angles(np.arange(max_context))
                self.rope_tables_local = (cupy.asarray(cos.astype(np.float32)), cupy.asarray(sin.astype(np.float32)))
            self.post = cupy.zeros((C, a.dim), F32) if has_post_norms(args) else None
            self.null_cache = GpuKVCache.allocate(args, 1, 1, self.stream, self.stage)
            self.index = PassIndex(C, self.null_cache, self.stream)
            self.x = cupy.zeros((C + 1, a.dim), F32)  # hidden states; row C: the null row
            self.qkv = cupy.zeros((C, self.shape.width), F32)
            self.att = cupy.zeros((C, a.q_dim), F32)
            self.gu = cupy.zeros((C, 2 * a.ffn_dim), F32)  # [gate | up]
            formats = [weights.formats(i) for i in self.stage]
            self.inputs = Inputs(args, C, [w for f in formats for w in layer_inputs(args, f)])
            self.split = cupy.zeros(products.SPLIT_SCRATCH_BYTES // 4, F32)  # group sums of products that split K
            self.work_rows = attention_work_rows(self.shape, C, max_context)
            self.work = cupy.zeros(attention.attention_work_nbytes(self.shape, self.work_rows, max_context) // 4, F32)
            self._make_head(logits_rows)
        self.stream.synchronize()
        self._segments = self._plan_segments()

    def _make_head(self, rows: int) -> None:
        self.logits_rows = rows
        if not self.heads:  # a stage before the last: its passes end with the hidden states
            self.logits = cupy.zeros((0, self.args.vocab_size), F32)
            return
        self.head_inputs = Inputs(self.args, rows, [("out", self.output.act, self.args.dim)])
        self.logits = cupy.zeros((rows, self.args.vocab_size), F32)

    @property
    def token_embd(self) -> GpuMatrix:
        return self.weights.token_embd

    @property
    def output(self) -> GpuMatrix:
        return self.weights.output

    @property
    def layers(self) -> list[GpuLayer]:
        """The resident layers (kernel timings and tests); streamed layers exist one at a time."""
        return [self.weights.layer(i) for i in self.stage if self.weights.is_resident(i)]

    def weight_bytes_per_token(self) -> int:
        """Bytes of weights one pass reads from VRAM (all layer matrices and the output)."""
        return self.weights.bytes_per_token()[0]

    def source_bytes_per_token(self) -> int:
        """The same in GGUF bytes (what llama.cpp reads per token)."""
        return self.weights.bytes_per_token()[1]

    def new_cache(self, max_tokens: int) -> GpuKVCache:
        if max_tokens > self.max_context:
            raise ValueError(f"a cache of {max_tokens} positions exceeds the model's context of {self.max_context} "
                             "(raise -c/--ctx-size)")
        cache = GpuKVCache.allocate(self.args, max_tokens, self.capacity, self.stream, self.stage)
        self.stream.synchronize()
        return cache

    def reserve_tree(self, nodes: int) -> None:
        """Sizes the logits of one pass for token trees of up to `nodes` nodes (before the first pass:
        the head's buffers and graphs are made anew)."""
        if nodes > self.capacity:
            raise ValueError(f"a tree of {nodes} nodes exceeds the pass capacity of {self.capacity} rows")
        if nodes > self.logits_rows:
            with self.stream:
                self._make_head(nodes)
            self.stream.synchronize()
            self.graphs.drop("head")

    def use_gpu_experts(self, experts: GpuExperts) -> None:
        """Computes the blocks of experts on the device with `experts` (their kernels compiled now,
        before any capture): every resident layer then replays in the pass's graphs."""
        products.prepare_kernels(experts.matrix_shapes())
        self.gpu_experts = experts
        self._segments = self._plan_segments()
        self.graphs.drop("run")
        self.graphs.drop(stream_graph.KIND)

    def without_layers(self, skip: frozenset[int]) -> GpuTransformer:
        """A view of this model with layers `skip` left out (a self-draft), sharing its weights and
        buffers, with its own segments and graphs (its passes run between this model's)."""
        view = copy.copy(self)
        view.skip = frozenset(skip)
        view._segments = view._plan_segments()
        view.graphs = GraphCache(self.stream)
        return view

    # ------------------------------------------------------------------ the layer recipe
    def _layer(self, i: int, L: GpuLayer, shape: PassShape, normed: bool = False,
               then: GpuLayer | None = None) -> bool:
        """Layer i for the rows of a pass of `shape`: self.x in place. `normed`: its input norm was
        written by the layer before; `then`: the next layer, whose input norm this one's last launch
        may take over (a block of experts on the device: GpuExperts.run_ffn); whether it did."""
        self._attention(i, L, shape, normed)
        if L.ffn_down is None:  # a block of experts: its feed-forward on the device or by the CPU
            experts = self._experts_of(i)
            if isinstance(experts, GpuExperts):
                return experts.run_ffn(self, i, shape, self._next_norm(then, shape))
            experts.run_ffn(self, i, shape)
            return False
        self._feed_forward(L, shape)
        return False

    def _next_norm(self, L: GpuLayer | None, shape: PassShape) -> NextNorm | None:
        """Layer L's attention input norm as a NextNorm (None: no layer, or more than one launch)."""
        if L is None:
            return None
        outputs = self.inputs.norm_outputs("attn", [L.attn_q.act, L.attn_k.act, L.attn_v.act], half=shape.prompt > 0)
        return None if outputs is None else NextNorm(L.attn_norm, self.args.norm_eps, outputs)

    def _experts_of(self, i: int) -> GpuExperts | CpuExperts:
        """Who computes block i's feed-forward of experts: the device (its experts in VRAM) or the CPU."""
        if self.gpu_experts is not None and i in self.gpu_experts.blocks:
            return self.gpu_experts
        assert self.cpu_experts is not None, f"block {i} has experts and no one to compute them"
        return self.cpu_experts

    def _attention(self, i: int, L: GpuLayer, shape: PassShape, normed: bool = False) -> None:
        """The attention half of layer i: self.x += the attention of its normed rows (`normed`: written
        by the layer before)."""
        a, s, ix, inputs, n = self.args, self.shape, self.index, self.inputs, shape.rows
        half = shape.prompt > 0  # the prompt rows' float16 inputs are wanted too
        local = a.is_local(i)
        window = a.sliding_window if local else 0
        xs = inputs.normed(self.x, L.attn_norm, "attn", [L.attn_q.act, L.attn_k.act, L.attn_v.act], n, half=half,
                           written=normed)
        qkv = self.qkv.reshape(-1)
        for parts, row0 in L.attn_qkv():
            rows = sum(m.rows for m in parts)
            self._product(parts, xs[parts[0].act], "attn", qkv[row0:], shape, s.width,
                          bias=None if L.bqkv is None else L.bqkv[row0 : row0 + rows])
        tables = self.rope_tables_local if local else self.rope_tables
        fields = ix.fields_local if local else ix.fields
        j = self.null_cache.layer(i)[1]  # the layer's index among the cache's global or local layers
        attention.rope_rows(self.qkv, s, *tables, j, fields, n, L.q_norm, L.k_norm, a.norm_eps)
        att = inputs.get("att", L.attn_output.act) if L.attn_output.act in ops.EIGHT_BIT else self.att
        int8 = att if isinstance(att, ops.Int8Act) else None
        scale = a.scores_scale
        if half and attention.uses_prompt_attention(s, window > 0) and \
                products.uses_pmm(L.attn_output.fmt, L.attn_output.cols):
            # the canonical rows through attention.cu, the prompt rows on the tensor cores (their
            # float16 output is all the prompt products of wo take)
            c = shape.canonical
            if c:
                attention.attention(self.qkv, s, j, fields, c, self.max_context, self.work, self.work_rows,
                                    self.att, L.attn_output.act, int8, window=window, scale=scale)
            attention.prompt_attention(self.qkv, s, j, fields, c, shape.prompt, inputs.half("att"), scale=scale,
                                       window=window)
        else:
            attention.attention(self.qkv, s, j, fields, n, self.max_context, self.work, self.work_rows, self.att,
                                L.attn_output.act, int8, inputs.half("att") if half else None, window=window, scale=scale)
        self._residual_product(L.attn_output, att, "att", shape, L.post_attn_norm)

    def _feed_forward(self, L: GpuLayer, shape: PassShape) -> None:
        """The feed-forward half of a dense layer: self.x += the gated products of its normed rows."""
        a, inputs, n = self.args, self.inputs, shape.rows
        half = shape.prompt > 0
        assert L.ffn_gate is not None and L.ffn_up is not None and L.ffn_down is not None
        xs = inputs.normed(self.x, L.ffn_norm, "ffn", [L.ffn_gate.act, L.ffn_up.act], n, half=half)
        gu = self.gu.reshape(-1)
        for parts, row0 in L.ffn_gate_up():
            self._product(parts, xs[parts[0].act], "ffn", gu[row0:], shape, 2 * a.ffn_dim)
        ff = inputs.get("ff", L.ffn_down.act)
        ff16 = inputs.half("ff") if half else None
        activation = a.arch_table.activation
        if isinstance(ff, ops.Int8Act):
            ops.glu_round(self.gu, a.ffn_dim, n, L.ffn_down.act, int8=ff, y16=ff16, activation=activation)
        else:
            ops.glu_round(self.gu, a.ffn_dim, n, L.ffn_down.act, y=ff, y16=ff16, activation=activation)
        self._residual_product(L.ffn_down, ff, "ff", shape, L.post_ffn_norm)

    def _residual_product(self, m: GpuMatrix, x: products.Input, key: str, shape: PassShape,
                          post_norm: cupy.ndarray | None) -> None:
        """self.x += m times input `key`: fused into the product, or (a post-norm, Gemma) the product
        into self.post, normalised and added."""
        if post_norm is None:
            self._product([m], x, key, self.x, shape, self.args.dim, residual=self.x)
            return
        self._product([m], x, key, self.post, shape, self.args.dim)
        ops.norm_add(self.post, post_norm, self.x, shape.rows, self.args.dim, self.args.norm_eps)

    def _product(self, parts: list[GpuMatrix], x: products.Input, key: str, y: cupy.ndarray, shape: PassShape, ldy: int,
                 bias: cupy.ndarray | None = None, residual: cupy.ndarray | None = None) -> None:
        """y (row v at y[v * ldy:]) = the parts times input `key` for the pass's rows: the canonical
        region through the canonical products, the prompt region through the prompt products (its
        float16 inputs), or every row canonically where the matrix has no prompt product."""
        m0 = parts[0]
        if not shape.prompt or not products.uses_pmm(m0.fmt, m0.cols):
            products.product(parts, x, y, shape.rows, ldy=ldy, bias=bias, residual=residual, scratch=self.split)
            return
        c = shape.canonical
        if c:
            products.product(parts, x, y, c, ldy=ldy, bias=bias, residual=residual, scratch=self.split)
        at = (lambda a: a[c:]) if y.ndim == 2 else (lambda a: a[c * ldy :])
        products.prompt_product(parts, self.inputs.half(key)[c:], at(y), shape.prompt, ldy=ldy, bias=bias,
                                residual=None if residual is None else at(residual))

    def _head(self, m: int, sample: bool, advance: bool) -> None:
        """Logits of the pass's rows out_rows[0..m) into self.logits; with `sample` each row's next
        token drawn (and with `advance` the rows moved on: a decode step)."""
        a, d, out = self.args, self.index.d, self.output
        xs = self.head_inputs.normed(self.x, self.weights.output_norm, "out", [out.act], m, src_rows=d["out_rows"])
        products.product([out], xs[out.act], self.logits, m, ldy=a.vocab_size, scratch=self.split)
        if sample:
            ops.sample_rows(self.logits, m, a.vocab_size, d["out_rows"], d["temps"], d["seeds"], d["tok"], d["pos"],
                            d["slot"], d["base"], d["anc_off"], d["hist"], advance)

    def _plan_segments(self) -> list[tuple[bool, list[int]]]:
        """A pass as (capturable, items): runs of the embedding and resident layers, which replay as
        one CUDA graph each, and single streamed layers (or blocks of experts: the CPU's part waits
        for the host, which no graph can)."""
        items = [EMBED] if self.embeds else []
        items += [i for i in self.stage if i not in self.skip]
        segments: list[tuple[bool, list[int]]] = []
        for item in items:
            resident = item == EMBED or (self.weights.is_resident(item) and (
                "ffn_down" in self.weights.formats(item) or (self.gpu_experts is not None and item in self.gpu_experts.blocks)))
            # a graph never spans a gap in a GPU's share of the layers (other GPUs' layers run there)
            follows = bool(self.skip) or (bool(segments) and item - segments[-1][1][-1] == 1)
            if resident and segments and segments[-1][0] and follows:
                segments[-1][1].append(item)
            else:
                segments.append((resident, [item]))
        return segments

    def _launch(self, items: list[int], shape: PassShape) -> None:
        """The launches of a run of resident items (one graph): a layer may normalise the next one's
        input in its last launch."""
        normed = False
        for k, item in enumerate(items):
            if item == EMBED:
                ops.embed(self.token_embd, self.index.d["tok"], shape.rows, self.x, self.embed_scale)
                normed = False
                continue
            after = items[k + 1] if k + 1 < len(items) else None
            normed = self._layer(item, self.weights.layer(item), shape, normed,
                                 self.weights.layer(after) if after is not None else None)

    def _run_layers(self, part: range | None = None) -> None:
        """Every layer for the rows in the index (queued on self.stream); `part`: only those layers
        (a run of this GPU's share of a pipeline)."""
        shape = self.index.shape
        on_cpu = self.cpu_tier.layers.layers if self.cpu_tier is not None and self.cpu_tier.takes(shape.rows) \
            else frozenset()
        if self.cpu_tier is not None and not self.skip:  # a view that skips layers streams none (a self-draft)
            self.weights.leave_to_cpu(on_cpu)
        if part is None and stream_graph.can_capture(self):  # a streamed pass as one graph (opt-in)
            stream_graph.run_pass(self, shape)
            return
        for s, (capturable, items) in enumerate(self._segments):
            if part is not None and max(items[-1], 0) not in part:  # EMBED: with block 0
                continue
            if capturable:
                self.graphs.replay(("run", s, shape), None, lambda items=items: self._launch(items, shape))
                continue
            for i in items:  # streamed: its matrices copied and repacked now, its kernels replayed
                if i in on_cpu:  # or computed where its bytes lie (infer.tiers.cpu_tier)
                    self.cpu_tier.run_layer(self, i, shape)  # type: ignore[union-attr]
                    continue
                L = self.weights.layer(i)
                if L.ffn_down is None:  # a block whose experts the CPU computes: its attention half replays
                    self.graphs.replay(("attn", i, shape), L.addresses(), lambda i=i, L=L: self._attention(i, L, shape))
                    self._host_experts(i, shape)  # then the host's part (no graph can hold it)
                    continue
                self.graphs.replay(("layer", i, shape), L.addresses(), lambda i=i, L=L: self._layer(i, L, shape))

    def _host_experts(self, i: int, shape: PassShape) -> None:
        """The feed-forward of block i, whose experts the CPU holds: a long prompt's rows here with
        the block streamed in (infer.gpu.expert_stream), the other rows by the CPU, or split by
        pick between the CPU and experts fetched to the GPU (infer.gpu.expert_split)."""
        cpu, gpu = self.cpu_experts, self.gpu_experts
        assert cpu is not None, f"block {i} has experts and no one to compute them"
        streamed = gpu is not None and gpu.streams(i, self.index.live_prompt_rows)
        rows = shape.canonical if streamed else shape.rows
        stream_in = (lambda: gpu.run_streamed(self, i, shape)) if streamed else None  # type: ignore[union-attr]
        if gpu is not None and gpu.splits(i):
            gpu.split.run(self, i, rows, cpu, then=stream_in)  # type: ignore[union-attr]  # the streamed rows overlap the CPU's part
            return
        cpu.run_ffn(self, i, shape, rows=rows)
        if stream_in is not None:
            stream_in()

    def _run_head(self, m: int, sample: bool = False, advance: bool = False) -> None:
        b = bucket_of(m, self.logits_rows)
        self.graphs.replay(("head", b, sample, advance), None, lambda: self._head(b, sample, advance))

    def run_pass(self, rows: Sequence[Row], out_rows: Sequence[int], to_host: bool = True) -> np.ndarray | cupy.ndarray:
        """One pass over the layers for `rows` (at most the capacity); the logits of rows `out_rows`
        (len, vocab): NumPy, or with to_host=False a view of the device block when they fit it
        (valid until the next pass)."""
        slots, shape, out_rows = self.lay_out(rows, out_rows)
        with self.stream:
            self.fill_pass(slots, shape, out_rows)
            self._run_layers()
            return self.finish_pass(out_rows, to_host)

    # ------------------------------------------------------------------ a pass in steps (a pipeline's stages)
    def lay_out(self, rows: Sequence[Row], out_rows: Sequence[int]) -> tuple[list[Row | None], PassShape, list[int]]:
        """Where the rows of a pass go (pass_layout) and where the rows wanting logits went; the
        rows' caches learn which slots the pass writes."""
        slots, shape, where = pass_layout(rows, self.capacity)
        for row in rows:
            row.cache.wrote(row.slot + 1)
        return slots, shape, [where[r] for r in out_rows]

    def fill_pass(self, slots: Sequence[Row | None], shape: PassShape, out_rows: Sequence[int]) -> None:
        """The pass's rows into the device index (on self.stream)."""
        self.index.fill(slots, shape, out_rows[: self.logits_rows])
        self.passes += 1

    def run_layers(self, part: range | None = None) -> None:
        """The pass's layers (of this GPU's share; `part`: only those), queued on self.stream."""
        with self.stream:
            self._run_layers(part)

    def queue_logits(self, out_rows: Sequence[int]) -> np.ndarray:
        """The head over the pass's rows `out_rows` (as laid out), their logits copied to pinned host
        memory, queued and not waited for: valid once self.stream has run (a pipeline's micro-batch)."""
        out = cupyx.empty_pinned((len(out_rows), self.args.vocab_size), np.float32)
        with self.stream:
            for j0 in range(0, len(out_rows), self.logits_rows):
                part = out_rows[j0 : j0 + self.logits_rows]
                if j0:
                    self.index.set_out_rows(part)
                self._run_head(len(part))
                cupy.asnumpy(self.logits[: len(part)], stream=self.stream, out=out[j0 : j0 + len(part)])
        return out

    def finish_pass(self, out_rows: Sequence[int], to_host: bool) -> np.ndarray | cupy.ndarray:
        """The head over the hidden states of the pass's rows `out_rows` (as laid out): their logits
        as run_pass returns them (pinned host memory: the rows come back at the link's speed in one
        copy; a server step of 32 sequences brings 16 MB of logits back)."""
        if not self.heads:
            raise ValueError("a GPU's share without the last layer has no head: run it in its pipeline "
                             "(infer.gpu.stages.PipelineTransformer)")
        m = len(out_rows)
        if not to_host and m <= self.logits_rows:
            with self.stream:
                self._run_head(m)
            return self.logits[:m]
        out = self.queue_logits(out_rows)
        self.stream.synchronize()
        return out
