#!/usr/bin/env bash
# The README's test command: installs what is missing (Debian 12, root or
# sudo), builds, runs every test with ctest; then builds again with clang, the
# thread-safety analysis as errors and AddressSanitizer + UndefinedBehaviorSanitizer
# (CPU only), and runs the tests once more under the sanitizers. GPU tests run
# when a CUDA device is present and are reported as skipped, with the reason,
# when not.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
scripts/build.sh
status=0
ctest --test-dir build --output-on-failure --timeout 900 -j2 || status=$?
# Say why tests were skipped (ctest lists them but not the reason).
if grep -q "GPU test skipped" build/Testing/Temporary/LastTest.log 2>/dev/null; then
  echo "Skipped GPU tests, reason: $(grep -o 'GPU test skipped: .*' \
    build/Testing/Temporary/LastTest.log | sort -u | head -1)"
fi
echo "== clang: -Werror=thread-safety, ASan + UBSan"
scripts/build.sh sanitize
# The Python models and tool checks do not run C++; they ran above. The
# memory-bound checks (label memory) measure RSS, which the sanitizers inflate.
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
  ctest --test-dir build-sanitize --output-on-failure --timeout 900 -j2 -LE "model|tools|memory" || status=$?
exit $status
