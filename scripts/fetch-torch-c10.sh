#!/usr/bin/env bash
# Fetches what tests/test_torch_errors.py needs of PyTorch, without installing PyTorch:
# the headers and libc10 of three PyTorch releases from PyPI (CPU only; no GPU is needed),
# into DEST/<version>/torch/{include,lib}, and prints the folders for
# STREAMPOOL_TEST_TORCH_DIRS. The releases make PyTorch's out-of-memory error three ways
# (cxx/throw.cpp): 2.15's libc10 exports the error's constructor; in 2.11 (the GPU
# machine's) the error's type lives in libc10_cuda, which needs the CUDA runtime's library
# (fetched too, where libc10_cuda's run path looks for it); 2.5.1 is built for the old C++
# ABI. A folder already fetched is kept. About 2 GB is downloaded, and 70 MB kept per
# release.
set -euo pipefail
DEST=${1:-.torch-c10}
PYTHON=${PYTHON:-python3}
download() {  # download FOLDER REQUIREMENT: one wheel, no dependencies
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d "$1" "$2" >&2
}
folders=()
for spec in 2.15.0: 2.11.0:nvidia-cuda-runtime==13.0.96 2.5.1:nvidia-cuda-runtime-cu12==12.4.127; do
  version=${spec%%:*} runtime=${spec#*:}
  folder="$DEST/$version"
  if [ ! -e "$folder/torch/lib/libc10.so" ]; then
    wheels=$(mktemp -d)
    download "$wheels" "torch==$version"
    rm -rf "$folder" && mkdir -p "$folder"
    unzip -q "$wheels"/torch-*.whl 'torch/include/*' 'torch/lib/libc10.so' 'torch/lib/libc10_cuda.so' -d "$folder"
    if [ -n "$runtime" ]; then
      download "$wheels" "$runtime"
      unzip -q "$wheels"/nvidia_cuda_runtime*.whl 'nvidia/*/lib/libcudart.so.*' -d "$folder"
    fi
    rm -rf "$wheels"
  fi
  folders+=("$(cd "$folder" && pwd)")
done
(IFS=:; echo "${folders[*]}")
