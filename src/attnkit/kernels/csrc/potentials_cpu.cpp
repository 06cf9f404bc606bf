// DNAS, HNAS and Sinkhorn attention on the CPU in O(L) extra memory, forward and exact backward.
//
// "Attention that does not Explain Away" (arXiv:2009.14308), sections 3.1-3.2 and 5; "Doubly-Normalized Attention",
// eqs. (6)-(8) and section 6; docs/design.md section 2. With scores s_ij = scale * q_i . k_j, a^0 = 0 and
// k >= 1 rounds of log-domain potentials
//
//     b^t_j = -LSE_i (s_ij + a^{t-1}_i)        (column step, over valid queries)
//     a^t_i = -LSE_j (s_ij + b^t_j)            (row step, over valid keys)
//     out_i = sum_j exp(s_ij + b^k_j + a^k_i) v_j
//
// k = 1 is DNAS, k > 1 Sinkhorn; with `softmax_too` the same sweeps also return the softmax output
// (the other half of HNAS). k = 0 is softmax alone (a^0 = -LSE_j s_ij; softmax_forward_head), for attention
// dropout, which PyTorch's fused CPU attention does not have. Padding masks are handled by compaction: each (batch, head) gathers its
// valid queries and keys into dense buffers, so the kernel proper never meets an invalid pair.
//
// Layout of the work. The keys are visited in strips of `kBc` columns; a strip holds every valid query,
// so its column log-sum-exp is complete within the strip. Each strip is built in row chunks of `bq` (up to
// kBq; one GEMM per chunk), and every elementwise step of a chunk runs while it is in cache.
//
// forward without the softmax half (DNAS, Sinkhorn), in the scaling domain (scaled_strip):
//                    round 1, chunk c: E = exp(s - u_c), column sums cs_cj = sum_i E_ij, with the bounds
//                           u_cj = scale q_c . k_j + |scale| max_{i in c} |q_i - q_c| |k_j| >= s_ij (q_c: the chunk's
//                           mean query; Cauchy-Schwarz), so no pass finds the column maxima; E is kept within
//                           the scores' budget
//                    round t > 1, chunk c: cs_cj = sum_i A_i E_ij, A_i = exp(a^{t-1}_i - alpha_c), alpha_c the chunk's
//                           largest a^{t-1} (no exponentials: E is read back, or recomputed alike)
//                    strip: b^t_j = -(M_j + log z_j) from the chunk log-sums u_cj + alpha_c + log cs_cj; columns
//                           whose bounds are too loose to trust take the robust column step (recomputed scores)
//                    chunk: F_cj = exp(u_cj + alpha_c + b^t_j); l_i += sum_j E_ij F_cj (= sum_j w_ij / A_i);
//                           last round: acc_i += E_i (diag(F) V)
//                    a^t_i = alpha_c - log(l_i), out_i = acc_i / l_i; a round whose a^{t-1} spreads over more than
//                    bound_gap within a chunk takes the log-domain sweep below instead
// forward with the softmax half (HNAS), log domain, round t:
//                    chunk: X = s + a^{t-1}; per-chunk column max m_c and sums of exp(X - m_c)  (from round 2
//                           on m_c is a bound on the column maximum known from round t - 1, when it is close)
//                    strip: merge the chunks -> b^t_j
//                    chunk: w = exp(X - m_c) * f_c, f_c = exp(m_c - M) / z  (column-normalized, in [0, 1]);
//                           l_i += sum_j w_ij; last round: acc_i += w_i V  (without dropout w is not
//                           formed: l += E f_c and acc += E (diag(f_c) V), E = exp(X - m_c))
//                    a^t_i = a^{t-1}_i - log(l_i), out_i = acc_i / l_i  (rows whose l underflowed are
//                    recomputed with a running maximum)
// backward, k = 1:   chunk: P = exp(s + b^k + a^k), dP = dO V^T, dV += P^T dO, dS = P (dP - delta),
//                           g_j += sum_i dS_ij  (gradient of b^k_j, complete after the strip)
//                    chunk: dS -= Q_col g (Q_col: column-normalized weights of the last column step),
//                           dQ += dS K, dK += dS^T Q
// backward, k > 1:   sweeps of rounds k .. 2 find the gradients of the potentials b^t, a^{t-1} alone (the
//                    last one from dV: g_j = v_j . dV_j - sum_i P_ij delta_i, no dP), then one sweep forms
//                    dS of every round and computes dP, dQ and dK once (see backward_head); without the
//                    softmax half the weights of every round are products of kept exponentials E = exp(s - u)
//                    and row and column factors (the scaling domain), when those factors are safe
//
// Attention dropout (training) drops the final weights pi_ij with a counter-based hash of (seed, head, i, j),
// so that the backward pass replays the same mask without storing it (as FlashAttention does on the GPU):
// out_i = sum_j pi_ij z_ij v_j with z_ij in {0, 1 / (1 - p)}; the row sums, the potentials and every
// column step use the weights before dropout.
//
// potentials_inference runs the same forward without returning the potentials that only the backward pass
// reads (no input needs a gradient), so its outputs are bit-identical to potentials_forward's.
//
// Sinkhorn (k > 1) reads the same scores in every round: the first sweep that computes a strip keeps them
// (Scratch::scores, up to `score_cache_bytes` shared by the threads): the exponentials E in the scaling domain,
// else the scores. The later sweeps read them back instead
// of recomputing Q K^T; a strip that is not kept is recomputed with the same arithmetic, so the results are the
// same for every budget.
// The extra memory is two strips of (Lq, kBc) per thread, the kept scores (at most score_cache_bytes), and
// O(L) vectors per (batch, head) (the chunk bounds: (Lq / bq, Lk)).
// Parallel over (batch, head) problems, balanced by their valid pairs (run_balanced).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <memory>
#include <mutex>
#include <type_traits>
#include <vector>


#include "cpu_common.h"

namespace {

using attnkit_cpu_common::balanced_schedule;
using attnkit_cpu_common::problem_costs;
using attnkit_cpu_common::blas;
using attnkit_cpu_common::Dropout;
using attnkit_cpu_common::mm;

constexpr int64_t kBc = 128;  // keys per strip
constexpr int64_t kBq = 1024;  // queries per chunk (at most; fewer when one head is spread over the threads)

// ---------------------------------------------------------------------------------------------------
// Vector helpers (the BLAS wrappers, the dropout and the schedule are in cpu_common.h)

// dst[j] = exp((src[j] + shift[j]) + c) for j < n (shift may be null; dst may be src). In this order: the
// backward's weights exp((s_ij + b_j) + a_i) have s_ij + b_j = s_ij - c_j exact wherever the weight matters
// (Sterbenz) and a_i of order one; (s_ij + a_i) + b_j rounds at |s| (float32 dK erred 0.19 at |s| ~ 1e4).
inline void exp_to(float* dst, const float* src, const float* shift, float c, int64_t n) {
  using V = at::vec::Vectorized<float>;
  const V vc(c);
  int64_t j = 0;
  for (; j + V::size() <= n; j += V::size()) {
    V y = V::loadu(src + j);
    if (shift) y = y + V::loadu(shift + j);
    (y + vc).exp_u20().store(dst + j);
  }
  for (; j < n; ++j) dst[j] = std::exp((src[j] + (shift ? shift[j] : 0.f)) + c);
}
inline void exp_to(double* dst, const double* src, const double* shift, double c, int64_t n) {
  for (int64_t j = 0; j < n; ++j) dst[j] = std::exp((src[j] + (shift ? shift[j] : 0.0)) + c);
}
template <typename T>
inline void exp_shift(T* x, const T* shift, T c, int64_t n) {
  exp_to(x, x, shift, c, n);
}

// x[j] = exp(x[j] + shift[j]) and acc[j] += x[j], for j < n, in one pass.
inline void exp_acc(float* x, const float* shift, float* acc, int64_t n) {
  using V = at::vec::Vectorized<float>;
  int64_t j = 0;
  for (; j + V::size() <= n; j += V::size()) {
    const V y = (V::loadu(x + j) + V::loadu(shift + j)).exp_u20();
    y.store(x + j);
    (V::loadu(acc + j) + y).store(acc + j);
  }
  for (; j < n; ++j) {
    x[j] = std::exp(x[j] + shift[j]);
    acc[j] += x[j];
  }
}
inline void exp_acc(double* x, const double* shift, double* acc, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    x[j] = std::exp(x[j] + shift[j]);
    acc[j] += x[j];
  }
}

// dst[j] = exp(src[j] + c + shift[j]) and acc[j] += dst[j], for j < n: exp_acc on x = src + c, rounded alike.
inline void exp_acc_from(float* dst, const float* src, float c, const float* shift, float* acc, int64_t n) {
  using V = at::vec::Vectorized<float>;
  const V vc(c);
  int64_t j = 0;
  for (; j + V::size() <= n; j += V::size()) {
    const V y = ((V::loadu(src + j) + vc) + V::loadu(shift + j)).exp_u20();
    y.store(dst + j);
    (V::loadu(acc + j) + y).store(acc + j);
  }
  for (; j < n; ++j) {
    dst[j] = std::exp((src[j] + c) + shift[j]);
    acc[j] += dst[j];
  }
}
inline void exp_acc_from(double* dst, const double* src, double c, const double* shift, double* acc, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    dst[j] = std::exp((src[j] + c) + shift[j]);
    acc[j] += dst[j];
  }
}

// x[j] = exp(x[j] + c) for j < n; returns their sum.
inline float exp_sum(float* x, float c, int64_t n) {
  using V = at::vec::Vectorized<float>;
  const V vc(c);
  V acc(0.f);
  int64_t j = 0;
  for (; j + V::size() <= n; j += V::size()) {
    const V y = (V::loadu(x + j) + vc).exp_u20();
    y.store(x + j);
    acc = acc + y;
  }
  float s = at::vec::vec_reduce_all<float>([](const V& p, const V& q) { return p + q; }, acc);
  for (; j < n; ++j) {
    x[j] = std::exp(x[j] + c);
    s += x[j];
  }
  return s;
}
inline double exp_sum(double* x, double c, int64_t n) {
  double s = 0;
  for (int64_t j = 0; j < n; ++j) {
    x[j] = std::exp(x[j] + c);
    s += x[j];
  }
  return s;
}

template <typename T>
inline T vmax(const T* x, int64_t n) {
  T m = -std::numeric_limits<T>::infinity();
  for (int64_t j = 0; j < n; ++j) m = std::max(m, x[j]);
  return m;
}
template <>
inline float vmax<float>(const float* x, int64_t n) {
  using V = at::vec::Vectorized<float>;
  V acc(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + V::size() <= n; j += V::size()) acc = at::vec::maximum(acc, V::loadu(x + j));
  float m = at::vec::vec_reduce_all<float>([](const V& a, const V& b) { return at::vec::maximum(a, b); }, acc);
  for (; j < n; ++j) m = std::max(m, x[j]);
  return m;
}

template <typename T>
inline T dot(const T* a, const T* b, int64_t n) {
  T s = 0;
  for (int64_t j = 0; j < n; ++j) s += a[j] * b[j];
  return s;
}
template <>
inline float dot<float>(const float* a, const float* b, int64_t n) {
  using V = at::vec::Vectorized<float>;
  V acc(0.f);
  int64_t j = 0;
  for (; j + V::size() <= n; j += V::size()) acc = at::vec::fmadd(V::loadu(a + j), V::loadu(b + j), acc);
  float s = at::vec::vec_reduce_all<float>([](const V& x, const V& y) { return x + y; }, acc);
  for (; j < n; ++j) s += a[j] * b[j];
  return s;
}

