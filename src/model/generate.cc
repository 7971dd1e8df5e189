#include "model/generate.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <string>
#include <unordered_map>

#include "core/error.h"
#include "core/philox.h"
#include "kernels/cpu/elementwise.h"
#include "kernels/cpu/layernorm.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/vec_math.h"

namespace tetra {

Generator::Generator(const Gpt& model) : config_(model.config()) {
  std::unordered_map<std::string, const float*> by_name;
  for (const Param& p : model.params()) by_name[p.view.name] = model.param_data() + p.view.offset;
  auto get = [&](const std::string& name) {
    auto it = by_name.find(name);
    TETRA_CHECK(it != by_name.end(), "[generate] internal: the model has no tensor '{}'", name);
    return it->second;
  };
  wte_ = get("transformer.wte.weight");
  wpe_ = get("transformer.wpe.weight");
  lnfw_ = get("transformer.ln_f.weight");
  lnfb_ = get("transformer.ln_f.bias");
  for (int l = 0; l < config_.n_layer; ++l) {
    auto at = [&](const char* rest) {
      return get("transformer.h." + std::to_string(l) + "." + rest);
    };
    layers_.push_back({at("ln_1.weight"), at("ln_1.bias"), at("attn.c_attn.weight"),
                       at("attn.c_attn.bias"), at("attn.c_proj.weight"), at("attn.c_proj.bias"),
                       at("ln_2.weight"), at("ln_2.bias"), at("mlp.c_fc.weight"),
                       at("mlp.c_fc.bias"), at("mlp.c_proj.weight"), at("mlp.c_proj.bias")});
  }
  const size_t C = size_t(config_.d_model), maxT = size_t(config_.max_seq);
  cache_.resize(size_t(config_.n_layer) * 2 * maxT * C);
  x_.resize(C);
  ln_.resize(C);
  qkv_.resize(3 * C);
  atty_.resize(C);
  fch_.resize(4 * C);
  scores_.resize(maxT);
  logits_.resize(size_t(config_.padded_vocab));
}

const float* Generator::step(int32_t token) {
  const int C = config_.d_model, NH = config_.n_head, hs = C / NH, maxT = config_.max_seq;
  TETRA_CHECK(pos_ < maxT,
              "[generate] the sequence reached model.max_seq={} tokens; use a shorter prompt or "
              "fewer --max-tokens",
              maxT);
  TETRA_CHECK(token >= 0 && token < config_.vocab_size,
              "[generate] token id {} is outside the model's vocabulary of {}; the tokenizer does "
              "not match the model",
              token, config_.vocab_size);
  const int t = pos_;
  for (int c = 0; c < C; ++c) x_[c] = wte_[size_t(token) * C + c] + wpe_[size_t(t) * C + c];
  const float scale = 1.0f / std::sqrt(float(hs));
  for (int l = 0; l < config_.n_layer; ++l) {
    const Layer& w = layers_[size_t(l)];
    float* keys = cache_.data() + size_t(l) * 2 * maxT * C;  // (maxT, C)
    float* values = keys + size_t(maxT) * C;                 // (maxT, C)
    cpu::layernorm_forward(ln_.data(), &mean_, &rstd_, x_.data(), w.ln1w, w.ln1b, 1, C);
    cpu::matmul_nt(qkv_.data(), ln_.data(), w.qkvw, w.qkvb, 1, 3 * C, C);
    std::memcpy(keys + size_t(t) * C, qkv_.data() + C, sizeof(float) * C);
    std::memcpy(values + size_t(t) * C, qkv_.data() + 2 * C, sizeof(float) * C);
    // Causal attention of this position over positions 0..t, head by head.
    for (int h = 0; h < NH; ++h) {
      const float* q = qkv_.data() + h * hs;
      float mx = -INFINITY;
      for (int j = 0; j <= t; ++j) {
        const float* k = keys + size_t(j) * C + h * hs;
        float dot = 0;
        for (int d = 0; d < hs; ++d) dot += q[d] * k[d];
        scores_[j] = dot * scale;
        mx = std::max(mx, scores_[j]);
      }
      float sum = 0;
      for (int j = 0; j <= t; ++j) {
        scores_[j] = cpu::exp_approx(scores_[j] - mx);
        sum += scores_[j];
      }
      float* y = atty_.data() + h * hs;
      std::fill(y, y + hs, 0.0f);
      for (int j = 0; j <= t; ++j) {
        const float p = scores_[j] / sum;
        const float* v = values + size_t(j) * C + h * hs;
        for (int d = 0; d < hs; ++d) y[d] += p * v[d];
      }
    }
    cpu::matmul_nt(x_.data(), atty_.data(), w.attprojw, w.attprojb, 1, C, C, /*accumulate=*/true);
    cpu::layernorm_forward(ln_.data(), &mean_, &rstd_, x_.data(), w.ln2w, w.ln2b, 1, C);
    cpu::matmul_nt(fch_.data(), ln_.data(), w.fcw, w.fcb, 1, 4 * C, C);
    cpu::gelu_forward(fch_.data(), fch_.data(), 4 * int64_t(C));
    cpu::matmul_nt(x_.data(), fch_.data(), w.fcprojw, w.fcprojb, 1, C, 4 * C, /*accumulate=*/true);
  }
  cpu::layernorm_forward(ln_.data(), &mean_, &rstd_, x_.data(), lnfw_, lnfb_, 1, C);
  cpu::matmul_nt<float>(logits_.data(), ln_.data(), wte_, nullptr, 1, config_.padded_vocab, C);
  ++pos_;
  return logits_.data();
}

const float* Generator::prefill(std::span<const int32_t> prompt) {
  TETRA_CHECK(!prompt.empty(), "[generate] the prompt is empty; give at least one token");
  reset();
  const float* logits = nullptr;
  for (int32_t token : prompt) logits = step(token);
  return logits;
}

int32_t sample_token(const float* logits, int V, const SamplingOptions& options, uint64_t draw) {
  TETRA_CHECK(options.temperature >= 0 && std::isfinite(options.temperature),
              "[generate] temperature must be >= 0 (got {})", options.temperature);
  TETRA_CHECK(options.top_k >= 0, "[generate] top-k must be >= 0 (got {})", options.top_k);
  // Candidates by descending logit, ties to the lower id, so the choice is deterministic.
  std::vector<int32_t> ids(static_cast<size_t>(V));
  std::iota(ids.begin(), ids.end(), 0);
  auto better = [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };
  const int k = options.top_k > 0 ? std::min(options.top_k, V) : V;
  if (options.temperature == 0 || k == 1) return *std::min_element(ids.begin(), ids.end(), better);
  std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), better);
  std::vector<double> p(static_cast<size_t>(k));
  const double top = logits[ids[0]];
  double sum = 0;
  for (int i = 0; i < k; ++i) {
    p[size_t(i)] = std::exp((double(logits[ids[size_t(i)]]) - top) / options.temperature);
    sum += p[size_t(i)];
  }
  const double u = double(Philox(options.seed, "generate/sample").uniform(draw)) * sum;
  double acc = 0;
  for (int i = 0; i < k; ++i) {
    acc += p[size_t(i)];
    if (u < acc) return ids[size_t(i)];
  }
  return ids[size_t(k) - 1];
}

std::vector<int32_t> generate(Generator& gen, std::span<const int32_t> prompt, int max_new,
                              const SamplingOptions& options, int32_t stop_token) {
  const int maxT = gen.config().max_seq;
  TETRA_CHECK(max_new >= 0, "[generate] --max-tokens must be >= 0 (got {})", max_new);
  TETRA_CHECK(int64_t(prompt.size()) + max_new <= maxT,
              "[generate] the prompt ({} tokens) plus --max-tokens {} exceeds the model's "
              "max_seq={}; lower --max-tokens to at most {} or shorten the prompt",
              prompt.size(), max_new, maxT, std::max<int64_t>(0, maxT - int64_t(prompt.size())));
  std::vector<int32_t> out;
  if (max_new == 0) return out;
  const float* logits = gen.prefill(prompt);
  const int V = gen.config().vocab_size;
  for (int i = 0; i < max_new; ++i) {
    int32_t next = sample_token(logits, V, options, uint64_t(gen.position()));
    out.push_back(next);
    if (next == stop_token || i + 1 == max_new) break;
    logits = gen.step(next);
  }
  return out;
}

}  // namespace tetra
