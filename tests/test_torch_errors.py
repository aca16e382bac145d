"""PyTorch's out-of-memory error from ``streampool_alloc_cxx``, made from PyTorch's own
libraries (cxx/throw.cpp), checked without a GPU: a C++ caller built against PyTorch's
headers catches what the entry point throws as PyTorch's handler does
(``catch (const c10::OutOfMemoryError&)``, which becomes ``torch.OutOfMemoryError``).

The PyTorch installations checked: the one installed here, if any, and each folder in
``STREAMPOOL_TEST_TORCH_DIRS`` (separated by ``:``) that holds ``torch/include`` and
``torch/lib``, as ``make test-torch-errors`` fetches them (three PyTorch releases: one whose
``libc10`` exports the error's constructor, one whose error is defined in ``libc10_cuda``,
and one built for the old C++ ABI). Each check runs in a process of its own: the look for PyTorch's libraries
is made once per process."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# Built against PyTorch's headers and linked to its libc10, as PyTorch's own code is.
CALLER = r"""
#include <c10/util/Exception.h>
#include <cstring>
#include <new>
typedef void* (*alloc_fn)(std::size_t, int, void*);
// 1: c10::OutOfMemoryError, 2: std::bad_alloc, 3: another std::exception, 0: nothing thrown.
extern "C" int call(alloc_fn f, std::size_t size, int device, char* message, std::size_t cap) {
  try {
    f(size, device, nullptr);
    return 0;
  } catch (const c10::OutOfMemoryError& e) {
    std::strncpy(message, e.what_without_backtrace(), cap - 1);
    return std::strlen(e.what()) > 0 ? 1 : 4;  // what() adds PyTorch's backtrace, made lazily
  } catch (const std::bad_alloc& e) {
    std::strncpy(message, e.what(), cap - 1);
    return 2;
  } catch (const std::exception& e) {
    std::strncpy(message, e.what(), cap - 1);
    return 3;
  }
}
"""

# What runs in the child process: argv = caller library, PyTorch's lib folder.
CHILD = r"""
import ctypes, sys
from streampool import _native, allocators
from streampool.sim import SimulatedDevice

# Loads PyTorch's libc10, as `import torch` does; into the global scope, where PyTorch's
# libraries put copies of the error's type (a weak symbol, defined by every library that
# uses it, this one too): libc10_cuda's virtual table then points at this library's copy,
# not at the one libc10_cuda itself defines.
caller = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL).call
lib = sys.argv[2]
c10 = ctypes.CDLL(f"{lib}/libc10.so")
try:  # CUDA builds define the error's type here (it needs the CUDA runtime's library)
    c10_cuda = ctypes.CDLL(f"{lib}/libc10_cuda.so")
except OSError:
    c10_cuda = None
loaded = [library for library in (c10, c10_cuda) if library is not None]

def has(name, libraries=loaded):
    return any(hasattr(library, name) for library in libraries)

# What the symbols say: the error's type, and either its own constructor in libc10, or
# c10::Error's with the error's virtual table (either taking the std::string of the C++11
# ABI or that of the old one).
STRINGS = ("NSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE", "Ss")
def constructor(cls):
    return any(has(f"_ZN3c10{cls}C1ENS_14SourceLocationE{string}", [c10]) for string in STRINGS)
expected = has("_ZTIN3c1016OutOfMemoryErrorE") and (
    constructor("16OutOfMemoryError") or (constructor("5Error") and has("_ZTVN3c1016OutOfMemoryErrorE"))
)

def call(size, device=0):
    message = ctypes.create_string_buffer(1024)
    kind = caller(function, ctypes.c_size_t(size), device, message, 1024)
    return kind, message.value.decode()

with SimulatedDevice(capacity_bytes="64MiB"):
    function = ctypes.cast(getattr(ctypes.CDLL(allocators.library_path()), allocators.CXX_ALLOC_FUNCTION), ctypes.c_void_p)
    kind, message = call(1 << 40)
    assert kind == 2, (kind, message)  # a std::bad_alloc until PyTorch's error is asked for
    assert _native._use_torch_out_of_memory() is expected
    assert _native._use_torch_out_of_memory() is expected  # asked again: the same answer
    for size in (1 << 40, 3 << 40):
        kind, message = call(size)
        assert kind == (1 if expected else 2), (kind, message)
        assert message.startswith(f"CUDA out of memory. streampool: streampool_alloc(size={size}"), message
        assert "out of memory: CudaAsyncMemoryResource could not allocate" in message, message
    kind, message = call(16, device=7)
    assert kind == 3 and "device 7 does not exist" in message, (kind, message)  # not out of memory
    assert call(0) == (0, "")
print("type" if has("_ZTIN3c1016OutOfMemoryErrorE") else "notype", "torch" if expected else "bad_alloc")
"""


def torch_installations() -> list[Path]:
    """Folders that hold PyTorch's ``torch/include`` and ``torch/lib``: the installed
    PyTorch (found without importing it) and those named in STREAMPOOL_TEST_TORCH_DIRS."""
    found = []
    spec = importlib.util.find_spec("torch")
    if spec is not None and spec.submodule_search_locations:
        found.append(Path(next(iter(spec.submodule_search_locations))).parent)
    for folder in filter(None, os.environ.get("STREAMPOOL_TEST_TORCH_DIRS", "").split(":")):
        found.append(Path(folder))
    return [folder for folder in found if (folder / "torch/include/c10/util/Exception.h").exists()]


INSTALLATIONS = torch_installations()


@pytest.mark.skipif(not INSTALLATIONS, reason="needs PyTorch's headers and libc10 (make test-torch-errors)")
@pytest.mark.skipif(not shutil.which("c++"), reason="needs a C++ compiler")
@pytest.mark.parametrize("installation", INSTALLATIONS, ids=str)
def test_out_of_memory_is_pytorchs_own_error(installation: Path, tmp_path: Path) -> None:
    lib = installation / "torch/lib"
    source, caller = tmp_path / "caller.cpp", tmp_path / "libcaller.so"
    source.write_text(CALLER)
    # Built for the C++ ABI PyTorch was built for (the old one up to PyTorch 2.6).
    cxx11 = b"_ZN3c105ErrorC1ENS_14SourceLocationENSt7__cxx11" in (lib / "libc10.so").read_bytes()
    flags = ["-std=c++17", "-shared", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={int(cxx11)}"]
    include = f"-I{installation / 'torch/include'}"
    link = [f"-L{lib}", "-lc10", f"-Wl,-rpath,{lib}"]
    subprocess.run(["c++", *flags, include, "-o", str(caller), str(source), *link], check=True)
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(caller), str(lib)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    # Where the loaded libraries define the error's type (PyTorch 2.x's CUDA builds, and its
    # libc10 alone from 2.15), the error is PyTorch's; and the folders fetched for the check
    # are such builds, so that it cannot pass by finding nothing.
    fetched = map(Path, os.environ.get("STREAMPOOL_TEST_TORCH_DIRS", "").split(":"))
    if done.stdout.split()[-2] == "type" or installation in fetched:
        assert done.stdout.split()[-2:] == ["type", "torch"], done.stdout + done.stderr
