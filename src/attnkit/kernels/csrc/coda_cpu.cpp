// CoDA quasi-attention on the CPU, fused and cache-blocked, forward and exact backward.
//
// "Compositional De-Attention Networks", eqs. (1)-(6) and (10); docs/design.md section 3. With
// a = alpha * scale, b = beta * scale and the means mu_E, mu_N of the centred variants (0 otherwise):
//
//     E_ij = a q_i . k_j - mu_E,     N_ij = -b ||q_i - k_j||_1 - mu_N,
//     M_ij = f_E(E_ij) * g(N_ij),    g = c (f_N - lo) / (hi - lo)   (c = 2 for gate="scaled", else 1)
//     out_i = sum_j M_ij z_ij v_j    (M = 0 on invalid pairs; z: the dropout keep mask, 1 without dropout)
//
// Layout of the work. The valid queries and keys of one (batch, head) are gathered into dense buffers
// (padding by compaction, as in potentials_cpu.cpp); the queries are visited in chunks of kBq and, for
// each chunk, the keys in strips of kBc. One (kBq, kBc) tile holds E (one GEMM), another the L1
// distances, which a register tile of kRows queries x 2 vectors of keys computes over the keys transposed
// to (D, m) with
//
//     ||x - y||_1 = sum_d x_d + sum_d y_d - 2 sum_d min(x_d, y_d)       (|x - y| = x + y - 2 min(x, y))
//
// on queries and keys shifted by the mean key (the distance is unchanged in exact arithmetic and the sums
// stay small; in floating point the distance is accurate to about D ulp(max |x - c|), which a key far from
// the others makes larger: float32 keys at an offset of 1000 from the rest, 6e-5 in the output). The mean
// takes every valid key, those a causal or pair mask hides from a query too, so an output's last bits can
// change with a hidden key (2.7e-7 in float32 for a later key moved by 1, 1e-4 for one moved by 1e4); the
// first key alone, which a causal query sees, was tried and lost 8-10x in accuracy where that key is an
// outlier (a start-of-sequence or sink token)
// (one min and one add per element instead of a subtraction, an absolute value and an add). The
// activations, the gate, the mask and the dropout are applied to the tile while it is in cache, and
// M_tile V_strip is added to the chunk's output. Nothing (Lq, Lk)-shaped is stored.
//
// Backward (recomputing the tiles):  dM = (dO V^T) z,  dV += (M z)^T dO,
//     dE = dM f_E'(E) g(N),  dN = dM f_E(E) g'(N)  (0 on invalid pairs),
//     dQ += a dE K,  dK += a dE^T Q                                   (two GEMMs per tile)
//     G = -b dN (the gradient of the distances), with P_x(i, d) = sum_j G_ij [x_id < y_jd] and
//     P_y(j, d) = sum_i G_ij [x_id < y_jd] (one compare and two masked adds per element):
//     dQ_id += sum_j G_ij - 2 P_x(i, d),   dK_jd += 2 P_y(j, d) - sum_i G_ij,
// i.e. G sign(x - y) away from ties (at a tie x_id == y_jd the subgradient +1 is used where torch.cdist
// uses 0; the two differ only on exactly equal coordinates: the comparisons read the inputs as given, not
// the shifted copies, whose rounding could make a tie of two close coordinates). The gradients of the means are returned as
// -sum dE and -sum dN; the caller propagates them through its sum pass.
//
// Dropout drops M_ij with a counter-based hash of (seed, head, i, j) (compacted indices) that the
// backward pass replays, as in potentials_cpu.cpp.
//
// Threads. The query chunks of all (batch, head) problems, in order, are cut into one contiguous run per
// thread of about equal work (valid pairs), so that a batch of one sequence, a head count that the thread
// count does not divide or uneven lengths still keep every thread busy. The forward's rows are computed
// alike however they are cut (its results do not depend on the thread count); in the backward, a problem cut
// between threads adds the threads' partial dK, dV (and mean gradients) in thread order after the parallel
// region, so their last bits depend on the thread count.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <vector>


#include "cpu_common.h"

