// L2 reduction throughput probe: the dKV scatter of the sparse MLA backward, several ways.
//
// Every variant adds the same work into an fp32 buffer dkv[S_kv][576]: per task (one query
// row's block of 64 gathered slots) a 64 x 576 fp32 tile into the 64 rows idx[task][0..63]
// (distinct within a query row, random). The tile is all ones, so the result is checked
// exactly against a host count of each row's references.
//
//   red_v4_lines   red.global.add.v4.f32; a warp instruction adds four whole 128-byte lines of
//                  four rows (the layout of our backward's interleaved accumulator and of the
//                  cuDNN frontend's SM90 kernel)
//   red_v4_row     red.global.add.v4.f32; a warp instruction adds 512 contiguous bytes of one row
//   gather+red   red_v4_lines after gathering the task's 64 bf16 KV rows (1152 bytes each) into
//                shared memory with 16-byte cp.async.cg: the backward's L2 traffic without its
//                math (Q and dO, read once per query row, left out)
//   bulk_<W>       the tile staged in shared memory, then cp.reduce.async.bulk ... .add.f32 per
//                  row segment of W columns (W * 4 bytes per bulk operation), two staging
//                  buffers so one drains while the next is written
//   u64_lines      integer adds into a uint64 buffer (fixed point: order-independent, so
//                  bit-reproducible): red.global.add.u64, 16 lanes per 128-byte line, two rows
//                  a warp instruction
//   u64_halves     the same, 8 lanes per 64 bytes (two sectors), four rows a warp instruction
//   u64_sectors    the same, 4 lanes per 32-byte sector, eight rows a warp instruction (the
//                  layout a wgmma accumulator fragment gives without lane trades)
//   u32_lines      red.global.add.u32 into a uint32 buffer, one 128-byte line a warp instruction
//
// Build: nvcc -O3 -arch=sm_90a -o l2_reduce_probe bench/l2_reduce_probe.cu
// Run:   ./l2_reduce_probe [s_q=2048] [s_kv=8192] [topk=2048] [reps=10] [variant]
// Prints one JSON object per variant: median ms, GB/s added (of the accumulator type), G values
// added per second, max error.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#define CHECK(x)                                                                        \
  do {                                                                                  \
    cudaError_t e_ = (x);                                                               \
    if (e_ != cudaSuccess) {                                                            \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      exit(1);                                                                          \
    }                                                                                   \
  } while (0)

constexpr int D = 576;
constexpr int ROWS = 64;  // slots per task
constexpr int THREADS = 128;

// ---- red.global.add.v4.f32 ------------------------------------------------------------------

__device__ __forceinline__ void red_add_v4(float* p, float v) {
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};"
               :: "l"(p), "f"(v), "f"(v), "f"(v), "f"(v) : "memory");
}

__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem) {
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(s), "l"(gmem) : "memory");
}

// KV rows of D bf16 (2 bytes each), gathered whole into [ROWS][D] bf16 of shared memory
__device__ __forceinline__ void gather_kv(unsigned short* s_kv, const unsigned short* kv,
                                          const int* rows) {
  constexpr int CHUNKS = D * 2 / 16;  // 72 16-byte chunks a row
  for (int i = threadIdx.x; i < ROWS * CHUNKS; i += THREADS) {
    int r = i / CHUNKS, c = i % CHUNKS;
    cp_async_16(s_kv + r * D + c * 8, kv + size_t(rows[r]) * D + c * 8);
  }
  asm volatile("cp.async.commit_group;\n\tcp.async.wait_group 0;" ::: "memory");
  __syncthreads();
}