// y[r] += x_r . f for r < rows (rows of x of length n, leading dimension ld): four rows at a time, so that
// the multiply-adds of different rows overlap instead of waiting on one accumulator.
template <typename T>
inline void rows_dot(const T* x, int64_t ld, const T* f, int64_t n, int64_t rows, T* y) {
  for (int64_t r = 0; r < rows; ++r) y[r] += dot(x + r * ld, f, n);
}
template <>
inline void rows_dot<float>(const float* x, int64_t ld, const float* f, int64_t n, int64_t rows, float* y) {
  using V = at::vec::Vectorized<float>;
  const auto add = [](const V& p, const V& q) { return p + q; };
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) {
    const float* x0 = x + r * ld;
    const float* x1 = x0 + ld;
    const float* x2 = x1 + ld;
    const float* x3 = x2 + ld;
    V a0(0.f), a1(0.f), a2(0.f), a3(0.f);
    int64_t j = 0;
    for (; j + V::size() <= n; j += V::size()) {
      const V fv = V::loadu(f + j);
      a0 = at::vec::fmadd(V::loadu(x0 + j), fv, a0);
      a1 = at::vec::fmadd(V::loadu(x1 + j), fv, a1);
      a2 = at::vec::fmadd(V::loadu(x2 + j), fv, a2);
      a3 = at::vec::fmadd(V::loadu(x3 + j), fv, a3);
    }
    float s0 = at::vec::vec_reduce_all<float>(add, a0), s1 = at::vec::vec_reduce_all<float>(add, a1);
    float s2 = at::vec::vec_reduce_all<float>(add, a2), s3 = at::vec::vec_reduce_all<float>(add, a3);
    for (; j < n; ++j) {
      s0 += x0[j] * f[j];
      s1 += x1[j] * f[j];
      s2 += x2[j] * f[j];
      s3 += x3[j] * f[j];
    }
    y[r] += s0;
    y[r + 1] += s1;
    y[r + 2] += s2;
    y[r + 3] += s3;
  }
  for (; r < rows; ++r) y[r] += dot(x + r * ld, f, n);
}

template <typename T>
inline T sum(const T* a, int64_t n) {
  T s = 0;
  for (int64_t j = 0; j < n; ++j) s += a[j];
  return s;
}
template <>
inline float sum<float>(const float* a, int64_t n) {
  using V = at::vec::Vectorized<float>;
  V acc(0.f);
  int64_t j = 0;
  for (; j + V::size() <= n; j += V::size()) acc = acc + V::loadu(a + j);
  float s = at::vec::vec_reduce_all<float>([](const V& x, const V& y) { return x + y; }, acc);
  for (; j < n; ++j) s += a[j];
  return s;
}

// Largest gap between the column bound and the column maximum for which the forward takes exponentials against
// the bound: terms within ~60 (float) of the maximum stay normal numbers, and smaller ones are below rounding.
template <typename T>
inline T bound_gap() {
  return std::is_same<T, float>::value ? T(25) : T(300);
}

template <typename T>
inline T tiny() {
  return std::sqrt(std::numeric_limits<T>::min());  // row sums below this are redone with a running max
}

// ---------------------------------------------------------------------------------------------------

// One (batch, head) problem in dense, compacted form: n valid queries, m valid keys.

template <typename T>
struct Head {
  int64_t n, m, D, Dv;
  T scale;
  const T* q;  // (n, D)
  const T* k;  // (m, D)
  const T* v;  // (m, Dv)
};

// Large scratch blocks (2 MiB and more, 2 MiB aligned) kept between calls, up to kPoolBytes in all. A fresh
// block costs its first touch: a page fault and the zero-filling of every page (64 MiB of kept Sinkhorn
// exponentials take about 10 ms, and the first calls of a process stall longer while the system assembles
// huge pages), which for one head at L = 4096 was a sixth of a Sinkhorn forward. release_scratch() frees them.
constexpr size_t kPoolBytes = size_t(128) << 20;
constexpr size_t kHugePage = size_t(2) << 20;

class BlockPool {
 public:
  static BlockPool& instance() {
    static BlockPool pool;
    return pool;
  }
  // A kept block of at least `bytes` and at most twice that (the smallest), or null.
  void* take(size_t bytes, size_t& got) {
    std::lock_guard<std::mutex> lock(m_);
    size_t best = blocks_.size();
    for (size_t x = 0; x < blocks_.size(); ++x) {
      const size_t size = blocks_[x].first;
      if (size >= bytes && size <= 2 * bytes && (best == blocks_.size() || size < blocks_[best].first)) best = x;
    }
    if (best == blocks_.size()) return nullptr;
    void* p = blocks_[best].second;
    got = blocks_[best].first;
    held_ -= got;
    blocks_.erase(blocks_.begin() + best);
    return p;
  }
  // Keep the block if the pool has room, else free it.
  void give(void* p, size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(m_);
      if (held_ + bytes <= kPoolBytes) {
        blocks_.emplace_back(bytes, p);
        held_ += bytes;
        return;
      }
    }
    std::free(p);
  }
  void clear() {
    std::lock_guard<std::mutex> lock(m_);
    for (auto& b : blocks_) std::free(b.second);
    blocks_.clear();
    held_ = 0;
  }
  size_t held() {
    std::lock_guard<std::mutex> lock(m_);
    return held_;
  }

 private:
  std::mutex m_;
  std::vector<std::pair<size_t, void*>> blocks_;
  size_t held_ = 0;
};

// A growable buffer. From 2 MiB on its memory is 2 MiB aligned, advised as transparent huge pages (where the
// system allows them; with 4 KiB pages a first touch costs a page fault every 4 KiB, a fifth of a Sinkhorn
// forward at L = 4096) and taken from / returned to the BlockPool. Not zero-filled: every use writes before it
// reads (the buffers are reused from one head to the next anyway).
template <typename T>
class HugeBuffer {
 public:
  HugeBuffer() = default;
  HugeBuffer(const HugeBuffer&) = delete;
  HugeBuffer& operator=(const HugeBuffer&) = delete;
  ~HugeBuffer() { release(); }
  T* data() { return p_; }
  const T* data() const { return p_; }
  void resize(int64_t n) {
    if (n <= cap_) return;
    release();
    const size_t need = size_t(n) * sizeof(T);
    if (need < kHugePage) {  // below a huge page, a huge page would only add zero-filling
      bytes_ = (need + 63) / 64 * 64;
      p_ = static_cast<T*>(std::aligned_alloc(64, bytes_));
      pooled_ = false;
    } else {
      const size_t bytes = (need + kHugePage - 1) / kHugePage * kHugePage;
      p_ = static_cast<T*>(BlockPool::instance().take(bytes, bytes_));
      if (!p_) {
        bytes_ = bytes;
        p_ = static_cast<T*>(std::aligned_alloc(kHugePage, bytes_));
#ifdef MADV_HUGEPAGE
        if (p_) madvise(p_, bytes_, MADV_HUGEPAGE);
#endif
      }
      pooled_ = true;
    }
    TORCH_CHECK(p_ != nullptr, "out of memory: the attention kernel's scratch needs ", bytes_, " bytes");
    cap_ = int64_t(bytes_ / sizeof(T));
  }

 private:
  void release() {
    if (p_ && pooled_)
      BlockPool::instance().give(p_, bytes_);
    else
      std::free(p_);
    p_ = nullptr;
    cap_ = 0;
    bytes_ = 0;
  }
  T* p_ = nullptr;
  int64_t cap_ = 0;
  size_t bytes_ = 0;
  bool pooled_ = false;
};

// Buffers of one worker thread: three (bq, kBc) tiles and kBc vectors.
template <typename T>
struct Tiles {
  std::vector<T> tile, tile2, tile3, vec, row, z, vcat, sink;
};

// Buffers of one (batch, head) problem: two (n, kBc) strips, per-chunk column statistics, and the tiles
// of each thread that works on its chunks (one when the heads are spread over the threads; all of them
// when one head at a time is spread over its query chunks).
//
// Sinkhorn's rounds (iters > 1) all read the same scores s = scale * Q K^T: the scores of the first
// `cached` strips are kept (`scores`, strip s at s * n * kBc, laid out (n, bc)) by the first sweep that
// computes them and read back by the later ones instead of being recomputed, within a byte budget; the values
// are those the product would give again, so the results do not depend on the budget.
template <typename T>
struct Scratch {
  HugeBuffer<T> strip1, strip2;
  std::vector<T> cmax, csum, gb, cg, cref;
  HugeBuffer<T> scores;  // every kept strip is written before it is read
  std::vector<Tiles<T>> tiles;
  // Each query chunk's share of a strip's dK (kBc, D) and dV (kBc, Dv), added up in chunk order (add_partials),
  // so that the sum does not depend on which thread ran which chunk, nor on how the BLAS adds a product to a
  // C it accumulates into (before or after the sum over k: machines differ).
  std::vector<T> pdk, pdv;
  int64_t sdk = 0, sdv = 0;
  T* part_dk(int64_t c) { return pdk.data() + c * sdk; }
  T* part_dv(int64_t c) { return pdv.data() + c * sdv; }
  bool parallel = false;
  int64_t cached = 0, n_rows = 0, capacity = 0, bq = kBq;
  // How many of the m / kBc strips of (n, kBc) scores fit in `budget` bytes.
  static int64_t strips_kept(int64_t n, int64_t m, int64_t budget) {
    const int64_t strips = (m + kBc - 1) / kBc, per_strip = n * kBc * (int64_t)sizeof(T);
    return budget > 0 ? std::min(strips, budget / per_strip) : 0;
  }
  // Keep the scores of as many of the m / kBc strips of (n, kBc) as fit in `budget` bytes.
  void cache_scores(int64_t n, int64_t m, int64_t budget) {
    cached = strips_kept(n, m, budget);
    n_rows = n;
    if (capacity < cached * n * kBc) {
      capacity = cached * n * kBc;
      scores.resize(capacity);
    }
  }
  // Rows i0.. of strip j0's cached scores, or null when the strip is not kept.
  T* cached_scores(int64_t j0, int64_t i0, int64_t bc) {
    const int64_t s = j0 / kBc;
    return s < cached ? scores.data() + s * n_rows * kBc + i0 * bc : nullptr;
  }
  // Query chunks of `bq` rows, at most chunk_rows (kBq unless a test asks for fewer), as many as a multiple of the
  // thread count and of equal size (a multiple of 64, at least 128), so that a head spread over the threads
  // gives each the same work (large chunks amortize the GEMMs' packing of their shared operand). The chunks
  // depend on n and the thread count alone, not on whether the head is spread (par), so neither do the
  // results (the bounds of the scaling domain are per chunk): a head gives the same bits wherever it is run.
  void reserve(int64_t n, int64_t D, int64_t Dv, bool par, int64_t threads, int64_t chunk_rows) {
    parallel = par;
    const int64_t even = ((n + chunk_rows - 1) / chunk_rows + threads - 1) / threads * threads;
    bq = std::min(chunk_rows, std::max<int64_t>(128, ((n + even - 1) / even + 63) / 64 * 64));
    strip1.resize(n * kBc);
    strip2.resize(n * kBc);
    const int64_t chunks = (n + bq - 1) / bq;
    cmax.resize(chunks * kBc);
    csum.resize(chunks * kBc);
    cg.resize(chunks * kBc);
    cref.resize(chunks);
    sdk = kBc * D;
    sdv = kBc * Dv;
    pdk.resize(chunks * sdk);
    pdv.resize(chunks * sdv);
    gb.resize(kBc);
    tiles.resize(par ? threads : 1);
    for (auto& t : tiles) {
      t.tile.resize(bq * kBc);
      t.tile2.resize(std::max(bq, Dv) * kBc);
      t.tile3.resize(bq * kBc);
      t.row.resize(kBc);
      t.vec.resize(kBc);
      t.z.resize(kBc);
      t.sink.resize(kBc);
      t.vcat.resize(kBc * 2 * Dv);
    }
  }
};

// The merge of column j over the query chunks: on entry cmax holds each chunk's exponent e_c (its csum is a sum of
// exp(x_ij - e_c)) and M is the reference; returns b_j = -LSE_i x_ij = -(M + log z), z = sum_c csum_c exp(e_c - M),
// and leaves in cmax the factors exp(e_c - M) / z that column-normalize each chunk's exponentials.
template <typename T>
T merge_column(Scratch<T>& w, int64_t chunks, int64_t j, T M) {
  T z = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    const T f = std::exp(w.cmax[c * kBc + j] - M);
    w.cmax[c * kBc + j] = f;
    z += w.csum[c * kBc + j] * f;
  }
  for (int64_t c = 0; c < chunks; ++c) w.cmax[c * kBc + j] /= z;
  return -(M + std::log(z));
}

// fn(c, tiles) for every query chunk c, on the calling thread or spread over the threads.
template <typename T, typename F>
void for_chunks(int64_t chunks, Scratch<T>& w, const F& fn) {
  if (!w.parallel || chunks == 1) {
    for (int64_t c = 0; c < chunks; ++c) fn(c, w.tiles[0]);
    return;
  }
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    Tiles<T>& tl = w.tiles[at::get_thread_num()];
    for (int64_t c = begin; c < end; ++c) fn(c, tl);
  });
}

