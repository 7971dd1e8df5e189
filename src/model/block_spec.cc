#include "model/block_spec.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "model/weights_shape.h"

namespace tetra {

namespace {

// GPT-2 (Hugging Face's GPT2LMHeadModel names): the output projections' weights drawn with the
// residual scaling 0.02/sqrt(2L), as GPT-2's paper does.
BlockSpec gpt2_block(const GptConfig& c, int layer) {
  BlockSpec b;
  b.prefix = "transformer.h." + std::to_string(layer);
  const std::string p = b.prefix + ".";
  const float residual_std = 0.02f / std::sqrt(2.0f * float(c.n_layer));
  b.ln1 = {p + "ln_1", false, kLayerNormEps};
  b.ln2 = {p + "ln_2", false, kLayerNormEps};
  AttentionSpec& a = b.attention;
  a.fused_qkv = true;
  a.qkv = {p + "attn.c_attn", true, 0.02f};
  a.out = {p + "attn.c_proj", true, residual_std};
  a.conv1d = true;
  auto gelu_mlp = [&](const std::string& q) {
    MlpSpec m;
    m.act = mlp_activation(c);
    m.hidden = c.ffn;
    m.in = {q + "c_fc", true, 0.02f};
    m.down = {q + "c_proj", true, residual_std};
    m.conv1d = true;
    return m;
  };
  b.moe = c.is_moe(layer);
  if (b.moe) {
    b.experts.router = p + "mlp.router";
    b.experts.experts = p + "mlp.experts";
    b.experts.expert = gelu_mlp("");
  } else {
    b.mlp = gelu_mlp(p + "mlp.");
  }
  return b;
}

// Llama (LlamaForCausalLM names; Mixtral's MixtralForCausalLM for a MoE block): every weight
// drawn with std 0.02.
BlockSpec llama_block(const GptConfig& c, int layer) {
  BlockSpec b;
  b.prefix = "model.layers." + std::to_string(layer);
  const std::string p = b.prefix + ".";
  b.ln1 = {p + "input_layernorm", true, c.norm_eps};
  b.ln2 = {p + "post_attention_layernorm", true, c.norm_eps};
  AttentionSpec& a = b.attention;
  a.qkv = {p + "self_attn.q_proj"};
  a.k = {p + "self_attn.k_proj"};
  a.v = {p + "self_attn.v_proj"};
  a.out = {p + "self_attn.o_proj"};
  a.rope = true;
  a.rope_theta = c.rope_theta;
  b.moe = c.is_moe(layer);
  MlpSpec m;
  m.act = mlp_activation(c);
  m.hidden = c.ffn;
  if (b.moe) {
    b.experts.router = p + "block_sparse_moe.gate";
    b.experts.experts = p + "block_sparse_moe.experts";
    m.in = {"w1"};
    m.up = {"w3"};
    m.down = {"w2"};
    b.experts.expert = m;
  } else {
    m.in = {p + "mlp.gate_proj"};
    m.up = {p + "mlp.up_proj"};
    m.down = {p + "mlp.down_proj"};
    b.mlp = m;
  }
  return b;
}

}  // namespace

Activation mlp_activation(const GptConfig& c) {
  return c.llama() ? Activation::swiglu : Activation::gelu;
}

BlockSpec block_spec(const GptConfig& c, int layer) {
  return c.llama() ? llama_block(c, layer) : gpt2_block(c, layer);
}

RootSpec root_spec(const GptConfig& c) {
  if (!c.llama()) {
    return {"transformer.wte.weight",
            "transformer.wpe.weight",
            {"transformer.ln_f", false, kLayerNormEps},
            ""};
  }
  return {kLlamaEmbedding, "", {"model.norm", true, c.norm_eps}, c.tie_embeddings ? "" : kLmHead};
}

std::vector<std::string> model_tensor_names(const GptConfig& c) {
  std::vector<std::string> names;
  auto linear = [&](const LinearSpec& l, const std::string& prefix = "") {
    names.push_back(prefix + l.name + ".weight");
    if (l.bias) names.push_back(prefix + l.name + ".bias");
  };
  auto norm = [&](const NormSpec& n) {
    names.push_back(n.name + ".weight");
    if (!n.rms) names.push_back(n.name + ".bias");
  };
  auto mlp = [&](const MlpSpec& m, const std::string& prefix = "") {
    linear(m.in, prefix);
    if (m.act == Activation::swiglu) linear(m.up, prefix);
    linear(m.down, prefix);
  };
  for (int l = 0; l < c.n_layer; ++l) {
    const BlockSpec b = block_spec(c, l);
    norm(b.ln1);
    norm(b.ln2);
    linear(b.attention.qkv);
    if (!b.attention.fused_qkv) {
      linear(b.attention.k);
      linear(b.attention.v);
    }
    linear(b.attention.out);
    if (!b.moe) {
      mlp(b.mlp);
      continue;
    }
    names.push_back(b.experts.router + ".weight");
    for (int e = 0; e < c.moe.experts; ++e) {
      mlp(b.experts.expert, b.experts.experts + "." + std::to_string(e) + ".");
    }
  }
  const RootSpec r = root_spec(c);
  for (const std::string& n : {r.wte, r.wpe, r.lm_head}) {
    if (!n.empty()) names.push_back(n);
  }
  norm(r.final_norm);
  return names;
}

ParamSpec weight_spec(const LinearSpec& l, int64_t out, int64_t in, bool conv1d, Slice slice) {
  ParamSpec s;
  s.name = l.name + ".weight";
  s.shape = {out, in};
  s.decay = true;
  s.file.transposed = conv1d;
  s.init = {ParamInit::Kind::normal, l.init_std, -1};
  s.slice = slice;
  return s;
}

ParamSpec bias_spec(const LinearSpec& l, int64_t out, Slice slice) {
  ParamSpec s;
  s.name = l.name + ".bias";
  s.shape = {out};
  s.init.kind = ParamInit::Kind::zeros;
  s.slice = slice;
  return s;
}

ParamSpec norm_weight_spec(const NormSpec& n, int64_t C) {
  ParamSpec s;
  s.name = n.name + ".weight";
  s.shape = {C};
  s.init.kind = ParamInit::Kind::ones;
  return s;
}

std::string profile_role(const std::string& name) {
  std::string role;
  bool after_block = false;
  size_t start = 0;
  while (start <= name.size()) {
    const size_t end = std::min(name.find('.', start), name.size());
    const std::string part = name.substr(start, end - start);
    const bool number = !part.empty() && part.find_first_not_of("0123456789") == std::string::npos;
    if (number) {
      after_block = true;
    } else if (after_block) {
      role += (role.empty() ? "" : ".") + part;
    }
    start = end + 1;
  }
  return role.empty() ? name : role;
}

ParamSpec norm_bias_spec(const NormSpec& n, int64_t C) {
  ParamSpec s;
  s.name = n.name + ".bias";
  s.shape = {C};
  s.init.kind = ParamInit::Kind::zeros;
  return s;
}

}  // namespace tetra
