// The checkpoint layer on its own: what ranks of one layout write is read back by the ranks of
// another (tensor slices along either dimension, ZeRO shards of any count), every element exact,
// each reading only the files its part overlaps; a damaged or incomplete checkpoint is refused with
// what is wrong; old ones are pruned; the same shards kept in a memory store (ckpt/memory_store.h)
// load like a directory's.
#include "ckpt/checkpoint.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "ckpt/memory_store.h"
#include "ckpt/shard.h"
#include "core/error.h"

namespace tetra::ckpt {
namespace {

using json = nlohmann::json;

// Two tensors of one unit and one of another, each optionally sliced along `dim` into `parts`.
struct Layout {
  int slice_dim = -1, parts = 1, part = 0;  // "tensor parallel" slicing of the 2-D tensors
  int shards = 1, shard = 0;                // ZeRO-3-style sharding of everything
};

const Shape kA = {6, 10}, kB = {10}, kC = {4, 6};

// The value of element g of tensor `t` of kind `k`: distinct everywhere.
float value(int t, int k, int64_t g) { return float(t * 100000 + k * 10000 + g) * 0.5f; }

struct Rank {
  ParamStore store;
  std::vector<float> m, v;
  explicit Rank(const Layout& l) {
    auto spec = [&](const std::string& name, const Shape& shape) {
      ParamSpec s;
      s.name = name;
      s.shape = shape;
      if (shape.size() == 2 && l.slice_dim >= 0) {
        const int64_t n = shape[size_t(l.slice_dim)] / l.parts;
        s.slice = {l.slice_dim, n * l.part, n};
      }
      return s;
    };
    store.begin_unit("u0");
    store.add(spec("a", kA));
    store.add(spec("b", kB));
    store.end_unit();
    store.begin_unit("u1");
    store.add(spec("c", kC));
    store.end_unit();
    Sharding sh;
    sh.shards = l.shards;
    sh.index = l.shard;
    sh.params = sh.grads = sh.state = l.shards > 1;
    store.finalize(sh);
    m.assign(store.state_size(), 0.0f);
    v.assign(store.state_size(), 0.0f);
  }
  // Fills what this rank holds with the global values.
  void fill() {
    for (TensorId id = 0; id < 3; ++id) {
      const ParamEntry& e = store.tensor(id);
      const auto run = store.held(id);
      for (int64_t k = 0; k < run.count; ++k)
        run.data[k] = value(id, 0, e.global_index(run.first + k));
    }
    for (const OwnedSegment& s : store.owned()) {
      const ParamEntry& e = store.tensor(s.tensor);
      for (size_t k = 0; k < s.count; ++k) {
        const int64_t g = e.global_index(int64_t(s.element + k));
        m[s.state_pos + k] = value(s.tensor, 1, g);
        v[s.state_pos + k] = value(s.tensor, 2, g);
      }
    }
  }
  // Every element this rank holds equals the global value; returns the elements checked.
  int64_t check() {
    int64_t n = 0;
    for (TensorId id = 0; id < 3; ++id) {
      const ParamEntry& e = store.tensor(id);
      const auto run = store.held(id);
      for (int64_t k = 0; k < run.count; ++k, ++n) {
        EXPECT_EQ(run.data[k], value(id, 0, e.global_index(run.first + k))) << e.spec.name;
      }
    }
    for (const OwnedSegment& s : store.owned()) {
      const ParamEntry& e = store.tensor(s.tensor);
      for (size_t k = 0; k < s.count; ++k, n += 2) {
        const int64_t g = e.global_index(int64_t(s.element + k));
        EXPECT_EQ(m[s.state_pos + k], value(s.tensor, 1, g)) << e.spec.name;
        EXPECT_EQ(v[s.state_pos + k], value(s.tensor, 2, g)) << e.spec.name;
      }
    }
    return n;
  }
};

class Checkpoint : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("tetra_ckpt_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Every rank of `layouts` writes step `step`; returns the published directory.
  fs::path save(const std::vector<Layout>& layouts, int64_t step, int keep = 0) {
    std::vector<std::unique_ptr<Rank>> ranks;
    std::vector<std::unique_ptr<Writer>> writers;
    for (size_t r = 0; r < layouts.size(); ++r) {
      ranks.push_back(std::make_unique<Rank>(layouts[r]));
      ranks.back()->fill();
      WriterOptions o;
      o.dir = dir_;
      o.keep = keep;
      o.rank = int(r);
      o.world = int(layouts.size());
      o.nonce = "test";
      o.publish_timeout_s = 30;
      writers.push_back(std::make_unique<Writer>(o, nullptr));
    }
    for (size_t r = 0; r < layouts.size(); ++r) {
      Rank& k = *ranks[r];
      writers[r]->save(step, sources(k.store, k.m.data(), k.v.data(), false, layouts[r].part > 0),
                       {{"trainer", {{"step", step}}},
                        {"layout", {{"world", layouts.size()}}},
                        {"config", ""},
                        {"model", "test model"}},
                       {{"rank", r}});
    }
    for (auto& w : writers) w->wait();
    for (auto& w : writers) {
      for (const SaveReport& rep : w->take_reports()) EXPECT_EQ(rep.error, "");
    }
    return dir_ / checkpoint_name(step);
  }

  // Every rank of `layouts` loads `dir` and holds exactly the global values.
  void load_everywhere(const fs::path& dir, const std::vector<Layout>& layouts) {
    const Manifest m = Manifest::read(dir);
    int64_t checked = 0;
    for (const Layout& l : layouts) {
      Rank r(l);
      load(m, r.store, r.m.data(), r.v.data());
      checked += r.check();
    }
    EXPECT_GT(checked, 0);
  }

  fs::path dir_;
};

std::vector<Layout> tp(int dim, int parts) {
  std::vector<Layout> out;
  for (int p = 0; p < parts; ++p) out.push_back({dim, parts, p, 1, 0});
  return out;
}
std::vector<Layout> zero(int shards) {
  std::vector<Layout> out;
  for (int s = 0; s < shards; ++s) out.push_back({-1, 1, 0, shards, s});
  return out;
}

TEST_F(Checkpoint, AnyLayoutReadsWhatAnyOtherWrote) {
  const std::vector<std::vector<Layout>> layouts = {
      {Layout{}}, zero(2), zero(3), tp(0, 2), tp(1, 2)};
  int64_t step = 0;
  for (const auto& writer : layouts) {
    const fs::path dir = save(writer, ++step);
    const Manifest m = Manifest::read(dir);
    EXPECT_EQ(m.step, step);
    // Three kinds of every element, once: the checkpoint holds 12 bytes per parameter.
    EXPECT_EQ(m.bytes, 12u * uint64_t(shape_numel(kA) + shape_numel(kB) + shape_numel(kC)));
    EXPECT_TRUE(verify(m).empty());
    for (const auto& reader : layouts) load_everywhere(dir, reader);
    const std::vector<float> a = read_global(m, "a", "adam_v");
    for (int64_t g = 0; g < shape_numel(kA); ++g) ASSERT_EQ(a[size_t(g)], value(0, 2, g));
  }
  std::ifstream latest(dir_ / "latest");
  std::string name;
  latest >> name;
  EXPECT_EQ(name, checkpoint_name(step));
}

TEST_F(Checkpoint, KeepsTheNewestAndIgnoresUnfinishedSaves) {
  for (int64_t step : {2, 4, 6, 8}) save(zero(2), step, 2);
  fs::create_directories(dir_ / (checkpoint_name(10) + ".tmp-other"));
  const std::vector<fs::path> all = list_checkpoints(dir_);
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(all[0].filename(), checkpoint_name(8));
  EXPECT_EQ(all[1].filename(), checkpoint_name(6));
  // A new writer (rank 0) clears the temporary directory a crashed save left.
  WriterOptions o;
  o.dir = dir_;
  o.nonce = "mine";
  Writer w(o, nullptr);
  EXPECT_FALSE(fs::exists(dir_ / (checkpoint_name(10) + ".tmp-other")));
}

TEST_F(Checkpoint, DamageIsFoundAndNamed) {
  const fs::path dir = save(zero(2), 3);
  const fs::path file = dir / "rank-00001.safetensors";
  // A flipped byte in the data: verify and load name the file and the tensor.
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-3, std::ios::end);
    char c = 0;
    f.read(&c, 1);
    c ^= 0x10;
    f.seekp(-3, std::ios::end);
    f.write(&c, 1);
  }
  const Manifest m = Manifest::read(dir);
  const std::vector<std::string> problems = verify(m);
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_NE(problems[0].find("rank-00001.safetensors"), std::string::npos) << problems[0];
  EXPECT_NE(problems[0].find("fails its checksum"), std::string::npos) << problems[0];
  Rank r(Layout{});
  EXPECT_THROW(load(m, r.store, r.m.data(), r.v.data()), Error);
  // A truncated file is refused when the manifest is read.
  fs::resize_file(file, fs::file_size(file) - 8);
  try {
    Manifest::read(dir);
    FAIL() << "a truncated checkpoint was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("truncated"), std::string::npos) << e.what();
  }
}