namespace {

using attnkit_cpu_common::blas;
using attnkit_cpu_common::Dropout;
using attnkit_cpu_common::lvector;
using attnkit_cpu_common::mm;

constexpr int64_t kBq = 128;  // queries per chunk (a multiple of kRows)
constexpr int64_t kBc = 256;  // keys per strip (a multiple of 2 vectors)
constexpr int64_t kRows = 8;  // queries per register tile of the L1 passes

// ---------------------------------------------------------------------------------------------------
// BLAS: row-major C (M x N) = alpha op(A) op(B) + beta C.


// ---------------------------------------------------------------------------------------------------
// The vector operations of the L1 passes: add(acc, min(x, y)) and "acc + g where x < y".
// AVX-512 intrinsics where built for it (at::vec's minimum propagates NaN with extra instructions and
// its comparisons return vectors, not mask registers); at::vec elsewhere.

#if defined(CPU_CAPABILITY_AVX512)
template <typename T>
struct Simd;
template <>
struct Simd<float> {
  using R = __m512;
  static constexpr int64_t W = 16;
  static R zero() { return _mm512_setzero_ps(); }
  static R set1(float x) { return _mm512_set1_ps(x); }
  static R load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, R x) { _mm512_storeu_ps(p, x); }
  static R add(R a, R b) { return _mm512_add_ps(a, b); }
  static R min(R a, R b) { return _mm512_min_ps(a, b); }
  using Mask = __mmask16;
  static Mask lt(R x, R y) { return _mm512_cmp_ps_mask(x, y, _CMP_LT_OQ); }
  static R mask_add(R acc, Mask m, R g) { return _mm512_mask_add_ps(acc, m, acc, g); }
  static float hsum(R x) { return _mm512_reduce_add_ps(x); }
};
template <>
struct Simd<double> {
  using R = __m512d;
  static constexpr int64_t W = 8;
  static R zero() { return _mm512_setzero_pd(); }
  static R set1(double x) { return _mm512_set1_pd(x); }
  static R load(const double* p) { return _mm512_loadu_pd(p); }
  static void store(double* p, R x) { _mm512_storeu_pd(p, x); }
  static R add(R a, R b) { return _mm512_add_pd(a, b); }
  static R min(R a, R b) { return _mm512_min_pd(a, b); }
  using Mask = __mmask8;
  static Mask lt(R x, R y) { return _mm512_cmp_pd_mask(x, y, _CMP_LT_OQ); }
  static R mask_add(R acc, Mask m, R g) { return _mm512_mask_add_pd(acc, m, acc, g); }
  static double hsum(R x) { return _mm512_reduce_add_pd(x); }
};
#else
template <typename T>
struct Simd {
  using R = at::vec::Vectorized<T>;
  static constexpr int64_t W = R::size();
  static R zero() { return R(T(0)); }
  static R set1(T x) { return R(x); }
  static R load(const T* p) { return R::loadu(p); }
  static void store(T* p, R x) { x.store(p); }
  static R add(R a, R b) { return a + b; }
  static R min(R a, R b) { return at::vec::minimum(a, b); }
  using Mask = R;  // all bits set where true
  static Mask lt(R x, R y) { return x < y; }
  static R mask_add(R acc, Mask m, R g) { return acc + (g & m); }
  static T hsum(R x) {
    return at::vec::vec_reduce_all<T>([](const R& a, const R& b) { return a + b; }, x);
  }
};
#endif

// out (kBq rows, ld ldo) = sum_d min(x_id, yT[d][j]) for the rows of x (a multiple of kRows, zero-padded)
// and the columns j < cols (a multiple of 2W) of yT (D, ldy).
template <typename T>
void min_tile(const T* x, int64_t rows, int64_t D, const T* yT, int64_t ldy, int64_t cols, T* out, int64_t ldo) {
  using S = Simd<T>;
  constexpr int64_t W = S::W;
  for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
    const T* xr = x + r0 * D;
    for (int64_t j0 = 0; j0 < cols; j0 += 2 * W) {
      typename S::R acc[kRows][2];
      for (int64_t r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = S::zero();
      for (int64_t d = 0; d < D; ++d) {
        const auto y0 = S::load(yT + d * ldy + j0);
        const auto y1 = S::load(yT + d * ldy + j0 + W);
        for (int64_t r = 0; r < kRows; ++r) {
          const auto xb = S::set1(xr[r * D + d]);
          acc[r][0] = S::add(acc[r][0], S::min(xb, y0));
          acc[r][1] = S::add(acc[r][1], S::min(xb, y1));
        }
      }
      for (int64_t r = 0; r < kRows; ++r) {
        S::store(out + (r0 + r) * ldo + j0, acc[r][0]);
        S::store(out + (r0 + r) * ldo + j0 + W, acc[r][1]);
      }
    }
  }
}

