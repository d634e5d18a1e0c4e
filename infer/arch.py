"""The model description, in one place: one table per architecture (`ARCHITECTURES`: its rotary
pairing, the tensors of a block and which a file may leave out), hyper-parameters from GGUF
metadata (rope scaling: infer.rope_scaling), the tensor names and the order a forward pass uses
them, and the load-time check that every tensor the forward pass will touch exists with the shape
and a type it can compute.

Every engine (the NumPy one, the GPU one, the streaming providers and the placement planner) takes
names, shapes and options from here; a block's vectors (norms, biases) are put together once, by
`layer_vectors`, for all of them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from infer.errors import UnsupportedModelError
from infer.rope_scaling import RopeScaling

if TYPE_CHECKING:  # NumPy stays unimported until a model is opened (the CLI sets BLAS threads first)
    import numpy as np

    from infer.gguf_file import GGUFModel, TensorInfo

TOKEN_EMBD = "token_embd.weight"
OUTPUT = "output.weight"
OUTPUT_NORM = "output_norm.weight"
ROPE_FREQS = "rope_freqs.weight"
# Every tensor kind a block may hold, in the order the forward pass uses them (the planner streams
# a layer's tensors in this order).
LAYER_KINDS = ("attn_norm", "attn_q", "attn_q.bias", "attn_k", "attn_k.bias", "attn_v", "attn_v.bias",
               "attn_q_norm", "attn_k_norm", "attn_sinks", "attn_output", "attn_output.bias", "post_attention_norm",
               "ffn_norm", "ffn_gate", "ffn_up", "ffn_down", "ffn_gate_inp", "ffn_gate_inp.bias", "ffn_gate_exps",
               "ffn_gate_exps.bias", "ffn_up_exps", "ffn_up_exps.bias", "ffn_down_exps", "ffn_down_exps.bias",
               "ffn_gate_inp_shexp", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp", "post_ffw_norm")
BIAS_KINDS = ("attn_q.bias", "attn_k.bias", "attn_v.bias")  # Qwen2 has them; a missing one is zeros
QK_NORM_KINDS = ("attn_q_norm", "attn_k_norm")  # Qwen3: RMSNorm of each query and key head before rope
POST_NORM_KINDS = ("post_attention_norm", "post_ffw_norm")  # Gemma: the attention and FFN outputs normed
QKV_KINDS = ("attn_q", "attn_k", "attn_v")
FFN_KINDS = ("ffn_gate", "ffn_up", "ffn_down")  # a dense block's feed-forward
# A mixture-of-experts block's feed-forward: the router (n_experts, dim), then the experts' matrices
# stacked along a third axis (n_experts, rows, cols); infer/moe.py computes it
EXPERT_KINDS = ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
# a shared expert beside them (qwen2moe): its gate (dim,) (a sigmoid of its dot with the normed input
# scales its output), then a dense gated feed-forward of its own width
SHARED_EXPERT_KINDS = ("ffn_gate_inp_shexp", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")
# gpt-oss: a bias on the router's logits and on each expert's three products (n_experts, rows)
EXPERT_BIAS_KINDS = ("ffn_gate_inp.bias", "ffn_gate_exps.bias", "ffn_up_exps.bias", "ffn_down_exps.bias")
# gpt-oss's attention: one learned logit per query head that joins every softmax (a "sink" taking
# probability from the keys) and a bias on the output projection
SINK_KINDS = ("attn_sinks", "attn_output.bias")
EXPERT_BLOCK_KINDS = frozenset(EXPERT_KINDS + SHARED_EXPERT_KINDS + EXPERT_BIAS_KINDS)  # a block of experts' FFN
_ATTENTION = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm")
_DENSE = (*_ATTENTION, *FFN_KINDS)


@dataclass(frozen=True)
class Architecture:
    """What a GGUF `general.architecture` means to the engines: the tensors of a block (required,
    and optional ones a file may leave out) and how rotary pairs are formed. A new dense
    architecture of this family is a new entry here plus the few lines its layer features need in
    each engine's layer recipe (infer/model.py, infer/gpu/model.py)."""

    name: str
    neox_rope: bool  # rotary pairs (i, i + d/2), the Hugging Face order; else (2i, 2i+1), Llama's GGUF order
    required: tuple[str, ...]
    optional: tuple[str, ...] = BIAS_KINDS
    activation: str = "silu"  # the gated FFN's: silu (SwiGLU) or gelu_tanh (GeGLU, Gemma)
    embed_scale: bool = False  # token embeddings times sqrt(width) (Gemma)
    sliding_window_pattern: int = 0  # Gemma 3: of every n layers the first n - 1 see a sliding window
    scale_queries: bool = False  # the attention scale multiplies Q (float32) before attention (Gemma)
    # "never": a dense feed-forward whatever the file says (llama.cpp ignores an expert count there);
    # "optional": experts in place of it when the file counts them (`expert_count`, Mixtral's llama
    # files); "always": experts only (qwen3moe)
    experts: str = "never"
    expert_weights_norm: bool = True  # the top k's weights divided by their sum (qwen2moe: not)
    # "softmax": the top k of the router's softmax, weighted by their probabilities; "softmax_weight"
    # (gpt-oss): the top k of the router's logits, weighted by a softmax over those k logits alone
    gating: str = "softmax"
    ffn_norm: str = "ffn_norm"  # the kind of the feed-forward's input norm (gpt-oss: post_attention_norm)
    local_rope: bool = False  # local layers rotate with their own base, unscaled (Gemma 3); else as the rest
    gpu: bool = True  # the GPU engines compute it (gpt-oss: the CPU engines only, so far)
    window_required: bool = False  # llama.cpp refuses a file without attention.sliding_window (gpt-oss)

    @property
    def shared_expert(self) -> bool:
        return SHARED_EXPERT_KINDS[0] in self.required

    @property
    def kinds(self) -> tuple[str, ...]:
        """The block's tensor kinds in pass order."""
        return self.block_kinds(self.experts == "always")

    def block_kinds(self, with_experts: bool) -> tuple[str, ...]:
        """The kinds of a block whose feed-forward is a mixture of experts or dense, in pass order."""
        mine = set(self.required) | set(self.optional)
        if with_experts:
            mine = (mine - set(FFN_KINDS)) | set(EXPERT_KINDS)
        if self.ffn_norm != "ffn_norm":
            mine.discard("ffn_norm")
        return tuple(k for k in LAYER_KINDS if k in mine)


