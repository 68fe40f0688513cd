// Config parsing on nlohmann::json. Every key Spillway reads is checked for type and range here,
// once; the rest of the code trusts a Config.
#include "spillway/offload/config.h"

#include <sys/statvfs.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "spillway/base/bytes.h"
#include "spillway/base/log.h"

namespace spillway::offload {
namespace {

using nlohmann::json;

std::string Describe(const json& v) {
  std::string s = v.dump();
  return s.size() > 60 ? s.substr(0, 57) + "..." : s;
}

// Reads one object's keys against a table of handlers; keys without a handler are either
// collected as ignored (DeepSpeed sections) or an error (the spillway section).
class Reader {
 public:
  explicit Reader(Config* c) : c_(c) {}
  Status error;

  bool Fail(const std::string& path, const std::string& what) {
    if (error.ok()) error = Status::InvalidArgument(StrCat("config key '", path, "': ", what));
    return false;
  }
  bool Bool(const json& v, const std::string& path, bool* out) {
    if (!v.is_boolean()) return Fail(path, StrCat("is ", Describe(v), "; expected true or false"));
    *out = v.get<bool>();
    return true;
  }
  // DeepSpeed writes counts as 1e8; accept numbers with an integral value, >= min.
  bool Count(const json& v, const std::string& path, uint64_t min, uint64_t* out) {
    if (v.is_string() && v.get<std::string>() == "auto") {
      return Fail(path,
                  "is \"auto\"; Spillway reads the resolved config. Replace \"auto\" with a "
                  "number (the HF Trainer does this before DeepSpeed sees the file)");
    }
    if (!v.is_number()) return Fail(path, StrCat("is ", Describe(v), "; expected a number"));
    const double d = v.get<double>();
    if (!(d >= static_cast<double>(min)) || d != std::floor(d) || d > 9.2e18) {
      return Fail(path, StrCat("is ", Describe(v), "; expected a whole number >= ", min));
    }
    *out = v.is_number_unsigned() ? v.get<uint64_t>() : static_cast<uint64_t>(d);
    return true;
  }
  // Byte sizes: a number, or a string with a unit ("64GiB", "512 MiB", "1.5TB").
  bool Bytes(const json& v, const std::string& path, uint64_t* out) {
    if (v.is_number()) return Count(v, path, 1, out);
    if (!v.is_string()) return Fail(path, StrCat("is ", Describe(v), "; expected bytes"));
    auto bytes = ParseByteSize(v.get<std::string>());
    if (bytes.ok()) {
      *out = *bytes;
      return true;
    }
    return Fail(path, StrCat("is ", Describe(v),
                             "; expected bytes, e.g. 68719476736 or \"64GiB\" "
                             "(units: B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)"));
  }
  bool String(const json& v, const std::string& path, std::string* out) {
    if (!v.is_string()) return Fail(path, StrCat("is ", Describe(v), "; expected a string"));
    *out = v.get<std::string>();
    return true;
  }
  bool Device(const json& v, const std::string& path, OffloadDevice* out) {
    std::string s;
    if (!String(v, path, &s)) return false;
    if (s == "none")
      *out = OffloadDevice::kNone;
    else if (s == "cpu")
      *out = OffloadDevice::kCpu;
    else if (s == "nvme")
      *out = OffloadDevice::kNvme;
    else
      return Fail(path, StrCat("is \"", s, "\"; allowed values: none, cpu, nvme"));
    return true;
  }
  bool Policy(const json& v, const std::string& path, allocator::EscapePolicy* out) {
    std::string s;
    if (!String(v, path, &s)) return false;
    auto p = allocator::ParseEscapePolicy(s);
    if (!p.ok()) return Fail(path, p.status().message());
    *out = *p;
    return true;
  }

