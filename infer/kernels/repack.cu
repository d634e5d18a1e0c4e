// GGUF blocks -> the planar formats of formats.cuh, once per tensor at upload. One thread per
// 32-weight sub-block g; rows hold whole GGUF blocks, so sub-block g of the flat tensor lies in
// GGUF block g / (block_size / 32) whatever the row length. Byte-wise reads: GGUF blocks of 18, 22,
// 34 or 210 bytes are not aligned for wider loads, and this runs once.
#include "formats.cuh"

__device__ __forceinline__ float f16_at(const uint8_t* p) {
    return __half2float(__ushort_as_half((unsigned short)(p[0] | (p[1] << 8))));
}

__device__ __forceinline__ uint32_t u32_at(const uint8_t* p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

// 16 packed bytes (byte j = q[j] | q[j+16] << 4) from per-weight values produced by `value(i)`
template <class V>
__device__ __forceinline__ void store_nibbles(uint8_t* dst, V value) {
    uint32_t w[4];
#pragma unroll
    for (int t = 0; t < 4; ++t) {
        uint32_t word = 0;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int j = 4 * t + k;
            word |= ((value(j) & 0xFu) | ((value(j + 16) & 0xFu) << 4)) << (8 * k);
        }
        w[t] = word;
    }
    *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
}

__device__ __forceinline__ void store_copy16(uint8_t* dst, const uint8_t* src) {
    uint32_t w[4];
#pragma unroll
    for (int t = 0; t < 4; ++t) w[t] = u32_at(src + 4 * t);
    *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
}

__device__ __forceinline__ void store_sm(uint8_t* sm, long long g, float s, float m) {
    reinterpret_cast<__half2*>(sm)[g] = __floats2half2_rn(s, m);
}

// K-quant 6-bit scale and min of sub-block j (0..7) from the 12 packed bytes
__device__ __forceinline__ void k_scale_min(const uint8_t* sc, int j, int& s, int& m) {
    if (j < 4) {
        s = sc[j] & 63;
        m = sc[j + 4] & 63;
    } else {
        s = (sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4);
        m = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
    }
}

#define REPACK_PROLOGUE                                                 \
    const long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x; \
    if (g >= n_sb) return;

#define REPACK_ARGS const uint8_t *src, long long n_sb, uint8_t *qs, uint8_t *hi, uint8_t *sm, uint8_t *dm

extern "C" __global__ void repack_q8_0(REPACK_ARGS) {
    REPACK_PROLOGUE
    const uint8_t* b = src + g * 34;
    uint32_t w[8];
#pragma unroll
    for (int t = 0; t < 8; ++t) w[t] = u32_at(b + 2 + 4 * t);
    uint4* dst = reinterpret_cast<uint4*>(qs + g * 32);
    dst[0] = make_uint4(w[0], w[1], w[2], w[3]);
    dst[1] = make_uint4(w[4], w[5], w[6], w[7]);
    reinterpret_cast<__half*>(sm)[g] = __float2half_rn(f16_at(b));
}

extern "C" __global__ void repack_q4_0(REPACK_ARGS) {
    REPACK_PROLOGUE
    const uint8_t* b = src + g * 18;
    store_copy16(qs + g * 16, b + 2);
    const float d = f16_at(b);
    store_sm(sm, g, d, -8.f * d);
}

extern "C" __global__ void repack_q4_1(REPACK_ARGS) {
    REPACK_PROLOGUE
    const uint8_t* b = src + g * 20;
    store_copy16(qs + g * 16, b + 4);
    store_sm(sm, g, f16_at(b), f16_at(b + 2));
}

extern "C" __global__ void repack_q5_0(REPACK_ARGS) {
    REPACK_PROLOGUE
    const uint8_t* b = src + g * 22;
    store_copy16(qs + g * 16, b + 6);
    reinterpret_cast<uint32_t*>(hi)[g] = u32_at(b + 2);
    const float d = f16_at(b);
    store_sm(sm, g, d, -16.f * d);
}

extern "C" __global__ void repack_q5_1(REPACK_ARGS) {
    REPACK_PROLOGUE
    const uint8_t* b = src + g * 24;
    store_copy16(qs + g * 16, b + 8);
    reinterpret_cast<uint32_t*>(hi)[g] = u32_at(b + 4);
    store_sm(sm, g, f16_at(b), f16_at(b + 2));
}

