#include "core/memory.h"

#include <fstream>
#include <string>

namespace tetra {

const char* mem_category_name(MemCategory c) {
  switch (c) {
    case MemCategory::params:
      return "params";
    case MemCategory::grads:
      return "grads";
    case MemCategory::optimizer:
      return "optimizer";
    case MemCategory::activations:
      return "activations";
    case MemCategory::comm:
      return "comm";
    case MemCategory::temporaries:
      return "temporaries";
  }
  return "?";
}

namespace {

void raise_to(std::atomic<int64_t>& peak, int64_t value) {
  int64_t seen = peak.load();
  while (value > seen && !peak.compare_exchange_weak(seen, value)) {
  }
}

}  // namespace

void MemoryLedger::add(MemCategory c, int64_t bytes) {
  raise_to(peak_[size_t(c)], cur_[size_t(c)].fetch_add(bytes) + bytes);
  raise_to(peak_total_, total_.fetch_add(bytes) + bytes);
}

int64_t MemoryLedger::current_total() const { return total_.load(); }

Rss read_rss() {
  Rss r;
  std::ifstream in("/proc/self/status");
  for (std::string key; in >> key;) {
    int64_t kb = 0;
    if (key == "VmRSS:" && in >> kb) r.current = kb * 1024;
    if (key == "VmHWM:" && in >> kb) r.peak = kb * 1024;
  }
  return r;
}

}  // namespace tetra