  void OffloadParam(const json& o, const std::string& path) {
    if (!Object(o, path)) return;
    for (const auto& [k, v] : o.items()) {
      const std::string p = StrCat(path, ".", k);
      auto& c = c_->offload_param;
      if (k == "device")
        Device(v, p, &c.device);
      else if (k == "nvme_path")
        NvmePath(v, p, &c.nvme_path);
      else if (k == "buffer_count")
        Count(v, p, 0, &c.buffer_count);
      else if (k == "buffer_size")
        Count(v, p, 0, &c.buffer_size);
      else if (k == "max_in_cpu")
        Count(v, p, 0, &c.max_in_cpu);
      else if (k == "pin_memory")
        Bool(v, p, &c.pin_memory);
      else
        c_->ignored_keys.push_back(p);
    }
  }
  void OffloadOptimizer(const json& o, const std::string& path) {
    if (!Object(o, path)) return;
    for (const auto& [k, v] : o.items()) {
      const std::string p = StrCat(path, ".", k);
      auto& c = c_->offload_optimizer;
      if (k == "device")
        Device(v, p, &c.device);
      else if (k == "nvme_path")
        NvmePath(v, p, &c.nvme_path);
      else if (k == "buffer_count")
        Count(v, p, 0, &c.buffer_count);
      else if (k == "pin_memory")
        Bool(v, p, &c.pin_memory);
      else if (k == "pipeline_read")
        Bool(v, p, &c.pipeline_read);
      else if (k == "pipeline_write")
        Bool(v, p, &c.pipeline_write);
      else if (k == "fast_init")
        Bool(v, p, &c.fast_init);
      else if (k == "ratio") {
        if (!v.is_number() || !(v.get<double>() > 0.0 && v.get<double>() <= 1.0)) {
          Fail(p, StrCat("is ", Describe(v), "; expected a fraction in (0, 1]"));
        } else {
          c.ratio = v.get<double>();
        }
      } else {
        c_->ignored_keys.push_back(p);
      }
    }
  }
  void Aio(const json& o) {
    if (!Object(o, "aio")) return;
    for (const auto& [k, v] : o.items()) {
      const std::string p = "aio." + k;
      auto& c = c_->aio;
      if (k == "block_size")
        Count(v, p, 4096, &c.block_size);
      else if (k == "queue_depth")
        Count(v, p, 1, &c.queue_depth);
      else if (k == "intra_op_parallelism" || k == "thread_count") {
        Count(v, p, 1, &c.intra_op_parallelism);
      } else if (k == "single_submit")
        Bool(v, p, &c.single_submit);
      else if (k == "overlap_events")
        Bool(v, p, &c.overlap_events);
      else if (k == "use_gds")
        Bool(v, p, &c.use_gds);
      else
        c_->ignored_keys.push_back(p);
    }
  }
  void Spillway(const json& o) {
    if (!Object(o, "spillway")) return;
    auto& c = c_->spillway;
    bool region_set = false;
    for (const auto& [k, v] : o.items()) {
      const std::string p = "spillway." + k;
      if (k == "host_budget_bytes")
        Bytes(v, p, &c.host_budget_bytes);
      else if (k == "nvme_budget_bytes")
        Bytes(v, p, &c.nvme_budget_bytes);
      else if (k == "retain_limit_bytes")
        Bytes(v, p, &c.retain_limit_bytes);
      else if (k == "host_region_bytes") {
        if (Bytes(v, p, &c.host_region_bytes)) region_set = true;
      } else if (k == "bounce_buffers") {
        if (Count(v, p, 1, &c.bounce_buffers) && c.bounce_buffers > allocator::kMaxBounceBuffers) {
          Fail(p, StrCat("is ", c.bounce_buffers, "; at most ", allocator::kMaxBounceBuffers,
                         " bounce buffers"));
        }
      } else if (k == "escape_policy")
        EscapePolicies(v, p);
      else if (k == "metrics_address")
        MetricsAddress(v, p, &c.metrics_address);
      else if (k == "checksum")
        Bool(v, p, &c.checksum);
      else if (k == "capture_backtraces")
        Bool(v, p, &c.capture_backtraces);
      else if (k == "fork_safety")
        ForkSafetySetting(v, p, &c.fork_safety);
      else if (k == "spill_path")
        String(v, p, &c.spill_path);
      else if (k == "prefetch_partitions") {
        if (Count(v, p, 0, &c.prefetch_partitions) && c.prefetch_partitions > 1024) {
          Fail(p, StrCat("is ", c.prefetch_partitions, "; at most 1024 partitions ahead"));
        }
      } else if (k == "eviction")
        EvictionOrder(v, p, &c.eviction);
      else if (k == "peak_slack")
        UnitFraction(v, p, &c.peak_slack);
      else {
        Fail(p,
             "is not a Spillway setting; allowed keys: host_budget_bytes, nvme_budget_bytes, "
             "escape_policy, metrics_address, checksum, fork_safety, capture_backtraces, "
             "retain_limit_bytes, peak_slack, host_region_bytes, bounce_buffers, spill_path, "
             "prefetch_partitions, eviction");
      }
    }
    // The default region is checked by the arena against its budget.
    if (region_set) CheckHostRegion();
  }
  // spillway.escape_policy: one policy for both tiers, or an object of "host" and "nvme".
  void EscapePolicies(const json& v, const std::string& p) {
    auto& c = c_->spillway;
    if (v.is_object()) {
      for (const auto& [tier, pv] : v.items()) {
        if (tier == "host")
          Policy(pv, p + ".host", &c.host_escape_policy);
        else if (tier == "nvme")
          Policy(pv, p + ".nvme", &c.nvme_escape_policy);
        else
          Fail(StrCat(p, ".", tier), "is not a tier; allowed keys: host, nvme");
      }
    } else if (Policy(v, p, &c.host_escape_policy)) {
      c.nvme_escape_policy = c.host_escape_policy;
    }
  }
  // spillway.metrics_address: host:port, or "off".
  void MetricsAddress(const json& v, const std::string& p, std::string* out) {
    if (String(v, p, out) && *out != "off" && out->find(':') == std::string::npos) {
      Fail(p, StrCat("is \"", *out, "\"; expected host:port or \"off\""));
    }
  }
  // spillway.fork_safety, as allocator::ParseForkSafety reads it.
  void ForkSafetySetting(const json& v, const std::string& p, allocator::ForkSafety* out) {
    std::string s;
    if (String(v, p, &s)) {
      auto f = allocator::ParseForkSafety(s);
      if (f.ok())
        *out = *f;
      else
        Fail(p, f.status().message());
    }
  }
  // spillway.eviction: "opt" or "lru".
  void EvictionOrder(const json& v, const std::string& p, Eviction* out) {
    std::string s;
    if (String(v, p, &s)) {
      if (s == "opt")
        *out = Eviction::kOpt;
      else if (s == "lru")
        *out = Eviction::kLru;
      else
        Fail(p, StrCat("is \"", s, "\"; expected \"opt\" (the schedule's next use) or \"lru\""));
    }
  }
  // A fraction in [0, 1].
  void UnitFraction(const json& v, const std::string& p, double* out) {
    if (!v.is_number() || !(v.get<double>() >= 0.0 && v.get<double>() <= 1.0)) {
      Fail(p, StrCat("is ", Describe(v), "; expected a fraction in [0, 1]"));
    } else {
      *out = v.get<double>();
    }
  }
  // A spillway.host_region_bytes that was set: at least a page, and within the host budget.
  void CheckHostRegion() {
    const auto& c = c_->spillway;
    const std::string p = "spillway.host_region_bytes";
    if (c.host_region_bytes < 4096) {
      Fail(p, StrCat("is ", c.host_region_bytes, "; at least 4096 (one page)"));
    } else if (c.host_budget_bytes != 0 && c.host_region_bytes > c.host_budget_bytes) {
      Fail(p, StrCat("is ", FormatBytes(c.host_region_bytes),
                     ", more than spillway.host_budget_bytes, ", FormatBytes(c.host_budget_bytes),
                     ": every allocation that shares a region would be over budget; lower it"));
    }
  }
  bool NonNegative(const json& v, const std::string& path, double* out) {
    if (!v.is_number() || !(v.get<double>() >= 0.0) || !std::isfinite(v.get<double>())) {
      return Fail(path, StrCat("is ", Describe(v), "; expected a finite number >= 0"));
    }
    *out = v.get<double>();
    return true;
  }
  void Optimizer(const json& o) {
    if (!Object(o, "optimizer")) return;
    auto& t = c_->training;
    for (const auto& [k, v] : o.items()) {
      const std::string p = "optimizer." + k;
      if (k == "type") {
        std::string s;
        if (!String(v, p, &s)) continue;
        // DeepSpeed matches optimizer names case-insensitively.
        std::string lower;
        for (char ch : s) lower += static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
        if (lower == "adam")
          t.optimizer = "Adam";
        else if (lower == "adamw")
          t.optimizer = "AdamW";
        else
          Fail(p, StrCat("is \"", s,
                         "\"; Spillway's host optimizer implements \"Adam\" and "
                         "\"AdamW\""));
      } else if (k == "params") {
        if (!Object(v, p)) continue;
        for (const auto& [pk, pv] : v.items()) {
          const std::string pp = StrCat(p, ".", pk);
          if (pk == "lr") {
            if (NonNegative(pv, pp, &t.lr) && t.lr == 0.0) Fail(pp, "is 0; expected lr > 0");
          } else if (pk == "eps") {
            if (NonNegative(pv, pp, &t.eps) && t.eps == 0.0) Fail(pp, "is 0; expected eps > 0");
          } else if (pk == "weight_decay")
            NonNegative(pv, pp, &t.weight_decay);
          else if (pk == "betas") {
            if (!pv.is_array() || pv.size() != 2 || !pv[0].is_number() || !pv[1].is_number() ||
                !(pv[0].get<double>() >= 0 && pv[0].get<double>() < 1) ||
                !(pv[1].get<double>() >= 0 && pv[1].get<double>() < 1)) {
              Fail(pp, StrCat("is ", Describe(pv), "; expected [beta1, beta2], each in [0, 1)"));
            } else {
              t.beta1 = pv[0].get<double>();
              t.beta2 = pv[1].get<double>();
            }
          } else {
            c_->ignored_keys.push_back(pp);
          }
        }
      } else {
        c_->ignored_keys.push_back(p);
      }
    }
  }
  void Zero(const json& o) {
    if (!Object(o, "zero_optimization")) return;
    for (const auto& [k, v] : o.items()) {
      const std::string p = "zero_optimization." + k;
      if (k == "stage") {
        uint64_t stage = 0;
        if (Count(v, p, 0, &stage)) {
          if (stage > 3) Fail(p, StrCat("is ", stage, "; allowed values: 0, 1, 2, 3"));
          c_->zero_stage = static_cast<int>(stage);
        }
      } else if (k == "offload_param")
        OffloadParam(v, p);
      else if (k == "offload_optimizer")
        OffloadOptimizer(v, p);
      else if (k == "sub_group_size")
        Count(v, p, 1, &c_->sub_group_size);
      else if (k == "stage3_prefetch_bucket_size") {
        // "auto" (the HF Trainer's placeholder) keeps the default: only 0 (off) changes anything.
        // Only 0 acts, so any number >= 0 is accepted (older HF versions write 0.9 * h * h).
        double bucket = 0.0;
        if (!(v.is_string() && v.get<std::string>() == "auto") && NonNegative(v, p, &bucket)) {
          c_->prefetch_bucket_size = static_cast<uint64_t>(bucket);
        }
      } else if (k == "reduce_bucket_size") {
        // The gradient bucket DeepSpeed allocates whole on the accelerator (host memory on its CPU
        // accelerator). "auto" is HF's placeholder, which it fills with hidden_size^2: a plan of
        // the file keeps DeepSpeed's default, the larger bucket.
        double bucket = 0.0;
        if (!(v.is_string() && v.get<std::string>() == "auto") && NonNegative(v, p, &bucket)) {
          if (bucket > 1e15) Fail(p, StrCat("is ", bucket, "; at most 1e15 elements"));
          c_->reduce_bucket_size = static_cast<uint64_t>(bucket);
        }
      } else
        c_->ignored_keys.push_back(p);
    }
  }
  void Root(const json& root) {
    if (!root.is_object()) {
      Fail("(root)", StrCat("is ", Describe(root), "; a DeepSpeed config is a JSON object"));
      return;
    }
    for (const auto& [k, v] : root.items()) {
      if (k == "zero_optimization")
        Zero(v);
      else if (k == "aio")
        Aio(v);
      else if (k == "spillway")
        Spillway(v);
      else if (k == "train_micro_batch_size_per_gpu")
        Count(v, k, 1, &c_->training.micro_batch_size);
      else if (k == "gradient_accumulation_steps") {
        Count(v, k, 1, &c_->training.gradient_accumulation_steps);
      } else if (k == "gradient_clipping")
        NonNegative(v, k, &c_->training.gradient_clipping);
      else if (k == "optimizer")
        Optimizer(v);
      else
        c_->ignored_keys.push_back(k);
    }
  }

