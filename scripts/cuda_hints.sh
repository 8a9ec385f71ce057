# Sourced by scripts/check_cuda_build.sh and scripts/gpu_check.sh: the CMake definitions a CUDA
# build of torch needs to configure. Caffe2's CMake looks for nvcc, the toolkit and NVRTC; the
# toolkit is CUDA_HOME, /usr/local/cuda or where nvcc lives, and NVRTC the toolkit's own or, where the toolkit
# has none, the NVIDIA wheel's that torch depends on.
#
#   cuda_hints PYTHON    sets cuda_home, nvcc, and cuda_defines (an array of -DNAME=VALUE)
cuda_hints() {
  local python=$1 nvrtc
  cuda_home=${CUDA_HOME:-}
  [ -n "$cuda_home" ] || [ ! -x /usr/local/cuda/bin/nvcc ] || cuda_home=/usr/local/cuda
  if [ -z "$cuda_home" ] && command -v nvcc >/dev/null; then
    cuda_home=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
  fi
  nvcc=$cuda_home/bin/nvcc
  [ -x "$nvcc" ] || { echo "cuda_hints: no CUDA toolkit at $cuda_home (set CUDA_HOME)"; return 1; }
  nvrtc=$(ls "$cuda_home"/lib64/libnvrtc.so 2>/dev/null ||
    "$python" -c "import glob, os, site
libs = [p for d in site.getsitepackages() for p in glob.glob(os.path.join(d, 'nvidia', '*', 'lib', 'libnvrtc.so.*'))]
print(sorted(p for p in libs if 'builtins' not in p)[0])")
  cuda_defines=(-DCMAKE_CUDA_COMPILER="$nvcc" -DCUDAToolkit_ROOT="$cuda_home"
    -DCUDA_TOOLKIT_ROOT_DIR="$cuda_home" -DCUDA_nvrtc_LIBRARY="$nvrtc")
}