// Zero every chunk's partial dK / dV of a strip; afterwards add them, in chunk order, to dk / dv (rows
// j0 .. j0 + bc).
template <typename T>
void zero_partials(Scratch<T>& w) {
  std::fill(w.pdk.begin(), w.pdk.end(), T(0));
  std::fill(w.pdv.begin(), w.pdv.end(), T(0));
}
template <typename T>
void add_partials(Scratch<T>& w, int64_t chunks, int64_t bc, int64_t D, int64_t Dv, T* dk, T* dv) {
  for (int64_t c = 0; c < chunks; ++c) {
    const T* pk = w.part_dk(c);
    for (int64_t x = 0; x < bc * D; ++x) dk[x] += pk[x];
    if (dv) {
      const T* pv = w.part_dv(c);
      for (int64_t x = 0; x < bc * Dv; ++x) dv[x] += pv[x];
    }
  }
}

// The products of a head's sequential steps (the robust rows and columns, the chunk bounds) are loops, not BLAS
// calls: when one head is spread over the threads these steps run outside the parallel loops, where the BLAS
// may split a product over threads of its own and round it otherwise than the same product run by one thread
// (MKL did, on AMD EPYC), and a head must give the same bits wherever it runs.

// s_i. for one query against all keys, plus bias b: y (m) = scale * K q_i + b.
template <typename T>
void score_row(const Head<T>& h, int64_t i, const T* b, T* y) {
  const T* qi = h.q + i * h.D;
  for (int64_t j = 0; j < h.m; ++j) y[j] = h.scale * dot(qi, h.k + j * h.D, h.D) + (b ? b[j] : T(0));
}

// Robust row step for row i: a_i = -LSE_j y_ij (y = s + b) and, if out != null, out_i = softmax(y) V.
template <typename T>
T robust_row(const Head<T>& h, int64_t i, const T* b, T* out, std::vector<T>& row, const Dropout& drop) {
  row.resize(h.m);
  score_row(h, i, b, row.data());
  const T mx = vmax(row.data(), h.m);
  exp_shift(row.data(), (const T*)nullptr, -mx, h.m);
  const T l = sum(row.data(), h.m);
  if (out) {
    if (drop.on) {
      std::vector<T> z(h.m);
      drop.row(i, 0, h.m, z.data());
      for (int64_t j = 0; j < h.m; ++j) row[j] *= z[j];
    }
    std::fill(out, out + h.Dv, T(0));  // out = (row / l) V
    for (int64_t j = 0; j < h.m; ++j) {
      const T rj = row[j];
      const T* vj = h.v + j * h.Dv;
      for (int64_t d = 0; d < h.Dv; ++d) out[d] += rj * vj[d];
    }
    const T inv = T(1) / l;
    for (int64_t d = 0; d < h.Dv; ++d) out[d] *= inv;
  }
  return -(mx + std::log(l));
}

// Bounds on the scores of the first column step, so that its exponentials need no column maxima. With q_c the
// mean query of chunk c and r_c = |scale| max_{i in c} |q_i - q_c|,
//     s_ij = scale q_c . k_j + scale (q_i - q_c) . k_j <= scale q_c . k_j + r_c |k_j|  =: u_cj
// (Cauchy-Schwarz); the centring keeps the bound tight when the queries share a large common component. The
// rounding of the products may put a score a hair above its bound: harmless, the exponentials are normalized by
// their sums.
template <typename T>
struct ChunkBounds {
  std::vector<T> qbar, radius, knorm, u;  // (chunks, D), (chunks), (m), (chunks, m)
  int64_t m = 0;
  void build(const Head<T>& h, int64_t bq) {
    const int64_t chunks = (h.n + bq - 1) / bq, D = h.D;
    qbar.assign(chunks * D, T(0));
    radius.assign(chunks, T(0));
    knorm.resize(h.m);
    for (int64_t j = 0; j < h.m; ++j) knorm[j] = std::sqrt(dot(h.k + j * D, h.k + j * D, D));
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t i0 = c * bq, rows = std::min(bq, h.n - i0);
      T* qb = qbar.data() + c * D;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t d = 0; d < D; ++d) qb[d] += h.q[(i0 + r) * D + d];
      for (int64_t d = 0; d < D; ++d) qb[d] /= T(rows);
      T rmax = 0;
      for (int64_t r = 0; r < rows; ++r) {
        const T* qi = h.q + (i0 + r) * D;
        T acc = 0;
        for (int64_t d = 0; d < D; ++d) acc += (qi[d] - qb[d]) * (qi[d] - qb[d]);
        rmax = std::max(rmax, acc);
      }
      radius[c] = std::abs(h.scale) * std::sqrt(rmax);
    }
    m = h.m;
    u.resize(chunks * m);
    for (int64_t c = 0; c < chunks; ++c)
      for (int64_t j = 0; j < m; ++j)
        u[c * m + j] = h.scale * dot(qbar.data() + c * D, h.k + j * D, D) + radius[c] * knorm[j];
  }
  // The bounds u_cj of chunk c (m).
  const T* bounds(int64_t c) const { return u.data() + c * m; }
};

// Robust column step for column j (when the bounds were too loose to trust): returns b_j = -LSE_i (s_ij + a_i)
// (a null: 0) from the column's scores S[i * ld] (the strip's GEMM, so that b_j is consistent with the scores
// every other sweep and the backward pass compute), and writes side (n) = exp(s_ij + b_j + alpha_c(i)), the
// column's weights w_ij = exp(s_ij + a_i + b_j) divided by A_i = exp(a_i - alpha_c(i)) (alpha null: 0).
template <typename T>
T robust_column(const Head<T>& h, const T* S, int64_t ld, const T* a, const T* alpha, int64_t bq, T* side,
                std::vector<T>& col) {
  col.resize(2 * h.n);
  T* s = col.data();
  T* y = s + h.n;
  for (int64_t i = 0; i < h.n; ++i) s[i] = S[i * ld];
  for (int64_t i = 0; i < h.n; ++i) y[i] = a ? s[i] + a[i] : s[i];
  const T mx = vmax(y, h.n);
  exp_shift(y, (const T*)nullptr, -mx, h.n);
  const T bj = -(mx + std::log(sum(y, h.n)));
  for (int64_t i = 0; i < h.n; ++i) side[i] = std::exp(s[i] + bj + (alpha ? alpha[i / bq] : T(0)));
  return bj;
}

// Softmax alone (iters = 0): out_i = sum_j pi_ij z_ij v_j with pi_ij = exp(s_ij + a_i), a_i = -LSE_j s_ij, and
// the dropout mask z (all ones without dropout). The cpp_softmax route takes it for attention dropout, which
// PyTorch's fused CPU attention lacks. Each query chunk sweeps the key strips with a running maximum per row
// (as FlashAttention does): when a row's maximum rises, its sum and numerator are rescaled. a (n), out (n, Dv).
template <typename T>
void softmax_forward_head(const Head<T>& h, T* a, T* out, Scratch<T>& w, const Dropout& drop) {
  const int64_t n = h.n, m = h.m, D = h.D, Dv = h.Dv, chunks = (n + w.bq - 1) / w.bq;
  std::fill(out, out + n * Dv, T(0));
  for_chunks(chunks, w, [&](int64_t c, Tiles<T>& tl) {
    const int64_t i0 = c * w.bq, rows = std::min(w.bq, n - i0);
    std::vector<T> mx(rows, -std::numeric_limits<T>::infinity()), l(rows, T(0));
    T* S = tl.tile.data();  // (rows, bc)
    for (int64_t j0 = 0; j0 < m; j0 += kBc) {
      const int64_t bc = std::min(kBc, m - j0);
      mm<T>(false, true, rows, bc, D, h.scale, h.q + i0 * D, D, h.k + j0 * D, D, T(0), S, bc);
      for (int64_t r = 0; r < rows; ++r) {
        T* s = S + r * bc;
        const T top = std::max(mx[r], vmax(s, bc));
        if (top > mx[r] && j0 > 0) {
          const T resc = std::exp(mx[r] - top);
          l[r] *= resc;
          T* o = out + (i0 + r) * Dv;
          for (int64_t d = 0; d < Dv; ++d) o[d] *= resc;
        }
        mx[r] = top;
        l[r] += exp_sum(s, -top, bc);  // the row sums are taken before dropout
        if (drop.on) {
          drop.row(i0 + r, j0, bc, tl.z.data());
          for (int64_t j = 0; j < bc; ++j) s[j] *= tl.z[j];
        }
      }
      mm<T>(false, false, rows, Dv, bc, T(1), S, bc, h.v + j0 * Dv, Dv, T(1), out + i0 * Dv, Dv);
    }
    for (int64_t r = 0; r < rows; ++r) {  // l_r >= 1: the row's maximum contributes exp(0)
      T* o = out + (i0 + r) * Dv;
      const T inv = T(1) / l[r];
      for (int64_t d = 0; d < Dv; ++d) o[d] *= inv;
      a[i0 + r] = -(mx[r] + std::log(l[r]));
    }
  });
}

// Backward of softmax alone: with P = exp(S + a) and delta_i = dO_i . out_i (= sum_j pi_ij z_ij dP_ij),
//     dV = (P * Z)^T dO,   dS = P * (Z * dP - delta),   dQ = scale dS K,   dK = scale dS^T Q,
// per key strip (dK and dV of a strip summed over the threads' partials).
template <typename T>
void softmax_backward_head(const Head<T>& h, const T* dout, const T* out, const T* a, T* dq, T* dk, T* dv,
                           Scratch<T>& w, const Dropout& drop) {
  const int64_t n = h.n, m = h.m, D = h.D, Dv = h.Dv, chunks = (n + w.bq - 1) / w.bq;
  std::fill(dq, dq + n * D, T(0));
  std::fill(dk, dk + m * D, T(0));
  std::fill(dv, dv + m * Dv, T(0));
  std::vector<T> delta(n);
  for (int64_t i = 0; i < n; ++i) delta[i] = dot(dout + i * Dv, out + i * Dv, Dv);
  for (int64_t j0 = 0; j0 < m; j0 += kBc) {
    const int64_t bc = std::min(kBc, m - j0);
    zero_partials(w);
    for_chunks(chunks, w, [&](int64_t c, Tiles<T>& tl) {
      const int64_t i0 = c * w.bq, rows = std::min(w.bq, n - i0);
      T* P = tl.tile.data();    // (rows, bc): P, then P * Z
      T* dS = tl.tile2.data();  // (rows, bc): dP, then dS
      mm<T>(false, true, rows, bc, D, h.scale, h.q + i0 * D, D, h.k + j0 * D, D, T(0), P, bc);
      mm<T>(false, true, rows, bc, Dv, T(1), dout + i0 * Dv, Dv, h.v + j0 * Dv, Dv, T(0), dS, bc);
      for (int64_t r = 0; r < rows; ++r) {
        T* p = P + r * bc;
        T* ds = dS + r * bc;
        exp_shift(p, (const T*)nullptr, a[i0 + r], bc);
        const T di = delta[i0 + r];
        if (drop.on) {
          T* z = tl.z.data();
          drop.row(i0 + r, j0, bc, z);
          for (int64_t j = 0; j < bc; ++j) {
            ds[j] = p[j] * (z[j] * ds[j] - di);
            p[j] *= z[j];
          }
        } else {
          for (int64_t j = 0; j < bc; ++j) ds[j] = p[j] * (ds[j] - di);
        }
      }
      mm<T>(true, false, bc, Dv, rows, T(1), P, bc, dout + i0 * Dv, Dv, T(1), w.part_dv(c), Dv);
      mm<T>(false, false, rows, D, bc, h.scale, dS, bc, h.k + j0 * D, D, T(1), dq + i0 * D, D);
      mm<T>(true, false, bc, D, rows, h.scale, dS, bc, h.q + i0 * D, D, T(1), w.part_dk(c), D);
    });
    add_partials(w, chunks, bc, D, Dv, dk + j0 * D, dv + j0 * Dv);
  }
}

