// L1 distances for CoDA's gate on the CPU, forward and backward ("Compositional De-Attention Networks",
// eq. (10); docs/design.md section 3):
//
//     dist_ij = sum_d |x_id - y_jd|
//     dx_id   =  sum_j G_ij sign(x_id - y_jd),    dy_jd = -sum_i G_ij sign(x_id - y_jd)
//
// torch.cdist(p=1) has no matrix-product form and handles one pair at a time. Here the keys are
// transposed to (D, m), so a register tile of kRows queries x 2 vectors of keys accumulates |x - y|
// lane-wise over d with no horizontal sums; the backward pass reuses the same tiles for the signs.
// Parallel over (batch*head, query chunk); the backward pass gives each query chunk its own dy
// partial only when the batch*head problems are fewer than the threads.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

namespace {

constexpr int64_t kRows = 4;      // queries per register tile
constexpr int64_t kChunk = 64;    // queries per task

template <typename T>
using Vec = at::vec::Vectorized<T>;

// yT (D, mp) = y (m, D) transposed, columns m..mp zero.
template <typename T>
void transpose_keys(const T* y, int64_t m, int64_t D, int64_t mp, std::vector<T>& yT) {
  yT.assign(D * mp, T(0));
  for (int64_t j = 0; j < m; ++j)
    for (int64_t d = 0; d < D; ++d) yT[d * mp + j] = y[j * D + d];
}

template <typename T>
void forward_rows(const T* x, int64_t rows, int64_t D, const T* yT, int64_t m, int64_t mp, T* out) {
  constexpr int64_t W = Vec<T>::size();
  T tmp[2 * W];
  for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
    const int64_t nr = std::min(kRows, rows - r0);
    for (int64_t j0 = 0; j0 < mp; j0 += 2 * W) {
      Vec<T> acc[kRows][2];
      for (int64_t r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = Vec<T>(T(0));
      for (int64_t d = 0; d < D; ++d) {
        const Vec<T> y0 = Vec<T>::loadu(yT + d * mp + j0);
        const Vec<T> y1 = Vec<T>::loadu(yT + d * mp + j0 + W);
        for (int64_t r = 0; r < kRows; ++r) {
          if (r < nr) {
            const Vec<T> xb(x[(r0 + r) * D + d]);
            acc[r][0] = acc[r][0] + (xb - y0).abs();
            acc[r][1] = acc[r][1] + (xb - y1).abs();
          }
        }
      }
      const int64_t nj = std::min(2 * W, m - j0);
      for (int64_t r = 0; r < nr; ++r) {
        T* o = out + (r0 + r) * m + j0;
        if (nj == 2 * W) {
          acc[r][0].store(o);
          acc[r][1].store(o + W);
        } else {
          acc[r][0].store(tmp);
          acc[r][1].store(tmp + W);
          std::copy(tmp, tmp + nj, o);
        }
      }
    }
  }
}

// dx rows (rows, D) = sum_j G sign(x - y); dyT (D, mp) -= sum_i G sign(x - y). G is (rows, m).
template <typename T>
void backward_rows(const T* g, const T* x, int64_t rows, int64_t D, const T* yT, int64_t m, int64_t mp, T* dx,
                   T* dyT, std::vector<T>& gpad, std::vector<Vec<T>>& dxv) {
  constexpr int64_t W = Vec<T>::size();
  const Vec<T> zero(T(0));
  gpad.assign(kRows * 2 * W, T(0));
  dxv.assign(kRows * D, zero);
  for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
    const int64_t nr = std::min(kRows, rows - r0);
    std::fill(dxv.begin(), dxv.end(), zero);
    for (int64_t j0 = 0; j0 < mp; j0 += 2 * W) {
      const int64_t nj = std::min(2 * W, m - j0);
      Vec<T> gv[kRows][2];
      for (int64_t r = 0; r < kRows; ++r) {
        if (r < nr) {
          const T* gr = g + (r0 + r) * m + j0;
          if (nj == 2 * W) {
            gv[r][0] = Vec<T>::loadu(gr);
            gv[r][1] = Vec<T>::loadu(gr + W);
          } else {
            std::fill(gpad.begin(), gpad.end(), T(0));
            std::copy(gr, gr + nj, gpad.begin());
            gv[r][0] = Vec<T>::loadu(gpad.data());
            gv[r][1] = Vec<T>::loadu(gpad.data() + W);
          }
        } else {
          gv[r][0] = gv[r][1] = zero;
        }
      }
      for (int64_t d = 0; d < D; ++d) {
        const Vec<T> y0 = Vec<T>::loadu(yT + d * mp + j0);
        const Vec<T> y1 = Vec<T>::loadu(yT + d * mp + j0 + W);
        Vec<T> dy0 = zero, dy1 = zero;
        for (int64_t r = 0; r < nr; ++r) {
          const Vec<T> xb(x[(r0 + r) * D + d]);
          const Vec<T> e0 = xb - y0, e1 = xb - y1;
          // G * sign(e): +G where e > 0, -G where e < 0, 0 at ties
          const Vec<T> t0 = (gv[r][0] & (e0 > zero)) - (gv[r][0] & (e0 < zero));
          const Vec<T> t1 = (gv[r][1] & (e1 > zero)) - (gv[r][1] & (e1 < zero));
          dxv[r * D + d] = dxv[r * D + d] + t0 + t1;
          dy0 = dy0 + t0;
          dy1 = dy1 + t1;
        }
        T* dyr = dyT + d * mp + j0;
        (Vec<T>::loadu(dyr) - dy0).store(dyr);
        (Vec<T>::loadu(dyr + W) - dy1).store(dyr + W);
      }
    }
    for (int64_t r = 0; r < nr; ++r)
      for (int64_t d = 0; d < D; ++d)
        dx[(r0 + r) * D + d] =
            at::vec::vec_reduce_all<T>([](const Vec<T>& a, const Vec<T>& b) { return a + b; }, dxv[r * D + d]);
  }
}