# GGUF stores Llama's Q/K rows permuted so rotary pairs are adjacent (x[2i], x[2i+1]); Qwen keeps the
# Hugging Face order, where dimension i pairs with i + d/2 (NeoX style). Checked against llama.cpp by
# tests/infer/test_oracle.py.
ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture("llama", neox_rope=False, required=_DENSE, experts="optional"),
    "qwen2": Architecture("qwen2", neox_rope=True, required=_DENSE),
    "qwen3": Architecture("qwen3", neox_rope=True, required=(*_DENSE, *QK_NORM_KINDS)),
    "gemma3": Architecture("gemma3", neox_rope=True, required=(*_DENSE, *QK_NORM_KINDS, *POST_NORM_KINDS),
                           activation="gelu_tanh", embed_scale=True, sliding_window_pattern=6,
                           scale_queries=True, local_rope=True),
    "qwen3moe": Architecture("qwen3moe", neox_rope=True, required=(*_ATTENTION, *QK_NORM_KINDS, *EXPERT_KINDS),
                             experts="always"),
    # Qwen1.5-MoE, Qwen2-57B-A14B: Qwen2's attention (biases), routed experts whose top-k weights are
    # not renormalised, and a gated shared expert (llama.cpp's qwen2moe graph)
    "qwen2moe": Architecture("qwen2moe", neox_rope=True, required=(*_ATTENTION, *EXPERT_KINDS, *SHARED_EXPERT_KINDS),
                             experts="always", expert_weights_norm=False),
    # gpt-oss (llama.cpp's openai-moe graph): Q/K/V and output biases, attention sinks, every other
    # layer (the first of each pair) a sliding window, the FFN's input norm stored as
    # post_attention_norm, routed experts with biases and llama.cpp's clamped SwiGLU ("swiglu_oai":
    # min(g, 7) * sigmoid(1.702 min(g, 7)) * (clamp(u, -7, 7) + 1)); no shared expert
    "gpt-oss": Architecture("gpt-oss", neox_rope=True,
                            required=("attn_norm", *QKV_KINDS, "attn_output", *SINK_KINDS, "post_attention_norm",
                                      *EXPERT_KINDS, *EXPERT_BIAS_KINDS),
                            activation="swiglu_oai", sliding_window_pattern=2, experts="always",
                            expert_weights_norm=False, gating="softmax_weight", ffn_norm="post_attention_norm",
                            gpu=False, window_required=True),
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.(.+)\.(weight|bias)$")


