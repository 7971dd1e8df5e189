// A GPT-2 or Llama model (as Hugging Face's GPT2LMHeadModel or LlamaForCausalLM) composed of
// modules — an embedding, L blocks and a head, tied to the embedding or (Llama) not — over a
// parameter store that lives outside the model. Each block is one unit of the store, and the
// embedding with the final norm is the last ("root") unit, so units run
// in the order backward finishes them. Around every module the model tells the store's hooks
// (ZeRO) what it is about to use and what it has finished, so parameters can be gathered just in
// time and gradients reduced as soon as they are final. Under tensor parallelism every module holds
// its rank's slices (config.tp ways, over the group it is given) and the residual stream stays
// whole on every rank of the group. Under pipeline parallelism the model is the part a pipeline
// rank holds (GptPart): chunks of consecutive layers, the embedding on the first virtual stage,
// the final norm and the head (with a copy of a tied wte) on the last, each chunk keeping the
// activations of the micro-batches it has in flight.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "core/arena.h"
#include "core/memory.h"
#include "core/param_store.h"
#include "core/recompute.h"
#include "kernels/backend.h"
#include "model/block.h"
#include "model/embedding.h"
#include "model/gpt_config.h"
#include "model/head.h"
#include "parallel/expert_parallel.h"
#include "parallel/tensor_parallel.h"
#include "parallel/tp_layers.h"

namespace tetra {

/** The part of the model a pipeline rank holds: its chunks in virtual-stage order, each a range
 * of consecutive layers with the number of micro-batches whose activations it keeps between
 * forward and backward (slots); whether the first chunk starts with the embedding and whether the
 * last ends with ln_f and the head. Empty chunks: the whole model, one slot. */
struct GptPart {
  struct Chunk {
    int first = 0, end = 0;  // layers [first, end)
    int slots = 1;
  };
  std::vector<Chunk> chunks;
  bool embedding = true, head = true;
};

template <typename F>
class GptT {
 public:
  /** Registers every tensor of `part` with `store` (not yet finalized; on `backend`'s device) and
   *  allocates activations on that device for micro-batches of (B,T) with recomputation `r`,
   *  charged to `ledger`. `tp` is the tensor-parallel group of config.tp ranks (null: one rank),
   *  `ep` the expert-parallel group of config.ep ranks (null: one rank); they must outlive
   *  the model. A MoE block's experts are a unit of their own ("h.<N>.experts", in the store's
   *  expert shard group) just before the block's. `cp` is context-parallel attention across
   *  config.cp ranks (null: one rank): T is then this rank's T/cp tokens of every sequence, and
   *  inputs and targets are those tokens (parallel::CpSplit). */
  GptT(Backend& backend, const GptConfig& config, ParamStoreT<F>& store, int B, int T,
       Recompute r = Recompute::none, MemoryLedger* ledger = nullptr,
       parallel::TensorParallel* tp = nullptr, GptPart part = {},
       parallel::ExpertParallel* ep = nullptr, parallel::ContextAttention<F>* cp = nullptr);

  /** The residency manager the model reports to (null: every unit is always resident). */
  void set_hooks(UnitHooks* hooks) { hooks_ = hooks; }

  // inputs and targets are (B,T) in host memory (token ids are copied to the device). Forward and
  // backward of one micro-batch; gradients accumulate with d(loss)/d(mean loss) = loss_scale
  // (1 / micro-batches for accumulation). Returns the mean loss. This and the calls below need the
  // whole model; activations (input, output, gradients) are device buffers.
  double forward_backward(const int32_t* inputs, const int32_t* targets, float loss_scale);