TEST_F(Checkpoint, MalformedManifestsAreRefused) {
  const fs::path dir = save({Layout{}}, 1);
  const fs::path path = dir / "manifest.json";
  std::string good;
  {
    std::ifstream in(path);
    good.assign(std::istreambuf_iterator<char>(in), {});
  }
  auto refused = [&](const std::function<void(nlohmann::json&)>& edit, const std::string& what) {
    nlohmann::json j = nlohmann::json::parse(good);
    edit(j);
    std::ofstream(path) << j.dump();
    try {
      Manifest::read(dir);
      ADD_FAILURE() << "accepted: " << what;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  refused([](auto& j) { j["version"] = 99; }, "format version 1");
  refused([](auto& j) { j["tensors"]["a"]["chunks"]["param"][0]["file"] = "../x"; },
          "names the file");
  refused([](auto& j) { j["tensors"]["a"]["chunks"]["adam_m"][0]["count"] = 59; },
          "hold 59 elements");
  refused([](auto& j) { j["tensors"]["b"]["chunks"]["adam_v"][0]["first"] = 1; },
          "outside its part");
  refused([](auto& j) { j.erase("trainer"); }, "malformed manifest");
  // Each field's lower bound holds for non-negative values too (JSON reads them as unsigned): a
  // zero where at least one is needed never reaches a division.
  refused([](auto& j) { j["tensors"]["a"]["chunks"]["param"][0]["count"] = 0; },
          "'count' is 0, not an integer in [1, ");
  refused([](auto& j) { j["tensors"]["a"]["chunks"]["param"][0]["slice"]["parts"] = 0; },
          "'parts' is 0, not an integer in [1, ");
  refused(
      [](auto& j) {
        j["model_shape"] = {
            {"vocab_size", 64}, {"n_layer", 2}, {"n_head", 0}, {"d_model", 32}, {"max_seq", 16}};
      },
      "'n_head' is 0, not an integer in [1, ");
  refused([](auto& j) { j["step"] = -1; }, "'step' is -1, not an integer in [0, ");
  // A model with another tensor shape is refused by tensor.
  std::ofstream(path) << good;
  const Manifest m = Manifest::read(dir);
  ParamStore other;
  other.begin_unit("u");
  for (const auto& [name, shape] :
       std::vector<std::pair<std::string, Shape>>{{"a", {6, 11}}, {"b", kB}, {"c", kC}}) {
    ParamSpec s;
    s.name = name;
    s.shape = shape;
    other.add(s);
  }
  other.end_unit();
  other.finalize({});
  std::vector<float> mv(other.state_size());
  try {
    load(m, other, mv.data(), mv.data());
    FAIL() << "a mis-shaped tensor was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'a' has shape (6, 10) there but (6, 11)"),
              std::string::npos)
        << e.what();
  }
}

