// Streaming read of a buffer, every byte once, on all threads: the DRAM read floor that a
// decode step's weight reads are compared with (benchmarks/hardware.py builds and times it).
//
// Each thread reads one contiguous slice with 64-byte AVX-512 loads into eight independent
// accumulators (enough loads in flight to keep the memory pipeline full; one accumulator
// would serialise on the add's latency). The sum is returned so the compiler cannot drop the
// loads. Without AVX-512 the same loop runs on 64-bit words.

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(_OPENMP)
#include <omp.h>
#endif

namespace {

constexpr int64_t kLine = 64;  // bytes per load (one cache line)
constexpr int64_t kUnroll = 8;  // loads per iteration, one accumulator each

uint64_t read_slice(const unsigned char* p, int64_t lines) {
#if defined(__AVX512F__)
    __m512i acc[kUnroll];
    for (auto& a : acc) a = _mm512_setzero_si512();
    int64_t i = 0;
    for (; i + kUnroll <= lines; i += kUnroll) {
        const unsigned char* q = p + i * kLine;
        for (int64_t u = 0; u < kUnroll; ++u) {
            acc[u] = _mm512_add_epi64(acc[u], _mm512_loadu_si512(q + u * kLine));
        }
    }
    for (; i < lines; ++i) {
        acc[0] = _mm512_add_epi64(acc[0], _mm512_loadu_si512(p + i * kLine));
    }
    for (int64_t u = 1; u < kUnroll; ++u) acc[0] = _mm512_add_epi64(acc[0], acc[u]);
    return static_cast<uint64_t>(_mm512_reduce_add_epi64(acc[0]));
#else
    uint64_t acc[kUnroll] = {0};
    const int64_t words = lines * kLine / 8;
    int64_t i = 0;
    for (; i + kUnroll <= words; i += kUnroll) {
        for (int64_t u = 0; u < kUnroll; ++u) {
            uint64_t w;
            std::memcpy(&w, p + (i + u) * 8, 8);
            acc[u] += w;
        }
    }
    uint64_t total = 0;
    for (int64_t u = 0; u < kUnroll; ++u) total += acc[u];
    for (; i < words; ++i) {
        uint64_t w;
        std::memcpy(&w, p + i * 8, 8);
        total += w;
    }
    return total;
#endif
}

}  // namespace

// Reads the first floor(nbytes[i] / 64) * 64 bytes of each of `count` buffers, all in one
// parallel region, and returns their 64-bit lane sum. Each thread reads one contiguous slice of
// every buffer, in order (a static split by lines): each core streams its own pages, as a kernel
// splitting a weight matrix by output rows would, and several buffers in one call are the peer
// of one layer's kernel call reading its weight, scales and zeros (one region's start and end).
extern "C" uint64_t poise_read_spans(const void* const* data, const int64_t* nbytes, int count,
                                     int threads) {
    uint64_t total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        int nt = 1, t = 0;
#if defined(_OPENMP)
        nt = omp_get_num_threads();
        t = omp_get_thread_num();
#endif
        for (int i = 0; i < count; ++i) {
            const int64_t lines = nbytes[i] / kLine;
            const int64_t begin = lines * t / nt, end = lines * (t + 1) / nt;
            total += read_slice(static_cast<const unsigned char*>(data[i]) + begin * kLine,
                                end - begin);
        }
    }
    return total;
}

// One buffer: the first floor(nbytes / 64) * 64 bytes of data; returns their 64-bit lane sum.
extern "C" uint64_t poise_read_bytes(const void* data, int64_t nbytes, int threads) {
    return poise_read_spans(&data, &nbytes, 1, threads);
}
