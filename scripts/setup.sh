#!/usr/bin/env bash
# setup.sh — install what k3 needs on Debian 12 (as root) and configure + build it.
# Idempotent: packages already present are not reinstalled; an existing build is reused.
#   scripts/setup.sh [BUILD_DIR] [extra cmake args...]
#   scripts/setup.sh --check     only say which packages are missing (exit 1 if any), build nothing
# One configuration (RelWithDebInfo, warnings as errors): the demo and the tests both build
# build/ with it, so neither rebuilds what the other built. apt-get waits up to 10 min for the
# dpkg lock (unattended-upgrades may hold it) instead of failing at once.
set -euo pipefail
cd "$(dirname "$0")/.."
CHECK=0
if [ "${1:-}" = --check ]; then CHECK=1; shift; fi
BUILD=${1:-build}; shift || true

# libhwloc-dev: host/bind.c binds each rank to its share of a node's cores (and `k3 plan` shows
# them). python3-venv: scripts/test.sh puts the Python references in a virtual environment. curl:
# the README's serve example. The Slurm daemons for tests/slurm are installed by that test itself.
APT_PKGS="build-essential cmake pkg-config libopenmpi-dev openmpi-bin libucx-dev libhwloc-dev
          libcjson-dev libpcre2-dev libmicrohttpd-dev libcurl4-openssl-dev curl clang clang-format python3
          python3-venv"
missing=""
for p in $APT_PKGS; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ "$CHECK" = 1 ]; then
  [ -z "$missing" ] && exit 0
  echo "$missing"; exit 1
fi
if [ -n "$missing" ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "k3 setup: missing packages:$missing — run as root or install them" >&2; exit 1
  fi
  echo "k3 setup: installing$missing" >&2
  apt-get -o DPkg::Lock::Timeout=600 update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -q $missing >/dev/null
fi

cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DK3_WERROR=ON "$@" >/dev/null
cmake --build "$BUILD" -j"$(nproc)"
