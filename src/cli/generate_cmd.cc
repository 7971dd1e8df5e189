// tetra generate: sample text from a saved model (see docs/generate.md).
#include <omp.h>

#include <cstdio>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "ckpt/safetensors.h"
#include "cli/args.h"
#include "cli/commands.h"
#include "comm/communicator.h"
#include "core/config.h"
#include "core/error.h"
#include "data/tokenizer.h"
#include "model/generate.h"
#include "model/gpt_io.h"
#include "parallel/tensor_parallel.h"
#include "train/train_config.h"

namespace tetra::cli {

namespace {

constexpr const char* kUsage =
    "usage: tetra generate --model FILE.safetensors --tokenizer FILE.json|byte --prompt TEXT\n"
    "                      [--prompt TEXT ...] [--max-tokens 64] [--temperature 0.8]\n"
    "                      [--top-k 40] [--seed 1] [--threads N]\n"
    "                      [--special-tokens match|ordinary|refuse]\n"
    "                      [--config RUN_DIR/config.toml] [--model.KEY=VALUE ...]\n"
    "\n"
    "Continues each prompt with tokens sampled from the model and prints the text.\n"
    "The model shape comes from --config (the config.toml `tetra train` writes into run.dir) or\n"
    "is read off the tensor shapes, which cannot tell the head count: then --model.n_head=N is\n"
    "required. --model.KEY=VALUE overrides either (keys as in tetra train --help).\n";

/** model.* overrides read off the tensor shapes: layers, width, vocabulary and positions. */
std::vector<std::string> shape_from_tensors(const std::string& path) {
  SafeTensorsFile f = read_safetensors(path);
  auto find = [&](const std::string& name) -> const SafeTensor& {
    for (const std::string& n : {name, "transformer." + name}) {
      auto it = f.tensors.find(n);
      if (it != f.tensors.end() && it->second.shape.size() == 2) return it->second;
    }
    fail("[generate] {}: no 2-D tensor '{}'; is this a GPT-2 safetensors file?", path, name);
  };
  const SafeTensor& wte = find("wte.weight");
  const SafeTensor& wpe = find("wpe.weight");
  std::set<int> layers;
  const std::regex block(R"(^(transformer\.)?h\.(\d+)\.)");
  for (const auto& [name, t] : f.tensors) {
    std::smatch m;
    if (std::regex_search(name, m, block)) layers.insert(std::stoi(m[2].str()));
  }
  TETRA_CHECK(!layers.empty(), "[generate] {}: no transformer blocks (h.N.*) found", path);
  return {"model.vocab_size=" + std::to_string(wte.shape[0]),
          "model.d_model=" + std::to_string(wte.shape[1]),
          "model.max_seq=" + std::to_string(wpe.shape[0]),
          "model.n_layer=" + std::to_string(layers.size())};
}

}  // namespace

int generate_main(const Args& args) {
  ArgParser p(
      "generate", "tetra generate", kUsage,
      {{{"--model", ValueKind::String, "\"\"", "the weights (required)"}, "FILE.safetensors"},
       {{"--tokenizer", ValueKind::String, "\"\"",
         "the tokenizer the model was trained with (required)"},
        "FILE.json|byte"},
       {.spec = {"--prompt", ValueKind::String, "\"\"", "text to continue (at least one)"},
        .metavar = "TEXT",
        .repeatable = true},
       {{"--config", ValueKind::String, "\"\"", "the run's config.toml, for the model shape"},
        "FILE.toml"},
       {{"--max-tokens", ValueKind::Int, "64", "tokens to add to each prompt", "[0, 65536]"}, "N"},
       {{"--temperature", ValueKind::Float, "0.8", "0 is greedy; higher is more random",
         "[0, 100]"},
        "T"},
       {{"--top-k", ValueKind::Int, "40", "draw among the K most likely tokens; 0 = all",
         "[0, 16777216]"},
        "K"},
       {{"--seed", ValueKind::Int, "1", "the same seed, model and prompt give the same text",
         "[0, inf)"},
        "S"},
       {{"--threads", ValueKind::Int, "0", "compute threads; 0 = all cores", "[0, 1024]"}, "N"},
       {{"--special-tokens", ValueKind::String, "\"match\"",
         "what the text of a special token such as <|endoftext|> in a prompt becomes: match = "
         "that token's id (as Hugging Face), ordinary = plain text, refuse = an error"},
        "MODE"}});
  p.allow_overrides(train_config_schema(), "model.");
  if (!p.parse(args)) return 0;
  const std::string& model_path = p.s("--model");
  const std::string& tokenizer_spec = p.s("--tokenizer");
  const std::string& config_path = p.s("--config");
  const std::vector<std::string>& prompts = p.all("--prompt");
  std::vector<std::string> overrides = p.overrides();
  const int max_tokens = int(p.i("--max-tokens"));
  SamplingOptions sampling;
  sampling.temperature = float(p.f("--temperature"));
  sampling.top_k = int(p.i("--top-k"));
  sampling.seed = uint64_t(p.i("--seed"));
  const SpecialTokens special = parse_special_tokens(p.s("--special-tokens"), "generate");
  TETRA_CHECK(!model_path.empty(), "[generate] give the weights: --model FILE.safetensors");
  TETRA_CHECK(!tokenizer_spec.empty(),
              "[generate] give the tokenizer the model was trained with: --tokenizer "
              "DIR/tokenizer.json (written by tetra data prepare) or --tokenizer byte");
  TETRA_CHECK(!prompts.empty(), "[generate] give at least one --prompt TEXT");
  if (p.i("--threads") > 0) omp_set_num_threads(int(p.i("--threads")));

  if (config_path.empty()) {
    std::vector<std::string> inferred = shape_from_tensors(model_path);
    overrides.insert(overrides.begin(), inferred.begin(), inferred.end());
  }
  Config config = Config::load(train_config_schema(), config_path, overrides);
  TETRA_CHECK(!config_path.empty() || config.is_set("model.n_head"),
              "[generate] the head count cannot be read off the weights; pass --config "
              "RUN_DIR/config.toml or --model.n_head=N");
  // Under tetra launch (or mpirun) the model is tensor-parallel over every rank: each holds its
  // heads, MLP channels and vocabulary rows, and every rank samples the same tokens from the
  // gathered logits (docs/tp.md).
  comm::Communicator world;
  if (launched_by_mpi()) world = comm::init_world(comm::CommOptions::from_config(config));
  const int tp = world.valid() ? world.size() : 1;
  const GptConfig shape = gpt_config_from(config, tp);
  const bool root = !world.valid() || world.rank() == 0;
  auto tokenizer = load_tokenizer(tokenizer_spec);
  TETRA_CHECK(tokenizer->vocab_size() <= size_t(shape.vocab_size),
              "[generate] the tokenizer has {} tokens but the model only {}; use the tokenizer "
              "the model was trained with",
              tokenizer->vocab_size(), shape.vocab_size);

  parallel::TensorParallel group(world, false);
  ParamStore store;
  Gpt model(shape, store, 1, 1, Recompute::none, nullptr, &group);
  store.finalize({});
  comm::run_or_abort(world, [&] {
    load_safetensors_into(store, model_path, shape.describe());
    Generator gen(model);
    const int32_t eot = int32_t(tokenizer->eot_token());
    for (const std::string& prompt : prompts) {
      if (special == SpecialTokens::refuse) {
        const auto m = find_added_token(*tokenizer, prompt);
        TETRA_CHECK(!m,
                    "[generate] the prompt '{}' holds the special token '{}' at byte {}, refused "
                    "by --special-tokens refuse; pass --special-tokens match to encode it as that "
                    "token or ordinary to encode it as text",
                    prompt, m ? m->token->content : "", m ? m->offset : 0);
      }
      std::vector<uint32_t> ids = special == SpecialTokens::match
                                      ? encode_matching_added_tokens(*tokenizer, prompt, 1)
                                      : tokenizer->encode(prompt);
      TETRA_CHECK(!ids.empty(), "[generate] the prompt '{}' encodes to no tokens", prompt);
      std::vector<int32_t> context(ids.begin(), ids.end());
      std::vector<int32_t> added = generate(gen, context, max_tokens, sampling, eot);
      for (int32_t t : added) {
        if (t != eot) ids.push_back(uint32_t(t));
      }
      if (!root) continue;
      std::printf("%s\n", tokenizer->decode(ids).c_str());
      if (prompts.size() > 1) std::printf("\n");
    }
  });
  return 0;
}

}  // namespace tetra::cli
