// Runs code that joins our own threads, which may need the GIL themselves
// (they drop tensors Python created, complete Works Python holds): with the
// GIL released when the caller holds it (Python destroys groups holding it).
#pragma once

#include <torch/csrc/utils/pybind.h>

namespace mooncake::pg {

template <class Fn>
void runWithoutGil(Fn&& fn) {
  if (Py_IsInitialized() && PyGILState_Check()) {
    pybind11::gil_scoped_release release;
    fn();
  } else {
    fn();
  }
}

}  // namespace mooncake::pg
