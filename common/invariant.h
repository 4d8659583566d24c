// FLEXKV_INVARIANT: an internal invariant that does not hold is a bug of this program, not bad input: it crashes
// loudly, naming the file and line, the part whose invariant broke, what was expected and the condition
// (CONVENTIONS: untrusted input is answered with a Status, invariants assert). Never use it for anything a client,
// a file or a peer can make false. Header-only.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>

namespace flexkv {

// Prints "<file>:<line>: <part> invariant violated: <what> [<condition>]" to stderr and aborts.
[[noreturn]] inline void InvariantViolated(const char* file, int line, const char* part, const std::string& what,
                                           const char* condition) {
  std::fprintf(stderr, "%s:%d: %s invariant violated: %s [%s]\n", file, line, part, what.c_str(), condition);
  std::abort();
}

}  // namespace flexkv

// `what` (a string or a C string) is built only when `cond` is false.
#define FLEXKV_INVARIANT(cond, part, what)                                               \
  do {                                                                                   \
    if (!(cond)) ::flexkv::InvariantViolated(__FILE__, __LINE__, part, (what), #cond);   \
  } while (0)
