#!/bin/bash
# The one script to run on the GPU machine (H200): sets up carried wheels, compiles the kernels,
# runs the GPU tests, then benchmarks the synthetic 8B Q4_K_M inside --vram-budget 8GB (prompt,
# decode, 32 sequences decoded together and each alone, the FP64 instructions of a pass, per-product
# timings) and 6GB, and llama.cpp's llama-bench on the same file. Logs and JSON results go under
# $OUT; a summary is printed last. No section aborts the run.
#
#   OUT=/path/to/out bash scripts/gpu-check.sh            # tests + 8B benchmarks (~7-9 min)
#   GPU_CHECK_SKIP_BENCH=1 bash scripts/gpu-check.sh      # compile + GPU tests (~4-5 min)
#   GPU_CHECK_SKIP_TESTS=1 bash scripts/gpu-check.sh      # the 8B benchmarks (~3-4 min)
#   GPU_CHECK_TESTS="tests/gpu/test_kernels.py -k qmm"    # these tests instead of the default list
#   GPU_CHECK_SKIP_COMPILE=1 ...                          # no separate compile of every module (the tests compile
#                                                         # what they use)
#   GPU_CHECK_SWEEP=1 ...                                 # bench.kernel_sweep --skip-products: attention, norms
#   GPU_CHECK_BENCH_QUICK=1 ...                           # only the first benchmark (8 GB, with the batch)
#   GPU_CHECK_BENCH_BATCH= GPU_CHECK_BENCH_TAG=-x ...     # that benchmark without the batch, its files tagged -x
#   GPU_CHECK_PMM_SWEEP=1 GPU_CHECK_PASS_PROFILE=1 ...    # the prompt products' variants; where a pass's time goes
#   GPU_CHECK_STREAM=1 ...                                # also the 8B through the streaming engine (8 GB)
#   GPU_CHECK_Q8=1 ...                                    # also the 8B Q8_0 (resident, no budget)
#   GPU_CHECK_LLAMA_BUILD=1 ...                           # start building llama.cpp (.peer/llama.cpp.tgz from
#                                                         # /work/shared/device/llama-cpp-src.sh) in the background:
#                                                         # 8-12 min, it outlives this call (setsid)
#   GPU_CHECK_LLAMA=1 GPU_CHECK_SKIP_TESTS=1 GPU_CHECK_SKIP_BENCH=1 ...
#                                                         # wait for that build, then llama-bench pp512/tg128 on
#                                                         # the synthetic 8B (same file as ours); with a carried
#                                                         # .peer/llama-bin.tar.xz (scripts/llama-cpp-cuda.sh built
#                                                         # it on a CPU machine) no build: its binaries are used,
#                                                         # for GPU_CHECK_COMPARE, GPU_CHECK_MOE and
#                                                         # GPU_CHECK_70B_LLAMA_NGL too (carry .peer/llama-bin.tar.xz;
#                                                         # 44 MB of the call's 64 MiB)
#   GPU_CHECK_COMPARE=m.gguf GPU_CHECK_COMPARE_DEPTHS=0,8192 ...
#                                                         # that file: bench.gpu_bench --depth D and llama-bench -d D
#                                                         # (pp512, tg128) at each depth
#   GPU_CHECK_SPEC=1 ...                                  # speculative decoding: the CLI with a draft model on
#                                                         # synthetic 8B/1B
#   GPU_CHECK_70B=1 GPU_CHECK_70B_CPU_TIER=auto ...        # the 70B bench with its RAM layers on the CPU in decode
#   GPU_CHECK_70B_LLAMA_NGL=40 GPU_CHECK_LLAMA_BUILD=1 ...   # then llama-bench on that file with 40 layers on the GPU
#   GPU_CHECK_70B_LLAMA_ONLY=1 ...                        # (a later call) no bench of ours: wait for the build that
#                                                         # the first call started, then that llama-bench only
#   GPU_CHECK_70B=1 GPU_CHECK_VERIFY=1 ...                # after the 70B bench, on its file: the time of one
#                                                         # verification pass per tree size (GPU_CHECK_VERIFY_SIZES)
#   GPU_CHECK_70B=1 GPU_CHECK_SKIP_TESTS=1 GPU_CHECK_SKIP_BENCH=1 ...
#                                                         # the 70B Q4_K_M streamed at --vram-budget 24GB
#                                                         # (bench.streaming_bench; writes ~42 GB to disk)
#   GPU_CHECK_MOE=1 GPU_CHECK_LLAMA_BUILD=1 ...           # the synthetic Qwen3-30B-A3B at 8 GB, experts on the CPU,
#                                                         # and llama-bench -ncmoe N on it (N down to what fits 8 GB);
#                                                         # then at 24 GB, experts in VRAM, against llama-bench -ngl 99
#   GPU_CHECK_MOE_ONLY24=1                                # with GPU_CHECK_MOE: only the 24 GB half
#   GPU_CHECK_PROFILE=1 ...                               # where a speculative pass's time goes (bench.spec_profile
#                                                         # on synthetic models of the Qwen pair's shapes, traced)
#   NVMEDIRECT_GPU_MODELS=a.gguf:b.gguf                   # real models for tests/gpu/test_model.py
#   GPU_CHECK_ALL_GPU_TESTS=1                             # also `pytest -m gpu tests/` (every area)
#
# Carry: .whl (gguf, cffi, pycparser, pyudev wheels from /work/shared/device/fetch-wheels.sh), .peer for
# llama.cpp, and for GPU_CHECK_ALL_GPU_TESTS also nvmedirect/_vfio_cffi.abi3.so (built here by
# scripts/bootstrap.sh; without it the pinned-DMA and reader tests fail to import).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-check}
SYNTH_DIR=${SYNTH_DIR:-/tmp/nvmedirect-synth}
mkdir -p "$OUT" "$SYNTH_DIR"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }
section() { echo; echo "=== $* ($(date +%T))"; }

