#include "kernels/weight_grads.h"

#include "core/error.h"

namespace tetra {

template <typename F>
void WeightGrads<F>::defer(Key key) {
  TETRA_CHECK(!kept_.count(key),
              "[pipeline] internal: weight gradients of micro-batch {} chunk {} "
              "deferred twice",
              key.first, key.second);
  deferring_ = true;
  key_ = key;
}

template <typename F>
void WeightGrads<F>::stop() {
  deferring_ = false;
}

template <typename F>
std::unique_ptr<Buffer<F>> WeightGrads<F>::take(size_t n) {
  auto it = pool_.find(n);
  if (it == pool_.end()) return std::make_unique<Buffer<F>>(n, tag_, device_);
  std::unique_ptr<Buffer<F>> b = std::move(it->second);
  pool_.erase(it);
  return b;
}

template <typename F>
void WeightGrads<F>::copy_operand(MatOperand& op, int64_t rows, int64_t cols, Kept& into) {
  const F* src = static_cast<const F*>(op.data);
  std::unique_ptr<Buffer<F>> b = take(size_t(rows * cols));
  const int64_t row = op.strides[2], col = op.strides[3];
  if (col == 1) {  // row-major (rows, cols), rows `row` apart
    k_.copy_rows(b->data(), cols, src, row, rows, cols);
    op.strides = {rows * cols, rows * cols, cols, 1};
  } else {
    TETRA_CHECK(row == 1, "[pipeline] internal: a weight-gradient operand with strides ({}, {})",
                row, col);
    // Column-major: the transpose of a row-major (cols, rows), rows `col` apart.
    k_.copy_rows(b->data(), rows, src, col, cols, rows);
    op.strides = {rows * cols, rows * cols, 1, rows};
  }
  op.data = b->data();
  into.copies.push_back(std::move(b));
}

template <typename F>
void WeightGrads<F>::run(std::span<const MatmulArgs> products, bool grouped) {
  if (!deferring_) {
    if (grouped) {
      k_.matmul_group(products);
    } else {
      for (const MatmulArgs& p : products) k_.matmul(p);
    }
    return;
  }
  Kept& kept = kept_[key_];
  Batch batch{{products.begin(), products.end()}, grouped, {}};
  for (MatmulArgs& p : batch.products) {
    TETRA_CHECK(p.b0 == 1 && p.b1 == 1 && p.accumulate && !p.bias,
                "[pipeline] internal: deferred weight-gradient product '{}' is not a 2-D "
                "accumulation",
                p.role);
    copy_operand(p.a, p.M, p.K, kept);
    copy_operand(p.b, p.K, p.N, kept);
  }
  kept.batches.push_back(std::move(batch));
}

template <typename F>
void WeightGrads<F>::then(std::function<void()> after) {
  if (!deferring_) {
    after();
    return;
  }
  kept_[key_].batches.push_back(Batch{{}, false, std::move(after)});
}

template <typename F>
void WeightGrads<F>::flush(Key key) {
  auto it = kept_.find(key);
  if (it == kept_.end()) return;  // a chunk with no weight products (none today)
  for (const Batch& b : it->second.batches) {
    if (b.after) {
      b.after();
    } else if (b.grouped) {
      k_.matmul_group(b.products);
    } else {
      for (const MatmulArgs& p : b.products) k_.matmul(p);
    }
  }
  for (std::unique_ptr<Buffer<F>>& c : it->second.copies) {
    const size_t n = c->size();
    pool_.emplace(n, std::move(c));
  }
  kept_.erase(it);
}

template class WeightGrads<float>;
template class WeightGrads<double>;

}  // namespace tetra