// Forward: a (iters + 1, n), b (iters, m), out (n, Dv); with soft: out_l (n, Dv), a_l (n).
//
// The softmax half (soft) shares the last round's exponentials E_ij = exp(x_ij - m_cj) (x = s + a^{k-1},
// m_cj: the column maximum of x over query chunk c): with R_c the running maximum of x over the chunk,
// exp(x_ij - R_c) = E_ij g_j, g_j = exp(m_cj - R_c) in (0, 1], so one GEMM E [diag(f) V | diag(g) V]
// gives both numerators (a^{k-1}_i is constant along a row and cancels in the softmax). When R_c rises,
// the chunk's softmax sums are rescaled; rows whose softmax sum underflowed (their maximum far below the
// chunk's) are recomputed with their own maximum.
template <typename T>
void forward_head(const Head<T>& h, int64_t iters, T* a, T* b, T* out, T* out_l, T* a_l, Scratch<T>& w,
                  const Dropout& drop, int64_t cache_bytes) {
  if (iters == 0) {
    softmax_forward_head(h, a, out, w, drop);
    return;
  }
  const int64_t n = h.n, m = h.m, Dv = h.Dv;
  w.cache_scores(n, m, iters > 1 ? cache_bytes : 0);
  const T NEG = -std::numeric_limits<T>::infinity();
  const int64_t chunks = (n + w.bq - 1) / w.bq;
  const bool soft = out_l != nullptr;
  std::fill(a, a + n, T(0));  // a^0
  std::vector<T> l(n), ll, acc, bnd, col, side, alpha(chunks), A(n);
  std::vector<int64_t> robust;  // the columns of a strip that took the robust column step
  // Without the softmax half, the first column step takes its exponentials against the chunk bounds u_cj
  // instead of the column maxima (no pass over the scores to find them), and the kept scores are these
  // exponentials (see scaled_round); the softmax half keeps the maxima, which its row sums need.
  ChunkBounds<T> cb;
  const bool keep_exp = !soft;
  if (keep_exp) cb.build(h, w.bq);
  if (soft) {
    ll.assign(n, T(0));
    acc.assign(n * 2 * Dv, T(0));  // (n, 2 Dv): [numerator of out | numerator of out_l]
    std::fill(w.cref.begin(), w.cref.end(), NEG);
  }
  // One strip of a round in the scaling domain. Round 1 forms E_ij = exp(s_ij - u_cj) (u: the chunk bounds) and
  // keeps it within the scores' budget; a later round t reads E back, or recomputes it with the same GEMM and
  // exponential (so the results do not depend on the budget). With alpha_c = max_{i in c} a^{t-1}_i and
  // A_i = exp(a^{t-1}_i - alpha_c) (round 1: 0 and 1),
  //     sum_{i in c} exp(s_ij + a^{t-1}_i) = exp(u_cj + alpha_c) sum_{i in c} A_i E_ij,
  // so a later column step is a weighted sum of kept values, without exponentials. The weights are
  // w_ij = A_i E_ij F_cj with F_cj = exp(u_cj + alpha_c + b^t_j); l_i collects sum_j E_ij F_cj = sum_j w_ij / A_i
  // and the output's numerator E (diag(F) V) (A_i cancels in out_i). A column with a chunk whose
  // u_cj + alpha_c is more than bound_gap above the column's log-sum (terms that matter could have underflowed)
  // takes the robust column step instead (F_cj = 0, its weights added on the side).
  auto scaled_strip = [&](int64_t j0, int64_t bc, int64_t t, bool last) {
    const T* a_prev = a + (t - 1) * n;
    T* X = w.strip1.data();  // (n, bc): the exponentials of strips whose scores are not kept
    for_chunks(chunks, w, [&](int64_t c, Tiles<T>& tl) {
      const int64_t i0 = c * w.bq, rows = std::min(w.bq, n - i0);
      T* Sc = w.cached_scores(j0, i0, bc);
      T* E = Sc ? Sc : X + i0 * bc;  // (rows, bc)
      T* cs = w.csum.data() + c * kBc;
      std::fill(cs, cs + bc, T(0));
      if (t == 1 || !Sc) {
        mm<T>(false, true, rows, bc, h.D, h.scale, h.q + i0 * h.D, h.D, h.k + j0 * h.D, h.D, T(0), E, bc);
        const T* u = cb.bounds(c) + j0;
        T* neg = tl.vec.data();
        for (int64_t j = 0; j < bc; ++j) neg[j] = -u[j];
        T* sums = t == 1 ? cs : tl.sink.data();  // round 1's column sums (A = 1) come with the exponentials
        for (int64_t r = 0; r < rows; ++r) exp_acc(E + r * bc, neg, sums, bc);
      }
      if (t > 1)
        for (int64_t r = 0; r < rows; ++r) {
          const T Ai = A[i0 + r];
          const T* e = E + r * bc;
          for (int64_t j = 0; j < bc; ++j) cs[j] += Ai * e[j];
        }
    });
    // merge the chunks: M_j = max_c (u_cj + alpha_c + log cs_cj), b_j = -(M_j + log z_j); cmax becomes F
    T* bj = b + (t - 1) * m + j0;
    robust.clear();
    for (int64_t j = 0; j < bc; ++j) {
      const T NEG = -std::numeric_limits<T>::infinity();
      T M = NEG;
      for (int64_t c = 0; c < chunks; ++c) {
        const T cs = w.csum[c * kBc + j];
        if (cs > T(0)) M = std::max(M, cb.bounds(c)[j0 + j] + alpha[c] + std::log(cs));
      }
      bool ok = M > NEG;
      for (int64_t c = 0; c < chunks && ok; ++c) ok = cb.bounds(c)[j0 + j] + alpha[c] - M <= bound_gap<T>();
      if (!ok) {
        robust.push_back(j);
        for (int64_t c = 0; c < chunks; ++c) w.cmax[c * kBc + j] = T(0);
        continue;
      }
      for (int64_t c = 0; c < chunks; ++c) w.cmax[c * kBc + j] = cb.bounds(c)[j0 + j] + alpha[c];
      bj[j] = merge_column(w, chunks, j, M);
    }
    if (!robust.empty()) {
      // The strip's scores once more, by the GEMM of every other sweep and of the backward pass: a column's
      // own dot products round otherwise (by up to ~|s| 1e-7), and potentials taken from them disagree with
      // the backward's scores by as much, which at scores of a few hundred cost float32 gradients 5-25x in
      // accuracy.
      T* R = w.strip2.data();  // (n, bc); the forward does not use strip2 otherwise
      for_chunks(chunks, w, [&](int64_t c, Tiles<T>&) {
        const int64_t i0 = c * w.bq, rows = std::min(w.bq, n - i0);
        mm<T>(false, true, rows, bc, h.D, h.scale, h.q + i0 * h.D, h.D, h.k + j0 * h.D, h.D, T(0), R + i0 * bc, bc);
      });
      side.resize(robust.size() * n);
      for (size_t k = 0; k < robust.size(); ++k)
        bj[robust[k]] = robust_column(h, R + robust[k], bc, t > 1 ? a_prev : (const T*)nullptr, alpha.data(),
                                      w.bq, side.data() + k * n, col);
    }
    // pass 2: row sums and, in the last round, the output's numerator
    for_chunks(chunks, w, [&](int64_t c, Tiles<T>& tl) {
      const int64_t i0 = c * w.bq, rows = std::min(w.bq, n - i0);
      T* Sc = w.cached_scores(j0, i0, bc);
      const T* E = Sc ? Sc : X + i0 * bc;
      const T* F = w.cmax.data() + c * kBc;
      const T* vj = h.v + j0 * Dv;
      if (last && drop.on) {  // W = E diag(F) * Z (the row sums before dropout), then out += W V
        T* W = X + i0 * bc;
        for (int64_t r = 0; r < rows; ++r) {
          T* x = W + r * bc;
          const T* e = E + r * bc;
          for (int64_t j = 0; j < bc; ++j) x[j] = e[j] * F[j];
          l[i0 + r] += sum(x, bc);
          drop.row(i0 + r, j0, bc, tl.z.data());
          for (int64_t j = 0; j < bc; ++j) x[j] *= tl.z[j];
        }
        mm<T>(false, false, rows, Dv, bc, T(1), W, bc, vj, Dv, T(1), out + i0 * Dv, Dv);
      } else {
        rows_dot(E, bc, F, bc, rows, l.data() + i0);
        if (last) {
          T* Vf = tl.tile2.data();  // (bc, Dv) = diag(F) V
          for (int64_t j = 0; j < bc; ++j)
            for (int64_t d = 0; d < Dv; ++d) Vf[j * Dv + d] = F[j] * vj[j * Dv + d];
          mm<T>(false, false, rows, Dv, bc, T(1), E, bc, Vf, Dv, T(1), out + i0 * Dv, Dv);
        }
      }
      for (size_t k = 0; k < robust.size(); ++k) {  // the robust columns' weights (divided by A_i)
        const int64_t j = robust[k];
        const T* sd = side.data() + k * n;
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t i = i0 + r;
          l[i] += sd[i];
          if (!last) continue;
          T wt = sd[i];
          if (drop.on) {
            T zz;
            drop.row(i, j0 + j, 1, &zz);
            wt *= zz;
          }
          T* o = out + i * Dv;
          for (int64_t d = 0; d < Dv; ++d) o[d] += wt * vj[j * Dv + d];
        }
      }
    });
  };

  for (int64_t t = 1; t <= iters; ++t) {
    const bool last = t == iters;
    const bool both = last && soft;
    const T* a_prev = a + (t - 1) * n;
    T* a_t = a + t * n;
    T* b_t = b + (t - 1) * m;
    std::fill(l.begin(), l.end(), T(0));
    if (last) std::fill(out, out + n * Dv, T(0));
    // From round 2 on, the column maxima need not be found: with d_i = a^{t-1}_i - a^{t-2}_i,
    // max_i (s_ij + a^{t-1}_i) <= LSE_i (s_ij + a^{t-2}_i) + max d = -b^{t-1}_j + max d, at most
    // log(n) + max d - min d above it; the exponentials are taken against this bound when that gap is small
    // (every term that matters stays far from underflow), else against the maxima.
    const T* bound = nullptr;
    if (t > 1 && !soft) {
      const T* a_pp = a + (t - 2) * n;
      T dmax = -std::numeric_limits<T>::infinity(), dmin = std::numeric_limits<T>::infinity();
      for (int64_t i = 0; i < n; ++i) {
        dmax = std::max(dmax, a_prev[i] - a_pp[i]);
        dmin = std::min(dmin, a_prev[i] - a_pp[i]);
      }
      const T gap = std::log(T(n)) + dmax - dmin;
      if (gap <= bound_gap<T>()) {
        const T* b_pp = b + (t - 2) * m;
        bnd.resize(m);
        for (int64_t j = 0; j < m; ++j) bnd[j] = dmax - b_pp[j];
        bound = bnd.data();
      }
    }
    // The scaling domain (below) needs every A_i far from underflow: the spread of a^{t-1} within each chunk
    // at most bound_gap; else this round takes the log-domain sweep, its scores recomputed.
    bool scaled = keep_exp;
    for (int64_t c = 0; c < chunks && keep_exp; ++c) {
      const int64_t i0 = c * w.bq, rows = std::min(w.bq, n - i0);
      if (t == 1) {
        alpha[c] = T(0);
        std::fill(A.begin() + i0, A.begin() + i0 + rows, T(1));
        continue;
      }
      const T hi = vmax(a_prev + i0, rows);
      T lo = hi;
      for (int64_t r = 0; r < rows; ++r) lo = std::min(lo, a_prev[i0 + r]);
      scaled = scaled && hi - lo <= bound_gap<T>();
      alpha[c] = hi;
      for (int64_t r = 0; r < rows; ++r) A[i0 + r] = std::exp(a_prev[i0 + r] - hi);
    }
    for (int64_t j0 = 0; j0 < m && scaled; j0 += kBc)
      scaled_strip(j0, std::min(kBc, m - j0), t, last);
    for (int64_t j0 = 0; j0 < m && !scaled; j0 += kBc) {
      const int64_t bc = std::min(kBc, m - j0);
      T* X = w.strip1.data();  // (n, bc)
      // pass 1: scores, per-chunk column statistics (and, for the softmax half, g)
      for_chunks(chunks, w, [&](int64_t c, Tiles<T>& tl) {
        const int64_t i0 = c * w.bq, rows = std::min(w.bq, n - i0);
        T* Xc = X + i0 * bc;
        // kept scores (computed in round 1), or null: X = s + a^{t-1}
        T* Sc = keep_exp ? nullptr : w.cached_scores(j0, i0, bc);
        if (!Sc || t == 1)
          mm<T>(false, true, rows, bc, h.D, h.scale, h.q + i0 * h.D, h.D, h.k + j0 * h.D, h.D, T(0), Sc ? Sc : Xc,
                bc);
        T* cm = w.cmax.data() + c * kBc;
        T* cs = w.csum.data() + c * kBc;
        if (bound)
          std::copy(bound + j0, bound + j0 + bc, cm);
        else
          std::fill(cm, cm + bc, NEG);
        std::fill(cs, cs + bc, T(0));
        for (int64_t r = 0; r < rows && !(Sc && bound); ++r) {
          const T ai = t > 1 ? a_prev[i0 + r] : T(0);
          if (Sc) {  // X is formed by the exponential below
            const T* sr = Sc + r * bc;
            for (int64_t j = 0; j < bc; ++j) cm[j] = std::max(cm[j], sr[j] + ai);
            continue;
          }
          T* x = Xc + r * bc;
          if (t > 1)
            for (int64_t j = 0; j < bc; ++j) x[j] += ai;
          if (!bound)
            for (int64_t j = 0; j < bc; ++j) cm[j] = std::max(cm[j], x[j]);
        }
        if (both) {  // g_j = exp(m_cj - R_c); rescale the chunk's softmax numerators when R_c rises
          const T r_old = w.cref[c], r_new = std::max(r_old, vmax(cm, bc));
          if (r_new > r_old && r_old != NEG) {
            const T resc = std::exp(r_old - r_new);
            for (int64_t r = 0; r < rows; ++r) {
              ll[i0 + r] *= resc;
              T* o = acc.data() + (i0 + r) * 2 * Dv + Dv;
              for (int64_t d = 0; d < Dv; ++d) o[d] *= resc;
            }
          }
          w.cref[c] = r_new;
          T* g = w.cg.data() + c * kBc;
          for (int64_t j = 0; j < bc; ++j) g[j] = cm[j] == NEG ? T(0) : std::exp(cm[j] - r_new);
        }
        T* neg = tl.vec.data();  // -cm, as the shift of the exponent
        for (int64_t j = 0; j < bc; ++j) neg[j] = -cm[j];
        for (int64_t r = 0; r < rows; ++r) {
          if (Sc)
            exp_acc_from(Xc + r * bc, Sc + r * bc, t > 1 ? a_prev[i0 + r] : T(0), neg, cs, bc);
          else
            exp_acc(Xc + r * bc, neg, cs, bc);
        }
      });
      // merge the chunks: b_j = -LSE_i x_ij; cmax becomes the factor exp(m_c - M_j) / z_j
      T* bj = b_t + j0;
      for (int64_t j = 0; j < bc; ++j) {
        T M = NEG;
        for (int64_t c = 0; c < chunks; ++c) M = std::max(M, w.cmax[c * kBc + j]);
        bj[j] = merge_column(w, chunks, j, M);
      }
      // pass 2: column-normalized weights, row sums, output
      for_chunks(chunks, w, [&](int64_t c, Tiles<T>& tl) {
        const int64_t i0 = c * w.bq, rows = std::min(w.bq, n - i0);
        T* Xc = X + i0 * bc;
        const T* f = w.cmax.data() + c * kBc;
        if (both) {
          // row sums of E diag(f) and E diag(g) before dropout; then acc += (E * Z) [diag(f) V | diag(g) V]
          const T* g = w.cg.data() + c * kBc;
          rows_dot(Xc, bc, f, bc, rows, l.data() + i0);
          rows_dot(Xc, bc, g, bc, rows, ll.data() + i0);
          for (int64_t r = 0; r < rows && drop.on; ++r) {
            T* x = Xc + r * bc;
            drop.row(i0 + r, j0, bc, tl.z.data());
            for (int64_t j = 0; j < bc; ++j) x[j] *= tl.z[j];
          }
          T* Vc = tl.vcat.data();  // (bc, 2 Dv)
          const T* vj = h.v + j0 * Dv;
          for (int64_t j = 0; j < bc; ++j)
            for (int64_t d = 0; d < Dv; ++d) {
              Vc[j * 2 * Dv + d] = f[j] * vj[j * Dv + d];
              Vc[j * 2 * Dv + Dv + d] = g[j] * vj[j * Dv + d];
            }
          mm<T>(false, false, rows, 2 * Dv, bc, T(1), Xc, bc, Vc, 2 * Dv, T(1), acc.data() + i0 * 2 * Dv, 2 * Dv);
          return;
        }
        if (!(last && drop.on) && Dv <= w.bq) {
          // w = X diag(f) is never written: l += X f, and the last round's output takes X (diag(f) V)
          rows_dot(Xc, bc, f, bc, rows, l.data() + i0);
          if (last) {
            T* Vf = tl.tile2.data();  // (bc, Dv)
            const T* vj = h.v + j0 * Dv;
            for (int64_t j = 0; j < bc; ++j)
              for (int64_t d = 0; d < Dv; ++d) Vf[j * Dv + d] = f[j] * vj[j * Dv + d];
            mm<T>(false, false, rows, Dv, bc, T(1), Xc, bc, Vf, Dv, T(1), out + i0 * Dv, Dv);
          }
          return;
        }
        for (int64_t r = 0; r < rows; ++r) {
          T* x = Xc + r * bc;
          for (int64_t j = 0; j < bc; ++j) x[j] *= f[j];
          l[i0 + r] += sum(x, bc);
          if (last && drop.on) {  // the row sums above are taken before dropout
            drop.row(i0 + r, j0, bc, tl.z.data());
            for (int64_t j = 0; j < bc; ++j) x[j] *= tl.z[j];
          }
        }
        if (last) mm<T>(false, false, rows, Dv, bc, T(1), Xc, bc, h.v + j0 * Dv, Dv, T(1), out + i0 * Dv, Dv);
      });
    }
    if (both) {  // the numerators of out and out_l (the robust rows below overwrite theirs)
      for (int64_t i = 0; i < n; ++i) {
        std::copy(acc.data() + i * 2 * Dv, acc.data() + i * 2 * Dv + Dv, out + i * Dv);
        std::copy(acc.data() + i * 2 * Dv + Dv, acc.data() + (i + 1) * 2 * Dv, out_l + i * Dv);
      }
    }
    // row step: a^t = a^{t-1} - log(sum_j w_ij); rows whose weights underflowed get a running maximum. In the
    // scaling domain l_i holds sum_j w_ij / A_i, and a^t_i = alpha_c - log(l_i).
    const T small = tiny<T>();
    for (int64_t i = 0; i < n; ++i) {
      if ((scaled ? A[i] * l[i] : l[i]) >= small) {
        a_t[i] = scaled ? alpha[i / w.bq] - std::log(l[i]) : a_prev[i] - std::log(l[i]);
        if (last) {
          T* o = out + i * Dv;
          const T inv = T(1) / l[i];
          for (int64_t d = 0; d < Dv; ++d) o[d] *= inv;
        }
      } else {
        a_t[i] = robust_row(h, i, b_t, last ? out + i * Dv : (T*)nullptr, w.tiles[0].row, drop);
      }
    }
  }
  if (soft) {  // softmax half: a_l_i = -LSE_j s_ij = a^{k-1}_i - R_c - log(ll_i)
    const T small = tiny<T>();
    const T* a_prev = a + (iters - 1) * n;
    for (int64_t i = 0; i < n; ++i) {
      T* o = out_l + i * Dv;
      if (ll[i] >= small) {
        const T inv = T(1) / ll[i];
        for (int64_t d = 0; d < Dv; ++d) o[d] *= inv;
        a_l[i] = a_prev[i] - w.cref[i / w.bq] - std::log(ll[i]);
      } else {
        a_l[i] = robust_row(h, i, (const T*)nullptr, o, w.tiles[0].row, drop);
      }
    }
  }
}

