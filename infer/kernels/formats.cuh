// Planar GPU weight formats and their decoders, shared by the GEMV, dequantization and embedding
// kernels. Every quantized GGML type is repacked once at upload (repack.cu) into a planar format
// whose unit is a sub-block of 32 consecutive weights of a row; a matrix of `rows` x `K` has
// rows*K/32 sub-blocks, numbered row-major, and each plane is an array indexed by that number (dm:
// by number / 8, one per 256-weight K-quant block), so a warp's lanes read consecutive 16-byte
// pieces (coalesced, aligned). All formats keep GGUF's numbers exactly:
//
//   q8: qs int8[32] (natural order)               sm half          : w = s*q          (Q8_0)
//   g4: qs u8[16] (byte j = q[j] | q[j+16]<<4)    sm half2 (s, m)  : w = s*q + m      (Q4_0 Q4_1)
//   g5: g4's qs + hi u32 (bit j = bit 4 of q[j])  sm half2 (s, m)  : w = s*q + m      (Q5_0 Q5_1)
//   k4: g4's qs, sm u8x2 (sc, mn), dm half2 (d, dmin): w = (d*sc)*q - dmin*mn         (Q4_K)
//   k5: g5's qs and hi, sm and dm as k4                                               (Q5_K)
//   k6: g4's qs + hi u32x2 (2 bits per weight: word 0 weights 0..15, word 1 16..31),
//       sm int8x2 (sc_lo, sc_hi), dm half2 (d, 0): w = (d*sc_lo)*(q-32) for j<16, sc_hi for j>=16 (Q6_K)
//   f16 / bf16 / f32: the GGUF data itself, row-major.
//
// Integers become floats without the slow I2F unit: a byte b placed under the exponent of 2^23
// (0x4B0000bb) is the float 2^23 + b, and one FADD removes the 2^23.
//
// The product kernels (qmm.cu) multiply these integers with 8-bit activations and sum in the
// canonical order of canon.cuh; dequant.cu turns them into floats (the embedding lookup).
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#if defined(__CUDACC_RTC__)  // NVRTC has no system headers
typedef unsigned char uint8_t;
typedef signed char int8_t;
typedef unsigned int uint32_t;
#else
#include <stdint.h>
#endif

#define MAGIC_2P23 8388608.0f
#define NEG_INF __int_as_float(0xff800000u)

__device__ __forceinline__ float byte_as_float(uint32_t word, int k, float bias) {
    // byte k of `word`, plus 2^23, minus (2^23 + bias): exact for bytes and small biases
    return __int_as_float(__byte_perm(word, 0x4B000000u, 0x7540u | (uint32_t)k)) - (MAGIC_2P23 + bias);
}

// 4 bits (bit i of `bits`) -> bit 4 of byte i
__device__ __forceinline__ uint32_t spread_bit4(uint32_t bits) {
    return ((bits * 0x00204081u) & 0x01010101u) << 4;
}

// four 2-bit fields (bits 2i..2i+1 of `bits`) -> bits 4..5 of byte i
__device__ __forceinline__ uint32_t spread_2bit4(uint32_t bits) {
    return ((bits | (bits << 6) | (bits << 12) | (bits << 18)) & 0x03030303u) << 4;
}

__device__ __forceinline__ float4 ldg4(const float* p) { return __ldg(reinterpret_cast<const float4*>(p)); }

__device__ __forceinline__ uint4 ldg_u4(const uint8_t* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }

// Planes of one tensor; unused planes are null.
struct Planes {
    const uint8_t* qs;
    const uint8_t* hi;
    const uint8_t* sm;
    const uint8_t* dm;
};

// ---------------------------------------------------------------- q8
struct FmtQ8 {
    struct Raw { uint4 a, b; float s; };
    static __device__ __forceinline__ Raw load(const Planes& p, long long sb) {
        Raw r;
        r.a = ldg_u4(p.qs + sb * 32);
        r.b = ldg_u4(p.qs + sb * 32 + 16);
        r.s = __half2float(__ldg(reinterpret_cast<const __half*>(p.sm) + sb));
        return r;
    }
    static __device__ __forceinline__ void dequant(const Raw& r, float* out) {
        const uint32_t w[8] = {r.a.x, r.a.y, r.a.z, r.a.w, r.b.x, r.b.y, r.b.z, r.b.w};
#pragma unroll
        for (int t = 0; t < 8; ++t)
#pragma unroll
            for (int k = 0; k < 4; ++k) out[4 * t + k] = r.s * byte_as_float(w[t] ^ 0x80808080u, k, 128.f);
    }
};

