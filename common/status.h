// Status helpers shared by every module. absl::Status crosses module
// boundaries; CHECK-style aborts are only for programmer errors.
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define KVSERVE_CONCAT_INNER(a, b) a##b
#define KVSERVE_CONCAT(a, b) KVSERVE_CONCAT_INNER(a, b)

// Returns from the enclosing function if `expr` is not OK.
#define RETURN_IF_ERROR(expr)                 \
  do {                                        \
    ::absl::Status _kvserve_status = (expr);  \
    if (!_kvserve_status.ok()) return _kvserve_status; \
  } while (0)

// ASSIGN_OR_RETURN(auto x, StatusOrExpr());
#define ASSIGN_OR_RETURN(lhs, expr) \
  ASSIGN_OR_RETURN_IMPL(KVSERVE_CONCAT(_kvserve_statusor_, __LINE__), lhs, expr)
#define ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                          \
  if (!tmp.ok()) return tmp.status();         \
  lhs = std::move(tmp).value()