 private:
  bool Object(const json& v, const std::string& path) {
    if (v.is_object()) return true;
    return Fail(path, StrCat("is ", Describe(v), "; expected an object"));
  }
  bool NvmePath(const json& v, const std::string& path, std::string* out) {
    if (v.is_null()) return true;  // DeepSpeed's default
    return String(v, path, out);
  }
  Config* c_;
};

// Whole-config rules: what no single key can check.
Status CrossCheck(const Config& c) {
  auto need_path = [](const std::string& section, OffloadDevice d, const std::string& path) {
    if (d == OffloadDevice::kNvme && path.empty()) {
      return Status::InvalidArgument(StrCat("config key 'zero_optimization.", section,
                                            ".nvme_path' is missing; device \"nvme\" needs a "
                                            "directory on the NVMe drive"));
    }
    return Status::Ok();
  };
  SPILLWAY_RETURN_IF_ERROR(
      need_path("offload_param", c.offload_param.device, c.offload_param.nvme_path));
  SPILLWAY_RETURN_IF_ERROR(
      need_path("offload_optimizer", c.offload_optimizer.device, c.offload_optimizer.nvme_path));
  if (c.offload_param.device != OffloadDevice::kNone && c.zero_stage != 3) {
    return Status::InvalidArgument(
        StrCat("config key 'zero_optimization.offload_param.device' is \"",
               OffloadDeviceName(c.offload_param.device), "\" with zero_optimization.stage ",
               c.zero_stage, "; parameter offload needs stage 3"));
  }
  if (c.aio.block_size % 4096 != 0) {
    return Status::InvalidArgument(StrCat("config key 'aio.block_size' is ", c.aio.block_size,
                                          "; it must be a multiple of 4096 for direct I/O"));
  }
  if (c.aio.block_size % c.aio.intra_op_parallelism != 0) {
    return Status::InvalidArgument(StrCat("config key 'aio.intra_op_parallelism' is ",
                                          c.aio.intra_op_parallelism,
                                          "; aio.block_size must divide evenly by it"));
  }
  if (c.aio.queue_depth > 4096) {
    return Status::InvalidArgument(StrCat("config key 'aio.queue_depth' is ", c.aio.queue_depth,
                                          "; the most Spillway keeps in flight is 4096"));
  }
  if (c.aio.use_gds) {
    return Status::InvalidArgument(
        "config key 'aio.use_gds' is true; Spillway does not implement GPUDirect Storage. Set it "
        "to false (Spillway stages through pinned host memory) or use DeepSpeed's own GDS op");
  }
  return Status::Ok();
}

}  // namespace

const char* OffloadDeviceName(OffloadDevice device) {
  switch (device) {
    case OffloadDevice::kNone:
      return "none";
    case OffloadDevice::kCpu:
      return "cpu";
    case OffloadDevice::kNvme:
      return "nvme";
  }
  return "?";
}

Result<uint64_t> ParseByteSize(std::string_view text) {
  std::istringstream in{std::string(text)};
  double n = 0;
  std::string unit;
  in >> n;
  if (!in.fail() && !in.eof()) in >> unit;
  static const std::pair<const char*, double> kUnits[] = {{"", 1},
                                                          {"B", 1},
                                                          {"KiB", 1024.0},
                                                          {"MiB", 1048576.0},
                                                          {"GiB", 1073741824.0},
                                                          {"TiB", 1099511627776.0},
                                                          {"KB", 1e3},
                                                          {"MB", 1e6},
                                                          {"GB", 1e9},
                                                          {"TB", 1e12}};
  if (!in.fail() && in.eof() && n > 0 && n < 1.8e19) {
    for (const auto& [name, mult] : kUnits) {
      if (unit == name && n * mult < 1.8e19) return static_cast<uint64_t>(n * mult);
    }
  }
  return Status::InvalidArgument(
      StrCat("'", text, "' is not a byte size; use a positive number ",
             "with an optional unit: B, KiB, MiB, GiB, TiB, KB, MB, GB, TB"));
}

Result<Config> Config::Parse(std::string_view text, bool warn_ignored) {
  json root = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) {
    // Parse again with exceptions on to get the position and reason.
    try {
      const json again = json::parse(text);
      (void)again;
    } catch (const json::parse_error& e) {
      return Status::InvalidArgument(StrCat("config is not valid JSON: ", e.what()));
    }
    return Status::InvalidArgument("config is not valid JSON");
  }
  Config c;
  Reader reader(&c);
  reader.Root(root);
  SPILLWAY_RETURN_IF_ERROR(reader.error);
  SPILLWAY_RETURN_IF_ERROR(CrossCheck(c));
  if (warn_ignored && !c.ignored_keys.empty()) {
    std::string list;
    for (const auto& k : c.ignored_keys) list += StrCat(list.empty() ? "" : ", ", k);
    Log(LogLevel::kWarning,
        StrCat("config: DeepSpeed keys accepted and not acted on by Spillway: ", list));
  }
  return c;
}

