// The canonical sum of a quantized matrix product: what every product kernel computes for one
// output y[t, r] (token t, weight row r), so that a row's result is the same bits whether it is
// computed alone (qgemv) or among 512 others (qmm), and whichever kernel, tile or launch holds it.
//
// Inputs: weight row r in its planar format (formats.cuh) and token t's activations in their 8-bit
// form (act.cuh): int8 values xq, a float scale xs per group (32 values for q8_0, 256 for q8_k) and
// the sum of xq per 32 (xsum).
//
//   idot_j  = sum over the 32 values of sub-block j of q_w * xq        (int32, exact; Q6_K: per 16)
//   term_j  (32-value formats q8, g4, g5: one per sub-block)           (float32, formulas below)
//   tile    = (term_4T + term_4T+1) + (term_4T+2 + term_4T+3)          (absent sub-blocks: +0.0)
//   K-quants (k4, k5, k6): the tile is the 256-value super-block, from integer sums over its
//             8 sub-blocks (isum, msum: exact) and one float formula
//   group   = 0; for each tile of a group of 1024 values (CANON_GROUP), in order: group + tile
//   acc     = 0; for each group in ascending K: acc = acc + group
//   y       = acc (+ bias[r]) (+ residual[t, r])
// The groups let a product split K across blocks (each computes whole groups, a last step adds them
// in order) and give the same bits as one block walking all of K.
//
// Every float operation is an explicit round-to-nearest intrinsic: the compiler may not contract
// them into fused multiply-adds or reorder them, so the NumPy reference (infer/gpu/reference.py)
// reproduces every bit. Single precision only: the cards this is for run FP64 at 1/64 of FP32.
#pragma once

#define CANON_TILE 4  // sub-blocks per tile of the 32-value formats
#define CANON_GROUP 1024  // values per group (32 sub-blocks: one iteration of a qgemv warp)

__device__ __forceinline__ float i2f(int v) { return __int2float_rn(v); }

// Q8_0 weights (scale sw) with q8_0 activations
__device__ __forceinline__ float term_q8(float sw, float xs, int idot) {
    return __fmul_rn(__fmul_rn(sw, xs), i2f(idot));
}

// Q4_0 Q4_1 Q5_0 Q5_1 weights, w = s*q + m, with q8_0 activations
__device__ __forceinline__ float term_g(float s, float m, float xs, int idot, int xsum) {
    return __fmul_rn(xs, __fadd_rn(__fmul_rn(s, i2f(idot)), __fmul_rn(m, i2f(xsum))));
}

// Q4_K Q5_K super-block, w = (d*sc)*q - dmin*mn: isum = sum_j sc_j*idot_j, msum = sum_j mn_j*xsum_j
__device__ __forceinline__ float term_k45(float d, float dmin, float xs, int isum, int msum) {
    return __fmul_rn(xs, __fsub_rn(__fmul_rn(d, i2f(isum)), __fmul_rn(dmin, i2f(msum))));
}

// Q6_K super-block, w = d*sc*(q-32): isum = sum over the 16 halves of sc_h * idot_h
__device__ __forceinline__ float term_k6(float d, float xs, int isum) {
    return __fmul_rn(__fmul_rn(d, xs), i2f(isum));
}

__device__ __forceinline__ float tile4(float t0, float t1, float t2, float t3) {
    return __fadd_rn(__fadd_rn(t0, t1), __fadd_rn(t2, t3));
}

// The float formats (f16, bf16, f32 weights): term_j = the 32 products of sub-block j added one by
// one in ascending order, each product and sum rounded; tiles and acc as above.

// The epilogue every product kernel shares.
__device__ __forceinline__ float canon_out(float acc, int row, int tok, int ldy, const float* bias,
                                           const float* residual) {
    float v = acc;
    if (bias) v = __fadd_rn(v, bias[row]);
    if (residual) v = __fadd_rn(v, residual[(long long)tok * ldy + row]);
    return v;
}
