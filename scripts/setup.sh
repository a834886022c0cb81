#!/usr/bin/env bash
# setup.sh — install what k3 needs on Debian 12 (as root) and configure + build it.
# Idempotent: packages already present are not reinstalled; an existing build is reused.
#   scripts/setup.sh [BUILD_DIR] [extra cmake args...]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}; shift || true

# libhwloc-dev: host/bind.c binds each rank to its share of a node's cores (and `k3 plan` shows
# them). The Slurm daemons for tests/slurm are installed by that test itself.
APT_PKGS="build-essential cmake pkg-config libopenmpi-dev openmpi-bin libucx-dev libhwloc-dev
          libcjson-dev libpcre2-dev libmicrohttpd-dev libcurl4-openssl-dev clang clang-format python3"
missing=""
for p in $APT_PKGS; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "k3 setup: missing packages:$missing — run as root or install them" >&2; exit 1
  fi
  echo "k3 setup: installing$missing" >&2
  apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q $missing >/dev/null
fi

cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@" >/dev/null
cmake --build "$BUILD" -j"$(nproc)"
