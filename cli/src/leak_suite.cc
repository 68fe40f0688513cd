// The leak suite's runner: growth rules, each scenario's trial (its Spillway run, its control, its
// verdict) and the pass rule, the table, CSV files and gnuplot PNGs. The scenarios and their
// registry live in leak/. Note [Leak suite] in docs/leak-suite.md.
#include "spillway/cli/leak_suite.h"

#include <sys/wait.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "leak/scenario.h"
#include "spillway/base/bytes.h"

namespace spillway::cli {

double LeakSeries::BoundaryGrowthPerEpoch() const {
  std::vector<double> b;
  for (const auto& p : points) {
    if (p.boundary) b.push_back(p.bytes);
  }
  if (b.size() < 2) return 0;
  return (b.back() - b.front()) / static_cast<double>(b.size() - 1);
}

double LeakSeries::PeakGrowthPerEpoch() const {
  double sum = 0, prev = 0, peak = 0;
  int epochs = 0;
  bool seen_boundary = false, any = false;
  for (const auto& p : points) {
    if (p.boundary) {
      if (seen_boundary && any) {
        sum += peak - prev;
        ++epochs;
      }
      seen_boundary = true;
      prev = p.bytes;
      any = false;
      peak = p.bytes;
      continue;
    }
    if (seen_boundary) {
      peak = std::max(peak, p.bytes);
      any = true;
    }
  }
  return epochs == 0 ? 0 : sum / epochs;
}

namespace {

// One trial of `s`: the Spillway run, then the control, then the verdict.
Result<ScenarioOutcome> RunScenario(const Scenario& s, const LeakSuiteOptions& options) {
  SPILLWAY_ASSIGN_OR_RETURN(std::unique_ptr<leak::Trial> trial, s.start(options));
  ScenarioOutcome out;
  out.name = s.name;
  out.detector = s.detector;
  SPILLWAY_RETURN_IF_ERROR(trial->Spillway(&out));
  SPILLWAY_RETURN_IF_ERROR(trial->Control(&out));
  trial->Verdict(&out);
  return out;
}

Status WriteCsv(const std::string& path, const ScenarioOutcome& s) {
  std::ofstream f(path);
  if (!f) {
    return Status::FromErrno(StatusCode::kInvalidArgument, errno,
                             StrCat("cannot write ", path, "; pass --out DIR"));
  }
  f << "series,step,epoch,boundary,bytes\n";
  for (const auto* series : {&s.spillway, &s.control}) {
    const char* name = series == &s.spillway ? "spillway" : "control";
    for (const auto& p : series->points) {
      f << name << ',' << p.step << ',' << p.epoch << ',' << (p.boundary ? 1 : 0) << ','
        << static_cast<uint64_t>(p.bytes) << '\n';
    }
  }
  f.close();
  if (!f) return Status::Make(StatusCode::kIoError, StrCat("writing ", path, " failed"));
  return Status::Ok();
}

// gnuplot (Debian gnuplot-nox) renders the CSV: host bytes against step, Spillway and the control
// side by side, dashed lines at the epoch boundaries.
Status Plot(const std::string& csv, const std::string& png, const ScenarioOutcome& s) {
  const std::string script = png + ".gp";
  {
    std::ofstream g(script);
    g << "set terminal pngcairo size 900,420 font 'sans,10'\n"
      << "set output '" << png << "'\n"
      << "set datafile separator ','\n"
      << "set key below\n"
      << "set title '" << s.name << ": " << s.detector << " (Spillway vs control)'\n"
      << "set xlabel 'step'\nset ylabel 'MiB'\nset grid ytics\n";
    for (const auto& p : s.spillway.points) {
      if (p.boundary)
        g << "set arrow from " << p.step << ", graph 0 to " << p.step
          << ", graph 1 nohead dt 2 lc rgb '#999999'\n";
    }
    g << "plot '" << csv
      << "' using 2:(strcol(1) eq 'spillway' ? $5/1048576 : 1/0) with linespoints pt 7 ps 0.5 lw 2 "
         "title 'Spillway', "
      << "'' using 2:(strcol(1) eq 'control' ? $5/1048576 : 1/0) with linespoints pt 5 ps 0.5 lw 2 "
         "title 'control (naive)'\n";
  }
  const std::string cmd = StrCat("gnuplot '", script, "' 2>&1");
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return Status::FromErrno(StatusCode::kUnavailable, errno, "cannot run gnuplot");
  std::string out;
  char buf[512];
  while (size_t n = fread(buf, 1, sizeof(buf), p)) out.append(buf, n);
  const int st = pclose(p);
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
    return Status::Make(StatusCode::kUnavailable,
                        StrCat("gnuplot failed for ", png, ": ", out.empty() ? "no output" : out,
                               WIFEXITED(st) && WEXITSTATUS(st) == 127
                                   ? " (install Debian's gnuplot-nox: scripts/install-deps does)"
                                   : "",
                               "; pass --no-plots to skip the PNGs"));
  }
  std::filesystem::remove(script);
  return Status::Ok();
}

}  // namespace