  // Pipeline stages. Forward of micro-batch mb through chunk `chunk` into one of its free slots:
  // the chunk with the embedding reads inputs (B,T), any other its input (B,T,C) (this rank's rows
  // under sequence parallelism); output receives the chunk's output (B,T,C), except on the chunk
  // with the head (nullptr), whose output stays in the slot for the head.
  void forward_chunk(int chunk, int mb, const int32_t* inputs, const F* input, F* output);
  // Backward of (mb, chunk), freeing its slot: the chunk with the head runs the head's forward and
  // backward against targets (B,T) with d(loss)/d(mean loss) = loss_scale and returns the mean
  // loss; any other starts from grad_output (B,T,C) and returns 0. grad_input receives the
  // gradient of the chunk's input, except on the chunk with the embedding (nullptr).
  double backward_chunk(int chunk, int mb, const int32_t* targets, const F* grad_output,
                        F* grad_input, float loss_scale);
  // Zero-bubble pipelines (docs/pipeline.md): backward_chunk in two. backward_input_chunk is
  // backward_chunk (the input's gradient, the loss, the slot freed, the norms', biases' and
  // embeddings' gradients) with the weight products kept, their operands copied, for
  // backward_weight_chunk(chunk, mb) to run. The gradients equal backward_chunk's bit for bit when
  // each chunk's W run in the order of its B.
  double backward_input_chunk(int chunk, int mb, const int32_t* targets, const F* grad_output,
                              F* grad_input, float loss_scale);
  void backward_weight_chunk(int chunk, int mb);
  // The hooks hear after_backward(unit) once per backward of a chunk holding the unit, when its
  // gradients from that backward are final (under a split backward: after its W). A unit that
  // two chunks add to (the root, with the head on this rank in another chunk) is final for the
  // step only after both; its id, or -1.
  int unit_of_two_chunks() const;
  // Mixed precision: keep bf16 copies of the parameters this rank holds whole (the store's flat
  // buffer; not ZeRO-3's shards), charged to `ledger` as parameters, so that each weight is rounded
  // once per step instead of at every product that reads it; invalidate_bf16_weights() when the
  // parameters may have changed (before every step and evaluation). No-op without bf16.
  void keep_bf16_weights(MemoryLedger* ledger);
  void invalidate_bf16_weights() {
    if (bf16_) bf16_->invalidate_weights();
  }
  // Where an optimizer writes the kept copies as it updates the store's parameters (indexed as
  // them), or null when none are kept; bf16_weights_updated() then names what it wrote, which
  // stays fresh until the next update.
  bf16* bf16_weight_copies() {
    return bf16_ ? bf16_->weight_copies(reinterpret_cast<const float*>(store_.params().data()))
                 : nullptr;
  }
  void bf16_weights_updated(const std::vector<OwnedSegment>& segments) {
    if (bf16_) bf16_->rounded_by_update(segments);
  }
  // Forward only (evaluation) of one micro-batch through `chunk`, with inputs, input and output
  // as forward_chunk; the chunk with the head returns the mean loss against targets (B,T), any
  // other 0. Needs a free slot; keeps nothing.
  double evaluate_chunk(int chunk, const int32_t* inputs, const F* input, F* output,
                        const int32_t* targets);
  /** Elements of the activation between two chunks (and of its gradient). */
  size_t boundary_size() const;
  const GptPart& part() const { return part_; }
  /** The head's copy of the tied wte on a part with the head but not the embedding; -1 otherwise.
   */
  TensorId tied_wte_copy() const { return wte_copy_; }
  /** The tied wte this part holds: the embedding's, or the head's copy of it; -1 if neither or
   *  the head is untied. */
  TensorId tied_wte() const {
    if (!config_.tie_embeddings) return -1;
    return embedding_ ? embedding_->wte() : wte_copy_;
  }
  // Forward only: the mean loss (evaluation).
  double forward_loss(const int32_t* inputs, const int32_t* targets);
  // Forward only: the logits (B,T,Vp/tp) (this rank's vocabulary columns, device memory), valid
  // until the next call.
  const F* forward_logits(const int32_t* inputs);