// px (rows, D) += sum_j G_rj [x_rd < yT[d][j]] and pyT (D, ldy) += sum_r G_rj [x_rd < yT[d][j]], over the
// columns j < cols of G (rows, ld ldg; zero on padded rows and columns). For each block of kRows rows and
// each d, the row sums stay in registers across the strip (one horizontal sum per row and d).
template <typename T>
void lt_tile(const T* g, int64_t ldg, const T* x, int64_t rows, int64_t D, const T* yT, int64_t ldy, int64_t cols,
             T* px, T* pyT) {
  using S = Simd<T>;
  constexpr int64_t W = S::W;
  for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
    const T* xr = x + r0 * D;
    const T* gr = g + r0 * ldg;
    for (int64_t d = 0; d < D; ++d) {
      typename S::R xb[kRows], xa[kRows];
      for (int64_t r = 0; r < kRows; ++r) {
        xb[r] = S::set1(xr[r * D + d]);
        xa[r] = S::zero();
      }
      const T* yd = yT + d * ldy;
      T* py = pyT + d * ldy;
      for (int64_t j0 = 0; j0 < cols; j0 += 2 * W) {
        const auto y0 = S::load(yd + j0);
        const auto y1 = S::load(yd + j0 + W);
        typename S::R p[2][2] = {{S::zero(), S::zero()}, {S::zero(), S::zero()}};  // two chains of sums
        for (int64_t r = 0; r < kRows; ++r) {
          const auto g0 = S::load(gr + r * ldg + j0);
          const auto g1 = S::load(gr + r * ldg + j0 + W);
          const auto m0 = S::lt(xb[r], y0);
          const auto m1 = S::lt(xb[r], y1);
          xa[r] = S::mask_add(S::mask_add(xa[r], m0, g0), m1, g1);
          p[r & 1][0] = S::mask_add(p[r & 1][0], m0, g0);
          p[r & 1][1] = S::mask_add(p[r & 1][1], m1, g1);
        }
        S::store(py + j0, S::add(S::load(py + j0), S::add(p[0][0], p[1][0])));
        S::store(py + j0 + W, S::add(S::load(py + j0 + W), S::add(p[0][1], p[1][1])));
      }
      for (int64_t r = 0; r < kRows; ++r) px[(r0 + r) * D + d] += S::hsum(xa[r]);
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// Activations (CoDA Table 9) and their derivatives, vectorized; 0 tanh, 1 sigmoid, 2 arctan, 3 algebraic.

template <typename T>
using Vec = at::vec::Vectorized<T>;

// sigmoid and tanh through one exponential (float: at::vec's exp_u20, as potentials_cpu.cpp uses);
// tanh(x) = 2 sigmoid(2x) - 1.
// 1 / x for x >= 1 (float: rcp14 and one Newton step, relative error about 2^-28).
inline Vec<float> recip(const Vec<float>& x) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 v = x;
  const __m512 r = _mm512_rcp14_ps(v);
  return Vec<float>(_mm512_mul_ps(r, _mm512_fnmadd_ps(v, r, _mm512_set1_ps(2.f))));
#else
  return Vec<float>(1.f) / x;
#endif
}
// exp(-x) is capped at exp(80) so that the reciprocal stays finite (sigmoid(x) < 2e-35 there).
inline Vec<float> sigmoid_v(const Vec<float>& x) {
  return recip(Vec<float>(1.f) + at::vec::minimum(x.neg(), Vec<float>(80.f)).exp_u20());
}
inline Vec<double> sigmoid_v(const Vec<double>& x) { return Vec<double>(1.0) / (Vec<double>(1.0) + x.neg().exp()); }
inline Vec<float> tanh_v(const Vec<float>& x) { return Vec<float>(2.f) * sigmoid_v(x + x) - Vec<float>(1.f); }
inline Vec<double> tanh_v(const Vec<double>& x) { return x.tanh(); }

template <typename T>
inline Vec<T> act(int kind, const Vec<T>& x) {
  const Vec<T> one(T(1));
  switch (kind) {
    case 0:
      return tanh_v(x);
    case 1:
      return sigmoid_v(x);
    case 2:
      return x.atan();
    default:
      return x * (one + x * x).rsqrt();
  }
}

// f'(x) from x and f = f(x).
template <typename T>
inline Vec<T> act_grad(int kind, const Vec<T>& x, const Vec<T>& f) {
  const Vec<T> one(T(1));
  switch (kind) {
    case 0:
      return one - f * f;
    case 1:
      return f * (one - f);
    case 2:
      return one / (one + x * x);
    default: {
      const Vec<T> r = (one + x * x).rsqrt();
      return r * r * r;
    }
  }
}

inline void act_range(int kind, double& lo, double& hi) {
  switch (kind) {
    case 1:
      lo = 0.0, hi = 1.0;
      return;
    case 2:
      lo = -M_PI / 2, hi = M_PI / 2;
      return;
    default:
      lo = -1.0, hi = 1.0;
  }
}

// The constants of one call.
template <typename T>
struct Params {
  T a, b;          // alpha * scale, beta * scale
  int fe, fn;      // activations of E and of the gate
  T glo, gscale;   // gate = gscale * (f_N(N) - glo)
};

// ---------------------------------------------------------------------------------------------------

// ---------------------------------------------------------------------------------------------------
// Validity of pairs beyond padding: causal (key index <= query index) and a boolean pair mask read with
// strides (broadcast dimensions have stride 0). Indices are the original (uncompacted) positions.
struct PairMask {
  const bool* p = nullptr;  // the mask of this (batch, head), or null
  int64_t si = 0, sj = 0;
  bool causal = false;
  bool any() const { return p != nullptr || causal; }
  bool ok(int64_t i, int64_t j) const { return (!causal || j <= i) && (!p || p[i * si + j * sj]); }
};

// One (batch, head) problem in compacted form: n valid queries, m valid keys. The forward's L1 pass reads
// the queries and keys shifted by the mean key c (||x - y||_1 is unchanged in exact arithmetic; the sums in
// the min form stay small when the vectors share a large offset): qc (n, D) with rows padded to a multiple
// of kRows, kT (D, mp) the shifted keys transposed, zero beyond m; sq (n), sk (mp): the sums of their rows.
// The backward's comparisons x_id < y_jd read the inputs as given (qu, kU, laid out as qc, kT): a float
// comparison is exact, where two shifted values x - c and y - c closer than ulp(|x - c|) round to a tie
// (coordinates 5e-6 apart at an offset of 1000 had their gradient's sign reversed).
template <typename T>
struct Head {
  int64_t n, m, mp, D, Dv;
  const T* q;
  const T* k;
  const T* v;
  const T* qc;
  const T* kT;
  const T* qu;
  const T* kU;
  const T* sq;
  const T* sk;
  T me, mn;  // the means (0 unless centred)
  const std::vector<int64_t>* iq;
  const std::vector<int64_t>* ik;
  PairMask pm;
};

// Tiles of one worker.
template <typename T>
struct Tiles {
  lvector<T> e, dist, m, dm, z;
  Tiles() : e(kBq * kBc), dist(kBq * kBc), m(kBq * kBc), dm(kBq * kBc), z(kBc) {}
};

// Whether some / every pair of the tile (rows [i0, i0 + rows), columns [j0, j0 + cols)) is valid.
template <typename T>
void tile_validity(const Head<T>& h, int64_t i0, int64_t rows, int64_t j0, int64_t cols, bool& some, bool& all) {
  some = all = true;
  if (!h.pm.any()) return;
  const auto& iq = *h.iq;
  const auto& ik = *h.ik;
  if (h.pm.causal && !h.pm.p) {  // indices are increasing: compare the corners
    all = ik[j0 + cols - 1] <= iq[i0];
    some = ik[j0] <= iq[i0 + rows - 1];
    return;
  }
  some = false;
  all = true;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const bool ok = h.pm.ok(iq[i0 + r], ik[j0 + c]);
      some |= ok;
      all &= ok;
    }
}

