// Minimal leveled logging for the torch-free core, controlled by MC_LOG_LEVEL
// (TRACE, DEBUG, INFO, WARNING, ERROR, OFF; default WARNING). Lines go to stderr
// with a timestamp, the pid and the source location, so that interleaved
// output of several ranks stays readable.
#pragma once

#include <sstream>

namespace mooncake::log {

enum class Level : int { kTrace = 0, kDebug, kInfo, kWarning, kError, kOff };

Level threshold();
bool enabled(Level level);
void emit(Level level, const char* file, int line, const std::string& message);

class Line {
 public:
  Line(Level level, const char* file, int line) : level_(level), file_(file), line_(line) {}
  ~Line() { emit(level_, file_, line_, stream_.str()); }
  template <typename T>
  Line& operator<<(const T& value) {
    stream_ << value;
    return *this;
  }

 private:
  Level level_;
  const char* file_;
  int line_;
  std::ostringstream stream_;
};

}  // namespace mooncake::log

#define MC_LOG(LEVEL)                                                   \
  if (!::mooncake::log::enabled(::mooncake::log::Level::k##LEVEL)) {    \
  } else                                                                \
    ::mooncake::log::Line(::mooncake::log::Level::k##LEVEL, __FILE__, __LINE__)

namespace mooncake::log {
// Warning for a failure, Info for the same event when it was planned.
inline Level warningUnlessPlanned(bool planned) { return planned ? Level::kInfo : Level::kWarning; }
}  // namespace mooncake::log

// A level chosen at run time (e.g. warningUnlessPlanned(...)).
#define MC_LOG_AT(LEVEL_VALUE)                                          \
  if (const ::mooncake::log::Level mc_log_level_ = (LEVEL_VALUE);       \
      !::mooncake::log::enabled(mc_log_level_)) {                       \
  } else                                                                \
    ::mooncake::log::Line(mc_log_level_, __FILE__, __LINE__)
