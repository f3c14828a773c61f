// Writing a step's K/V into the KV cache at each token's slot, in one call per layer.
// - The int8 cache: each (token, head) row quantized with its own scale (cpu_kv_int8.h).
//   Replaces kv_int8.write_kv_int8's dozen torch ops (a few hundred microseconds a layer at
//   decode) with one pass over the step's K/V.
// - A cache in the step's dtype: each token's K and V heads (one contiguous run in the qkv
//   buffer) copied to its slot. torch's index_copy_ on the strided [T, 2Hkv, hd] view took
//   ~46 us a layer for one token of SmolLM2-1.7B's 8 KB (1.1 ms of a 24-layer step).
//
//   kv        [T, 2 * Hkv, HD] (float or bf16) token stride kv_token_stride, heads contiguous
//   slots     [T] int64 flat slot of each token (block * block_size + offset)
//   kv_cache  [num_slots, 2 * Hkv, HD + 2] int8, or [num_slots, 2 * Hkv, HD] in kv's dtype

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

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

// Each token's rows x hd elements of T, contiguous in kv and in its slot.
void copy_rows(const void* kv, int64_t kv_token_stride, const int64_t* slots, int num_tokens,
               int64_t row_bytes, int64_t elem, void* cache, int num_threads) {
  const char* src = static_cast<const char*>(kv);
  char* dst = static_cast<char*>(cache);
  // A decode step's few tokens are not worth waking the threads for.
  const int threads = num_tokens * row_bytes < (int64_t(1) << 20) ? 1 : num_threads;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int t = 0; t < num_tokens; ++t)
    std::memcpy(dst + slots[t] * row_bytes, src + t * kv_token_stride * elem, row_bytes);
}

}  // namespace

extern "C" {

// The cache in kv's dtype (0 = float32, 1 = bfloat16): the same arguments as below, rows x
// head_dim elements a slot. Returns 0, or a negative code on bad arguments.
int poise_write_kv(int dtype, const void* kv, int64_t kv_token_stride, const int64_t* slots,
                   int num_tokens, int rows, int head_dim, void* kv_cache, int num_threads) {
  if (num_tokens <= 0) return 0;
  if (rows <= 0 || head_dim <= 0) return -1;
  if (dtype != 0 && dtype != 1) return -2;
  const int64_t elem = dtype == 0 ? 4 : 2;
  copy_rows(kv, kv_token_stride, slots, num_tokens, static_cast<int64_t>(rows) * head_dim * elem,
            elem, kv_cache, std::max(num_threads, 1));
  return 0;
}

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
