// GPT-2 weights in Hugging Face's safetensors layout: names like
// "transformer.h.0.attn.c_attn.weight", Conv1D weights stored (in, out), wte with the real
// (unpadded) vocab, no lm_head (tied).
#pragma once

#include <string>

#include "ckpt/safetensors.h"
#include "model/gpt.h"

namespace tetra {

/** Loads weights into the model; names may carry the "transformer." prefix or not. Refuses
 * missing, unknown or mis-shaped tensors, naming each, before touching the model. */
void load_gpt_safetensors(Gpt& model, const std::string& path);

/** The tensors of a flat buffer laid out like the model's parameters (the weights themselves, or
 * their gradients) in Hugging Face names and layouts. */
SafeTensorsFile gpt_to_safetensors(const Gpt& model, const float* flat);

}  // namespace tetra
