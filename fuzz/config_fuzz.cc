// TOML config reader and `--section.key=value` overrides on arbitrary bytes: either refused with
// tetra::Error, or a config whose every value lies in its key's range and whose to_toml() loads
// back to the same values. The schema has every kind of key and every form of range the train
// and plan schemas use (closed, open and unbounded ends, 32-bit default, choices with ""), under
// real key names; those schemas live in libraries the fuzzers do not link.
#include <fmt/format.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <type_traits>
#include <variant>
#include <vector>

#include "core/config.h"
#include "core/error.h"
#include "fuzz/fuzz_util.h"

namespace {

using tetra::ConfigSchema;
using tetra::ValueKind;

const ConfigSchema kSchema = {
    {"model.n_layer", ValueKind::Int, "4", "", "[1, 1024]"},
    {"train.steps", ValueKind::Int, "100", "", "[1, 1000000000000]"},
    {"train.seed", ValueKind::Int, "1337", "", "[0, inf)"},
    {"layout.zero", ValueKind::Int, "-1", "", "[-1, 3]"},
    {"parallel.dp", ValueKind::Int, "0", ""},
    {"optim.lr", ValueKind::Float, "6e-4", "", "(0, 1000]"},
    {"optim.beta1", ValueKind::Float, "0.9", "", "[0, 0.9999999]"},
    {"optim.grad_clip", ValueKind::Float, "1.0", "", "[0, inf)"},
    {"dist.timeout_s", ValueKind::Float, "300", ""},
    {"data.shuffle", ValueKind::Bool, "false", ""},
    {"run.dir", ValueKind::String, "\"runs/default\"", ""},
    {"optim.schedule", ValueKind::String, "\"cosine\"", "", "cosine | constant"},
    {"layout.schedule", ValueKind::String, "\"\"", "", "\"\" | gpipe | 1f1b | interleaved"},
};

// Every value of `c` lies in its key's range; checked through the same parser a user's text goes
// through, so a value Config stored but would refuse is a crash.
void require_in_range(const tetra::Config& c) {
  for (const auto& spec : kSchema) {
    const tetra::ConfigValue& v = c.at(spec.key);
    if (spec.kind == ValueKind::Float) {
      tetra::fuzz::require(std::isfinite(std::get<double>(v)), "floats are finite");
    }
    std::string text;
    std::visit(
        [&](const auto& x) {
          using T = std::decay_t<decltype(x)>;
          if constexpr (std::is_same_v<T, std::string>) {
            text = "\"" + x + "\"";  // parse_value strips one pair of quotes
          } else if constexpr (std::is_same_v<T, bool>) {
            text = x ? "true" : "false";
          } else {
            text = fmt::format("{}", x);
          }
        },
        v);
    try {
      tetra::fuzz::require(tetra::parse_value(spec, text, "") == v, "a value reads back as itself");
    } catch (const tetra::Error& e) {
      std::fprintf(stderr, "%s\n", e.what());
      tetra::fuzz::require(false, "a stored value is in its key's range");
    }
  }
}

// to_toml() (what a run writes as config.toml) loads back to the same values.
void require_round_trip(const tetra::Config& c) {
  const std::string saved = c.to_toml();
  try {
    const tetra::Config back = tetra::Config::parse(kSchema, saved, "<saved>", {});
    for (const auto& spec : kSchema) {
      tetra::fuzz::require(back.at(spec.key) == c.at(spec.key),
                           "to_toml() loads to the same values");
    }
  } catch (const tetra::Error& e) {
    std::fprintf(stderr, "%s\n%s\n", e.what(), saved.c_str());
    tetra::fuzz::require(false, "to_toml() loads");
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  tetra::fuzz::quiet_logs();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tetra;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto refused = [](const Error& e) {
    fuzz::require(std::string_view(e.what()).substr(0, 9) == "[config] ", "[config] prefix");
  };
  // As a TOML document.
  try {
    const Config c = Config::parse(kSchema, text, "<fuzz>", {});
    require_in_range(c);
    require_round_trip(c);
  } catch (const Error& e) {
    refused(e);
  }
  // As command-line overrides, one per line.
  std::vector<std::string> overrides;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string_view::npos) end = text.size();
    overrides.emplace_back(text.substr(start, end - start));
    start = end + 1;
  }
  try {
    const Config c = Config::from_overrides(kSchema, overrides);
    require_in_range(c);
    require_round_trip(c);
  } catch (const Error& e) {
    refused(e);
  }
  return 0;
}
