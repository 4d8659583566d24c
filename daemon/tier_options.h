// Each tier's options from the daemon's configuration (the flags and the config file that name them): what daemon.cc
// passes to the tier's Create, one line per tier.
#pragma once

#include "daemon/config/config.h"
#include "daemon/tiers/cluster/cluster_tier.h"
#include "daemon/tiers/ssd/ssd_tier.h"

namespace flexkv {

// --etcd-endpoints, --node-id, --cluster-* and --transfer-dev.
ClusterTierOptions ClusterTierOptionsFrom(const DaemonConfig& config);
// --ssd-*.
SsdTierOptions SsdTierOptionsFrom(const DaemonConfig& config);

}  // namespace flexkv
