// `flexkv-bench transfer --host`: the host backend's store copy (engine KV memfd -> pool slots) with the content
// checksum summed in the copy loop, against plain memcpy and memcpy + a second checksum pass, in the same run.
#pragma once

int RunHostTransferBench(int argc, char** argv);