section "environment"
export PYTHONPATH="$PWD"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
        > "$OUT/pip.log" 2>&1 && note "wheels: installed $(ls .whl/*.whl | wc -l) into /tmp/site" \
        || note "wheels: install FAILED (see pip.log)"
    export PYTHONPATH="/tmp/site:$PWD"
fi
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
python3 - <<'EOF' 2>&1 | tee "$OUT/env.txt"
import sys, numpy, cupy
print("python", sys.version.split()[0], "numpy", numpy.__version__, "cupy", cupy.__version__)
p = cupy.cuda.runtime.getDeviceProperties(0)
print("device", p["name"].decode(), "sm", p["major"], p["minor"], "SMs", p["multiProcessorCount"],
      "L2", p["l2CacheSize"] // 2**20, "MiB")
import gguf; print("gguf", getattr(gguf, "__version__", "?"))
EOF

LLAMA_DIR=/tmp/lc
if [ -n "${GPU_CHECK_LLAMA_BUILD:-}" ] && [ -f .peer/llama.cpp.tgz ] && [ ! -e "$LLAMA_DIR/started" ]; then
    mkdir -p "$LLAMA_DIR" && touch "$LLAMA_DIR/started"
    setsid nice -n 19 bash -c "tar xzf .peer/llama.cpp.tgz -C $LLAMA_DIR && cd $LLAMA_DIR/llama.cpp &&
      cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON > $LLAMA_DIR/cmake.log 2>&1 &&
      cmake --build build -j 12 --target llama-bench llama-server > $LLAMA_DIR/build.log 2>&1; echo rc=\$? > $LLAMA_DIR/done" \
      > /dev/null 2>&1 < /dev/null &
    note "llama.cpp: build started in the background ($LLAMA_DIR)"
fi

if [ -z "${GPU_CHECK_SKIP_COMPILE:-}" ]; then
section "kernel compile (RawModule, this device)"
timeout 90 python3 - <<'EOF' 2>&1 | tee "$OUT/compile.txt"
import time
from infer.gpu import kernels
for name in kernels.SOURCES:
    t = time.perf_counter()
    try:
        m = kernels.module(name)
        print(f"{name}: ok in {time.perf_counter() - t:.2f} s (backend {getattr(m, 'backend', '?')})")
    except Exception as e:
        print(f"{name}: FAILED {type(e).__name__}: {str(e)[:3000]}")
EOF
grep -q FAILED "$OUT/compile.txt" && note "compile: FAILED (compile.txt)" || note "compile: all modules ok"
fi

if [ -z "${GPU_CHECK_SKIP_TESTS:-}" ]; then
    section "GPU tests"
    TESTS=${GPU_CHECK_TESTS:-"tests/gpu/test_kernels.py tests/gpu/test_model.py tests/gpu/test_cli_gpu.py \
        tests/gpu/test_streaming.py tests/gpu/test_budget.py tests/gpu/test_speculative_gpu.py \
        tests/gpu/test_moe_kernels.py tests/gpu/test_moe_gpu.py tests/gpu/test_stages_gpu.py tests/gpu/test_uploads.py \
        tests/infer/test_gpu_layout.py tests/infer/test_synth.py"}
    # shellcheck disable=SC2086
    timeout "${GPU_CHECK_TESTS_SECONDS:-420}" python3 -m pytest -q -s --timeout 200 -p no:cacheprovider --tb=short \
        --durations=10 $TESTS --junitxml="$OUT/pytest.xml" > "$OUT/pytest.log" 2>&1
    rc=$?
    grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -40
    tail -3 "$OUT/pytest.log"
    note "tests: exit $rc; $(tail -1 "$OUT/pytest.log")"
    if [ -n "${GPU_CHECK_ALL_GPU_TESTS:-}" ]; then  # every gpu-marked test of the project (other areas too)
        timeout 300 python3 -m pytest -q -m gpu --timeout 150 -p no:cacheprovider --tb=short \
            --continue-on-collection-errors tests/ > "$OUT/pytest-all-gpu.log" 2>&1
        note "all gpu-marked tests: exit $?; $(tail -1 "$OUT/pytest-all-gpu.log")"
    fi
fi

bench() {  # name, timeout, bench.gpu_bench arguments...
    local name=$1 limit=$2
    shift 2
    section "benchmark $name: $*"
    timeout "$limit" python3 -m bench.gpu_bench --synth-dir "$SYNTH_DIR" --pp 512 --tg 128 --no-kernels "$@" \
        --out "$OUT/bench-$name.json" > "$OUT/bench-$name.txt" 2>&1
    local rc=$?
    cat "$OUT/bench-$name.txt"
    if [ $rc -ne 0 ]; then note "bench $name: FAILED (exit $rc, bench-$name.txt)"; return; fi
    python3 - "$OUT/bench-$name.json" "$name" <<'EOF' | tee -a "$SUMMARY"
import json, sys
r = json.load(open(sys.argv[1]))
budget = f" of {r['vram_budget_bytes'] / 1e9:.2f} GB" if "vram_budget_bytes" in r else ""
copy = f"{r['fraction_of_copy']:.0%} of copy {r['copy_GBps']}" if r["copy_GBps"] else "copy not measured"
b = r.get("batch")
batch = (f"; {b['sequences']} seq x {b['new_tokens']}: {b['decode_aggregate_tok_s']} tok/s, identical "
         f"{b.get('identical_to_alone', '-')}") if b else ""
print(f"bench {sys.argv[2]:<14} pp{r['pp_tokens']} {r['pp_tok_s']:>8} tok/s (canonical {r.get('pp_canonical_tok_s')})  "
      f"tg{r['tg_tokens']} {r['tg_tok_s']:>7} tok/s  "
      f"{r['achieved_GBps']} GB/s ({copy})  peak {r['peak_vram_bytes'] / 1e9:.2f} GB{budget}  "
      f"fp64/pass {r.get('fp64_ops_per_pass')}{batch}")
EOF
    rm -f "$SYNTH_DIR"/*.part
}

cli_bench() {  # name, timeout, ntransformer arguments...: the CLI's own --benchmark --json
    local name=$1 limit=$2
    shift 2
    section "ntransformer $*"
    timeout "$limit" python3 -c "from infer.cli import main; main()" "$@" > "$OUT/cli-$name.json" 2> "$OUT/cli-$name.txt"
    local rc=$?
    tail -5 "$OUT/cli-$name.txt"
    python3 - "$OUT/cli-$name.json" "$name" "$rc" <<'EOF' | tee -a "$SUMMARY"
import json, sys
try:
    r = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
    print(f"cli {sys.argv[2]:<16} exit {sys.argv[3]}: pp{r['pp_tokens']} {r['pp_tok_s']} tok/s, tg{r['tg_tokens']} "
          f"{r['tg_tok_s']} tok/s, peak {r['peak_vram_bytes'] / 1e9:.2f} GB of {r.get('vram_budget_bytes', 0) / 1e9:.2f}")
except Exception as err:
    print(f"cli {sys.argv[2]:<16} exit {sys.argv[3]}: no result ({err})")
EOF
}

if [ -z "${GPU_CHECK_SKIP_BENCH:-}" ]; then
    batch_args=${GPU_CHECK_BENCH_BATCH---batch 32 --batch-prompt 128 --batch-new 64}
    # shellcheck disable=SC2086
    bench 8b-q4km-8GB${GPU_CHECK_BENCH_TAG:-} 400 --synth 8b:q4_k_m --vram-budget 8GB --ctx 4096 $batch_args
fi
if [ -z "${GPU_CHECK_SKIP_BENCH:-}" ] && [ -z "${GPU_CHECK_BENCH_QUICK:-}" ]; then
    bench 8b-q4km-6GB 200 --synth 8b:q4_k_m --vram-budget 6GB --ctx 1024 --no-kernels
    cli_bench 8b-8GB 120 -m "$SYNTH_DIR/synth-8b-q4_k_m.gguf" --device gpu --benchmark -n 64 --vram-budget 8GB --json
    [ -n "${GPU_CHECK_STREAM:-}" ] && bench 8b-q4km-stream 200 --synth 8b:q4_k_m --vram-budget 8GB --ctx 4096 --streaming --no-kernels
    [ -n "${GPU_CHECK_Q8:-}" ] && bench 8b-q80 300 --synth 8b:q8_0
fi

if [ -n "${GPU_CHECK_PMM_SWEEP:-}" ]; then
    section "prompt products (bench.pmm_sweep)"
    timeout 150 python3 -m bench.pmm_sweep --out "$OUT/pmm-sweep.json" > "$OUT/pmm-sweep.txt" 2>&1
    note "pmm sweep: exit $?"
    tail -n 30 "$OUT/pmm-sweep.txt"
fi
if [ -n "${GPU_CHECK_PASS_PROFILE:-}" ]; then
    section "where the passes go (bench.pass_profile, 8B 8GB)"
    timeout 200 python3 -m bench.pass_profile --synth 8b:q4_k_m --synth-dir "$SYNTH_DIR" --vram-budget 8GB \
        --out "$OUT/pass-profile.json" > "$OUT/pass-profile.txt" 2>&1
    note "pass profile: exit $?"
    tail -n 40 "$OUT/pass-profile.txt"
fi
if [ -n "${GPU_CHECK_SWEEP:-}" ]; then
    section "kernel timings (bench.kernel_sweep --skip-products)"
    timeout 120 python3 -m bench.kernel_sweep --skip-products --out "$OUT/sweep.json" > "$OUT/sweep.txt" 2>&1
    note "sweep: exit $?; $(grep -c kernel "$OUT/sweep.txt") rows"
    grep '"kernel"' "$OUT/sweep.txt" | head -20
fi

if [ -n "${GPU_CHECK_LLAMA:-}${GPU_CHECK_COMPARE:-}${GPU_CHECK_MOE:-}${GPU_CHECK_70B_LLAMA_NGL:-}" ] &&
    [ -f .peer/llama-bin.tar.xz ] && ! grep -q "rc=0" "$LLAMA_DIR/done" 2>/dev/null; then  # prebuilt: no build here
    mkdir -p /tmp/lcbin && tar xJf .peer/llama-bin.tar.xz -C /tmp/lcbin && mkdir -p "$LLAMA_DIR/llama.cpp/build" &&
        ln -sfn /tmp/lcbin "$LLAMA_DIR/llama.cpp/build/bin" && echo "rc=0 (prebuilt)" > "$LLAMA_DIR/done"
    cublas=$(find /usr/local/cuda*/ /opt /usr/lib -name 'libcublas.so.1*' 2>/dev/null | head -1)  # toolkit or pip's
    export LD_LIBRARY_PATH="/tmp/lcbin:${cublas:+$(dirname "$cublas"):}/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
    rm -f /tmp/lcbin/libggml-cpu-sapphirerapids.so  # its AMX code dies with SIGILL on these machines
    # the 2026-12-06 package's libggml-cuda.so does not name the driver (scripts/llama-cpp-cuda.sh)
    libcuda=$(ldconfig -p | awk '/libcuda.so.1 /{print $NF; exit}')
    [ -n "$libcuda" ] && export LD_PRELOAD="$libcuda${LD_PRELOAD:+:$LD_PRELOAD}"
    note "llama.cpp: prebuilt binaries from .peer/llama-bin.tar.xz ($(cat /tmp/lcbin/BUILD 2>/dev/null | head -1))"
fi
if [ -n "${GPU_CHECK_LLAMA:-}" ]; then
    section "llama.cpp llama-bench on the synthetic 8B Q4_K_M (the file ours ran on)"
    for _ in $(seq 1 "${GPU_CHECK_LLAMA_WAIT:-540}"); do [ -f "$LLAMA_DIR/done" ] && break; sleep 1; done
    if grep -q "rc=0" "$LLAMA_DIR/done" 2>/dev/null; then
        python3 -c "from bench.gpu_bench import synth_path; from pathlib import Path; synth_path('8b:q4_k_m', Path('$SYNTH_DIR'))"
        timeout 300 "$LLAMA_DIR/llama.cpp/build/bin/llama-bench" -m "$SYNTH_DIR/synth-8b-q4_k_m.gguf" -p 512 -n 128 \
            -ngl 99 -fa 1 -r 3 -o json > "$OUT/llama-bench-8b.json" 2> "$OUT/llama-bench-8b.log"
        note "llama-bench 8b: exit $?; $(python3 - "$OUT/llama-bench-8b.json" <<'EOF' 2>&1 | tail -1
import json, sys
rows = json.load(open(sys.argv[1]))
print(" ".join(f"{'pp' if r['n_prompt'] else 'tg'}{r['n_prompt'] or r['n_gen']} {r['avg_ts']:.1f} tok/s" for r in rows))
EOF
)"
    else
        note "llama.cpp: not built ($(cat "$LLAMA_DIR/done" 2>/dev/null || echo 'still building'); $LLAMA_DIR/build.log)"
        tail -5 "$LLAMA_DIR/build.log" 2>/dev/null
    fi
