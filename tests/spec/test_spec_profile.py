"""bench.spec_profile's summary of a chrome trace (pure Python; the traces come from the GPU)."""

from __future__ import annotations

from bench.spec_profile import trace_summary


def test_busy_time_is_the_union_of_kernels_and_gaps_are_what_is_left() -> None:
    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "gemv8_k4(int, float*)", "ts": 0, "dur": 5},
        {"ph": "X", "cat": "kernel", "name": "gemv8_k4", "ts": 3, "dur": 5},  # overlaps the first
        {"ph": "X", "cat": "kernel", "name": "rmsnorm8", "ts": 38, "dur": 2},  # after a 30 us gap
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 0, "dur": 40, "args": {"bytes": 4096}},
        {"ph": "X", "cat": "cpu_op", "name": "ignored", "ts": 0, "dur": 999},
    ]}
    s = trace_summary(trace)
    assert s["gpu_span_ms"] == 0.04 and s["kernel_busy_ms"] == 0.01 and s["kernel_sum_ms"] == 0.012
    assert s["idle_gaps_ms"] == 0.03 and s["gaps_over_20us"] == 1 and s["largest_gaps_us"] == [30]
    assert s["copies"] == 1 and s["copy_bytes"] == 4096
    assert s["top_kernels"][0] == {"name": "gemv8_k4", "count": 2, "total_ms": 0.01, "mean_us": 5.0}
    assert trace_summary({"traceEvents": []}) == {"gpu_events": 0}
