// tetra ckpt inspect|verify|export: looking inside checkpoints (docs/checkpoints.md).
// tetra verify-resume: proves that a run killed and resumed ends bitwise equal to a straight one.
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ckpt/checkpoint.h"
#include "ckpt/safetensors.h"
#include "cli/args.h"
#include "cli/commands.h"
#include "core/config.h"
#include "core/dir_lock.h"
#include "core/error.h"
#include "core/paths.h"
#include "model/gpt.h"
#include "model/gpt_io.h"
#include "train/train_config.h"

namespace tetra::cli {

namespace {

namespace fs = std::filesystem;

// A checkpoint directory, its manifest.json, or the newest published checkpoint under a ckpt.dir
// (names that are not checkpoints are noted and passed over).
ckpt::Manifest open_checkpoint(const std::string& path, const std::string& what) {
  const std::vector<fs::path> all = ckpt::locate_checkpoints(path, what);
  TETRA_CHECK(!all.empty(),
              "[ckpt] {}: no checkpoint in {} (no manifest.json in it or in a step-* directory "
              "under it); give a checkpoint directory, its manifest.json, or a ckpt.dir",
              what, path);
  return ckpt::Manifest::read(all.front());
}

int inspect(const ckpt::Manifest& m) {
  std::printf("checkpoint %s\n", m.dir.c_str());
  std::printf("  step %lld, tetra %s, format 1\n", (long long)m.step, m.tetra_version.c_str());
  std::printf("  model: %s\n", m.model.c_str());
  std::printf("  layout: %s\n", m.layout.dump().c_str());
  std::printf("  trainer: %s\n", m.trainer.dump().c_str());
  std::map<std::string, uint64_t> per_file;
  size_t chunks = 0;
  for (const auto& [name, rec] : m.tensors) {
    for (const auto& [kind, list] : rec.chunks) {
      for (const ckpt::Chunk& c : list) per_file[c.file] += uint64_t(c.count) * 4, ++chunks;
    }
  }
  std::printf("  %zu tensors, %zu chunks, %.1f MB of data in %zu file(s):\n", m.tensors.size(),
              chunks, double(m.bytes) / 1e6, per_file.size());
  for (const auto& [file, bytes] : per_file) {
    std::printf("    %-24s %10.1f MB\n", file.c_str(), double(bytes) / 1e6);
  }
  std::printf("  %-48s %-16s %s\n", "tensor", "shape", "chunks (param/adam_m/adam_v)");
  for (const auto& [name, rec] : m.tensors) {
    std::printf("  %-48s %-16s %zu/%zu/%zu\n", name.c_str(), shape_str(rec.shape).c_str(),
                rec.chunks.at("param").size(), rec.chunks.at("adam_m").size(),
                rec.chunks.at("adam_v").size());
  }
  return 0;
}

int verify_cmd(const ckpt::Manifest& m) {
  const std::vector<std::string> problems = ckpt::verify(m);
  for (const auto& p : problems) std::fprintf(stderr, "%s\n", p.c_str());
  if (!problems.empty()) {
    std::fprintf(stderr, "[ckpt] %s: %zu chunk(s) damaged; this checkpoint cannot be resumed\n",
                 m.dir.c_str(), problems.size());
    return 1;
  }
  std::printf("[ckpt] %s verifies: %.1f MB, every chunk matches its checksum\n", m.dir.c_str(),
              double(m.bytes) / 1e6);
  return 0;
}

// Whether `path` starts like a safetensors file: an 8-byte header length that fits the file,
// then a JSON object. Only the first bytes are read, however large the file.
bool looks_like_safetensors(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  uint8_t len[8] = {};
  char brace = 0;
  if (!in.read(reinterpret_cast<char*>(len), 8) || !in.get(brace)) return false;
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | len[i];
  std::error_code ec;
  const uintmax_t size = fs::file_size(path, ec);
  return !ec && brace == '{' && n >= 2 && n <= size - 8;
}

// Refuses an export target that would overwrite anything it should not: the checkpoint it reads
// (or anything in the directory the user named), a directory, or an existing file without
// --force (and with --force, anything but a safetensors file).
void check_export_target(const fs::path& to, const ckpt::Manifest& m, const fs::path& given,
                         bool force) {
  for (const fs::path& input : {m.dir, given}) {
    TETRA_CHECK(!is_within(to, input),
                "[ckpt] export --to {}: that is inside {}, which this export reads; write the "
                "weights outside it (nothing in a checkpoint is replaced)",
                to.string(), input.string());
  }
  std::error_code ec;
  const fs::file_status st = fs::symlink_status(to, ec);
  TETRA_CHECK(!fs::is_directory(fs::status(to, ec)),
              "[ckpt] export --to {} is a directory; give a file path such as "
              "{}/model.safetensors",
              to.string(), to.string());
  if (fs::exists(st)) {
    TETRA_CHECK(force,
                "[ckpt] export --to {}: the file exists; add --force to replace it (it is "
                "replaced whole, once the new file is complete), or choose another path",
                to.string());
    TETRA_CHECK(fs::is_regular_file(st) && looks_like_safetensors(to),
                "[ckpt] export --to {} --force: it exists and is not a safetensors file, so it is "
                "not replaced even with --force; choose another path",
                to.string());
  }
  const fs::path parent = to.parent_path().empty() ? fs::path(".") : to.parent_path();
  TETRA_CHECK(fs::is_directory(parent, ec),
              "[ckpt] export --to {}: the directory {} does not exist; create it or choose "
              "another path",
              to.string(), parent.string());
}

// The weights in Hugging Face names and layouts, through the same model and store as training.
int export_cmd(const ckpt::Manifest& m, const fs::path& given, const std::string& to, bool force) {
  check_export_target(to, m, given, force);
  const Config config =
      Config::parse(train_config_schema(), m.config_toml, (m.dir / "manifest.json").string(), {});
  ParamStore store;
  Gpt model(cpu_backend(), gpt_config_from(config), store, 1, 1);
  store.finalize(Sharding{});
  for (TensorId id = 0; id < TensorId(store.tensors().size()); ++id) {
    const std::string& name = store.tensor(id).spec.name;
    store.load_global(id, ckpt::read_global(m, name, "param").data());
  }
  write_safetensors(to, store_to_safetensors(store, store.params().data(), true));
  std::printf("[ckpt] wrote the weights of %s (step %lld) to %s\n", m.dir.c_str(),
              (long long)m.step, to.c_str());
  return 0;
}

// Runs `args` (this binary) with stdout and stderr into `log`; returns the wait status.
int run_logged(const std::vector<std::string>& args, const fs::path& log) {
  std::vector<std::string> cmd = {fs::read_symlink("/proc/self/exe").string()};
  cmd.insert(cmd.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& s : cmd) argv.push_back(s.data());
  argv.push_back(nullptr);
  const pid_t child = fork();
  TETRA_CHECK(child >= 0, "[verify-resume] fork failed: {}", std::strerror(errno));
  if (child == 0) {
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd >= 0) dup2(fd, 1), dup2(fd, 2);
    execv(argv[0], argv.data());
    _exit(127);
  }
  int status = 0;
  while (waitpid(child, &status, 0) < 0) {
    TETRA_CHECK(errno == EINTR, "[verify-resume] waitpid failed: {}", std::strerror(errno));
  }
  return status;
}

// step -> the metrics record of that step, from every metrics file of a run directory.
std::vector<std::pair<fs::path, nlohmann::json>> metric_records(const fs::path& run_dir) {
  std::vector<std::pair<fs::path, nlohmann::json>> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(run_dir, ec)) {
    if (e.path().filename().string().rfind("metrics.jsonl", 0) != 0) continue;
    std::ifstream in(e.path());
    for (std::string line; std::getline(in, line);) {
      out.emplace_back(e.path(), nlohmann::json::parse(line));
    }
  }
  return out;
}