fi

if [ -n "${GPU_CHECK_COMPARE:-}" ]; then  # a given file, ours and llama-bench, at each depth
    model=$GPU_CHECK_COMPARE
    tag=$(basename "$model" .gguf)
    for depth in $(echo "${GPU_CHECK_COMPARE_DEPTHS:-0}" | tr ',' ' '); do
        section "$tag at depth $depth: ours (bench.gpu_bench) and llama-bench"
        timeout 240 python3 -m bench.gpu_bench --model "$model" --pp 512 --tg 128 --depth "$depth" --no-kernels \
            --out "$OUT/ours-$tag-d$depth.json" > "$OUT/ours-$tag-d$depth.txt" 2>&1
        note "ours $tag depth $depth: exit $?; $(head -2 "$OUT/ours-$tag-d$depth.txt" | tail -1)"
        if grep -q "rc=0" "$LLAMA_DIR/done" 2>/dev/null; then
            timeout 300 "$LLAMA_DIR/llama.cpp/build/bin/llama-bench" -m "$model" -p 512 -n 128 -d "$depth" \
                -ngl 99 -fa 1 -r 3 -o json > "$OUT/llama-bench-$tag-d$depth.json" 2> "$OUT/llama-bench-$tag-d$depth.log"
            note "llama-bench $tag depth $depth: exit $?; $(python3 - "$OUT/llama-bench-$tag-d$depth.json" <<'EOF2' 2>&1 | tail -1
