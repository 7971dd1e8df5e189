#include "model/gpt.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "core/error.h"

namespace tetra {

template <typename F>
GptT<F>::GptT(const GptConfig& config, ParamStoreT<F>& store, int B, int T, Recompute r,
              MemoryLedger* ledger, parallel::TensorParallel* tp)
    : config_(config), store_(store), B_(B), T_(T), recompute_(r), tp_(tp ? tp : &own_tp_) {
  TETRA_CHECK(B > 0, "[model] micro-batch must be positive (got {})", B);
  TETRA_CHECK(T > 0 && T <= config.max_seq,
              "[model] sequence length {} must be in 1..model.max_seq={}; raise model.max_seq or "
              "lower train.seq_len",
              T, config.max_seq);
  TETRA_CHECK(
      !config.sequence_parallel || (int64_t(B) * T) % config.tp == 0,
      "[model] tp.sequence_parallel splits the B*T = {}*{} = {} token rows of a micro-batch "
      "over parallel.tp={} ranks, which does not divide them; change train.micro_batch or "
      "train.seq_len",
      B, T, int64_t(B) * T, config.tp);
  const int L = config.n_layer;
  if (config.bf16) {
    // The largest product's operands: an MLP product reads a (BT,4C/tp) activation or gradient
    // with a weight or a (BT,C) one; the head's backward reads the (BT,Vp/tp) logit gradient.
    const size_t BT = size_t(B) * T, C = size_t(config.d_model);
    const size_t H = size_t(config.local_hidden()), V = size_t(config.local_vocab());
    const size_t elements = std::max(BT * H + std::max(H, BT) * C, BT * V + std::max(BT, V) * C);
    bf16_ = std::make_unique<cpu::Bf16Operands>(elements + 32,
                                                MemTag{ledger, MemCategory::temporaries});
  }
  // Units in backward order: blocks from last to first, then the root (embedding and ln_f),
  // whose tied wte gradient is finished last, by the embedding's backward.
  blocks_.resize(size_t(L));
  block_unit_.resize(size_t(L));
  for (int l = L - 1; l >= 0; --l) {
    block_unit_[size_t(l)] = store.begin_unit("h." + std::to_string(l));
    blocks_[size_t(l)] = std::make_unique<BlockT<F>>(config_, l, store, *tp_, bf16_.get());
    store.end_unit();
  }
  root_unit_ = store.begin_unit("root");
  embedding_ = std::make_unique<EmbeddingT<F>>(config_, store, *tp_);
  head_ = std::make_unique<HeadT<F>>(config_, store, embedding_->wte(), *tp_, bf16_.get());
  store.end_unit();

  // The residual stream: this rank's rows of it under sequence parallelism.
  const size_t BTC = size_t(config.local_rows(B, T)) * size_t(config.d_model);
  const bool keep_layers = r != Recompute::full;
  const size_t per_layer = BlockActs<F>::elements(config, B, T, r == Recompute::none);
  acts_mem_ = Buffer<F>(BTC * size_t(L + 1) + (keep_layers ? per_layer * size_t(L) : 0) +
                            HeadActs<F>::elements(config, B, T),
                        {ledger, MemCategory::activations});
  F* p = acts_mem_.data();
  auto take = [&](size_t n) { return std::exchange(p, p + n); };
  for (int l = 0; l <= L; ++l) x_.push_back(take(BTC));
  for (int l = 0; keep_layers && l < L; ++l) {
    layer_acts_.push_back(BlockActs<F>::carve(take(per_layer), config, B, T, r == Recompute::none));
  }
  head_acts_ = HeadActs<F>::carve(take(HeadActs<F>::elements(config, B, T)), config, B, T);

  const size_t work = r == Recompute::full ? BlockActs<F>::elements(config, B, T, false) + BTC : 0;
  tmp_mem_ = Buffer<F>(BTC + BlockScratch<F>::elements(config, B, T) + work,
                       {ledger, MemCategory::temporaries});
  p = tmp_mem_.data();
  dres_ = take(BTC);
  scratch_ = BlockScratch<F>::carve(take(BlockScratch<F>::elements(config, B, T)), config, B, T);
  if (r == Recompute::full) {
    work_acts_ =
        BlockActs<F>::carve(take(BlockActs<F>::elements(config, B, T, false)), config, B, T, false);
    work_out_ = take(BTC);
  }
  inputs_.resize(size_t(B) * T);
}

template <typename F>
const BlockActs<F>& GptT<F>::saved_acts(int layer) const {
  return recompute_ == Recompute::full ? work_acts_ : layer_acts_[size_t(layer)];
}

template <typename F>
void GptT<F>::forward_pass(const int32_t* inputs) {
  const int L = config_.n_layer;
  std::memcpy(inputs_.data(), inputs, sizeof(int32_t) * inputs_.size());
  before_forward(root_unit_, block_unit_[0]);
  embedding_->forward(x_[0], inputs, B_, T_, 0, scratch_.full);
  after_forward(root_unit_);
  for (int l = 0; l < L; ++l) {
    before_forward(block_unit_[size_t(l)], l + 1 < L ? block_unit_[size_t(l) + 1] : root_unit_);
    // Without saved probabilities the forward still needs somewhere to put them.
    BlockActs<F> a = saved_acts(l);
    if (!a.att) a.att = scratch_.att;
    blocks_[size_t(l)]->forward(x_[size_t(l)], x_[size_t(l) + 1], a, B_, T_, nullptr, 0,
                                scratch_.full);
    after_forward(block_unit_[size_t(l)]);
  }
}

template <typename F>
double GptT<F>::forward_backward(const int32_t* inputs, const int32_t* targets, float loss_scale) {
  const int L = config_.n_layer;
  forward_pass(inputs);
  // The head's forward runs straight into its backward: one residency for both.
  before_backward(root_unit_, block_unit_[size_t(L) - 1]);
  head_->forward(x_[size_t(L)], head_acts_, B_, T_);
  const double loss = head_->backward(dres_, scratch_.dln, x_[size_t(L)], targets, head_acts_, B_,
                                      T_, loss_scale, scratch_.full);
  for (int l = L - 1; l >= 0; --l) {
    before_backward(block_unit_[size_t(l)], l > 0 ? block_unit_[size_t(l) - 1] : -1);
    if (recompute_ == Recompute::full) {
      BlockActs<F> a = work_acts_;
      a.att = scratch_.att;
      blocks_[size_t(l)]->forward(x_[size_t(l)], work_out_, a, B_, T_, nullptr, 0, scratch_.full);
    }
    blocks_[size_t(l)]->backward(dres_, x_[size_t(l)], saved_acts(l), scratch_, B_, T_);
    after_backward(block_unit_[size_t(l)]);
  }
  embedding_->backward(dres_, inputs_.data(), B_, T_, scratch_.full);
  after_backward(root_unit_);
  return loss;
}

template <typename F>
double GptT<F>::forward_loss(const int32_t* inputs, const int32_t* targets) {
  forward_logits(inputs);
  return head_->loss(targets, head_acts_, B_, T_);
}

template <typename F>
const F* GptT<F>::forward_logits(const int32_t* inputs) {
  forward_pass(inputs);
  before_forward(root_unit_, -1);
  head_->forward(x_[size_t(config_.n_layer)], head_acts_, B_, T_);
  after_forward(root_unit_);
  end_forward_only();
  return head_acts_.logits;
}

template <typename F>
std::unique_ptr<typename GptT<F>::DecodeState> GptT<F>::make_decode_state(int B) const {
  TETRA_CHECK(B > 0, "[generate] batch must be positive (got {})", B);
  const GptConfig& c = config_;
  const size_t C = size_t(c.d_model), maxT = size_t(c.max_seq), L = size_t(c.n_layer);
  const size_t kv = size_t(B) * maxT * size_t(c.local_width());
  auto st = std::make_unique<DecodeState>();
  st->B = B;
  const size_t acts = BlockActs<F>::elements(c, B, 1, false), head = HeadActs<F>::elements(c, B, 1);
  st->mem.resize(L * 2 * kv + maxT + acts + head + 2 * size_t(B) * C);
  F* p = st->mem.data();
  auto take = [&](size_t n) { return std::exchange(p, p + n); };
  for (size_t l = 0; l < L; ++l) {
    KvCache<F> kc;
    kc.keys = take(kv);
    kc.values = take(kv);
    st->cache.push_back(kc);
  }
  F* scores = take(maxT);
  for (auto& kc : st->cache) kc.scores = scores;
  st->acts = BlockActs<F>::carve(take(acts), c, B, 1, false);
  st->head = HeadActs<F>::carve(take(head), c, B, 1);
  st->x = take(size_t(B) * C);
  st->y = take(size_t(B) * C);
  return st;
}

template <typename F>
const F* GptT<F>::decode(DecodeState& st, const int32_t* tokens, int pos) {
  const int L = config_.n_layer;
  TETRA_CHECK(!config_.sequence_parallel,
              "[generate] decoding runs without tp.sequence_parallel (one token per step has no "
              "sequence to split); build the model with it off");
  TETRA_CHECK(pos >= 0 && pos < config_.max_seq,
              "[generate] position {} is outside the model's max_seq={}; use a shorter prompt or "
              "fewer new tokens",
              pos, config_.max_seq);
  before_forward(root_unit_, block_unit_[0]);
  embedding_->forward(st.x, tokens, st.B, 1, pos);
  for (int l = 0; l < L; ++l) {
    before_forward(block_unit_[size_t(l)], l + 1 < L ? block_unit_[size_t(l) + 1] : root_unit_);
    blocks_[size_t(l)]->forward(st.x, st.y, st.acts, st.B, 1, &st.cache[size_t(l)], pos);
    after_forward(block_unit_[size_t(l)]);
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
