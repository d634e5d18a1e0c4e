#!/usr/bin/env bash
# Builds llama.cpp's llama-bench, llama-batched-bench and llama-server with CUDA on a machine WITHOUT a GPU (nvcc only),
# for the GPU machine of the device tool, and packs them as .peer/llama-bin.tar.xz (ignored by git,
# carried with `carry: [".peer"]`): scripts/gpu-check.sh (GPU_CHECK_LLAMA=1) then measures llama.cpp
# on the same file as ours without spending 8-12 minutes of device time on a build.
#
#   bash scripts/llama-cpp-cuda.sh [ARCH]      # ARCH: CUDA architecture, default 90 (H200); ~40-60 min on 2 cores
#
# The source is .peer/llama.cpp.tgz (/work/shared/device/llama-cpp-src.sh: the llama.cpp that
# llama-cpp-python 0.3.36 vendors, the version of the CPU oracle tests). This machine's toolkit has
# no cuBLAS and no driver: cuBLAS comes from the nvidia-cublas wheel of the same CUDA major, and the
# driver library is an empty stub with its soname (libcuda.so.1), both in a private directory (the
# GPU machine links its own libcublas.so.13 and libcuda.so.1 at run time; llama.cpp keeps its default
# virtual-memory pool). The CPU backend is built for every x86 variant and loaded at run time
# (GGML_BACKEND_DL, GGML_CPU_ALL_VARIANTS): the GPU machine's CPU need not be this one's, and with
# --n-cpu-moe llama.cpp's CPU half gets that machine's best instructions (AVX-512, VNNI, BF16), as a
# native build there does. Two things learned on the H100 machines (2026-12-06): the sapphirerapids
# variant (AMX) dies there with SIGILL, so it is left out (the zen4 variant, AVX-512 with VNNI and
# BF16, is then chosen, as a native build there compiles no AMX code); and the shared libraries are
# linked with --no-as-needed, or the symbol-less driver stub is dropped from libggml-cuda.so's needs
# and the CUDA backend fails to load ("undefined symbol: cuMemCreate": the package of that day needs
# LD_PRELOAD=libcuda.so.1, which scripts/gpu-check.sh sets).
set -euo pipefail
cd "$(dirname "$0")/.."
arch=${1:-90}
work=${LLAMA_CUDA_WORK:-/tmp/llama-cuda-build}
[ -f .peer/llama.cpp.tgz ] || bash /work/shared/device/llama-cpp-src.sh
command -v nvcc > /dev/null || { echo "nvcc is not installed" >&2; exit 2; }
major=$(nvcc --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p')
mkdir -p "$work/cublas"
if [ ! -f "$work/cublas/lib/libcublas.so" ]; then
    python3 -m pip download -q --no-deps "nvidia-cublas==${major}.0.*" -d "$work/cublas/whl"
    python3 -m zipfile -e "$work"/cublas/whl/*.whl "$work/cublas/x"
    mkdir -p "$work/cublas/lib" "$work/cublas/include"
    cp "$work"/cublas/x/nvidia/cu"$major"/lib/libcublas*.so."$major" "$work/cublas/lib/"
    cp "$work"/cublas/x/nvidia/cu"$major"/include/*.h "$work/cublas/include/"
    ln -sf "libcublas.so.$major" "$work/cublas/lib/libcublas.so"
    ln -sf "libcublasLt.so.$major" "$work/cublas/lib/libcublasLt.so"
fi
[ -f "$work/cublas/lib/libcuda.so" ] || echo "" | gcc -shared -x c - -o "$work/cublas/lib/libcuda.so" -Wl,-soname,libcuda.so.1
rm -rf "$work/src" && mkdir -p "$work/src" && tar xzf .peer/llama.cpp.tgz -C "$work/src"
cd "$work/src/llama.cpp"
inc="-I$work/cublas/include"
cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$arch" -DGGML_NATIVE=OFF \
    -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON -DBUILD_SHARED_LIBS=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_BUILD_RPATH_USE_ORIGIN=ON -DCMAKE_LIBRARY_PATH="$work/cublas/lib" \
    -DCMAKE_SHARED_LINKER_FLAGS="-Wl,--no-as-needed" \
    -DCMAKE_CUDA_FLAGS="$inc" -DCMAKE_CXX_FLAGS="$inc" -DCMAKE_C_FLAGS="$inc" > "$work/cmake.log"
cmake --build build -j "$(nproc)" > "$work/build.log"  # every target: the CPU variants are libraries of their own
out=$work/bin && rm -rf "$out" && mkdir -p "$out"
cp build/bin/llama-bench build/bin/llama-server build/bin/llama-batched-bench "$out/"  # batched: many sequences at once
find build -name "*.so*" -exec cp -P {} "$out/" \;
rm -f "$out"/libcublas* "$out"/libcuda.so*  # the GPU machine's own
rm -f "$out"/libggml-cpu-sapphirerapids.so  # AMX: SIGILL on the GPU machines
strip --strip-unneeded "$out"/*.so* "$out"/llama-bench "$out"/llama-server "$out"/llama-batched-bench 2> /dev/null || true
{ echo "llama.cpp $(git describe --tags 2>/dev/null || echo 'from llama-cpp-python 0.3.36') CUDA sm_$arch, built $(date -u +%F) on $(hostname) with nvcc $(nvcc --version | sed -n 's/.*release //p')"; } > "$out/BUILD"
cd - > /dev/null
mkdir -p .peer
tar cJf .peer/llama-bin.tar.xz -C "$out" .
ls -la .peer/llama-bin.tar.xz
