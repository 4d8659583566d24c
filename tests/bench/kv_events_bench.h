// `flexkv-bench events`: the KV event stream's cost on the store path (issue 20): store round trips (Store + Wait,
// with evictions) on a flexkvd with no subscriber, against the same with a gRPC subscriber reading the stream and,
// with --zmq, a daemon publishing on ZMQ too; rounds interleaved in one run, medians reported.
#pragma once

int RunKvEventsBench(int argc, char** argv);
