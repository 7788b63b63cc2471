// Status: the result of every engine call that can fail.
//
// The engine never throws across its public interface. A call returns a
// Status; an OK status carries no message, any other carries a code and a
// message naming the table, handle or shape at fault. The Python binding maps
// each code to one exception class (see python/mltuner/exceptions.py).
//
// Status is a small value type, safe to copy and to pass between threads.
#pragma once

#include <string>
#include <utility>

namespace mltuner {

enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument = 1,   // wrong shape, dtype, size, unknown name
  kNotFound = 2,          // unknown table or handle
  kOutOfOrder = 3,        // a call that breaks the recorded op order
  kTimeout = 4,           // a bounded wait ran out
  kResourceExhausted = 5, // memory budget too small
  kShutdown = 6,          // the engine is shut down or was stopped by an error
  kCorruptMessage = 7,    // malformed, truncated or foreign wire message
  kInternal = 8,          // a broken invariant: a bug in mltuner
  kPeerLost = 9,          // another worker process died or stopped answering
  kNonFinite = 10,        // a NaN or infinite update refused (Config::check_finite)
  kCancelled = 11,        // a wait given up because the caller's interrupt check asked (mltuner/interrupt.h)
};

const char* StatusCodeName(StatusCode code);

class Status {
 public:
  Status() = default;  // OK

  static Status Ok() { return Status(); }
  static Status InvalidArgument(std::string msg) { return {StatusCode::kInvalidArgument, std::move(msg)}; }
  static Status NotFound(std::string msg) { return {StatusCode::kNotFound, std::move(msg)}; }
  static Status OutOfOrder(std::string msg) { return {StatusCode::kOutOfOrder, std::move(msg)}; }
  static Status Timeout(std::string msg) { return {StatusCode::kTimeout, std::move(msg)}; }
  static Status ResourceExhausted(std::string msg) { return {StatusCode::kResourceExhausted, std::move(msg)}; }
  static Status Shutdown(std::string msg) { return {StatusCode::kShutdown, std::move(msg)}; }
  static Status CorruptMessage(std::string msg) { return {StatusCode::kCorruptMessage, std::move(msg)}; }
  static Status Internal(std::string msg) { return {StatusCode::kInternal, std::move(msg)}; }
  static Status PeerLost(std::string msg) { return {StatusCode::kPeerLost, std::move(msg)}; }
  static Status NonFinite(std::string msg) { return {StatusCode::kNonFinite, std::move(msg)}; }
  static Status Cancelled(std::string msg) { return {StatusCode::kCancelled, std::move(msg)}; }
  // A status of `code` (a code read off the wire); an unknown code, or kOk,
  // becomes kInternal, so the result is never OK.
  static Status FromCode(StatusCode code, std::string msg);

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  std::string ToString() const;
  // The same code, its message prefixed by `context` (where it happened).
  Status WithContext(const std::string& context) const {
    return ok() ? *this : Status(code_, context + ": " + message_);
  }

 private:
  Status(StatusCode code, std::string msg) : code_(code), message_(std::move(msg)) {}

  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

}  // namespace mltuner

// Returns from the enclosing function when `expr` yields a non-OK Status.
#define MLT_RETURN_IF_ERROR(expr)              \
  do {                                         \
    ::mltuner::Status _mlt_status = (expr);    \
    if (!_mlt_status.ok()) return _mlt_status; \
  } while (0)