import json, sys
rows = json.load(open(sys.argv[1]))
print(" ".join(f"{'pp' if r['n_prompt'] else 'tg'}{r['n_prompt'] or r['n_gen']} {r['avg_ts']:.1f} tok/s" for r in rows))
EOF2
)"
        fi
    done
fi

if [ -n "${GPU_CHECK_SPEC:-}" ]; then
    section "speculative decoding through the CLI (synthetic 8B target, 1B draft: same vocabulary)"
    python3 -m infer.synth --shape 1b --type q4_k_m -o "$SYNTH_DIR/synth-1b-q4_k_m.gguf" > /dev/null 2>&1 || true
    [ -f "$SYNTH_DIR/synth-8b-q4_k_m.gguf" ] || python3 -m infer.synth --shape 8b --type q4_k_m \
        -o "$SYNTH_DIR/synth-8b-q4_k_m.gguf" > /dev/null 2>&1
    for extra in "" "--streaming"; do
        timeout 150 python3 -c "from infer.cli import main; main()" -m "$SYNTH_DIR/synth-8b-q4_k_m.gguf" --device gpu \
            --draft-model "$SYNTH_DIR/synth-1b-q4_k_m.gguf" --vram-budget 8GB -p "hello world" -n 32 -t 0 --json \
            $extra > "$OUT/spec-cli$extra.json" 2> "$OUT/spec-cli$extra.txt"
        note "spec cli ${extra:-resident}: exit $?; $(grep -o 'speculation (.*' "$OUT/spec-cli$extra.txt" | tail -1)"
    done
