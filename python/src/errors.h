// Status -> Python exception, shared by the extension's translation units (module.cc creates the
// classes, one per StatusCode, in PYBIND11_MODULE).
#pragma once

#include <pybind11/pybind11.h>

#include <map>
#include <utility>

#include "spillway/allocator/owner.h"
#include "spillway/base/status.h"

namespace spillway::python {

inline std::map<StatusCode, pybind11::object>& ExceptionTypes() {
  static auto* types =
      new std::map<StatusCode, pybind11::object>();  // never destroyed: outlives the interpreter
  return *types;
}

[[noreturn]] inline void Raise(const Status& st) {
  auto& types = ExceptionTypes();
  auto it = types.find(st.code());
  pybind11::object type = it != types.end() ? it->second : types.at(StatusCode::kInternal);
  PyErr_SetString(type.ptr(), st.ToString().c_str());
  throw pybind11::error_already_set();
}
inline void Check(const Status& st) {
  if (!st.ok()) Raise(st);
}
template <typename T>
T Check(Result<T> r) {
  if (!r.ok()) Raise(r.status());
  return std::move(r.value());
}

// {kind name: bytes} for a per-kind byte array (arena, node and swap-store stats).
template <typename Array>
pybind11::dict KindBytesDict(const Array& bytes) {
  pybind11::dict d;
  for (int k = 0; k < allocator::kKindCount; ++k) {
    d[allocator::KindName(static_cast<allocator::Kind>(k))] = bytes[k];
  }
  return d;
}

}  // namespace spillway::python