// The E and distance tiles of rows [i0, i0 + rows) and columns [j0, j0 + cols); returns the padded width.
template <typename T>
int64_t score_tiles(const Head<T>& h, const Params<T>& P, int64_t i0, int64_t rows, int64_t j0, int64_t cols,
                    Tiles<T>& w) {
  constexpr int64_t W2 = 2 * Simd<T>::W;
  const int64_t cp = (cols + W2 - 1) / W2 * W2;
  mm<T>(false, true, rows, cols, h.D, P.a, h.q + i0 * h.D, h.D, h.k + j0 * h.D, h.D, T(0), w.e.data(), kBc);
  const int64_t rp = (rows + kRows - 1) / kRows * kRows;
  min_tile<T>(h.qc + i0 * h.D, rp, h.D, h.kT + j0, h.mp, cp, w.dist.data(), kBc);
  return cp;
}

// Forward elementwise step of one row over cp columns (a multiple of the vector width): m <- M from the
// raw tiles e = a q.k and n = sum_d min(q, k).
template <typename T>
inline void row_forward(const Head<T>& h, const Params<T>& P, T sq, const T* sk, const T* e, const T* n, T* m,
                        int64_t cp) {
  const Vec<T> me(h.me), mn(h.mn), b(P.b), vsq(sq), two(T(2)), glo(P.glo), gs(P.gscale), zero(T(0));
  for (int64_t j = 0; j < cp; j += Vec<T>::size()) {
    const Vec<T> ev = Vec<T>::loadu(e + j) - me;
    const Vec<T> nv = zero - b * (vsq + Vec<T>::loadu(sk + j) - two * Vec<T>::loadu(n + j)) - mn;
    (act<T>(P.fe, ev) * (gs * (act<T>(P.fn, nv) - glo))).store(m + j);
  }
}

// Backward elementwise step of one row over cp columns, from the raw tiles and dm (dO V^T, times the
// keep mask and 0 on invalid pairs and padded columns): m <- M, e <- dE, n <- G = -b dN; adds the sums
// of dE and dN to se, sn.
template <typename T>
inline void row_backward(const Head<T>& h, const Params<T>& P, T sq, const T* sk, T* e, T* n, T* m, const T* dm,
                         int64_t cp, Vec<T>& se, Vec<T>& sn) {
  const Vec<T> me(h.me), mn(h.mn), b(P.b), vsq(sq), two(T(2)), glo(P.glo), gs(P.gscale), zero(T(0));
  for (int64_t j = 0; j < cp; j += Vec<T>::size()) {
    const Vec<T> ev = Vec<T>::loadu(e + j) - me;
    const Vec<T> nv = zero - b * (vsq + Vec<T>::loadu(sk + j) - two * Vec<T>::loadu(n + j)) - mn;
    const Vec<T> fe = act<T>(P.fe, ev), fn = act<T>(P.fn, nv);
    const Vec<T> gate = gs * (fn - glo);
    const Vec<T> dmv = Vec<T>::loadu(dm + j);
    (fe * gate).store(m + j);
    const Vec<T> de = dmv * act_grad<T>(P.fe, ev, fe) * gate;
    const Vec<T> dn = dmv * fe * gs * act_grad<T>(P.fn, nv, fn);
    de.store(e + j);
    (zero - b * dn).store(n + j);
    se = se + de;
    sn = sn + dn;
  }
}

// z[c] for c < cols: the dropout keep mask times the validity of the pair, for row i (compacted) of the tile
// at column j0; false (z untouched) when every pair is kept and valid.
template <typename T>
bool row_weights(const Head<T>& h, const Dropout& drop, bool all, int64_t i, int64_t j0, int64_t cols, T* z) {
  if (all && !drop.on) return false;
  if (drop.on)
    drop.row(i, j0, cols, z);
  else
    std::fill(z, z + cols, T(1));
  if (!all) {
    const int64_t oi = (*h.iq)[i];
    for (int64_t c = 0; c < cols; ++c)
      if (!h.pm.ok(oi, (*h.ik)[j0 + c])) z[c] = T(0);
  }
  return true;
}

// Forward of the query rows [r0, r1) of one head (r0 a multiple of kBq): rows r0 .. r1 of out (n, Dv). (The
// rows keep their offsets in out however the chunks are cut: BLAS results may depend on the alignment.)
template <typename T>
void forward_head(const Head<T>& h, const Params<T>& P, const Dropout& drop, int64_t r0, int64_t r1, T* out,
                  Tiles<T>& w) {
  std::fill(out + r0 * h.Dv, out + r1 * h.Dv, T(0));
  for (int64_t i0 = r0; i0 < r1; i0 += kBq) {
    const int64_t rows = std::min(kBq, r1 - i0);
    for (int64_t j0 = 0; j0 < h.m; j0 += kBc) {
      const int64_t cols = std::min(kBc, h.m - j0);
      bool some, all;
      tile_validity(h, i0, rows, j0, cols, some, all);
      if (!some) continue;
      const int64_t cp = score_tiles(h, P, i0, rows, j0, cols, w);
      for (int64_t r = 0; r < rows; ++r) {
        T* mr = w.m.data() + r * kBc;
        row_forward(h, P, h.sq[i0 + r], h.sk + j0, w.e.data() + r * kBc, w.dist.data() + r * kBc, mr, cp);
        if (row_weights(h, drop, all, i0 + r, j0, cols, w.z.data()))
          for (int64_t c = 0; c < cols; ++c) mr[c] *= w.z[c];
      }
      mm<T>(false, false, rows, h.Dv, cols, T(1), w.m.data(), kBc, h.v + j0 * h.Dv, h.Dv, T(1), out + i0 * h.Dv,
            h.Dv);
    }
  }
}

