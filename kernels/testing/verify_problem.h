// Random verify problems for the kernel tests and the benchmark: a paged pool
// with pages in random order, unused pages and rows poisoned with NaN (so a
// stray read shows up in the output), random draft trees, and the comparison
// of an output against the CPU reference. Host memory only; device copies live
// in device_problem.h.
#ifndef MLAVERIFY_KERNELS_TESTING_VERIFY_PROBLEM_H_
#define MLAVERIFY_KERNELS_TESTING_VERIFY_PROBLEM_H_

#include <cstdint>
#include <string>
#include <vector>

#include "common/bf16.h"
#include "kernels/kv_cache.h"
#include "kernels/verify_attention.h"

namespace mlaverify::kernels::testing {

enum class MaskKind { kChain, kTree };
const char* MaskName(MaskKind m);

// How the prefix rows' values are drawn: U(-kv_range, kv_range); N(0, 1) x
// kv_range; or heavy-tailed, Student-t (nu = 3) x kv_range with four channels
// (7, 100, 300, 450) 20x larger (the rows common/kv_dtype.h's scale rule was
// measured on). Draft rows stay uniform.
enum class KvValues { kUniform, kNormal, kHeavyTailed };
const char* KvValuesName(KvValues v);  // "uniform", "normal", "heavy"

struct VerifyProblemSpec {
  std::vector<int> prefix_len;  // per request
  std::vector<int> draft_len;   // per request, 0..64 (0 = padding)
  int num_heads = 8;
  int page_size = 64;
  int num_layers = 2;  // each request uses one; the others stay NaN
  // How the pool stores rows: fp8 rows are the quantized random rows; the
  // NaN poison of unused rows reads as NaN there too (its scale bytes form
  // an fp32 NaN, its rope values are bf16 NaN).
  KvDtype kv_dtype = KvDtype::kBf16;
  MaskKind mask = MaskKind::kTree;
  uint64_t seed = 1;
  int extra_pages = 3;  // never referenced, filled with NaN
  // Lower bounds on the pool's page count and the page-table row length, so
  // that problems of different lengths share one shape (graph replay tests).
  int64_t min_num_pages = 0;
  int64_t min_page_table_stride = 0;
  int64_t q_token_pad = 0;  // extra elements between q tokens (stride tests)
  // Extra elements after each output head row on the device (stride and
  // alignment tests: 2 gives rows that are 4- but not 8-byte aligned).
  int64_t out_head_pad = 0;
  float q_range = 2.0f;   // q ~ U(-q_range, q_range)
  float kv_range = 1.0f;  // kv ~ U(-kv_range, kv_range)
  // Prefix row j's range grows to kv_range * (1 + kv_ramp * j / P): scores
  // that keep rising along the prefix move the softmax's exponent reference
  // many times inside one split.
  float kv_ramp = 0.0f;
  KvValues kv_values = KvValues::kUniform;
};

// A problem on the host. The pool holds the prefix rows of every request; the
// draft rows are in `draft_kv` and reach the pool through the draft write
// (CPU or GPU), exactly as in the service.
struct HostVerifyProblem {
  VerifyProblemSpec spec;
  int batch = 0;
  int total_draft = 0;
  int64_t num_pages = 0;
  int64_t page_table_stride = 0;
  // [num_layers, num_pages, page_size, row]: KvRowBytes(spec.kv_dtype) per row
  std::vector<Bf16> pool;
  std::vector<int32_t> page_table;  // [batch, page_table_stride], -1 past the end
  std::vector<int32_t> prefix_len, draft_len, layer;
  std::vector<std::vector<int32_t>> parents;  // per request
  std::vector<uint64_t> visibility;           // [total_draft]
  std::vector<Bf16> q;                        // [total_draft, q_token_stride]
  int64_t q_token_stride = 0;
  std::vector<Bf16> draft_kv;  // [total_draft, 576]
  float softmax_scale = 0.0f;

  int64_t total_kv_tokens() const;  // sum of P + N
  // Argument structs over this problem's host vectors.
  VerifyArguments HostArgs(Bf16* out, float* lse);
  DraftKvWriteArguments HostWriteArgs();
};

// Builds a problem (multithreaded fill; a few GB take about a second).
HostVerifyProblem MakeProblem(const VerifyProblemSpec& spec);

struct Comparison {
  double rel_err = 0.0;          // ||o - ref|| / ||ref|| over the checked rows
  double lse_max_abs_err = 0.0;  // over the checked rows
  int64_t rows_checked = 0;
  int64_t nan_outputs = 0;  // NaN/Inf anywhere in out or lse (all rows)
  // Where to look when it fails: the first (token, head) row holding NaN/Inf
  // (-1: none), and the checked row with the largest relative error.
  int64_t first_nan_token = -1, first_nan_head = -1;
  int64_t worst_token = -1, worst_head = -1;
  double worst_row_rel_err = 0.0;
  // Per checked row, in check order: ||o - ref|| / ||ref|| and |lse - ref|.
  std::vector<double> row_rel_errs, row_lse_abs_errs;
  bool ok(double tolerance = 1e-2) const {
    return nan_outputs == 0 && rel_err == rel_err && rel_err <= tolerance;
  }
  std::string ToString() const;
};

// Compares out/lse (bf16 / fp32, laid out like HostArgs) with the CPU
// reference. The problem's pool must already hold the draft rows (call
// WriteDraftKvCpu on HostWriteArgs first). Checks every row when there are at
// most `max_rows` of them, else a random sample of `max_rows` rows; scans all
// rows for NaN either way.
Comparison CompareWithReference(HostVerifyProblem& problem, const std::vector<Bf16>& out,
                                const std::vector<float>& lse, int64_t max_rows, uint64_t seed = 7);

// Useful work of a problem (the same counts docs/kernel.md uses).
double ProblemBytes(const HostVerifyProblem& p);  // sum (P+N) * KvRowBytes(kv_dtype)
double ProblemFlops(const HostVerifyProblem& p);  // sum N*H*(P+N) * 2176

}  // namespace mlaverify::kernels::testing

#endif  // MLAVERIFY_KERNELS_TESTING_VERIFY_PROBLEM_H_
