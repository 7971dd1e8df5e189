#include "ckpt/checkpoint.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <regex>

#include "ckpt/checkpoint_files.h"
#include "core/atomic_file.h"
#include "core/error.h"
#include "core/log.h"
#include "core/read_file.h"
#include "core/timer.h"

namespace tetra::ckpt {

using detail::checksum;
using detail::kFormat;
using detail::kFormatVersion;
using detail::kMaxManifestBytes;

namespace {

using json = nlohmann::json;

// The global element index of element i of a writer's (or reader's) part of a tensor.
struct PartMap {
  ParamEntry entry;
  PartMap(const Shape& shape, const Slice& slice) {
    entry.spec.shape = shape;
    entry.spec.slice = slice;
    entry.local_shape = shape;
    if (slice.dim >= 0) entry.local_shape[size_t(slice.dim)] = slice.parts * slice.extent;
  }
  int64_t global(int64_t i) const { return entry.global_index(i); }
  int64_t numel() const { return entry.numel(); }
};

// Reads [offset, offset + n) of a file whole; errors name the checkpoint file.
void pread_all(int fd, void* out, size_t n, uint64_t offset, const fs::path& path) {
  auto* p = static_cast<char*>(out);
  while (n > 0) {
    ssize_t got = ::pread(fd, p, n, off_t(offset));
    if (got < 0 && errno == EINTR) continue;
    TETRA_CHECK(got > 0,
                "[ckpt] {}: cannot read {} bytes at offset {} ({}); the file is truncated "
                "or unreadable",
                path.string(), n, offset, got < 0 ? std::strerror(errno) : "end of file");
    p += got, n -= size_t(got), offset += uint64_t(got);
  }
}

class OpenFiles {
 public:
  explicit OpenFiles(fs::path dir) : dir_(std::move(dir)) {}
  ~OpenFiles() {
    for (auto& [name, fd] : fds_) ::close(fd);
  }
  int get(const std::string& name) {
    auto it = fds_.find(name);
    if (it != fds_.end()) return it->second;
    const fs::path p = dir_ / name;
    int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
    TETRA_CHECK(fd >= 0, "[ckpt] {}: cannot open ({})", p.string(), std::strerror(errno));
    fds_[name] = fd;
    return fd;
  }
  const fs::path& dir() const { return dir_; }

