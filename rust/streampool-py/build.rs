//! Compiles the C++ that throws for `streampool_alloc_cxx` (cxx/): throw.cpp, and
//! throw_old_abi.cpp, which makes PyTorch's error for builds of the old C++ ABI and so is
//! compiled for that ABI, as a library of its own.
fn main() {
    for file in ["cxx/throw.cpp", "cxx/throw_old_abi.cpp", "cxx/c10_error.h"] {
        println!("cargo:rerun-if-changed={file}");
    }
    cc::Build::new().cpp(true).std("c++17").warnings(true).file("cxx/throw.cpp").compile("streampool_throw");
    cc::Build::new()
        .cpp(true)
        .std("c++17")
        .warnings(true)
        .define("_GLIBCXX_USE_CXX11_ABI", "0")
        .file("cxx/throw_old_abi.cpp")
        .compile("streampool_throw_old_abi");
}
