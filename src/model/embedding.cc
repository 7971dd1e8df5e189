#include "model/embedding.h"

#include "core/error.h"
#include "kernels/cpu/embedding.h"

namespace tetra {

template <typename F>
EmbeddingT<F>::EmbeddingT(const GptConfig& config, ParamStoreT<F>& store,
                          parallel::TensorParallel& tp, TensorId wte)
    : c_(config), store_(store), tp_(tp), wte_(wte) {
  const int64_t C = config.d_model;
  ParamSpec wpe;
  wpe.name = "transformer.wpe.weight";
  wpe.shape = {config.max_seq, C};
  wpe.decay = true;
  wpe.init = {ParamInit::Kind::normal, 0.02f, -1};
  wpe_ = store.add(std::move(wpe));
  if (wte_ < 0) wte_ = store.add(wte_spec(config, tp));
}

template <typename F>
ParamSpec EmbeddingT<F>::wte_spec(const GptConfig& config, const parallel::TensorParallel& tp) {
  ParamSpec wte;
  wte.name = "transformer.wte.weight";
  wte.shape = {config.padded_vocab, config.d_model};
  wte.decay = true;
  wte.init = {ParamInit::Kind::normal, 0.02f, config.vocab_size};
  wte.file.rows = config.vocab_size;
  if (tp.size() > 1)
    wte.slice = {0, int64_t(tp.rank()) * config.local_vocab(), config.local_vocab()};
  return wte;
}

template <typename F>
void EmbeddingT<F>::forward(F* out, const int32_t* tokens, int B, int T, int pos0, F* tmp) {
  const int C = c_.d_model;
  if (tp_.size() == 1) {
    cpu::embedding_forward(out, tokens, store_.param(wte_), store_.param(wpe_), B, T, C, pos0);
    return;
  }
  const int Vl = c_.local_vocab();
  const size_t BTC = size_t(B) * T * C;
  if (!c_.sequence_parallel) {  // wpe once, then the sum of every rank's lookups
    cpu::embedding_forward(out, tokens, store_.param(wte_),
                           tp_.rank() == 0 ? store_.param(wpe_) : nullptr, B, T, C, pos0,
                           tp_.rank() * Vl, Vl);
    tp_.all_reduce(out, BTC);
    return;
  }
  TETRA_CHECK(tmp && pos0 == 0, "[model] internal: sequence-parallel embedding without scratch");
  cpu::embedding_forward<F>(tmp, tokens, store_.param(wte_), nullptr, B, T, C, 0, tp_.rank() * Vl,
                            Vl);
  const size_t n = BTC / size_t(tp_.size());
  tp_.reduce_scatter(tmp, out, n);
  // This rank's rows are rows [rank·N, (rank+1)·N) of (B·T): positions (row mod T).
  const int64_t N = int64_t(n) / C, first = tp_.rank() * N;
  const F* wpe = store_.param(wpe_);
  for (int64_t i = 0; i < N; ++i) {
    const F* p = wpe + (first + i) % T * C;
    F* o = out + i * C;
    for (int c = 0; c < C; ++c) o[c] += p[c];
  }
}

template <typename F>
void EmbeddingT<F>::backward(const F* dout, const int32_t* tokens, int B, int T, F* tmp) {
  const int C = c_.d_model;
  const int Vl = tp_.size() == 1 ? 0 : c_.local_vocab();
  if (c_.sequence_parallel) {
    TETRA_CHECK(tmp, "[model] internal: sequence-parallel embedding without scratch");
    tp_.all_gather(dout, tmp, size_t(B) * T * C / size_t(tp_.size()));
    dout = tmp;
  }
  cpu::embedding_backward(store_.grad(wte_), store_.grad(wpe_), dout, tokens, B, T, C,
                          tp_.rank() * Vl, Vl);
}

template class EmbeddingT<float>;
template class EmbeddingT<double>;

}  // namespace tetra
