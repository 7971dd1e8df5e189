// The machine's measured fp32 matmul rate: the denominator of MFU on CPU. Measured once per
// thread count with the same oneDNN path the model uses, cached in ~/.cache/tetra/peak.json.
#pragma once

namespace tetra {

/** GFLOP/s of an fp32 2048^3 matmul at `threads` threads (measured or from the cache). */
double fp32_peak_gflops(int threads, bool* from_cache = nullptr);

}  // namespace tetra
