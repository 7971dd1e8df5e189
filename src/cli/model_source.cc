// Where `tetra generate` and `tetra export` get the model shape (see commands.h).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <string>
#include <vector>

#include "cli/commands.h"
#include "core/error.h"
#include "core/log.h"
#include "train/train_config.h"

namespace tetra::cli {

Config model_config_for(const std::string& module, const std::string& config_path,
                        const std::string& model_arg, const WeightsShape& weights,
                        std::vector<std::string> overrides) {
  const bool model_dir = is_model_dir(model_arg);
  const bool bare = config_path.empty() && !model_dir;
  if (config_path.empty()) {
    const std::vector<std::string> inferred =
        model_dir ? model_dir_overrides(model_arg, module) : weights_shape_overrides(weights);
    overrides.insert(overrides.begin(), inferred.begin(), inferred.end());
  }
  Config config = Config::load(train_config_schema(), config_path, overrides);
  TETRA_CHECK(!bare || config.is_set("model.n_head"),
              "[{}] the head count cannot be read off the weights; pass --config "
              "RUN_DIR/config.toml or --model.n_head=N",
              module);
  if (!bare || !weights.llama) return config;
  // A bare Llama file: k_proj's rows are n_kv_head heads of d_model / n_head channels, so the
  // head count gives the key/value heads; what no tensor holds is said, not guessed silently.
  if (!config.is_set("model.n_kv_head")) {
    if (auto kv = llama_kv_heads_override(weights, config.i("model.n_head"))) {
      overrides.insert(overrides.begin(), *kv);
      config = Config::load(train_config_schema(), config_path, overrides);
    }
  }
  std::vector<std::string> assumed;
  if (!config.is_set("model.max_seq")) {
    assumed.push_back(fmt::format("model.max_seq={}", config.i("model.max_seq")));
  }
  for (const char* key : {"model.rope_theta", "model.norm_eps"}) {
    if (!config.is_set(key)) assumed.push_back(fmt::format("{}={}", key, config.f(key)));
  }
  if (!assumed.empty()) {
    log_warn(
        "[{}] {} is a bare Llama weights file: its tensors do not hold {}; using the defaults "
        "{} (set them with --model.KEY=VALUE, or give --config RUN_DIR/config.toml or the "
        "model directory, whose config.json has them)",
        module, model_arg, "the longest sequence, RoPE's base or RMSNorm's epsilon",
        fmt::join(assumed, ", "));
  }
  return config;
}

}  // namespace tetra::cli
