#include "model/gpt.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>

#include "core/error.h"

namespace tetra {

namespace {

// The family's dense block and a MoE block (a dense one in a dense model): the shapes of buffers
// that every block of the kind shares.
BlockSpec dense_block(const GptConfig& c) {
  GptConfig dense = c;
  dense.moe = MoeConfig{};
  return block_spec(dense, 0);
}
BlockSpec moe_block(const GptConfig& c) {
  return c.moe.experts > 0 ? block_spec(c, c.moe.every - 1) : dense_block(c);
}

}  // namespace

template <typename F>
GptT<F>::GptT(Backend& backend, const GptConfig& config, ParamStoreT<F>& store, int B, int T,
              Recompute r, MemoryLedger* ledger, parallel::TensorParallel* tp, GptPart part,
              parallel::ExpertParallel* ep, parallel::ContextAttention<F>* cp)
    : backend_(backend),
      k_(backend.kernels<F>()),
      config_(config),
      store_(store),
      B_(B),
      T_(T),
      recompute_(r),
      own_tp_(backend),
      tp_(tp ? tp : &own_tp_),
      own_ep_(backend),
      ep_(ep ? ep : &own_ep_),
      cp_(cp && cp->cp() > 1 ? cp : nullptr),
      part_(std::move(part)) {
  Device& device = backend.device();
  TETRA_CHECK(&store.device() == &device && &tp_->backend() == &backend,
              "[model] internal: the parameter store and the tensor-parallel group must live on "
              "the model's backend");
  TETRA_CHECK(config.tp == tp_->size() && config.sequence_parallel == tp_->sequence_parallel(),
              "[model] internal: a model shaped for tp={} (sequence parallel {}) on a group of {} "
              "(sequence parallel {})",
              config.tp, config.sequence_parallel, tp_->size(), tp_->sequence_parallel());
  TETRA_CHECK(config.ep == ep_->size() && &ep_->backend() == &backend,
              "[model] internal: a model shaped for ep={} on an expert-parallel group of {}",
              config.ep, ep_->size());
  TETRA_CHECK(B > 0, "[model] micro-batch must be positive (got {})", B);
  TETRA_CHECK(!cp_ || (&cp_->backend() == &backend && r != Recompute::selective && T % 2 == 0 &&
                       config.moe.experts == 0),
              "[model] internal: context parallelism with recompute {}, {} local tokens, {} "
              "experts or on another backend",
              int(r), T, config.moe.experts);
  const int whole_T = T * (cp_ ? cp_->cp() : 1);  // under context parallelism T is a share
  TETRA_CHECK(T > 0 && whole_T <= config.max_seq,
              "[model] sequence length {} must be in 1..model.max_seq={}; raise model.max_seq or "
              "lower train.seq_len",
              whole_T, config.max_seq);
  TETRA_CHECK(
      !config.sequence_parallel || (int64_t(B) * T) % config.tp == 0,
      "[model] tp.sequence_parallel splits the B*T = {}*{} = {} token rows of a micro-batch "
      "over parallel.tp={} ranks, which does not divide them; change train.micro_batch or "
      "train.seq_len",
      B, T, int64_t(B) * T, config.tp);
  const int L = config.n_layer;
  if (part_.chunks.empty()) part_.chunks.push_back({0, L, 1});
  for (size_t c = 0; c < part_.chunks.size(); ++c) {
    const GptPart::Chunk& k = part_.chunks[c];
    TETRA_CHECK(k.first >= 0 && k.first < k.end && k.end <= L && k.slots >= 1 &&
                    (c == 0 || k.first >= part_.chunks[c - 1].end),
                "[model] internal: chunk {} holds layers [{}, {}) with {} slots of a {}-layer "
                "model",
                c, k.first, k.end, k.slots, L);
  }
  attention_ = AttentionSizes::of(k_, config, B, T, cp_);
  if (config.bf16) reserve_bf16(ledger);
  weight_grads_ = std::make_unique<WeightGrads<F>>(k_, store.device(),
                                                   MemTag{ledger, MemCategory::activations});
  const parallel::LayerEnv<F> env{store, *tp_, bf16_.get(), cp_, weight_grads_.get()};
  register_modules(env);
  allocate_activations(ledger);
  allocate_temporaries(ledger);
}

// Mixed precision: scratch for the bf16 copies of the largest product's operands.
template <typename F>
void GptT<F>::reserve_bf16(MemoryLedger* ledger) {
  const GptConfig& config = config_;
  const int B = B_, T = T_;
  const std::string unsupported = backend_.bf16_unsupported();
  TETRA_CHECK(unsupported.empty(), "[model] {}", unsupported);
  // The largest product's operands: an MLP product reads a (BT,4C/tp) activation or gradient
  // with a weight or a (BT,C) one; the head's backward reads the (BT,Vp/tp) logit gradient.
  // Attention's own bf16 copies (the backend's count; on the CPU q, k and v, or v and dy, with
  // the probabilities) can be larger at long T.
  const size_t BT = size_t(B) * T, C = size_t(config.d_model);
  const size_t H = size_t(config.local_hidden()), V = size_t(config.local_vocab());
  // A MoE block's expert products read up to all its expert rows R with an (ffn,C) weight.
  const size_t R = config.moe.experts > 0 ? size_t(MoeShape::of(config, B, T).expert_rows) : 0;
  const size_t He = size_t(config.ffn);
  const size_t elements =
      std::max({BT * H + std::max(H, BT) * C, BT * V + std::max(BT, V) * C,
                R * He + std::max(He, R) * C, k_.attention_bf16_elements(config.attention(B, T))});
  bf16_ = std::make_unique<Bf16Operands>(backend_.device(), elements + 32,
                                         MemTag{ledger, MemCategory::temporaries});
}

// The modules and their tensors, unit by unit in the order backward finishes them.
template <typename F>
void GptT<F>::register_modules(const parallel::LayerEnv<F>& env) {
  ParamStoreT<F>& store = store_;
  const GptConfig& config = config_;
  const int L = config.n_layer;
  // Units in backward order: a head without the embedding (its backward comes first: its copy of
  // the tied wte, then ln_f), the chunks from last to first with their blocks from last to first,
  // then the embedding — wte and the root (wpe; with wte and ln_f when the head is here too, the
  // whole model), whose wte gradient is finished last. On the end stages of a pipeline wte is a
  // unit of its own, so that ZeRO shards it alike on both. A MoE block's experts come just
  // before the block: backward finishes them before the router, ln_2 and attention.
  blocks_.resize(size_t(L));
  block_unit_.assign(size_t(L), -1);
  expert_unit_.assign(size_t(L), -1);
  const bool head_alone = part_.head && !part_.embedding;
  const bool tied = config.tie_embeddings;
  if (head_alone) {
    if (tied) {
      wte_unit_ = store.begin_unit("wte");
      wte_copy_ = store.add(EmbeddingT<F>::wte_spec(config_, *tp_));
      store.end_unit();
    }
    head_unit_ = store.begin_unit("head");
    head_ = std::make_unique<HeadT<F>>(config_, env, wte_copy_);
    store.end_unit();
  }
  for (auto c = part_.chunks.rbegin(); c != part_.chunks.rend(); ++c) {
    for (int l = c->end - 1; l >= c->first; --l) {
      std::vector<typename MoeMlp<F>::ExpertIds> experts;
      if (config_.is_moe(l)) {
        expert_unit_[size_t(l)] =
            store.begin_unit("h." + std::to_string(l) + ".experts", ShardGroup::expert);
        experts = MoeMlp<F>::register_experts(config_, block_spec(config_, l).experts, store,
                                              ep_->rank());
        store.end_unit();
      }
      block_unit_[size_t(l)] = store.begin_unit("h." + std::to_string(l));
      blocks_[size_t(l)] = std::make_unique<BlockT<F>>(config_, l, env, ep_, std::move(experts));
      store.end_unit();
    }
  }
  if (part_.embedding) {
    TensorId wte = -1;
    // GPT-2's root holds wpe; a Llama model's would hold nothing but wte, which is then the root.
    if (!part_.head && !config.llama()) {
      wte_unit_ = store.begin_unit("wte");
      wte = store.add(EmbeddingT<F>::wte_spec(config_, *tp_));
      store.end_unit();
    }
    root_unit_ = store.begin_unit("root");
    embedding_ = std::make_unique<EmbeddingT<F>>(config_, env, wte);
    if (part_.head) {
      head_unit_ = root_unit_;
      head_ = std::make_unique<HeadT<F>>(config_, env, tied ? embedding_->wte() : -1);
    }
    store.end_unit();
  }
}

// What each chunk's slots hold between forward and backward.
template <typename F>
void GptT<F>::allocate_activations(MemoryLedger* ledger) {
  const GptConfig& config = config_;
  const int B = B_, T = T_;
  const Recompute r = recompute_;
  Device& device = backend_.device();
  // The residual stream: this rank's rows of it under sequence parallelism.
  const size_t BTC = boundary_size();
  const bool keep_layers = r != Recompute::full;
  const size_t saved = r == Recompute::none ? attention_.saved : 0;
  const MoeShape moe = MoeShape::of(config, B, T);
  auto per_layer = [&](int l) {
    return BlockActs<F>::elements(blocks_[size_t(l)]->spec(), config, B, T, saved, moe);
  };
  size_t total = part_.head ? HeadActs<F>::elements(config, B, T) : 0;
  for (const GptPart::Chunk& k : part_.chunks) {
    size_t layers = 0;
    for (int l = k.first; keep_layers && l < k.end; ++l) layers += per_layer(l);
    total += size_t(k.slots) * (BTC * size_t(k.end - k.first + 1) + layers);
  }
  acts_mem_ = Buffer<F>(total, {ledger, MemCategory::activations}, device);
  F* p = acts_mem_.data();
  auto take = [&](size_t n) { return std::exchange(p, p + n); };
  for (size_t c = 0; c < part_.chunks.size(); ++c) {
    const GptPart::Chunk& k = part_.chunks[c];
    ChunkState ch;
    ch.first = k.first;
    ch.end = k.end;
    ch.embedding = part_.embedding && c == 0;
    ch.head = part_.head && c + 1 == part_.chunks.size();
    ch.slots.resize(size_t(k.slots));
    for (Slot& s : ch.slots) {
      for (int l = k.first; l <= k.end; ++l) s.x.push_back(take(BTC));
      for (int l = k.first; keep_layers && l < k.end; ++l) {
        const BlockSpec& spec = blocks_[size_t(l)]->spec();
        s.acts.push_back(BlockActs<F>::carve(take(per_layer(l)), spec, config, B, T, saved, moe));
        s.routes.push_back(spec.moe ? std::make_unique<MoeRoute>(
                                          moe, device, MemTag{ledger, MemCategory::activations})
                                    : nullptr);
      }
      if (ch.embedding) s.tokens = Buffer<int32_t>(size_t(B) * T, {}, device);
    }
    chunks_.push_back(std::move(ch));
  }
  if (part_.head) {
    head_acts_ = HeadActs<F>::carve(take(HeadActs<F>::elements(config, B, T)), config, B, T);
  }
}

// Backward's residual gradient and scratch, and a full recomputation's work buffers.
template <typename F>
void GptT<F>::allocate_temporaries(MemoryLedger* ledger) {
  const GptConfig& config = config_;
  const int B = B_, T = T_;
  const Recompute r = recompute_;
  Device& device = backend_.device();
  const size_t BTC = boundary_size();
  const MoeShape moe = MoeShape::of(config, B, T);
  if (part_.head) targets_ = Buffer<int32_t>(size_t(B) * T, {}, device);
  const size_t scratch = BlockScratch<F>::elements(config, B, T, attention_);
  const bool any_moe = config.moe.experts > 0;
  const BlockSpec dense_spec = dense_block(config), moe_spec = moe_block(config);
  const size_t work_acts =
      std::max(BlockActs<F>::elements(dense_spec, config, B, T, 0, moe),
               any_moe ? BlockActs<F>::elements(moe_spec, config, B, T, 0, moe) : size_t(0));
  const size_t work = r == Recompute::full ? work_acts + BTC : 0;
  tmp_mem_ = Buffer<F>(BTC + scratch + work, {ledger, MemCategory::temporaries}, device);
  F* p = tmp_mem_.data();
  auto take = [&](size_t n) { return std::exchange(p, p + n); };
  dres_ = take(BTC);
  scratch_ = BlockScratch<F>::carve(take(scratch), config, B, T, attention_);
  if (r == Recompute::full) {
    // One block at a time: a dense and a MoE block's views of the same memory.
    work_acts_ = BlockActs<F>::carve(p, dense_spec, config, B, T, 0, moe);
    if (any_moe) {
      work_moe_acts_ = BlockActs<F>::carve(p, moe_spec, config, B, T, 0, moe);
      work_route_ =
          std::make_unique<MoeRoute>(moe, device, MemTag{ledger, MemCategory::temporaries});
    }
    take(work_acts);
    work_out_ = take(BTC);
  }
  for (auto& block : blocks_) {
    if (block) block->set_forward_scratch(scratch_);
  }
}

template <typename F>
void GptT<F>::reset_moe_stats() {
  for (auto& block : blocks_) {
    if (block && block->moe()) block->moe()->reset_stats();
  }
}

template <typename F>
void GptT<F>::record_moe_routes(bool on) {
  for (auto& block : blocks_) {
    if (block && block->moe()) block->moe()->record_routes(on);
  }
}

template <typename F>
void GptT<F>::before_forward_block(int layer, int next) {
  const int block = block_unit_[size_t(layer)], experts = expert_unit_[size_t(layer)];
  if (experts >= 0) {
    before_forward(block, experts);
    before_forward(experts, next);
  } else {
    before_forward(block, next);
  }
}

template <typename F>
void GptT<F>::after_forward_block(int layer) {
  if (expert_unit_[size_t(layer)] >= 0) after_forward(expert_unit_[size_t(layer)]);
  after_forward(block_unit_[size_t(layer)]);
}

template <typename F>
void GptT<F>::before_backward_block(int layer, int next) {
  const int block = block_unit_[size_t(layer)], experts = expert_unit_[size_t(layer)];
  if (experts >= 0) {
    before_backward(block, experts);
    before_backward(experts, next);
  } else {
    before_backward(block, next);
  }
}

template <typename F>
void GptT<F>::after_backward_block(int layer) {
  if (expert_unit_[size_t(layer)] >= 0) after_backward(expert_unit_[size_t(layer)]);
  after_backward(block_unit_[size_t(layer)]);
}

template <typename F>
size_t GptT<F>::boundary_size() const {
  return size_t(config_.local_rows(B_, T_)) * size_t(config_.d_model);
}

template <typename F>
bool GptT<F>::whole() const {
  return part_.embedding && part_.head && chunks_.size() == 1 && chunks_[0].first == 0 &&
         chunks_[0].end == config_.n_layer;
}

template <typename F>
void GptT<F>::check_whole(const char* what) const {
  TETRA_CHECK(whole(), "[model] internal: {} needs the whole model, not a pipeline stage's part",
              what);
}

template <typename F>
typename GptT<F>::Slot& GptT<F>::slot_of(int chunk, int mb, bool take) {
  TETRA_CHECK(chunk >= 0 && chunk < int(chunks_.size()),
              "[model] internal: chunk {} of a part with {} chunks", chunk, chunks_.size());
  for (Slot& s : chunks_[size_t(chunk)].slots) {
    if (s.mb == (take ? -1 : mb)) {
      if (take) s.mb = mb;
      return s;
    }
  }
  fail("[model] internal: chunk {} {} micro-batch {} ({} slots)", chunk,
       take ? "has no free slot for" : "holds no activations of", mb,
       chunks_[size_t(chunk)].slots.size());
}

template <typename F>
BlockActs<F> GptT<F>::saved_acts(const Slot& s, int first, int i) const {
  const bool moe = config_.is_moe(first + i);
  if (recompute_ == Recompute::full) {
    if (!moe) return work_acts_;
    BlockActs<F> a = work_moe_acts_;
    a.route = work_route_.get();
    return a;
  }
  BlockActs<F> a = s.acts[size_t(i)];
  if (moe) a.route = s.routes[size_t(i)].get();
  return a;
}

template <typename F>
void GptT<F>::forward_pass(const ChunkState& ch, Slot& s, const int32_t* inputs, const F* input,
                           BlockPass pass) {
  const int n = ch.end - ch.first;
  auto unit = [&](int i) { return block_unit_[size_t(ch.first + i)]; };
  if (ch.embedding) {
    backend_.device().from_host(s.tokens.data(), inputs, s.tokens.bytes());
    before_forward_end(root_unit_, unit(0));
    embedding_->forward(s.x[0], s.tokens.data(), B_, T_, 0, scratch_.full);
    after_forward_end(root_unit_);
  } else if (input) {
    k_.copy(s.x[0], input, boundary_size());
  }
  for (int i = 0; i < n; ++i) {
    before_forward_block(ch.first + i, i + 1 < n ? unit(i + 1) : (ch.head ? head_unit_ : -1));
    // Without saved probabilities the forward still needs somewhere to put them.
    BlockActs<F> a = saved_acts(s, ch.first, i);
    if (!a.attn.saved) a.attn.saved = scratch_.attn.attn_saved;
    blocks_[size_t(ch.first + i)]->forward(s.x[size_t(i)], s.x[size_t(i) + 1], a, B_, T_, nullptr,
                                           0, scratch_.full, pass);
    after_forward_block(ch.first + i);
  }
}

template <typename F>
void GptT<F>::forward_chunk(int chunk, int mb, const int32_t* inputs, const F* input, F* output) {
  const ChunkState& ch = chunks_[size_t(chunk)];
  Slot& s = slot_of(chunk, mb, true);
  TETRA_CHECK(ch.head || output, "[model] internal: chunk {} forward without an output", chunk);
  TETRA_CHECK(ch.embedding || input, "[model] internal: chunk {} forward without an input", chunk);
  forward_pass(ch, s, inputs, input, BlockPass::train);
  if (output) k_.copy(output, s.x.back(), boundary_size());
}

template <typename F>
double GptT<F>::backward_input_chunk(int chunk, int mb, const int32_t* targets,
                                     const F* grad_output, F* grad_input, float loss_scale) {
  weight_grads_->defer({mb, chunk});
  double loss = 0.0;
  try {
    loss = backward_chunk(chunk, mb, targets, grad_output, grad_input, loss_scale);
  } catch (...) {
    weight_grads_->stop();
    throw;
  }
  weight_grads_->stop();
  return loss;
}

template <typename F>
void GptT<F>::backward_weight_chunk(int chunk, int mb) {
  weight_grads_->flush({mb, chunk});
}

template <typename F>
void GptT<F>::keep_bf16_weights(MemoryLedger* ledger) {
  if constexpr (!std::is_same_v<F, float>) return;  // bf16 products take f32 operands
  if (!bf16_) return;
  const Buffer<F>& params = store_.params();
  bf16_->keep_weights(reinterpret_cast<const float*>(params.data()), params.size(),
                      MemTag{ledger, MemCategory::params});
}

template <typename F>
int GptT<F>::unit_of_two_chunks() const {
  int head = -1, embedding = -1;
  for (size_t c = 0; c < chunks_.size(); ++c) {
    if (chunks_[c].head) head = int(c);
    if (chunks_[c].embedding) embedding = int(c);
  }
  return head >= 0 && embedding >= 0 && head != embedding ? root_unit_ : -1;
}

template <typename F>
double GptT<F>::backward_chunk(int chunk, int mb, const int32_t* targets, const F* grad_output,
                               F* grad_input, float loss_scale) {
  const ChunkState& ch = chunks_[size_t(chunk)];
  Slot& s = slot_of(chunk, mb, false);
  const int n = ch.end - ch.first;
  auto unit = [&](int i) { return block_unit_[size_t(ch.first + i)]; };
  TETRA_CHECK(ch.head || grad_output, "[model] internal: chunk {} backward without a gradient",
              chunk);
  TETRA_CHECK(ch.embedding || grad_input,
              "[model] internal: chunk {} backward with nowhere to put its input's gradient",
              chunk);
  double loss = 0.0;
  if (ch.head) {
    // The head's forward runs straight into its backward: one residency for both.
    before_backward_end(head_unit_, unit(n - 1));
    head_->forward(s.x.back(), head_acts_, B_, T_);
    backend_.device().from_host(targets_.data(), targets, targets_.bytes());
    loss = head_->backward(dres_, scratch_.dln, s.x.back(), targets_.data(), head_acts_, B_, T_,
                           loss_scale, scratch_.full, scratch_.norm_grads);
    if (head_unit_ != root_unit_) after_backward_end(head_unit_);
  } else if (grad_output) {
    k_.copy(dres_, grad_output, boundary_size());
  }
  // The root is resident since the head's backward on the whole model.
  const bool root_next = ch.embedding && !ch.head;
  for (int i = n - 1; i >= 0; --i) {
    before_backward_block(ch.first + i, i > 0 ? unit(i - 1) : (root_next ? root_unit_ : -1));
    BlockActs<F> saved = saved_acts(s, ch.first, i);
    if (recompute_ == Recompute::full) {
      // The block's forward again, attention's saved state included: backward reads it.
      saved.attn.saved = scratch_.attn.attn_saved;
      blocks_[size_t(ch.first + i)]->forward(s.x[size_t(i)], work_out_, saved, B_, T_, nullptr, 0,
                                             scratch_.full, BlockPass::recompute);
    }
    blocks_[size_t(ch.first + i)]->backward(dres_, s.x[size_t(i)], saved, scratch_, B_, T_,
                                            loss_scale);
    after_backward_block(ch.first + i);
  }
  if (ch.embedding) {
    if (root_next) before_backward_end(root_unit_, -1);
    embedding_->backward(dres_, s.tokens.data(), B_, T_, scratch_.full);
    after_backward_end(root_unit_);
  } else if (grad_input) {
    k_.copy(grad_input, dres_, boundary_size());
  }
  s.mb = -1;
  return loss;
}

template <typename F>
double GptT<F>::forward_backward(const int32_t* inputs, const int32_t* targets, float loss_scale) {
  check_whole("forward_backward");
  forward_chunk(0, 0, inputs, nullptr, nullptr);
  return backward_chunk(0, 0, targets, nullptr, nullptr, loss_scale);
}

template <typename F>
double GptT<F>::evaluate_chunk(int chunk, const int32_t* inputs, const F* input, F* output,
                               const int32_t* targets) {
  const ChunkState& ch = chunks_[size_t(chunk)];
  TETRA_CHECK(ch.head || output, "[model] internal: chunk {} forward without an output", chunk);
  TETRA_CHECK(ch.embedding || input, "[model] internal: chunk {} forward without an input", chunk);
  Slot& s = slot_of(chunk, -2, true);
  forward_pass(ch, s, inputs, input, BlockPass::evaluate);
  double loss = 0.0;
  if (ch.head) {
    before_forward_end(head_unit_, -1);
    head_->forward(s.x.back(), head_acts_, B_, T_);
    after_forward_end(head_unit_);
    loss = head_loss(targets);
  } else if (output) {
    k_.copy(output, s.x.back(), boundary_size());
  }
  end_forward_only();
  s.mb = -1;
  return loss;
}

template <typename F>
double GptT<F>::head_loss(const int32_t* targets) {
  backend_.device().from_host(targets_.data(), targets, targets_.bytes());
  return head_->loss(targets_.data(), head_acts_, B_, T_);
}

template <typename F>
double GptT<F>::forward_loss(const int32_t* inputs, const int32_t* targets) {
  forward_logits(inputs);
  return head_loss(targets);
}

template <typename F>
const F* GptT<F>::forward_logits(const int32_t* inputs) {
  check_whole("forward_logits");
  Slot& s = chunks_[0].slots[0];
  forward_pass(chunks_[0], s, inputs, nullptr, BlockPass::evaluate);
  before_forward(root_unit_, -1);
  head_->forward(s.x.back(), head_acts_, B_, T_);
  after_forward(root_unit_);
  end_forward_only();
  return head_acts_.logits;
}

template <typename F>
std::unique_ptr<typename GptT<F>::DecodeState> GptT<F>::make_decode_state(int B) const {
  TETRA_CHECK(B > 0, "[generate] batch must be positive (got {})", B);
  const GptConfig& c = config_;
  const size_t C = size_t(c.d_model), maxT = size_t(c.max_seq), L = size_t(c.n_layer);
  const size_t kv = size_t(B) * maxT * size_t(c.local_kv_width());
  const size_t scratch = k_.attention_decode_scratch_elements(B, c.local_heads(), c.max_seq);
  auto st = std::make_unique<DecodeState>();
  st->B = B;
  const MoeShape moe = MoeShape::of(c, B, 1, /*capacity=*/false);
  const BlockSpec dense_spec = dense_block(c), moe_spec = moe_block(c);
  const size_t acts = BlockActs<F>::elements(dense_spec, c, B, 1, 0, moe);
  const size_t head = HeadActs<F>::elements(c, B, 1);
  const size_t moe_acts = c.moe.experts > 0 ? BlockActs<F>::elements(moe_spec, c, B, 1, 0, moe) : 0;
  Device& device = backend_.device();
  st->mem =
      Buffer<F>(L * 2 * kv + scratch + acts + moe_acts + head + 2 * size_t(B) * C, {}, device);
  st->tokens = Buffer<int32_t>(size_t(B), {}, device);
  F* p = st->mem.data();
  auto take = [&](size_t n) { return std::exchange(p, p + n); };
  for (size_t l = 0; l < L; ++l) {
    KvCache<F> kc;
    kc.keys = take(kv);
    kc.values = take(kv);
    st->cache.push_back(kc);
  }
  F* decode_scratch = take(scratch);
  for (auto& kc : st->cache) kc.scratch = decode_scratch;
  st->acts = BlockActs<F>::carve(take(acts), dense_spec, c, B, 1, 0, moe);
  if (c.moe.experts > 0) {
    st->moe_acts = BlockActs<F>::carve(take(moe_acts), moe_spec, c, B, 1, 0, moe);
    st->route = std::make_unique<MoeRoute>(moe, device, MemTag{});
    st->moe_acts.route = st->route.get();
  }
  st->head = HeadActs<F>::carve(take(head), c, B, 1);
  st->x = take(size_t(B) * C);
  st->y = take(size_t(B) * C);
  return st;
}

template <typename F>
const F* GptT<F>::decode(DecodeState& st, const int32_t* tokens, int pos) {
  check_whole("decode");
  const int L = config_.n_layer;
  TETRA_CHECK(!config_.sequence_parallel,
              "[generate] decoding runs without tp.sequence_parallel (one token per step has no "
              "sequence to split); build the model with it off");
  TETRA_CHECK(pos >= 0 && pos < config_.max_seq,
              "[generate] position {} is outside the model's max_seq={}; use a shorter prompt or "
              "fewer new tokens",
              pos, config_.max_seq);
  backend_.device().from_host(st.tokens.data(), tokens, st.tokens.bytes());
  before_forward(root_unit_, block_unit_[0]);
  embedding_->forward(st.x, st.tokens.data(), st.B, 1, pos);
  for (int l = 0; l < L; ++l) {
    before_forward_block(l, l + 1 < L ? block_unit_[size_t(l) + 1] : root_unit_);
    blocks_[size_t(l)]->forward(st.x, st.y, config_.is_moe(l) ? st.moe_acts : st.acts, st.B, 1,
                                &st.cache[size_t(l)], pos);
    after_forward_block(l);
    std::swap(st.x, st.y);
  }
  head_->forward(st.x, st.head, st.B, 1);
  after_forward(root_unit_);
  end_forward_only();
  return st.head.logits;
}

template class GptT<float>;
template class GptT<double>;

}  // namespace tetra