int verify_resume(const Args& args) {
  ArgParser p(
      "verify-resume", "tetra verify-resume",
      "usage: tetra verify-resume --config FILE.toml [--steps N] [--kill-at K] "
      "[--every E] [-n RANKS] [--dir D] [--section.key=value ...]\n\n"
      "Trains N steps straight; trains again with checkpoints every E steps, killed by\n"
      "SIGKILL after step K (on the last rank), and resumes from the newest checkpoint.\n"
      "Passes when the final weights, the optimizer state, the data position and every\n"
      "logged loss are bitwise equal. Exit status 0: equal; 1: not.\n",
      {{{"--config", ValueKind::String, "\"\"", "the run's TOML config"}, "FILE.toml"},
       {{"--steps", ValueKind::Int, "12", "steps of each run", "[2, 1000000000]"}, "N"},
       {{"--kill-at", ValueKind::Int, "0",
         "the step after which the run is killed (0: two thirds of --steps)", "[0, 1000000000]"},
        "K"},
       {{"--every", ValueKind::Int, "0", "steps between checkpoints (0: a third of --steps)",
         "[0, 1000000000]"},
        "E"},
       {.spec = {"-n", ValueKind::Int, "1", "ranks (through tetra launch)", "[1, 4096]"},
        .metavar = "RANKS"},
       {{"--dir", ValueKind::String, "\"runs/verify-resume\"",
         "where both runs write (emptied first)"},
        "D"}});
  p.allow_overrides(train_config_schema());
  if (!p.parse(args)) return 0;
  const int64_t steps = p.i("--steps");
  const int64_t kill_at =
      p.i("--kill-at") > 0 ? p.i("--kill-at") : std::max<int64_t>(1, 2 * steps / 3);
  const int64_t every = p.i("--every") > 0 ? p.i("--every") : std::max<int64_t>(1, steps / 3);
  const int ranks = int(p.i("-n"));
  TETRA_CHECK(kill_at < steps, "[verify-resume] --kill-at={} must be below --steps={}", kill_at,
              steps);
  // The config is checked here, so that a bad key fails now and not inside the first run.
  Config::load(train_config_schema(), p.s("--config"), p.overrides());
  const fs::path dir = p.s("--dir");
  // --dir is emptied first, so it must be verify-resume's own: a directory it made (it leaves a
  // marker file) or an empty one. Its lock keeps a second verify-resume from emptying it under
  // the first; the runs inside lock their own run and checkpoint directories.
  const fs::path marker = dir / ".tetra-verify-resume";
  std::error_code ec;
  if (fs::exists(dir, ec)) {
    TETRA_CHECK(fs::is_directory(dir, ec),
                "[verify-resume] --dir {} is a file; give a directory (it is emptied first)",
                dir.string());
    bool empty = true;
    for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
      if (it->path().filename() != ".tetra.lock") empty = false;
    }
    TETRA_CHECK(empty || fs::exists(marker, ec),
                "[verify-resume] --dir {} holds files verify-resume did not write, and it is "
                "emptied first; give a new or empty directory",
                dir.string());
  }
  fs::create_directories(dir, ec);
  TETRA_CHECK(fs::is_directory(dir, ec),
              "[verify-resume] --dir {}: cannot create it ({}); choose a writable place",
              dir.string(), ec.message());
  const DirLock lock =
      DirLock::acquire(dir, "verify-resume --dir=" + dir.string(), "verify-resume");
  std::vector<fs::path> previous;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    if (it->path().filename() != ".tetra.lock") previous.push_back(it->path());
  }
  for (const fs::path& old : previous) fs::remove_all(old, ec);
  std::ofstream(marker) << "written by tetra verify-resume; the directory is emptied by its next "
                           "run\n";

  auto train = [&](const std::string& name, std::vector<std::string> extra) {
    std::vector<std::string> a;
    if (ranks > 1) a = {"launch", "-n", std::to_string(ranks), "--"};
    a.push_back("train");
    if (!p.s("--config").empty()) a.insert(a.end(), {"--config", p.s("--config")});
    for (const auto& o : p.overrides()) a.push_back("--" + o);
    a.insert(a.end(), {fmt::format("--train.steps={}", steps), "--run.dir=" + (dir / name).string(),
                       "--run.progress=never"});
    a.insert(a.end(), extra.begin(), extra.end());
    return run_logged(a, dir / (name + ".log"));
  };
  auto ok = [](int status) { return WIFEXITED(status) && WEXITSTATUS(status) == 0; };
  const std::string straight_ckpt = "--ckpt.dir=" + (dir / "straight-ckpt").string();
  const std::string resumed_ckpt = "--ckpt.dir=" + (dir / "resumed-ckpt").string();
  std::printf("[verify-resume] straight run: %lld steps (log %s)\n", (long long)steps,
              (dir / "straight.log").c_str());
  int st = train("straight", {straight_ckpt, "--ckpt.every=0",
                              "--save.final=" + (dir / "straight.safetensors").string()});
  TETRA_CHECK(ok(st), "[verify-resume] the straight run failed; see {}",
              (dir / "straight.log").string());
  std::printf("[verify-resume] second run: checkpoints every %lld steps, killed after step %lld\n",
              (long long)every, (long long)kill_at);
  st = train("resumed", {resumed_ckpt, fmt::format("--ckpt.every={}", every),
                         fmt::format("--debug.kill_step={}", kill_at),
                         fmt::format("--debug.fault_rank={}", ranks - 1)});
  TETRA_CHECK(!ok(st), "[verify-resume] the run to be killed finished instead; see {}",
              (dir / "resumed.log").string());
  std::printf("[verify-resume] it %s; resuming from its newest checkpoint\n",
              WIFSIGNALED(st) ? fmt::format("died of signal {}", WTERMSIG(st)).c_str()
                              : fmt::format("exited with status {}", WEXITSTATUS(st)).c_str());
  st = train("resumed", {resumed_ckpt, fmt::format("--ckpt.every={}", every), "--ckpt.resume=auto",
                         "--save.final=" + (dir / "resumed.safetensors").string()});
  TETRA_CHECK(ok(st), "[verify-resume] the resumed run failed; see {}",
              (dir / "resumed.log").string());

  int failures = 0;
  // Every loss logged by either part of the second run against the straight run's.
  std::map<int64_t, nlohmann::json> straight;
  for (auto& [file, rec] : metric_records(dir / "straight")) straight[rec["step"]] = rec;
  size_t compared = 0;
  for (auto& [file, rec] : metric_records(dir / "resumed")) {
    const int64_t step = rec["step"];
    const double a = straight.at(step)["loss"], b = rec["loss"];
    ++compared;
    if (std::memcmp(&a, &b, sizeof a) != 0) {
      std::printf("  loss of step %lld differs: %.17g straight, %.17g in %s\n", (long long)step, a,
                  b, file.filename().c_str());
      ++failures;
    }
  }
  std::printf("[verify-resume] losses: %zu logged records compared\n", compared);
  // Weights, optimizer moments and the data position, from both runs' final checkpoints.
  const ckpt::Manifest sa = open_checkpoint((dir / "straight-ckpt").string(), "verify-resume");
  const ckpt::Manifest sb = open_checkpoint((dir / "resumed-ckpt").string(), "verify-resume");
  size_t tensors = 0;
  for (const auto& [name, rec] : sa.tensors) {
    for (const char* kind : ckpt::kKinds) {
      const std::vector<float> a = ckpt::read_global(sa, name, kind);
      const std::vector<float> b = ckpt::read_global(sb, name, kind);
      ++tensors;
      if (a.size() != b.size() || std::memcmp(a.data(), b.data(), a.size() * 4) != 0) {
        std::printf("  %s (%s) differs\n", name.c_str(), kind);
        ++failures;
      }
    }
  }
  std::printf("[verify-resume] weights and AdamW moments: %zu tensors compared\n", tensors);
  if (sa.trainer.at("sampler") != sb.trainer.at("sampler") ||
      sa.trainer.at("adamw_steps") != sb.trainer.at("adamw_steps")) {
    std::printf("  data position or optimizer step differ: %s vs %s\n", sa.trainer.dump().c_str(),
                sb.trainer.dump().c_str());
    ++failures;
  }
  std::printf("[verify-resume] %s: %d difference(s)\n", failures ? "FAIL" : "PASS, bitwise equal",
              failures);
  return failures ? 1 : 0;
}

}  // namespace

