// Calls into each installed library, so that linking resolves every one of them.
#include <cstdio>

#include "spillway/aio/aio_handle.h"
#include "spillway/allocator/host_arena.h"
#include "spillway/engine/cpu_features.h"
#include "spillway/engine/host_optimizer.h"
#include "spillway/metrics/exporter.h"
#include "spillway/offload/config.h"
#if CONSUMER_WITH_TORCH
#include "spillway/trainer/trainer.h"
#endif

int main() {
  using namespace spillway;
  auto config = offload::Config::Parse(R"({"zero_optimization": {"stage": 3}})");
  if (!config.ok()) return 1;
  allocator::HostArenaOptions ho = config->HostArenaOptions();
  ho.budget_bytes = 64ull << 20;
  auto arena = allocator::HostArena::Create(ho);
  if (!arena.ok()) return 2;
  aio::AioHandleOptions ao;
  ao.arena = arena->get();
  auto handle = aio::AioHandle::Create(ao);
  if (!handle.ok()) return 6;
  auto optimizer = engine::HostOptimizer::Create(engine::HostOptimizerOptions{});
  if (!optimizer.ok()) return 3;
  metrics::ExporterOptions eo;
  eo.address = "127.0.0.1:0";
  auto exporter = metrics::Exporter::Start(eo);
  if (!exporter.ok()) return 4;
#if CONSUMER_WITH_TORCH
  trainer::GptConfig model;
  if (trainer::gpt::Units(model) != model.n_layer + 2) return 5;
#endif
  std::printf("consumer: found spillway, made an arena, an aio handle, an optimizer (%s) and an exporter at %s\n",
              engine::IsaName(optimizer.value()->isa()), exporter.value()->address().c_str());
  return 0;
}