// ---------------------------------------------------------------- g4 / g5 / k4 / k5 / k6: the nibble plane
// KIND 4: g4, 5: g5, 14: k4, 15: k5, 16: k6
template <int KIND>
struct FmtNib {
    static constexpr bool K = KIND >= 14;
    static constexpr int BITS = KIND % 10;  // 4, 5 or 6
    struct Raw { uint4 q; uint2 h; float2 sm; };  // sm: (scale, offset), or for k6 (scale_lo, scale_hi)
    static __device__ __forceinline__ Raw load(const Planes& p, long long sb) {
        Raw r;
        r.q = ldg_u4(p.qs + sb * 16);
        if (BITS == 5) {
            r.h.x = __ldg(reinterpret_cast<const uint32_t*>(p.hi) + sb);
            r.h.y = 0;
        } else if (BITS == 6) {
            r.h = __ldg(reinterpret_cast<const uint2*>(p.hi) + sb);
        } else {
            r.h = make_uint2(0, 0);
        }
        if (!K) {
            r.sm = __half22float2(__ldg(reinterpret_cast<const __half2*>(p.sm) + sb));
        } else {
            const float2 dm = __half22float2(__ldg(reinterpret_cast<const __half2*>(p.dm) + (sb >> 3)));
            const unsigned short sc = __ldg(reinterpret_cast<const unsigned short*>(p.sm) + sb);
            if (BITS == 6) {  // two signed 8-bit scales, one per 16 weights
                r.sm = make_float2(dm.x * (float)(signed char)(sc & 0xFF), dm.x * (float)(signed char)(sc >> 8));
            } else {  // 6-bit scale and min: w = (d*sc)*q - dmin*mn
                r.sm = make_float2(dm.x * (float)(sc & 0xFF), -(dm.y * (float)(sc >> 8)));
            }
        }
        return r;
    }
    // word t of the nibble plane -> (weights 4t..4t+3, weights 16+4t..16+4t+3) as byte values
    static __device__ __forceinline__ void word_values(const Raw& r, int t, uint32_t& lo, uint32_t& hi) {
        const uint32_t w = t == 0 ? r.q.x : t == 1 ? r.q.y : t == 2 ? r.q.z : r.q.w;
        lo = w & 0x0F0F0F0Fu;
        hi = (w >> 4) & 0x0F0F0F0Fu;
        if (BITS == 5) {
            lo |= spread_bit4((r.h.x >> (4 * t)) & 0xFu);
            hi |= spread_bit4((r.h.x >> (16 + 4 * t)) & 0xFu);
        } else if (BITS == 6) {
            lo |= spread_2bit4((r.h.x >> (8 * t)) & 0xFFu);
            hi |= spread_2bit4((r.h.y >> (8 * t)) & 0xFFu);
        }
    }
    static __device__ __forceinline__ void dequant(const Raw& r, float* out) {
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            uint32_t lo, hi;
            word_values(r, t, lo, hi);
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                if (BITS == 6) {
                    out[4 * t + k] = r.sm.x * byte_as_float(lo, k, 32.f);
                    out[16 + 4 * t + k] = r.sm.y * byte_as_float(hi, k, 32.f);
                } else {  // no fused multiply-add: the same two roundings as the CPU's dequantization
                    out[4 * t + k] = __fadd_rn(__fmul_rn(r.sm.x, byte_as_float(lo, k, 0.f)), r.sm.y);
                    out[16 + 4 * t + k] = __fadd_rn(__fmul_rn(r.sm.x, byte_as_float(hi, k, 0.f)), r.sm.y);
                }
            }
        }
    }
};

typedef FmtNib<4> FmtG4;
typedef FmtNib<5> FmtG5;
typedef FmtNib<14> FmtK4;
typedef FmtNib<15> FmtK5;
typedef FmtNib<16> FmtK6;

// ---------------------------------------------------------------- float formats
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(float v) { return v; }