int ckpt_main(const Args& args) {
  const std::string usage =
      "usage: tetra ckpt inspect|verify CHECKPOINT\n"
      "       tetra ckpt export CHECKPOINT --to FILE.safetensors [--force]\n\n"
      "CHECKPOINT is a checkpoint directory, its manifest.json, or a ckpt.dir (its newest\n"
      "checkpoint).\n"
      "  inspect  what it holds: step, layout, trainer state, tensors, files\n"
      "  verify   reads every chunk and checks its checksum (exit status 1 if damaged)\n"
      "  export   the weights as one Hugging Face GPT-2 safetensors file (--to); an existing\n"
      "           file is replaced only with --force, and only if it is a safetensors file\n";
  const std::vector<Flag> export_flags = {
      {{"--to", ValueKind::String, "\"\"", "export: the safetensors file to write"}, "FILE"},
      {{"--force", ValueKind::Bool, "false",
        "export: replace an existing safetensors file at --to"}}};
  const bool verb =
      !args.empty() && (args[0] == "inspect" || args[0] == "verify" || args[0] == "export");
  if (!verb) {
    ArgParser p("ckpt", "tetra ckpt", usage, export_flags);
    if (!p.parse(args)) return 0;  // --help
    fail("[ckpt] usage: tetra ckpt inspect|verify|export CHECKPOINT [--to FILE]; got '{}'",
         fmt::join(args, " "));
  }
  const std::string& cmd = args[0];
  const bool is_export = cmd == "export";
  // Each verb takes only its own flags: one that another verb takes is refused by name rather
  // than ignored.
  ArgParser p("ckpt", "tetra ckpt " + cmd, usage, is_export ? export_flags : std::vector<Flag>{});
  for (size_t i = 1; i < args.size() && !is_export; ++i) {
    const std::string name = args[i].substr(0, args[i].find('='));
    TETRA_CHECK(name != "--to" && name != "--force",
                "[ckpt] tetra ckpt {} takes no {}: only export writes a file (tetra ckpt export "
                "CHECKPOINT --to FILE.safetensors)",
                cmd, name);
  }
  if (args.size() >= 2 && (args[1] == "--help" || args[1] == "-h")) {
    p.parse({args[1]});
    return 0;
  }
  // The checkpoint comes right after the verb, so that a flag's value is never taken for it.
  TETRA_CHECK(args.size() >= 2 && args[1].rfind("-", 0) != 0,
              "[ckpt] tetra ckpt {} needs the checkpoint right after the verb (tetra ckpt {} "
              "CHECKPOINT{}): a checkpoint directory, its manifest.json, or a ckpt.dir",
              cmd, cmd, is_export ? " --to FILE.safetensors" : "");
  if (!p.parse(Args(args.begin() + 2, args.end()))) return 0;
  if (is_export) {
    TETRA_CHECK(!p.s("--to").empty(),
                "[ckpt] tetra ckpt export needs --to FILE.safetensors: the file to write");
  }
  const ckpt::Manifest m = open_checkpoint(args[1], "tetra ckpt " + cmd + " " + args[1]);
  if (cmd == "inspect") return inspect(m);
  if (cmd == "verify") return verify_cmd(m);
  return export_cmd(m, args[1], p.s("--to"), p.b("--force"));
}

int verify_resume_main(const Args& args) { return verify_resume(args); }

}  // namespace tetra::cli
