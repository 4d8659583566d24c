// flexkv-bench index: the daemon's PrefixIndex and pool recovery at scale, in-process on one thread.
#pragma once

// argv[0] is the subcommand name.
int RunIndexBench(int argc, char** argv);