  /** Generation state: a key/value cache for B sequences of up to max_seq tokens, plus
   *  one-position activations. */
  struct DecodeState;
  std::unique_ptr<DecodeState> make_decode_state(int B = 1) const;
  // tokens is (B) in host memory: position `pos` of each sequence; returns the next-token logits
  // (B,Vp/tp) (this rank's columns, device memory), valid until the next call.
  const F* decode(DecodeState& state, const int32_t* tokens, int pos);

  const GptConfig& config() const { return config_; }
  Backend& backend() const { return backend_; }
  int batch() const { return B_; }
  int seq() const { return T_; }
  Recompute recompute() const { return recompute_; }
  ParamStoreT<F>& store() { return store_; }
  parallel::TensorParallel& tp() { return *tp_; }
  int root_unit() const { return root_unit_; }
  int block_unit(int layer) const { return block_unit_[size_t(layer)]; }  // -1: not held
  /** The unit of a MoE block's experts; -1: a dense block or not held. */
  int expert_unit(int layer) const { return expert_unit_[size_t(layer)]; }
  /** The MoE MLP of a held MoE block (null otherwise), for its routing statistics. */
  const MoeMlp<F>* moe(int layer) const {
    return blocks_[size_t(layer)] ? blocks_[size_t(layer)]->moe() : nullptr;
  }
  /** Clears every MoE block's routing statistics (a step begins). */
  void reset_moe_stats();
  /** Every held MoE block keeps its training micro-batches' decisions in its statistics. */
  void record_moe_routes(bool on);
  size_t activation_bytes() const { return acts_mem_.bytes(); }
  size_t temporary_bytes() const { return tmp_mem_.bytes(); }

 private:
  // One micro-batch's activations in a chunk: the residual stream at every block boundary (x[i] is
  // the input of layer first + i, x.back() the chunk's output), what each block saves, the tokens.
  struct Slot {
    int mb = -1;  // the micro-batch held; -1: free
    std::vector<F*> x;
    std::vector<BlockActs<F>> acts;                 // none/selective: one per layer; full: empty
    Buffer<int32_t> tokens;                         // (B,T): the chunk with the embedding only
    std::vector<std::unique_ptr<MoeRoute>> routes;  // per layer: MoE blocks' routing
  };
  struct ChunkState {
    int first = 0, end = 0;
    bool embedding = false, head = false;
    std::vector<Slot> slots;
  };

  // The constructor's steps: the bf16 operands' scratch, the modules with their tensors, the
  // slots' activations, backward's scratch.
  void reserve_bf16(MemoryLedger* ledger);
  void register_modules(const parallel::LayerEnv<F>& env);
  void allocate_activations(MemoryLedger* ledger);
  void allocate_temporaries(MemoryLedger* ledger);

  bool whole() const;
  // The head's mean loss against targets (B,T) (host memory) after its forward.
  double head_loss(const int32_t* targets);
  void check_whole(const char* what) const;
  Slot& slot_of(int chunk, int mb, bool take);
  // The embedding (or the copied input) and the chunk's blocks into slot s, with hooks.
  void forward_pass(const ChunkState& ch, Slot& s, const int32_t* inputs, const F* input,
                    BlockPass pass);
  // Activations of layer first + i in slot s (with its routing, for a MoE block).
  BlockActs<F> saved_acts(const Slot& s, int first, int i) const;
  // A block's units around its forward and backward: the experts' unit inside the block's.
  void before_forward_block(int layer, int next);
  void after_forward_block(int layer);
  void before_backward_block(int layer, int next);
  void after_backward_block(int layer);