 private:
  fs::path dir_;
  std::map<std::string, int> fds_;
};

// One chunk's values, checked against its checksum.
std::vector<float> read_chunk(OpenFiles& files, const Chunk& c, const std::string& name,
                              const std::string& kind) {
  std::vector<float> data(size_t(c.count));
  pread_all(files.get(c.file), data.data(), data.size() * sizeof(float), c.offset,
            files.dir() / c.file);
  TETRA_CHECK(checksum(data.data(), c.count) == c.xxh3,
              "[ckpt] {}: the chunk of {} ({}, elements {}..{}) at byte {} fails its checksum: "
              "the file is damaged",
              (files.dir() / c.file).string(), name, kind, c.first, c.first + c.count, c.offset);
  return data;
}

// Calls f(chunk, g0, g1) for every chunk of (rec, kind) holding some of global elements [lo, hi);
// [g0, g1) is the span of global elements the chunk covers.
template <typename F>
void for_each_overlapping(const TensorRecord& rec, const std::string& kind, int64_t lo, int64_t hi,
                          F&& f) {
  for (const Chunk& c : rec.chunks.at(kind)) {
    const PartMap part(rec.shape, c.slice);
    const int64_t g0 = part.global(c.first), g1 = part.global(c.first + c.count - 1) + 1;
    if (g1 <= lo || g0 >= hi) continue;
    f(c, part, g0, g1);
  }
}

// Writes global elements [lo, hi) of (name, kind) into out from every chunk that overlaps them.
void read_range(OpenFiles& files, const std::string& name, const TensorRecord& rec,
                const std::string& kind, int64_t lo, int64_t hi, float* out) {
  for_each_overlapping(
      rec, kind, lo, hi, [&](const Chunk& c, const PartMap& part, int64_t g0, int64_t g1) {
        const std::vector<float> data = read_chunk(files, c, name, kind);
        if (c.slice.dim < 0) {
          const int64_t a = std::max(lo, g0), b = std::min(hi, g1);
          std::copy(data.begin() + (a - g0), data.begin() + (b - g0), out + (a - lo));
          return;
        }
        for (int64_t k = 0; k < c.count; ++k) {
          const int64_t g = part.global(c.first + k);
          if (g >= lo && g < hi) out[g - lo] = data[size_t(k)];
        }
      });
}

// Calls f(name, record, entry, kind, first, count, out) for every run of elements this rank holds
// of `store` (its parameters, store.held) and updates (AdamW's m and v of its owned segments, at
// `m` and `v`), after checking that the checkpoint has every tensor of the model in its shape.
template <typename F>
void for_each_held_run(const Manifest& manifest, ParamStore& store, float* m, float* v, bool stage,
                       F&& f) {
  const std::string where = manifest.dir.string();
  for (const auto& [name, rec] : manifest.tensors) {
    TETRA_CHECK(stage || store.find(name) >= 0,
                "[ckpt] {} holds '{}', which this model does not have: it was saved from another "
                "model ({})",
                where, name, manifest.model);
  }
  for (TensorId id = 0; id < TensorId(store.tensors().size()); ++id) {
    const ParamEntry& e = store.tensor(id);
    auto it = manifest.tensors.find(e.spec.name);
    TETRA_CHECK(it != manifest.tensors.end(),
                "[ckpt] {} has no '{}': it was saved from another model ({}); this run's model "
                "needs it",
                where, e.spec.name, manifest.model);
    // A padded vocabulary's row count depends on the tensor-parallel size (vocab_multiple x
    // tp); rows past the real ones are zero (no gradient reaches them), so only the real rows
    // need to match and missing padding rows read as zero.
    const Shape& saved = it->second.shape;
    const int64_t real = e.spec.file.rows;
    const bool padding_differs =
        real >= 0 && saved.size() == e.spec.shape.size() && saved[0] >= real &&
        e.spec.shape[0] >= real &&
        std::equal(saved.begin() + 1, saved.end(), e.spec.shape.begin() + 1);
    TETRA_CHECK(saved == e.spec.shape || padding_differs,
                "[ckpt] {}: '{}' has shape {} there but {} in this model; the model.* keys must "
                "match the run that saved it ({})",
                where, e.spec.name, shape_str(it->second.shape), shape_str(e.spec.shape),
                manifest.model);
    const ParamStore::HeldRun run = store.held(id);
    f(e.spec.name, it->second, e, kKinds[0], run.first, run.count, run.data);
  }
  for (const OwnedSegment& s : store.owned()) {
    const ParamEntry& e = store.tensor(s.tensor);
    const TensorRecord& rec = manifest.tensors.at(e.spec.name);
    // (No moments to fill when only the files are asked for: m and v are null then.)
    f(e.spec.name, rec, e, kKinds[1], int64_t(s.element), int64_t(s.count),
      m ? m + s.state_pos : nullptr);
    f(e.spec.name, rec, e, kKinds[2], int64_t(s.element), int64_t(s.count),
      v ? v + s.state_pos : nullptr);
  }
}

constexpr int64_t kMaxElements = int64_t(1) << 50;

// Steps in [0, 10^18) have at most 18 digits, so every name checkpoint_name writes parses back
// without overflow and a longer digit run is never handed to a conversion.
constexpr size_t kMinStepDigits = 9, kMaxStepDigits = 18;
constexpr std::string_view kStepPrefix = "step-";

// The nonce of "<checkpoint name>.tmp-<nonce>" (or ".old-"): the writer's are 16 hex digits;
// any non-empty run of letters and digits is taken as one (tests name theirs), nothing else.
bool is_nonce(std::string_view s) {
  return !s.empty() && s.size() <= 64 &&
         std::all_of(s.begin(), s.end(), [](char c) { return std::isalnum((unsigned char)c); });
}

// "<checkpoint name>.tmp-<nonce>" or ".old-<nonce>" (a save in progress, or one that died): the
// nonce, else nothing.
std::optional<std::string> unfinished_nonce(std::string_view name) {
  const size_t dot = name.find('.');
  if (dot == std::string_view::npos || !parse_checkpoint_name(name.substr(0, dot))) return {};
  const std::string_view rest = name.substr(dot);
  for (std::string_view tag : {std::string_view(".tmp-"), std::string_view(".old-")}) {
    if (rest.substr(0, tag.size()) == tag && is_nonce(rest.substr(tag.size()))) {
      return std::string(rest.substr(tag.size()));
    }
  }
  return {};
}

}  // namespace

int64_t integer_field(const json& j, const char* field, int64_t lo, int64_t hi,
                      const std::string& where) {
  TETRA_CHECK(j.is_object() && j.contains(field), "[ckpt] {}: '{}' is missing", where, field);
  const json& v = j.at(field);
  // JSON reads every non-negative integer as unsigned: both bounds apply to it too (a count of 0
  // where at least 1 is needed would later divide by zero).
  const bool ok = v.is_number_integer() &&
                  (v.is_number_unsigned() ? (lo <= 0 || v.get<uint64_t>() >= uint64_t(lo)) &&
                                                v.get<uint64_t>() <= uint64_t(hi)
                                          : v.get<int64_t>() >= lo && v.get<int64_t>() <= hi);
  TETRA_CHECK(ok, "[ckpt] {}: '{}' is {}, not an integer in [{}, {}]", where, field, v.dump(), lo,
              hi);
  return v.get<int64_t>();
}

std::string checkpoint_name(int64_t step) { return fmt::format("step-{:09}", step); }

std::optional<int64_t> parse_checkpoint_name(std::string_view name) {
  if (name.substr(0, kStepPrefix.size()) != kStepPrefix) return std::nullopt;
  const std::string_view digits = name.substr(kStepPrefix.size());
  if (digits.size() < kMinStepDigits || digits.size() > kMaxStepDigits) return std::nullopt;
  if (digits.find_first_not_of("0123456789") != std::string_view::npos) return std::nullopt;
  // Zero padding only up to 9 digits: "step-0000000012" is not a name tetra writes.
  if (digits.size() > kMinStepDigits && digits[0] == '0') return std::nullopt;
  int64_t step = 0;
  for (char c : digits) step = step * 10 + (c - '0');  // at most 18 digits: cannot overflow
  return step;
}

DirScan scan_checkpoint_dir(const fs::path& dir) {
  DirScan scan;
  std::error_code ec;
  fs::directory_iterator it(dir, ec), end;
  for (; !ec && it != end; it.increment(ec)) {
    const fs::path path = it->path();
    const std::string name = path.filename().string();
    if (name.rfind(kStepPrefix, 0) != 0) continue;  // not tetra's (latest, .tetra.lock, yours)
    std::error_code e2;
    const bool is_dir = fs::is_directory(path, e2);
    if (const std::optional<int64_t> step = parse_checkpoint_name(name)) {
      if (!is_dir) {
        scan.ignored.push_back(path.string() + ": named like a checkpoint but not a directory");
      } else if (!fs::is_regular_file(path / "manifest.json", e2)) {
        scan.ignored.push_back(path.string() +
                               ": no manifest.json in it, so not a published checkpoint");
      } else {
        scan.published.push_back({*step, path});
      }
    } else if (const std::optional<std::string> nonce = unfinished_nonce(name); nonce && is_dir) {
      scan.unfinished.push_back({path, *nonce});
    } else {
      scan.ignored.push_back(path.string() +
                             ": not a checkpoint name (tetra names them step- and the step in 9 "
                             "to 18 digits, as " +
                             checkpoint_name(120) + ")");
    }
  }
  std::sort(scan.published.begin(), scan.published.end(),
            [](const auto& a, const auto& b) { return a.step > b.step; });
  return scan;
}

void log_ignored(const DirScan& scan) {
  for (const std::string& note : scan.ignored) log_info("[ckpt] ignored {}", note);
}

std::vector<fs::path> list_checkpoints(const fs::path& dir) {
  std::vector<fs::path> out;
  for (const DirScan::Published& p : scan_checkpoint_dir(dir).published) out.push_back(p.path);
  return out;
}

std::vector<fs::path> locate_checkpoints(const fs::path& path, const std::string& what) {
  const std::string hint = "give a checkpoint directory (" + checkpoint_name(120) +
                           "), its manifest.json, or a ckpt.dir holding checkpoints";
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  TETRA_CHECK(fs::exists(st), "[ckpt] {}: no checkpoint there: {} does not exist; {}", what,
              path.string(), hint);
  if (fs::is_regular_file(st)) {
    TETRA_CHECK(path.filename() == "manifest.json", "[ckpt] {}: {} is a file, not a checkpoint; {}",
                what, path.string(), hint);
    return {path.parent_path().empty() ? fs::path(".") : path.parent_path()};
  }
  TETRA_CHECK(fs::is_directory(st), "[ckpt] {}: {} is neither a directory nor a file; {}", what,
              path.string(), hint);
  if (fs::exists(path / "manifest.json", ec)) return {path};
  const DirScan scan = scan_checkpoint_dir(path);
  log_ignored(scan);
  std::vector<fs::path> out;
  for (const DirScan::Published& p : scan.published) out.push_back(p.path);
  return out;
}

Manifest Manifest::read(const fs::path& dir) {
  const std::string text =
      read_small_file((dir / "manifest.json").string(), kMaxManifestBytes, "ckpt",
                      "a checkpoint manifest", "it is written by tetra train with ckpt.dir set");
  return parse(text, dir, [&](const std::string& file) -> std::optional<uintmax_t> {
    std::error_code ec;
    const uintmax_t size = fs::file_size(dir / file, ec);
    if (ec) return std::nullopt;
    return size;
  });
}

Manifest Manifest::parse(const std::string& text, const fs::path& dir,
                         const std::function<std::optional<uintmax_t>(const std::string&)>& size) {
  const std::string where = (dir / "manifest.json").string();
  Manifest m;
  m.dir = dir;
  try {
    const json j = json::parse(text);
    TETRA_CHECK(j.at("format") == kFormat && j.at("version") == kFormatVersion,
                "[ckpt] {}: not a tetra checkpoint of format version {} (format {}, version {})",
                where, kFormatVersion, j.at("format").dump(), j.at("version").dump());
    m.step = integer_field(j, "step", 0, kMaxStep, where);
    // A directory named for a step holds that step: a copy or an edit that disagrees is refused
    // rather than resumed at the wrong place.
    if (const std::optional<int64_t> named = parse_checkpoint_name(dir.filename().string())) {
      TETRA_CHECK(*named == m.step,
                  "[ckpt] {}: the manifest says step {} but its directory is named for step {}; "
                  "the checkpoint was renamed or edited, so it cannot be trusted",
                  where, m.step, *named);
    }
    m.trainer = j.at("trainer");
    m.layout = j.at("layout");
    m.ranks = j.at("ranks");
    m.config_toml = j.at("config").get<std::string>();
    m.model = j.at("model").get<std::string>();
    m.tetra_version = j.at("tetra_version").get<std::string>();
    if (j.contains("model_shape")) {
      const json& shape = j.at("model_shape");
      for (const char* key : {"vocab_size", "n_layer", "n_head", "d_model", "max_seq"}) {
        integer_field(shape, key, 1, INT32_MAX, where + " model_shape");
      }
      m.model_shape = shape;
    }
    std::map<std::string, uintmax_t> sizes;
    for (const auto& [name, t] : j.at("tensors").items()) {
      TensorRecord rec;
      int64_t numel = 1;
      for (const json& d : t.at("shape")) {
        TETRA_CHECK(d.is_number_integer() && d.get<int64_t>() >= 1 &&
                        d.get<int64_t>() <= kMaxElements / numel,
                    "[ckpt] {}: {} has the shape {}; dimensions are positive integers", where, name,
                    t.at("shape").dump());
        rec.shape.push_back(d.get<int64_t>());
        numel *= rec.shape.back();
      }
      TETRA_CHECK(!rec.shape.empty() && rec.shape.size() <= 8, "[ckpt] {}: {} has the shape {}",
                  where, name, t.at("shape").dump());
      for (const char* kind : kKinds) {
        std::vector<Chunk>& chunks = rec.chunks[kind];
        int64_t covered = 0;
        for (const json& c : t.at("chunks").at(kind)) {
          Chunk k;
          k.file = c.at("file").get<std::string>();
          static const std::regex file_re("rank-[0-9]{5,}\\.safetensors");
          TETRA_CHECK(std::regex_match(k.file, file_re), "[ckpt] {}: {} names the file '{}'", where,
                      name, k.file);
          k.offset = uint64_t(integer_field(c, "offset", 0, INT64_MAX, where));
          const json& sl = c.at("slice");
          k.slice = {int(integer_field(sl, "dim", -1, 7, where)),
                     integer_field(sl, "offset", 0, kMaxElements, where),
                     integer_field(sl, "extent", 0, kMaxElements, where),
                     sl.contains("parts") ? integer_field(sl, "parts", 1, kMaxElements, where) : 1};
          k.first = integer_field(c, "first", 0, kMaxElements, where);
          k.count = integer_field(c, "count", 1, kMaxElements, where);
          const std::string hex = c.at("xxh3").get<std::string>();
          TETRA_CHECK(!hex.empty() && hex.size() <= 16 &&
                          hex.find_first_not_of("0123456789abcdef") == std::string::npos,
                      "[ckpt] {}: {} ({}) has the checksum '{}', not 1 to 16 hex digits", where,
                      name, kind, hex);
          k.xxh3 = std::stoull(hex, nullptr, 16);
          const Slice& s = k.slice;
          TETRA_CHECK(
              s.dim < int(rec.shape.size()) &&
                  (s.dim < 0 ||
                   (rec.shape[size_t(s.dim)] % s.parts == 0 && s.offset >= 0 && s.extent > 0 &&
                    s.offset + s.extent <= rec.shape[size_t(s.dim)] / s.parts)),
              "[ckpt] {}: {} ({}) has a slice outside its shape {}", where, name, kind,
              shape_str(rec.shape));
          TETRA_CHECK(k.first + k.count <= PartMap(rec.shape, s).numel(),
                      "[ckpt] {}: {} ({}) has a chunk of elements {}..{} outside its part", where,
                      name, kind, k.first, k.first + k.count);
          if (!sizes.count(k.file)) {
            const std::optional<uintmax_t> bytes = size(k.file);
            TETRA_CHECK(bytes, "[ckpt] {}: {} is missing", where, k.file);
            sizes[k.file] = *bytes;
          }
          TETRA_CHECK(k.offset <= sizes[k.file] &&
                          uint64_t(k.count) * sizeof(float) <= sizes[k.file] - k.offset,
                      "[ckpt] {}: {} is truncated: {} ({}) needs bytes up to {}, the file has {}",
                      where, k.file, name, kind, k.offset + uint64_t(k.count) * sizeof(float),
                      sizes[k.file]);
          covered += k.count;
          m.bytes += uint64_t(k.count) * sizeof(float);
          chunks.push_back(k);
        }
        // Whole-tensor chunks must tile the tensor; sliced ones at least add up to it.
        std::sort(chunks.begin(), chunks.end(), [](const Chunk& a, const Chunk& b) {
          return a.slice.dim != b.slice.dim         ? a.slice.dim < b.slice.dim
                 : a.slice.offset != b.slice.offset ? a.slice.offset < b.slice.offset
                                                    : a.first < b.first;
        });
        int64_t next = 0;
        for (const Chunk& c : chunks) {
          if (c.slice.dim >= 0) continue;
          TETRA_CHECK(c.first == next,
                      "[ckpt] {}: {} ({}) has overlapping or missing elements "
                      "at {}",
                      where, name, kind, next);
          next = c.first + c.count;
        }
        TETRA_CHECK(covered == numel,
                    "[ckpt] {}: the chunks of {} ({}) hold {} elements, its shape {} has {}", where,
                    name, kind, covered, shape_str(rec.shape), numel);
      }
      m.tensors[name] = std::move(rec);
    }
  } catch (const json::exception& e) {
    fail("[ckpt] {}: malformed manifest ({}); the checkpoint cannot be used", where, e.what());
  }
  return m;
}

std::vector<std::string> verify(const Manifest& m) {
  std::vector<std::string> problems;
  OpenFiles files(m.dir);
  for (const auto& [name, rec] : m.tensors) {
    for (const auto& [kind, chunks] : rec.chunks) {
      for (const Chunk& c : chunks) {
        try {
          read_chunk(files, c, name, kind);
        } catch (const Error& e) {
          problems.push_back(e.what());
        }
      }
    }
  }
  return problems;
}

std::vector<Source> sources(ParamStore& store, const float* m, const float* v, bool dp_replica,
                            bool slice_replica) {
  std::vector<Source> out;
  if (dp_replica) return out;
  const float* params = store.params().data();
  for (int k = 0; k < 3; ++k) {
    for (const OwnedSegment& s : store.owned()) {
      if (slice_replica && store.tensor(s.tensor).spec.slice.dim < 0) continue;
      const float* data = k == 0 ? params + s.param_pos : (k == 1 ? m : v) + s.state_pos;
      out.push_back(
          {kKinds[k], &store.tensor(s.tensor), int64_t(s.element), int64_t(s.count), data});
    }
  }
  return out;
}

void load(const Manifest& manifest, ParamStore& store, float* m, float* v, bool stage) {
  OpenFiles files(manifest.dir);
  // Host staging: the chunks' values in global order, then this rank's run of them, copied to
  // the store's device.
  std::vector<float> buf, run;
  for_each_held_run(manifest, store, m, v, stage,
                    [&](const std::string& name, const TensorRecord& rec, const ParamEntry& e,
                        const char* kind, int64_t first, int64_t count, float* out) {
                      if (count == 0) return;
                      const int64_t lo = e.global_index(first),
                                    hi = e.global_index(first + count - 1) + 1;
                      buf.assign(size_t(hi - lo), 0.0f);
                      read_range(files, name, rec, kind, lo, hi, buf.data());
                      run.resize(size_t(count));
                      for (int64_t k = 0; k < count; ++k)
                        run[size_t(k)] = buf[size_t(e.global_index(first + k) - lo)];
                      store.device().from_host(out, run.data(), run.size() * sizeof(float));
                    });
}

std::set<std::string> files_needed(const Manifest& manifest, ParamStore& store, bool stage) {
  std::set<std::string> files;
  for_each_held_run(manifest, store, nullptr, nullptr, stage,
                    [&](const std::string&, const TensorRecord& rec, const ParamEntry& e,
                        const char* kind, int64_t first, int64_t count, float*) {
                      if (count == 0) return;
                      const int64_t lo = e.global_index(first),
                                    hi = e.global_index(first + count - 1) + 1;
                      for_each_overlapping(rec, kind, lo, hi,
                                           [&](const Chunk& c, const PartMap&, int64_t, int64_t) {
                                             files.insert(c.file);
                                           });
                    });
  return files;
}

std::vector<float> read_global(const Manifest& manifest, const std::string& name,
                               const std::string& kind) {
  auto it = manifest.tensors.find(name);
  TETRA_CHECK(it != manifest.tensors.end(), "[ckpt] {} has no tensor '{}'", manifest.dir.string(),
              name);
  std::vector<float> out(size_t(shape_numel(it->second.shape)));
  OpenFiles files(manifest.dir);
  read_range(files, name, it->second, kind, 0, int64_t(out.size()), out.data());
  return out;
}

}  // namespace tetra::ckpt
