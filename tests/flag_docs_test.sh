#!/usr/bin/env bash
# The server's flag table (docs/operations.md, "Flags") names exactly the
# flags `mlaverify-server --help` lists: a flag added, renamed or retired
# without its row fails here, so the table cannot drift from the code. It is
# the only flag table: a second one in README.md or docs/ fails too.
#   tests/flag_docs_test.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
server=$1/server/mlaverify-server
src=$2
work=$(mktemp -d /tmp/mlaverify-flagdocs.XXXX)
trap 'rm -rf "$work"' EXIT

# Long options as CLI11 prints them ("  -h,--help", "  --listen TEXT ...").
"$server" --help | grep -oE '^ +(-[a-zA-Z],)?--[a-z0-9-]+' | grep -oE -- '--[a-z0-9-]+' |
  grep -vx -- '--help' | sort -u > "$work/help"
[ -s "$work/help" ] || { echo "FAIL: no flags read from $server --help"; exit 1; }

failures=0
doc=docs/operations.md
# Flag rows start with a backquoted flag: "| `--pool-bytes` | ...".
grep -E '^\| `--' "$src/$doc" | cut -d'|' -f2 | grep -oE -- '--[a-z0-9-]+' | sort -u \
  > "$work/doc"
if ! diff -u --label "--help" --label "$doc" "$work/help" "$work/doc" > "$work/diff"; then
  echo "FAIL: $doc's flag table differs from the server's --help ('-' missing, '+' not a flag):"
  grep -E '^[-+]--[a-z]' "$work/diff"
  failures=$((failures + 1))
else
  echo "ok: $doc lists the server's $(wc -l < "$work/help") flags"
fi

# One table: no other top-level doc repeats server flag rows.
for other in "$src/README.md" "$src"/docs/*.md; do
  [ "$other" = "$src/$doc" ] && continue
  rows=$(grep -E '^\| `--' "$other" | cut -d'|' -f2 | grep -oE -- '--[a-z0-9-]+' | sort -u |
    comm -12 - "$work/help" | tr '\n' ' ' || true)
  if [ -n "$rows" ]; then
    echo "FAIL: ${other#"$src"/} has server flag rows ($rows); the table is $doc's, link to it"
    failures=$((failures + 1))
  fi
done
exit "$failures"
