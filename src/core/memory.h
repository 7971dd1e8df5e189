// Memory accounting by category. Every long-lived buffer of a training run is charged to one
// category of the seeds' memory ledger, so the trainer can report what it holds (current and
// high-water mark per category) next to what `tetra plan` predicts for the same model and layout.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

namespace tetra {

enum class MemCategory : uint8_t {
  params,       // parameters this rank holds persistently (full, or its ZeRO-3 shard)
  grads,        // persistent gradients (full, or the ZeRO-2/3 shard)
  optimizer,    // AdamW moments (full, or the ZeRO-1+ shard)
  activations,  // tensors saved by forward for backward, and the logits
  comm,         // communication buffers: gathered parameters, gradient workspaces, scratch
  temporaries,  // backward scratch and recomputation workspaces
};
inline constexpr size_t kMemCategories = 6;
const char* mem_category_name(MemCategory c);

/** Thread-safe byte counters per category with high-water marks. */
class MemoryLedger {
 public:
  void add(MemCategory c, int64_t bytes);
  int64_t current(MemCategory c) const { return cur_[size_t(c)].load(); }
  int64_t peak(MemCategory c) const { return peak_[size_t(c)].load(); }
  int64_t current_total() const;
  int64_t peak_total() const { return peak_total_.load(); }

 private:
  std::array<std::atomic<int64_t>, kMemCategories> cur_{}, peak_{};
  std::atomic<int64_t> total_{0}, peak_total_{0};
};

/** Where a buffer's bytes are charged; a null ledger charges nothing. */
struct MemTag {
  MemoryLedger* ledger = nullptr;
  MemCategory category = MemCategory::temporaries;
};

/** Resident set size of this process now and at its peak (VmRSS, VmHWM), in bytes. */
struct Rss {
  int64_t current = 0, peak = 0;
};
Rss read_rss();

}  // namespace tetra