TEST(CheckpointNames, OnlyTheNamesCheckpointNameWritesParse) {
  for (int64_t step :
       {int64_t(0), int64_t(1), int64_t(120), int64_t(999'999'999), int64_t(1'000'000'000),
        int64_t(1'000'000'000'000), int64_t(999'999'999'999'999'999)}) {
    EXPECT_EQ(parse_checkpoint_name(checkpoint_name(step)).value_or(-1), step)
        << checkpoint_name(step);
  }
  for (const char* name :
       {"step-", "step-12", "step-00000012", "step-0000000012", "step-99999999999999999999",
        "step-1000000000000000000", "step-abc", "step-00000001a", "step--00000001",
        "step-+00000001", "step-000000001 ", " step-000000001", "Step-000000001",
        "step-000000001.tmp-0123456789abcdef", "step-000000001/", "latest", ""}) {
    EXPECT_FALSE(parse_checkpoint_name(name).has_value()) << "'" << name << "'";
  }
}

TEST_F(Checkpoint, StrayNamesAreNotedAndNeverStopASaveAListingOrAPrune) {
  // Names that look like checkpoints but are not tetra's, beside real ones.
  const std::vector<std::string> stray_dirs = {
      "step-99999999999999999999",
      "step-abc",
      "step-1.tmp-x",
      "step-0000000012",
      "step-000000010",  // a step's name with no manifest.json
      "step-000000007.tmp-a.b"};
  for (const std::string& d : stray_dirs) fs::create_directories(dir_ / d);
  std::ofstream(dir_ / "step-000000009") << "a file named like a step";
  std::ofstream(dir_ / "notes.txt") << "the user's own file";
  for (int64_t step : {2, 4, 6}) save({Layout{}}, step, 2);
  const DirScan scan = scan_checkpoint_dir(dir_);
  ASSERT_EQ(scan.published.size(), 2u);
  EXPECT_EQ(scan.published[0].step, 6);
  EXPECT_EQ(scan.published[1].step, 4);
  // Every stray step-* name is noted, none is removed; the user's file is not even noted.
  EXPECT_EQ(scan.ignored.size(), 7u);
  for (const std::string& d : stray_dirs) EXPECT_TRUE(fs::exists(dir_ / d)) << d;
  EXPECT_TRUE(fs::exists(dir_ / "step-000000009"));
  EXPECT_TRUE(fs::exists(dir_ / "notes.txt"));
  for (const std::string& note : scan.ignored) {
    EXPECT_NE(note.find("step-"), std::string::npos) << note;
    EXPECT_EQ(note.find("notes.txt"), std::string::npos) << note;
  }
  // A new writer clears unfinished saves of other nonces (only those).
  fs::create_directories(dir_ / (checkpoint_name(8) + ".tmp-0123456789abcdef"));
  {
    WriterOptions o;
    o.dir = dir_;
    o.nonce = "mine";
    Writer w(o, nullptr);
  }
  EXPECT_FALSE(fs::exists(dir_ / (checkpoint_name(8) + ".tmp-0123456789abcdef")));
  EXPECT_TRUE(fs::exists(dir_ / "step-1.tmp-x"));
  EXPECT_EQ(locate_checkpoints(dir_, "test").front(), dir_ / checkpoint_name(6));
}

TEST_F(Checkpoint, PublishingNeverReplacesWhatTetraDidNotWrite) {
  std::ofstream(dir_ / checkpoint_name(4)) << "not a checkpoint";
  WriterOptions o;
  o.dir = dir_;
  o.nonce = "test";
  o.async = false;
  Rank r(Layout{});
  r.fill();
  Writer w(o, nullptr);
  w.save(4, sources(r.store, r.m.data(), r.v.data(), false, false), {{"trainer", {{"step", 4}}}},
         {{"rank", 0}});
  const std::vector<SaveReport> reports = w.take_reports();
  ASSERT_EQ(reports.size(), 1u);
  EXPECT_NE(reports[0].error.find("exists and is not a checkpoint"), std::string::npos)
      << reports[0].error;
  std::ifstream in(dir_ / checkpoint_name(4));
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), {}), "not a checkpoint");
}

