// The library's identity (which level it was built for) and its error message.
#include <cstdarg>
#include "common.h"

namespace {
thread_local char g_error[512] = "";
}

void pl::set_error(const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(g_error, sizeof g_error, fmt, args);
  va_end(args);
}

PL_EXPORT const char* pl_last_error() { return g_error; }

// The level named by the build (-DPL_LEVEL=...): the loader checks it against the one it asked for.
PL_EXPORT const char* pl_level() { return PL_LEVEL; }

// Vector width in float32 lanes: 8 (AVX2) or 16 (AVX-512).
PL_EXPORT int pl_lanes() { return pl::kLanes; }