fi

if [ -n "${GPU_CHECK_70B:-}" ]; then
    section "70B Q4_K_M streamed at --vram-budget 24GB"
    rm -f "$SYNTH_DIR"/synth-8b-*.gguf "$SYNTH_DIR"/synth-1b-*.gguf  # disk: 64 GB in all
    limit=${GPU_CHECK_70B_SECONDS:-560}
    [ -n "${GPU_CHECK_70B_LLAMA_ONLY:-}" ] || timeout "$limit" python3 -m bench.streaming_bench --out "$OUT" --sections "${GPU_CHECK_70B_SECTIONS:-model,h2d,stream}" \
        --cpu-tier "${GPU_CHECK_70B_CPU_TIER:-off}" \
        --deadline "$((limit - 20))" > "$OUT/bench-70b.txt" 2>&1
    note "70B streaming bench: exit $?"
    [ -f "$OUT/results.json" ] && python3 - "$OUT/results.json" <<'EOF' | tee -a "$SUMMARY"
import json, sys
r = json.load(open(sys.argv[1])).get("stream", {})
keys = ("decode_tok_s", "roofline_tok_s", "decode_fraction_of_roofline", "pp512_tok_s", "batch32_aggregate_tok_s",
        "peak_vram_bytes", "vram_budget_bytes", "peak_within_budget", "error")