// The column gradient g of a strip: the sum of the per-chunk partial sums kept in w.csum.
template <typename T>
const T* strip_gradient(Scratch<T>& w, int64_t chunks, int64_t bc) {
  T* g = w.gb.data();
  std::fill(g, g + bc, T(0));
  for (int64_t c = 0; c < chunks; ++c)
    for (int64_t j = 0; j < bc; ++j) g[j] += w.csum[c * kBc + j];
  return g;
}

// Second pass of a backward strip: dS -= Q_col * g; grad_a -= Q_col g; dQ += dS K; then dK (and the dV
// that the first pass left in the threads' partials) of the strip's keys.
template <typename T>
void finish_strip(const Head<T>& h, int64_t j0, int64_t bc, T* grad_a, T* dq, T* dk, T* dv, Scratch<T>& w) {
  const int64_t n = h.n, chunks = (n + w.bq - 1) / w.bq;
  const T* g = strip_gradient(w, chunks, bc);
  for_chunks(chunks, w, [&](int64_t c, Tiles<T>& tl) {
    const int64_t i0 = c * w.bq, rows = std::min(w.bq, n - i0);
    T* dS = w.strip1.data() + i0 * bc;
    const T* Qc = w.strip2.data() + i0 * bc;
    for (int64_t r = 0; r < rows; ++r) {
      T* d = dS + r * bc;
      const T* qc = Qc + r * bc;
      if (grad_a) grad_a[i0 + r] -= dot(qc, g, bc);
      for (int64_t j = 0; j < bc; ++j) d[j] -= qc[j] * g[j];
    }
    mm<T>(false, false, rows, h.D, bc, h.scale, dS, bc, h.k + j0 * h.D, h.D, T(1), dq + i0 * h.D, h.D);
    mm<T>(true, false, bc, h.D, rows, h.scale, dS, bc, h.q + i0 * h.D, h.D, T(1), w.part_dk(c), h.D);
  });
  add_partials(w, chunks, bc, h.D, h.Dv, dk + j0 * h.D, dv ? dv + j0 * h.Dv : (T*)nullptr);
}

