#!/usr/bin/env bash
# Installs every build and run dependency of ulysses from Debian 12 packages.
# Idempotent: packages already present are skipped by apt-get.
set -euo pipefail
packages=(
  build-essential cmake ninja-build
  libtorch-dev libgloo-dev
  libopenblas0-pthread       # libtorch fp32 matmul: ~190 GFLOP/s vs ~6 with reference BLAS
  libblas-dev                # libblas.so for the kernel's sgemm_ (resolves to OpenBLAS)
  googletest libgtest-dev libgmock-dev libbenchmark-dev
  python3
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
