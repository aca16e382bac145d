// The C++ in streampool (with throw_old_abi.cpp and c10_error.h): throwing the exception
// that a C++ caller of the allocation entry point (PyTorch's CUDAPluggableAllocator, which
// has no other error channel) turns into an error of its own. See streampool_alloc_cxx in
// src/capi.rs.
#include <cxxabi.h>
#include <dlfcn.h>

#include "c10_error.h"

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <typeinfo>
#include <utility>

namespace {

// Out of memory: a std::bad_alloc, as RMM's rmm::out_of_memory is, with the message of
// the failed call (std::bad_alloc's own what() says only "std::bad_alloc").
class out_of_memory : public std::bad_alloc {
 public:
  explicit out_of_memory(std::string message) : message_(std::move(message)) {}
  const char* what() const noexcept override { return message_.c_str(); }

 private:
  std::string message_;
};

// PyTorch's c10::OutOfMemoryError, which PyTorch raises in Python as torch.OutOfMemoryError
// (any other C++ exception becomes a RuntimeError). streampool does not link against
// PyTorch: the exception is made from the symbols of PyTorch's own libc10, found at run
// time in the process that loaded them (streampool_use_torch_out_of_memory).
struct TorchOutOfMemory {
  // The constructor (c10::OutOfMemoryError's own, or c10::Error's), and how to call it:
  // with a std::string of the C++11 ABI or of the old one (c10_error.h).
  void* constructor = nullptr;
  void (*construct)(void* constructor, void* self, const char* text, std::size_t len) = nullptr;
  // c10::OutOfMemoryError's virtual table, set after c10::Error's constructor (the class
  // adds no member to c10::Error, only its type); null with OutOfMemoryError's own
  // constructor (the libc10 of PyTorch 2.15 exports one; that of 2.11 does not).
  void* vtable = nullptr;
  std::type_info* type = nullptr;
};

// Room for the exception object, 8 times what it needs or more: sizeof(c10::Error) and
// sizeof(c10::OutOfMemoryError) are 128 bytes in PyTorch 2.11 and 2.15, 80 in 2.5.1.
constexpr std::size_t kTorchErrorSpace = 1024;

TorchOutOfMemory torch_oom;  // written under `torch_once`, before `torch_ready` is set
std::once_flag torch_once;
std::atomic<bool> torch_ready{false};

void destroy(void* object) {
  // c10::Error derives from std::exception alone, which sits at offset 0: its virtual
  // destructor runs the exception's own.
  static_cast<std::exception*>(object)->~exception();
}

[[noreturn]] void throw_torch_out_of_memory(const std::string& text) {
  void* object = abi::__cxa_allocate_exception(kTorchErrorSpace);
  try {
    torch_oom.construct(torch_oom.constructor, object, text.data(), text.size());
  } catch (...) {
    abi::__cxa_free_exception(object);
    throw;
  }
  if (torch_oom.vtable != nullptr) {
    *static_cast<void**>(object) = torch_oom.vtable;
  }
  abi::__cxa_throw(object, torch_oom.type, destroy);
}

#if defined(__GLIBCXX__) && _GLIBCXX_USE_CXX11_ABI
void construct_cxx11(void* constructor, void* self, const char* text, std::size_t len) {
  streampool_c10::construct(constructor, self, text, len);
}
#endif

void* symbol(void* first, void* second, const char* name) {
  void* found = first != nullptr ? dlsym(first, name) : nullptr;
  return found != nullptr || second == nullptr ? found : dlsym(second, name);
}

// Finds PyTorch's symbols in the libraries this process has loaded, and throws one such
// exception to check what it is; leaves `torch_oom` empty when anything is missing or odd.
bool find_torch_out_of_memory() {
#if defined(__GLIBCXX__)
  // PyTorch's CUDA builds define c10::OutOfMemoryError's type in libc10_cuda, and from 2.15
  // in libc10 too. RTLD_NOLOAD: only libraries already loaded, PyTorch's own.
  void* c10 = dlopen("libc10.so", RTLD_NOW | RTLD_NOLOAD);
  if (c10 == nullptr) {
    return false;
  }
  void* c10_cuda = dlopen("libc10_cuda.so", RTLD_NOW | RTLD_NOLOAD);
  TorchOutOfMemory found;
  found.type = static_cast<std::type_info*>(symbol(c10, c10_cuda, "_ZTIN3c1016OutOfMemoryErrorE"));
  // The constructors, by the C++ ABI of their std::string: OutOfMemoryError's own first.
  struct Candidate {
    const char* name;
    decltype(TorchOutOfMemory::construct) construct;
    bool own;
  };
  const Candidate candidates[] = {
#if _GLIBCXX_USE_CXX11_ABI
      {"_ZN3c1016OutOfMemoryErrorC1ENS_14SourceLocationENSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE",
       construct_cxx11, true},
      {"_ZN3c105ErrorC1ENS_14SourceLocationENSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE", construct_cxx11,
       false},
#endif
      {"_ZN3c1016OutOfMemoryErrorC1ENS_14SourceLocationESs", streampool_construct_c10_error_old_abi, true},
      {"_ZN3c105ErrorC1ENS_14SourceLocationESs", streampool_construct_c10_error_old_abi, false},
  };
  for (const Candidate& candidate : candidates) {
    found.constructor = dlsym(c10, candidate.name);
    if (found.constructor != nullptr) {
      found.construct = candidate.construct;
      if (!candidate.own) {
        // The table's address point is two words in: its offset to the top (0 here) and
        // its type, which must be OutOfMemoryError's. Compared as types, not addresses: the
        // type is a weak symbol that PyTorch's other libraries define too, and the table
        // points at whichever copy the loader bound first (libtorch's, in a PyTorch process).
        auto* table = static_cast<void**>(symbol(c10_cuda, c10, "_ZTVN3c1016OutOfMemoryErrorE"));
        if (table == nullptr || table[0] != nullptr || table[1] == nullptr ||
            !(*static_cast<const std::type_info*>(table[1]) == *found.type)) {
          return false;
        }
        found.vtable = table + 2;
      }
      break;
    }
  }
  if (found.type == nullptr || found.constructor == nullptr) {
    return false;
  }
  torch_oom = found;
  try {
    throw_torch_out_of_memory("streampool: a check of PyTorch's out-of-memory error");
  } catch (const std::exception& e) {
    if (typeid(e) == *found.type) {
      return true;
    }
  } catch (...) {
  }
  torch_oom = TorchOutOfMemory{};
  return false;
#else
  return false;  // PyTorch's libraries are built with libstdc++
#endif
}

}  // namespace

