// GPT-2 (Hugging Face GPT2LMHeadModel without dropout) with explicit forward and backward,
// in f32 for training or f64 for gradient checks.
// Parameters, gradients live in flat buffers in backward order; every tensor is a view with its
// global Hugging Face name, so checkpoints, safetensors and RNG keys all agree.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "core/arena.h"
#include "core/tensor.h"
#include "model/gpt_config.h"

namespace tetra {

/** A parameter tensor: a view plus how the optimizer and the HF format treat it. */
struct Param {
  TensorView view;           // internal layout; Linear weights are (out, in)
  bool decay = false;        // AdamW weight decay applies (2-D weights)
  bool conv1d = false;       // stored transposed, (in, out), in Hugging Face files
  bool padded_rows = false;  // wte: rows >= vocab_size are padding, absent from files
};

/** Called during backward with n: the first n elements of the flat gradient are final. */
using GradReadyFn = std::function<void(size_t n)>;

template <typename F>
class GptT {
 public:
  /** Allocates parameters, gradients and activations for micro-batches of (B, T). */
  GptT(const GptConfig& config, int B, int T);

  /** GPT-2 init from Philox keyed by (seed, tensor name, element index). */
  void init(uint64_t seed);

  // inputs is (B,T): fills logits (B,T,Vp).
  void forward(const int32_t* inputs);
  // targets is (B,T). After forward(): loss, then backward accumulating into the gradients with
  // d(loss)/d(mean loss) = loss_scale (1 / micro-batches for accumulation). Returns the mean loss.
  double backward(const int32_t* targets, float loss_scale, const GradReadyFn& ready = {});
  // targets is (B,T). After forward(): the mean loss, logits untouched.
  double loss(const int32_t* targets);

  void zero_grads() { grads_.zero(); }

  const GptConfig& config() const { return config_; }
  int batch() const { return B_; }
  int seq() const { return T_; }
  std::vector<Param>& params() { return params_; }
  const std::vector<Param>& params() const { return params_; }
  F* param_data() { return params_mem_.data(); }
  const F* param_data() const { return params_mem_.data(); }
  F* grad_data() { return grads_.data(); }
  /** The parameter's values inside the flat buffer. */
  F* data_of(const Param& p) { return params_mem_.data() + p.view.offset; }
  size_t num_elements() const { return params_mem_.size(); }
  /** Gradient view matching a parameter. */
  F* grad_of(const Param& p) { return grads_.data() + p.view.offset; }
  const F* logits() const { return acts_.logits; }
  size_t activation_bytes() const { return act_mem_.size() * sizeof(F); }

 private:
  struct Layer {  // pointers into the flat parameter (or gradient) buffer
    F *ln1w, *ln1b, *qkvw, *qkvb, *attprojw, *attprojb;
    F *ln2w, *ln2b, *fcw, *fcb, *fcprojw, *fcprojb;
  };
  struct Weights {
    F *wte, *wpe, *lnfw, *lnfb;
    std::vector<Layer> layers;
  };
  struct LayerActs {
    F* residual;  // (B,T,C): input of the block
    F *ln1, *ln1_mean, *ln1_rstd, *qkv, *att, *atty;
    F *residual2, *ln2, *ln2_mean, *ln2_rstd, *fch, *fch_gelu;
  };
  struct Acts {
    std::vector<LayerActs> layers;
    F *encoded, *residual_out, *lnf, *lnf_mean, *lnf_rstd, *logits, *losses;
    // backward scratch
    F *dresidual, *dln, *dqkv, *datt, *datty, *dfch;
  };

  Weights bind(F* base) const;
  void build_layout();
  void allocate_activations();

  GptConfig config_;
  int B_, T_;
  std::vector<Param> params_;
  Buffer<F> params_mem_, grads_, act_mem_;
  Weights w_, g_;
  Acts acts_;
  std::vector<int32_t> inputs_;    // (B,T) copy of the last forward's inputs
  std::vector<size_t> layer_end_;  // flat offset after layer l's parameters (backward order)
  size_t lnf_end_ = 0;
};

/** The training model (f32); GptT<double> serves whole-model gradient checks. */
using Gpt = GptT<float>;

}  // namespace tetra
