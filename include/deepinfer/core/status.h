// Status and Result<T>: how every fallible call at a module boundary reports failure (leveldb's Status,
// with a value-or-error wrapper in the spirit of std::expected, which C++20 lacks).
#pragma once

#include "deepinfer/core/check.h"
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace deepinfer {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,  // the caller's input is wrong: a field, a value, a limit
  kNotFound,         // a file, tensor, token or name does not exist
  kIoError,          // the operating system refused a read or write
  kCorruption,       // data on disk or on the wire is malformed
  kUnsupported,      // valid input that this build does not handle
  kInternal,         // a bug: an invariant of ours does not hold
  kResourceExhausted,  // memory (host or device) ran out
  kShuttingDown,       // the work was refused or cut short because the process is stopping
  kFailedPrecondition,  // the system is not in a state to do this (e.g. a directory of another model)
};

// A success or an error with a message a user can act on. Cheap to copy when ok.
// Thread-safety: a Status is a value; distinct objects may be used from distinct threads.
class [[nodiscard]] Status {
 public:
  Status() = default;
  static Status ok_status() { return Status(); }
  static Status invalid_argument(std::string message) { return {StatusCode::kInvalidArgument, std::move(message)}; }
  static Status not_found(std::string message) { return {StatusCode::kNotFound, std::move(message)}; }
  static Status io_error(std::string message) { return {StatusCode::kIoError, std::move(message)}; }
  static Status corruption(std::string message) { return {StatusCode::kCorruption, std::move(message)}; }
  static Status unsupported(std::string message) { return {StatusCode::kUnsupported, std::move(message)}; }
  static Status internal(std::string message) { return {StatusCode::kInternal, std::move(message)}; }
  static Status resource_exhausted(std::string message) {
    return {StatusCode::kResourceExhausted, std::move(message)};
  }

  static Status failed_precondition(std::string message) {
    return {StatusCode::kFailedPrecondition, std::move(message)};
  }
  static Status shutting_down(std::string message) { return {StatusCode::kShuttingDown, std::move(message)}; }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "InvalidArgument: <message>", or "OK".
  std::string to_string() const;

 private:
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

std::string_view status_code_name(StatusCode code);

// A value of type T, or the Status that explains why there is none.
// REQUIRES: value() only when ok(); status() is Ok when ok().
template <class T>
class [[nodiscard]] Result {
 public:
  Result(T value) : state_(std::move(value)) {}            // NOLINT(google-explicit-constructor)
  Result(Status status) : state_(std::move(status)) {       // NOLINT(google-explicit-constructor)
    DEEPINFER_CHECK(!std::get<Status>(state_).ok(), "a Result built from a Status must carry an error");
  }
  bool ok() const { return std::holds_alternative<T>(state_); }
  const T& value() const& { return std::get<T>(state_); }
  T& value() & { return std::get<T>(state_); }
  T&& value() && { return std::get<T>(std::move(state_)); }
  const T& operator*() const& { return value(); }
  T& operator*() & { return value(); }
  const T* operator->() const { return &value(); }
  T* operator->() { return &value(); }
  Status status() const { return ok() ? Status() : std::get<Status>(state_); }

 private:
  std::variant<T, Status> state_;
};

}  // namespace deepinfer

// Returns the Status of `expr` from the enclosing function when it is not ok.
#define DEEPINFER_RETURN_IF_ERROR(expr) \
  do {                                  \
    ::deepinfer::Status status_ = (expr); \
    if (!status_.ok()) return status_;  \
  } while (0)
