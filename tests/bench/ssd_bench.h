// flexkv-bench ssd: the SSD tier's block store against fio on the same directory (see ssd_bench.cc).
#pragma once

// argv[0] is the subcommand name.
int RunSsdBench(int argc, char** argv);
