// Model weights in Hugging Face's safetensors layout: names like
// "transformer.h.0.attn.c_attn.weight", Conv1D weights stored (in, out), wte with the real
// (unpadded) vocab, no lm_head (tied). Reading and writing go through the parameter store's
// tensor specs (global name, shape, file layout), so any model registered there and any way the
// store is sharded load the same file.
#pragma once

#include <string>

#include "ckpt/safetensors.h"
#include "core/param_store.h"
#include "parallel/tensor_parallel.h"

namespace tetra {

/** Loads every registered tensor from `path` into the store (each rank keeps what it holds).
 * Names may carry the "transformer." prefix or not. Refuses, before touching the store, missing,
 * unknown or mis-shaped tensors (naming each; `describe` says what the model is) and any NaN or
 * infinity (naming the tensor and the element). */
void load_safetensors_into(ParamStore& store, const std::string& path, const std::string& describe);

/** The tensors of a flat buffer laid out like the store's full (unsharded) layout — the weights
 * themselves, or their gradients — in Hugging Face names and file layouts. `check_finite` refuses
 * a NaN or infinity, naming the tensor and element. Tensor-parallel slices are assembled into the
 * global tensors over `tp` (collective: every rank of the group calls it; each gets the file). */
SafeTensorsFile store_to_safetensors(const ParamStore& store, const float* flat,
                                     bool check_finite = false,
                                     parallel::TensorParallel* tp = nullptr);

}  // namespace tetra
