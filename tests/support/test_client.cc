// flexkv-test-client: an engine stand-in that integration and chaos tests start as a separate process.
// Prints one line per event on stdout ("ATTACHED <id> <block_bytes> <capacity_blocks>", "ERROR <CODE> <msg>")
// and then holds its session until it is killed.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <string>

#include "flexkv/client.h"

int main(int argc, char** argv) {
  CLI::App app{"flexkv test client"};
  std::string socket, name = "test-client", ns = "test-model";
  flexkv::Geometry g = flexkv::Llama3_8B();
  uint32_t dp_rank = 0;
  app.add_option("--socket", socket);
  app.add_option("--name", name);
  app.add_option("--namespace", ns);
  app.add_option("--dp-rank", dp_rank);
  app.add_option("--tokens-per-block", g.tokens_per_block);
  app.add_option("--layers", g.num_layers);
  app.add_option("--kv-planes", g.kv_planes);
  app.add_option("--heads", g.kv_heads_per_rank);
  app.add_option("--head-dim", g.head_dim);
  app.add_option("--dtype-bytes", g.dtype_bytes);
  app.add_option("--tp", g.tp_size);
  CLI11_PARSE(app, argc, argv);

  setvbuf(stdout, nullptr, _IOLBF, 0);
  auto client = flexkv::Client::Connect({socket, std::chrono::milliseconds(5000), std::chrono::milliseconds(10000)});
  if (!client.ok()) {
    std::printf("ERROR %s %s\n", flexkv::StatusCodeName(client.status().code()), client.status().message().c_str());
    return 3;
  }
  flexkv::AttachOptions options;
  options.client_name = name;
  options.model_namespace = ns;
  options.dp_rank = dp_rank;
  options.geometry = g;
  auto session = (*client)->Attach(options);
  if (!session.ok()) {
    std::printf("ERROR %s %s\n", flexkv::StatusCodeName(session.status().code()), session.status().message().c_str());
    return 1;
  }
  std::printf("ATTACHED %llu %llu %llu\n", static_cast<unsigned long long>(session->session_id),
              static_cast<unsigned long long>(session->block_bytes),
              static_cast<unsigned long long>(session->capacity_blocks));
  for (;;) pause();  // hold the session until killed
}
