#include "model/embedding.h"

#include "kernels/cpu/embedding.h"

namespace tetra {

template <typename F>
EmbeddingT<F>::EmbeddingT(const GptConfig& config, ParamStoreT<F>& store,
                          parallel::TensorParallel& tp)
    : c_(config), store_(store), tp_(tp) {
  const int64_t C = config.d_model;
  ParamSpec wpe;
  wpe.name = "transformer.wpe.weight";
  wpe.shape = {config.max_seq, C};
  wpe.decay = true;
  wpe.init = {ParamInit::Kind::normal, 0.02f, -1};
  wpe_ = store.add(std::move(wpe));
  ParamSpec wte;
  wte.name = "transformer.wte.weight";
  wte.shape = {config.padded_vocab, C};
  wte.decay = true;
  wte.init = {ParamInit::Kind::normal, 0.02f, config.vocab_size};
  wte.file.rows = config.vocab_size;
  if (tp.size() > 1)
    wte.slice = {0, int64_t(tp.rank()) * config.local_vocab(), config.local_vocab()};
  wte_ = store.add(std::move(wte));
}

template <typename F>
void EmbeddingT<F>::forward(F* out, const int32_t* tokens, int B, int T, int pos0) {
  if (tp_.size() == 1) {
    cpu::embedding_forward(out, tokens, store_.param(wte_), store_.param(wpe_), B, T, c_.d_model,
                           pos0);
    return;
  }
  const int Vl = c_.local_vocab();
  cpu::embedding_forward(out, tokens, store_.param(wte_),
                         tp_.rank() == 0 ? store_.param(wpe_) : nullptr, B, T, c_.d_model, pos0,
                         tp_.rank() * Vl, Vl);
  tp_.all_reduce(out, size_t(B) * T * c_.d_model);
}

template <typename F>
void EmbeddingT<F>::backward(const F* dout, const int32_t* tokens, int B, int T) {
  const int Vl = tp_.size() == 1 ? 0 : c_.local_vocab();
  cpu::embedding_backward(store_.grad(wte_), store_.grad(wpe_), dout, tokens, B, T, c_.d_model,
                          tp_.rank() * Vl, Vl);
}

template class EmbeddingT<float>;
template class EmbeddingT<double>;

}  // namespace tetra
