// The library each product runs on (kernels/cpu/matmul.h), chosen by measuring every library
// that can run it, once per machine, and kept in $XDG_CACHE_HOME/tetra/matmul.json (default
// $HOME/.cache/tetra/matmul.json) in the style of the peak cache (core/machine_cache.h):
//
//   {"schema": 3, "machine": "<CPU model> (oneDNN <ISA>, OpenBLAS <core>)",
//    "products": {"<key>": {"library": "openblas-split", "role": "mlp.c_fc weight grad",
//                           "gflops": {"onednn": 31.2, "openblas": 74.9, "onednn-copy": 52.0,
//                                      "onednn-split": 40.1, "openblas-split": 80.3},
//                           "measured_at": "2025-01-31T12:00:00Z"}, ...}}
//
// A key names what the rate depends on: the shape, the batch, A's and B's layout, a bias, bf16
// operands and the thread count (matmul_choice_key). A product is measured on the caller's A and B
// with a scratch C, so nothing the caller holds changes, in two rounds over the libraries (each
// keeps its best), so that a burst of other work slows one run of each rather than every run of
// one. Processes sharing the cache take a lock around a measurement and read the file again under
// it, so the ranks of a job on one machine measure each product once and run the same library. A
// damaged entry or file is measured again with a warning; another machine's or an older-format file
// is measured again and replaced.
#pragma once

#include <filesystem>
#include <functional>
#include <string>
#include <unordered_map>

#include "kernels/cpu/matmul.h"

namespace tetra::cpu {

/** "<M>x<K>x<N> b<batch> <A layout><B layout>[ bias][ bf16] t<threads>", layouts n (row-major), t
 *  (transposed) or s (other strides), e.g. "1024x768x3072 b1 nt bias t2"; " bf16" for a product
 *  of bf16 operands. */
std::string matmul_choice_key(const MatmulArgs& x, int threads);

/** What the choice reads from the machine; tests substitute their own. */
struct MatmulChoiceSource {
  std::function<double(MatmulLib, const MatmulArgs&)> measure;  // GFLOP/s of one library
  std::string machine;  // another machine's cache is measured again
};
/** The real machine: the best of repeated runs into a scratch C; matmul_machine(). */
MatmulChoiceSource machine_matmul_source();
/** machine_cache_path("matmul.json"). */
std::filesystem::path matmul_cache_path();

class MatmulChooser {
 public:
  /** No cache file when `cache` is empty: each product is measured once per process. */
  MatmulChooser(std::filesystem::path cache, MatmulChoiceSource source);

  /** The fastest library for this f32 product: remembered, read from the cache, or measured
   *  now and cached. */
  MatmulLib choose(const MatmulArgs& x);
  /** Products this object measured (not found in memory or in the cache). */
  int measured() const { return measured_; }

 private:
  // Reads the file's entries for this machine into known_; says why when it holds none.
  void load(bool warn);

  std::filesystem::path cache_;
  MatmulChoiceSource source_;
  std::unordered_map<std::string, MatmulLib> known_;
  bool loaded_ = false;
  int measured_ = 0;
};

/** The process's chooser: matmul_cache_path() and the real machine. */
MatmulChooser& matmul_chooser();

}  // namespace tetra::cpu
