// spillway: the command-line program. `spillway plan` runs the capacity planner
// (offload/planner.h). Exit status: 0 fits, 1 does not fit, 2 bad usage or input.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "spillway/offload/config.h"
#include "spillway/offload/planner.h"

namespace {

using spillway::Result;
using spillway::Status;
using namespace spillway::offload;

int Fail(const std::string& message) {
  std::fprintf(stderr, "spillway: %s\n", message.c_str());
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Spillway: host-memory and NVMe offload for ZeRO-3 training"};
  app.require_subcommand(1);

  CLI::App* plan = app.add_subcommand(
      "plan", "Capacity plan for a ZeRO-3 run: bytes per tier and state, pools, checkpoint and fork "
              "peaks, a verdict and the settings that would make it fit");
  std::string params_text, host_text, nvme_text = "0", config_path;
  uint32_t world = 1, nodes = 1;
  plan->add_option("--params", params_text, "model parameters, e.g. 34e9")->required();
  plan->add_option("--world-size", world, "ranks (GPUs) in total")->check(CLI::PositiveNumber);
  plan->add_option("--nodes", nodes, "machines")->check(CLI::PositiveNumber);
  plan->add_option("--host-ram", host_text, "host memory per node, e.g. 1TiB")->required();
  plan->add_option("--nvme", nvme_text, "NVMe bytes per node, e.g. 4TiB (default 0)");
  plan->add_option("--config", config_path, "DeepSpeed JSON config (default: stage 3, no offload)")
      ->check(CLI::ExistingFile);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }

  if (plan->parsed()) {
    PlanInput in;
    char* end = nullptr;
    in.params = std::strtod(params_text.c_str(), &end);
    if (end == params_text.c_str() || *end != '\0' || !(in.params > 0)) {
      return Fail("--params '" + params_text + "' is not a positive number of parameters (e.g. 34e9)");
    }
    auto host = ParseByteSize(host_text);
    if (!host.ok()) return Fail("--host-ram " + host.status().message());
    in.host_ram_bytes = *host;
    if (nvme_text != "0") {
      auto nvme = ParseByteSize(nvme_text);
      if (!nvme.ok()) return Fail("--nvme " + nvme.status().message());
      in.nvme_bytes = *nvme;
    }
    in.world_size = world;
    in.nodes = nodes;
    if (!config_path.empty()) {
      auto c = Config::Load(config_path);
      if (!c.ok()) return Fail(c.status().ToString());
      in.config = *c;
    } else {
      auto c = Config::Parse(R"({"zero_optimization": {"stage": 3}})");
      if (!c.ok()) return Fail(c.status().ToString());
      in.config = *c;
    }
    auto r = MakePlan(in);
    if (!r.ok()) return Fail(r.status().ToString());
    std::printf("spillway plan: %.3g parameters, %u ranks on %u node(s)\n\n%s", in.params, world,
                nodes, r->ToString().c_str());
    return r->fits ? 0 : 1;
  }
  return 2;
}