def tensor_name(layer: int, kind: str) -> str:
    """'blk.3.attn_q.weight' for (3, 'attn_q'); 'blk.3.attn_q.bias' for (3, 'attn_q.bias')."""
    return f"blk.{layer}.{kind}" if kind.endswith(".bias") else f"blk.{layer}.{kind}.weight"


def parse_tensor_name(name: str) -> tuple[int | None, str]:
    """(layer, kind) of a tensor name: (3, 'attn_q'), (3, 'attn_q.bias'); (None, 'output') for the
    tensors outside the blocks."""
    match = _LAYER_NAME.match(name)
    if match is None:
        return None, name.rsplit(".", 1)[0]
    kind = match.group(2) + (".bias" if match.group(3) == "bias" else "")
    return int(match.group(1)), kind


@dataclass(frozen=True)
class ModelArgs:
    arch: str
    n_layers: int
    dim: int
    ffn_dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int
    norm_eps: float
    rope_base: float
    rope_dim: int  # leading dimensions of each head that are rotated
    rope_neox: bool
    rope_scaling: RopeScaling = RopeScaling()
    sliding_window: int = 0  # keys a local layer's query sees (itself included); 0: none
    local_layers: tuple[bool, ...] = ()  # per layer: a local (sliding-window) layer
    rope_base_local: float = 0.0  # Gemma 3's local layers' own rotary base, unscaled; 0: they rotate like the rest
    attn_scale: float = 0.0  # the attention scores' factor; 0: 1 / sqrt(head_dim)
    n_experts: int = 0  # experts of each block's feed-forward (infer/moe.py); 0: a dense feed-forward
    n_experts_used: int = 0  # experts each token is routed to (the top k of the router's softmax)
    expert_ffn_dim: int = 0  # an expert's hidden width
    expert_weights_norm: bool = True  # the top k's weights divided by their sum (llama.cpp's, for qwen3moe and Mixtral)
    shared_ffn_dim: int = 0  # the shared expert's hidden width (qwen2moe); 0: none

    @property
    def scores_scale(self) -> float:
        return self.attn_scale or 1.0 / math.sqrt(self.head_dim)

    def is_local(self, layer: int) -> bool:
        return bool(self.local_layers) and self.local_layers[layer]

    def kv_ring(self, ctx_size: int, pass_rows: int) -> int:
        """Positions a local layer's KV cache keeps for a context of ctx_size and passes of up to
        pass_rows rows: its window and a pass (a ring; no query reads further back), at most ctx_size."""
        return min(ctx_size, self.sliding_window + pass_rows) if self.sliding_window else ctx_size

    def kv_cache_layout(self, ctx_size: int, pass_rows: int) -> str:
        """The KV cache in words where local layers keep a ring ("" where every layer keeps ctx_size)."""
        n_local, ring = sum(self.local_layers), self.kv_ring(ctx_size, pass_rows)
        if not n_local or ring == ctx_size:
            return ""
        return (f"{self.n_layers - n_local} global layers x {ctx_size} positions, {n_local} local layers x a ring "
                f"of {ring}")

    def kv_cache_nbytes(self, ctx_size: int, pass_rows: int, itemsize: int = 2, sequences: int = 1,
                        positions: int | None = None, layers: Sequence[int] | None = None) -> int:
        """Keys and values (float16) of `sequences` sequences of ctx_size positions, or of `positions`
        in all where they share fewer: every position in each global layer, at most a kv_ring per
        sequence in each local one (`layers`: of those layers only, a stage across GPUs)."""
        total = sequences * ctx_size if positions is None else positions
        layers = range(self.n_layers) if layers is None else layers
        n_local = sum(self.is_local(i) for i in layers)
        local = min(total, sequences * self.kv_ring(ctx_size, pass_rows))
        return 2 * ((len(layers) - n_local) * total + n_local * local) * self.kv_dim * itemsize

    @property
    def rope_linear_scale(self) -> float:
        """Positions are divided by this ("linear" rope scaling; 1 otherwise)."""
        return self.rope_scaling.factor if self.rope_scaling.kind == "linear" else 1.0

    @property
    def arch_table(self) -> Architecture:
        return ARCHITECTURES[self.arch]

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """A block's tensor kinds in pass order: the table's, with the experts in place of the dense
        feed-forward where this file has them."""
        return self.arch_table.block_kinds(self.n_experts > 0)

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def largest_matrix(self) -> int:
        """Elements of the largest matrix of a block (Q, K and V stacked count as one)."""
        return max((self.q_dim + 2 * self.kv_dim) * self.dim, self.dim * self.q_dim, self.ffn_dim * self.dim)

    def layer_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        """Tensor name -> shape (NumPy order: rows, then row length) of every tensor of a block."""
        rows = {"attn_norm": (self.dim,), "attn_q": (self.q_dim, self.dim), "attn_k": (self.kv_dim, self.dim),
                "attn_v": (self.kv_dim, self.dim), "attn_q.bias": (self.q_dim,), "attn_k.bias": (self.kv_dim,),
                "attn_v.bias": (self.kv_dim,), "attn_q_norm": (self.head_dim,), "attn_k_norm": (self.head_dim,),
                "post_attention_norm": (self.dim,), "post_ffw_norm": (self.dim,),
                "attn_output": (self.dim, self.q_dim), "ffn_norm": (self.dim,),
                "ffn_gate": (self.ffn_dim, self.dim), "ffn_up": (self.ffn_dim, self.dim),
                "ffn_down": (self.dim, self.ffn_dim), "ffn_gate_inp": (self.n_experts, self.dim),
                "ffn_gate_exps": (self.n_experts, self.expert_ffn_dim, self.dim),
                "ffn_up_exps": (self.n_experts, self.expert_ffn_dim, self.dim),
                "ffn_down_exps": (self.n_experts, self.dim, self.expert_ffn_dim),
                "attn_sinks": (self.n_heads,), "attn_output.bias": (self.dim,),
                "ffn_gate_inp.bias": (self.n_experts,), "ffn_gate_exps.bias": (self.n_experts, self.expert_ffn_dim),
                "ffn_up_exps.bias": (self.n_experts, self.expert_ffn_dim),
                "ffn_down_exps.bias": (self.n_experts, self.dim),
                "ffn_gate_inp_shexp": (self.dim,), "ffn_gate_shexp": (self.shared_ffn_dim, self.dim),
                "ffn_up_shexp": (self.shared_ffn_dim, self.dim), "ffn_down_shexp": (self.dim, self.shared_ffn_dim)}
        return {tensor_name(layer, kind): rows[kind] for kind in self.layer_kinds}

    @classmethod
    def from_gguf(cls, model: GGUFModel) -> ModelArgs:
        arch = model.architecture
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                model.path, f"architecture '{arch}' is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})",
                "key general.architecture")

        def key(name: str, kind: type, default: object = None) -> object:
            full = f"{arch}.{name}"
            if default is not None and full not in model.metadata:
                return default
            return model.require(full, kind)

        n_heads = int(key("attention.head_count", int))
        dim = int(key("embedding_length", int))
        if n_heads <= 0 or (f"{arch}.attention.key_length" not in model.metadata and dim % n_heads):
            raise UnsupportedModelError(model.path, f"{n_heads} heads do not divide width {dim}",
                                        f"key {arch}.attention.head_count")
        n_kv_heads = int(key("attention.head_count_kv", int, n_heads))
        if n_kv_heads <= 0 or n_heads % n_kv_heads:
            raise UnsupportedModelError(model.path, f"{n_kv_heads} KV heads do not divide {n_heads} heads",
                                        f"key {arch}.attention.head_count_kv")
        head_dim = int(key("attention.key_length", int, dim // n_heads))
        value_dim = int(key("attention.value_length", int, head_dim))
        if value_dim != head_dim:
            raise UnsupportedModelError(model.path, f"value heads of {value_dim} beside key heads of {head_dim} are "
                                        "not supported (only equal sizes)", f"key {arch}.attention.value_length")
        for cap in ("final_logit_softcapping", "attn_logit_softcapping"):  # Gemma 2's; llama.cpp reads them for Gemma 3
            value = model.metadata.get(f"{arch}.{cap}")
            if value not in (None, 0, 0.0):
                raise UnsupportedModelError(model.path, f"logit soft-capping ({value}) is not supported", f"key {arch}.{cap}")
        context_length = int(key("context_length", int))
        n_layers = int(key("block_count", int))
        table = ARCHITECTURES[arch]
        window, local = 0, ()
        if f"{arch}.attention.sliding_window" in model.metadata:
            window = int(key("attention.sliding_window", int))
        if window > 0 and table.sliding_window_pattern:
            pattern = key("attention.sliding_window_pattern", int, table.sliding_window_pattern)
            if isinstance(pattern, list):  # llama.cpp reads an array as the flags themselves
                raise UnsupportedModelError(model.path, "a per-layer sliding window array is not supported",
                                            f"key {arch}.attention.sliding_window_pattern")
            n = int(pattern)
            local = tuple(n == 0 or i % n < n - 1 for i in range(n_layers))
        elif table.window_required:
            raise UnsupportedModelError(model.path, f"{arch} needs its sliding window (llama.cpp requires the key)",
                                        f"key {arch}.attention.sliding_window")
        elif window > 0:  # Mistral's: every layer (llama.cpp ignores the key in llama and qwen files)
            local = (True,) * n_layers
        # llama.cpp does not require the dense width of an all-experts architecture
        ffn_dim = int(key("feed_forward_length", int, 0 if table.experts == "always" else None))
        from infer.moe import expert_shape  # NumPy is in by now: the file is open
        n_experts, n_used, expert_ffn = expert_shape(model, arch, table, n_layers, ffn_dim)
        shared_ffn = int(key("expert_shared_feed_forward_length", int, ffn_dim)) if table.shared_expert else 0
        if table.shared_expert and shared_ffn <= 0:
            raise UnsupportedModelError(model.path, "no shared expert width (neither this key nor feed_forward_length)",
                                        f"key {arch}.expert_shared_feed_forward_length")
        base = float(key("rope.freq_base", float, 10000.0))
        if not table.local_rope and float(key("rope.freq_base_swa", float, base)) != base:  # type: ignore[arg-type]
            raise UnsupportedModelError(model.path, "a rotary base of the local layers' own is not supported for "
                                        f"{arch} (only the global layers' {base:g})", f"key {arch}.rope.freq_base_swa")
        embd = model.tensor(TOKEN_EMBD)
        return cls(
            arch=arch,
            n_layers=n_layers,
            dim=dim,
            ffn_dim=ffn_dim,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            vocab_size=int(embd.shape[0]),
            context_length=context_length,
            norm_eps=float(key("attention.layer_norm_rms_epsilon", float)),
            rope_base=base,
            rope_dim=int(key("rope.dimension_count", int, head_dim)),
            rope_neox=ARCHITECTURES[arch].neox_rope,
            rope_scaling=RopeScaling.from_gguf(model, arch, context_length),
            sliding_window=window,
            local_layers=local,
            rope_base_local=float(key("rope.freq_base_swa", float, 10000.0)) if table.local_rope else 0.0,
            # llama.cpp: Gemma 3 27B scales by 1 / sqrt(width / heads), the others by 1 / sqrt(head size)
            attn_scale=1.0 / math.sqrt(dim // n_heads) if arch == "gemma3" and n_layers == 62 else 0.0,
            n_experts=n_experts,
            n_experts_used=n_used,
            expert_ffn_dim=expert_ffn,
            expert_weights_norm=table.expert_weights_norm,
            shared_ffn_dim=shared_ffn,
        )


def context_warning(args: ModelArgs, ctx_size: int, name: str) -> str | None:
    """One line when a run's context exceeds what the model was trained for (positions past it are
    out of distribution), saying which rope scaling would stretch the trained positions that far."""
    trained = args.context_length
    if ctx_size <= trained:
        return None
    have = f"; the file's linear factor {args.rope_linear_scale:g} is already applied" if args.rope_linear_scale != 1 \
        else ""
    return (f"warning: a context of {ctx_size} tokens exceeds the {trained} {name} was trained for: output past "
            f"position {trained} degrades unless rope scaling stretches the positions by {ctx_size / trained:.2f}x "
            f"(rope.scaling.type linear, rope.scaling.factor {ctx_size / trained:.2f}){have}")


def output_name(model: GGUFModel) -> str:
    """The output projection: `output.weight`, or the token embeddings when the file ties them
    (SmolLM2 has no output.weight)."""
    return OUTPUT if OUTPUT in model.tensors else TOKEN_EMBD


def rope_freq_factors(model: GGUFModel, args: ModelArgs) -> np.ndarray | None:
    """Per-pair divisors of the rotary frequencies (Llama 3.1 `rope_freqs.weight`), if present."""
    if ROPE_FREQS not in model.tensors:
        return None
    return checked_tensor(model, ROPE_FREQS, (args.rope_dim // 2,)).dequantize()


def checked_tensor(model: GGUFModel, name: str, shape: tuple[int, ...]) -> TensorInfo:
    """The tensor, with the shape the metadata implies and a type the engine computes, or a
    one-line UnsupportedModelError naming the file and the tensor."""
    info = model.tensor(name)
    if info.shape != shape:
        raise UnsupportedModelError(model.path, f"shape {list(info.shape)} where {list(shape)} "
                                    "was expected from the metadata", f"tensor {name}")
    model.check_tensor_supported(info)
    return info


def check_model(model: GGUFModel) -> ModelArgs:
    """ModelArgs of the file, after checking every tensor the forward pass will touch, so a bad file
    fails at load with its name, not mid-generation."""
    args = ModelArgs.from_gguf(model)
    checked_tensor(model, TOKEN_EMBD, (args.vocab_size, args.dim))
    checked_tensor(model, OUTPUT_NORM, (args.dim,))
    if OUTPUT in model.tensors:
        checked_tensor(model, OUTPUT, (args.vocab_size, args.dim))
    rope_freq_factors(model, args)
    used = {TOKEN_EMBD, OUTPUT_NORM, OUTPUT, ROPE_FREQS}
    for i in range(args.n_layers):
        for name, shape in args.layer_shapes(i).items():
            used.add(name)
            if parse_tensor_name(name)[1] in args.arch_table.optional and name not in model.tensors:
                continue
            checked_tensor(model, name, shape)
    # a tensor no engine reads is a feature of the file that would be skipped, silently changing what
    # it computes (shared experts, a second norm, ...); llama.cpp refuses such a file too
    unused = sorted(set(model.tensors) - used)
    if unused:
        raise UnsupportedModelError(model.path, f"{len(unused)} tensor(s) that no engine here computes with, such as "
                                    f"{', '.join(unused[:3])}: a feature of '{args.arch}' files that is not supported",
                                    f"tensor {unused[0]}")
    return args


def layer_vectors(args: ModelArgs, i: int, tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray | None]:
    """A block's vectors as every engine's layer takes them, from its float32 tensors by kind
    (`tensors` may hold the matrices too): attn_norm, ffn_norm; bqkv, Q, K and V biases as one
    (q_dim + 2 kv_dim) vector (zeros for a missing one) or None; q_norm, k_norm (head_dim) or None."""
    import numpy as np

    bqkv = None
    if any(kind in tensors for kind in BIAS_KINDS):
        sizes = (args.q_dim, args.kv_dim, args.kv_dim)
        bqkv = np.concatenate([np.asarray(tensors[kind], np.float32).reshape(-1) if kind in tensors
                               else np.zeros(n, np.float32) for kind, n in zip(BIAS_KINDS, sizes, strict=True)])
    vector = {kind: np.asarray(tensors[kind], np.float32).reshape(-1) if kind in tensors else None
              for kind in ("attn_norm", "ffn_norm", *QK_NORM_KINDS, *POST_NORM_KINDS, *SINK_KINDS)}
    ffn_norm = args.arch_table.ffn_norm  # gpt-oss stores the FFN's input norm as post_attention_norm
    if ffn_norm != "ffn_norm":
        vector["ffn_norm"], vector[ffn_norm] = vector[ffn_norm], None
    if vector["attn_norm"] is None or vector["ffn_norm"] is None:
        raise ValueError(f"layer {i} lacks attn_norm or {ffn_norm}")
    return {"attn_norm": vector["attn_norm"], "ffn_norm": vector["ffn_norm"], "bqkv": bqkv,
            "q_norm": vector["attn_q_norm"], "k_norm": vector["attn_k_norm"],
            "post_attn_norm": vector["post_attention_norm"], "post_ffn_norm": vector["post_ffw_norm"],
            "sinks": vector["attn_sinks"], "bo": vector["attn_output.bias"]}


def layer_vector_kinds(args: ModelArgs) -> tuple[str, ...]:
    """The kinds of a block's tensors that are vectors (norms, biases, sinks): what layer_vectors
    reads (the experts' biases belong to the experts: infer.moe)."""
    return tuple(k for k in args.layer_kinds if (k.endswith(".bias") or k.endswith("norm") or k == "attn_sinks")
                 and k not in EXPERT_BIAS_KINDS)


def refuse_cpu_only(args: ModelArgs, path: object, engine: str, instead: str = "run it with --device cpu") -> None:
    """A one-line UnsupportedModelError for an architecture only the CPU engines compute (gpt-oss:
    its attention sinks, expert biases and MXFP4 experts have no GPU kernels yet); `instead` says what
    runs the file."""
    if not args.arch_table.gpu:
        raise UnsupportedModelError(str(path), f"'{args.arch}' runs on the CPU engines only, not {engine} yet: "
                                    f"{instead}", "key general.architecture")


def refuse_experts(args: ModelArgs, path: object, engine: str, instead: str) -> None:
    """A one-line UnsupportedModelError for an engine that has no mixture-of-experts path yet
    (issue 26); `instead` says what runs the file."""
    if args.n_experts:
        raise UnsupportedModelError(str(path), f"a mixture-of-experts model ({args.n_experts} experts) runs on the "
                                    f"CPU engines and on one GPU (resident, or --streaming with experts tiered), "
                                    f"not {engine} yet: {instead}",
                                    f"key {args.arch}.expert_count")
