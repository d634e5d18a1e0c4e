"""The Llama/Qwen2 forward pass on the GPU: the same function as infer.model.Transformer (same
ModelArgs, rotary tables from the same infer.model.Rope, float16 KV cache, and by default the inputs
of every matrix product rounded as llama.cpp's CPU rounds them), over weights from a provider
(infer.gpu.weights): all resident in VRAM, or streamed through the 3-tier pipeline.

- one row (a sequence's next token): quantized GEMVs (integer dp4a kernels on 8-bit activations
  where the format has one) and fused kernels summing in double, all buffers preallocated, token and
  position read from device memory. Runs of resident layers, with the embedding and the output head
  and sampling, are captured once as CUDA graphs and replayed; streamed layers run between them.
  Only token ids come back to the host when generating.
- many rows (a prompt chunk, or one token of each of many sequences): each matrix as float16 (a kept
  copy when the VRAM budget has room for it, else dequantized into a scratch) multiplied with cuBLAS
  (float32 accumulation); attention per sequence over its own cache.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import cupy
import numpy as np

from infer.arch import ModelArgs
from infer.gpu import ops
from infer.gpu.activations import RoundedInputs, normed16, rounded16
from infer.gpu.attention import rows_attention
from infer.gpu.ops import GpuMatrix
from infer.gpu.tree import CAPACITY_STEP, TreeLogits, TreeRunner, verify_tree
from infer.gpu.weights import GpuLayer, GpuWeightSource, HalfCopies
from infer.model import Rope, check_batch, tree_layout
from infer.tiers.budget import LOGITS_ROWS, VramAccount

F32, F16 = cupy.float32, cupy.float16
_RUNNER_GENERATIONS = itertools.count()  # tells a runner's graphs from an earlier runner's in a cache
HEAD = -1  # segment item: the output norm and head (and sampling); EMBED: the token embedding
EMBED = -2


@dataclass
class Tree:
    """A token tree's rows on the device: positions, cache slots, attention mask (N, start + N)."""

    positions: cupy.ndarray
    slots: cupy.ndarray
    allowed: cupy.ndarray


@dataclass
class GpuKVCache:
    """KV cache and decode state of one sequence. `length` = positions filled, as in infer.model.KVCache."""

    keys: cupy.ndarray  # (n_layers, n_kv_heads, max_tokens, head_dim) float16
    values: cupy.ndarray
    max_tokens: int
    n_splits: int
    tok: cupy.ndarray  # int32[1]: the token the next decode step processes
    pos: cupy.ndarray  # int32[1]: its position
    tokens: cupy.ndarray  # int32[max_tokens + 1]: tokens[p] = the token at position p (sampled ones)
    scores: cupy.ndarray  # decode attention work buffers
    part_o: cupy.ndarray
    part_ml: cupy.ndarray
    length: int = 0
    graphs: dict[tuple, object] = field(default_factory=dict)
    stream: cupy.cuda.Stream | None = None  # the model's: work on the cache is ordered on it

    def accept(self, nodes: Sequence[int]) -> None:
        """After forward_tree: keep tree nodes `nodes` (a root-to-node path) as the positions after
        `length`, and count them in (as infer.model.KVCache.accept)."""
        src = self.length + np.asarray(nodes, dtype=np.int64)
        dst = self.length + np.arange(len(nodes))
        if (src != dst).any():
            with self.stream or cupy.cuda.get_current_stream():
                take, put = cupy.asarray(src), cupy.asarray(dst)
                self.keys[:, :, put] = self.keys[:, :, take]  # the right side is gathered first
                self.values[:, :, put] = self.values[:, :, take]
        self.length += len(nodes)


