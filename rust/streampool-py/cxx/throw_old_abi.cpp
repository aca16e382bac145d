// PyTorch's c10::Error made for PyTorch builds of the old C++ ABI (pip wheels of PyTorch
// 2.6 and before), whose constructor takes the old std::string. build.rs compiles this
// file with -D_GLIBCXX_USE_CXX11_ABI=0; throw.cpp calls it.
#include "c10_error.h"

#if defined(__GLIBCXX__) && _GLIBCXX_USE_CXX11_ABI
#error "throw_old_abi.cpp is compiled with -D_GLIBCXX_USE_CXX11_ABI=0"
#endif

extern "C" void streampool_construct_c10_error_old_abi(void* constructor, void* self, const char* text,
                                                       std::size_t len) {
  streampool_c10::construct(constructor, self, text, len);
}