// Backward of the query rows [r0, r1) of one head (r0 a multiple of kBq): rows r0 .. r1 of dq (n, D), and
// their parts of dk (m, D), dv (m, Dv) and of the sums of dE and dN (all zeroed here). The parts of the row
// ranges of a head add up to its gradients.
template <typename T>
void backward_head(const Head<T>& h, const Params<T>& P, const Dropout& drop, const T* dO, int64_t r0, int64_t r1,
                   T* dq, T* dk, T* dv, T& sum_de, T& sum_dn, Tiles<T>& w) {
  const int64_t n = r1 - r0, m = h.m, D = h.D, Dv = h.Dv;
  constexpr int64_t V = Vec<T>::size();
  dq += r0 * D;  // rows r0 ..
  std::fill(dq, dq + n * D, T(0));
  std::fill(dk, dk + m * D, T(0));
  std::fill(dv, dv + m * Dv, T(0));
  // px: sum_j G [q < k] (n, D); pyT: sum_i G [q < k] (D, mp); rowg / colg: the row and column sums of G
  // (rows: those of the range)
  std::vector<T> px(((n + kRows - 1) / kRows * kRows) * D, T(0)), pyT(D * h.mp, T(0)), rowg(n, T(0)),
      colg(h.mp, T(0));
  Vec<T> se(T(0)), sn(T(0));
  for (int64_t i0 = r0; i0 < r1; i0 += kBq) {
    const int64_t rows = std::min(kBq, r1 - i0);
    const int64_t rp = (rows + kRows - 1) / kRows * kRows;
    for (int64_t j0 = 0; j0 < m; j0 += kBc) {
      const int64_t cols = std::min(kBc, m - j0);
      bool some, all;
      tile_validity(h, i0, rows, j0, cols, some, all);
      if (!some) continue;
      const int64_t cp = score_tiles(h, P, i0, rows, j0, cols, w);
      mm<T>(false, true, rows, cols, Dv, T(1), dO + i0 * Dv, Dv, h.v + j0 * Dv, Dv, T(0), w.dm.data(), kBc);  // dO V^T
      for (int64_t r = 0; r < rows; ++r) {
        T* e = w.e.data() + r * kBc;     // -> dE
        T* g = w.dist.data() + r * kBc;  // -> G = -b dN
        T* mr = w.m.data() + r * kBc;    // -> M z
        T* dm = w.dm.data() + r * kBc;
        std::fill(dm + cols, dm + cp, T(0));
        const bool weighted = row_weights(h, drop, all, i0 + r, j0, cols, w.z.data());
        if (weighted)
          for (int64_t c = 0; c < cols; ++c) dm[c] *= w.z[c];
        row_backward(h, P, h.sq[i0 + r], h.sk + j0, e, g, mr, dm, cp, se, sn);
        if (weighted)
          for (int64_t c = 0; c < cols; ++c) mr[c] *= w.z[c];
        Vec<T> rs(T(0));
        for (int64_t c = 0; c < cp; c += V) {
          const Vec<T> gv = Vec<T>::loadu(g + c);
          rs = rs + gv;
          (Vec<T>::loadu(colg.data() + j0 + c) + gv).store(colg.data() + j0 + c);
        }
        rowg[i0 - r0 + r] += at::vec::vec_reduce_all<T>([](const Vec<T>& x, const Vec<T>& y) { return x + y; }, rs);
      }
      for (int64_t r = rows; r < rp; ++r) std::fill(w.dist.begin() + r * kBc, w.dist.begin() + r * kBc + cp, T(0));
      // dV += (M z)^T dO, dQ += a dE K, dK += a dE^T Q, and the L1 backward of G
      mm<T>(true, false, cols, Dv, rows, T(1), w.m.data(), kBc, dO + i0 * Dv, Dv, T(1), dv + j0 * Dv, Dv);
      mm<T>(false, false, rows, D, cols, P.a, w.e.data(), kBc, h.k + j0 * D, D, T(1), dq + (i0 - r0) * D, D);
      mm<T>(true, false, cols, D, rows, P.a, w.e.data(), kBc, h.q + i0 * D, D, T(1), dk + j0 * D, D);
      lt_tile<T>(w.dist.data(), kBc, h.qu + i0 * D, rp, D, h.kU + j0, h.mp, cp, px.data() + (i0 - r0) * D,
                 pyT.data() + j0);
    }
  }
  for (int64_t i = 0; i < n; ++i)
    for (int64_t d = 0; d < D; ++d) dq[i * D + d] += rowg[i] - T(2) * px[i * D + d];
  for (int64_t j = 0; j < m; ++j)
    for (int64_t d = 0; d < D; ++d) dk[j * D + d] += T(2) * pyT[d * h.mp + j] - colg[j];
  const auto add = [](const Vec<T>& x, const Vec<T>& y) { return x + y; };
  sum_de = at::vec::vec_reduce_all<T>(add, se);
  sum_dn = at::vec::vec_reduce_all<T>(add, sn);
}

// ---------------------------------------------------------------------------------------------------
// Padding, scheduling, entry points.

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

// The rows idx of src (L rows, width) into buf, padded with zero rows to `rows_to` rows; src itself when
// that is the same.
template <typename T>
const T* gather(const T* src, const std::vector<int64_t>& idx, int64_t L, int64_t width, int64_t rows_to,
                lvector<T>& buf) {
  if ((int64_t)idx.size() == L && rows_to <= L) return src;
  buf.assign(std::max<int64_t>(rows_to, idx.size()) * width, T(0));
  for (size_t r = 0; r < idx.size(); ++r) std::copy(src + idx[r] * width, src + (idx[r] + 1) * width, &buf[r * width]);
  return buf.data();
}

template <typename T>
void scatter(const T* src, const std::vector<int64_t>& idx, int64_t width, T* dst) {
  for (size_t r = 0; r < idx.size(); ++r) std::copy(src + r * width, src + (r + 1) * width, dst + idx[r] * width);
}


// The inputs of one call, checked.
struct Call {
  at::Tensor q, k, v, km, qm, pair, mean_e, mean_n;
  int64_t heads;
  bool causal;
};

