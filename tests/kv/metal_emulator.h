// Enough of the Metal Shading Language to run the bodies of mx.fast.metal_kernel kernels
// (metal/turboquant.metal) as C++ on a CPU: tests/kv/metal_emulator.py generates the kernel
// function around a body and launches it one threadgroup at a time, every thread of the group
// an OS thread, so barriers and SIMD-group reductions are real synchronisation points.
//
// Threadgroup memory: `threadgroup float x[N];` becomes a function-local static. One
// threadgroup runs at a time (and one kernel at a time), so the static is exactly the memory
// its threads share. Half and bfloat16 round like a GPU's conversion (metal/half_float.h).
#pragma once

#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

extern "C" {
#include "half_float.h"
}

typedef unsigned int uint;
typedef unsigned long ulong;

struct uint3 {
    uint x, y, z;
};

struct half {
    uint16_t bits;
    half() = default;
    half(float f) : bits(float_to_half(f)) {}
    operator float() const { return half_to_float(bits); }
};
typedef half float16_t;

struct bfloat16_t {
    uint16_t bits;
    bfloat16_t() = default;
    bfloat16_t(float f) : bits(float_to_bf16(f)) {}
    operator float() const { return bf16_to_float(bits); }
};

// address spaces: plain memory on a CPU; threadgroup memory: see above
#define device
#define constant const
#define threadgroup static

using std::sqrt;

template <class T>
inline T max(T a, T b) { return a > b ? a : b; }
template <class T>
inline T min(T a, T b) { return a < b ? a : b; }

namespace metal {
inline float exp(float x) { return std::exp(x); }
}  // namespace metal

// ---- synchronisation of the running threadgroup ------------------------------------------

constexpr uint SIMD_WIDTH = 32;

struct SimdGroup {
    std::barrier<> barrier;
    float lanes[SIMD_WIDTH];
    explicit SimdGroup(std::ptrdiff_t size) : barrier(size) {}
};

struct ThreadContext {
    std::barrier<>* group = nullptr;
    SimdGroup* simd = nullptr;
    uint lane = 0, simd_size = 0;
};

inline thread_local ThreadContext tg_context;

namespace mem_flags {
constexpr int mem_none = 0, mem_device = 1, mem_threadgroup = 2;
}

inline void threadgroup_barrier(int) { tg_context.group->arrive_and_wait(); }

// every lane of the SIMD group writes its value, all wait, all read every lane, all wait
// again before the slots can be reused: the same result in every lane, as on a GPU
template <class Reduce>
inline float simd_reduce(float v, Reduce reduce) {
    SimdGroup& s = *tg_context.simd;
    s.lanes[tg_context.lane] = v;
    s.barrier.arrive_and_wait();
    float r = s.lanes[0];
    for (uint i = 1; i < tg_context.simd_size; ++i) r = reduce(r, s.lanes[i]);
    s.barrier.arrive_and_wait();
    return r;
}

inline float simd_sum(float v) {
    return simd_reduce(v, [](float a, float b) { return a + b; });
}

inline float simd_max(float v) {
    return simd_reduce(v, [](float a, float b) { return a > b ? a : b; });
}

// The built-in positions of one thread, as the kernel body sees them.
struct ThreadPosition {
    uint3 thread_position_in_grid, thread_position_in_threadgroup, threadgroup_position_in_grid,
        threadgroups_per_grid, threads_per_threadgroup;
    uint thread_index_in_threadgroup, thread_index_in_simdgroup, simdgroup_index_in_threadgroup;
};

// Runs `body` for every thread of a dispatchThreads(grid, group) launch: threadgroups one
// after another, threads beyond the grid not launched (the edge groups are smaller), as
// MLX dispatches a metal_kernel. A thread that returns leaves its barriers
// (arrive_and_drop), so the threads still running are not held up by it.
inline void run_grid(uint3 grid, uint3 group, const std::function<void(const ThreadPosition&)>& body) {
    group = {min(group.x, grid.x), min(group.y, grid.y), min(group.z, grid.z)};
    uint3 groups = {(grid.x + group.x - 1) / group.x, (grid.y + group.y - 1) / group.y,
                    (grid.z + group.z - 1) / group.z};
    for (uint gz = 0; gz < groups.z; ++gz)
        for (uint gy = 0; gy < groups.y; ++gy)
            for (uint gx = 0; gx < groups.x; ++gx) {
                uint3 size = {min(group.x, grid.x - gx * group.x), min(group.y, grid.y - gy * group.y),
                              min(group.z, grid.z - gz * group.z)};
                uint n = size.x * size.y * size.z;
                std::barrier<> barrier(n);
                std::vector<std::unique_ptr<SimdGroup>> simds;
                for (uint first = 0; first < n; first += SIMD_WIDTH)
                    simds.push_back(std::make_unique<SimdGroup>(min(SIMD_WIDTH, n - first)));
                std::vector<std::thread> threads;
                for (uint i = 0; i < n; ++i) {
                    uint3 local = {i % size.x, (i / size.x) % size.y, i / (size.x * size.y)};
                    ThreadPosition at = {
                        {gx * group.x + local.x, gy * group.y + local.y, gz * group.z + local.z},
                        local,
                        {gx, gy, gz},
                        groups,
                        size,
                        i,
                        i % SIMD_WIDTH,
                        i / SIMD_WIDTH,
                    };
                    SimdGroup* simd = simds[i / SIMD_WIDTH].get();
                    uint simd_size = min(SIMD_WIDTH, n - (i / SIMD_WIDTH) * SIMD_WIDTH);
                    threads.emplace_back([&barrier, simd, simd_size, at, &body] {
                        tg_context = {&barrier, simd, at.thread_index_in_simdgroup, simd_size};
                        body(at);
                        simd->barrier.arrive_and_drop();
                        barrier.arrive_and_drop();
                    });
                }
                for (auto& t : threads) t.join();
            }
}