TEST_F(Checkpoint, APathIsACheckpointItsManifestOrACkptDirAndNothingElse) {
  const fs::path c = save({Layout{}}, 3);
  EXPECT_EQ(locate_checkpoints(c, "t"), std::vector<fs::path>{c});
  EXPECT_EQ(locate_checkpoints(c / "manifest.json", "t"), std::vector<fs::path>{c});
  EXPECT_EQ(locate_checkpoints(dir_, "t"), std::vector<fs::path>{c});
  auto refused = [&](const fs::path& p, const std::string& what) {
    try {
      locate_checkpoints(p, "ckpt.resume=" + p.string());
      ADD_FAILURE() << "accepted " << p;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
      EXPECT_EQ(std::string(e.what()).rfind("[ckpt] ckpt.resume=", 0), 0u) << e.what();
    }
  };
  refused(c / "rank-00000.safetensors", "is a file, not a checkpoint");
  refused(dir_ / "nowhere", "does not exist");
  fs::create_directories(dir_ / "empty");
  EXPECT_TRUE(locate_checkpoints(dir_ / "empty", "t").empty());
}

TEST_F(Checkpoint, AManifestMustHoldTheStepItsDirectoryIsNamedFor) {
  const fs::path c = save({Layout{}}, 3);
  const fs::path copy = dir_ / checkpoint_name(5);
  fs::copy(c, copy);
  try {
    Manifest::read(copy);
    FAIL() << "a checkpoint of step 3 was read as step 5";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("the manifest says step 3 but its directory is named "
                                         "for step 5"),
              std::string::npos)
        << e.what();
  }
  // Under a name that is not a step's (a copy kept aside), the manifest's step stands.
  fs::rename(copy, dir_ / "best");
  EXPECT_EQ(Manifest::read(dir_ / "best").step, 3);
}