// Backward of one head. dout (n, Dv); u: weight of the mechanism's half (1 without hybrid); out_l/a_l:
// the softmax half (null without hybrid). Writes dq (n, D), dk (m, D), dv (m, Dv).
//
// With S the scores, P^t_ij = exp(s_ij + b^t_j + a^t_i) the row-normalized weights of round t and
// C^t_ij = P^t_ij exp(a^{t-1}_i - a^t_i) its column-normalized ones, the gradient of the scores is
//
//     dS = u P^k (dP - delta) [+ (1 - u) softmax half] - sum_{t<k} P^t gr^t_i - sum_t C^t gb^t_j,
//
// where gb^t (m) and gr^t (n) are the gradients of b^t and a^t: gb^t_j = sum_i (round t's row term)_ij,
// a column sum complete within a strip, and gr^{t-1}_i = -sum_j C^t_ij gb^t_j, a row sum complete after a
// sweep. With k > 1 rounds, sweeps of rounds k .. 2 first find these vectors (no dQ, dK, dV), and one
// last sweep forms dS of all rounds together, so that dQ += dS K and dK += dS^T Q are computed once.
template <typename T>
void backward_head(const Head<T>& h, int64_t iters, const T* dout, const T* out, const T* a, const T* b,
                   const T* out_l, const T* a_l, T u, T* dq, T* dk, T* dv, Scratch<T>& w, const Dropout& drop,
                   int64_t cache_bytes) {
  if (iters == 0) {
    softmax_backward_head(h, dout, out, a, dq, dk, dv, w, drop);
    return;
  }
  const int64_t n = h.n, m = h.m, D = h.D, Dv = h.Dv;
  const int64_t chunks = (n + w.bq - 1) / w.bq;
  w.cache_scores(n, m, iters > 1 ? cache_bytes : 0);  // kept by the first sweep for the later ones
  std::fill(dq, dq + n * D, T(0));
  std::fill(dk, dk + m * D, T(0));
  std::fill(dv, dv + m * Dv, T(0));
  std::vector<T> delta(n), delta_l(out_l ? n : 0);
  for (int64_t i = 0; i < n; ++i) {
    delta[i] = dot(dout + i * Dv, out + i * Dv, Dv);
    if (out_l) delta_l[i] = dot(dout + i * Dv, out_l + i * Dv, Dv);
  }
  // r_col^t_i = exp(a^{t-1}_i - a^t_i): row sum of round t's column weights (C^t = P^t r_col^t)
  std::vector<T> r_col(iters * n);
  for (int64_t t = 1; t <= iters; ++t)
    for (int64_t i = 0; i < n; ++i) r_col[(t - 1) * n + i] = std::exp(a[(t - 1) * n + i] - a[t * n + i]);
  std::vector<T> gb(iters > 1 ? iters * m : 0), gr(iters > 1 ? iters * n : 0);  // gb^t at (t-1) m, gr^t at t n
  const T* a_k = a + iters * n;
  const T* b_k = b + (iters - 1) * m;
  const T* rc_k = r_col.data() + (iters - 1) * n;
  // The softmax half's weights from the mechanism's: PL_ij = exp(s_ij + a_l_i) = P_ij rho_i kappa_j with
  // rho_i = exp(a_l_i - a^k_i - r), kappa_j = exp(r - b^k_j), r = max_i (a_l_i - a^k_i): a product instead of an
  // exponential, taken when every rho_i kappa_j is at most e^bound_gap (then P_ij stays clear of underflow
  // wherever PL_ij matters); else both are exponentials.
  std::vector<T> rho, kappa;
  if (out_l) {
    T r = -std::numeric_limits<T>::infinity(), c = r;
    for (int64_t i = 0; i < n; ++i) r = std::max(r, a_l[i] - a_k[i]);
    for (int64_t j = 0; j < m; ++j) c = std::max(c, -b_k[j]);
    if (r + c <= bound_gap<T>()) {
      rho.resize(n);
      kappa.resize(m);
      for (int64_t i = 0; i < n; ++i) rho[i] = std::exp(a_l[i] - a_k[i] - r);
      for (int64_t j = 0; j < m; ++j) kappa[j] = std::exp(r - b_k[j]);
    }
  }
  const bool derive_pl = !rho.empty();
  // Sinkhorn without the softmax half runs in the scaling domain, as its forward does: the sweeps keep (or
  // recompute alike) E = exp(S - U) (U: the chunk bounds) instead of the scores, and round t's weights are the
  // products P^t_ij = E_ij A^t_i F^t_cj, A^t_i = exp(a^t_i - alpha^t_c), F^t_cj = exp(u_cj + alpha^t_c + b^t_j)
  // (alpha^t_c: the chunk's largest a^t), not new exponentials. Taken for the whole head when every round's a^t
  // spreads over at most bound_gap within each chunk and every F^t is at most e^bound_gap (then no E_ij that
  // underflowed could have mattered); else the sweeps take exponentials of the scores.
  ChunkBounds<T> cb;
  std::vector<T> A_t, F_t;  // (iters, n), (iters, chunks, m)
  bool scaled = iters > 1 && !out_l;
  if (scaled) {
    cb.build(h, w.bq);
    A_t.resize(iters * n);
    F_t.resize(iters * chunks * m);
    for (int64_t t = 1; t <= iters && scaled; ++t) {
      const T* at = a + t * n;
      const T* bt = b + (t - 1) * m;
      for (int64_t c = 0; c < chunks && scaled; ++c) {
        const int64_t i0 = c * w.bq, rows = std::min(w.bq, n - i0);
        const T hi = vmax(at + i0, rows);
        T lo = hi;
        for (int64_t r = 0; r < rows; ++r) {
          lo = std::min(lo, at[i0 + r]);
          A_t[(t - 1) * n + i0 + r] = std::exp(at[i0 + r] - hi);
        }
        scaled = hi - lo <= bound_gap<T>();
        const T* uc = cb.bounds(c);
        T* F = F_t.data() + ((t - 1) * chunks + c) * m;
        for (int64_t j = 0; j < m; ++j) {
          const T x = uc[j] + hi + bt[j];
          scaled = scaled && x <= bound_gap<T>();
          F[j] = std::exp(x);
        }
      }
    }
  }

  // The scores (scaled: E) of rows i0.. of strip j0: kept ones (computed here when `fresh`), else computed into
  // `into`.
  auto scores = [&](Tiles<T>& tl, int64_t j0, int64_t i0, int64_t rows, int64_t bc, bool fresh,
                    T* into) -> const T* {
    T* S = w.cached_scores(j0, i0, bc);
    if (S && !fresh) return S;
    if (!S) S = into;
    mm<T>(false, true, rows, bc, D, h.scale, h.q + i0 * D, D, h.k + j0 * D, D, T(0), S, bc);
    if (scaled) {
      const T* uc = cb.bounds(i0 / w.bq) + j0;
      T* neg = tl.vec.data();
      for (int64_t j = 0; j < bc; ++j) neg[j] = -uc[j];
      for (int64_t r = 0; r < rows; ++r) exp_acc(S + r * bc, neg, tl.sink.data(), bc);
    }
    return S;
  };
  // p (bc) = round t's weights P^t of (compacted) row i on the keys of strip j0, from that row of `scores`.
  auto weights = [&](T* p, const T* s, int64_t t, int64_t i, int64_t j0, int64_t bc) {
    if (!scaled) {
      exp_to(p, s, b + (t - 1) * m + j0, a[t * n + i], bc);
      return;
    }
    const T ai = A_t[(t - 1) * n + i];
    const T* F = F_t.data() + ((t - 1) * chunks + i / w.bq) * m + j0;
    for (int64_t j = 0; j < bc; ++j) p[j] = s[j] * (ai * F[j]);
  };
  // The output's own step for chunk c of strip j0: P = P^k (in strip2), dS = the output's part of the score
  // gradient (in strip1) and its column sums (csum of c); with dv_too, dV += W^T dO. P becomes C^k.
  auto output_step = [&](int64_t c, Tiles<T>& tl, int64_t j0, int64_t bc, bool fresh, bool dv_too) {
    const int64_t i0 = c * w.bq, rows = std::min(w.bq, n - i0);
    T* g = w.csum.data() + c * kBc;  // this chunk's part of the column gradient
    std::fill(g, g + bc, T(0));
    T* P = w.strip2.data() + i0 * bc;  // (rows, bc)
    T* dS = w.strip1.data() + i0 * bc;
    T* dP = tl.tile.data();
    T* PL = tl.tile2.data();
    const T* S = scores(tl, j0, i0, rows, bc, fresh, iters > 1 ? tl.tile3.data() : P);
    mm<T>(false, true, rows, bc, Dv, T(1), dout + i0 * Dv, Dv, h.v + j0 * Dv, Dv, T(0), dP, bc);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = i0 + r;
      T* p = P + r * bc;
      T* dp = dP + r * bc;
      T* ds = dS + r * bc;
      if (out_l && !derive_pl) exp_to(PL + r * bc, S + r * bc, (const T*)nullptr, a_l[i], bc);
      weights(p, S + r * bc, iters, i, j0, bc);
      if (derive_pl) {
        T* pl = PL + r * bc;
        const T* kp = kappa.data() + j0;
        const T ri = rho[i];
        for (int64_t j = 0; j < bc; ++j) pl[j] = p[j] * (ri * kp[j]);
      }
      T* z = tl.z.data();
      if (drop.on) {  // d out / d pi_ij = z_ij v_j
        drop.row(i, j0, bc, z);
        for (int64_t j = 0; j < bc; ++j) dp[j] *= z[j];
      }
      const T di = delta[i];
      for (int64_t j = 0; j < bc; ++j) {
        ds[j] = u * p[j] * (dp[j] - di);
        g[j] += ds[j];
      }
      if (out_l) {
        const T* pl = PL + r * bc;
        const T dl = delta_l[i], ul = T(1) - u;
        for (int64_t j = 0; j < bc; ++j) {
          ds[j] += ul * pl[j] * (dp[j] - dl);
          dp[j] = u * p[j] + ul * pl[j];  // the hybrid weights, for dV
        }
        if (drop.on)
          for (int64_t j = 0; j < bc; ++j) dp[j] *= z[j];
      } else if (drop.on) {
        for (int64_t j = 0; j < bc; ++j) dp[j] = p[j] * z[j];  // the dropped weights, for dV
      }
    }
    if (dv_too) {
      const T* W = (out_l || drop.on) ? dP : P;
      mm<T>(true, false, bc, Dv, rows, out_l ? T(1) : u, W, bc, dout + i0 * Dv, Dv, T(1), w.part_dv(c), Dv);
    }
    for (int64_t r = 0; r < rows; ++r) {  // P -> column weights of the last column step
      T* p = P + r * bc;
      const T rc = rc_k[i0 + r];
      for (int64_t j = 0; j < bc; ++j) p[j] *= rc;
    }
  };

  if (iters == 1) {  // DNAS, HNAS: one sweep
    for (int64_t j0 = 0; j0 < m; j0 += kBc) {
      const int64_t bc = std::min(kBc, m - j0);
      zero_partials(w);
      for_chunks(chunks, w, [&](int64_t c, Tiles<T>& tl) { output_step(c, tl, j0, bc, true, true); });
      finish_strip(h, j0, bc, (T*)nullptr, dq, dk, dv, w);
    }
    return;
  }

  // Round k without the softmax half: dV = u (P^k * Z)^T dO is complete per strip, and so is
  // gb^k_j = u sum_i P^k_ij (dP_ij - delta_i) = v_j . dV_j - u sum_i P^k_ij delta_i, without dP = dO V^T.
  const bool dv_first = out_l == nullptr;
  if (dv_first) {
    T* gb_k = gb.data() + (iters - 1) * m;
    T* gr_prev = gr.data() + (iters - 1) * n;
    for (int64_t j0 = 0; j0 < m; j0 += kBc) {
      const int64_t bc = std::min(kBc, m - j0);
      zero_partials(w);
      for_chunks(chunks, w, [&](int64_t c, Tiles<T>& tl) {
        const int64_t i0 = c * w.bq, rows = std::min(w.bq, n - i0);
        T* g = w.csum.data() + c * kBc;  // sum_i P_ij delta_i over the chunk
        std::fill(g, g + bc, T(0));
        T* P = w.strip2.data() + i0 * bc;
        T* W = drop.on ? tl.tile.data() : P;  // the weights that multiply dO
        const T* S = scores(tl, j0, i0, rows, bc, true, tl.tile3.data());
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t i = i0 + r;
          T* p = P + r * bc;
          weights(p, S + r * bc, iters, i, j0, bc);
          const T di = delta[i];
          for (int64_t j = 0; j < bc; ++j) g[j] += p[j] * di;
          if (drop.on) {
            T* z = tl.z.data();
            drop.row(i, j0, bc, z);
            T* wr = W + r * bc;
            for (int64_t j = 0; j < bc; ++j) wr[j] = p[j] * z[j];
          }
        }
        mm<T>(true, false, bc, Dv, rows, u, W, bc, dout + i0 * Dv, Dv, T(1), w.part_dv(c), Dv);
        for (int64_t r = 0; r < rows; ++r) {  // P -> C^k
          T* p = P + r * bc;
          const T rc = rc_k[i0 + r];
          for (int64_t j = 0; j < bc; ++j) p[j] *= rc;
        }
      });
      add_partials(w, chunks, bc, D, Dv, dk + j0 * D, dv + j0 * Dv);  // dK's partials are zero here
      const T* pd = strip_gradient(w, chunks, bc);
      for (int64_t j = 0; j < bc; ++j)
        gb_k[j0 + j] = dot(h.v + (j0 + j) * Dv, dv + (j0 + j) * Dv, Dv) - u * pd[j];
      const T* g = gb_k + j0;
      for_chunks(chunks, w, [&](int64_t c, Tiles<T>&) {
        const int64_t i0 = c * w.bq, rows = std::min(w.bq, n - i0);
        const T* C = w.strip2.data() + i0 * bc;
        for (int64_t r = 0; r < rows; ++r) gr_prev[i0 + r] -= dot(C + r * bc, g, bc);
      });
    }
  }

  // Sweeps of rounds k .. 2: gb^t (complete per strip), then gr^{t-1} -= C^t gb^t. C^t is kept in strip2.
  for (int64_t t = dv_first ? iters - 1 : iters; t >= 2; --t) {
    const T* rc = r_col.data() + (t - 1) * n;
    const T* gr_t = gr.data() + t * n;
    T* gb_t = gb.data() + (t - 1) * m;
    T* gr_prev = gr.data() + (t - 1) * n;
    for (int64_t j0 = 0; j0 < m; j0 += kBc) {
      const int64_t bc = std::min(kBc, m - j0);
      for_chunks(chunks, w, [&](int64_t c, Tiles<T>& tl) {
        if (t == iters) {
          output_step(c, tl, j0, bc, true, false);
          return;
        }
        const int64_t i0 = c * w.bq, rows = std::min(w.bq, n - i0);
        T* g = w.csum.data() + c * kBc;
        std::fill(g, g + bc, T(0));
        T* P = w.strip2.data() + i0 * bc;
        const T* S = scores(tl, j0, i0, rows, bc, false, P);
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t i = i0 + r;
          T* p = P + r * bc;
          weights(p, S + r * bc, t, i, j0, bc);  // P^t
          const T gri = gr_t[i], rci = rc[i];
          for (int64_t j = 0; j < bc; ++j) {
            g[j] -= p[j] * gri;
            p[j] *= rci;
          }
        }
      });
      const T* g = strip_gradient(w, chunks, bc);
      std::copy(g, g + bc, gb_t + j0);
      for_chunks(chunks, w, [&](int64_t c, Tiles<T>&) {
        const int64_t i0 = c * w.bq, rows = std::min(w.bq, n - i0);
        const T* C = w.strip2.data() + i0 * bc;
        for (int64_t r = 0; r < rows; ++r) gr_prev[i0 + r] -= dot(C + r * bc, g, bc);
      });
    }
  }

  // The last sweep: dS of every round, with round 1's column term (gb^1, complete per strip) in finish_strip.
  for (int64_t j0 = 0; j0 < m; j0 += kBc) {
    const int64_t bc = std::min(kBc, m - j0);
    zero_partials(w);
    for_chunks(chunks, w, [&](int64_t c, Tiles<T>& tl) {
      output_step(c, tl, j0, bc, false, !dv_first);  // dS = the output's part, P = C^k
      const int64_t i0 = c * w.bq, rows = std::min(w.bq, n - i0);
      T* g = w.csum.data() + c * kBc;  // now: round 1's column gradient
      std::fill(g, g + bc, T(0));
      T* P = w.strip2.data() + i0 * bc;
      T* dS = w.strip1.data() + i0 * bc;
      const T* S = w.cached_scores(j0, i0, bc);
      if (!S) S = tl.tile3.data();  // where output_step computed them
      T* q = tl.row.data();
      const T* gbk = gb.data() + (iters - 1) * m + j0;
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = i0 + r;
        T* ds = dS + r * bc;
        T* p = P + r * bc;
        for (int64_t j = 0; j < bc; ++j) ds[j] -= p[j] * gbk[j];
        for (int64_t t = iters - 1; t >= 1; --t) {
          weights(q, S + r * bc, t, i, j0, bc);  // P^t
          const T gri = gr[t * n + i], rci = r_col[(t - 1) * n + i];
          if (t > 1) {
            const T* gbt = gb.data() + (t - 1) * m + j0;
            for (int64_t j = 0; j < bc; ++j) ds[j] -= q[j] * (gri + rci * gbt[j]);
          } else {
            for (int64_t j = 0; j < bc; ++j) {
              const T d = -q[j] * gri;
              ds[j] += d;
              g[j] += d;
              p[j] = q[j] * rci;  // C^1, for finish_strip
            }
          }
        }
      }
    });
    finish_strip(h, j0, bc, (T*)nullptr, dq, dk, dv, w);
  }
}

