// Weight-gradient products, run now or kept for later: the zero-bubble pipeline schedules
// (docs/pipeline.md) split a chunk's backward into B, the input gradients the previous stage
// waits for, and W, the weight gradients nobody waits for. A layer hands its weight-gradient
// products (dW += dyᵀ·x, accumulating into the parameter's gradient) to WeightGrads instead of
// running them; outside a deferral they run at once, exactly as before. While a deferral is open
// for a key (micro-batch, chunk), each product's two operands are copied into buffers of their
// own (the activations and gradients they read are scratch that the rest of the backward
// overwrites, or a slot the backward frees) and the product is kept; flush(key) runs that key's
// products in the order given, on the same operands, and returns the buffers to a pool. The
// gradients are therefore bit for bit those of the unsplit backward when the keys are flushed in
// the order their backwards ran. What must follow a layer's weight gradients (a unit's gradients
// final: the data-parallel reduction may start) is handed over with then(): kept in its place
// among the products, or run at once outside a deferral.
#pragma once

#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "core/arena.h"
#include "core/device.h"
#include "kernels/kernels.h"

namespace tetra {

template <typename F>
class WeightGrads {
 public:
  using Key = std::pair<int, int>;  // (micro-batch, chunk)

  /** Operand copies on `device`, charged to `tag` (activations: they are held from B to W). */
  WeightGrads(Kernels<F>& kernels, Device& device, MemTag tag = {})
      : k_(kernels), device_(device), tag_(tag) {}

  /** Weight-gradient products from now on are kept for `key` until flush(key). */
  void defer(Key key);
  /** Weight-gradient products from now on run at once. */
  void stop();
  /** Runs `products` (2-D, accumulating into parameter gradients) as one group now, or keeps
   *  them with copies of their operands while a deferral is open. */
  void run(std::span<const MatmulArgs> products, bool grouped = false);
  /** Runs `after` once every product handed over before it has run: now, or in its place when
   *  the open deferral's key is flushed. */
  void then(std::function<void()> after);
  /** Runs the products kept for `key` and what was handed to then() between them, in the order
   *  given, and frees their operands' copies. */
  void flush(Key key);

 private:
  struct Batch {
    std::vector<MatmulArgs> products;
    bool grouped = false;
    std::function<void()> after;  // then(): after the batches before it
  };
  struct Kept {
    std::vector<Batch> batches;
    std::vector<std::unique_ptr<Buffer<F>>> copies;
  };
  // A copy of operand `op` of (rows, cols) into a buffer of its own, `op` rewritten to read it.
  void copy_operand(MatOperand& op, int64_t rows, int64_t cols, Kept& into);
  std::unique_ptr<Buffer<F>> take(size_t n);

  Kernels<F>& k_;
  Device& device_;
  MemTag tag_;
  bool deferring_ = false;
  Key key_{-1, -1};
  std::map<Key, Kept> kept_;
  std::multimap<size_t, std::unique_ptr<Buffer<F>>> pool_;  // by elements
};

}  // namespace tetra
