// IoCore: requests, chunks and tickets, shared by both backends (io_core.h).
#include "io_core.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>

#include "spillway/base/bytes.h"
#include "spillway/base/log.h"

namespace spillway::allocator {
namespace {

double NowSeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

int TakeOne(std::atomic<int>* counter) {
  int v = counter->load(std::memory_order_relaxed);
  while (v > 0 && !counter->compare_exchange_weak(v, v - 1, std::memory_order_acq_rel)) {
  }
  return v > 0 ? 1 : 0;
}

size_t LatencyBucket(double seconds) {
  size_t i = 0;
  while (i < kIoLatencyBuckets.size() && seconds > kIoLatencyBuckets[i]) ++i;
  return i;
}

}  // namespace

IoCore::IoCore(IoEngineOptions opts) : options(opts) {
  for (int i = kBufferSlots - 1; i >= 0; --i) free_buffer_slots.push_back(i);
}

Result<Ticket> IoCore::Enqueue(IoOp op, const char* verb, int file_id, uint64_t offset,
                               char* buffer, uint64_t bytes) {
  SPILLWAY_RETURN_IF_ERROR(process.Check("IoEngine", verb));
  if (buffer == nullptr || bytes == 0) {
    return Status::InvalidArgument(StrCat(verb, ": null buffer or 0 bytes"));
  }
  Ticket ticket;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = files.find(file_id);
    if (it == files.end()) {
      return Status::InvalidArgument(StrCat(verb, ": file id ", file_id, " is not registered"));
    }
    if (stopping) return Status::FailedPrecondition(StrCat(verb, ": the engine is stopping"));
    if (!ring_error.ok()) {
      return Status::FailedPrecondition(
          StrCat(verb, ": the I/O engine's ring failed (", ring_error.message(), ")"));
    }
    const IoFile& f = it->second;
    if (offset % f.alignment != 0) {
      return Status::InvalidArgument(StrCat(verb, " of '", f.name, "' at offset ", offset,
                                            ": the offset must be a multiple of the direct-I/O "
                                            "alignment ",
                                            f.alignment));
    }
    if (offset + bytes < offset) {
      return Status::InvalidArgument(StrCat(verb, ": offset + size overflows"));
    }
    ticket = next_ticket++;
    auto req = std::make_unique<IoRequest>();
    req->ticket = ticket;
    req->op = op;
    req->file_id = file_id;
    req->offset = offset;
    req->buffer = buffer;
    req->bytes = bytes;
    req->submitter = std::this_thread::get_id();
    pending.push_back(req.get());
    requests.emplace(ticket, std::move(req));
    stats.requests++;
  }
  backend->Wake();
  return ticket;
}

bool IoCore::DrainedLocked() const { return stopping && pending.empty() && in_flight == 0; }