// ---------------------------------------------------------------------------------------------------
// Padding: gather the valid rows of one (batch, head), scatter the results back.

std::vector<int64_t> valid_index(const at::Tensor& mask, int64_t b, int64_t L) {
  std::vector<int64_t> idx;
  if (!mask.defined()) {
    idx.resize(L);
    for (int64_t i = 0; i < L; ++i) idx[i] = i;
    return idx;
  }
  const bool* p = mask.data_ptr<bool>() + b * L;
  for (int64_t i = 0; i < L; ++i)
    if (p[i]) idx.push_back(i);
  return idx;
}

template <typename T>
const T* gather(const T* src, const std::vector<int64_t>& idx, int64_t L, int64_t width, std::vector<T>& buf) {
  if ((int64_t)idx.size() == L) return src;
  buf.resize(idx.size() * width);
  for (size_t r = 0; r < idx.size(); ++r) std::copy(src + idx[r] * width, src + (idx[r] + 1) * width, &buf[r * width]);
  return buf.data();
}

// dst (L, width): rows idx[r] (ascending) = src rows r, the other rows 0. Every row is written, so the outputs
// are allocated uninitialised (zero-filling them first cost a pass over each, plus its page faults).
template <typename T>
void scatter(const T* src, const std::vector<int64_t>& idx, int64_t L, int64_t width, T* dst) {
  int64_t next = 0;  // the first row not yet written
  for (size_t r = 0; r < idx.size(); ++r) {
    std::fill(dst + next * width, dst + idx[r] * width, T(0));
    std::copy(src + r * width, src + (r + 1) * width, dst + idx[r] * width);
    next = idx[r] + 1;
  }
  std::fill(dst + next * width, dst + L * width, T(0));
}

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const c10::optional<at::Tensor>& km,
                  const c10::optional<at::Tensor>& qm, int64_t heads) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "CPU tensors expected");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be (B*H, L, D)");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(), "q, k, v dtypes differ");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble, "float32 or float64 expected");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(), "contiguous q, k, v expected");
  TORCH_CHECK(q.size(0) == k.size(0) && k.size(0) == v.size(0) && k.size(1) == v.size(1), "shape mismatch");
  TORCH_CHECK(q.size(2) == k.size(2), "q and k head sizes differ");
  TORCH_CHECK(heads >= 1 && q.size(0) % heads == 0, "heads must divide B*H");
  const int64_t B = q.size(0) / heads;
  if (km.has_value()) {
    TORCH_CHECK(km->scalar_type() == at::kBool && km->is_contiguous() && km->dim() == 2 && km->size(0) == B &&
                    km->size(1) == k.size(1),
                "key_valid must be a contiguous bool (B, Lk) tensor");
  }
  if (qm.has_value()) {
    TORCH_CHECK(qm->scalar_type() == at::kBool && qm->is_contiguous() && qm->dim() == 2 && qm->size(0) == B &&
                    qm->size(1) == q.size(1),
                "query_valid must be a contiguous bool (B, Lq) tensor");
  }
  TORCH_CHECK(q.size(1) < (1LL << 31) / kBc && k.size(1) < (1LL << 31), "sequence too long for 32-bit BLAS");
}


// body(problems, inner) for every (batch, head) problem. With fewer problems than threads, each problem's
// query chunks are spread over the threads (inner). Else the problems are dealt to the threads by work
// (balanced_schedule), and two kinds run afterwards, one at a time with their chunks spread over the threads
// (when each has the rows for a chunk of kMinSplitRows per thread):
//  - those for which shared(n, m) holds: Sinkhorn's, whose kept scores need more than a worker's share of the
//    budget, so that each has the whole budget (8 heads at L = 4096 on 2 threads: all of every head's scores
//    kept instead of half, forward 1.9x -> 1.4x SDPA);
//  - when the thread count does not divide the number of the others, the cheapest `mod threads` of them, which
//    would keep a few threads busy while the rest wait (3 heads on 2 threads: 2 problems' time instead of 1.5).
constexpr int64_t kMinSplitRows = 128;

template <typename F, typename S>
void run_balanced(const at::Tensor& km, const at::Tensor& qm, int64_t BH, int64_t heads, int64_t Lq, int64_t Lk,
                  const S& shared, const F& body) {
  const int64_t threads = at::get_num_threads();
  std::vector<int64_t> all(BH);
  for (int64_t bh = 0; bh < BH; ++bh) all[bh] = bh;
  if (threads == 1 || BH < threads) {
    body(all, threads > 1);
    return;
  }
  auto valid = [](const at::Tensor& mask, int64_t b, int64_t L) {
    return mask.defined() ? (int64_t)std::count(mask.data_ptr<bool>() + b * L, mask.data_ptr<bool>() + (b + 1) * L, true)
                          : L;
  };
  auto splits = [&](int64_t bh) { return valid(qm, bh / heads, Lq) >= kMinSplitRows * threads; };
  std::vector<int64_t> dealt, tail;
  for (const int64_t bh : all) {
    const bool big = splits(bh) && shared(valid(qm, bh / heads, Lq), valid(km, bh / heads, Lk));
    (big ? tail : dealt).push_back(bh);
  }
  if (const int64_t r = (int64_t)dealt.size() % threads) {
    const auto cost = problem_costs(km, qm, heads, Lq, Lk, dealt);
    std::vector<int64_t> order(dealt.size());  // positions in dealt, cheapest first
    for (size_t x = 0; x < order.size(); ++x) order[x] = x;
    std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return cost[x] < cost[y]; });
    std::vector<int64_t> rest(order.begin(), order.begin() + r);
    if (std::all_of(rest.begin(), rest.end(), [&](int64_t x) { return splits(dealt[x]); })) {
      std::vector<bool> out(dealt.size(), false);
      for (const int64_t x : rest) {
        out[x] = true;
        tail.push_back(dealt[x]);
      }
      std::vector<int64_t> kept;
      for (size_t x = 0; x < dealt.size(); ++x)
        if (!out[x]) kept.push_back(dealt[x]);
      dealt.swap(kept);
    }
  }
  std::sort(tail.begin(), tail.end());
  if (!dealt.empty()) {
    const auto lists = balanced_schedule(km, qm, dealt, heads, Lq, Lk, threads);
    at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) body(lists[t], false);
    });
  }
  if (!tail.empty()) body(tail, true);
}

// Whether a problem of n queries and m keys keeps more of Sinkhorn's scores with the whole budget than with a
// worker's share of it (see run_balanced).
template <typename T>
auto needs_shared_budget(int64_t iters, int64_t cache_bytes) {
  const int64_t threads = at::get_num_threads();
  return [=](int64_t n, int64_t m) {
    return iters > 1 && Scratch<T>::strips_kept(n, m, cache_bytes / threads) < Scratch<T>::strips_kept(n, m, cache_bytes);
  };
}

void check_dropout(double p, const at::Tensor& q, const at::Tensor& k) {
  TORCH_CHECK(p >= 0.0 && p < 1.0, "dropout_p must be in [0, 1)");
  TORCH_CHECK(p == 0.0 || (q.size(0) < (1LL << 31) && q.size(1) < (1LL << 32) && k.size(1) < (1LL << 34)),
              "too many heads or positions for the dropout hash");
}

template <typename T>
void forward_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& km,
                  const at::Tensor& qm, int64_t heads, double scale, int64_t iters, bool soft, const Dropout& dropout,
                  int64_t cache_bytes, int64_t chunk_rows, at::Tensor& out, at::Tensor& a_all, at::Tensor& b_all,
                  at::Tensor& out_l, at::Tensor& a_l) {
  const int64_t BH = q.size(0), Lq = q.size(1), Lk = k.size(1), D = q.size(2), Dv = v.size(2);
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* op = out.data_ptr<T>();
  // a_all / b_all / a_l undefined: inference, where nothing is kept for a backward pass
  T* ap = a_all.defined() ? a_all.data_ptr<T>() : nullptr;
  T* bp = b_all.defined() ? b_all.data_ptr<T>() : nullptr;
  T* olp = soft ? out_l.data_ptr<T>() : nullptr;
  T* alp = soft && a_l.defined() ? a_l.data_ptr<T>() : nullptr;
  // The problems spread over the threads, or their query chunks (inner; see run_balanced).
  const int64_t threads = at::get_num_threads();
  auto body = [&](const std::vector<int64_t>& problems, bool inner) {
    const int64_t budget = inner ? cache_bytes : cache_bytes / threads;  // per worker
    Scratch<T> w;
    std::vector<T> gq, gk, gv, o, aa, bb, ol, al;
    for (const int64_t bh : problems) {
      const int64_t bi = bh / heads;
      const auto iq = valid_index(qm, bi, Lq);
      const auto ik = valid_index(km, bi, Lk);
      const int64_t n = iq.size(), m = ik.size();
      if (n == 0 || m == 0) {  // outputs and potentials 0
        const std::vector<int64_t> none;
        scatter(o.data(), none, Lq, Dv, op + bh * Lq * Dv);
        if (ap)
          for (int64_t t = 0; t <= iters; ++t) scatter(aa.data(), none, Lq, 1, ap + (t * BH + bh) * Lq);
        if (bp)
          for (int64_t t = 0; t < iters; ++t) scatter(bb.data(), none, Lk, 1, bp + (t * BH + bh) * Lk);
        if (soft) scatter(ol.data(), none, Lq, Dv, olp + bh * Lq * Dv);
        if (alp) scatter(al.data(), none, Lq, 1, alp + bh * Lq);
        continue;
      }
      Head<T> h{n, m, D, Dv, (T)scale, gather(qp + bh * Lq * D, iq, Lq, D, gq), gather(kp + bh * Lk * D, ik, Lk, D, gk),
                gather(vp + bh * Lk * Dv, ik, Lk, Dv, gv)};
      w.reserve(n, D, Dv, inner, threads, chunk_rows);
      o.resize(n * Dv);
      aa.resize((iters + 1) * n);
      bb.resize(iters * m);
      if (soft) {
        ol.resize(n * Dv);
        al.resize(n);
      }
      Dropout drop = dropout;
      drop.bh = bh;
      forward_head<T>(h, iters, aa.data(), bb.data(), o.data(), soft ? ol.data() : nullptr,
                      soft ? al.data() : nullptr, w, drop, budget);
      scatter(o.data(), iq, Lq, Dv, op + bh * Lq * Dv);
      if (ap)
        for (int64_t t = 0; t <= iters; ++t) scatter(aa.data() + t * n, iq, Lq, 1, ap + (t * BH + bh) * Lq);
      if (bp)
        for (int64_t t = 0; t < iters; ++t) scatter(bb.data() + t * m, ik, Lk, 1, bp + (t * BH + bh) * Lk);
      if (soft) scatter(ol.data(), iq, Lq, Dv, olp + bh * Lq * Dv);
      if (alp) scatter(al.data(), iq, Lq, 1, alp + bh * Lq);
    }
  };
  run_balanced(km, qm, BH, heads, Lq, Lk, needs_shared_budget<T>(iters, cache_bytes), body);
}