Result<int> RunLeakSuite(const LeakSuiteOptions& options, const std::vector<std::string>& only) {
  const auto& all = LeakScenarios();
  for (const auto& name : only) {
    if (std::none_of(all.begin(), all.end(), [&](const Scenario& s) { return name == s.name; })) {
      std::string names;
      for (const auto& s : all) names += StrCat(names.empty() ? "" : ", ", s.name);
      return Status::InvalidArgument(
          StrCat("--scenario '", name, "' is not a scenario; choose from ", names));
    }
  }
  std::error_code ec;
  std::filesystem::create_directories(options.out_dir, ec);
  if (ec) {
    return Status::InvalidArgument(
        StrCat("--out ", options.out_dir, ": ", ec.message(), "; pass a writable directory"));
  }
  std::FILE* out = options.out;
  std::vector<ScenarioOutcome> done;
  std::vector<std::string> skipped;
  int failed = 0;
  for (const auto& s : all) {
    if (!only.empty() && std::find(only.begin(), only.end(), s.name) == only.end()) continue;
    if (s.start == nullptr) {
      skipped.push_back(StrCat(s.name, ": ", s.unavailable));
      continue;
    }
    std::fprintf(out, "running %-16s %s ...\n", s.name, s.summary);
    std::fflush(out);
    auto r = RunScenario(s, options);
    if (!r.ok()) {
      ++failed;
      std::fprintf(out, "  %s FAILED TO RUN: %s\n", s.name, r.status().ToString().c_str());
      continue;
    }
    ScenarioOutcome& o = *r;
    o.pass = o.failure.empty() && o.spillway_growth <= o.tolerance && o.spillway.escapes == 0 &&
             o.control_growth > 4 * std::max(o.tolerance, 4096.0);
    for (const auto& n : o.notes) std::fprintf(out, "  %s\n", n.c_str());
    if (!o.failure.empty()) std::fprintf(out, "  FAILED: %s\n", o.failure.c_str());
    const std::string csv = StrCat(options.out_dir, "/", s.name, ".csv");
    SPILLWAY_RETURN_IF_ERROR(WriteCsv(csv, o));
    if (options.plots)
      SPILLWAY_RETURN_IF_ERROR(Plot(csv, StrCat(options.out_dir, "/", s.name, ".png"), o));
    if (!o.pass) ++failed;
    done.push_back(std::move(o));
  }
  std::fprintf(out, "\n%-16s %6s %-34s %16s %16s %8s  %s\n", "scenario", "epochs", "detector",
               "spillway/epoch", "control/epoch", "escapes", "verdict");
  for (const auto& o : done) {
    std::fprintf(out, "%-16s %6" PRId64 " %-34s %16s %16s %8" PRIu64 "  %s\n", o.name.c_str(),
                 o.epochs, o.detector.c_str(), FormatMiBDelta(o.spillway_growth).c_str(),
                 FormatMiBDelta(o.control_growth).c_str(), o.spillway.escapes,
                 o.pass ? "pass" : "FAIL");
  }
  for (const auto& s : skipped) std::fprintf(out, "skipped %s\n", s.c_str());
  std::fprintf(out, "CSV%s in %s/\n", options.plots ? " and PNG" : "", options.out_dir.c_str());
  return failed;
}

}  // namespace spillway::cli
