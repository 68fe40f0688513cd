// The host arena from an installed Spillway, linked as spillway::allocator alone.
#include <cstdio>

#include "spillway/allocator/host_arena.h"

int main() {
  using namespace spillway::allocator;
  Ledger ledger;
  HostArenaOptions o;
  o.ledger = &ledger;
  o.budget_bytes = 64 << 20;
  o.pin = PinMode::kPageable;
  auto arena = HostArena::Create(o);
  if (!arena.ok()) return std::printf("%s\n", arena.status().ToString().c_str()), 1;
  auto p = (*arena)->Allocate(
      1 << 20, {Kind::kSwapBuffer, Lifetime::kPersistent, 0, kProcessScope, SPILLWAY_SITE});
  if (!p.ok()) return std::printf("%s\n", p.status().ToString().c_str()), 1;
  std::printf("allocator_consumer: 1 MiB from the host arena, %llu bytes live\n",
              static_cast<unsigned long long>((*arena)->Stats().live_bytes));
  return (*arena)->Free(*p).ok() ? 0 : 1;
}
