#!/bin/sh
# Runs one GoogleTest suite for CTest (tests/testing/gtest_suites.cmake):
# exits 77 (CTest's SKIP_RETURN_CODE) when the suite passed without running
# any case (every case skipped, e.g. no GPU), so skips stay visible in
# CTest's summary; otherwise gtest's own exit status.
#   run_suite.sh <test executable> --gtest_filter=Suite.* [gtest flags...]
out="$("$@" 2>&1)"
rc=$?
printf '%s\n' "$out"
if [ "$rc" = 0 ] && printf '%s\n' "$out" | grep -q '^\[  PASSED  \] 0 tests'; then
  exit 77
fi
exit "$rc"