Call make_call(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const c10::optional<at::Tensor>& km,
               const c10::optional<at::Tensor>& qm, const c10::optional<at::Tensor>& pair, bool causal,
               int64_t heads, const c10::optional<at::Tensor>& mean_e, const c10::optional<at::Tensor>& mean_n) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "CPU tensors expected");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be (B*H, L, D)");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(), "q, k, v dtypes differ");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble, "float32 or float64 expected");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(), "contiguous q, k, v expected");
  TORCH_CHECK(q.size(0) == k.size(0) && k.size(0) == v.size(0) && k.size(1) == v.size(1), "shape mismatch");
  TORCH_CHECK(q.size(2) == k.size(2), "q and k head sizes differ");
  TORCH_CHECK(heads >= 1 && q.size(0) % heads == 0, "heads must divide B*H");
  TORCH_CHECK(q.size(1) < (1LL << 31) && k.size(1) < (1LL << 31), "sequence too long for 32-bit BLAS");
  const int64_t BH = q.size(0), B = BH / heads, Lq = q.size(1), Lk = k.size(1);
  Call c{q, k, v, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), heads, causal};
  if (km.has_value()) {
    TORCH_CHECK(km->scalar_type() == at::kBool && km->is_contiguous() && km->dim() == 2 && km->size(0) == B &&
                    km->size(1) == Lk,
                "key_valid must be a contiguous bool (B, Lk) tensor");
    c.km = *km;
  }
  if (qm.has_value()) {
    TORCH_CHECK(qm->scalar_type() == at::kBool && qm->is_contiguous() && qm->dim() == 2 && qm->size(0) == B &&
                    qm->size(1) == Lq,
                "query_valid must be a contiguous bool (B, Lq) tensor");
    c.qm = *qm;
  }
  if (pair.has_value()) {
    TORCH_CHECK(pair->scalar_type() == at::kBool && pair->dim() == 4 && pair->size(0) == B &&
                    pair->size(1) == heads && pair->size(2) == Lq && pair->size(3) == Lk,
                "pair must be a bool (B, H, Lq, Lk) tensor (expanded views allowed)");
    c.pair = *pair;
  }
  for (const auto* mean : {&mean_e, &mean_n}) {
    if (mean->has_value()) {
      TORCH_CHECK((*mean)->dim() == 1 && (*mean)->size(0) == BH && (*mean)->is_contiguous() &&
                      (*mean)->scalar_type() == q.scalar_type(),
                  "means must be contiguous (B*H,) tensors of q's dtype");
    }
  }
  if (mean_e.has_value()) c.mean_e = *mean_e;
  if (mean_n.has_value()) c.mean_n = *mean_n;
  return c;
}

// One thread's share of a (batch, head) problem: its compacted query rows [r0, r1), whole chunks.
struct Piece {
  int64_t bh, r0, r1;
};

// The query chunks of every problem with a valid query and key, in (problem, chunk) order, cut into `threads`
// contiguous runs of about equal work: a chunk costs its valid pairs (under the causal mask, those of its
// last row) and goes to the thread whose share holds the chunk's midpoint. Fewer runs than threads when there
// are fewer chunks.
std::vector<std::vector<Piece>> chunk_schedule(const Call& c, int64_t threads) {
  const int64_t BH = c.q.size(0), Lq = c.q.size(1), Lk = c.k.size(1), B = BH / c.heads;
  struct Chunk {
    int64_t bh, r0, r1;
    double cost;
  };
  std::vector<Chunk> chunks;
  std::vector<std::vector<Chunk>> per_batch(B);  // a batch's heads share their masks and costs
  for (int64_t b = 0; b < B; ++b) {
    const auto iq = valid_index(c.qm, b, Lq);
    const auto ik = valid_index(c.km, b, Lk);
    const int64_t n = iq.size(), m = ik.size();
    if (n == 0 || m == 0) continue;
    for (int64_t r0 = 0; r0 < n; r0 += kBq) {
      const int64_t r1 = std::min(n, r0 + kBq);
      int64_t keys = m;
      if (c.causal) keys = std::upper_bound(ik.begin(), ik.end(), iq[r1 - 1]) - ik.begin();
      per_batch[b].push_back({0, r0, r1, double(r1 - r0) * double(keys) + 1.0});
    }
  }
  double total = 0;
  for (int64_t bh = 0; bh < BH; ++bh)
    for (Chunk ch : per_batch[bh / c.heads]) {
      ch.bh = bh;
      total += ch.cost;
      chunks.push_back(ch);
    }
  threads = std::max<int64_t>(1, std::min<int64_t>(threads, chunks.size()));
  std::vector<std::vector<Piece>> lists(threads);
  double done = 0;
  for (const Chunk& ch : chunks) {
    const int64_t t = std::min<int64_t>(threads - 1, int64_t((done + ch.cost / 2) / total * threads));
    done += ch.cost;
    auto& l = lists[t];
    if (!l.empty() && l.back().bh == ch.bh && l.back().r1 == ch.r0)
      l.back().r1 = ch.r1;
    else
      l.push_back({ch.bh, ch.r0, ch.r1});
  }
  return lists;
}

// body(t, pieces) for every list of the schedule, one per thread.
template <typename F>
void run_pieces(const std::vector<std::vector<Piece>>& lists, const F& body) {
  if (lists.size() == 1) {
    body(0, lists[0]);
    return;
  }
  at::parallel_for(0, lists.size(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) body(t, lists[t]);
  });
}