  void before_forward(int unit, int next) {
    if (hooks_) hooks_->before_forward(unit, next);
  }
  void after_forward(int unit) {
    if (hooks_) hooks_->after_forward(unit);
  }
  void before_backward(int unit, int next) {
    if (hooks_) hooks_->before_backward(unit, next);
  }
  // A unit's gradients are final once its weight products have run: now, or in a split
  // backward at its W (WeightGrads::then).
  void after_backward(int unit) {
    if (hooks_) weight_grads_->then([this, unit] { hooks_->after_backward(unit); });
  }
  void end_forward_only() {
    if (hooks_) hooks_->end_forward_only();
  }
  // The embedding's or the head's unit and, on a pipeline's end stage, the tied wte's own unit.
  void before_forward_end(int unit, int next) {
    if (wte_unit_ >= 0) before_forward(wte_unit_, unit);
    before_forward(unit, next);
  }
  void after_forward_end(int unit) {
    after_forward(unit);
    if (wte_unit_ >= 0) after_forward(wte_unit_);
  }
  void before_backward_end(int unit, int next) {
    if (wte_unit_ >= 0) before_backward(wte_unit_, unit);
    before_backward(unit, next);
  }
  void after_backward_end(int unit) {
    after_backward(unit);
    if (wte_unit_ >= 0) after_backward(wte_unit_);
  }

  Backend& backend_;
  Kernels<F>& k_;
  GptConfig config_;
  ParamStoreT<F>& store_;
  int B_, T_;
  Recompute recompute_;
  UnitHooks* hooks_ = nullptr;
  parallel::TensorParallel own_tp_;  // one rank, when none is given
  parallel::TensorParallel* tp_;
  parallel::ExpertParallel own_ep_;  // one rank, when none is given
  parallel::ExpertParallel* ep_;
  parallel::ContextAttention<F>* cp_;

  // Mixed precision (config.bf16): the bf16 copies of a product's operands, charged to the ledger
  // as temporaries; null in fp32.
  std::unique_ptr<Bf16Operands> bf16_;
  std::unique_ptr<WeightGrads<F>> weight_grads_;  // the layers' weight products, now or for W
  AttentionSizes attention_;                      // of one micro-batch
  GptPart part_;
  std::vector<std::unique_ptr<BlockT<F>>> blocks_;  // by layer; null where not held
  std::unique_ptr<EmbeddingT<F>> embedding_;
  std::unique_ptr<HeadT<F>> head_;
  std::vector<int> block_unit_, expert_unit_;
  // The unit of the embedding (with ln_f when the head is here too) and of the head: the same
  // unit on the whole model; -1 where absent. On a part with only one of them the tied wte (or
  // the head's copy) is a unit of its own, so that ZeRO shards it alike on both end stages.
  int root_unit_ = -1, head_unit_ = -1, wte_unit_ = -1;
  TensorId wte_copy_ = -1;

  // Activations: every chunk's slots, and the head's (its forward runs straight into backward).
  Buffer<F> acts_mem_, tmp_mem_;
  Buffer<int32_t> targets_;  // (B,T): the head's targets on the device
  std::vector<ChunkState> chunks_;
  HeadActs<F> head_acts_;
  // Temporaries: the residual-stream gradient, backward scratch, and the activations of the block
  // being run (forward under full recomputation, or recomputed in backward) with its output.
  F* dres_ = nullptr;
  BlockScratch<F> scratch_;
  BlockActs<F> work_acts_, work_moe_acts_;  // full recomputation: a dense block's, a MoE block's
  std::unique_ptr<MoeRoute> work_route_;
  F* work_out_ = nullptr;
};

template <typename F>
struct GptT<F>::DecodeState {
  int B = 1;
  Buffer<F> mem;
  Buffer<int32_t> tokens;         // (B): the positions being fed
  std::vector<KvCache<F>> cache;  // per layer
  BlockActs<F> acts, moe_acts;    // one position per sequence (dense, MoE); att unused
  std::unique_ptr<MoeRoute> route;
  HeadActs<F> head;
  F *x = nullptr, *y = nullptr;  // (B,C): the residual stream in and out of a block
};

/** The training model (f32); GptT<double> serves whole-model gradient checks. */
using Gpt = GptT<float>;

}  // namespace tetra
