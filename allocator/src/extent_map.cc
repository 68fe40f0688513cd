// ExtentMap: best-fit with coalescing. Both indexes are ordered trees, so every operation is O(log
// n) in the number of free extents, which stays small because neighbours always merge.
#include "spillway/allocator/extent_map.h"

#include <algorithm>

#include "spillway/base/check.h"

namespace spillway::allocator {

Status ExtentMap::AddSpan(uint64_t base, uint64_t size) {
  SPILLWAY_VALIDATE_ON_EXIT(*this);
  if (size == 0) return Status::InvalidArgument("ExtentMap::AddSpan: a span of 0 bytes");
  if (base + size < base) return Status::InvalidArgument("ExtentMap::AddSpan: span wraps around");
  auto next = spans_.lower_bound(base);
  if (next != spans_.end() && next->first < base + size) {
    return Status::Internal(
        StrCat("ExtentMap::AddSpan: span at ", base, " overlaps span at ", next->first));
  }
  if (next != spans_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second.size > base) {
      return Status::Internal(
          StrCat("ExtentMap::AddSpan: span at ", base, " overlaps span at ", prev->first));
    }
  }
  spans_.emplace(base, Span{base, size, 0, 0});
  span_bytes_ += size;
  empty_count_++;
  empty_bytes_ += size;
  InsertFree(base, size, base);
  return Status::Ok();
}

Status ExtentMap::GrowSpan(uint64_t base, uint64_t extra) {
  SPILLWAY_VALIDATE_ON_EXIT(*this);
  auto it = spans_.find(base);
  if (it == spans_.end()) return Status::Internal(StrCat("ExtentMap::GrowSpan: no span at ", base));
  Span& span = it->second;
  const uint64_t old_end = base + span.size;
  auto next = std::next(it);
  if (extra == 0 || old_end + extra < old_end ||
      (next != spans_.end() && next->first < old_end + extra)) {
    return Status::Internal(StrCat("ExtentMap::GrowSpan: growing span ", base, " by ", extra,
                                   " would overlap or wrap"));
  }
  span.size += extra;
  span_bytes_ += extra;
  if (span.used_count == 0) empty_bytes_ += extra;
  auto tail = free_by_addr_.lower_bound(old_end);
  if (tail != free_by_addr_.begin()) {
    auto prev = std::prev(tail);
    if (prev->second.span_base == base && prev->first + prev->second.size == old_end) {
      auto size_node = free_by_size_.extract({prev->second.size, prev->first});
      size_node.value().first += extra;
      free_by_size_.insert(std::move(size_node));
      prev->second.size += extra;
      free_bytes_ += extra;
      return Status::Ok();
    }
  }
  InsertFree(old_end, extra, base);
  return Status::Ok();
}

Status ExtentMap::RemoveSpan(uint64_t base) {
  SPILLWAY_VALIDATE_ON_EXIT(*this);
  auto it = spans_.find(base);
  if (it == spans_.end()) {
    return Status::Internal(StrCat("ExtentMap::RemoveSpan: no span starts at ", base));
  }
  if (it->second.used_count != 0) {
    return Status::Internal(StrCat("ExtentMap::RemoveSpan: span at ", base, " still holds ",
                                   it->second.used_count, " allocations"));
  }
  auto free_it = free_by_addr_.find(base);
  if (free_it == free_by_addr_.end() || free_it->second.size != it->second.size) {
    return Status::Internal("ExtentMap::RemoveSpan: an empty span is not one free extent");
  }
  EraseFree(free_it);
  span_bytes_ -= it->second.size;
  empty_bytes_ -= it->second.size;
  empty_count_--;
  spans_.erase(it);
  return Status::Ok();
}

std::optional<uint64_t> ExtentMap::Allocate(uint64_t size, uint64_t max_extent) {
  SPILLWAY_VALIDATE_ON_EXIT(*this);
  if (size == 0) return std::nullopt;
  auto fit = free_by_size_.lower_bound({size, 0});
  if (fit == free_by_size_.end() || fit->first > max_extent) return std::nullopt;
  const uint64_t base = fit->second;
  const uint64_t extent_size = fit->first;
  // Re-key the nodes in place (extract + insert) so the hot path allocates no tree nodes.
  auto size_node = free_by_size_.extract(fit);
  auto addr_node = free_by_addr_.extract(base);
  const uint64_t span_base = addr_node.mapped().span_base;
  free_bytes_ -= size;
  if (extent_size > size) {
    size_node.value() = {extent_size - size, base + size};
    free_by_size_.insert(std::move(size_node));
    addr_node.key() = base + size;
    addr_node.mapped().size = extent_size - size;
    free_by_addr_.insert(std::move(addr_node));
  }
  NoteUsed(spans_.at(span_base), static_cast<int64_t>(size), 1);
  return base;
}