// K-quant sub-block scales: (sc, mn) or two int8 scales, as two bytes
__device__ __forceinline__ void store_sc(uint8_t* sm, long long g, int lo, int hi) {
    reinterpret_cast<unsigned short*>(sm)[g] = (unsigned short)((lo & 0xFF) | ((hi & 0xFF) << 8));
}

// the block's f16 pair (d, dmin), or (d, 0), once per 256-weight block
__device__ __forceinline__ void store_dm(uint8_t* dm, long long g, const uint8_t* d, const uint8_t* dmin) {
    if ((g & 7) == 0) {
        const unsigned int lo = d[0] | (d[1] << 8), hi = dmin ? (dmin[0] | (dmin[1] << 8)) : 0u;
        reinterpret_cast<unsigned int*>(dm)[g >> 3] = lo | (hi << 16);
    }
}

// Q4_K: d, dmin (f16), scales[12], qs[128]; sub-block j uses the low (j even) or high nibbles of
// qs[32*(j/2) .. +32]; w = (d*sc)*q - dmin*mn
extern "C" __global__ void repack_q4_k(REPACK_ARGS) {
    REPACK_PROLOGUE
    const int j = (int)(g & 7);
    const uint8_t* b = src + (g >> 3) * 144;
    const uint8_t* q = b + 16 + 32 * (j >> 1);
    const int shift = 4 * (j & 1);
    store_nibbles(qs + g * 16, [&](int i) { return (uint32_t)(q[i] >> shift); });
    int s, m;
    k_scale_min(b + 4, j, s, m);
    store_sc(sm, g, s, m);
    store_dm(dm, g, b, b + 2);
}

// Q5_K: d, dmin, scales[12], qh[32], qs[128]; bit 4 of weight i of sub-block j is bit j of qh[i]
extern "C" __global__ void repack_q5_k(REPACK_ARGS) {
    REPACK_PROLOGUE
    const int j = (int)(g & 7);
    const uint8_t* b = src + (g >> 3) * 176;
    const uint8_t* qh = b + 16;
    const uint8_t* q = b + 48 + 32 * (j >> 1);
    const int shift = 4 * (j & 1);
    store_nibbles(qs + g * 16, [&](int i) { return (uint32_t)(q[i] >> shift); });
    uint32_t bits = 0;
#pragma unroll
    for (int i = 0; i < 32; ++i) bits |= (uint32_t)((qh[i] >> j) & 1) << i;
    reinterpret_cast<uint32_t*>(hi)[g] = bits;
    int s, m;
    k_scale_min(b + 4, j, s, m);
    store_sc(sm, g, s, m);
    store_dm(dm, g, b, b + 2);
}

// Q6_K: ql[128], qh[64], scales[16] (int8), d; sub-block j = 4h + jj takes the low (jj < 2) or high
// nibbles of ql[64h + 32*(jj&1) ..] and bits 2jj..2jj+1 of qh[32h ..]; w = (d*sc)*(q - 32), one
// scale per 16 weights
extern "C" __global__ void repack_q6_k(REPACK_ARGS) {
    REPACK_PROLOGUE
    const int j = (int)(g & 7), h = j >> 2, jj = j & 3;
    const uint8_t* b = src + (g >> 3) * 210;
    const uint8_t* ql = b + 64 * h + 32 * (jj & 1);
    const uint8_t* qh = b + 128 + 32 * h;
    const int shift = 4 * (jj >> 1);
    store_nibbles(qs + g * 16, [&](int i) { return (uint32_t)(ql[i] >> shift); });
    uint32_t w0 = 0, w1 = 0;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        w0 |= (uint32_t)((qh[i] >> (2 * jj)) & 3) << (2 * i);
        w1 |= (uint32_t)((qh[i + 16] >> (2 * jj)) & 3) << (2 * i);
    }
    reinterpret_cast<uint2*>(hi)[g] = make_uint2(w0, w1);
    store_sc(sm, g, b[192 + 2 * j], b[192 + 2 * j + 1]);
    store_dm(dm, g, b + 208, nullptr);
}