TEST_F(Checkpoint, ARankReadsOnlyTheFilesItsPartOverlaps) {
  const Manifest z = Manifest::read(save(zero(2), 1));
  const auto needs = [](const Manifest& m, const Layout& l) {
    Rank r(l);
    return files_needed(m, r.store);
  };
  using Files = std::set<std::string>;
  // A shard reads its own writer's file; one rank holding everything reads both.
  EXPECT_EQ(needs(z, zero(2)[0]), Files{"rank-00000.safetensors"});
  EXPECT_EQ(needs(z, zero(2)[1]), Files{"rank-00001.safetensors"});
  EXPECT_EQ(needs(z, Layout{}), (Files{"rank-00000.safetensors", "rank-00001.safetensors"}));
  // Under tensor slicing the first part's file also holds the unsliced tensor (b) every part reads.
  const Manifest t = Manifest::read(save(tp(0, 2), 2));
  EXPECT_EQ(needs(t, tp(0, 2)[0]), Files{"rank-00000.safetensors"});
  EXPECT_EQ(needs(t, tp(0, 2)[1]), (Files{"rank-00000.safetensors", "rank-00001.safetensors"}));
}

TEST_F(Checkpoint, ShardsHeldInAMemoryStoreLoadUnderAnyLayout) {
  const MemoryStore store(MemoryStore::root_for(dir_ / "shm", dir_ / "ckpt"));
  EXPECT_EQ(store.root(), MemoryStore::root_for(dir_ / "shm", dir_ / "x" / ".." / "ckpt"))
      << "one store per ckpt.dir, however the path is spelled";
  const json header = {{"trainer", {{"step", 7}}},
                       {"layout", {{"world", 2}}},
                       {"config", ""},
                       {"model", "test model"}};
  std::vector<json> fragments;
  for (const Layout& l : zero(2)) {
    Rank r(l);
    r.fill();
    const std::vector<Source> parts = sources(r.store, r.m.data(), r.v.data(), false, false);
    const ShardLayout layout = ShardLayout::of(parts, 7);
    MemoryStore::Shard shard = store.create(l.shard, layout.file_bytes());
    layout.write_header(shard.data());
    for (size_t i = 0; i < parts.size(); ++i) {
      std::memcpy(shard.data() + layout.data_start + layout.parts[i].at * sizeof(float),
                  parts[i].data, size_t(parts[i].count) * sizeof(float));
    }
    fragments.push_back(layout.fragment(
        reinterpret_cast<const float*>(shard.data() + layout.data_start), l.shard, {}));
    store.put_header(7, header);
    shard.commit(7, fragments.back());
  }
  // A shard never committed leaves nothing behind.
  { const MemoryStore::Shard dropped = store.create(5, 64); }
  EXPECT_EQ(std::distance(fs::directory_iterator(store.root()), fs::directory_iterator()), 1);
  const std::vector<MemoryStore::Step> held = store.inventory();
  ASSERT_EQ(held.size(), 1u);
  EXPECT_EQ(held[0].step, 7);
  EXPECT_TRUE(held[0].header);
  ASSERT_EQ(held[0].shards.size(), 2u);
  EXPECT_EQ(store.fragment(7, 1), fragments[1]);
  EXPECT_EQ(store.header(7), header);

  const json text = merge_fragments(store.header(7), 7, fragments, nullptr);
  const Manifest m = Manifest::parse(text.dump(), store.step_dir(7), [&](const std::string& f) {
    return std::optional<uintmax_t>(fs::file_size(store.step_dir(7) / f));
  });
  EXPECT_TRUE(verify(m).empty());
  for (const auto& reader : {std::vector<Layout>{Layout{}}, zero(3), tp(1, 2)}) {
    int64_t checked = 0;
    for (const Layout& l : reader) {
      Rank r(l);
      load(m, r.store, r.m.data(), r.v.data());
      checked += r.check();
    }
    EXPECT_GT(checked, 0);
  }
  // A file the shards' sizes do not list is missing, whatever the directory holds.
  EXPECT_THROW(Manifest::parse(text.dump(), store.step_dir(7),
                               [](const std::string&) { return std::optional<uintmax_t>(); }),
               Error);

  // Dropped, the shards become spares a restarted job makes its files from, its pages kept.
  const uint64_t size = held[0].shards.at(0);
  store.drop_all_but(-1);
  EXPECT_TRUE(store.inventory().empty());
  {
    MemoryStore::Shard again = store.claim(3, size);
    ASSERT_TRUE(again.data());
    EXPECT_EQ(again.size(), size);
    EXPECT_FALSE(store.claim(3, size + 8).data()) << "a spare of another size was claimed";
    store.drop_spares();
    EXPECT_FALSE(store.claim(3, size).data()) << "a dropped spare was claimed";
    again.commit(9, json::object());
    EXPECT_EQ(store.inventory().at(0).shards.at(3), size);
  }
  // No room: refused naming what to change, never a SIGBUS later.
  try {
    store.create(0, uint64_t(1) << 60);
    FAIL() << "an exabyte shard was made";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("or save in memory less often (ckpt.memory_every)"),
              std::string::npos)
        << e.what();
  }
  store.remove();
  EXPECT_FALSE(fs::exists(store.root()));
}

}  // namespace
}  // namespace tetra::ckpt