class GpuTransformer:
    """new_cache(max_tokens), forward(tokens, cache, all_logits) and forward_batch(batch) -> NumPy
    logits, as infer.model.Transformer; generate_iter decodes greedily (or sampling on the device)
    with CUDA graphs."""

    device = "gpu"
    skip: frozenset[int] = frozenset()  # layers left out (infer.layerskip: a self-draft), none by default

    def __init__(self, args: ModelArgs, weights: GpuWeightSource, rope_freq_factors: np.ndarray | None,
                 max_context: int, prefill_chunk: int = 512, int8_dot: bool = True,
                 half_copies: int | None = None) -> None:
        self.args = args
        self.weights = weights
        self.prefill_chunk = prefill_chunk
        # prompts up to this many tokens run through the decode kernels (no dequantization, exact
        # sums): cheaper for a few tokens, and the CPU's exact numerics where a test needs them
        self.gemv_prefill_max = 4
        self.max_context = max_context
        self.rope = Rope(args, rope_freq_factors)
        self.half = HalfCopies(half_copies)
        self.account: VramAccount | None = None  # the VRAM budget it was planned in, when loaded with one
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self._segments = self._plan_segments()
        self._tree_runner: TreeRunner | None = None  # token-tree verification's buffers and graphs
        self._tree_capacity = 0
        a = args
        cos, sin = self.rope.angles(np.arange(max_context))
        with self.stream:
            self._rope_tables = (cupy.asarray(cos.astype(np.float32)), cupy.asarray(sin.astype(np.float32)))
            # decode activations (one token)
            self.h = cupy.zeros(a.dim, F32)
            self.qkv = cupy.zeros(a.q_dim + 2 * a.kv_dim, F32)
            self.q = self.qkv[: a.q_dim]
            self.k = self.qkv[a.q_dim : a.q_dim + a.kv_dim]
            self.v = self.qkv[a.q_dim + a.kv_dim :]
            self.att = cupy.zeros(a.q_dim, F32)
            self.gate = cupy.zeros(a.ffn_dim, F32)
            self.up = cupy.zeros(a.ffn_dim, F32)
            self.ff = cupy.zeros(a.ffn_dim, F32)
            self.logits = cupy.zeros(a.vocab_size, F32)
            # decode GEMVs on the 8-bit form of q8_0/q8_k activations (dp4a integer dot products)
            # where the weight format has such a kernel; the same numbers (both sum in double). The
            # float kernels read x as float32, 4x the bytes (docs/GPU.md).
            self.inputs = RoundedInputs(args, int8_dot)
            for i in range(a.n_layers):
                self.inputs.plan_layer(weights.formats(i))
            self.inputs.plan("out", [self.output.act], a.dim)
        self.stream.synchronize()

    @property
    def token_embd(self) -> GpuMatrix:
        return self.weights.token_embd

    @property
    def output(self) -> GpuMatrix:
        return self.weights.output

    @property
    def layers(self) -> list[GpuLayer]:
        """The resident layers (kernel timings and tests); streamed layers exist one at a time."""
        return [self.weights.layer(i) for i in range(self.args.n_layers) if self.weights.is_resident(i)]

    @property
    def int8_dot(self) -> bool:
        return self.inputs.int8_dot

    def set_int8_dot(self, enabled: bool) -> None:
        """Switches the decode GEMVs between the float and the integer (dp4a) kernels."""
        with self.stream:
            self.inputs.set_int8(enabled)
        self.stream.synchronize()

    def weight_bytes_per_token(self) -> int:
        """Bytes of weights one decode step reads from VRAM (all layer matrices and the output)."""
        return self.weights.bytes_per_token()[0]

    def source_bytes_per_token(self) -> int:
        """The same in GGUF bytes (what llama.cpp reads per token)."""
        return self.weights.bytes_per_token()[1]

    # ------------------------------------------------------------------ cache
    def new_cache(self, max_tokens: int) -> GpuKVCache:
        a = self.args
        if max_tokens > self.max_context:
            raise ValueError(f"a cache of {max_tokens} positions exceeds the model's context of {self.max_context} "
                             "(raise -c/--ctx-size)")
        n_splits = ops.attention_splits(max_tokens)
        with self.stream:
            shape = (a.n_layers, a.n_kv_heads, max_tokens, a.head_dim)
            scores, part_o, part_ml = ops.attention_work(a.n_heads, a.head_dim, max_tokens)
            cache = GpuKVCache(
                keys=cupy.zeros(shape, F16), values=cupy.zeros(shape, F16), max_tokens=max_tokens,
                n_splits=n_splits, tok=cupy.zeros(1, cupy.int32), pos=cupy.zeros(1, cupy.int32),
                tokens=cupy.zeros(max_tokens + 1, cupy.int32), scores=scores, part_o=part_o, part_ml=part_ml,
                stream=self.stream,
            )
        self.stream.synchronize()
        return cache

    # ------------------------------------------------------------------ one row (decode)
    def _decode_layer(self, i: int, L: GpuLayer, cache: GpuKVCache, mark: Callable[[str], None] | None = None) -> None:
        """The kernels of layer i for token cache.tok at position cache.pos: self.h in place.
        `mark(stage)` after each stage (tests inspect the buffers there; eager runs only)."""
        a, done = self.args, mark or (lambda _stage: None)
        cos, sin = self._rope_tables
        xs = self.inputs.normed(self.h, L.attn_norm, "attn", [m.act for m, _ in L.qkv])
        done("rmsnorm")
        for m, row in L.qkv:
            self.inputs.gemv(m, "attn", xs[m.act], self.qkv[row : row + m.rows],
                       bias=None if L.bqkv is None else L.bqkv[row : row + m.rows])
        done("gemv_qkv")
        # rotary embedding and the KV store happen inside the attention kernels
        ops.attention_decode(self.q, cache.keys[i], cache.values[i], cache.pos, a.n_heads, a.n_kv_heads,
                             a.head_dim, cache.max_tokens, cache.n_splits, cache.scores, cache.part_o, cache.part_ml,
                             self.att, act=L.wo.act,  # the output is wo's rounded input
                             rope=(self.k, self.v, cos, sin, self.rope.n_pairs, a.rope_neox),
                             int8=self.inputs.int8_of("att", L.wo.act) if L.wo.fmt in ops.INT8_FORMATS else None)
        done("attention")
        self.inputs.gemv(L.wo, "att", self.att, self.h, residual=self.h)
        done("gemv_o")
        xs = self.inputs.normed(self.h, L.ffn_norm, "ffn", [L.w_gate.act, L.w_up.act])
        done("rmsnorm")
        if L.w_gate.fmt == L.w_up.fmt and L.w_gate.act == L.w_up.act:
            int8 = self.inputs.int8_of("ffn", L.w_gate.act) if L.w_gate.fmt in ops.INT8_FORMATS else None
            if int8 is not None:
                ops.gemv8_swiglu(L.w_gate, L.w_up, int8, self.ff)
            else:
                ops.gemv_swiglu(L.w_gate, L.w_up, xs[L.w_gate.act], self.ff)
        else:
            self.inputs.gemv(L.w_gate, "ffn", xs[L.w_gate.act], self.gate)
            self.inputs.gemv(L.w_up, "ffn", xs[L.w_up.act], self.up)
            ops.swiglu(self.gate, self.up, self.ff, a.ffn_dim)
        done("gemv_gate_up")
        self.inputs.gemv(L.w_down, "ff", self.inputs.rounded(self.ff, "ff", L.w_down.act), self.h, residual=self.h)
        done("gemv_down")

    def _head(self) -> None:
        xs = self.inputs.normed(self.h, self.weights.output_norm, "out", [self.output.act])
        self.inputs.gemv(self.output, "out", xs[self.output.act], self.logits)

    def _plan_segments(self) -> list[tuple[bool, list[int]]]:
        """The decode step as (capturable, items): runs of the embedding, resident layers and the
        head, which replay as CUDA graphs, and single streamed layers run as they arrive."""
        items = [EMBED, *(i for i in range(self.args.n_layers) if i not in self.skip), HEAD]
        segments: list[tuple[bool, list[int]]] = []
        for item in items:
            resident = item < 0 or self.weights.is_resident(item)
            if resident and segments and segments[-1][0]:
                segments[-1][1].append(item)
            else:
                segments.append((resident, [item]))
        return segments

    def _launch_items(self, items: list[int], cache: GpuKVCache, sample: tuple[float, int] | None,
                      mark: Callable[[str], None] | None = None) -> None:
        for item in items:
            if item == EMBED:
                ops.embed(self.token_embd, cache.tok, 1, self.h)
            elif item == HEAD:
                self._head()
                if mark:
                    mark("output")
                if sample is not None:
                    ops.sample_token(self.logits, self.args.vocab_size, sample[0], sample[1], cache.tok, cache.pos,
                                     cache.tokens)
            else:
                self._decode_layer(item, self.weights.layer(item), cache, mark)

    def _decode_launches(self, cache: GpuKVCache, mark: Callable[[str], None] | None = None) -> None:
        """One decode step launched eagerly (no graph), `mark(stage)` after each stage."""
        self._launch_items([item for _, items in self._segments for item in items], cache, None, mark)

    def _decode_step(self, cache: GpuKVCache, sample: tuple[float, int] | None = None) -> None:
        """One token through every layer on self.stream (queued, not waited for): token cache.tok at
        position cache.pos -> self.logits; with `sample` (temperature, seed) the next token is drawn
        into cache.tok and cache.tokens and cache.pos advances (all on the device)."""
        last = len(self._segments) - 1
        for s, (capturable, items) in enumerate(self._segments):
            step_sample = sample if s == last else None
            if not capturable:
                self._launch_items(items, cache, None)
                continue
            key = (s, self.int8_dot, step_sample)
            graph = cache.graphs.get(key)
            if graph is None:
                self.stream.begin_capture()
                try:
                    self._launch_items(items, cache, step_sample)
                finally:
                    graph = self.stream.end_capture()
                cache.graphs[key] = graph
            graph.launch(self.stream)  # type: ignore[attr-defined]

    def queue_steps(self, cache: GpuKVCache, token: int, n: int, temperature: float = 0.0, seed: int = 0) -> None:
        """Queues n decode steps from `token` at position cache.length, each sampling the next token on
        the device (cache.tokens[p + 1] for the step at position p); nothing is waited for and
        cache.length is not advanced (the caller reads cache.tokens)."""
        with self.stream:
            self._set_position(cache, token, cache.length)
            for _ in range(n):
                self._decode_step(cache, (float(temperature), int(seed)))

    def _set_position(self, cache: GpuKVCache, token: int, position: int) -> None:
        cache.tok.set(np.array([token], np.int32), stream=self.stream)
        cache.pos.set(np.array([position], np.int32), stream=self.stream)

    # ------------------------------------------------------------------ many rows
    def _mm(self, x16: cupy.ndarray, w16: cupy.ndarray, out: cupy.ndarray | None = None,
            accumulate: bool = False) -> cupy.ndarray:
        """(R, cols) float16 @ W16.T -> (R, rows) float32, into `out` (added to it with accumulate)."""
        target = cupy.empty((x16.shape[0], w16.shape[0]), F32) if out is None else out
        ops.matmul_f16(x16, w16, target, accumulate=accumulate)
        return target

    def _half(self, m: GpuMatrix) -> cupy.ndarray:
        return self.half.get(m, self.args.largest_matrix)

    def _qkv_rows(self, L: GpuLayer, xs16: dict[str, cupy.ndarray]) -> list[cupy.ndarray]:
        """Q, K and V of every row, each its own (R, n) float32 product. A stacked matrix is
        multiplied part by part, so a resident and a streamed layer run the same cuBLAS shapes."""
        a, rows = self.args, next(iter(xs16.values())).shape[0]
        outs = []
        halves: dict[int, cupy.ndarray] = {}
        for start, n in ((0, a.q_dim), (a.q_dim, a.kv_dim), (a.q_dim + a.kv_dim, a.kv_dim)):
            m, row0 = next((m, r) for m, r in L.qkv if r <= start < r + m.rows)
            if id(m) not in halves:
                halves[id(m)] = self._half(m)
            out = self._mm(xs16[m.act], halves[id(m)][start - row0 : start - row0 + n], cupy.empty((rows, n), F32))
            if L.bqkv is not None:
                out += L.bqkv[start : start + n]
            outs.append(out)
        return outs

    def _rows_layer(self, i: int, L: GpuLayer, x: cupy.ndarray, batch: Sequence[tuple[np.ndarray, GpuKVCache]],
                    bounds: list[int], positions: list[cupy.ndarray], tree: Tree | None = None) -> None:
        a = self.args
        xs16 = normed16(self.args, x, L.attn_norm, [m.act for m, _ in L.qkv])
        q, k, v = self._qkv_rows(L, xs16)
        del xs16
        att = cupy.empty((x.shape[0], a.q_dim), F32)
        cos, sin = self._rope_tables
        for s, (_, cache) in enumerate(batch):
            r0, r1 = bounds[s], bounds[s + 1]
            n, start = r1 - r0, cache.length
            ops.rope_store(q[r0:r1], k[r0:r1], v[r0:r1], cos, sin, positions[s], n, a.n_heads, a.n_kv_heads,
                           a.head_dim, self.rope.n_pairs, a.rope_neox, cache.keys[i], cache.values[i],
                           cache.max_tokens, slots=None if tree is None else tree.slots)
            if tree is not None:  # a token tree: nodes in slots start.., each sees its ancestors
                rows_attention(q, cache.keys[i], cache.values[i], start + n, a.n_kv_heads, a.head_dim, att,
                               allowed=tree.allowed)
            elif n == 1:  # one new token of this sequence: the decode kernels
                ops.attention_decode(q[r0], cache.keys[i], cache.values[i], positions[s], a.n_heads, a.n_kv_heads,
                                     a.head_dim, cache.max_tokens, cache.n_splits, cache.scores, cache.part_o,
                                     cache.part_ml, att[r0])
            else:
                rows_attention(q[r0:r1], cache.keys[i], cache.values[i], start + n, a.n_kv_heads, a.head_dim,
                               att[r0:r1], start=start)
        del q, k, v
        self._mm(rounded16(att, L.wo.act), self._half(L.wo), out=x, accumulate=True)
        del att
        xs16 = normed16(self.args, x, L.ffn_norm, [L.w_gate.act, L.w_up.act])
        g = self._mm(xs16[L.w_gate.act], self._half(L.w_gate))
        u = self._mm(xs16[L.w_up.act], self._half(L.w_up))
        del xs16
        ops.swiglu(g, u, g, g.size)  # in place, evaluated in double as the decode kernels do
        del u
        self._mm(rounded16(g, L.w_down.act), self._half(L.w_down), out=x, accumulate=True)

    def _rows_pass(self, batch: Sequence[tuple[np.ndarray, GpuKVCache]], sizes: list[int],
                   all_logits: bool, tree: Tree | None = None) -> list[np.ndarray]:
        """One pass over the layers for every row of the batch; logits to the host. With `tree` (one
        sequence) the rows are a token tree's nodes and the cache's length stays."""
        a = self.args
        bounds = np.cumsum([0, *sizes]).tolist()
        rows = bounds[-1]
        ids = cupy.asarray(np.concatenate([np.asarray(t, np.int64) for t, _ in batch]).astype(np.int32))
        positions = [tree.positions] if tree is not None else [
            cupy.arange(c.length, c.length + n, dtype=cupy.int32) for (_, c), n in zip(batch, sizes, strict=True)]
        x = cupy.empty((rows, a.dim), F32)
        ops.embed(self.token_embd, ids, rows, x)
        for i in range(a.n_layers):
            if i not in self.skip:
                self._rows_layer(i, self.weights.layer(i), x, batch, bounds, positions, tree)
        if tree is None:
            for (_, cache), n in zip(batch, sizes, strict=True):
                cache.length += n
        picked = list(range(rows)) if all_logits else [b - 1 for b in bounds[1:]]
        host = np.empty((len(picked), a.vocab_size), np.float32)
        block = cupy.empty((min(LOGITS_ROWS, len(picked)), a.vocab_size), F32)
        for j0 in range(0, len(picked), LOGITS_ROWS):  # a bounded block of logits at a time
            part = picked[j0 : j0 + LOGITS_ROWS]
            for j, r in enumerate(part):
                xs = self.inputs.normed(x[r], self.weights.output_norm, "out", [self.output.act])
                self.inputs.gemv(self.output, "out", xs[self.output.act], block[j])
            host[j0 : j0 + len(part)] = cupy.asnumpy(block[: len(part)], stream=self.stream)
        if all_logits:
            return [host[bounds[s] : bounds[s + 1]] for s in range(len(batch))]
        return [host[s] for s in range(len(batch))]

    # ------------------------------------------------------------------ public calls
    def forward_tree(self, tokens: np.ndarray, parents: np.ndarray, cache: GpuKVCache) -> np.ndarray:
        """As infer.model.Transformer.forward_tree: logits (N, vocab) of every node of a token tree
        in one pass (batched products, tree attention mask, per-node positions; keys and values in
        slots cache.length + node); cache.length stays, GpuKVCache.accept keeps a path."""
        tokens, parents = np.asarray(tokens, dtype=np.int64).reshape(-1), np.asarray(parents, dtype=np.int64)
        check_batch([(tokens, cache)], self.args.vocab_size)
        depths, allowed = tree_layout(parents, cache.length)
        n = len(tokens)
        with self.stream:
            tree = Tree(cupy.asarray((cache.length + depths).astype(np.int32)),
                        cupy.arange(cache.length, cache.length + n, dtype=cupy.int32), cupy.asarray(allowed))
            logits = self._rows_pass([(tokens, cache)], [n], True, tree)[0]
        self.stream.synchronize()
        return logits

    def reserve_tree(self, nodes: int) -> None:
        """Sizes token-tree verification for trees of up to `nodes` nodes before the first pass (its
        buffers are made once; a larger tree later makes them anew, and its graphs with them)."""
        self._tree_capacity = max(self._tree_capacity, int(nodes))

    def tree_runner(self, nodes: int, max_tokens: int) -> TreeRunner:
        """The TreeRunner for a tree of `nodes` nodes over a cache of max_tokens positions."""
        runner = self._tree_runner
        if runner is None or runner.capacity < nodes or runner.max_tokens != max_tokens \
                or runner.int8_dot != self.int8_dot:
            want = max(nodes, self._tree_capacity)
            self._tree_runner = None  # the old buffers go before the new ones are made
            self._tree_runner = TreeRunner(self, -(-want // CAPACITY_STEP) * CAPACITY_STEP, max_tokens,
                                           next(_RUNNER_GENERATIONS))
        return self._tree_runner

    def verify_tree(self, tokens: np.ndarray, parents: np.ndarray, cache: GpuKVCache) -> TreeLogits:
        """forward_tree with the decode step's kernels (infer/gpu/tree.py): node i's logits are bit
        for bit those of plain decoding along its path; rows fetched on demand."""
        return verify_tree(self, tokens, parents, cache)

    def draft_chain(self, tokens: np.ndarray, cache: GpuKVCache, depth: int, width: int) -> np.ndarray:
        """The draft side of speculation, queued on the device with one wait at the end: `tokens`
        fed at cache.length (more than gemv_prefill_max of them, a new prompt, in one batched pass
        first: a decode step per token cost a streamed e2e run ~6 ms a pass), then `depth` greedy
        decode steps, each picking its next token on the
        device (the graph's arg-max). Returns (depth, width) ids: column 0 the chain, the others each
        step's runners-up (one sort of all steps' logits at the end). The cache then holds `tokens`
        and the chain's first depth - 1 tokens (cache.length counts them)."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if len(tokens) == 0 or depth < 1 or width < 1:
            raise ValueError("draft_chain needs tokens, depth >= 1 and width >= 1")
        if cache.length + len(tokens) + depth - 1 > cache.max_tokens:
            raise ValueError(f"context full: {cache.length} + {len(tokens)} + {depth - 1} exceed {cache.max_tokens}")
        if len(tokens) - 1 > self.gemv_prefill_max:  # a new prompt: one batched pass, not a step a token
            self.forward(tokens[:-1], cache)
            tokens = tokens[-1:]
        with self.stream:
            for token in tokens[:-1]:  # decode steps (queued, no dequantization): usually one or two tokens
                self._set_position(cache, int(token), cache.length)
                self._decode_step(cache)
                cache.length += 1
            start = cache.length  # position of the last fed token; the chain's tokens follow it
            self._set_position(cache, int(tokens[-1]), start)
            steps = cupy.empty((depth, self.args.vocab_size), F32) if width > 1 else None
            for d in range(depth):
                self._decode_step(cache, (0.0, 0))  # arg-max into cache.tokens[pos + 1], pos + 1
                if steps is not None:
                    steps[d] = self.logits
            chain = cache.tokens[start + 1 : start + 1 + depth]
            if steps is None:
                ids = cupy.asnumpy(chain, stream=self.stream).astype(np.int64)[:, None]
            else:
                top = cupy.argsort(-steps, axis=1)[:, :width]
                top[:, 0] = chain  # the chain as the device step chose it (ties: the same token either way)
                ids = cupy.asnumpy(top, stream=self.stream).astype(np.int64)
        self.stream.synchronize()
        cache.length += depth  # the last fed token and the chain's first depth - 1
        return ids

    def forward(self, tokens: np.ndarray, cache: GpuKVCache, all_logits: bool = False) -> np.ndarray:
        """As infer.model.Transformer.forward: NumPy float32 logits, (T, vocab) with all_logits,
        else (vocab,) of the last token."""
        return self.forward_batch([(np.asarray(tokens, dtype=np.int64).reshape(-1), cache)], all_logits)[0]

    def forward_batch(self, batch: Sequence[tuple[np.ndarray, GpuKVCache]],
                      all_logits: bool = False) -> list[np.ndarray]:
        """Each (tokens, cache) at its cache's next positions; per sequence the logits of its last
        token (vocab,) or of every token (T, vocab). A few tokens of one sequence run token by token
        on the decode kernels; otherwise passes of at most prefill_chunk rows (or one row per
        sequence) over the batched products."""
        sizes = check_batch(batch, self.args.vocab_size)
        with self.stream:
            if len(batch) == 1 and sizes[0] <= self.gemv_prefill_max:
                tokens, cache = batch[0]
                rows = []
                for j, token in enumerate(tokens):
                    self._set_position(cache, int(token), cache.length)
                    self._decode_step(cache)
                    cache.length += 1
                    if all_logits or j == sizes[0] - 1:
                        rows.append(cupy.asnumpy(self.logits, stream=self.stream))
                self.stream.synchronize()
                return [np.stack(rows) if all_logits else rows[-1]]
            outputs: list[list[np.ndarray]] = [[] for _ in batch]
            done = [0] * len(batch)
            while True:  # the rows of a pass, shared evenly by the sequences with tokens left
                live = [s for s in range(len(batch)) if done[s] < sizes[s]]
                if not live:
                    break
                share = max(1, self.prefill_chunk // len(live))
                part = [(np.asarray(batch[s][0])[done[s] : done[s] + share], batch[s][1]) for s in live]
                part_sizes = [len(t) for t, _ in part]
                for s, n, logits in zip(live, part_sizes, self._rows_pass(part, part_sizes, all_logits), strict=True):
                    outputs[s].append(logits)
                    done[s] += n
        self.stream.synchronize()
        return [np.concatenate(out) if all_logits else out[-1] for out in outputs]

    def generate(self, prompt: np.ndarray, cache: GpuKVCache, n_new: int, temperature: float = 0.0, seed: int = 0,
                 stop: set[int] | frozenset[int] = frozenset(), check_every: int = 16,
                 on_tokens: Callable[[list[int]], None] | None = None) -> list[int]:
        """Prefill the prompt, then decode up to n_new tokens on the device; stops after a token in
        `stop`. The last sampled token is not yet in the cache (cache.length counts the tokens
        processed)."""
        out: list[int] = []
        for fresh in self.generate_iter(prompt, cache, n_new, temperature, seed, stop, check_every):
            out.extend(fresh)
            if on_tokens:
                on_tokens(fresh)
        return out

    def generate_iter(self, prompt: np.ndarray, cache: GpuKVCache, n_new: int, temperature: float = 0.0,
                      seed: int = 0, stop: set[int] | frozenset[int] = frozenset(),
                      check_every: int = 16) -> Iterator[list[int]]:
        """generate() as it goes: yields the new tokens in lists of up to `check_every` (the steps
        queued between two looks at the sampled ids). cache.length is final once exhausted."""
        prompt = np.asarray(prompt, dtype=np.int64).reshape(-1)
        if len(prompt) == 0:
            raise ValueError("generate needs at least one prompt token")
        check_batch([(prompt, cache)], self.args.vocab_size)
        if n_new <= 0:
            return
        if cache.length + len(prompt) + n_new - 1 > cache.max_tokens:
            raise ValueError(f"context full: {cache.length} + {len(prompt)} + {n_new} tokens exceed "
                             f"{cache.max_tokens}")
        start = cache.length + len(prompt)  # position of the first new token
        if len(prompt) > 1:
            self.forward(prompt[:-1], cache)
        with self.stream:
            self._set_position(cache, int(prompt[-1]), start - 1)
            self._decode_step(cache, (float(temperature), int(seed)))  # the last prompt token samples the first
        produced = 0
        done = 0  # decode steps launched after the first token
        while True:
            batch = min(check_every, n_new - 1 - done)
            with self.stream:
                for _ in range(batch):
                    self._decode_step(cache, (float(temperature), int(seed)))
            done += batch
            new = cupy.asnumpy(cache.tokens[start + produced : start + done + 1], stream=self.stream)
            self.stream.synchronize()
            fresh = [int(t) for t in new]
            cut = next((j + 1 for j, t in enumerate(fresh) if t in stop), None)
            if cut is not None:
                fresh = fresh[:cut]
            produced += len(fresh)
            cache.length = start + produced - 1
            if fresh:
                yield fresh
            if cut is not None or done >= n_new - 1:
                return