template <bool kLines, bool kGather>
__global__ void __launch_bounds__(THREADS) red_v4(float* __restrict__ dkv,
                                                  const int* __restrict__ idx, int n_tasks,
                                                  const unsigned short* __restrict__ kv) {
  extern __shared__ __align__(128) unsigned short s_kv[];  // [ROWS][D] with kGather
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int task = blockIdx.x; task < n_tasks; task += gridDim.x) {
    const int* rows = idx + size_t(task) * ROWS;
    if (kGather) gather_kv(s_kv, kv, rows);
    // 64 rows x 576 cols = 64 x 144 float4; 128 threads
    if (kLines) {
      // one instruction: lanes 8g..8g+7 add one 128-byte line (32 floats) of row r_g
      for (int c = 0; c < D / 32; ++c) {           // 18 lines per row
        for (int rg = 0; rg < ROWS / 16; ++rg) {   // 4 warps x 4 rows per instruction
          int r = rg * 16 + warp * 4 + lane / 8;
          float* p = dkv + size_t(rows[r]) * D + c * 32 + (lane % 8) * 4;
          red_add_v4(p, 1.f);
        }
      }
    } else {
      // one instruction: a warp adds 128 contiguous floats of one row
      for (int r = warp; r < ROWS; r += 4) {
        float* base = dkv + size_t(rows[r]) * D;
        for (int c = lane * 4; c < D; c += 128) red_add_v4(base + c, 1.f);
      }
    }
  }
}

// ---- integer adds (red.global.add.u64 / .u32) -------------------------------------------------

// LANES_PER_ROW consecutive lanes add LANES_PER_ROW * 8 contiguous bytes of one row: 16 (a
// 128-byte line, 2 rows an instruction), 8 (two sectors, 4 rows) or 4 (one sector, 8 rows)
template <int LANES_PER_ROW>
__global__ void __launch_bounds__(THREADS) red_u64(unsigned long long* __restrict__ dkv,
                                                   const int* __restrict__ idx, int n_tasks) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  constexpr int ROWS_PER_WARP = 32 / LANES_PER_ROW;
  for (int task = blockIdx.x; task < n_tasks; task += gridDim.x) {
    const int* rows = idx + size_t(task) * ROWS;
    for (int c = 0; c < D / LANES_PER_ROW; ++c) {
      for (int rg = 0; rg < ROWS / (4 * ROWS_PER_WARP); ++rg) {
        int r = (rg * 4 + warp) * ROWS_PER_WARP + lane / LANES_PER_ROW;
        unsigned long long* p = dkv + size_t(rows[r]) * D + c * LANES_PER_ROW + lane % LANES_PER_ROW;
        asm volatile("red.global.add.u64 [%0], %1;" :: "l"(p), "l"(1ull) : "memory");
      }
    }
  }
}

__global__ void __launch_bounds__(THREADS) red_u32(unsigned* __restrict__ dkv,
                                                   const int* __restrict__ idx, int n_tasks) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int task = blockIdx.x; task < n_tasks; task += gridDim.x) {
    const int* rows = idx + size_t(task) * ROWS;
    for (int c = 0; c < D / 32; ++c) {
      for (int r = warp; r < ROWS; r += 4) {
        unsigned* p = dkv + size_t(rows[r]) * D + c * 32 + lane;
        asm volatile("red.global.add.u32 [%0], %1;" :: "l"(p), "r"(1u) : "memory");
      }
    }
  }
}

// ---- cp.reduce.async.bulk from shared memory -------------------------------------------------

__device__ __forceinline__ void bulk_add(float* dst, const float* src_smem, int bytes) {
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(src_smem));
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"
               :: "l"(dst), "r"(s), "r"(bytes) : "memory");
}

