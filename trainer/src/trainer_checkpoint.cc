// The trainer's checkpoints: Trainer::Save and Trainer::Load. See trainer.h and docs/checkpoint.md,
// Note [Checkpoint].
//
// Layout of a checkpoint directory DIR:
//   DIR/latest                          the name of the newest complete checkpoint, replaced
//   atomically DIR/step-00000128/manifest.json     world size, model, steps, the caller's state,
//   every tensor's
//                                       dtype, shape, offsets and CRC32C, per rank
//   DIR/step-00000128/rank-00000-of-00002.safetensors   rank 0's partitions
//   DIR/.tmp-step-00000192/             a save in progress (or one that was killed): never loaded
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>

#include <algorithm>
#include <array>
#include <cinttypes>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <mutex>
#include <nlohmann/json.hpp>

#include "catch_torch.h"
#include "spillway/base/log.h"
#include "spillway/trainer/trainer.h"

namespace spillway::trainer {
namespace {

namespace fs = std::filesystem;
using engine::checkpoint::TensorRecord;
using engine::checkpoint::TensorSpec;
using nlohmann::json;

constexpr const char* kFormat = "spillway-checkpoint";
constexpr int kVersion = 1;
constexpr const char* kManifest = "manifest.json";
constexpr const char* kLatest = "latest";
constexpr const char* kRngTensor = "rng.torch_cpu";
constexpr uint64_t kScratchBytes = 4ull << 20;  // Load's checksum pass reads through this much

// `use` on a host view of one partition, for a save (kRead) or a load (kReadWrite). A partition
// homed on NVMe and not in host memory (the streamed optimizer's state) is brought in for this use
// only and dropped after it, so a save or load leaves the host bytes as it found them. The bytes
// are safe either way (on NVMe, or in the host copy the store keeps), so a failed drop only leaves
// the copy cached, within the budget and spillable: a warning, not a failed save or load.
Status UsePartition(offload::PartitionStore& store, offload::PartitionId id, offload::Access access,
                    const char* what, const std::function<Status(void*)>& use) {
  const bool passing = store.home(id) == offload::Placement::kNvme && !store.resident(id);
  SPILLWAY_ASSIGN_OR_RETURN(auto v, store.Acquire(id, access));
  Status st = use(v.data());
  SPILLWAY_RETURN_IF_ERROR(store.Release(v));
  SPILLWAY_RETURN_IF_ERROR(st);
  if (passing) {
    if (Status e = store.Evict(id); !e.ok()) {
      Log(LogLevel::kWarning, StrCat("checkpoint ", what, ": partition ", id,
                                     " stays cached in host memory (", e.ToString(), ")"));
    }
  }
  return Status::Ok();
}

// The partitions a checkpoint holds per unit, in file order, and their tensor names' suffixes:
// CheckpointSpecs, Save and Load all walk them through these two.
constexpr std::array<const char*, 4> kSavedStates = {"param", "master", "exp_avg", "exp_avg_sq"};
template <typename Unit>
std::array<offload::PartitionId, 4> SavedPartitions(const Unit& u) {
  return {u.param, u.master, u.exp_avg, u.exp_avg_sq};
}

std::string StepName(int64_t step) {
  char b[32];
  std::snprintf(b, sizeof(b), "step-%08" PRId64, step);
  return b;
}

std::string RankFile(int rank, int world) {
  char b[64];
  std::snprintf(b, sizeof(b), "rank-%05d-of-%05d.safetensors", rank, world);
  return b;
}

std::string SidecarFile(int rank, int world) {
  char b[64];
  std::snprintf(b, sizeof(b), "rank-%05d-of-%05d.json", rank, world);
  return b;
}

json ModelJson(const GptConfig& c) {
  return {{"vocab", c.vocab},   {"d_model", c.d_model}, {"n_layer", c.n_layer},
          {"n_head", c.n_head}, {"seq_len", c.seq_len}, {"seed", c.seed}};
}

json RecordsJson(const std::vector<TensorRecord>& records) {
  json t = json::object();
  for (const TensorRecord& r : records) {
    t[r.spec.name] = {{"dtype", r.spec.dtype},
                      {"shape", r.spec.shape},
                      {"data_offsets", {r.begin, r.end}},
                      {"crc32c", r.crc32c}};
  }
  return t;
}

std::string Hex(uint32_t v) {
  char b[16];
  std::snprintf(b, sizeof(b), "0x%08x", v);
  return b;
}

// std::filesystem reports by exception; checkpoints report statuses.
template <typename Fn>
Status Fs(const std::string& what, Fn fn) {
  try {
    fn();
    return Status::Ok();
  } catch (const fs::filesystem_error& e) {
    return Status::FromErrno(
        e.code().value() == ENOSPC ? StatusCode::kNoSpace : StatusCode::kIoError, e.code().value(),
        StrCat(what, ": ", e.what()));
  }
}

// The manifest's structure, before any field is read: every later access is then in range.
bool WellFormed(const json& m) {
  const auto unsigned_field = [&](const json& o, const char* k) {
    return o.contains(k) && o[k].is_number_unsigned() &&
           o[k].get<uint64_t>() <= static_cast<uint64_t>(INT64_MAX);
  };
  if (!m.is_object() || !m.contains("format") || !m["format"].is_string() ||
      !unsigned_field(m, "version") || !unsigned_field(m, "world_size") ||
      !unsigned_field(m, "step") || !unsigned_field(m, "adam_step") || !m.contains("model") ||
      !m["model"].is_object() || !m.contains("extra") || !m["extra"].is_object() ||
      !m.contains("ranks") || !m["ranks"].is_array()) {
    return false;
  }
  for (const char* k : {"vocab", "d_model", "n_layer", "n_head", "seq_len"}) {
    if (!unsigned_field(m["model"], k)) return false;
  }
  for (const json& r : m["ranks"]) {
    if (!r.is_object() || !r.contains("file") || !r["file"].is_string() || !r.contains("tensors") ||
        !r["tensors"].is_object()) {
      return false;
    }
    for (const auto& [name, t] : r["tensors"].items()) {
      if (!t.is_object() || !t.contains("crc32c") || !t["crc32c"].is_number_unsigned() ||
          t["crc32c"].get<uint64_t>() > UINT32_MAX) {
        return false;
      }
    }
  }
  return true;
}

// Checkpoint files are input: a JSON value of the wrong type is a damaged file, never a crash.
template <typename Fn>
Status GuardJson(const std::string& what, Fn fn) {
  try {
    return fn();
  } catch (const json::exception& e) {
    return Status::Make(StatusCode::kChecksumMismatch,
                        StrCat(what, ": unexpected JSON (", e.what(),
                               "); the checkpoint is damaged: "
                               "load an older checkpoint or restore this one from a copy"));
  } catch (const std::exception& e) {
    return Status::Internal(StrCat(what, ": ", e.what()));
  }
}

torch::Tensor RngState() {
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

// The checkpoint a Load of `dir` means: `dir` itself when it holds a manifest, else what its
// `latest` names.
Result<std::string> ResolveCheckpoint(const std::string& dir) {
  std::error_code ec;
  if (fs::exists(fs::path(dir) / kManifest, ec)) return dir;
  const std::string latest = (fs::path(dir) / kLatest).string();
  if (!fs::exists(latest, ec)) {
    return Status::InvalidArgument(StrCat(
        "checkpoint directory ", dir, " holds no checkpoint (no ", kLatest, " file, no ", kManifest,
        "): give the directory "
        "that was passed to save, or one of its step-N directories"));
  }
  SPILLWAY_ASSIGN_OR_RETURN(std::string n, engine::checkpoint::ReadSmallFile(latest, 4096));
  while (!n.empty() && (n.back() == '\n' || n.back() == ' ')) n.pop_back();
  if (n.empty() || n.find('/') != std::string::npos || n[0] == '.') {
    return Status::Make(StatusCode::kChecksumMismatch,
                        StrCat(latest, " holds '", n,
                               "', not a checkpoint name; the file is damaged: "
                               "load one of ",
                               dir, "'s step-N directories directly"));
  }
  const std::string path = (fs::path(dir) / n).string();
  if (!fs::exists(fs::path(path) / kManifest, ec)) {
    return Status::InvalidArgument(StrCat(latest, " names ", n, ", which holds no ", kManifest,
                                          " (removed by hand?): load one of ", dir,
                                          "'s step-N directories directly"));
  }
  return path;
}

// Removes checkpoints in `dir` beyond `keep` (the one just saved, `current` at step `step`,
// counts), and the temporary directories of killed saves. Kept first: the highest steps not past
// `step`. After a resume from an older step, checkpoints past it belong to the abandoned run and go
// first, while the one resumed from stays as the new run's fallback. Directories without a
// readable manifest are not checkpoints and are left alone.
Status Prune(const std::string& dir, const std::string& current, int64_t step, int keep) {
  return Fs(StrCat("removing old checkpoints in ", dir), [&] {
    std::vector<std::pair<std::pair<bool, int64_t>, fs::path>> old;  // ((same run, step), path)
    for (const auto& e : fs::directory_iterator(dir)) {
      const std::string n = e.path().filename().string();
      if (n.rfind(".tmp-step-", 0) == 0) fs::remove_all(e.path());
      if (n.rfind("step-", 0) != 0 || n == current || !e.is_directory()) continue;
      auto text = engine::checkpoint::ReadSmallFile((e.path() / kManifest).string());
      if (!text.ok()) continue;
      const json m = json::parse(*text, nullptr, false);
      if (!WellFormed(m)) continue;
      const int64_t s = m["step"].get<int64_t>();
      old.push_back({{s <= step, s}, e.path()});
    }
    std::sort(old.rbegin(), old.rend());
    for (size_t i = 0; keep > 0 && i < old.size(); ++i) {
      if (static_cast<int>(i) + 1 >= keep) fs::remove_all(old[i].second);
    }
  });
}

// What Load's check pass found, for its restore pass: the manifest, this rank's file, and the
// records of the tensors the trainer needs with the CRC32Cs the manifest gives them, in
// CheckpointSpecs order.
struct CheckedCheckpoint {
  std::string manifest_path;
  json manifest;
  std::string file;  // this rank's
  std::unique_ptr<engine::checkpoint::FileReader> reader;
  std::vector<const TensorRecord*> records;
  std::vector<uint32_t> crcs;
};

// A manifest that contradicts itself or its files: what is wrong, and what to do.
Status Damaged(const CheckedCheckpoint& c, const std::string& what) {
  return Status::Make(StatusCode::kChecksumMismatch,
                      StrCat(c.manifest_path, ": ", what,
                             "; the manifest is damaged: load an older "
                             "checkpoint or restore this one from a copy"));
}

// Reads the manifest of the checkpoint at `path` and checks it against this run: its format and
// version, the world size, the model, and this rank's entry.
Status ReadManifest(const std::string& path, const GptConfig& model, int rank, int world,
                    CheckedCheckpoint* c) {
  c->manifest_path = (fs::path(path) / kManifest).string();
  SPILLWAY_ASSIGN_OR_RETURN(auto text, engine::checkpoint::ReadSmallFile(c->manifest_path));
  c->manifest = json::parse(text, nullptr, false);
  json& manifest = c->manifest;
  if (!WellFormed(manifest) || manifest["format"] != kFormat) {
    return Damaged(
        *c, StrCat("not a ", kFormat, " manifest, or a field is missing or of the wrong type"));
  }
  if (manifest["version"] != kVersion) {
    return Status::InvalidArgument(StrCat(c->manifest_path, ": format version ",
                                          manifest["version"].dump(),
                                          "; this Spillway reads version ", kVersion));
  }
  const int64_t saved_world = manifest["world_size"].get<int64_t>();
  if (saved_world != world) {
    return Status::InvalidArgument(StrCat(
        "checkpoint ", path, " was written by ", saved_world, " rank(s); this run has ", world,
        ". A ZeRO-3 checkpoint holds each rank's partitions: resume with ", saved_world,
        " rank(s) (torchrun --nproc-per-node ", saved_world, "); resharding is not supported"));
  }
  const json mine = ModelJson(model);
  for (const char* k : {"vocab", "d_model", "n_layer", "n_head", "seq_len"}) {
    if (manifest["model"][k] != mine[k]) {
      return Status::InvalidArgument(
          StrCat("checkpoint ", path, " is of a model with ", k, " = ", manifest["model"][k].dump(),
                 "; this trainer's has ", mine[k].dump(),
                 ": create the trainer with the checkpoint's model ", manifest["model"].dump()));
    }
  }
  if (manifest["ranks"].size() != static_cast<size_t>(world)) {
    return Damaged(
        *c, StrCat("it lists ", manifest["ranks"].size(), " rank files for world size ", world));
  }
  const json& entry = manifest["ranks"][static_cast<size_t>(rank)];
  if (entry.at("file") != RankFile(rank, world)) {
    return Damaged(*c, StrCat("rank ", rank, "'s entry does not name ", RankFile(rank, world)));
  }
  return Status::Ok();
}

// Opens this rank's file and checks its RNG state is this libtorch's size. Returns that size.
Result<uint64_t> OpenRankFile(const std::string& path, int rank, int world, allocator::IoEngine* io,
                              CheckedCheckpoint* c) {
  c->file = (fs::path(path) / RankFile(rank, world)).string();
  SPILLWAY_ASSIGN_OR_RETURN(c->reader, engine::checkpoint::FileReader::Open(c->file, io));
  const TensorRecord* rng = c->reader->Find(kRngTensor);
  if (rng == nullptr) return Damaged(*c, StrCat(c->file, " has no tensor '", kRngTensor, "'"));
  const uint64_t rng_bytes = static_cast<uint64_t>(RngState().numel());
  if (rng->spec.bytes != rng_bytes) {
    return Status::InvalidArgument(StrCat("checkpoint file ", c->file, ", tensor '", kRngTensor,
                                          "': ", rng->spec.bytes,
                                          " bytes of torch "
                                          "CPU generator state, this libtorch's is ",
                                          rng_bytes,
                                          ": it was saved by another torch "
                                          "version; resume with the torch it was saved with"));
  }
  return rng->spec.bytes;
}

// Finds each tensor of `specs` in this rank's file, checks it against the spec and the manifest's
// entry, and records it with its CRC32C. Returns the largest one's bytes.
Result<uint64_t> MatchRecords(const std::vector<TensorSpec>& specs, int rank,
                              CheckedCheckpoint* c) {
  const json& entry = c->manifest["ranks"][static_cast<size_t>(rank)];
  uint64_t biggest = 0;
  for (const TensorSpec& want : specs) {
    const TensorRecord* got = c->reader->Find(want.name);
    const json& m =
        entry.at("tensors").contains(want.name) ? entry.at("tensors").at(want.name) : json();
    if (got == nullptr || !m.is_object()) {
      return Status::InvalidArgument(StrCat("checkpoint file ", c->file, " has no tensor '",
                                            want.name,
                                            "', which this trainer needs: it was saved by a "
                                            "different trainer; load a checkpoint of this model"));
    }
    if (got->spec.dtype != want.dtype || got->spec.shape != want.shape) {
      return Status::InvalidArgument(
          StrCat("checkpoint file ", c->file, ", tensor '", want.name, "': ", got->spec.dtype, " ",
                 json(got->spec.shape).dump(), " in the file, this trainer needs ", want.dtype, " ",
                 json(want.shape).dump(), ": load a checkpoint of this model"));
    }
    if (m.value("dtype", "") != got->spec.dtype ||
        m.value("shape", json()) != json(got->spec.shape) ||
        m.value("data_offsets", json()) != json({got->begin, got->end})) {
      return Damaged(*c, StrCat("its entry for tensor '", want.name,
                                "' disagrees with the header of ", c->file));
    }
    c->records.push_back(got);
    c->crcs.push_back(static_cast<uint32_t>(m.at("crc32c").get<uint64_t>()));
    biggest = std::max(biggest, got->spec.bytes);
  }
  return biggest;
}

// Checksums every recorded tensor through a scratch buffer of the arena (at most kScratchBytes)
// against the manifest's CRC32C.
Status ChecksumRecords(const CheckedCheckpoint& c, uint64_t biggest, allocator::HostArena* arena,
                       allocator::ScopeId scope) {
  const uint64_t scratch_bytes = std::max<uint64_t>(1, std::min(biggest, kScratchBytes));
  auto scratch = arena->Allocate(
      scratch_bytes, allocator::OwnerTag{allocator::Kind::kCheckpoint, allocator::Lifetime::kStep,
                                         0, scope, SPILLWAY_SITE});
  if (!scratch.ok()) return scratch.status().WithContext("the checkpoint's checksum buffer");
  Status checked;
  for (size_t i = 0; i < c.records.size() && checked.ok(); ++i) {
    auto crc = c.reader->Checksum(*c.records[i], *scratch, scratch_bytes);
    if (!crc.ok()) {
      checked = crc.status();
    } else if (*crc != c.crcs[i]) {
      checked = Status::Make(
          StatusCode::kChecksumMismatch,
          StrCat("checkpoint file ", c.file, ", tensor '", c.records[i]->spec.name,
                 "': its bytes have CRC32C ", Hex(*crc), ", the manifest says ", Hex(c.crcs[i]),
                 ": the file is damaged; load an older checkpoint "
                 "or restore this one from a copy"));
    }
  }
  SPILLWAY_RETURN_IF_ERROR(arena->Free(*scratch));
  return checked;
}

// Every rank must have found the same checkpoint (each resolves `latest` itself; it could move
// between their reads). Equal sums of the steps and of their squares mean equal steps. A
// different one turns *st into the error; a failed collective is returned.
Status CheckSameCheckpoint(Collectives* coll, int world, const std::string& dir,
                           const std::string& path, const json& manifest, Status* st) {
  const double my_step = st->ok() ? manifest["step"].get<double>() : 0.0;
  auto sum = coll->AllReduceSum(my_step);
  auto sum_sq = coll->AllReduceSum(my_step * my_step);  // both, before either error returns
  if (!sum.ok()) return sum.status();
  if (!sum_sq.ok()) return sum_sq.status();
  if (st->ok() && (*sum != my_step * world || *sum_sq != my_step * my_step * world)) {
    *st = Status::FailedPrecondition(StrCat("the ranks found different checkpoints in ", dir,
                                            " (this rank: ", path,
                                            "); was a save running? load a step-N directory"));
  }
  return Status::Ok();
}

// Tensor i into `dst`, against the CRC32C the check pass read.
Status ReadChecked(const CheckedCheckpoint& c, size_t i, void* dst) {
  SPILLWAY_ASSIGN_OR_RETURN(auto crc, c.reader->Read(*c.records[i], dst));
  if (crc != c.crcs[i]) {
    return Status::Make(StatusCode::kChecksumMismatch,
                        StrCat(c.reader->path(), ", tensor '", c.records[i]->spec.name,
                               "' changed between the check and the load"));
  }
  return Status::Ok();
}

// Tensor i, the torch CPU generator's state, into the default CPU generator.
Status RestoreRng(const CheckedCheckpoint& c, size_t i) {
  torch::Tensor rng = torch::empty({static_cast<int64_t>(c.records[i]->spec.bytes)}, torch::kUInt8);
  SPILLWAY_RETURN_IF_ERROR(ReadChecked(c, i, rng.data_ptr()));
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(rng);
  return Status::Ok();
}

// Save's checks of its options and of the trainer's state (out_of_step: not ok when a failed load
// left the state partly a checkpoint's); `extra` is the caller's state, parsed.
Status CheckSaveOptions(const CheckpointOptions& o, const Status& out_of_step, const json& extra) {
  if (o.io == nullptr) {
    return Status::InvalidArgument("Save needs CheckpointOptions::io (the io_uring engine)");
  }
  if (!out_of_step.ok()) {
    return Status::FailedPrecondition(StrCat(
        "Save refused: this trainer's state is not one step's (", out_of_step.message(), ")"));
  }
  if (!extra.is_object()) {
    return Status::InvalidArgument(
        StrCat("CheckpointOptions::extra_json must be a JSON object; got '",
               o.extra_json.substr(0, 80), "'"));
  }
  if (o.keep < 0) {
    return Status::InvalidArgument(
        StrCat("CheckpointOptions::keep = ", o.keep, "; use 0 (keep all) or more"));
  }
  return Status::Ok();
}

// Rank 0's first step of a save: DIR and the temporary directory `tmp` in it (a killed save's
// leftovers of the same step go), DIR made durable.
Status MakeSaveDirectory(const std::string& dir, const std::string& tmp) {
  Status st = Fs(StrCat("creating ", tmp), [&] {
    fs::create_directories(dir);
    fs::remove_all(tmp);
    fs::create_directory(tmp);
  });
  // DIR itself must survive a power cut once a checkpoint in it is reported saved.
  if (st.ok()) st = engine::checkpoint::FsyncDirectory(fs::absolute(dir).parent_path().string());
  return st;
}

// The manifest's "ranks": each rank's file with the checksum list it wrote beside it in `tmp`.
Result<json> ReadRankLists(const std::string& tmp, int world) {
  json files = json::array();
  for (int r = 0; r < world; ++r) {
    const std::string sidecar = (fs::path(tmp) / SidecarFile(r, world)).string();
    SPILLWAY_ASSIGN_OR_RETURN(auto text, engine::checkpoint::ReadSmallFile(sidecar));
    json t = json::parse(text, nullptr, false);
    if (!t.is_object())
      return Status::Internal(StrCat(sidecar, " is not the JSON this save wrote"));
    files.push_back({{"file", RankFile(r, world)}, {"tensors", std::move(t)}});
  }
  return files;
}

// Rank 0's last step of a save: the manifest into `tmp`, the checksum lists out of it, `tmp`
// renamed into place as `name` (name.N when that is taken: *suffix), `latest` naming it, and the
// checkpoints beyond `keep` pruned (a failure there only warns). Each step is made durable
// before the next; the fault hook sees the manifest, the rename and `latest`.
Status PublishCheckpoint(const std::string& dir, const std::string& tmp, const std::string& name,
                         const json& manifest, int world, int64_t step, const CheckpointOptions& o,
                         int* suffix) {
  const auto hook = [&](std::string_view point) {
    if (o.fault_hook) o.fault_hook(point);
  };
  hook("manifest");
  SPILLWAY_RETURN_IF_ERROR(
      engine::checkpoint::WriteFileDurably((fs::path(tmp) / kManifest).string(), manifest.dump(1)));
  SPILLWAY_RETURN_IF_ERROR(Fs("removing the per-rank checksum lists", [&] {
    for (int r = 0; r < world; ++r) fs::remove(fs::path(tmp) / SidecarFile(r, world));
  }));
  SPILLWAY_RETURN_IF_ERROR(engine::checkpoint::FsyncDirectory(tmp));
  std::string final_name = name;
  std::error_code ec;
  while (fs::exists(fs::path(dir) / final_name, ec)) final_name = StrCat(name, ".", ++*suffix);
  hook("rename");
  SPILLWAY_RETURN_IF_ERROR(Fs(StrCat("renaming ", tmp, " into place"),
                              [&] { fs::rename(tmp, fs::path(dir) / final_name); }));
  SPILLWAY_RETURN_IF_ERROR(engine::checkpoint::FsyncDirectory(dir));
  hook("latest");
  SPILLWAY_RETURN_IF_ERROR(
      engine::checkpoint::WriteFileDurably((fs::path(dir) / kLatest).string(), final_name + "\n"));
  // Now the new checkpoint is the one loaded. Older ones beyond `keep`, and temporary
  // directories of killed saves, go (every rank finished writing in step 2). The save has
  // succeeded whatever happens to them.
  Status pruned = Prune(dir, final_name, step, o.keep);
  if (!pruned.ok()) Log(LogLevel::kWarning, StrCat("checkpoint saved, but ", pruned.message()));
  return Status::Ok();
}

}  // namespace

std::vector<TensorSpec> Trainer::CheckpointSpecs(uint64_t rng_bytes) const {
  std::vector<TensorSpec> specs;
  for (size_t u = 0; u < units_.size(); ++u) {
    for (const char* what : kSavedStates) {
      specs.push_back({StrCat("unit.", u, ".", what),
                       "F32",
                       {units_[u].shard},
                       static_cast<uint64_t>(units_[u].shard) * 4});
    }
  }
  specs.push_back({kRngTensor, "U8", {static_cast<int64_t>(rng_bytes)}, rng_bytes});
  return specs;
}

Status Trainer::Agree(const Status& local, const char* what) {
  auto failed = coll_->AllReduceSum(local.ok() ? 0.0 : 1.0);
  if (!local.ok()) return local.WithContext(what);
  if (!failed.ok()) return failed.status().WithContext(what);
  if (*failed > 0) {
    return Status::FailedPrecondition(StrCat(what, " failed on ", *failed,
                                             " other rank(s) (their "
                                             "errors say why); this rank's part succeeded"));
  }
  return Status::Ok();
}

Result<CheckpointInfo> Trainer::Save(const std::string& dir, const CheckpointOptions& o) {
  const int rank = coll_->rank(), world = coll_->world_size();
  const std::string name = StepName(steps_);
  const std::string tmp = (fs::path(dir) / (".tmp-" + name)).string();
  // 1. Rank 0 makes the temporary directory (a killed save's leftovers of the same step go).
  json extra = json::parse(o.extra_json, nullptr, /*allow_exceptions=*/false);
  Status st = CheckSaveOptions(o, out_of_step_, extra);
  if (st.ok() && rank == 0) st = MakeSaveDirectory(dir, tmp);
  SPILLWAY_RETURN_IF_ERROR(Agree(st, "checkpoint save: preparing the directory"));

  // 2. Every rank streams its partitions into its own file, then lists their checksums beside it.
  st = CatchTorch("checkpoint save", [&]() -> Status {
    // The save's order is not the step's: no prefetching on its account.
    offload::PartitionStore::OffSchedule off_schedule(*store_);
    const torch::Tensor rng = RngState();
    SPILLWAY_ASSIGN_OR_RETURN(
        auto writer, engine::checkpoint::FileWriter::Create(
                         (fs::path(tmp) / RankFile(rank, world)).string(),
                         CheckpointSpecs(static_cast<uint64_t>(rng.numel())), o.io, o.fault_hook));
    for (const Unit& unit : units_) {
      for (offload::PartitionId id : SavedPartitions(unit)) {
        SPILLWAY_RETURN_IF_ERROR(UsePartition(*store_, id, offload::Access::kRead, "save",
                                              [&](void* data) { return writer->Write(data); }));
      }
    }
    SPILLWAY_RETURN_IF_ERROR(writer->Write(rng.data_ptr()));
    SPILLWAY_ASSIGN_OR_RETURN(auto records, writer->Finish());
    return engine::checkpoint::WriteFileDurably((fs::path(tmp) / SidecarFile(rank, world)).string(),
                                                RecordsJson(records).dump());
  });
  SPILLWAY_RETURN_IF_ERROR(Agree(st, "checkpoint save: writing the rank files"));

  // 3. Rank 0: the manifest, the rename into place, `latest`, and the old checkpoints go.
  CheckpointInfo info;
  info.step = steps_;
  info.extra_json = extra.dump();
  int suffix = 0;  // step-N.suffix when step-N is taken (a second save of the same step)
  if (rank == 0) {
    st = CatchTorch("checkpoint save", [&]() -> Status {
      SPILLWAY_ASSIGN_OR_RETURN(json files, ReadRankLists(tmp, world));
      const json manifest = {
          {"format", kFormat},
          {"version", kVersion},
          {"world_size", world},
          {"step", steps_},
          {"adam_step", optimizer_->step()},
          {"model", ModelJson(options_.model)},
          {"dtypes",
           {{"param", "F32"}, {"master", "F32"}, {"exp_avg", "F32"}, {"exp_avg_sq", "F32"}}},
          {"extra", extra},
          {"ranks", std::move(files)}};
      return PublishCheckpoint(dir, tmp, name, manifest, world, steps_, o, &suffix);
    });
  }
  SPILLWAY_RETURN_IF_ERROR(Agree(st, "checkpoint save: the manifest and the rename"));
  // Rank 0 chose the name.
  SPILLWAY_ASSIGN_OR_RETURN(const double agreed_suffix,
                            coll_->AllReduceSum(rank == 0 ? suffix : 0));
  suffix = static_cast<int>(agreed_suffix);
  info.path = (fs::path(dir) / (suffix == 0 ? name : StrCat(name, ".", suffix))).string();
  return info;
}

Result<CheckpointInfo> Trainer::Load(const std::string& dir, const CheckpointOptions& o) {
  const int rank = coll_->rank(), world = coll_->world_size();
  CheckpointInfo info;
  CheckedCheckpoint c;

  // 1. Read-only: find it, check it against this trainer, checksum every byte of this rank's file.
  Status st = GuardJson(StrCat("loading the checkpoint in ", dir), [&]() -> Status {
    if (o.io == nullptr)
      return Status::InvalidArgument("Load needs CheckpointOptions::io (the io_uring engine)");
    SPILLWAY_ASSIGN_OR_RETURN(info.path, ResolveCheckpoint(dir));
    SPILLWAY_RETURN_IF_ERROR(ReadManifest(info.path, options_.model, rank, world, &c));
    SPILLWAY_ASSIGN_OR_RETURN(const uint64_t rng_bytes,
                              OpenRankFile(info.path, rank, world, o.io, &c));
    SPILLWAY_ASSIGN_OR_RETURN(const uint64_t biggest,
                              MatchRecords(CheckpointSpecs(rng_bytes), rank, &c));
    return ChecksumRecords(c, biggest, arena_, scope_);
  });
  SPILLWAY_RETURN_IF_ERROR(CheckSameCheckpoint(coll_, world, dir, info.path, c.manifest, &st));
  SPILLWAY_RETURN_IF_ERROR(Agree(st, "checkpoint load: checking it"));

  // 2. Every check passed on every rank: overwrite the state.
  st = CatchTorch("checkpoint load", [&]() -> Status {
    offload::PartitionStore::OffSchedule off_schedule(*store_);
    size_t i = 0;
    for (const Unit& unit : units_) {
      for (offload::PartitionId id : SavedPartitions(unit)) {
        SPILLWAY_RETURN_IF_ERROR(
            UsePartition(*store_, id, offload::Access::kReadWrite, "load",
                         [&](void* data) { return ReadChecked(c, i++, data); }));
      }
    }
    SPILLWAY_RETURN_IF_ERROR(RestoreRng(c, i));
    return ZeroGrads();
  });
  if (st.ok()) {
    steps_ = c.manifest["step"].get<int64_t>();
    attempts_ = std::max(attempts_, steps_);  // the ledger's step numbers only increase
    optimizer_->RestoreStep(c.manifest["adam_step"].get<uint64_t>());
    info.step = steps_;
    info.extra_json = c.manifest["extra"].dump();
  }
  Status agreed = Agree(st, "checkpoint load: restoring the state");
  if (!agreed.ok()) {
    // This rank's state, or another's, is partly the checkpoint's: no step may run on it.
    out_of_step_ = Status::FailedPrecondition(
        StrCat("a checkpoint load failed after it began overwriting the trainers' state (",
               agreed.message(), "): create new trainers and load again"));
    return agreed;
  }
  return info;
}

}  // namespace spillway::trainer
