// SSD_CHECK: the SSD store's broken internal invariants crash loudly (CONVENTIONS: untrusted input is answered,
// invariants assert). Shared by the store (ssd_store.cc), its slot index and its drives' I/O engine.
#pragma once

#include <cstdio>
#include <cstdlib>

#define SSD_CHECK(cond, what)                                                                                  \
  do {                                                                                                         \
    if (!(cond)) {                                                                                             \
      std::fprintf(stderr, "%s:%d: SsdStore invariant violated: %s [%s]\n", __FILE__, __LINE__, what, #cond); \
      std::abort();                                                                                            \
    }                                                                                                          \
  } while (0)
