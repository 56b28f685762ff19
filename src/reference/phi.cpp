// Spec §2: the compression function phi and its gradients, in fp64.
#include <cmath>
#include <vector>

#include "nsa/blocks.h"
#include "reference/reference.h"

namespace nsa::reference {

namespace {

constexpr double kGeluC = 0.7978845608028654;  // sqrt(2 / pi), GELU's tanh form
constexpr double kGeluA = 0.044715;

double gelu(double x) { return 0.5 * x * (1.0 + std::tanh(kGeluC * (x + kGeluA * x * x * x))); }

double gelu_grad(double x) {
  const double th = std::tanh(kGeluC * (x + kGeluA * x * x * x));
  return 0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * kGeluC * (1.0 + 3.0 * kGeluA * x * x);
}

// u = flatten(block + pe) for compressed block starting at token row `first` of x, head h.
// For phi = mean the position embedding does not exist and u is the raw block.
std::vector<double> flatten_block(const Phi& phi, const Array& x, int64_t first, int64_t h, int64_t l) {
  const int64_t D = x.dim(2);
  std::vector<double> u(static_cast<size_t>(l * D));
  for (int64_t r = 0; r < l; ++r)
    for (int64_t c = 0; c < D; ++c)
      u[static_cast<size_t>(r * D + c)] =
          x.at(first + r, h)[c] + (phi.pe.numel() ? phi.pe.data[static_cast<size_t>(r * D + c)] : 0.0);
  return u;
}

// y = W u for W [rows, cols] (row-major).
void matvec(const Array& w, const std::vector<double>& u, std::vector<double>& y) {
  const int64_t rows = w.dim(0), cols = w.dim(1);
  y.assign(static_cast<size_t>(rows), 0.0);
  for (int64_t i = 0; i < rows; ++i) {
    double s = 0.0;
    for (int64_t j = 0; j < cols; ++j) s += w.data[static_cast<size_t>(i * cols + j)] * u[static_cast<size_t>(j)];
    y[static_cast<size_t>(i)] = s;
  }
}

// Calls fn(first_token_row, compressed_row) for every compressed block of every sequence.
template <typename Fn>
void for_each_block(const detail::Plan& p, Fn fn) {
  const int64_t l = p.cfg.cmp_block_len, d = p.cfg.cmp_stride;
  for (int64_t b = 0; b < p.B; ++b) {
    const int64_t s0 = p.seq_start(b);
    const int64_t nc = num_cmp_blocks(p.seq_len(b), l, d);
    for (int64_t i = 0; i < nc; ++i) fn(s0 + i * d, cmp_row_offset(s0, d) + i);
  }
}

}  // namespace

Array phi_forward(const detail::Plan& p, const Phi& phi, const Array& x) {
  const int64_t H = x.dim(1), D = x.dim(2), l = p.cfg.cmp_block_len;
  Array xc({cmp_rows(p.T, p.cfg.cmp_stride), H, D});
  for_each_block(p, [&](int64_t first, int64_t row) {
    for (int64_t h = 0; h < H; ++h) {
      double* y = xc.at(row, h);
      const std::vector<double> u = flatten_block(phi, x, first, h, l);
      std::vector<double> out;
      switch (p.cfg.phi) {
        case PhiKind::mean:
          for (int64_t c = 0; c < D; ++c) {
            double s = 0.0;
            for (int64_t r = 0; r < l; ++r) s += u[static_cast<size_t>(r * D + c)];
            y[c] = s / static_cast<double>(l);
          }
          break;
        case PhiKind::linear:
          matvec(phi.w1, u, out);
          for (int64_t c = 0; c < D; ++c) y[c] = out[static_cast<size_t>(c)];
          break;
        case PhiKind::mlp: {
          std::vector<double> hidden;
          matvec(phi.w1, u, hidden);
          for (size_t f = 0; f < hidden.size(); ++f) hidden[f] = gelu(hidden[f] + phi.b1.data[f]);
          matvec(phi.w2, hidden, out);
          for (int64_t c = 0; c < D; ++c) y[c] = out[static_cast<size_t>(c)] + phi.b2.data[static_cast<size_t>(c)];
          break;
        }
      }
    }
  });
  return xc;
}

void phi_backward(const detail::Plan& p, const Phi& phi, const Array& x, const Array& dxc, Array& dx,
                  Phi& dphi) {
  const int64_t H = x.dim(1), D = x.dim(2), l = p.cfg.cmp_block_len;
  dx = Array(x.shape);
  dphi = zeros_like(phi);
  for_each_block(p, [&](int64_t first, int64_t row) {
    for (int64_t h = 0; h < H; ++h) {
      const double* dy = dxc.at(row, h);
      std::vector<double> du(static_cast<size_t>(l * D), 0.0);  // dLoss / d flatten(block + pe)
      switch (p.cfg.phi) {
        case PhiKind::mean:
          for (int64_t r = 0; r < l; ++r)
            for (int64_t c = 0; c < D; ++c) du[static_cast<size_t>(r * D + c)] = dy[c] / static_cast<double>(l);
          break;
        case PhiKind::linear: {
          const std::vector<double> u = flatten_block(phi, x, first, h, l);
          const int64_t cols = l * D;
          for (int64_t i = 0; i < D; ++i)
            for (int64_t j = 0; j < cols; ++j) {
              dphi.w1.data[static_cast<size_t>(i * cols + j)] += dy[i] * u[static_cast<size_t>(j)];
              du[static_cast<size_t>(j)] += phi.w1.data[static_cast<size_t>(i * cols + j)] * dy[i];
            }
          break;
        }
        case PhiKind::mlp: {
          const std::vector<double> u = flatten_block(phi, x, first, h, l);
          const int64_t F = phi.w1.dim(0), cols = l * D;
          std::vector<double> pre;  // W1 u + b1
          matvec(phi.w1, u, pre);
          for (int64_t f = 0; f < F; ++f) pre[static_cast<size_t>(f)] += phi.b1.data[static_cast<size_t>(f)];
          std::vector<double> dpre(static_cast<size_t>(F), 0.0);
          for (int64_t c = 0; c < D; ++c) {
            dphi.b2.data[static_cast<size_t>(c)] += dy[c];
            for (int64_t f = 0; f < F; ++f) {
              dphi.w2.data[static_cast<size_t>(c * F + f)] += dy[c] * gelu(pre[static_cast<size_t>(f)]);
              dpre[static_cast<size_t>(f)] += phi.w2.data[static_cast<size_t>(c * F + f)] * dy[c];
            }
          }
          for (int64_t f = 0; f < F; ++f) {
            dpre[static_cast<size_t>(f)] *= gelu_grad(pre[static_cast<size_t>(f)]);
            dphi.b1.data[static_cast<size_t>(f)] += dpre[static_cast<size_t>(f)];
            for (int64_t j = 0; j < cols; ++j) {
              dphi.w1.data[static_cast<size_t>(f * cols + j)] += dpre[static_cast<size_t>(f)] * u[static_cast<size_t>(j)];
              du[static_cast<size_t>(j)] += phi.w1.data[static_cast<size_t>(f * cols + j)] * dpre[static_cast<size_t>(f)];
            }
          }
          break;
        }
      }
      // The block rows and the position embedding both enter through u = block + pe.
      for (int64_t r = 0; r < l; ++r)
        for (int64_t c = 0; c < D; ++c) {
          const double g = du[static_cast<size_t>(r * D + c)];
          dx.at(first + r, h)[c] += g;
          if (p.cfg.phi != PhiKind::mean) dphi.pe.data[static_cast<size_t>(r * D + c)] += g;
        }
    }
  });
}

}  // namespace nsa::reference
