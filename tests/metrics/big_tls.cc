// A shared library with 1 MiB of thread-local storage. Loaded at program start, its TLS lives in
// glibc's static TLS block, which every thread's stack must hold: the situation libtorch_cuda
// creates (Note [Thread stack floor]).
thread_local char big_tls_block[1 << 20];

extern "C" int BigTlsTouch(int i) {
  big_tls_block[i & ((1 << 20) - 1)] = static_cast<char>(i);
  return big_tls_block[i & ((1 << 20) - 1)];
}