template <typename T>
Params<T> make_params(double scale, double alpha, double beta, int64_t fe, int64_t fn, int64_t gate) {
  TORCH_CHECK(fe >= 0 && fe <= 3 && fn >= 0 && fn <= 3, "activation codes are 0..3");
  TORCH_CHECK(gate >= 0 && gate <= 2, "gate codes are 0 (sigmoid), 1 (scaled), 2 (centered)");
  double lo, hi;
  act_range((int)fn, lo, hi);
  const double c = gate == 1 ? 2.0 : 1.0;
  return Params<T>{(T)(alpha * scale), (T)(beta * scale), (int)fe, (int)fn, (T)lo, (T)(c / (hi - lo))};
}

// Everything of one (batch, head) problem the two passes share: compacted inputs, transposed keys, sums.
template <typename T>
struct Problem {
  std::vector<int64_t> iq, ik;
  lvector<T> q, k, v, qc, kT, sq, sk, qu, kU;
  Head<T> head;

  bool build(const Call& c, int64_t bh, bool with_inputs = false) {
    const int64_t Lq = c.q.size(1), Lk = c.k.size(1), D = c.q.size(2), Dv = c.v.size(2);
    const int64_t bi = bh / c.heads, hi = bh % c.heads;
    iq = valid_index(c.qm, bi, Lq);
    ik = valid_index(c.km, bi, Lk);
    const int64_t n = iq.size(), m = ik.size();
    if (n == 0 || m == 0) return false;
    constexpr int64_t W2 = 2 * Simd<T>::W;
    const int64_t np = (n + kRows - 1) / kRows * kRows, mp = (m + W2 - 1) / W2 * W2;
    const T* qp = gather(c.q.data_ptr<T>() + bh * Lq * D, iq, Lq, D, n, q);
    const T* kp = gather(c.k.data_ptr<T>() + bh * Lk * D, ik, Lk, D, m, k);
    const T* vp = gather(c.v.data_ptr<T>() + bh * Lk * Dv, ik, Lk, Dv, m, v);
    std::vector<double> mean(D, 0.0);
    for (int64_t j = 0; j < m; ++j)
      for (int64_t d = 0; d < D; ++d) mean[d] += kp[j * D + d];
    std::vector<T> cm(D);
    for (int64_t d = 0; d < D; ++d) cm[d] = (T)(mean[d] / m);
    qc.assign(np * D, T(0));
    sq.assign(np, T(0));
    for (int64_t i = 0; i < n; ++i) {
      T acc = 0;
      for (int64_t d = 0; d < D; ++d) acc += (qc[i * D + d] = qp[i * D + d] - cm[d]);
      sq[i] = acc;
    }
    kT.assign(D * mp, T(0));
    sk.assign(mp, T(0));
    for (int64_t j0 = 0; j0 < m; j0 += 16)  // blocks of 16 keys: contiguous writes, cached reads
      for (int64_t d = 0; d < D; ++d)
        for (int64_t j = j0; j < std::min(m, j0 + 16); ++j) kT[d * mp + j] = kp[j * D + d] - cm[d];
    for (int64_t d = 0; d < D; ++d)
      for (int64_t j = 0; j < m; ++j) sk[j] += kT[d * mp + j];
    if (with_inputs) {  // the backward's comparisons: the inputs as given, in the same layouts
      qu.assign(np * D, T(0));
      std::copy(qp, qp + n * D, qu.begin());
      kU.assign(D * mp, T(0));
      for (int64_t j0 = 0; j0 < m; j0 += 16)
        for (int64_t d = 0; d < D; ++d)
          for (int64_t j = j0; j < std::min(m, j0 + 16); ++j) kU[d * mp + j] = kp[j * D + d];
    }
    PairMask pm;
    pm.causal = c.causal;
    if (c.pair.defined()) {
      pm.p = c.pair.data_ptr<bool>() + bi * c.pair.stride(0) + hi * c.pair.stride(1);
      pm.si = c.pair.stride(2);
      pm.sj = c.pair.stride(3);
    }
    const T me = c.mean_e.defined() ? c.mean_e.data_ptr<T>()[bh] : T(0);
    const T mn = c.mean_n.defined() ? c.mean_n.data_ptr<T>()[bh] : T(0);
    head = Head<T>{n, m, mp, D, Dv, qp, kp, vp, qc.data(), kT.data(), qu.data(), kU.data(), sq.data(), sk.data(),
                   me, mn, &iq, &ik,
                   pm};
    return true;
  }
};

void check_dropout(double p, const at::Tensor& q, const at::Tensor& k) {
  TORCH_CHECK(p >= 0.0 && p < 1.0, "dropout_p must be in [0, 1)");
  TORCH_CHECK(p == 0.0 || (q.size(0) < (1LL << 31) && q.size(1) < (1LL << 32) && k.size(1) < (1LL << 34)),
              "too many heads or positions for the dropout hash");
}

at::Tensor coda_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const c10::optional<at::Tensor>& key_valid, const c10::optional<at::Tensor>& query_valid,
                        const c10::optional<at::Tensor>& pair, bool causal, int64_t heads, double scale,
                        double alpha, double beta, int64_t e_act, int64_t n_act, int64_t gate,
                        const c10::optional<at::Tensor>& mean_e, const c10::optional<at::Tensor>& mean_n,
                        double dropout_p, int64_t seed) {
  const Call c = make_call(q, k, v, key_valid, query_valid, pair, causal, heads, mean_e, mean_n);
  check_dropout(dropout_p, q, k);
  const Dropout dropout(dropout_p, seed);
  const int64_t BH = q.size(0), Lq = q.size(1), Lk = k.size(1), Dv = v.size(2);
  auto out = at::zeros({BH, Lq, Dv}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "coda_forward", [&] {
    using T = scalar_t;
    const Params<T> P = make_params<T>(scale, alpha, beta, e_act, n_act, gate);
    T* op = out.data_ptr<T>();
    run_pieces(chunk_schedule(c, at::get_num_threads()), [&](int64_t, const std::vector<Piece>& pieces) {
      Tiles<T> w;
      Problem<T> pr;
      lvector<T> o;
      int64_t built = -1;
      for (const Piece& p : pieces) {
        if (p.bh != built) {
          pr.build(c, p.bh);  // every scheduled problem has a valid query and key
          built = p.bh;
        }
        Dropout drop = dropout;
        drop.bh = p.bh;
        o.resize(pr.head.n * Dv);
        forward_head<T>(pr.head, P, drop, p.r0, p.r1, o.data(), w);
        T* dst = op + p.bh * Lq * Dv;
        for (int64_t r = p.r0; r < p.r1; ++r) std::copy(o.data() + r * Dv, o.data() + (r + 1) * Dv, dst + pr.iq[r] * Dv);
      }
    });
  });
  return out;
}

