// How context-parallel attention moves a sequence's shards (docs/context_parallel.md): the model
// runs it (parallel/context_parallel.h), the planner prices it, the trainer reads it from
// cp.attention.
#pragma once

#include <cstdint>
#include <string>

namespace tetra {

/** ring: K/V chunks passed around the cp ranks, overlapped with the blocks; all_gather: every
 *  rank's K/V gathered at once; ulysses: all-to-alls from sequence shards to head shards and
 *  back. */
enum class CpAttention : uint8_t { ring, all_gather, ulysses };

/** "ring" | "all_gather" | "ulysses"; throws naming them on anything else. */
CpAttention cp_attention_from_string(const std::string& s);
const char* cp_attention_name(CpAttention a);
/** The name, and for Ulysses groups of `ulysses` < cp ranks (0: cp) with a ring across them the
 *  2-D layout: "ulysses 2 x ring 4". */
std::string cp_attention_label(CpAttention a, int cp, int ulysses);

}  // namespace tetra
