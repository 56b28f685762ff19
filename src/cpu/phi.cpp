// phi (spec §2) and its gradients on the CPU backend.
//
// An item is one (compressed block, KV head). Items are processed kPhiTile at a time: the tile's
// inputs u = flatten(block + pe) form U [tile, l*D], and phi is two small matrix products with
// the weights packed once per call (transposed, fp32, columns padded). Gradients of the weights
// are sums over all items; they are computed output-tile by output-tile with the items in a fixed
// order, so they do not depend on the number of threads.
#include "cpu/phi.h"

#include <cmath>

#include "cpu/ops.h"
#include "nsa/blocks.h"

namespace nsa::cpu {

namespace {

constexpr float kGeluC = 0.7978845608028654f;  // sqrt(2 / pi), GELU's tanh form
constexpr float kGeluA = 0.044715f;

inline float gelu(float x) { return 0.5f * x * (1.0f + std::tanh(kGeluC * (x + kGeluA * x * x * x))); }
inline float gelu_grad(float x) {
  const float th = std::tanh(kGeluC * (x + kGeluA * x * x * x));
  return 0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * kGeluC * (1.0f + 3.0f * kGeluA * x * x);
}

// Columns of dW tiles in the weight-gradient pass.
constexpr int64_t kGradCols = 128;

struct PhiShape {
  PhiKind kind = PhiKind::mean;
  int64_t l = 1, d = 1, H = 1, D = 1, F = 0;
  int64_t lD = 1, lDp = 32, Fa = 0, Fap = 32, Dp = 32;  // Fa: rows of the first weight (F or D)
  int64_t blocks = 0;                                    // upper bound of compressed blocks
};

PhiShape shape_of(const Config& cfg, int64_t T, int64_t B, int64_t H, int64_t D, int64_t F) {
  PhiShape s;
  s.kind = cfg.phi;
  s.l = cfg.cmp_block_len;
  s.d = cfg.cmp_stride;
  s.H = H;
  s.D = D;
  s.F = cfg.phi == PhiKind::mlp ? F : 0;
  s.lD = s.l * D;
  s.lDp = pad_cols(s.lD);
  s.Fa = cfg.phi == PhiKind::mlp ? s.F : D;
  s.Fap = pad_cols(std::max<int64_t>(s.Fa, 1));
  s.Dp = pad_cols(D);
  s.blocks = cmp_rows(T, s.d) + B;
  return s;
}

struct Shared {
  int64_t* block_row;    // [blocks] packed compressed row
  int64_t* block_first;  // [blocks] packed token row of the block's first token
  float* w1t;            // [lD][Fap]   first layer, transposed (linear: W^T)
  float* w2t;            // [F][Dp]     second layer, transposed (mlp)
  float* w1n;            // [Fa][lDp]   first layer, natural (backward: dU = dA . W1)
  float* w2n;            // [D][Fap]    second layer, natural (backward: dH = dY . W2)
  float* b1;             // [Fap]
  float* b2;             // [Dp]
  float* pe;             // [lD]
  // backward only
  float* da;             // [items][Fap]  dPre (mlp) or dY (linear)
  float* hh;             // [items][Fap]  gelu(pre) (mlp)
  float* du;             // [items][lDp]  dLoss/du
  float* dat;            // [Fa][items_p] da transposed
  float* dyt;            // [D][items_p]  dY transposed
};

template <typename A>
Shared layout_shared(A& a, const PhiShape& s, bool backward) {
  Shared sh{};
  sh.block_row = a.template take<int64_t>(s.blocks);
  sh.block_first = a.template take<int64_t>(s.blocks);
  if (s.kind == PhiKind::mean) return sh;
  sh.w1t = a.template take<float>(s.lD * s.Fap);
  sh.w1n = a.template take<float>(s.Fa * s.lDp);
  sh.pe = a.template take<float>(s.lD);
  if (s.kind == PhiKind::mlp) {
    sh.w2t = a.template take<float>(s.F * s.Dp);
    sh.w2n = a.template take<float>(s.D * s.Fap);
    sh.b1 = a.template take<float>(s.Fap);
    sh.b2 = a.template take<float>(s.Dp);
  }
  if (backward) {
    const int64_t items = s.blocks * s.H, items_p = pad_cols(items);
    sh.da = a.template take<float>(items * s.Fap);
    if (s.kind == PhiKind::mlp) sh.hh = a.template take<float>(items * s.Fap);
    sh.du = a.template take<float>(items * s.lDp);
    sh.dat = a.template take<float>(s.Fa * items_p);
    sh.dyt = a.template take<float>(s.D * items_p);
  }
  return sh;
}

struct Slot {
  float* u;      // [kPhiTile][lD]
  float* pre;    // [kPhiTile][Fap]
  float* hid;    // [kPhiTile][Fap]
  float* y;      // [kPhiTile][Dp]
  float* dy;     // [kPhiTile][D]
  float* ucols;  // [kPhiTile][kGradCols]
  float* wacc;   // [Fap][kGradCols]
};

template <typename A>
Slot layout_slot(A& a, const PhiShape& s) {
  Slot sl{};
  sl.u = a.template take<float>(kPhiTile * s.lD);
  sl.pre = a.template take<float>(kPhiTile * s.Fap);
  sl.hid = a.template take<float>(kPhiTile * s.Fap);
  sl.y = a.template take<float>(kPhiTile * std::max(s.Dp, s.lDp));
  sl.dy = a.template take<float>(kPhiTile * s.D);
  sl.ucols = a.template take<float>(kPhiTile * kGradCols);
  sl.wacc = a.template take<float>(s.Fap * kGradCols);
  return sl;
}

// Reads a 2-D float view [rows, cols] into dst with leading dimension ld (zero padding), or its
// transpose (dst[c * ld + r]).
void load_matrix(const TensorView& t, float* dst, int64_t ld, bool transposed, int64_t pad_rows_to) {
  const int64_t rows = t.shape[0], cols = t.ndim > 1 ? t.shape[1] : 1;
  const int64_t s0 = t.stride[0], s1 = t.ndim > 1 ? t.stride[1] : 1;
  if (!transposed) {
    for (int64_t r = 0; r < pad_rows_to; ++r)
      for (int64_t c = 0; c < ld; ++c) dst[r * ld + c] = (r < rows && c < cols) ? load_scalar(t, r * s0 + c * s1) : 0.0f;
  } else {
    for (int64_t c = 0; c < cols; ++c)
      for (int64_t r = 0; r < ld; ++r) dst[c * ld + r] = r < rows ? load_scalar(t, r * s0 + c * s1) : 0.0f;
  }
}

// Lists every compressed block: its packed row and its first packed token. Returns the count.
int64_t list_blocks(const Plan& p, const PhiShape& s, Shared& sh) {
  int64_t count = 0;
  for (int64_t b = 0; b < p.B; ++b) {
    const int64_t s0 = p.seq_start(b), nc = num_cmp_blocks(p.seq_len(b), s.l, s.d);
    for (int64_t i = 0; i < nc; ++i) {
      sh.block_row[count] = cmp_row_offset(s0, s.d) + i;
      sh.block_first[count] = s0 + i * s.d;
      ++count;
    }
  }
  return count;
}

void pack_weights(const PhiParams& phi, const PhiShape& s, Shared& sh) {
  if (s.kind == PhiKind::mean) return;
  load_matrix(phi.w1, sh.w1t, s.Fap, /*transposed=*/true, 0);      // [lD][Fap]
  load_matrix(phi.w1, sh.w1n, s.lDp, /*transposed=*/false, s.Fa);  // [Fa][lDp]
  for (int64_t i = 0; i < s.lD; ++i)
    sh.pe[i] = load_scalar(phi.pe, (i / s.D) * phi.pe.stride[0] + (i % s.D) * phi.pe.stride[1]);
  if (s.kind == PhiKind::mlp) {
    load_matrix(phi.w2, sh.w2t, s.Dp, true, 0);     // [F][Dp]
    load_matrix(phi.w2, sh.w2n, s.Fap, false, s.D); // [D][Fap]
    for (int64_t f = 0; f < s.Fap; ++f) sh.b1[f] = f < s.F ? load_scalar(phi.b1, f * phi.b1.stride[0]) : 0.0f;
    for (int64_t c = 0; c < s.Dp; ++c) sh.b2[c] = c < s.D ? load_scalar(phi.b2, c * phi.b2.stride[0]) : 0.0f;
  }
}

// U rows of items [i0, i0 + m): u = flatten(block + pe) (pe absent for mean).
void build_u(const Rows& x, const PhiShape& s, const Shared& sh, int64_t i0, int64_t m, float* u) {
  for (int64_t k = 0; k < m; ++k) {
    const int64_t item = i0 + k, blk = item / s.H, h = item % s.H;
    float* row = u + k * s.lD;
    for (int64_t r = 0; r < s.l; ++r) x.load(sh.block_first[blk] + r, h, row + r * s.D);
    if (s.kind != PhiKind::mean)
      for (int64_t e = 0; e < s.lD; ++e) row[e] += sh.pe[e];
  }
}

// The hidden layer of an mlp tile: pre = U W1^T + b1 and hid = gelu(pre).
void hidden_layer(const PhiShape& s, const Shared& sh, int64_t m, Slot& sl) {
  kernels().gemm(m, s.Fap, s.lD, sl.u, s.lD, sh.w1t, s.Fap, sl.pre, s.Fap, false);
  for (int64_t k = 0; k < m; ++k)
    for (int64_t f = 0; f < s.Fap; ++f) {
      float& pre = sl.pre[k * s.Fap + f];
      pre += sh.b1[f];
      sl.hid[k * s.Fap + f] = f < s.F ? gelu(pre) : 0.0f;
    }
}

}  // namespace

void phi_sizes(const Config& cfg, int64_t T, int64_t B, int64_t H, int64_t D, int64_t F, bool backward,
               Sizer& shared, Sizer& slot) {
  const PhiShape s = shape_of(cfg, T, B, H, D, F);
  layout_shared(shared, s, backward);
  layout_slot(slot, s);
}

void phi_forward(const Plan& p, const PhiParams& phi, const TensorView& x, float* xc, Arena& shared,
                 const Slots& slots) {
  const int64_t F = p.cfg.phi == PhiKind::mlp ? phi.w1.shape[0] : 0;
  const PhiShape s = shape_of(p.cfg, p.T, p.B, x.shape[1], x.shape[2], F);
  Shared sh = layout_shared(shared, s, false);
  const int64_t nblocks = list_blocks(p, s, sh);
  pack_weights(phi, s, sh);
  const Rows xr = Rows::of(x);
  const int64_t items = nblocks * s.H;
  const KernelTable& K = kernels();
  parallel_for((items + kPhiTile - 1) / kPhiTile, slots, [&](int64_t tile, Arena arena) {
    Slot sl = layout_slot(arena, s);
    const int64_t i0 = tile * kPhiTile, m = std::min(kPhiTile, items - i0);
    build_u(xr, s, sh, i0, m, sl.u);
    switch (s.kind) {
      case PhiKind::mean:
        for (int64_t k = 0; k < m; ++k) {
          float* y = sl.y + k * s.Dp;
          std::fill(y, y + s.D, 0.0f);
          for (int64_t r = 0; r < s.l; ++r)
            for (int64_t c = 0; c < s.D; ++c) y[c] += sl.u[k * s.lD + r * s.D + c];
          for (int64_t c = 0; c < s.D; ++c) y[c] /= static_cast<float>(s.l);
        }
        break;
      case PhiKind::linear: K.gemm(m, s.Fap, s.lD, sl.u, s.lD, sh.w1t, s.Fap, sl.y, s.Dp, false); break;
      case PhiKind::mlp:
        hidden_layer(s, sh, m, sl);
        K.gemm(m, s.Dp, s.F, sl.hid, s.Fap, sh.w2t, s.Dp, sl.y, s.Dp, false);
        for (int64_t k = 0; k < m; ++k)
          for (int64_t c = 0; c < s.D; ++c) sl.y[k * s.Dp + c] += sh.b2[c];
        break;
    }
    for (int64_t k = 0; k < m; ++k) {
      const int64_t item = i0 + k, blk = item / s.H, h = item % s.H;
      std::copy(sl.y + k * s.Dp, sl.y + k * s.Dp + s.D, xc + (sh.block_row[blk] * s.H + h) * s.D);
    }
  });
}

void phi_backward(const Plan& p, const PhiParams& phi, const TensorView& x, const float* dxc,
                  const TensorView& dx, float* dx_acc, const PhiParams& dphi, Arena& shared,
                  const Slots& slots) {
  const int64_t F = p.cfg.phi == PhiKind::mlp ? phi.w1.shape[0] : 0;
  const PhiShape s = shape_of(p.cfg, p.T, p.B, x.shape[1], x.shape[2], F);
  Shared sh = layout_shared(shared, s, true);
  const int64_t nblocks = list_blocks(p, s, sh);
  const Rows xr = Rows::of(x);
  const KernelTable& K = kernels();
  const int64_t H = s.H, D = s.D, l = s.l, d = s.d;

  // dx of one packed token row (all heads): the sum over the blocks that cover it, in order.
  // For mean the block gradient is dy / l on every row; otherwise dU from the pass below.
  auto gather_dx = [&](const float* du_or_null) {
    parallel_for(p.B, slots, [&](int64_t b, Arena arena) {
      float* acc = arena.take<float>(D);
      const int64_t s0 = p.seq_start(b), len = p.seq_len(b), nc = num_cmp_blocks(len, l, d);
      const int64_t row0 = cmp_row_offset(s0, d);
      int64_t first_item_block = 0;  // index of this sequence's first block in the block list
      for (int64_t bb = 0; bb < b; ++bb) first_item_block += num_cmp_blocks(p.seq_len(bb), l, d);
      for (int64_t t = 0; t < len; ++t)
        for (int64_t h = 0; h < H; ++h) {
          std::fill(acc, acc + D, 0.0f);
          // Blocks i with i*d <= t <= i*d + l - 1.
          const int64_t i_lo = t >= l ? (t - l) / d + 1 : 0, i_hi = std::min(t / d, nc - 1);
          for (int64_t i = i_lo; i <= i_hi; ++i) {
            const int64_t r = t - i * d;
            if (du_or_null == nullptr) {
              const float* dy = dxc + ((row0 + i) * H + h) * D;
              for (int64_t c = 0; c < D; ++c) acc[c] += dy[c] / static_cast<float>(l);
            } else {
              const float* du = du_or_null + ((first_item_block + i) * H + h) * s.lDp + r * D;
              for (int64_t c = 0; c < D; ++c) acc[c] += du[c];
            }
          }
          if (dx_acc != nullptr) {
            float* out = dx_acc + ((s0 + t) * H + h) * D;
            for (int64_t c = 0; c < D; ++c) out[c] += acc[c];
          } else {
            store_row(dx, s0 + t, h, acc, D);
          }
        }
    });
  };
  if (s.kind == PhiKind::mean) {
    gather_dx(nullptr);
    return;
  }
  pack_weights(phi, s, sh);
  const int64_t items = nblocks * H, items_p = pad_cols(std::max<int64_t>(items, 1));

  // Pass 1 (item tiles): da = dPre (mlp) or dY (linear), hid, and dU = da . W1.
  parallel_for((items + kPhiTile - 1) / kPhiTile, slots, [&](int64_t tile, Arena arena) {
    Slot sl = layout_slot(arena, s);
    const int64_t i0 = tile * kPhiTile, m = std::min(kPhiTile, items - i0);
    for (int64_t k = 0; k < m; ++k) {
      const int64_t item = i0 + k, blk = item / H, h = item % H;
      std::copy(dxc + (sh.block_row[blk] * H + h) * D, dxc + (sh.block_row[blk] * H + h) * D + D, sl.dy + k * D);
    }
    float* da = sh.da + i0 * s.Fap;
    if (s.kind == PhiKind::mlp) {
      build_u(xr, s, sh, i0, m, sl.u);
      hidden_layer(s, sh, m, sl);
      K.gemm(m, s.Fap, D, sl.dy, D, sh.w2n, s.Fap, da, s.Fap, false);  // dH = dY . W2
      for (int64_t k = 0; k < m; ++k)
        for (int64_t f = 0; f < s.Fap; ++f) {
          da[k * s.Fap + f] = f < s.F ? da[k * s.Fap + f] * gelu_grad(sl.pre[k * s.Fap + f]) : 0.0f;
          sh.hh[(i0 + k) * s.Fap + f] = sl.hid[k * s.Fap + f];
        }
    } else {
      for (int64_t k = 0; k < m; ++k)
        for (int64_t f = 0; f < s.Fap; ++f) da[k * s.Fap + f] = f < D ? sl.dy[k * D + f] : 0.0f;
    }
    K.gemm(m, s.lDp, s.Fa, da, s.Fap, sh.w1n, s.lDp, sh.du + i0 * s.lDp, s.lDp, false);
  });

  // dx (and the shared-KV accumulation) from dU.
  gather_dx(sh.du);

  // Transposes for the weight gradients (items become the reduction dimension).
  for (int64_t f = 0; f < s.Fa; ++f) {
    for (int64_t it = 0; it < items; ++it) sh.dat[f * items_p + it] = sh.da[it * s.Fap + f];
    std::fill(sh.dat + f * items_p + items, sh.dat + (f + 1) * items_p, 0.0f);
  }
  for (int64_t c = 0; c < D; ++c) {
    for (int64_t it = 0; it < items; ++it) {
      const int64_t blk = it / H, h = it % H;
      sh.dyt[c * items_p + it] = dxc[(sh.block_row[blk] * H + h) * D + c];
    }
    std::fill(sh.dyt + c * items_p + items, sh.dyt + (c + 1) * items_p, 0.0f);
  }

  // dW1 [Fa][lD] = sum_items da (x) u, in column tiles; each tile reduces the items in order.
  const int64_t col_tiles = (s.lD + kGradCols - 1) / kGradCols;
  parallel_for(col_tiles, slots, [&](int64_t ct, Arena arena) {
    Slot sl = layout_slot(arena, s);
    float* acc = sl.wacc;
    const int64_t c0 = ct * kGradCols, cw = std::min(kGradCols, s.lD - c0);
    std::fill(acc, acc + s.Fa * kGradCols, 0.0f);
    for (int64_t i0 = 0; i0 < items; i0 += kPhiTile) {
      const int64_t m = std::min(kPhiTile, items - i0);
      // The u columns [c0, c0 + cw) of each item: block rows c0/D .. (c0+cw-1)/D, plus pe.
      const int64_t r_lo = c0 / D, r_hi = (c0 + cw - 1) / D;
      for (int64_t k = 0; k < m; ++k) {
        const int64_t item = i0 + k, blk = item / H, h = item % H;
        float* row = sl.ucols + k * kGradCols;
        std::fill(row, row + kGradCols, 0.0f);
        for (int64_t r = r_lo; r <= r_hi; ++r) {
          xr.load(sh.block_first[blk] + r, h, sl.y);
          const int64_t a = std::max(c0, r * D), b = std::min(c0 + cw, (r + 1) * D);
          for (int64_t col = a; col < b; ++col) row[col - c0] = sl.y[col - r * D] + sh.pe[col];
        }
      }
      K.gemm(s.Fa, kGradCols, m, sh.dat + i0, items_p, sl.ucols, kGradCols, acc, kGradCols, true);
    }
    for (int64_t f = 0; f < s.Fa; ++f)
      for (int64_t e = 0; e < cw; ++e)
        store_scalar(dphi.w1, f * dphi.w1.stride[0] + (c0 + e) * dphi.w1.stride[1], acc[f * kGradCols + e]);
  });

  // dpe [l][D] = sum_items dU (both the block and pe enter through u = block + pe).
  parallel_for((s.lD + kGradCols - 1) / kGradCols, slots, [&](int64_t ct, Arena arena) {
    float* acc = arena.take<float>(kGradCols);
    const int64_t c0 = ct * kGradCols, cw = std::min(kGradCols, s.lD - c0);
    std::fill(acc, acc + kGradCols, 0.0f);
    for (int64_t it = 0; it < items; ++it)
      for (int64_t e = 0; e < cw; ++e) acc[e] += sh.du[it * s.lDp + c0 + e];
    for (int64_t e = 0; e < cw; ++e) {
      const int64_t col = c0 + e;
      store_scalar(dphi.pe, (col / D) * dphi.pe.stride[0] + (col % D) * dphi.pe.stride[1], acc[e]);
    }
  });

  if (s.kind != PhiKind::mlp) return;
  // dW2 [D][F] = dY^T . hid; db1 = sum dPre; db2 = sum dY (one thread each: small).
  Arena arena = slots.slot(0);
  float* dw2 = arena.take<float>(D * s.Fap);
  K.gemm(D, s.Fap, items, sh.dyt, items_p, sh.hh, s.Fap, dw2, s.Fap, false);
  for (int64_t c = 0; c < D; ++c)
    for (int64_t f = 0; f < s.F; ++f) store_scalar(dphi.w2, c * dphi.w2.stride[0] + f * dphi.w2.stride[1], dw2[c * s.Fap + f]);
  for (int64_t f = 0; f < s.F; ++f) {
    float acc = 0.0f;
    for (int64_t it = 0; it < items; ++it) acc += sh.da[it * s.Fap + f];
    store_scalar(dphi.b1, f * dphi.b1.stride[0], acc);
  }
  for (int64_t c = 0; c < D; ++c) {
    float acc = 0.0f;
    for (int64_t it = 0; it < items; ++it) acc += sh.dyt[c * items_p + it];
    store_scalar(dphi.b2, c * dphi.b2.stride[0], acc);
  }
}

}  // namespace nsa::cpu