// From now on, out of memory throws PyTorch's c10::OutOfMemoryError where this process has
// loaded PyTorch's libc10 (torch.OutOfMemoryError in Python). Returns 1 when it does, 0
// when the exception stays a std::bad_alloc. Safe from any thread; the look is made once.
extern "C" int streampool_use_torch_out_of_memory() {
  std::call_once(torch_once, [] { torch_ready.store(find_torch_out_of_memory(), std::memory_order_release); });
  return torch_ready.load(std::memory_order_acquire) ? 1 : 0;
}

// Throws `message` (`len` bytes, copied before the throw): when `is_out_of_memory` is
// non-zero, PyTorch's out-of-memory error once streampool_use_torch_out_of_memory found it,
// an out_of_memory otherwise; a std::runtime_error for any other failure. Called from Rust
// as an "C-unwind" function, so the exception may cross the Rust frame that calls it.
extern "C" [[noreturn]] void streampool_throw_allocation_failure(const char* message, std::size_t len,
                                                                 int is_out_of_memory) {
  std::string text(message, len);
  if (is_out_of_memory != 0) {
    if (torch_ready.load(std::memory_order_acquire)) {
      throw_torch_out_of_memory(text);
    }
    throw out_of_memory(std::move(text));
  }
  throw std::runtime_error(text);
}
