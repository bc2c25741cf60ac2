// The *_arrays and *_pages forms take contiguous arrays of 8-byte integers
// (numpy uint64/int64, or anything with the buffer protocol): read them into
// vectors, with errors that name the argument.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace mooncake::binding {

inline bool isEightByteInteger(const pybind11::buffer_info& info) {
  if (info.itemsize != 8 || info.format.empty()) return false;
  const char kind = info.format.back();
  return kind == 'q' || kind == 'Q' || kind == 'l' || kind == 'L';
}

// A 1-D contiguous array of 8-byte integers.
inline std::vector<uint64_t> words(const pybind11::buffer& array, const char* name) {
  pybind11::buffer_info info = array.request();
  if (info.ndim != 1 || !isEightByteInteger(info) || (info.shape[0] > 1 && info.strides[0] != 8)) {
    throw pybind11::type_error(std::string(name) + ": must be a 1-D contiguous array of 8-byte integers " +
                               "(numpy uint64 or int64), got format '" + info.format + "' with " +
                               std::to_string(info.ndim) + " dimension(s)");
  }
  std::vector<uint64_t> out(static_cast<size_t>(info.shape[0]));
  if (!out.empty()) std::memcpy(out.data(), info.ptr, out.size() * 8);
  return out;
}

// A C-contiguous [rows, columns] array of 8-byte integers, row by row.
inline std::vector<uint64_t> table(const pybind11::buffer& array, const char* name, pybind11::ssize_t columns,
                                   size_t& rows) {
  pybind11::buffer_info info = array.request();
  const bool contiguous = info.ndim == 2 && (info.shape[0] <= 1 || info.strides[0] == 8 * columns) &&
                          (info.shape[1] <= 1 || info.strides[1] == 8);
  if (!isEightByteInteger(info) || info.ndim != 2 || info.shape[1] != columns || !contiguous) {
    throw pybind11::type_error(std::string(name) + ": must be a C-contiguous [rows, " + std::to_string(columns) +
                               "] array of 8-byte integers, got format '" + info.format + "' with " +
                               std::to_string(info.ndim) + " dimension(s)");
  }
  rows = static_cast<size_t>(info.shape[0]);
  std::vector<uint64_t> out(rows * columns);
  if (!out.empty()) std::memcpy(out.data(), info.ptr, out.size() * 8);
  return out;
}

}  // namespace mooncake::binding
