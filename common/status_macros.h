// Early-return helpers for absl::Status / absl::StatusOr. The Abseil on
// Debian 12 (20220623) predates its own status macros, so the project keeps
// these two; every layer above kernels/ uses them too.
#ifndef MLAVERIFY_COMMON_STATUS_MACROS_H_
#define MLAVERIFY_COMMON_STATUS_MACROS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define MLAVERIFY_STATUS_CONCAT_INNER_(a, b) a##b
#define MLAVERIFY_STATUS_CONCAT_(a, b) MLAVERIFY_STATUS_CONCAT_INNER_(a, b)

// Evaluates `expr` (an absl::Status); returns it from the enclosing function
// when it is not OK.
#define RETURN_IF_ERROR(expr)                  \
  do {                                         \
    ::absl::Status _mlaverify_status = (expr); \
    if (!_mlaverify_status.ok()) {             \
      return _mlaverify_status;                \
    }                                          \
  } while (false)

// `ASSIGN_OR_RETURN(auto x, MakeX());` declares/assigns `x` from an
// absl::StatusOr, or returns its status from the enclosing function.
#define ASSIGN_OR_RETURN(lhs, rexpr) \
  ASSIGN_OR_RETURN_IMPL_(MLAVERIFY_STATUS_CONCAT_(_mlaverify_statusor_, __LINE__), lhs, rexpr)

#define ASSIGN_OR_RETURN_IMPL_(statusor, lhs, rexpr) \
  auto statusor = (rexpr);                           \
  if (!statusor.ok()) {                              \
    return statusor.status();                        \
  }                                                  \
  lhs = std::move(statusor).value()

#endif  // MLAVERIFY_COMMON_STATUS_MACROS_H_
