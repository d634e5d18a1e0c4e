"""Rotary position scaling as llama.cpp applies it (`RopeScaling`: none, linear, YaRN; the attention
factor), read from GGUF metadata; infer.layers.Rope turns it into angles. Keys llama.cpp ignores
for the supported architectures, set to values that would mean something else, are refused."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from infer.errors import UnsupportedModelError

if TYPE_CHECKING:  # NumPy stays unimported until a model is opened (the CLI sets BLAS threads first)
    import numpy as np

    from infer.gguf_file import GGUFModel


# llama.cpp's YaRN defaults (llama-hparams.h); for these architectures it reads no file key for them
YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0
# Keys llama.cpp ignores for these architectures: a file that sets them means something we would not do
_UNHONOURED_ROPE_KEYS = {"rope.scaling.yarn_ext_factor": 1.0, "rope.scaling.yarn_attn_factor": 1.0,
                         "rope.scaling.yarn_beta_fast": YARN_BETA_FAST, "rope.scaling.yarn_beta_slow": YARN_BETA_SLOW,
                         "rope.scaling.yarn_log_multiplier": 0.0}


@dataclass(frozen=True)
class RopeScaling:
    """How positions become rotation angles beyond theta_i = pos * base^(-2i/d), as llama.cpp's
    ggml_rope_ext takes them: `linear` divides every angle by `factor`; `yarn` interpolates the slow
    dimensions like linear, keeps the fast ones, ramps between them (correction dimensions from
    `original_context` and the betas) and scales cos and sin by 1 + 0.1 ln(factor); `attn_factor`
    (rope.scaling.attn_factor) scales cos and sin for every kind."""

    kind: str = "none"  # none | linear | yarn
    factor: float = 1.0
    original_context: int = 0  # yarn: the context the model was trained at before stretching
    attn_factor: float = 1.0

    @classmethod
    def from_gguf(cls, model: GGUFModel, arch: str, context_length: int) -> RopeScaling:
        def key(name: str, kind: type, default: object) -> object:
            full = f"{arch}.{name}"
            return model.require(full, kind) if full in model.metadata else default

        # llama.cpp reads a factor without a type as linear scaling (its default type), and takes
        # the factor from the older rope.scale_linear key when rope.scaling.factor is missing
        factor = float(key("rope.scaling.factor", float, 0.0) or key("rope.scale_linear", float, 0.0) or 1.0)
        kind = str(key("rope.scaling.type", str, "linear" if factor != 1.0 else "none"))
        if kind not in ("none", "linear", "yarn"):
            raise UnsupportedModelError(model.path, f"rope scaling '{kind}' is not supported (supported: none, "
                                        "linear, yarn)", f"key {arch}.rope.scaling.type")
        for name, default in _UNHONOURED_ROPE_KEYS.items():
            value = float(key(name, float, default))  # type: ignore[arg-type]
            if value != default:
                raise UnsupportedModelError(model.path, f"{name} = {value:g} is not supported (only {default:g}, "
                                            "what llama.cpp uses for this architecture)", f"key {arch}.{name}")
        if factor <= 0:
            raise UnsupportedModelError(model.path, f"a rope scaling factor of {factor:g} is not positive",
                                        f"key {arch}.rope.scaling.factor")
        original = int(key("rope.scaling.original_context_length", int, context_length))
        if kind == "none":
            factor = 1.0  # llama.cpp: "none" never scales
        return cls(kind, factor, original, float(key("rope.scaling.attn_factor", float, 1.0)))

    def angle_scale(self, rope_dim: int, rope_base: float) -> Callable[[np.ndarray, np.ndarray],
                                                                       tuple[np.ndarray, float]]:
        """f(theta, pair) -> (the angles llama.cpp rotates by, the factor on cos and sin), theta
        float32 (positions, pairs) of the unscaled angles (after any frequency factors), as
        ggml's rope_yarn computes them in float32."""
        import numpy as np

        f32 = np.float32
        logf = _c_logf()
        if self.kind == "none":
            freq_scale = f32(1.0)
        else:
            freq_scale = f32(f32(1.0) / f32(self.factor))
        if self.kind != "yarn":
            def plain(theta: np.ndarray, pair: np.ndarray) -> tuple[np.ndarray, float]:
                return (theta if freq_scale == 1 else freq_scale * theta), f32(self.attn_factor)
            return plain
        # llama-context.cpp: the attention factor get_mscale(factor) / (1 + 0.1 ln factor) (about 1),
        # times the file's; ggml's rope_yarn then multiplies by 1 + 0.1 ln(1 / freq_scale)
        factor = f32(f32(1.0) / freq_scale)
        mscale = f32(f32(f32(0.1) * logf(factor)) + f32(1.0))  # get_mscale(factor, 1): 0.1f * 1.0f * logf + 1
        mscale = f32(mscale * f32(f32(1.0) / f32(f32(1.0) + f32(f32(0.1) * logf(factor)))))
        mscale = f32(mscale * f32(self.attn_factor))
        mscale = f32(mscale * f32(f32(1.0) + f32(f32(0.1) * logf(f32(f32(1.0) / freq_scale)))))
        low, high = yarn_correction_dims(rope_dim, self.original_context, rope_base)

        def yarn(theta: np.ndarray, pair: np.ndarray) -> tuple[np.ndarray, float]:
            # rope_yarn_ramp of i0 = 2 * pair: y = (i0 / 2 - low) / max(0.001, high - low)
            y = (pair.astype(f32) - f32(low)) / f32(max(0.001, high - low))
            ramp = (f32(1.0) - np.minimum(f32(1.0), np.maximum(f32(0.0), y))).astype(f32)
            interp = (freq_scale * theta).astype(f32)
            # theta_interp * (1 - ramp) + theta_extrap * ramp; the compiler fuses one product
            mixed = interp.astype(np.float64) * (f32(1.0) - ramp) + (theta * ramp).astype(np.float64)
            return mixed.astype(f32), mscale
        return yarn


def yarn_correction_dims(rope_dim: int, original_context: int, base: float) -> tuple[float, float]:
    """ggml_rope_yarn_corr_dims: the first and last rotary dimension YaRN ramps between, from
    beta_fast and beta_slow rotations over the original context (float32, as ggml computes)."""
    import numpy as np

    f32, logf = np.float32, _c_logf()

    def corr_dim(n_rot: float) -> np.float32:
        ratio = f32(f32(original_context) / f32(f32(n_rot) * f32(2) * f32(math.pi)))
        return f32(f32(f32(rope_dim) * logf(ratio)) / f32(f32(2) * logf(f32(base))))

    start, end = math.floor(corr_dim(YARN_BETA_FAST)), math.ceil(corr_dim(YARN_BETA_SLOW))
    return float(max(0, start)), float(min(rope_dim - 1, end))


def _c_logf() -> Callable[[float], np.float32]:
    """The C library's logf (float32 in, float32 out), as ggml calls it; NumPy's float32 log otherwise."""
    import numpy as np

    from infer.cmath import c_float_function

    fn = c_float_function("logf")
    if fn is None:
        return lambda x: np.log(np.float32(x))
    return lambda x: np.float32(fn(float(x)))
