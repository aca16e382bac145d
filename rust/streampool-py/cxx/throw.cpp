// The one piece of C++ in streampool: throwing the exception that a C++ caller of the
// allocation entry point (PyTorch's CUDAPluggableAllocator, which has no other error
// channel) turns into an error of its own. See streampool_alloc_cxx in src/capi.rs.
#include <cstddef>
#include <new>
#include <stdexcept>
#include <string>
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

}  // namespace

// Throws `message` (`len` bytes, copied before the throw): an out_of_memory when
// `is_out_of_memory` is non-zero, a std::runtime_error otherwise. Called from Rust as an
// "C-unwind" function, so the exception may cross the Rust frame that calls it.
extern "C" [[noreturn]] void streampool_throw_allocation_failure(const char* message, std::size_t len,
                                                                 int is_out_of_memory) {
  std::string text(message, len);
  if (is_out_of_memory != 0) {
    throw out_of_memory(std::move(text));
  }
  throw std::runtime_error(text);
}
