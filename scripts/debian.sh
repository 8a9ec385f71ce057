# Sourced by the scripts: installs the Debian packages given that are missing (as root, or
# through sudo). Works on Debian 12 and 13.
ensure_debian_packages() {
  local missing=() p
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  ((${#missing[@]})) || return 0
  echo "$(basename "$0" .sh): installing Debian packages: ${missing[*]}"
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo=sudo
  DEBIAN_FRONTEND=noninteractive $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
}

# The packages the C++ build and its tests need; a Debian python3 (rather than one that ships
# them) also needs its venv module and headers packaged.
ensure_build_packages() {
  local packages=(g++ cmake ninja-build libgtest-dev libgmock-dev)
  python3 -c "import ensurepip, venv" 2>/dev/null || packages+=(python3-venv)
  python3 -c "import os, sysconfig; assert os.path.exists(sysconfig.get_paths()['include'] + '/Python.h')" \
    2>/dev/null || packages+=(python3-dev)
  ensure_debian_packages "${packages[@]}"
}