print("70B stream: " + ", ".join(f"{k} {r[k]}" for k in keys if k in r))
EOF
    if [ -n "${GPU_CHECK_70B_LLAMA_ONLY:-}" ]; then  # a later call of the lease: wait for the build started earlier
        for _ in $(seq 1 "${GPU_CHECK_LLAMA_WAIT:-480}"); do [ -f "$LLAMA_DIR/done" ] && break; sleep 1; done
    fi
    if [ -n "${GPU_CHECK_70B_LLAMA_NGL:-}" ] && grep -q "rc=0" "$LLAMA_DIR/done" 2>/dev/null; then
        # issue 28's comparison: llama.cpp with N of the 80 layers on the GPU, the rest on every core
        section "llama-bench on the same 70B file, -ngl $GPU_CHECK_70B_LLAMA_NGL, $(nproc) threads"
        timeout "${GPU_CHECK_70B_LLAMA_SECONDS:-300}" "$LLAMA_DIR/llama.cpp/build/bin/llama-bench" \
            -m "${NVMEDIRECT_BENCH_DIR:-/tmp/nvmd-bench}/synth-llama70b-q4_k_m.gguf" -p 0 -n 32 \
            -ngl "$GPU_CHECK_70B_LLAMA_NGL" -t "$(nproc)" -fa 1 -r 2 -o json > "$OUT/llama-bench-70b-ngl.json" \
            2> "$OUT/llama-bench-70b-ngl.log"
        note "llama-bench 70b -ngl $GPU_CHECK_70B_LLAMA_NGL: exit $?; $(python3 -c "import json,sys; \