// W: columns per bulk operation; RB: rows per staging buffer (RB x W floats each, two of them)
template <int W, int RB>
__global__ void __launch_bounds__(THREADS) bulk(float* __restrict__ dkv,
                                                const int* __restrict__ idx, int n_tasks) {
  extern __shared__ __align__(128) float stage[];  // [2][RB][W]
  int buf = 0;
  for (int task = blockIdx.x; task < n_tasks; task += gridDim.x) {
    const int* rows = idx + size_t(task) * ROWS;
    for (int r0 = 0; r0 < ROWS; r0 += RB) {
      for (int c0 = 0; c0 < D; c0 += W) {
        float* s = stage + buf * RB * W;
        // the buffer's previous bulk reads are done (issued by threads 0..RB-1)
        if (threadIdx.x < RB) asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
        __syncthreads();
        for (int i = threadIdx.x * 4; i < RB * W; i += THREADS * 4)
          *reinterpret_cast<float4*>(s + i) = make_float4(1.f, 1.f, 1.f, 1.f);
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        __syncthreads();
        if (threadIdx.x < RB) {
          bulk_add(dkv + size_t(rows[r0 + threadIdx.x]) * D + c0, s + threadIdx.x * W, W * 4);
          asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        }
        buf ^= 1;
      }
    }
  }
  if (threadIdx.x < RB) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// ---- host ------------------------------------------------------------------------------------

enum Elem { F32, U64, U32 };

struct Variant {
  const char* name;
  void (*launch)(void*, const int*, int, int, cudaStream_t, const unsigned short*);
  Elem elem = F32;
};

size_t elem_bytes(Elem e) { return e == U64 ? 8 : 4; }

// lets `kernel` take `bytes` of dynamic shared memory (above the 48 KiB default)
template <typename Kernel>
void allow_smem(Kernel kernel, size_t bytes) {
  CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
}

template <bool kLines, bool kGather>
void launch_red(void* dkv, const int* idx, int n, int grid, cudaStream_t st,
                const unsigned short* kv) {
  size_t smem = kGather ? ROWS * D * 2 : 0;
  static const bool once = (allow_smem(red_v4<kLines, kGather>, smem), true);  // outside the timed launches
  (void)once;
  red_v4<kLines, kGather><<<grid, THREADS, smem, st>>>(static_cast<float*>(dkv), idx, n, kv);
}

template <int W, int RB>
void launch_bulk(void* dkv, const int* idx, int n, int grid, cudaStream_t st,
                 const unsigned short*) {
  size_t smem = 2 * RB * W * sizeof(float);
  static const bool once = (allow_smem(bulk<W, RB>, smem), true);
  (void)once;
  bulk<W, RB><<<grid, THREADS, smem, st>>>(static_cast<float*>(dkv), idx, n);
}

template <int LANES_PER_ROW>
void launch_u64(void* dkv, const int* idx, int n, int grid, cudaStream_t st,
                const unsigned short*) {
  red_u64<LANES_PER_ROW><<<grid, THREADS, 0, st>>>(static_cast<unsigned long long*>(dkv), idx, n);
}

void launch_u32(void* dkv, const int* idx, int n, int grid, cudaStream_t st,
                const unsigned short*) {
  red_u32<<<grid, THREADS, 0, st>>>(static_cast<unsigned*>(dkv), idx, n);
}

int main(int argc, char** argv) {
  int s_q = argc > 1 ? atoi(argv[1]) : 2048;
  int s_kv = argc > 2 ? atoi(argv[2]) : 8192;
  int topk = argc > 3 ? atoi(argv[3]) : 2048;
  int reps = argc > 4 ? atoi(argv[4]) : 10;
  int blocks = topk / ROWS, n_tasks = s_q * blocks;
  std::vector<int> h_idx(size_t(n_tasks) * ROWS);
  std::vector<int> perm(s_kv);
  std::mt19937 rng(1234);
  std::vector<double> count(s_kv, 0.0);
  for (int q = 0; q < s_q; ++q) {
    for (int i = 0; i < s_kv; ++i) perm[i] = i;
    for (int i = 0; i < topk; ++i) std::swap(perm[i], perm[i + rng() % (s_kv - i)]);
    for (int i = 0; i < topk; ++i) {
      h_idx[size_t(q) * topk + i] = perm[i];
      count[perm[i]] += 1.0;
    }
  }
  int* d_idx;
  void* d_kv;  // the accumulator: s_kv x D elements of the widest kind (8 bytes)
  unsigned short* d_kv_bf16;  // the gathered KV rows: contents never read back
  CHECK(cudaMalloc(&d_kv_bf16, size_t(s_kv) * D * 2));
  CHECK(cudaMemset(d_kv_bf16, 0, size_t(s_kv) * D * 2));
  CHECK(cudaMalloc(&d_idx, h_idx.size() * sizeof(int)));
  CHECK(cudaMalloc(&d_kv, size_t(s_kv) * D * 8));
  CHECK(cudaMemcpy(d_idx, h_idx.data(), h_idx.size() * sizeof(int), cudaMemcpyHostToDevice));
  int sms;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t st;
  CHECK(cudaStreamCreate(&st));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  const Variant variants[] = {
      {"red_v4_lines", launch_red<true, false>}, {"red_v4_row", launch_red<false, false>},
      {"gather+red", launch_red<true, true>},
      {"bulk_32", launch_bulk<32, 64>},    {"bulk_64", launch_bulk<64, 64>},
      {"bulk_192", launch_bulk<192, 32>},  {"bulk_576", launch_bulk<576, 16>},
      {"u64_lines", launch_u64<16>, U64},  {"u64_halves", launch_u64<8>, U64},
      {"u64_sectors", launch_u64<4>, U64},
      {"u32_lines", launch_u32, U32},
  };
  double values = double(n_tasks) * ROWS * D;
  printf("{\"gpu\": \"%s\", \"sms\": %d, \"s_q\": %d, \"s_kv\": %d, \"topk\": %d}\n", prop.name,
         sms, s_q, s_kv, topk);
  std::vector<unsigned char> h_kv(size_t(s_kv) * D * 8);
  const char* only = argc > 5 ? argv[5] : nullptr;  // one variant (e.g. under a profiler)
  for (const Variant& v : variants) {
    if (only && std::string(only) != v.name) continue;
    for (int per_sm : {1, 2, 4}) {
      int grid = sms * per_sm;
      std::vector<float> ms;
      double max_err = 0.0;
      for (int r = 0; r < reps + 1; ++r) {
        CHECK(cudaMemsetAsync(d_kv, 0, size_t(s_kv) * D * elem_bytes(v.elem), st));
        CHECK(cudaEventRecord(e0, st));
        v.launch(d_kv, d_idx, n_tasks, grid, st, d_kv_bf16);
        CHECK(cudaEventRecord(e1, st));
        CHECK(cudaStreamSynchronize(st));
        CHECK(cudaGetLastError());
        float t;
        CHECK(cudaEventElapsedTime(&t, e0, e1));
        if (r > 0) ms.push_back(t);
        if (r == 0) {
          CHECK(cudaMemcpy(h_kv.data(), d_kv, size_t(s_kv) * D * elem_bytes(v.elem),
                           cudaMemcpyDeviceToHost));
          for (size_t i = 0; i < size_t(s_kv) * D; ++i) {
            double got = v.elem == U64 ? double(reinterpret_cast<unsigned long long*>(h_kv.data())[i])
                       : v.elem == U32 ? double(reinterpret_cast<unsigned*>(h_kv.data())[i])
                                       : double(reinterpret_cast<float*>(h_kv.data())[i]);
            max_err = std::max(max_err, std::abs(got - count[i / D]));
          }
        }
      }
      std::sort(ms.begin(), ms.end());
      double med = ms[ms.size() / 2];
      printf("{\"variant\": \"%s\", \"ctas_per_sm\": %d, \"ms\": %.4f, \"gb_per_s\": %.1f, "
             "\"gvalues_per_s\": %.1f, \"max_err\": %.1f}\n",
             v.name, per_sm, med, values * elem_bytes(v.elem) / med / 1e6, values / med / 1e6,
             max_err);
      fflush(stdout);
    }
  }
  return 0;
}