void check(const at::Tensor& x, const at::Tensor& y) {
  TORCH_CHECK(x.device().is_cpu() && y.device().is_cpu(), "CPU tensors expected");
  TORCH_CHECK(x.dim() == 3 && y.dim() == 3 && x.size(0) == y.size(0) && x.size(2) == y.size(2),
              "x (N, n, D) and y (N, m, D) expected");
  TORCH_CHECK(x.scalar_type() == y.scalar_type() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble),
              "float32 or float64 x, y of one dtype expected");
  TORCH_CHECK(x.is_contiguous() && y.is_contiguous(), "contiguous x, y expected");
}

at::Tensor l1_distance(const at::Tensor& x, const at::Tensor& y) {
  check(x, y);
  const int64_t N = x.size(0), n = x.size(1), m = y.size(1), D = x.size(2);
  auto out = at::empty({N, n, m}, x.options());
  if (n == 0 || m == 0) return out;
  if (D == 0) return out.zero_();
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "l1_distance", [&] {
    using T = scalar_t;
    constexpr int64_t W = Vec<T>::size();
    const int64_t mp = (m + 2 * W - 1) / (2 * W) * (2 * W);
    const int64_t chunks = (n + kChunk - 1) / kChunk;
    const T* xp = x.data_ptr<T>();
    const T* yp = y.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, N * chunks, 1, [&](int64_t begin, int64_t end) {
      std::vector<T> yT;
      int64_t have = -1;
      for (int64_t task = begin; task < end; ++task) {
        const int64_t b = task / chunks, i0 = (task % chunks) * kChunk;
        if (b != have) {
          transpose_keys(yp + b * m * D, m, D, mp, yT);
          have = b;
        }
        forward_rows(xp + (b * n + i0) * D, std::min(kChunk, n - i0), D, yT.data(), m, mp, op + (b * n + i0) * m);
      }
    });
  });
  return out;
}

std::vector<at::Tensor> l1_distance_backward(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& y) {
  check(x, y);
  const int64_t N = x.size(0), n = x.size(1), m = y.size(1), D = x.size(2);
  TORCH_CHECK(grad.dim() == 3 && grad.size(0) == N && grad.size(1) == n && grad.size(2) == m &&
                  grad.scalar_type() == x.scalar_type(),
              "grad must be (N, n, m) of x's dtype");
  auto g = grad.contiguous();
  auto dx = at::zeros_like(x);
  auto dy = at::zeros_like(y);
  if (N == 0 || n == 0 || m == 0 || D == 0) return {dx, dy};
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "l1_distance_backward", [&] {
    using T = scalar_t;
    constexpr int64_t W = Vec<T>::size();
    const int64_t mp = (m + 2 * W - 1) / (2 * W) * (2 * W);
    const T* gp = g.data_ptr<T>();
    const T* xp = x.data_ptr<T>();
    const T* yp = y.data_ptr<T>();
    T* dxp = dx.data_ptr<T>();
    T* dyp = dy.data_ptr<T>();
    // parts: query ranges per problem, each with its own dy partial; 1 when the problems fill the threads
    const int64_t threads = at::get_num_threads();
    const int64_t parts = std::max<int64_t>(1, std::min((threads + N - 1) / N, (n + kChunk - 1) / kChunk));
    const int64_t rows_per = (n + parts - 1) / parts;
    std::vector<T> partial(N * parts * D * mp, T(0));  // (N, parts, D, mp): dy transposed
    at::parallel_for(0, N * parts, 1, [&](int64_t begin, int64_t end) {
      std::vector<T> yT, gpad;
      std::vector<Vec<T>> dxv;
      for (int64_t task = begin; task < end; ++task) {
        const int64_t b = task / parts, p = task % parts;
        const int64_t i0 = p * rows_per, i1 = std::min(n, i0 + rows_per);
        if (i0 >= i1) continue;
        transpose_keys(yp + b * m * D, m, D, mp, yT);
        T* dyT = partial.data() + task * D * mp;
        for (int64_t c0 = i0; c0 < i1; c0 += kChunk) {
          const int64_t rows = std::min(kChunk, i1 - c0);
          backward_rows(gp + (b * n + c0) * m, xp + (b * n + c0) * D, rows, D, yT.data(), m, mp,
                        dxp + (b * n + c0) * D, dyT, gpad, dxv);
        }
      }
    });
    at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b)
        for (int64_t p = 0; p < parts; ++p) {
          const T* dyT = partial.data() + (b * parts + p) * D * mp;
          for (int64_t j = 0; j < m; ++j)
            for (int64_t d = 0; d < D; ++d) dyp[(b * m + j) * D + d] += dyT[d * mp + j];
        }
    });
  });
  return {dx, dy};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(attnkit_cpu, m) {
  m.def("l1_distance", &l1_distance);
  m.def("l1_distance_backward", &l1_distance_backward);
}
