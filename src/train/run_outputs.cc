#include "train/run_outputs.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/log.h"
#include "core/paths.h"
#include "data/token_shard.h"
#include "data/tokenizer.h"
#include "model/gpt_io.h"

namespace tetra {

namespace fs = std::filesystem;

namespace {

// A directory the run can create files in, proven by creating one.
void check_writable_dir(const fs::path& dir, const std::string& key, const std::string& value) {
  const fs::path probe = dir / fmt::format(".tetra-write-probe-{}", ::getpid());
  int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  TETRA_CHECK(fd >= 0, "[train] {}={}: cannot create files in {} ({}); choose a writable place",
              key, value, dir.string(), std::strerror(errno));
  ::close(fd);
  ::unlink(probe.c_str());
}

// A directory (created if missing) that the run can create files in.
void prepare_dir(const fs::path& dir, const std::string& key, const std::string& value) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  TETRA_CHECK(!ec && fs::is_directory(dir),
              "[train] {}={}: cannot create the directory {} ({}); choose a writable place", key,
              value, dir.string(), ec ? ec.message() : "a file of that name exists");
  check_writable_dir(dir, key, value);
}

// An output file path: not a directory, in a writable directory (created if missing).
void prepare_output_file(const std::string& key, const std::string& value) {
  if (value.empty()) return;
  const fs::path p(value);
  std::error_code ec;
  const std::string model_dir_hint =
      key == "save.final"
          ? fmt::format(", or {}/ (a trailing slash) to write a Hugging Face model directory",
                        value)
          : "";
  TETRA_CHECK(!fs::is_directory(p, ec),
              "[train] {}={} is a directory; give a file path such as {}/model.safetensors{}", key,
              value, value, model_dir_hint);
  prepare_dir(p.parent_path().empty() ? fs::path(".") : p.parent_path(), key, value);
}

// Whether `name` is a file the run itself writes in run.dir (report.cc, run_outputs.cc).
bool is_run_dir_file(const std::string& name) {
  for (const char* own : {"config.toml", "metrics.jsonl", "profile.json", "plan_vs_measured.json",
                          "goodput.json", "audit.json", ".tetra.lock", "flight"}) {
    if (name == own) return true;
  }
  return name.rfind("metrics.jsonl.", 0) == 0 || name.rfind("trace-rank-", 0) == 0;
}

// An output (save.final, a debug dump) may not replace what this run reads or writes itself: a
// checkpoint (or anything under ckpt.dir, which the writer prunes), a file of run.dir's, the
// training data or its tokenizer, another output. Refused before anything is written.
void check_not_clobbering(const TrainOptions& opt, const TokenDataset& train,
                          const std::string& key, const std::string& value,
                          const std::vector<std::pair<std::string, std::string>>& others) {
  if (value.empty()) return;
  const fs::path p(value);
  TETRA_CHECK(opt.ckpt.dir.empty() || !is_within(p, opt.ckpt.dir),
              "[train] {}={} is inside ckpt.dir={}, whose checkpoints it would overwrite (and "
              "which ckpt.keep prunes); write it outside ckpt.dir",
              key, value, opt.ckpt.dir);
  std::error_code ec;
  const fs::path parent = p.parent_path().empty() ? fs::path(".") : p.parent_path();
  TETRA_CHECK(!(fs::equivalent(parent, opt.run.dir, ec) && is_run_dir_file(p.filename())),
              "[train] {}={} would replace {}, which this run writes in run.dir={}; choose "
              "another name (model.safetensors, for instance)",
              key, value, p.filename().string(), opt.run.dir);
  std::vector<std::string> inputs;
  for (const auto& shard : train.shards()) inputs.push_back(shard->path());
  if (!train.tokenizer_path().empty()) inputs.push_back(train.tokenizer_path());
  if (!opt.init_from.empty() && key != "save.final") inputs.push_back(opt.init_from);
  for (const std::string& input : inputs) {
    TETRA_CHECK(!fs::equivalent(p, input, ec),
                "[train] {}={} is {}, which this run reads; write it elsewhere", key, value, input);
  }
  for (const auto& [other_key, other] : others) {
    TETRA_CHECK(other.empty() || fs::weakly_canonical(fs::absolute(p), ec) !=
                                     fs::weakly_canonical(fs::absolute(other), ec),
                "[train] {}={} and {}={} name the same file, so one would replace the other; "
                "give each its own path",
                key, value, other_key, other);
  }
}

}  // namespace