// ---- phi of a few items: no packed weights -----------------------------------------------------

namespace nsa::cpu {

namespace {

struct RowsLayout {
  float* u;       // [items][lD] flatten(block + pe), fp32
  float* hidden;  // [items][F] (mlp)
};

template <typename A>
RowsLayout layout_rows(A& a, int64_t items, int64_t lD, int64_t F) {
  RowsLayout r;
  r.u = a.template take<float>(items * lD);
  r.hidden = a.template take<float>(items * F);
  return r;
}

// Row n of a weight [rows, cols] (the caller's dtype) as fp32.
void weight_row(const TensorView& w, int64_t n, float* dst) {
  Rows r;
  r.base = static_cast<const char*>(w.data);
  r.dtype = w.dtype;
  r.row_stride = w.stride[0];
  r.dim = w.shape[1];
  r.load(n, 0, dst);
}

// sum_k a[k] b[k] in eight interleaved partial sums (a fixed order: the result does not depend on
// the thread that computes it).
float dot(const float* a, const float* b, int64_t n) {
  float s[8] = {};
  int64_t k = 0;
  for (; k + 8 <= n; k += 8)
    for (int i = 0; i < 8; ++i) s[i] += a[k + i] * b[k + i];
  for (; k < n; ++k) s[0] += a[k] * b[k];
  return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

}  // namespace

void phi_rows_sizes(const Config& cfg, int64_t blocks, int64_t H, int64_t D, int64_t F, Sizer& shared, Sizer& slot) {
  const int64_t lD = cfg.cmp_block_len * D;
  layout_rows(shared, blocks * H, lD, cfg.phi == PhiKind::mlp ? F : 0);
  slot.take<float>(std::max(lD, F));
}

void phi_forward_rows(const Plan& p, const PhiParams& phi, const TensorView& x, float* xc, Arena& shared,
                      const Slots& slots) {
  const int64_t H = x.shape[1], D = x.shape[2], l = p.cfg.cmp_block_len, d = p.cfg.cmp_stride, lD = l * D;
  const int64_t F = p.cfg.phi == PhiKind::mlp ? phi.w1.shape[0] : 0, items = p.B * H;
  const RowsLayout r = layout_rows(shared, items, lD, F);
  const Rows xr = Rows::of(x);
  // Item k * H + h: block k (tokens [k*l, (k+1)*l) of x), head h; its output row k*l/d of xc.
  auto out_row = [&](int64_t item) { return xc + ((item / H) * l / d * H + item % H) * D; };
  parallel_for(items, slots, [&](int64_t item, Arena arena) {
    float* row = arena.take<float>(D);
    float* u = r.u + item * lD;
    for (int64_t t = 0; t < l; ++t) {
      xr.load((item / H) * l + t, item % H, row);
      for (int64_t c = 0; c < D; ++c) u[t * D + c] = row[c];
    }
    if (p.cfg.phi == PhiKind::mean) {
      float* y = out_row(item);
      for (int64_t c = 0; c < D; ++c) {
        float s = 0.f;
        for (int64_t t = 0; t < l; ++t) s += u[t * D + c];
        y[c] = s / static_cast<float>(l);
      }
      return;
    }
    for (int64_t k = 0; k < lD; ++k) u[k] += load_scalar(phi.pe, (k / D) * phi.pe.stride[0] + k % D);
  });
  if (p.cfg.phi == PhiKind::mean) return;
  // The first layer (linear: the only one): a row of W per work item, dotted with every item.
  const int64_t n1 = phi.w1.shape[0];
  parallel_for(n1, slots, [&](int64_t n, Arena arena) {
    float* w = arena.take<float>(lD);
    weight_row(phi.w1, n, w);
    for (int64_t item = 0; item < items; ++item) {
      const float y = dot(w, r.u + item * lD, lD);
      if (p.cfg.phi == PhiKind::linear) out_row(item)[n] = y;
      else r.hidden[item * F + n] = gelu(y + load_scalar(phi.b1, n * phi.b1.stride[0]));
    }
  });
  if (p.cfg.phi != PhiKind::mlp) return;
  parallel_for(D, slots, [&](int64_t c, Arena arena) {
    float* w = arena.take<float>(F);
    weight_row(phi.w2, c, w);
    for (int64_t item = 0; item < items; ++item)
      out_row(item)[c] = dot(w, r.hidden + item * F, F) + load_scalar(phi.b2, c * phi.b2.stride[0]);
  });
}

}  // namespace nsa::cpu
