// flexkv-bench cluster: the cluster tier (issue 16) between two flexkvd in network namespaces, against ucx_perftest
// over the same veths in the same run; the etcd directory's lookup latency and publish rate; a simulated N-node
// trace replay with and without peer reuse (see cluster_bench.cc).
#pragma once

// argv[0] is the subcommand name ("cluster").
int RunClusterBench(int argc, char** argv);
// The hidden "cluster-dir-worker" subcommand: the directory measurement, run by `cluster` inside a node's namespace.
int RunClusterDirWorker(int argc, char** argv);
