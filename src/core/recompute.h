// Activation recomputation: what a model keeps from forward for backward. The model runs it,
// the planner prices it (memory and FLOPs), the trainer reads it from train.recompute.
#pragma once

#include <cstdint>
#include <string>

namespace tetra {

/** none: keep every activation; selective: drop the attention probabilities (B·NH·T² per block)
 *  and recompute them in backward; full: keep only each block's input and rerun the block. */
enum class Recompute : uint8_t { none, selective, full };

/** "none" | "selective" | "full"; `key` names the config key in the error. */
Recompute parse_recompute(const std::string& text, const std::string& key);
const char* recompute_name(Recompute r);

}  // namespace tetra