std::vector<at::Tensor> coda_backward(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                                      const at::Tensor& v, const c10::optional<at::Tensor>& key_valid,
                                      const c10::optional<at::Tensor>& query_valid,
                                      const c10::optional<at::Tensor>& pair, bool causal, int64_t heads,
                                      double scale, double alpha, double beta, int64_t e_act, int64_t n_act,
                                      int64_t gate, const c10::optional<at::Tensor>& mean_e,
                                      const c10::optional<at::Tensor>& mean_n, double dropout_p, int64_t seed) {
  const Call c = make_call(q, k, v, key_valid, query_valid, pair, causal, heads, mean_e, mean_n);
  check_dropout(dropout_p, q, k);
  const Dropout dropout(dropout_p, seed);
  const int64_t BH = q.size(0), Lq = q.size(1), Lk = k.size(1), D = q.size(2), Dv = v.size(2);
  TORCH_CHECK(dout.dim() == 3 && dout.size(0) == BH && dout.size(1) == Lq && dout.size(2) == Dv &&
                  dout.is_contiguous() && dout.scalar_type() == q.scalar_type(),
              "dout must be a contiguous (B*H, Lq, Dv) tensor of q's dtype");
  auto dq = at::zeros_like(q);
  auto dk = at::zeros_like(k);
  auto dv = at::zeros_like(v);
  auto dme = at::zeros({BH}, q.options());
  auto dmn = at::zeros({BH}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "coda_backward", [&] {
    using T = scalar_t;
    const Params<T> P = make_params<T>(scale, alpha, beta, e_act, n_act, gate);
    const T* dop = dout.data_ptr<T>();
    T* dqp = dq.data_ptr<T>();
    T* dkp = dk.data_ptr<T>();
    T* dvp = dv.data_ptr<T>();
    T* dmep = dme.data_ptr<T>();
    T* dmnp = dmn.data_ptr<T>();
    // A problem cut between threads: each thread's parts of dK, dV and the mean gradients, added afterwards.
    struct Part {
      int64_t bh;
      lvector<T> dk, dv;
      T se, sn;
    };
    const auto lists = chunk_schedule(c, at::get_num_threads());
    std::vector<std::vector<Part>> parts(lists.size());
    run_pieces(lists, [&](int64_t t, const std::vector<Piece>& pieces) {
      Tiles<T> w;
      Problem<T> pr;
      lvector<T> gdo, bq, bk, bv;
      const T* dO = nullptr;
      int64_t built = -1;
      for (const Piece& p : pieces) {
        if (p.bh != built) {
          pr.build(c, p.bh, true);  // every scheduled problem has a valid query and key
          dO = gather(dop + p.bh * Lq * Dv, pr.iq, Lq, Dv, pr.head.n, gdo);
          built = p.bh;
        }
        const Head<T>& h = pr.head;
        Dropout drop = dropout;
        drop.bh = p.bh;
        bq.resize(h.n * D);
        bk.resize(h.m * D);
        bv.resize(h.m * Dv);
        T se, sn;
        backward_head<T>(h, P, drop, dO, p.r0, p.r1, bq.data(), bk.data(), bv.data(), se, sn, w);
        T* dq_bh = dqp + p.bh * Lq * D;
        for (int64_t r = p.r0; r < p.r1; ++r)
          std::copy(bq.data() + r * D, bq.data() + (r + 1) * D, dq_bh + pr.iq[r] * D);
        if (p.r0 == 0 && p.r1 == h.n) {  // the whole problem
          scatter(bk.data(), pr.ik, D, dkp + p.bh * Lk * D);
          scatter(bv.data(), pr.ik, Dv, dvp + p.bh * Lk * Dv);
          dmep[p.bh] = -se;
          dmnp[p.bh] = -sn;
        } else {
          parts[t].push_back(Part{p.bh, bk, bv, se, sn});
        }
      }
    });
    // the cut problems, their parts added in thread order (dk, dv and the means are still zero there)
    for (const auto& thread_parts : parts)
      for (const Part& part : thread_parts) {
        const auto ik = valid_index(c.km, part.bh / heads, Lk);
        T* dk_bh = dkp + part.bh * Lk * D;
        T* dv_bh = dvp + part.bh * Lk * Dv;
        for (size_t j = 0; j < ik.size(); ++j) {
          for (int64_t d = 0; d < D; ++d) dk_bh[ik[j] * D + d] += part.dk[j * D + d];
          for (int64_t d = 0; d < Dv; ++d) dv_bh[ik[j] * Dv + d] += part.dv[j * Dv + d];
        }
        dmep[part.bh] -= part.se;
        dmnp[part.bh] -= part.sn;
      }
  });
  return {dq, dk, dv, dme, dmn};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(attnkit_cpu, m) {
  m.def("coda_forward", &coda_forward);
  m.def("coda_backward", &coda_backward);
}