print(' '.join(f\"tg{r['n_gen']} {r['avg_ts']:.2f} tok/s\" for r in json.load(open(sys.argv[1]))))" \
            "$OUT/llama-bench-70b-ngl.json" 2>&1 | tail -1)"
    fi
    if [ -n "${GPU_CHECK_VERIFY:-}" ]; then  # on the file the streaming bench wrote (one 42 GB file fits the disk)
        section "70B Q4_K_M streamed at 24GB: one verification pass per tree size"
        timeout "${GPU_CHECK_VERIFY_SECONDS:-300}" python3 -m bench.spec_bench verify \
            --model "${NVMEDIRECT_BENCH_DIR:-/tmp/nvmd-bench}/synth-llama70b-q4_k_m.gguf" --streaming --vram-budget 24GB \
            --sizes "${GPU_CHECK_VERIFY_SIZES:-1,16,32,64,128,256}" --out "$OUT/spec-verify-70b.json" \
            > "$OUT/spec-verify-70b.txt" 2>&1
        note "70B verify passes: exit $?; $(python3 -c "import json,sys; r=json.load(open(sys.argv[1])); \
print(' '.join(f\"{p['nodes']}:{p['pass_seconds']}s\" for p in r['passes']))" "$OUT/spec-verify-70b.json" 2>&1 | tail -1)"
    fi
fi

if [ -n "${GPU_CHECK_MOE:-}" ]; then
    # issue 26: the synthetic Qwen3-30B-A3B Q4_K_M (~17 GB) resident at 8 GB with its experts on the CPU,
    # then llama.cpp on the same file with the experts of the first N blocks on the CPU, N the smallest
    # that fits 8 GB (llama-bench -ncmoe, from GPU_CHECK_MOE_NCMOE (36: ~15 blocks of experts in ~5.5 GB) down by 2 while it fits)
    section "mixture of experts: synthetic Qwen3-30B-A3B Q4_K_M at --vram-budget 8GB"
    rm -f "${NVMEDIRECT_BENCH_DIR:-/tmp/nvmd-bench}"/synth-llama70b-*.gguf  # disk
    [ -z "${GPU_CHECK_MOE_ONLY24:-}" ] && timeout "${GPU_CHECK_MOE_SECONDS:-300}" python3 -m bench.gpu_bench --synth qwen3-30b-a3b:q4_k_m --synth-dir "$SYNTH_DIR" \
        --vram-budget 8GB --pp 512 --tg 64 --no-kernels --out "$OUT/moe-30b-a3b-8GB.json" > "$OUT/moe-30b-a3b-8GB.txt" 2>&1
    note "moe 30b-a3b 8GB: exit $?; $(grep -E 'pp512|VRAM used' "$OUT/moe-30b-a3b-8GB.txt" | tr -s ' ' | tr '\n' ' ')"
    if [ -z "${GPU_CHECK_MOE_ONLY24:-}" ] && grep -q "rc=0" "$LLAMA_DIR/done" 2>/dev/null; then
        moe="$SYNTH_DIR/synth-qwen3-30b-a3b-q4_k_m.gguf"
        for n in $(seq "${GPU_CHECK_MOE_NCMOE:-36}" -2 0); do  # fewer experts on the CPU while the peak fits 8 GB
            timeout 300 "$LLAMA_DIR/llama.cpp/build/bin/llama-bench" -m "$moe" -p 512 -n 64 -ngl 99 -ncmoe "$n" \
                -t "$(nproc)" -fa 1 -r 2 -o json > "$OUT/llama-bench-moe-ncmoe$n.json" 2> "$OUT/llama-bench-moe-ncmoe$n.log" &
            pid=$!; peak=0
            while kill -0 "$pid" 2>/dev/null; do
                used=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1)
                [ "$used" -gt "$peak" ] && peak=$used; sleep 0.2
            done
            wait "$pid"; rc=$?
            note "llama-bench moe -ncmoe $n: exit $rc, peak ${peak} MiB; $(python3 -c "import json,sys; \
print(' '.join(f\"{'pp' if r['n_prompt'] else 'tg'}{r['n_prompt'] or r['n_gen']} {r['avg_ts']:.2f}\" for r in json.load(open(sys.argv[1]))))" \
                "$OUT/llama-bench-moe-ncmoe$n.json" 2>&1 | tail -1)"
            [ "$peak" -gt 7629 ] && break  # 8 GB = 7629 MiB: the previous N was the smallest that fits
        done
    fi
    # issue 26 bar 2: the model fits 24 GB: every expert in VRAM (infer.gpu.experts), against llama.cpp
    # with every layer on the GPU; the GPU's expert kernels checked first (tests/gpu/test_moe_kernels.py)
    section "mixture of experts: synthetic Qwen3-30B-A3B Q4_K_M at --vram-budget 24GB, experts in VRAM"
    timeout 300 python3 -m pytest -q -x tests/gpu/test_moe_kernels.py tests/gpu/test_moe_gpu.py \
        > "$OUT/moe-gpu-tests.txt" 2>&1
    note "moe GPU tests: exit $?; $(tail -1 "$OUT/moe-gpu-tests.txt")"
    timeout "${GPU_CHECK_MOE_SECONDS:-300}" python3 -m bench.gpu_bench --synth qwen3-30b-a3b:q4_k_m --synth-dir "$SYNTH_DIR" \
        --vram-budget 24GB --experts gpu --pp 512 --tg 64 --batch 32 --no-kernels --out "$OUT/moe-30b-a3b-24GB.json" \
        > "$OUT/moe-30b-a3b-24GB.txt" 2>&1
    note "moe 30b-a3b 24GB experts in VRAM: exit $?; $(grep -E 'pp512|tg64|batch|VRAM used' "$OUT/moe-30b-a3b-24GB.txt" | tr -s ' ' | tr '\n' ' ')"
    if grep -q "rc=0" "$LLAMA_DIR/done" 2>/dev/null; then
        timeout 300 "$LLAMA_DIR/llama.cpp/build/bin/llama-bench" -m "$SYNTH_DIR/synth-qwen3-30b-a3b-q4_k_m.gguf" \
            -p 512 -n 64 -ngl 99 -fa 1 -r 2 -o json > "$OUT/llama-bench-moe-ngl99.json" 2> "$OUT/llama-bench-moe-ngl99.log"
        note "llama-bench moe -ngl 99: exit $?; $(python3 -c "import json,sys; \
print(' '.join(f\"{'pp' if r['n_prompt'] else 'tg'}{r['n_prompt'] or r['n_gen']} {r['avg_ts']:.2f}\" for r in json.load(open(sys.argv[1]))))" \
            "$OUT/llama-bench-moe-ngl99.json" 2>&1 | tail -1)"
    fi
fi

if [ -n "${GPU_CHECK_PROFILE:-}" ]; then
    section "speculative pass profile (synthetic q15b target streamed, q05b draft)"
    timeout "${GPU_CHECK_PROFILE_SECONDS:-240}" python3 -m bench.spec_profile --synth --synth-dir "$SYNTH_DIR" --resident \
        --out "$OUT/profile" > "$OUT/profile.txt" 2> "$OUT/profile.log"
    note "spec profile: exit $?; $(tail -c 1500 "$OUT/profile.txt")"
    tail -n 30 "$OUT/profile.log"
fi

section "summary"
cat "$SUMMARY"
