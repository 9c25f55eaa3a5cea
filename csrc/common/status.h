// Status: what every core function (csrc/ops/*) returns instead of throwing.
//
// Cores are compiled by g++ and nvcc alike and never throw across that boundary; bindings.cpp turns a
// non-Ok status into a Python exception (InvalidArgument -> ValueError, CudaError/Internal -> RuntimeError).
// `message` must point at storage that outlives the call: a string literal, or the thread-local buffer
// filled by Status::printf (one per thread, overwritten by the next formatted status on that thread).
#pragma once

#include <cstdarg>
#include <cstdio>

namespace dg {

enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument = 1,  // bad shape / size / value: the caller's fault
  kCudaError = 2,        // a CUDA runtime call or kernel launch failed
  kInternal = 3,         // a bug in dgserve
};

struct Status {
  StatusCode code = StatusCode::kOk;
  const char* message = "";

  bool ok() const { return code == StatusCode::kOk; }

  static Status Ok() { return Status{}; }
  static Status InvalidArgument(const char* msg) { return Status{StatusCode::kInvalidArgument, msg}; }
  static Status CudaError(const char* msg) { return Status{StatusCode::kCudaError, msg}; }
  static Status Internal(const char* msg) { return Status{StatusCode::kInternal, msg}; }

  // A formatted status; the text lives in a thread-local buffer (read it before the next call).
  static Status printf(StatusCode code, const char* fmt, ...) {
    static thread_local char buf[512];
    va_list args;
    va_start(args, fmt);
    std::vsnprintf(buf, sizeof(buf), fmt, args);
    va_end(args);
    return Status{code, buf};
  }
};

inline const char* status_code_name(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "Ok";
    case StatusCode::kInvalidArgument: return "InvalidArgument";
    case StatusCode::kCudaError: return "CudaError";
    case StatusCode::kInternal: return "Internal";
  }
  return "Unknown";
}

}  // namespace dg
