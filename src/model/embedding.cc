#include "model/embedding.h"

#include <utility>

#include "model/block_spec.h"

namespace tetra {

namespace {

ParamSpec wpe_spec(const GptConfig& config) {
  ParamSpec wpe;
  wpe.name = root_spec(config).wpe;
  wpe.shape = {config.max_seq, config.d_model};
  wpe.decay = true;
  wpe.init = {ParamInit::Kind::normal, 0.02f, -1};
  return wpe;
}

}  // namespace

template <typename F>
EmbeddingT<F>::EmbeddingT(const GptConfig& config, const parallel::LayerEnv<F>& env, TensorId wte)
    : wpe_(config.llama() ? -1 : env.store.add(wpe_spec(config))),
      wte_(wte >= 0 ? wte : env.store.add(wte_spec(config, env.tp))),
      lookup_(env, wte_, wpe_, config.d_model, config.local_vocab()) {}

template <typename F>
ParamSpec EmbeddingT<F>::wte_spec(const GptConfig& config, const parallel::TensorParallel& tp) {
  ParamSpec wte;
  wte.name = root_spec(config).wte;
  wte.shape = {config.padded_vocab, config.d_model};
  wte.decay = true;
  wte.init = {ParamInit::Kind::normal, 0.02f, config.vocab_size};
  wte.file.rows = config.vocab_size;
  if (tp.size() > 1)
    wte.slice = {0, int64_t(tp.rank()) * config.local_vocab(), config.local_vocab()};
  return wte;
}

template class EmbeddingT<float>;
template class EmbeddingT<double>;

}  // namespace tetra