IoChunk* IoCore::NextChunkLocked(bool use_fixed_slots) {
  while (!pending.empty() && in_flight < options.queue_depth) {
    IoRequest* r = pending.front();
    if (!r->status.ok()) {  // a failed request cuts no more chunks
      pending.pop_front();
      continue;
    }
    const IoFile& f = files.at(r->file_id);
    char* p = r->buffer + r->chunked;
    uint64_t len = std::min(options.block_size, r->bytes - r->chunked);
    const auto addr = reinterpret_cast<uint64_t>(p);
    // Which registered region holds [p, p+len), and which 1 GiB piece of it. A chunk that crosses
    // the piece's end is cut there to stay inside one fixed buffer, but only when the cut keeps
    // it aligned: an unaligned cut would make a bounce chunk whose padding overwrites the next
    // chunk's file bytes, and the next chunk would start at an unaligned offset. Such a chunk
    // goes whole through the bounce pool instead (len <= block_size, which a bounce buffer holds).
    int slot = -1;
    bool in_arena = false;
    auto reg = regions.upper_bound(addr);
    if (reg != regions.begin()) {
      --reg;
      if (addr + len <= reg->first + reg->second.bytes) {
        const uint64_t piece = (addr - reg->first) / kMaxIovecBytes;
        const uint64_t piece_end = reg->first + (piece + 1) * kMaxIovecBytes;
        const uint64_t cut = std::min(len, piece_end - addr);
        if (cut == len || (addr % f.alignment == 0 && cut % f.alignment == 0)) {
          in_arena = true;
          len = cut;
          slot = reg->second.slots[piece];
        }
      }
    }
    const bool aligned = addr % f.alignment == 0 && len % f.alignment == 0;
    auto* c = new IoChunk{
        r, r->chunked, len, len, 0, len, p, -1, -1, 0, 0, r->offset + r->chunked, NowSeconds()};
    if (!in_arena || !aligned) {
      if (bounce_free.empty()) {
        delete c;
        return nullptr;  // wait for a bounce buffer to come back
      }
      c->bounce_index = bounce_free.back();
      bounce_free.pop_back();
      c->io_buffer = bounce[c->bounce_index];
      c->io_length = RoundUp(len, f.alignment);
      c->submit_length = c->io_length;
      const auto baddr = reinterpret_cast<uint64_t>(c->io_buffer);
      auto breg = std::prev(regions.upper_bound(baddr));
      slot = breg->second.slots[(baddr - breg->first) / kMaxIovecBytes];
      stats.bounce_chunks++;
      stats.bounce_bytes += len;
    }
    c->buf_index = use_fixed_slots ? slot : -1;
    c->fd = use_fixed_slots ? f.slot : f.fd;
    if (c->buf_index >= 0) stats.fixed_buffer_chunks++;
    r->chunked += len;
    r->in_flight++;
    in_flight++;
    stats.in_flight_chunks = in_flight;
    if (r->chunked == r->bytes) pending.pop_front();
    return c;
  }
  return nullptr;
}

void IoCore::StageWrite(IoChunk* c) {
  if (c->bounce_index < 0 || c->request->op != IoOp::kWrite) return;
  std::memcpy(c->io_buffer, c->request->buffer + c->offset_in_request, c->length);
  if (c->io_length > c->length) std::memset(c->io_buffer + c->length, 0, c->io_length - c->length);
}

void IoCore::FillFault(IoChunk* c) {
  c->submit_length = c->io_length - c->done;
  IoFaults* f = options.faults;
  if (f == nullptr) return;
  std::atomic<int>& shorts = c->request->op == IoOp::kRead ? f->short_reads : f->short_writes;
  const uint64_t align = 4096;
  if (c->submit_length >= 2 * align && TakeOne(&shorts)) {
    c->submit_length = c->submit_length / 2 / align * align;
  }
}

int64_t IoCore::InjectResult(const IoChunk* c, int64_t result) {
  IoFaults* f = options.faults;
  if (f == nullptr) return result;
  if (TakeOne(&f->eintr)) return -EINTR;
  if (TakeOne(&f->eagain)) return -EAGAIN;
  std::atomic<int>& err = c->request->op == IoOp::kRead ? f->read_errno : f->write_errno;
  if (int e = err.exchange(0); e != 0) return -e;
  return result;
}

