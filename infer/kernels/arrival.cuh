// The last block of a launch to finish a piece of work does the step that needs all of it (a
// decode step's routing after its router product, its gated activation after the gate and up
// products, its combination after the down products), instead of a launch of its own: a decode
// step pays a few microseconds a launch, which is most of such a step's cost.
#pragma once

// Whether this block is the last of `total` to arrive at *counter. Every thread of the block calls
// it, once, after its global writes; the last block then sees every block's writes made before
// their arrival (read them with __ldcg: past this SM's L1), and sets the counter back to 0 for the
// next launch (a CUDA graph's replays reuse it).
__device__ __forceinline__ bool last_to_arrive(unsigned int* counter, unsigned int total) {
    __shared__ int arrived_last;
    __threadfence();  // this block's writes, before its arrival
    __syncthreads();
    if (threadIdx.x == 0) {
        arrived_last = atomicAdd(counter, 1u) == total - 1u;
        if (arrived_last) *counter = 0u;
    }
    __syncthreads();
    if (arrived_last) __threadfence();
    return arrived_last;
}
