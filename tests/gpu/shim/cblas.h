// A minimal cblas_sgemm so that src/backend/cpu/cpu_backend.cpp compiles on the GPU machine, which has no
// OpenBLAS headers. Used only by scripts/gpu-check.sh's standalone build of gpu_check_mla, which calls
// nothing but mla_attention (no GEMM); the loop below is correct, not fast.
#pragma once

enum CBLAS_ORDER { CblasRowMajor = 101, CblasColMajor = 102 };
enum CBLAS_TRANSPOSE { CblasNoTrans = 111, CblasTrans = 112 };

inline void openblas_set_num_threads(int) {}

inline void cblas_sgemm(CBLAS_ORDER order, CBLAS_TRANSPOSE trans_a, CBLAS_TRANSPOSE trans_b, int m, int n, int k,
                        float alpha, const float* a, int lda, const float* b, int ldb, float beta, float* c,
                        int ldc) {
  // Row-major only (what cpu_backend.cpp uses); column-major is the transposed problem.
  if (order == CblasColMajor) {
    cblas_sgemm(CblasRowMajor, trans_b, trans_a, n, m, k, alpha, b, ldb, a, lda, beta, c, ldc);
    return;
  }
  for (int i = 0; i < m; ++i) {
    for (int j = 0; j < n; ++j) {
      float sum = 0.0f;
      for (int p = 0; p < k; ++p) {
        const float x = trans_a == CblasNoTrans ? a[i * lda + p] : a[p * lda + i];
        const float y = trans_b == CblasNoTrans ? b[p * ldb + j] : b[j * ldb + p];
        sum += x * y;
      }
      c[i * ldc + j] = alpha * sum + (beta == 0.0f ? 0.0f : beta * c[i * ldc + j]);
    }
  }
}
