# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The card's own ceilings, measured in the benchmark's run (METHOD.md: measure, don't
quote).

  copy_bytes_per_s   device-to-device copy of 1 GiB, bytes read + written bf16_flops
  cuBLAS bf16 8192^3 through torch.matmul, random data mma_flops
  mma.sync.m16n8k16 fp16 x fp16 -> fp32, all SMs, operands in registers int_instr_per_s
  dependent IMAD + LOP3 chains (the trellis decode's instruction mix), thread
                     instructions per second, all SMs: 16 T/s on the H200, one integer
                     pipe's rate (2026-11-30 runs), half of
  issue_instr_per_s  what the warp schedulers can issue (SMs x 4 x 32 lanes x SM clock;
  from the
                     device properties, not measured)

mma_flops and int_instr_per_s run tiny CUDA kernels compiled at run time through CuPy
(NVRTC); without CuPy they (and issue_instr_per_s) are None and the speed-of-light bound
uses the terms it has.
"""

from __future__ import annotations

import statistics

import torch

COPY_BYTES = 1 << 30
MATMUL_N = 8192
# Microbenchmark launch: enough resident warps per SM to saturate issue (8 warps x 8
# blocks).
MICRO_BLOCKS_PER_SM = 8
MICRO_THREADS = 256
INT_ITERS = 4096
INT_CHAINS = (
    8  # independent IMAD+LOP3 chains per thread (2 instructions each per iteration)
)
MMA_ITERS = 4096
MMA_CHAINS = 4  # independent accumulators per warp
MMA_FLOPS = 2 * 16 * 8 * 16
SCHEDULERS_PER_SM = 4  # warp schedulers (SM sub-partitions) per SM on sm_90 / sm_120

INT_SRC = r"""
extern "C" __global__ void int_issue(unsigned* out, int iters, unsigned seed) {
  unsigned a[8];
  #pragma unroll
  for (int u = 0; u < 8; ++u) a[u] = (threadIdx.x + 131u * u) ^ seed;
  for (int i = 0; i < iters; ++i) {
    #pragma unroll
    for (int u = 0; u < 8; ++u) {
      a[u] = a[u] * 0x9E3779B1u + 0x7F4A7C15u;
      a[u] = (a[u] & 0x8FFF8FFFu) ^ 0x3B603B60u;
    }
  }
  unsigned r = 0;
  #pragma unroll
  for (int u = 0; u < 8; ++u) r ^= a[u];
  if (r == seed) out[0] = r;
}
"""

MMA_SRC = r"""
extern "C" __global__ void mma_rate(float* out, int iters, unsigned seed) {
  unsigned a0 = threadIdx.x ^ seed, a1 = a0 * 3u, a2 = a0 * 5u, a3 = a0 * 7u;
  unsigned b0 = a0 * 11u, b1 = a0 * 13u;
  a0 &= 0x3C003C00u; a1 &= 0x3C003C00u; a2 &= 0x3C003C00u; a3 &= 0x3C003C00u;
  b0 &= 0x3C003C00u; b1 &= 0x3C003C00u;
  float c[4][4];
  #pragma unroll
  for (int u = 0; u < 4; ++u) { c[u][0] = c[u][1] = c[u][2] = c[u][3] = 0.f; }
  for (int i = 0; i < iters; ++i) {
    #pragma unroll
    for (int u = 0; u < 4; ++u) {
      asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, "
                   "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                   : "+f"(c[u][0]), "+f"(c[u][1]), "+f"(c[u][2]), "+f"(c[u][3])
                   : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
  }
  float s = 0.f;
  #pragma unroll
  for (int u = 0; u < 4; ++u) s += c[u][0] + c[u][1] + c[u][2] + c[u][3];
  if (s == 12345.f) out[0] = s;
}
"""


def median_ms(fn, reps: int = 10) -> float:
    """Median CUDA-event milliseconds of `fn()` over `reps` runs, after one warm-up."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = (
            torch.cuda.Event(enable_timing=True),
            torch.cuda.Event(enable_timing=True),
        )
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def copy_rate() -> float:
    src = torch.randint(0, 255, (COPY_BYTES,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * COPY_BYTES / (ms * 1e-3)


def bf16_rate() -> float:
    a = torch.randn(MATMUL_N, MATMUL_N, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(MATMUL_N, MATMUL_N, device="cuda", dtype=torch.bfloat16)
    ms = median_ms(lambda: torch.matmul(a, b))
    return 2 * MATMUL_N**3 / (ms * 1e-3)


def _micro(src: str, name: str, iters: int) -> float | None:
    """Milliseconds of one launch of a CuPy raw kernel over all SMs, or None without
    CuPy."""
    try:
        import cupy
    except ImportError:
        return None
    kernel = cupy.RawKernel(src, name, options=("-std=c++17",))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = cupy.zeros(4, dtype=cupy.float32)
    grid = (sms * MICRO_BLOCKS_PER_SM,)
    args = (out, cupy.int32(iters), cupy.uint32(0x2545F491))
    kernel(grid, (MICRO_THREADS,), args)
    cupy.cuda.Device().synchronize()
    times = []
    for _ in range(5):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        kernel(grid, (MICRO_THREADS,), args)
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop))
    return statistics.median(times)


def int_rate() -> float | None:
    ms = _micro(INT_SRC, "int_issue", INT_ITERS)
    if ms is None:
        return None
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    threads = sms * MICRO_BLOCKS_PER_SM * MICRO_THREADS
    return threads * INT_ITERS * INT_CHAINS * 2 / (ms * 1e-3)


def mma_rate() -> float | None:
    ms = _micro(MMA_SRC, "mma_rate", MMA_ITERS)
    if ms is None:
        return None
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    warps = sms * MICRO_BLOCKS_PER_SM * MICRO_THREADS // 32
    return warps * MMA_ITERS * MMA_CHAINS * MMA_FLOPS / (ms * 1e-3)


def issue_rate() -> float | None:
    """Thread-instructions per second the schedulers can issue: 4 per SM, one warp
    instruction per cycle each, at the SM clock the driver reports. Not a measurement:
    the integer probe above (IMAD + LOP3 chains) runs at half of it on the H200, because
    each of Hopper's ALU and FMA-heavy pipes accepts a warp instruction only every
    second cycle, so the decode loop is bounded by max(total / issue_rate, per-pipe
    count / int_instr_per_s) (bench_linear.sol_us)."""
    try:
        import cupy

        clock_hz = cupy.cuda.runtime.getDeviceProperties(0)["clockRate"] * 1e3
    except (ImportError, KeyError):
        return None
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return sms * SCHEDULERS_PER_SM * 32 * clock_hz


def measure() -> dict[str, float | None]:
    return {
        "copy_bytes_per_s": copy_rate(),
        "bf16_flops": bf16_rate(),
        "mma_flops": mma_rate(),
        "int_instr_per_s": int_rate(),
        "issue_instr_per_s": issue_rate(),
    }


if __name__ == "__main__":
    for k, v in measure().items():
        print(f"{k:20s} {v:.4g}" if v else f"{k:20s} n/a")
