#!/usr/bin/env bash
# The README's test command: installs what is missing (Debian 12, root or
# sudo), builds, runs every test with ctest. GPU tests run when a CUDA device
# is present and are reported as skipped, with the reason, when not.
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
exit $status
