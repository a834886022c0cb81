#!/usr/bin/env bash
# format.sh — clang-format every C/CUDA source of the project; --check only reports (exit 1).
set -euo pipefail
cd "$(dirname "$0")/.."
files=$(git ls-files '*.c' '*.h' '*.cu' '*.cuh' '*.cpp' 2>/dev/null || find . -name '*.[ch]' -o -name '*.cu')
if [ "${1:-}" = "--check" ]; then
  clang-format --dry-run --Werror $files
  echo "clang-format: $(echo $files | wc -w) files clean"
else
  clang-format -i $files
fi
