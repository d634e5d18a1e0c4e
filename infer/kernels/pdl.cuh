// Programmatic dependent launch (sm_90+): a kernel launched with the programmatic-serialization
// attribute (infer/gpu/pdl.py) may start while the kernel before it in the stream still runs, so its
// launch, its blocks' start and the first loads of weights nobody writes overlap that kernel's tail.
// Before it reads anything an earlier kernel wrote, or writes anything, it must wait:
//   pdl_wait()     returns once the previous kernel has finished and its writes are visible (at
//                  once when the kernel was launched without the attribute, or below sm_90);
//   pdl_release()  lets the next kernel be launched now (at the latest it is when this one ends).
// Every kernel that pdl.py may launch with the attribute calls pdl_wait() first, except for loads of
// immutable operands (weights), and pdl_release() after it: at most one kernel runs ahead.
#pragma once

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_release() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
// Both, at the top of a kernel whose every load depends on earlier kernels.
__device__ __forceinline__ void pdl_enter() {
    pdl_wait();
    pdl_release();
}