std::vector<at::Tensor> potentials_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                           const c10::optional<at::Tensor>& key_valid,
                                           const c10::optional<at::Tensor>& query_valid, int64_t heads,
                                           double scale, int64_t iters, bool softmax_too, double dropout_p,
                                           int64_t seed, int64_t score_cache_bytes, int64_t chunk_rows) {
  check_inputs(q, k, v, key_valid, query_valid, heads);
  TORCH_CHECK(iters >= 0, "iters must be >= 0 (0: softmax alone)");
  TORCH_CHECK(iters >= 1 || !softmax_too, "the softmax half goes with iters >= 1 (iters = 0 is softmax alone)");
  TORCH_CHECK(score_cache_bytes >= 0, "score_cache_bytes must be >= 0");
  TORCH_CHECK(chunk_rows >= 1, "chunk_rows must be >= 1");
  check_dropout(dropout_p, q, k);
  const Dropout dropout(dropout_p, seed);
  const int64_t BH = q.size(0), Lq = q.size(1), Lk = k.size(1), Dv = v.size(2);
  auto out = at::empty({BH, Lq, Dv}, q.options());  // every row is written (scatter)
  auto a_all = at::empty({iters + 1, BH, Lq}, q.options());
  auto b_all = at::empty({iters, BH, Lk}, q.options());
  auto out_l = softmax_too ? at::empty({BH, Lq, Dv}, q.options()) : at::empty({0}, q.options());
  auto a_l = softmax_too ? at::empty({BH, Lq}, q.options()) : at::empty({0}, q.options());
  const at::Tensor km = key_valid.has_value() ? *key_valid : at::Tensor();
  const at::Tensor qm = query_valid.has_value() ? *query_valid : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "potentials_forward", [&] {
    forward_impl<scalar_t>(q, k, v, km, qm, heads, scale, iters, softmax_too, dropout, score_cache_bytes, chunk_rows,
                           out, a_all, b_all, out_l, a_l);
  });
  return {out, a_all, b_all, out_l, a_l};
}

// Forward only (no input needs a gradient): the same computation as potentials_forward, so the outputs are
// bit-identical to it, without keeping the potentials that only the backward pass reads.
std::vector<at::Tensor> potentials_inference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                             const c10::optional<at::Tensor>& key_valid,
                                             const c10::optional<at::Tensor>& query_valid, int64_t heads,
                                             double scale, int64_t iters, bool softmax_too, double dropout_p,
                                             int64_t seed, int64_t score_cache_bytes, int64_t chunk_rows) {
  check_inputs(q, k, v, key_valid, query_valid, heads);
  TORCH_CHECK(iters >= 0, "iters must be >= 0 (0: softmax alone)");
  TORCH_CHECK(iters >= 1 || !softmax_too, "the softmax half goes with iters >= 1 (iters = 0 is softmax alone)");
  TORCH_CHECK(score_cache_bytes >= 0, "score_cache_bytes must be >= 0");
  TORCH_CHECK(chunk_rows >= 1, "chunk_rows must be >= 1");
  check_dropout(dropout_p, q, k);
  const Dropout dropout(dropout_p, seed);
  const int64_t BH = q.size(0), Lq = q.size(1), Dv = v.size(2);
  auto out = at::empty({BH, Lq, Dv}, q.options());  // every row is written (scatter)
  auto out_l = softmax_too ? at::empty({BH, Lq, Dv}, q.options()) : at::empty({0}, q.options());
  const at::Tensor km = key_valid.has_value() ? *key_valid : at::Tensor();
  const at::Tensor qm = query_valid.has_value() ? *query_valid : at::Tensor();
  at::Tensor none_a, none_b, none_al;
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "potentials_inference", [&] {
    forward_impl<scalar_t>(q, k, v, km, qm, heads, scale, iters, softmax_too, dropout, score_cache_bytes, chunk_rows,
                           out, none_a, none_b, out_l, none_al);
  });
  return {out, out_l};
}

template <typename T>
void backward_impl(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& out, const at::Tensor& out_l, const at::Tensor& a_all, const at::Tensor& b_all,
                   const at::Tensor& a_l, const at::Tensor& u, const at::Tensor& km, const at::Tensor& qm,
                   int64_t heads, double scale, int64_t iters, const Dropout& dropout, int64_t cache_bytes,
                   int64_t chunk_rows, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv) {
  const int64_t BH = q.size(0), Lq = q.size(1), Lk = k.size(1), D = q.size(2), Dv = v.size(2);
  const bool soft = out_l.defined();
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const T* dop = dout.data_ptr<T>();
  const T* op = out.data_ptr<T>();
  const T* ap = a_all.data_ptr<T>();
  const T* bp = b_all.data_ptr<T>();
  const T* olp = soft ? out_l.data_ptr<T>() : nullptr;
  const T* alp = soft ? a_l.data_ptr<T>() : nullptr;
  const T* up = u.defined() ? u.data_ptr<T>() : nullptr;
  T* dqp = dq.data_ptr<T>();
  T* dkp = dk.data_ptr<T>();
  T* dvp = dv.data_ptr<T>();
  // The problems spread over the threads, or their query chunks (inner; see run_balanced).
  const int64_t threads = at::get_num_threads();
  auto body = [&](const std::vector<int64_t>& problems, bool inner) {
    const int64_t budget = inner ? cache_bytes : cache_bytes / threads;  // per worker
    Scratch<T> w;
    std::vector<T> gq, gk, gv, gdo, go, gol, gal, aa, bb, dqb, dkb, dvb, tmp;
    for (const int64_t bh : problems) {
      const int64_t bi = bh / heads;
      const auto iq = valid_index(qm, bi, Lq);
      const auto ik = valid_index(km, bi, Lk);
      const int64_t n = iq.size(), m = ik.size();
      T* dqh = dqp + bh * Lq * D;
      T* dkh = dkp + bh * Lk * D;
      T* dvh = dvp + bh * Lk * Dv;
      if (n == 0 || m == 0) {  // gradients 0
        std::fill(dqh, dqh + Lq * D, T(0));
        std::fill(dkh, dkh + Lk * D, T(0));
        std::fill(dvh, dvh + Lk * Dv, T(0));
        continue;
      }
      Head<T> h{n, m, D, Dv, (T)scale, gather(qp + bh * Lq * D, iq, Lq, D, gq), gather(kp + bh * Lk * D, ik, Lk, D, gk),
                gather(vp + bh * Lk * Dv, ik, Lk, Dv, gv)};
      const T* dO = gather(dop + bh * Lq * Dv, iq, Lq, Dv, gdo);
      const T* o = gather(op + bh * Lq * Dv, iq, Lq, Dv, go);
      const T* ol = soft ? gather(olp + bh * Lq * Dv, iq, Lq, Dv, gol) : nullptr;
      const T* al = soft ? gather(alp + bh * Lq, iq, Lq, 1, gal) : nullptr;
      aa.resize((iters + 1) * n);
      bb.resize(iters * m);
      for (int64_t t = 0; t <= iters; ++t) {
        const T* src = gather(ap + (t * BH + bh) * Lq, iq, Lq, 1, tmp);
        std::copy(src, src + n, aa.begin() + t * n);
      }
      for (int64_t t = 0; t < iters; ++t) {
        const T* src = gather(bp + (t * BH + bh) * Lk, ik, Lk, 1, tmp);
        std::copy(src, src + m, bb.begin() + t * m);
      }
      w.reserve(n, D, Dv, inner, threads, chunk_rows);
      const bool dense = n == Lq && m == Lk;  // backward_head writes every row of dq, dk, dv
      if (!dense) {
        dqb.resize(n * D);
        dkb.resize(m * D);
        dvb.resize(m * Dv);
      }
      Dropout drop = dropout;
      drop.bh = bh;
      backward_head<T>(h, iters, dO, o, aa.data(), bb.data(), ol, al, up ? up[bh] : T(1), dense ? dqh : dqb.data(),
                       dense ? dkh : dkb.data(), dense ? dvh : dvb.data(), w, drop, budget);
      if (!dense) {
        scatter(dqb.data(), iq, Lq, D, dqh);
        scatter(dkb.data(), ik, Lk, D, dkh);
        scatter(dvb.data(), ik, Lk, Dv, dvh);
      }
    }
  };
  run_balanced(km, qm, BH, heads, Lq, Lk, needs_shared_budget<T>(iters, cache_bytes), body);
}

std::vector<at::Tensor> potentials_backward(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                                            const at::Tensor& v, const at::Tensor& out,
                                            const c10::optional<at::Tensor>& out_l, const at::Tensor& a_all,
                                            const at::Tensor& b_all, const c10::optional<at::Tensor>& a_l,
                                            const c10::optional<at::Tensor>& u,
                                            const c10::optional<at::Tensor>& key_valid,
                                            const c10::optional<at::Tensor>& query_valid, int64_t heads,
                                            double scale, int64_t iters, double dropout_p, int64_t seed,
                                            int64_t score_cache_bytes, int64_t chunk_rows) {
  check_inputs(q, k, v, key_valid, query_valid, heads);
  TORCH_CHECK(iters >= 0, "iters must be >= 0 (0: softmax alone)");
  TORCH_CHECK(iters >= 1 || (!out_l.has_value() && !u.has_value()), "softmax alone (iters = 0) has no hybrid weight");
  TORCH_CHECK(score_cache_bytes >= 0, "score_cache_bytes must be >= 0");
  TORCH_CHECK(chunk_rows >= 1, "chunk_rows must be >= 1");
  check_dropout(dropout_p, q, k);
  const Dropout dropout(dropout_p, seed);
  TORCH_CHECK(out_l.has_value() == a_l.has_value(), "out_l and a_l go together");
  for (const at::Tensor* t : {&dout, &out, &a_all, &b_all}) {
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == q.scalar_type(), "contiguous tensors of q's dtype expected");
  }
  const int64_t BH = q.size(0);
  TORCH_CHECK(dout.sizes() == out.sizes() && out.size(0) == BH && out.size(1) == q.size(1) && out.size(2) == v.size(2),
              "dout/out must be (B*H, Lq, Dv)");
  TORCH_CHECK(a_all.dim() == 3 && a_all.size(0) == iters + 1 && a_all.size(1) == BH && a_all.size(2) == q.size(1),
              "a_all must be (iters + 1, B*H, Lq)");
  TORCH_CHECK(b_all.dim() == 3 && b_all.size(0) == iters && b_all.size(1) == BH && b_all.size(2) == k.size(1),
              "b_all must be (iters, B*H, Lk)");
  if (out_l.has_value()) {
    TORCH_CHECK(out_l->sizes() == out.sizes() && out_l->is_contiguous() && out_l->scalar_type() == q.scalar_type(),
                "out_l must be like out");
    TORCH_CHECK(a_l->dim() == 2 && a_l->size(0) == BH && a_l->size(1) == q.size(1) && a_l->is_contiguous() &&
                    a_l->scalar_type() == q.scalar_type(),
                "a_l must be (B*H, Lq)");
  }
  if (u.has_value()) {
    TORCH_CHECK(u->dim() == 1 && u->size(0) == BH && u->is_contiguous() && u->scalar_type() == q.scalar_type(),
                "u must be a contiguous (B*H,) tensor of q's dtype");
  }
  auto dq = at::empty_like(q);  // every row is written
  auto dk = at::empty_like(k);
  auto dv = at::empty_like(v);
  const at::Tensor none;
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "potentials_backward", [&] {
    backward_impl<scalar_t>(dout, q, k, v, out, out_l.has_value() ? *out_l : none, a_all, b_all,
                            a_l.has_value() ? *a_l : none, u.has_value() ? *u : none,
                            key_valid.has_value() ? *key_valid : none, query_valid.has_value() ? *query_valid : none,
                            heads, scale, iters, dropout, score_cache_bytes, chunk_rows, dq, dk, dv);
  });
  return {dq, dk, dv};
}

// The bytes of scratch kept between calls, and freeing them.
int64_t scratch_pool_bytes() { return int64_t(BlockPool::instance().held()); }
void release_scratch() { BlockPool::instance().clear(); }

}  // namespace

TORCH_LIBRARY(attnkit_cpu, m) {
  m.def("scratch_pool_bytes", &scratch_pool_bytes);
  m.def("release_scratch", &release_scratch);
  m.def("potentials_forward", &potentials_forward);
  m.def("potentials_backward", &potentials_backward);
  m.def("potentials_inference", &potentials_inference);
}
