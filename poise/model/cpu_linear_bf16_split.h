// bf16 weights as stored, y = x . W^T for any row count: the work split shared by the AVX-512
// (cpu_linear_bf16.h) and AVX2 (cpu_linear_avx2.h) dot-product kernels, each of which computes
// one block of 4 channels for a run of rows.
//
// Rows in chunks of kBf16RowChunk, chunk-major items of (chunk, run of 4 channel blocks): a
// chunk's rows stay in L2 while the channels pass by (SmolLM2-1.7B's layers at 2,048 rows read
// x from DRAM for every 4 channels without it: 2.05x torch's time; chunked 1.18x). Chunking
// changes no sum (a row is in a block of 1-4 rows either way, summed in the same order), so a
// row's output is the same bits at any row count.
#pragma once

#include <cstdint>

#include "cpu_pool.h"

namespace plk {

constexpr int64_t kBf16RowChunk = 64;  // rows per pass over the channels
constexpr int64_t kBf16Block = 4;      // channels per block (both kernels)

// block(x, rows, k, w, n, c0, y): channels [c0, c0 + 4) (fewer at the end) for `rows` rows;
// row_block: the kernel's rows per register block (chunks are multiples of it).
template <class Block>
void bf16_rows_split(const uint16_t* x, int64_t m, int64_t k, const uint16_t* w, int64_t n,
                     uint16_t* y, int threads, int64_t row_block, Block block) {
  const int64_t blocks = (n + kBf16Block - 1) / kBf16Block;
  // Runs of 4 blocks per item, so that most prefetched next blocks are the same thread's.
  constexpr int64_t kRun = 4;
  const int64_t runs = (blocks + kRun - 1) / kRun;
  if (m <= kBf16RowChunk) {
    ppool::parallel_for(runs, threads, [&](int64_t item) {
      for (int64_t b = item * kRun; b < item * kRun + kRun && b < blocks; ++b)
        block(x, m, k, w, n, b * kBf16Block, y);
    });
    return;
  }
  // Chunks of equal size (a multiple of the row block, at most kBf16RowChunk, so every chunk
  // starts below m): 65 rows as 36 + 29, not 64 + 1, whose 1-row pass would read all the
  // weights again for one row.
  const int64_t chunks = (m + kBf16RowChunk - 1) / kBf16RowChunk;
  const int64_t chunk = ((m + chunks - 1) / chunks + row_block - 1) / row_block * row_block;
  ppool::parallel_for(chunks * runs, threads, [&](int64_t item) {
    const int64_t r0 = item / runs * chunk, b0 = item % runs * kRun;
    const int64_t rows = m - r0 < chunk ? m - r0 : chunk;
    for (int64_t b = b0; b < b0 + kRun && b < blocks; ++b)
      block(x + r0 * k, rows, k, w, n, b * kBf16Block, y + r0 * n);
  });
}

}  // namespace plk
