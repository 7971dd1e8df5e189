// tetra generate: sample text from a saved model (see docs/generate.md).
#include <omp.h>

#include <cstdio>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "cli/args.h"
#include "cli/commands.h"
#include "comm/communicator.h"
#include "core/config.h"
#include "core/error.h"
#include "data/text_check.h"
#include "data/tokenizer.h"
#include "model/generate.h"
#include "model/gpt_io.h"
#include "parallel/tensor_parallel.h"
#include "train/train_config.h"

namespace tetra::cli {

namespace {

constexpr const char* kGenerateUsage =
    "usage: tetra generate --model FILE.safetensors|DIR --tokenizer FILE.json|byte --prompt TEXT\n"
    "                      [--prompt TEXT ...] [--max-tokens 64] [--temperature 0.8]\n"
    "                      [--top-k 40] [--seed 1] [--threads N]\n"
    "                      [--special-tokens match|ordinary|refuse]\n"
    "                      [--config RUN_DIR/config.toml] [--model.KEY=VALUE ...]\n"
    "\n"
    "Continues each prompt with tokens sampled from the model and prints the text.\n"
    "--model DIR is a Hugging Face model directory (tetra export --hf writes one): the shape\n"
    "comes from its config.json and the tokenizer from its tokenizer.json (GPT-2 or Llama).\n"
    "Otherwise the shape comes from --config (the config.toml `tetra train` writes into run.dir)\n"
    "or is read off the tensor shapes, which cannot tell the head count: then --model.n_head=N\n"
    "is required (a Llama file cannot tell max_seq, rope_theta or norm_eps either).\n"
    "--model.KEY=VALUE overrides either (keys as in tetra train --help).\n";

}  // namespace

int generate_main(const Args& args) {
  ArgParser p(
      "generate", "tetra generate", kGenerateUsage,
      {{{"--model", ValueKind::String, "\"\"",
         "the weights, or a Hugging Face model directory (required)"},
        "FILE.safetensors|DIR"},
       {{"--tokenizer", ValueKind::String, "\"\"",
         "the tokenizer the model was trained with (required unless --model is a directory)"},
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
  const std::string& model_arg = p.s("--model");
  const bool model_dir = !model_arg.empty() && is_model_dir(model_arg);
  std::string tokenizer_spec = p.s("--tokenizer");
  if (model_dir && tokenizer_spec.empty()) {
    tokenizer_spec = (std::filesystem::path(model_arg) / "tokenizer.json").string();
  }
  const std::string& config_path = p.s("--config");
  const std::vector<std::string>& prompts = p.all("--prompt");
  const std::vector<std::string>& overrides = p.overrides();
  const int max_tokens = int(p.i("--max-tokens"));
  SamplingOptions sampling;
  sampling.temperature = float(p.f("--temperature"));
  sampling.top_k = int(p.i("--top-k"));
  sampling.seed = uint64_t(p.i("--seed"));
  const SpecialTokens special = parse_special_tokens(p.s("--special-tokens"), "generate");
  TETRA_CHECK(!model_arg.empty(),
              "[generate] give the weights: --model FILE.safetensors or --model MODEL_DIR");
  const std::string model_path = model_weights_path(model_arg, "generate");
  TETRA_CHECK(!tokenizer_spec.empty(),
              "[generate] give the tokenizer the model was trained with: --tokenizer "
              "DIR/tokenizer.json (written by tetra data prepare) or --tokenizer byte");
  TETRA_CHECK(!prompts.empty(), "[generate] give at least one --prompt TEXT");
  // Tokenizers read text as UTF-8; other bytes would be encoded as stray byte tokens the model
  // never saw in that place, as tetra data prepare refuses them in its inputs.
  for (size_t k = 0; k < prompts.size(); ++k) {
    const size_t bad = first_invalid_utf8(prompts[k]);
    TETRA_CHECK(bad == std::string_view::npos,
                "[generate] --prompt {} (of {}): byte {} (0x{:02x}) is not valid UTF-8; give the "
                "prompt as UTF-8 text (convert other encodings, e.g. iconv -f latin1 -t utf-8)",
                k + 1, prompts.size(), bad,
                bad == std::string_view::npos ? 0 : unsigned(uint8_t(prompts[k][bad])));
  }
  if (p.i("--threads") > 0) omp_set_num_threads(int(p.i("--threads")));

  // The weights are read once: their tensor shapes give (or check) the model shape, and the
  // model is loaded from the same bytes.
  const SafeTensorsFile weights = read_safetensors(model_path);
  const WeightsShape weights_has = weights_shape(weights, model_path, "generate");
  const Config config =
      model_config_for("generate", config_path, model_arg, weights_has, overrides);
  // Under tetra launch (or mpirun) the model is tensor-parallel over every rank: each holds its
  // heads, MLP channels and vocabulary rows, and every rank samples the same tokens from the
  // gathered logits (docs/tp.md).
  comm::Communicator world;
  if (launched_by_mpi()) world = comm::init_world(comm::CommOptions::from_config(config));
  const int tp = world.valid() ? world.size() : 1;
  const GptConfig shape = gpt_config_from(config, tp);
  const bool root = !world.valid() || world.rank() == 0;
  // The shape is held against the weights before anything else is compared with it, so that a
  // config.json that does not describe its weights is blamed, not the tokenizer.
  check_shape_matches_weights(shape, weights_has, model_path, config_path, model_arg, p.overrides(),
                              "generate");
  auto tokenizer = load_tokenizer(tokenizer_spec);
  TETRA_CHECK(tokenizer->vocab_size() <= size_t(shape.vocab_size),
              "[generate] the tokenizer {} has {} tokens but the model ({}) only {}; use the "
              "tokenizer the model was trained with",
              tokenizer_spec, tokenizer->vocab_size(), model_path, shape.vocab_size);

  Backend& backend = backend_for(parse_device_kind(config.s("run.device"), "run.device"));
  parallel::TensorParallel group(backend, world, false);
  ParamStore store(backend.device());
  Gpt model(backend, shape, store, 1, 1, Recompute::none, nullptr, &group);
  store.finalize({});
  comm::run_or_abort(world, [&] {
    load_safetensors_into(store, weights, model_path, shape.describe());
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
