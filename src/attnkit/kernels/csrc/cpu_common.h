// Pieces shared by the CPU kernels (potentials_cpu.cpp, coda_cpu.cpp): row-major GEMM over the BLAS that
// torch links, the replayable attention dropout, and the work-balanced schedule of (batch, head) problems.
// The functions are inline (or templates): each kernel file that includes the header shares one definition.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <vector>

extern "C" {
void sgemm_(const char*, const char*, const int*, const int*, const int*, const float*, const float*, const int*,
            const float*, const int*, const float*, float*, const int*);
void dgemm_(const char*, const char*, const int*, const int*, const int*, const double*, const double*,
            const int*, const double*, const int*, const double*, double*, const int*);
}

namespace attnkit_cpu_common {

// A std::vector whose data start on a cache line. The BLAS may take other code paths (and round differently)
// for operands at other alignments, so buffers that a thread happens to allocate at another offset could change
// the last bits of a result; on 64-byte boundaries they do not.
template <typename T>
struct LineAllocator {
  using value_type = T;
  LineAllocator() = default;
  template <typename U>
  LineAllocator(const LineAllocator<U>&) {}
  T* allocate(std::size_t n) {
    const std::size_t bytes = (n * sizeof(T) + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, bytes ? bytes : 64);
    if (!p) throw std::bad_alloc();
    return static_cast<T*>(p);
  }
  void deallocate(T* p, std::size_t) { std::free(p); }
  template <typename U>
  bool operator==(const LineAllocator<U>&) const { return true; }
  template <typename U>
  bool operator!=(const LineAllocator<U>&) const { return false; }
};
template <typename T>
using lvector = std::vector<T, LineAllocator<T>>;

inline void blas(char ta, char tb, int m, int n, int k, float alpha, const float* a, int lda, const float* b, int ldb,
          float beta, float* c, int ldc) {
  sgemm_(&ta, &tb, &m, &n, &k, &alpha, a, &lda, b, &ldb, &beta, c, &ldc);
}
inline void blas(char ta, char tb, int m, int n, int k, double alpha, const double* a, int lda, const double* b,
          int ldb, double beta, double* c, int ldc) {
  dgemm_(&ta, &tb, &m, &n, &k, &alpha, a, &lda, b, &ldb, &beta, c, &ldc);
}

// Row-major C (M x N) = alpha * op(A) op(B) + beta * C, where op(A) is M x K and op(B) is K x N.
// (Column-major BLAS computes C^T = op(B)^T op(A)^T on the same memory.)
template <typename T>
void mm(bool transA, bool transB, int64_t M, int64_t N, int64_t K, T alpha, const T* A, int64_t lda, const T* B,
        int64_t ldb, T beta, T* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  if (K == 0) {
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = beta == T(0) ? T(0) : beta * C[i * ldc + j];
    return;
  }
  blas(transB ? 'T' : 'N', transA ? 'T' : 'N', (int)N, (int)M, (int)K, alpha, B, (int)ldb, A, (int)lda, beta, C,
       (int)ldc);
}

// Replayable attention dropout: pair (i, j) of head bh (compacted indices) is kept iff the 16-bit lane
// j % 4 of splitmix64(seed, bh, i, j / 4) is >= thr (p is rounded to a multiple of 2^-16); kept weights
// are scaled by 1 / (1 - thr / 2^16), so that the expected output is unchanged.
struct Dropout {
  bool on = false;
  uint64_t seed = 0;
  uint32_t thr = 0;
  double keep_scale = 1.0;
  int64_t bh = 0;

  Dropout(double p, int64_t seed_) {
    if (p <= 0.0) return;
    on = true;
    seed = (uint64_t)seed_;
    thr = (uint32_t)std::llround(p * 65536.0);
    keep_scale = thr >= 65536 ? 0.0 : 65536.0 / (65536.0 - thr);
  }
  static uint64_t mix(uint64_t x) {
    x += 0x9E3779B97F4A7C15ULL;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
  }
  // z[j] = scale if pair (i, j0 + j) is kept, else 0, for j < bc. In pieces of kGroups hashes: one loop
  // of hashes and one of lanes, both branch-free so that the compiler vectorizes them (the 16-bit lane
  // k of a hash is the k-th uint16 of its little-endian bytes).
  template <typename T>
  void row(int64_t i, int64_t j0, int64_t bc, T* z) const {
    static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the dropout lanes assume little-endian bytes");
    constexpr int64_t kGroups = 64;
    alignas(64) uint64_t bits[kGroups];
    const uint64_t base = seed ^ mix(((uint64_t)bh << 32) ^ (uint64_t)i);
    const T keep = (T)keep_scale;
    for (int64_t j = 0; j < bc;) {
      const int64_t jj = j0 + j, first = jj >> 2, skip = jj & 3;
      const int64_t span = std::min<int64_t>(bc - j, 4 * kGroups - skip);  // keys of this piece
      const int64_t groups = (skip + span + 3) >> 2;
      for (int64_t g = 0; g < groups; ++g) bits[g] = mix(base + (uint64_t)(first + g));
      const uint16_t* lanes = reinterpret_cast<const uint16_t*>(bits) + skip;
      for (int64_t x = 0; x < span; ++x) z[j + x] = lanes[x] >= thr ? keep : T(0);
      j += span;
    }
  }
};

// The work of each of `problems` ((batch, head) indices): valid queries x valid keys, + 1 (an empty problem
// still costs its bookkeeping).
inline std::vector<int64_t> problem_costs(const at::Tensor& km, const at::Tensor& qm, int64_t heads, int64_t Lq,
                                          int64_t Lk, const std::vector<int64_t>& problems) {
  std::vector<int64_t> cost;
  cost.reserve(problems.size());
  for (const int64_t bh : problems) {
    const int64_t b = bh / heads;
    int64_t n = Lq, m = Lk;
    if (qm.defined()) n = std::count(qm.data_ptr<bool>() + b * Lq, qm.data_ptr<bool>() + (b + 1) * Lq, true);
    if (km.defined()) m = std::count(km.data_ptr<bool>() + b * Lk, km.data_ptr<bool>() + (b + 1) * Lk, true);
    cost.push_back(n * m + 1);
  }
  return cost;
}

// Work-balanced schedule of the (batch, head) problems over the threads: a problem costs its valid
// (query, key) pairs; the largest go first, each to the least-loaded thread (the longest-processing-time
// rule), so that a padded batch is split by work and not by index (with lengths 1024/700/400/100 in that
// order, contiguous index ranges gave one of two threads 90% of the pairs). Every problem is computed
// independently of the schedule, so the results do not depend on it.
inline std::vector<std::vector<int64_t>> balanced_schedule(const at::Tensor& km, const at::Tensor& qm,
                                                           const std::vector<int64_t>& problems, int64_t heads,
                                                           int64_t Lq, int64_t Lk, int64_t threads) {
  const auto cost = problem_costs(km, qm, heads, Lq, Lk, problems);
  std::vector<int64_t> order(problems.size());
  for (size_t x = 0; x < order.size(); ++x) order[x] = x;
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return cost[x] > cost[y]; });
  std::vector<std::vector<int64_t>> lists(threads);
  std::vector<int64_t> load(threads, 0);
  for (const int64_t x : order) {
    const int64_t t = std::min_element(load.begin(), load.end()) - load.begin();
    lists[t].push_back(problems[x]);
    load[t] += cost[x];
  }
  for (auto& l : lists) std::sort(l.begin(), l.end());  // index order within a thread
  return lists;
}

}  // namespace attnkit_cpu_common