void ExtentMap::Free(uint64_t base, uint64_t size) {
  SPILLWAY_VALIDATE_ON_EXIT(*this);
  Span* span = SpanOf(base);
  // Freeing an extent that is not allocated would hand the same bytes out twice: always checked.
  SPILLWAY_CHECK(span != nullptr && size <= span->size && base - span->base <= span->size - size)
      << "ExtentMap::Free(" << base << ", " << size << "): not inside one span";
  auto next = free_by_addr_.lower_bound(base);
  auto prev = next == free_by_addr_.begin() ? free_by_addr_.end() : std::prev(next);
  SPILLWAY_CHECK(next == free_by_addr_.end() || next->first >= base + size)
      << "ExtentMap::Free(" << base << ", " << size << "): overlaps the free extent at "
      << next->first;
  SPILLWAY_CHECK(prev == free_by_addr_.end() || prev->first + prev->second.size <= base)
      << "ExtentMap::Free(" << base << ", " << size << "): overlaps the free extent at "
      << prev->first;
  const bool merge_prev = prev != free_by_addr_.end() && prev->second.span_base == span->base &&
                          prev->first + prev->second.size == base;
  const bool merge_next = next != free_by_addr_.end() && next->second.span_base == span->base &&
                          next->first == base + size;
  free_bytes_ += size;
  if (merge_prev) {
    // Grow the previous extent in place; swallow the next one if it touches too.
    uint64_t grown = prev->second.size + size;
    if (merge_next) {
      grown += next->second.size;
      free_by_size_.erase({next->second.size, next->first});
      free_by_addr_.erase(next);
    }
    auto size_node = free_by_size_.extract({prev->second.size, prev->first});
    size_node.value().first = grown;
    free_by_size_.insert(std::move(size_node));
    prev->second.size = grown;
  } else if (merge_next) {
    // The next extent now starts at `base`: re-key both of its nodes.
    const uint64_t grown = next->second.size + size;
    auto size_node = free_by_size_.extract({next->second.size, next->first});
    size_node.value() = {grown, base};
    free_by_size_.insert(std::move(size_node));
    auto addr_node = free_by_addr_.extract(next);
    addr_node.key() = base;
    addr_node.mapped().size = grown;
    free_by_addr_.insert(std::move(addr_node));
  } else {
    free_by_addr_.emplace(base, Free_{size, span->base});
    free_by_size_.emplace(size, base);
  }
  NoteUsed(*span, -static_cast<int64_t>(size), -1);
}

const ExtentMap::Span* ExtentMap::FindSpan(uint64_t addr) const {
  auto it = spans_.upper_bound(addr);
  if (it == spans_.begin()) return nullptr;
  --it;
  return addr < it->first + it->second.size ? &it->second : nullptr;
}

ExtentMap::Span* ExtentMap::SpanOf(uint64_t addr) { return const_cast<Span*>(FindSpan(addr)); }

bool ExtentMap::IsFree(uint64_t addr) const {
  auto it = free_by_addr_.upper_bound(addr);
  if (it == free_by_addr_.begin()) return false;
  --it;
  return addr < it->first + it->second.size;
}

uint64_t ExtentMap::FreeBytesEndingAt(uint64_t end) const {
  auto it = free_by_addr_.lower_bound(end);
  if (it == free_by_addr_.begin()) return 0;
  --it;
  return it->first + it->second.size == end ? it->second.size : 0;
}

uint64_t ExtentMap::largest_free_extent() const {
  return free_by_size_.empty() ? 0 : free_by_size_.rbegin()->first;
}

std::vector<ExtentMap::Span> ExtentMap::EmptySpans() const {
  std::vector<Span> out;
  out.reserve(empty_count_);
  for (const auto& [base, span] : spans_) {
    if (span.used_count == 0) out.push_back(span);
  }
  std::sort(out.begin(), out.end(), [](const Span& a, const Span& b) {
    return a.size != b.size ? a.size > b.size : a.base < b.base;
  });
  return out;
}

void ExtentMap::InsertFree(uint64_t base, uint64_t size, uint64_t span_base) {
  free_by_addr_.emplace(base, Free_{size, span_base});
  free_by_size_.emplace(size, base);
  free_bytes_ += size;
}

void ExtentMap::EraseFree(std::map<uint64_t, Free_>::iterator it) {
  free_by_size_.erase({it->second.size, it->first});
  free_bytes_ -= it->second.size;
  free_by_addr_.erase(it);
}