RunOutputs::RunOutputs(const TrainOptions& opt, RunLayout& layout, const TrainData& data)
    : opt_(opt), layout_(layout), data_(data) {
  if (!layout.is_root()) return;
  // The other ranks are this job: only rank 0 writes run.dir, and every rank's checkpoint files
  // go through rank 0's publishing. A job that dies leaves no lock (the kernel drops it), so
  // tetra launch's restarts and verify-resume's successive runs take it again.
  prepare_dir(opt.run.dir, "run.dir", opt.run.dir);
  run_lock_ = DirLock::acquire(opt.run.dir, "run.dir=" + opt.run.dir, "train");
  if (!opt.ckpt.dir.empty()) {
    prepare_dir(opt.ckpt.dir, "ckpt.dir", opt.ckpt.dir);
    // One lock per directory: flock refuses a second descriptor of the same process too.
    std::error_code ec;
    if (!fs::equivalent(opt.ckpt.dir, opt.run.dir, ec)) {
      ckpt_lock_ = DirLock::acquire(opt.ckpt.dir, "ckpt.dir=" + opt.ckpt.dir, "train");
    }
  }
  check_not_clobbering(opt, data.train(), "save.final", opt.outputs.save_final,
                       {{"debug.dump_grads", opt.outputs.dump_grads},
                        {"debug.dump_logits", opt.outputs.dump_logits}});
  check_not_clobbering(opt, data.train(), "debug.dump_grads", opt.outputs.dump_grads,
                       {{"debug.dump_logits", opt.outputs.dump_logits}});
  check_not_clobbering(opt, data.train(), "debug.dump_logits", opt.outputs.dump_logits, {});
  if (!is_model_dir_target(opt.outputs.save_final))
    prepare_output_file("save.final", opt.outputs.save_final);
  prepare_output_file("debug.dump_grads", opt.outputs.dump_grads);
  prepare_output_file("debug.dump_logits", opt.outputs.dump_logits);
  if (!opt.outputs.dump_routes.empty())
    prepare_dir(opt.outputs.dump_routes, "debug.dump_routes", opt.outputs.dump_routes);
  if (is_model_dir_target(opt.outputs.save_final)) {
    // A model directory holds the tokenizer: the one the training data was prepared with.
    TETRA_CHECK(!data.train().tokenizer_path().empty(),
                "[train] save.final={} is a model directory, which holds the tokenizer, but "
                "data.train has no manifest.json naming one (its shards were not written by tetra "
                "data prepare); save to a .safetensors file and run tetra export --hf DIR --model "
                "FILE --tokenizer TOKENIZER",
                opt.outputs.save_final);
    load_tokenizer(data.train().tokenizer_path());
    check_hf_model_dir_target(opt.outputs.save_final, "train");
  }
}

void RunOutputs::dump_logits(Gpt& model, const Batch& batch) {
  const GptConfig& c = opt_.model;
  const int64_t rows = int64_t(opt_.batch.micro_batch) * opt_.batch.seq_len;
  Device& device = model.backend().device();
  Buffer<float> all(size_t(rows) * size_t(c.padded_vocab), {}, device);
  layout_.tp().gather_columns(model.forward_logits(batch.inputs.data()), all.data(), rows,
                              c.local_vocab());
  if (!layout_.is_root()) return;
  // Without the padding columns, to the host.
  Buffer<float> real(size_t(rows) * size_t(c.vocab_size), {}, device);
  model.backend().f32().copy_rows(real.data(), c.vocab_size, all.data(), c.padded_vocab, rows,
                                  c.vocab_size);
  std::vector<float> logits(real.size());
  device.to_host(logits.data(), real.data(), real.bytes());
  SafeTensorsFile f;
  f.tensors["logits"] =
      safetensor_f32({opt_.batch.micro_batch, opt_.batch.seq_len, c.vocab_size}, logits.data());
  write_safetensors(opt_.outputs.dump_logits, f);
}

void RunOutputs::dump_grads(ParamStore& store, const Gpt& model) {
  SafeTensorsFile grads = gather(store, model, store.grads().data(), false);
  if (layout_.is_root()) write_safetensors(opt_.outputs.dump_grads, grads);
}

