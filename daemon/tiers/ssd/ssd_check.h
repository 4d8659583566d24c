// SSD_CHECK: the SSD store's broken internal invariants crash loudly (FLEXKV_INVARIANT, common/invariant.h).
// Shared by the store (ssd_store.cc), its slot index and its drives' I/O engine.
#pragma once

#include "common/invariant.h"

#define SSD_CHECK(cond, what) FLEXKV_INVARIANT(cond, "SsdStore", what)
