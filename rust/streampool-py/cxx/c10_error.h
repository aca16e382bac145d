// What streampool needs of PyTorch's c10::Error to make one without PyTorch's headers
// (throw.cpp): the layout of c10::SourceLocation, and the call of a constructor
// c10::Error(SourceLocation, std::string) found at run time. std::string is that of the
// C++ ABI the including file is compiled for: throw.cpp has the C++11 one (PyTorch 2.7 and
// later), throw_old_abi.cpp the old one (PyTorch 2.6 and before).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace streampool_c10 {

struct SourceLocation {
  const char* function;
  const char* file;
  std::uint32_t line;
};

// Calls `constructor` (c10::Error's, or c10::OutOfMemoryError's own, as a function whose
// first argument is `this`: the Itanium C++ ABI's member calls) to make the error at
// `self` with the message `text` (`len` bytes).
inline void construct(void* constructor, void* self, const char* text, std::size_t len) {
  using Constructor = void (*)(void* self, SourceLocation, std::string);
  reinterpret_cast<Constructor>(constructor)(self, SourceLocation{"streampool_alloc_cxx", "streampool", 0},
                                             std::string(text, len));
}

}  // namespace streampool_c10

// c10::Error's constructor in the old ABI (throw_old_abi.cpp): a std::string of that ABI.
extern "C" void streampool_construct_c10_error_old_abi(void* constructor, void* self, const char* text,
                                                       std::size_t len);