bool IoCore::ApplyResult(IoChunk* c, int64_t result, Status* error) {
  IoRequest* r = c->request;
  const bool read = r->op == IoOp::kRead;
  result = InjectResult(c, result);
  if ((result == -EINTR || result == -EAGAIN) && c->retries < kMaxRetries) {
    c->retries++;
    std::lock_guard<std::mutex> lock(mu);
    stats.retries++;
    return true;
  }
  // A bounced read only needs the caller's bytes; the padding may lie past the end of the file.
  const uint64_t needed = read ? c->length : c->io_length;
  if (result > 0) {
    c->done += static_cast<uint64_t>(result);
    if (c->done < needed) {
      std::lock_guard<std::mutex> lock(mu);
      stats.short_resubmits++;
      return true;
    }
    return false;
  }
  std::string file;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = files.find(r->file_id);
    file = it == files.end() ? StrCat("file ", r->file_id) : it->second.name;
  }
  const std::string what =
      StrCat(read ? "read" : "write", " of ", c->io_length - c->done, " bytes at offset ",
             c->file_offset + c->done, " of '", file, "'");
  if (result == 0) {
    *error = Status::Make(StatusCode::kIoError,
                          StrCat(what, " reached the end of the file after ", c->done,
                                 " bytes; the file is shorter than the transfer"));
    return false;
  }
  const int err = static_cast<int>(-result);
  const bool space = err == ENOSPC || err == EFBIG || err == EDQUOT;
  *error = Status::FromErrno(space ? StatusCode::kNoSpace : StatusCode::kIoError, err, what);
  if (err == ENOSPC || err == EDQUOT) {
    *error = error->WithContext("no space: free space on the NVMe path or lower the NVMe budget");
  } else if (err == EFBIG) {
    *error = error->WithContext(
        "file too large: the file size limit (ulimit -f) or the filesystem's maximum file size "
        "was reached");
  }
  return false;
}

bool IoCore::CompleteChunk(IoChunk* c, int64_t result, const Status* failure) {
  IoRequest* r = c->request;
  const bool read = r->op == IoOp::kRead;
  Status error;
  if (failure != nullptr) {
    error = *failure;
  } else if (ApplyResult(c, result, &error)) {
    return true;
  }
  if (error.ok() && read && c->bounce_index >= 0) {
    std::memcpy(r->buffer + c->offset_in_request, c->io_buffer, c->length);
  }
  const double latency = NowSeconds() - c->started;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (read) {
      stats.read_ops++;
      stats.read_bytes += error.ok() ? c->length : 0;
      stats.read_latency[LatencyBucket(latency)]++;
      stats.read_latency_sum_seconds += latency;
    } else {
      stats.write_ops++;
      stats.write_bytes += error.ok() ? c->length : 0;
      stats.write_latency[LatencyBucket(latency)]++;
      stats.write_latency_sum_seconds += latency;
    }
    if (c->bounce_index >= 0) bounce_free.push_back(c->bounce_index);
    in_flight--;
    stats.in_flight_chunks = in_flight;
    r->in_flight--;
    if (!error.ok() && r->status.ok()) r->status = error;
    if (r->in_flight == 0 && (r->chunked == r->bytes || !r->status.ok())) {
      if (!r->status.ok()) {
        stats.failed_requests++;
        pending.erase(std::remove(pending.begin(), pending.end(), r), pending.end());
      }
      r->done = true;
      done_cv.notify_all();
    }
  }
  work_cv.notify_all();  // a queue slot or a bounce buffer came back
  delete c;
  return false;
}

Status IoCore::RingFailed(int err, const std::vector<IoChunk*>& unsubmitted) {
  Status failure = Status::FromErrno(
      StatusCode::kIoError, err,
      "io_uring_submit_and_wait failed and the I/O engine's ring stopped: this request did not "
      "complete (parts of it may have been written or read: treat its destination, file range "
      "or buffer, as invalid); make a new engine");
  Log(LogLevel::kError, failure.ToString());
  {
    std::lock_guard<std::mutex> lock(mu);
    ring_error = failure;
    stats.ring_failures++;
    stats.ring_error = failure.message();
    // Requests not cut yet fail now; those with chunks in flight fail as the chunks end.
    for (IoRequest* r : pending) {
      if (r->status.ok()) r->status = failure;
      if (r->in_flight == 0 && !r->done) {
        stats.failed_requests++;
        r->done = true;
      }
    }
    pending.clear();
    done_cv.notify_all();
  }
  for (IoChunk* c : unsubmitted) (void)CompleteChunk(c, 0, &failure);
  return failure;
}

void IoCore::AbandonInFlight(const Status& failure) {
  std::lock_guard<std::mutex> lock(mu);
  for (auto& [ticket, r] : requests) {
    if (r->done) continue;
    if (r->status.ok()) r->status = failure;
    r->done = true;
    stats.failed_requests++;
  }
  done_cv.notify_all();
}

}  // namespace spillway::allocator