void ExtentMap::NoteUsed(Span& span, int64_t delta_bytes, int64_t delta_count) {
  const bool was_empty = span.used_count == 0;
  span.used_bytes = static_cast<uint64_t>(static_cast<int64_t>(span.used_bytes) + delta_bytes);
  span.used_count = static_cast<uint64_t>(static_cast<int64_t>(span.used_count) + delta_count);
  const bool is_empty = span.used_count == 0;
  if (was_empty && !is_empty) {
    empty_count_--;
    empty_bytes_ -= span.size;
  } else if (!was_empty && is_empty) {
    empty_count_++;
    empty_bytes_ += span.size;
  }
}

Status ExtentMap::Validate() const {
  if (free_by_size_.size() != free_by_addr_.size()) {
    return Status::Internal("Validate: size and address indexes differ in length");
  }
  std::map<uint64_t, uint64_t> free_in_span;  // span base -> free bytes
  uint64_t free_sum = 0;
  uint64_t prev_end = 0, prev_span = UINT64_MAX;
  for (const auto& [b, f] : free_by_addr_) {
    if (f.size == 0) return Status::Internal(StrCat("Validate: empty free extent at ", b));
    if (!free_by_size_.count({f.size, b})) {
      return Status::Internal(StrCat("Validate: free extent at ", b, " missing from size index"));
    }
    const Span* s = FindSpan(b);
    if (s == nullptr || s->base != f.span_base || b + f.size > s->base + s->size) {
      return Status::Internal(StrCat("Validate: free extent at ", b, " is not inside its span"));
    }
    if (f.span_base == prev_span && b <= prev_end) {
      return Status::Internal(StrCat("Validate: free extent at ", b,
                                     b == prev_end ? " touches the one before it (not coalesced)"
                                                   : " overlaps the one before it"));
    }
    prev_end = b + f.size;
    prev_span = f.span_base;
    free_in_span[f.span_base] += f.size;
    free_sum += f.size;
  }
  if (free_sum != free_bytes_) return Status::Internal("Validate: free_bytes_ is stale");
  uint64_t spans_sum = 0, empty_sum = 0, empty_n = 0;
  for (const auto& [base, span] : spans_) {
    spans_sum += span.size;
    const uint64_t free = free_in_span.count(base) ? free_in_span[base] : 0;
    if (free + span.used_bytes != span.size) {
      return Status::Internal(StrCat("Validate: span ", base, " of ", span.size, " bytes has ",
                                     free, " free and ", span.used_bytes, " used"));
    }
    if ((span.used_count == 0) != (span.used_bytes == 0)) {
      return Status::Internal(StrCat("Validate: span ", base, " counts ", span.used_count,
                                     " extents in ", span.used_bytes, " used bytes"));
    }
    if (span.used_count == 0) {
      empty_sum += span.size;
      empty_n++;
    }
  }
  if (spans_sum != span_bytes_ || empty_sum != empty_bytes_ || empty_n != empty_count_) {
    return Status::Internal("Validate: span_bytes_ or empty_bytes_ is stale");
  }
  return Status::Ok();
}

Status ExtentMap::Validate(const std::vector<std::pair<uint64_t, uint64_t>>& allocated) const {
  // The free side on its own first; then every extent, free or allocated, tagged with whether it
  // is free, walked span by span: together they tile each span exactly.
  SPILLWAY_RETURN_IF_ERROR(Validate());
  struct E {
    uint64_t base, size;
    bool is_free;
  };
  std::vector<E> all;
  all.reserve(allocated.size() + free_by_addr_.size());
  for (const auto& [b, s] : allocated) all.push_back({b, s, false});
  for (const auto& [b, f] : free_by_addr_) all.push_back({b, f.size, true});
  std::sort(all.begin(), all.end(), [](const E& a, const E& b) { return a.base < b.base; });
  size_t i = 0;
  for (const auto& [base, span] : spans_) {
    uint64_t cursor = base, used = 0, count = 0;
    while (i < all.size() && all[i].base < base + span.size) {
      const E& e = all[i];
      if (e.base != cursor) {
        return Status::Internal(StrCat("Validate: gap or overlap at ", cursor, " in span ", base,
                                       " (next extent starts at ", e.base, ")"));
      }
      if (!e.is_free) {
        used += e.size;
        ++count;
      }
      cursor += e.size;
      ++i;
    }
    if (cursor != base + span.size) {
      return Status::Internal(StrCat("Validate: extents of span ", base, " cover ", cursor - base,
                                     " of ", span.size, " bytes"));
    }
    if (used != span.used_bytes || count != span.used_count) {
      return Status::Internal(StrCat("Validate: span ", base, " counts ", span.used_bytes,
                                     " used bytes, extents say ", used));
    }
  }
  if (i != all.size()) {
    return Status::Internal(
        StrCat("Validate: extent at ", all[i].base, " lies outside every span"));
  }
  return Status::Ok();
}

}  // namespace spillway::allocator
