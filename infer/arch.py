"""The model description, in one place: hyper-parameters from GGUF metadata, the tensor names of
the Llama/Qwen2 layout and the order a forward pass uses them, which tensors are optional (Q/K/V
biases, rope frequency factors, an output matrix tied to the embeddings), and the load-time check
that every tensor the forward pass will touch exists with the shape and a type it can compute.

Every engine (the NumPy one, the GPU one, the streaming providers and the placement planner) takes
names, shapes and options from here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from infer.errors import UnsupportedModelError

if TYPE_CHECKING:  # NumPy stays unimported until a model is opened (the CLI sets BLAS threads first)
    import numpy as np

    from infer.gguf_file import GGUFModel, TensorInfo

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
# GGUF stores Llama's Q/K rows permuted so rotary pairs are adjacent (x[2i], x[2i+1]); Qwen2 keeps
# the Hugging Face order, where dimension i pairs with i + d/2 (NeoX style). Checked against llama.cpp
# by tests/infer/test_oracle_logits.py.
NEOX_ROPE = {"llama": False, "qwen2": True}

TOKEN_EMBD = "token_embd.weight"
OUTPUT = "output.weight"
OUTPUT_NORM = "output_norm.weight"
ROPE_FREQS = "rope_freqs.weight"
# The tensors of one block, in the order the forward pass uses them.
LAYER_KINDS = ("attn_norm", "attn_q", "attn_q.bias", "attn_k", "attn_k.bias", "attn_v", "attn_v.bias",
               "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")
BIAS_KINDS = ("attn_q.bias", "attn_k.bias", "attn_v.bias")  # present in Qwen2, absent in Llama
QKV_KINDS = ("attn_q", "attn_k", "attn_v")
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
    rope_linear_scale: float  # positions are divided by this ("linear" rope scaling)

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
                "attn_v.bias": (self.kv_dim,), "attn_output": (self.dim, self.q_dim), "ffn_norm": (self.dim,),
                "ffn_gate": (self.ffn_dim, self.dim), "ffn_up": (self.ffn_dim, self.dim),
                "ffn_down": (self.dim, self.ffn_dim)}
        return {tensor_name(layer, kind): rows[kind] for kind in LAYER_KINDS}

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
        if n_heads <= 0 or dim % n_heads:
            raise UnsupportedModelError(model.path, f"{n_heads} heads do not divide width {dim}",
                                        f"key {arch}.attention.head_count")
        n_kv_heads = int(key("attention.head_count_kv", int, n_heads))
        if n_kv_heads <= 0 or n_heads % n_kv_heads:
            raise UnsupportedModelError(model.path, f"{n_kv_heads} KV heads do not divide {n_heads} heads",
                                        f"key {arch}.attention.head_count_kv")
        head_dim = int(key("attention.key_length", int, dim // n_heads))
        # llama.cpp reads a factor without a type as linear scaling (its default type), and takes
        # the factor from the older rope.scale_linear key when rope.scaling.factor is missing
        factor = float(key("rope.scaling.factor", float, 0.0) or key("rope.scale_linear", float, 0.0) or 1.0)
        scaling = str(key("rope.scaling.type", str, "linear" if factor != 1.0 else "none"))
        if scaling not in ("none", "linear"):
            raise UnsupportedModelError(model.path, f"rope scaling '{scaling}' is not supported",
                                        f"key {arch}.rope.scaling.type")
        # llama.cpp multiplies every rotation's cos and sin by this factor (for any scaling type):
        # refused rather than ignored until the rotations take it
        attn_factor = float(key("rope.scaling.attn_factor", float, 1.0))
        if attn_factor != 1.0:
            raise UnsupportedModelError(model.path, f"a rope attention factor of {attn_factor:g} is not supported "
                                        "(only 1)", f"key {arch}.rope.scaling.attn_factor")
        embd = model.tensor(TOKEN_EMBD)
        return cls(
            arch=arch,
            n_layers=int(key("block_count", int)),
            dim=dim,
            ffn_dim=int(key("feed_forward_length", int)),
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            vocab_size=int(embd.shape[0]),
            context_length=int(key("context_length", int)),
            norm_eps=float(key("attention.layer_norm_rms_epsilon", float)),
            rope_base=float(key("rope.freq_base", float, 10000.0)),
            rope_dim=int(key("rope.dimension_count", int, head_dim)),
            rope_neox=NEOX_ROPE[arch],
            rope_linear_scale=factor if scaling == "linear" else 1.0,
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


def has_qkv_bias(model: GGUFModel, layer: int) -> bool:
    return any(tensor_name(layer, kind) in model.tensors for kind in BIAS_KINDS)


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
    for i in range(args.n_layers):
        for name, shape in args.layer_shapes(i).items():
            if name.endswith(".bias") and name not in model.tensors:
                continue
            checked_tensor(model, name, shape)
    return args
