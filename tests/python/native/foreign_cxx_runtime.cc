// A shared library carrying its own copy of the C++ runtime with every symbol exported: linked with
// -static-libstdc++ and nothing hidden, as some libraries a CUDA torch loads into the global scope
// are. test_package.py loads it with RTLD_GLOBAL before torch: any later library whose std:: calls
// are left to the dynamic linker gets this copy, which is what happened to the extension on the GPU
// image (docs/results/gpu-findings.md).
#include <sstream>
#include <string>

extern "C" int spillway_foreign_runtime_probe(long value) {
  std::ostringstream s;
  s << value;
  return static_cast<int>(s.str().size());
}
