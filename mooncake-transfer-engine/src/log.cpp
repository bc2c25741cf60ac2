#include "mooncake/te/log.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>

namespace mooncake::log {
namespace {

Level parseLevel(const char* text) {
  if (text == nullptr) return Level::kWarning;
  std::string s(text);
  for (auto& c : s) c = static_cast<char>(toupper(static_cast<unsigned char>(c)));
  if (s == "TRACE") return Level::kTrace;
  if (s == "DEBUG") return Level::kDebug;
  if (s == "INFO") return Level::kInfo;
  if (s == "WARNING" || s == "WARN") return Level::kWarning;
  if (s == "ERROR") return Level::kError;
  if (s == "OFF" || s == "NONE") return Level::kOff;
  return Level::kWarning;
}

const char* levelTag(Level level) {
  switch (level) {
    case Level::kTrace: return "T";
    case Level::kDebug: return "D";
    case Level::kInfo: return "I";
    case Level::kWarning: return "W";
    case Level::kError: return "E";
    default: return "?";
  }
}

}  // namespace

Level threshold() {
  static const Level level = parseLevel(std::getenv("MC_LOG_LEVEL"));
  return level;
}

bool enabled(Level level) { return level >= threshold() && level != Level::kOff; }

void emit(Level level, const char* file, int line, const std::string& message) {
  using namespace std::chrono;
  auto now = system_clock::now();
  std::time_t secs = system_clock::to_time_t(now);
  auto micros = duration_cast<microseconds>(now.time_since_epoch()).count() % 1000000;
  std::tm tm_buf{};
  localtime_r(&secs, &tm_buf);
  const char* base = std::strrchr(file, '/');
  base = base ? base + 1 : file;
  // One fprintf per line keeps lines of concurrent threads whole.
  std::fprintf(stderr, "[mooncake %s %02d:%02d:%02d.%06ld %d %s:%d] %s\n", levelTag(level), tm_buf.tm_hour,
               tm_buf.tm_min, tm_buf.tm_sec, static_cast<long>(micros), static_cast<int>(getpid()), base, line,
               message.c_str());
}

}  // namespace mooncake::log
