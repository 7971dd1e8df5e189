// tetra export --hf DIR: a model as a Hugging Face model directory (see docs/export.md).
#include <filesystem>
#include <string>
#include <vector>

#include "cli/args.h"
#include "cli/commands.h"
#include "core/config.h"
#include "core/error.h"
#include "core/log.h"
#include "data/tokenizer.h"
#include "model/gpt.h"
#include "model/gpt_io.h"
#include "train/train_config.h"

namespace tetra::cli {

namespace {

constexpr const char* kExportUsage =
    "usage: tetra export --hf DIR --model FILE.safetensors|DIR --tokenizer FILE.json|byte\n"
    "                    [--config RUN_DIR/config.toml] [--model.KEY=VALUE ...]\n"
    "\n"
    "Writes DIR as a Hugging Face model directory (GPT2LMHeadModel or LlamaForCausalLM):\n"
    "config.json, model.safetensors, tokenizer.json, tokenizer_config.json and\n"
    "generation_config.json. The shape comes from --config (the config.toml `tetra train`\n"
    "writes into run.dir), from the config.json of a model directory, or is read off the\n"
    "tensor shapes with --model.n_head=N. DIR must be new, empty or an earlier export, which is\n"
    "replaced as a whole once the new directory is complete.\n";

}  // namespace

int export_main(const Args& args) {
  ArgParser p(
      "export", "tetra export", kExportUsage,
      {{{"--hf", ValueKind::String, "\"\"", "the model directory to write (required)"}, "DIR"},
       {{"--model", ValueKind::String, "\"\"", "the weights, or a model directory (required)"},
        "FILE.safetensors|DIR"},
       {{"--tokenizer", ValueKind::String, "\"\"",
         "the tokenizer the model was trained with (required unless --model is a directory)"},
        "FILE.json|byte"},
       {{"--config", ValueKind::String, "\"\"", "the run's config.toml, for the model shape"},
        "FILE.toml"}});
  p.allow_overrides(train_config_schema(), "model.");
  if (!p.parse(args)) return 0;
  const std::string& out = p.s("--hf");
  const std::string& model_arg = p.s("--model");
  const std::string& config_path = p.s("--config");
  TETRA_CHECK(!out.empty(), "[export] give the folder to write: --hf DIR");
  TETRA_CHECK(!model_arg.empty(),
              "[export] give the weights: --model FILE.safetensors or --model MODEL_DIR");
  const bool model_dir = is_model_dir(model_arg);
  std::string tokenizer_spec = p.s("--tokenizer");
  if (model_dir && tokenizer_spec.empty()) {
    tokenizer_spec = (std::filesystem::path(model_arg) / "tokenizer.json").string();
  }
  TETRA_CHECK(!tokenizer_spec.empty(),
              "[export] give the tokenizer the model was trained with: --tokenizer "
              "DIR/tokenizer.json (written by tetra data prepare) or --tokenizer byte");
  // A target that would be refused costs nothing: it is checked before the weights are read.
  check_hf_model_dir_target(out, "export");
  const std::string weights_path = model_weights_path(model_arg, "export");

  // The weights are read once: their tensor shapes give (or check) the model shape, and the
  // model is loaded from the same bytes.
  const SafeTensorsFile weights = read_safetensors(weights_path);
  const WeightsShape weights_has = weights_shape(weights, weights_path, "export");
  const Config config =
      model_config_for("export", config_path, model_arg, weights_has, p.overrides());
  const GptConfig shape = gpt_config_from(config);
  // The shape is held against the weights before anything else is compared with it, so that a
  // config.json that does not describe its weights is blamed, not the tokenizer.
  check_shape_matches_weights(shape, weights_has, weights_path, config_path, model_arg,
                              p.overrides(), "export");
  const auto tokenizer = load_tokenizer(tokenizer_spec);
  TETRA_CHECK(tokenizer->vocab_size() <= size_t(shape.vocab_size),
              "[export] the tokenizer {} has {} tokens but the model ({}) only {}; use the "
              "tokenizer the model was trained with",
              tokenizer_spec, tokenizer->vocab_size(), weights_path, shape.vocab_size);

  // Loading checks every tensor's name, shape and finiteness; the file is then written from the
  // store in Hugging Face's names and layouts.
  ParamStore store;
  Gpt model(cpu_backend(), shape, store, 1, 1);
  store.finalize({});
  load_safetensors_into(store, weights, weights_path, shape.describe());
  const uint32_t eot = tokenizer->eot_token();
  save_hf_model_dir(
      out, shape, store_to_safetensors(store, store.params().data(), true),
      {tokenizer->to_json(2), tokenizer->decode(std::span<const uint32_t>(&eot, 1)), eot},
      "export");
  log_info("[export] wrote {} ({}, tokenizer of {} tokens, <|endoftext|> = {})", out,
           shape.describe(), tokenizer->vocab_size(), eot);
  return 0;
}

}  // namespace tetra::cli