Result<Config> Config::Load(const std::string& path) {
  std::ifstream in(path);
  if (!in) {
    return Status::FromErrno(StatusCode::kInvalidArgument, errno,
                             StrCat("cannot read config file '", path, "'"));
  }
  std::stringstream ss;
  ss << in.rdbuf();
  auto c = Parse(ss.str());
  if (!c.ok()) return c.status().WithContext(path);
  return c;
}

allocator::HostArenaOptions Config::HostArenaOptions() const {
  allocator::HostArenaOptions o;
  o.budget_bytes = spillway.host_budget_bytes;
  // DeepSpeed pins when either offload asks for it; otherwise pageable, as DeepSpeed does.
  const bool pin = offload_param.pin_memory || offload_optimizer.pin_memory;
  o.pin = pin ? allocator::PinMode::kAuto : allocator::PinMode::kPageable;
  o.fork_safety = spillway.fork_safety;
  o.policy = spillway.host_escape_policy;
  o.capture_backtraces = spillway.capture_backtraces;
  o.retain_limit_bytes = spillway.retain_limit_bytes;
  o.peak_slack = spillway.peak_slack;
  o.region_bytes = spillway.host_region_bytes;
  return o;
}

allocator::IoEngineOptions Config::EngineOptions(allocator::HostArena* arena) const {
  allocator::IoEngineOptions o;
  o.arena = arena;
  o.block_size = aio.block_size;
  // Saturated, never wrapped: a Config built in code skips Parse's ranges, and the engine refuses
  // what is out of range by the key's name.
  const auto u32 = [](uint64_t v) {
    return static_cast<uint32_t>(std::min<uint64_t>(v, UINT32_MAX));
  };
  o.queue_depth = u32(aio.queue_depth);
  o.pool_threads = u32(std::max<uint64_t>(aio.intra_op_parallelism, 1));
  o.bounce_buffers = u32(spillway.bounce_buffers);
  return o;
}

