// Writing a step's K/V into the int8 KV cache: each (token, head) row quantized with its own
// scale (cpu_kv_int8.h) and stored at the token's slot, in one call per layer. Replaces
// kv_int8.write_kv_int8's dozen torch ops (a few hundred microseconds a layer at decode) with
// one pass over the step's K/V.
//
//   kv        [T, 2 * Hkv, HD] (float or bf16) token stride kv_token_stride, heads contiguous
//   slots     [T] int64 flat slot of each token (block * block_size + offset)
//   kv_cache  [num_slots, 2 * Hkv, HD + 2] int8

#include <omp.h>

#include <algorithm>
#include <cstdint>

#include "cpu_kv_int8.h"

namespace {

using namespace poise_attention;

template <typename T>
void write(const T* kv, int64_t kv_token_stride, const int64_t* slots, int num_tokens, int rows,
           int hd, int8_t* cache, int num_threads) {
  const int64_t slot_stride = static_cast<int64_t>(rows) * (hd + kInt8ScaleBytes);
  const int64_t work = static_cast<int64_t>(num_tokens) * rows;
  // A decode step's few rows are not worth waking the threads for.
  const int threads = work * hd < (1 << 16) ? 1 : num_threads;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t i = 0; i < work; ++i) {
    const int64_t t = i / rows, r = i % rows;
    quantize_row(kv + t * kv_token_stride + r * hd, hd,
                 cache + slots[t] * slot_stride + r * (hd + kInt8ScaleBytes));
  }
}

}  // namespace

extern "C" {

// dtype: 0 = float32, 1 = bfloat16 (of kv). Returns 0, or a negative code on bad arguments.
int poise_write_kv_int8(int dtype, const void* kv, int64_t kv_token_stride, const int64_t* slots,
                        int num_tokens, int rows, int head_dim, void* kv_cache, int num_threads) {
  if (num_tokens <= 0) return 0;
  if (rows <= 0 || head_dim <= 0) return -1;
  int8_t* cache = static_cast<int8_t*>(kv_cache);
  const int threads = std::max(num_threads, 1);
  if (dtype == 0) {
    write(static_cast<const float*>(kv), kv_token_stride, slots, num_tokens, rows, head_dim,
          cache, threads);
  } else if (dtype == 1) {
    write(static_cast<const bf16*>(kv), kv_token_stride, slots, num_tokens, rows, head_dim,
          cache, threads);
  } else {
    return -2;
  }
  return 0;
}

}  // extern "C"
