//! Compiles the C++ that throws for `streampool_alloc_cxx` (cxx/throw.cpp).
fn main() {
    println!("cargo:rerun-if-changed=cxx/throw.cpp");
    cc::Build::new().cpp(true).std("c++17").warnings(true).file("cxx/throw.cpp").compile("streampool_throw");
}