void RunOutputs::save_final(ParamStore& store, const Gpt& model, parallel::DataParallel& zero) {
  const Buffer<float> params = zero.full_params();  // collective under ZeRO-3
  SafeTensorsFile file = gather(store, model, params.data(), true);
  if (!layout_.is_root()) return;
  if (is_model_dir_target(opt_.outputs.save_final)) {
    const auto tok = load_tokenizer(data_.train().tokenizer_path());
    const uint32_t eot = tok->eot_token();
    save_hf_model_dir(opt_.outputs.save_final, opt_.model, file,
                      {tok->to_json(2), tok->decode(std::span<const uint32_t>(&eot, 1)), eot},
                      "train");
    log_info("[train] saved the model directory {}", opt_.outputs.save_final);
    return;
  }
  write_safetensors(opt_.outputs.save_final, file);
  log_info("[train] saved weights to {}", opt_.outputs.save_final);
}

SafeTensorsFile RunOutputs::gather(ParamStore& store, const Gpt& model, const float* flat,
                                   bool check_finite) {
  // Collective over the tp group: its slices are assembled into the global tensors. The head's
  // copy of the tied wte is the first stage's wte, which that stage writes.
  SafeTensorsFile file =
      store_to_safetensors(store, flat, check_finite, &layout_.tp(), model.tied_wte_copy());
  const bool first = layout_.dp_rank() == 0 && layout_.tp().rank() == 0;
  // Under expert parallelism the first ep group (dp ranks 0 .. ep-1) holds every expert once:
  // its members send theirs to dp rank 0, then each stage's dp rank 0 sends its part to stage 0.
  const comm::Communicator& edp = layout_.edp();
  if (opt_.model.ep > 1 && layout_.tp().rank() == 0 && edp.valid() && edp.rank() == 0) {
    // An expert's tensors are those of the store's expert units (whatever the family names them).
    gather_to_first(layout_.mesh()->ep(), file, [&store](const std::string& name) {
      const TensorId id = store.find(name);
      return id >= 0 && store.units()[size_t(store.tensor(id).unit)].group == ShardGroup::expert;
    });
  }
  if (layout_.pp_size() > 1 && first) {
    gather_to_first(layout_.pp(), file, [](const std::string&) { return true; });
  }
  return file;
}

void RunOutputs::gather_to_first(const comm::Communicator& group, SafeTensorsFile& file,
                                 const std::function<bool(const std::string&)>& sent) {
  constexpr int kTag = 3;  // apart from the executor's activation and gradient tags
  auto bytes = [](auto* p, size_t n) { return std::span(reinterpret_cast<std::byte*>(p), n); };
  if (group.rank() > 0) {
    // A header naming each tensor with its shape and size, then their values back to back.
    nlohmann::json header = nlohmann::json::array();
    std::vector<uint8_t> values;
    for (const auto& [name, t] : file.tensors) {
      if (!sent(name)) continue;
      header.push_back({name, t.shape, t.bytes.size()});
      values.insert(values.end(), t.bytes.begin(), t.bytes.end());
    }
    std::string text = header.dump();
    int64_t sizes[2] = {int64_t(text.size()), int64_t(values.size())};
    group.send(std::span<const std::byte>(bytes(sizes, sizeof sizes)), 0, kTag).wait();
    group.send(std::span<const std::byte>(bytes(text.data(), text.size())), 0, kTag).wait();
    group.send(std::span<const std::byte>(bytes(values.data(), values.size())), 0, kTag).wait();
    return;
  }
  for (int src = 1; src < group.size(); ++src) {
    int64_t sizes[2] = {0, 0};
    group.recv(bytes(sizes, sizeof sizes), src, kTag).wait();
    std::string text(static_cast<size_t>(sizes[0]), '\0');
    std::vector<uint8_t> values(static_cast<size_t>(sizes[1]));
    group.recv(bytes(text.data(), text.size()), src, kTag).wait();
    group.recv(bytes(values.data(), values.size()), src, kTag).wait();
    size_t at = 0;
    for (const nlohmann::json& t : nlohmann::json::parse(text)) {
      SafeTensor& out = file.tensors[t[0].get<std::string>()];
      out.shape = t[1].get<Shape>();
      const size_t n = t[2].get<size_t>();
      out.bytes.assign(values.begin() + ptrdiff_t(at), values.begin() + ptrdiff_t(at + n));
      at += n;
    }
  }
}

}  // namespace tetra
