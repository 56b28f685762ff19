// blas.h: phi's products on cuBLASLt. Host code only.
//
// cuBLASLt is column-major; a row-major C = A B is the column-major C^T = B^T A^T, so the call
// takes B as its first operand and A as its second, each transposed where it is stored the other
// way round. One handle per device (made on first use, kept for the process); one plan per
// (device, shape, layouts, beta, alignment): descriptors and the heuristic's first algorithm, at
// most kMaxPlans of them (below).
#include "cuda/phi/blas.h"

#include <cublasLt.h>

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>

#include "cuda/common/check.h"
#include "nsa/error.h"

namespace nsa::cuda::phi::blas {

namespace {

void check(cublasStatus_t st, const char* what) {
  if (st != CUBLAS_STATUS_SUCCESS)
    throw Error(std::string("cuBLASLt call ") + what, cublasLtGetStatusName(st), cublasLtGetStatusString(st));
}

cublasLtHandle_t handle_of(int device) {
  static std::mutex mu;
  static std::map<int, cublasLtHandle_t> handles;
  const std::lock_guard<std::mutex> lock(mu);
  auto it = handles.find(device);
  if (it != handles.end()) return it->second;
  cublasLtHandle_t h = nullptr;
  check(cublasLtCreate(&h), "cublasLtCreate");
  handles.emplace(device, h);
  return h;
}

// The largest power of two <= 256 that divides the address (the alignment cuBLASLt may assume).
uint32_t alignment_of(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  uint32_t al = 256;
  while (al > 1 && a % al != 0) al /= 2;
  return al;
}

using Key = std::tuple<int, bool, int64_t, int64_t, int64_t, int64_t, bool, int64_t, bool, int64_t, bool, uint32_t,
                       uint32_t, uint32_t>;

// Descriptors and algorithm of one product shape; destroys its descriptors with itself.
struct Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;  // cuBLASLt's A (our B), B (our A), C
  cublasLtMatmulAlgo_t algo{};

  Plan() = default;
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  ~Plan() {
    for (cublasLtMatrixLayout_t l : {c, b, a})
      if (l) cublasLtMatrixLayoutDestroy(l);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

std::mutex plans_mu;
std::map<Key, std::shared_ptr<const Plan>> plans;  // (under plans_mu)

std::shared_ptr<const Plan> make_plan(cublasLtHandle_t h, const Product& p, uint32_t al_a, uint32_t al_b,
                                      uint32_t al_c) {
  const std::shared_ptr<Plan> made = std::make_shared<Plan>();  // (a throw below destroys what was made)
  Plan& plan = *made;
  check(cublasLtMatmulDescCreate(&plan.op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
  // cuBLASLt's A = our B^T [N, K] (column-major): B stored [K, N] row-major is exactly that (N);
  // stored [N, K] it is the column-major [K, N], transposed (T). Its B = our A^T [K, M]: A stored
  // [M, K] row-major is that (N); stored [K, M] (a_km) it is transposed (T).
  const cublasOperation_t ta = p.b_nk ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t tb = p.a_km ? CUBLAS_OP_T : CUBLAS_OP_N;
  check(cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)), "set TRANSA");
  check(cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)), "set TRANSB");
  // Column-major stored shapes (rows, cols, ld): our B as stored, our A as stored, C^T [N, M].
  const uint64_t a_rows = p.b_nk ? p.K : p.N, a_cols = p.b_nk ? p.N : p.K;
  const uint64_t b_rows = p.a_km ? p.M : p.K, b_cols = p.a_km ? p.K : p.M;
  const cudaDataType_t in = p.f32 ? CUDA_R_32F : CUDA_R_16BF;
  check(cublasLtMatrixLayoutCreate(&plan.a, in, a_rows, a_cols, p.ldb), "cublasLtMatrixLayoutCreate");
  check(cublasLtMatrixLayoutCreate(&plan.b, in, b_rows, b_cols, p.lda), "cublasLtMatrixLayoutCreate");
  check(cublasLtMatrixLayoutCreate(&plan.c, CUDA_R_32F, uint64_t(p.N), uint64_t(p.M), p.ldc),
        "cublasLtMatrixLayoutCreate");
  cublasLtMatmulPreference_t pref = nullptr;
  check(cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate");
  const uint64_t ws = kWorkspaceBytes;
  check(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)),
        "set MAX_WORKSPACE_BYTES");
  // cuBLASLt's A is our B, its B our A.
  check(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_b, sizeof(al_b)),
        "set MIN_ALIGNMENT_A_BYTES");
  check(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_a, sizeof(al_a)),
        "set MIN_ALIGNMENT_B_BYTES");
  check(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_c, sizeof(al_c)),
        "set MIN_ALIGNMENT_C_BYTES");
  check(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_c, sizeof(al_c)),
        "set MIN_ALIGNMENT_D_BYTES");
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t st =
      cublasLtMatmulAlgoGetHeuristic(h, plan.op, plan.a, plan.b, plan.c, plan.c, pref, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  check(st, "cublasLtMatmulAlgoGetHeuristic");
  if (found == 0)
    throw Error("cuBLASLt call cublasLtMatmulAlgoGetHeuristic", "no algorithm",
                "for phi's product M " + std::to_string(p.M) + ", N " + std::to_string(p.N) + ", K " +
                    std::to_string(p.K));
  plan.algo = result.algo;
  return made;
}

}  // namespace

void matmul(const Product& p, void* ws, cudaStream_t s) {
  if (p.M <= 0 || p.N <= 0) return;
  int device = 0;
  NSA_CUDA_CHECK(cudaGetDevice(&device));
  const uint32_t al_a = alignment_of(p.a), al_b = alignment_of(p.b), al_c = alignment_of(p.c);
  const Key key{device, p.f32, p.M, p.N, p.K, p.lda, p.a_km, p.ldb, p.b_nk, p.ldc, p.beta != 0.f, al_a, al_b, al_c};
  const cublasLtHandle_t h = handle_of(device);
  std::shared_ptr<const Plan> plan;  // (kept by this call while the cache may start over)
  {
    const std::lock_guard<std::mutex> lock(plans_mu);
    auto it = plans.find(key);
    if (it == plans.end()) {
      if (plans.size() >= kMaxPlans) plans.clear();
      it = plans.emplace(key, make_plan(h, p, al_a, al_b, al_c)).first;
    }
    plan = it->second;
  }
  const float alpha = 1.f;
  check(cublasLtMatmul(h, plan->op, &alpha, p.b, plan->a, p.a, plan->b, &p.beta, p.c, plan->c, p.c, plan->c,
                       &plan->algo, ws, kWorkspaceBytes, s),
        "cublasLtMatmul");
}

size_t cached_plans() {
  const std::lock_guard<std::mutex> lock(plans_mu);
  return plans.size();
}

}  // namespace nsa::cuda::phi::blas