allocator::NvmeArenaOptions Config::NvmeArenaOptions() const {
  allocator::NvmeArenaOptions o;
  o.directory = offload_optimizer.device == OffloadDevice::kNvme ? offload_optimizer.nvme_path
                                                                 : offload_param.nvme_path;
  o.budget_bytes = spillway.nvme_budget_bytes;
  if (o.budget_bytes == 0 && !o.directory.empty()) {
    struct statvfs vfs {};
    if (statvfs(o.directory.c_str(), &vfs) == 0) {
      o.budget_bytes = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize / 10 * 9;
      Log(LogLevel::kInfo, StrCat("spillway.nvme_budget_bytes not set: using 90% of the free "
                                  "space at ",
                                  o.directory, ", ", FormatBytes(o.budget_bytes)));
    }
  }
  o.policy = spillway.nvme_escape_policy;
  o.checksum = spillway.checksum;
  return o;
}

allocator::NvmeArenaOptions Config::SpillArenaOptions() const {
  Config c = *this;
  std::string dir = spillway.spill_path;
  if (dir.empty()) {
    const char* tmp = std::getenv("TMPDIR");  // NOLINT(concurrency-mt-unsafe): read-only, no setenv
    dir = tmp != nullptr && *tmp != '\0' ? tmp : "/var/tmp";
  }
  c.offload_optimizer.device = OffloadDevice::kNvme;
  c.offload_optimizer.nvme_path = dir;
  return c.NvmeArenaOptions();
}

}  // namespace spillway::offload
