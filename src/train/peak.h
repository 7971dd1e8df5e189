// The machine's measured fp32 matmul rate: the denominator of MFU on CPU. Measured per thread
// count with the same oneDNN path the model uses (best 2048^3 product over a second), cached in
// ~/.cache/tetra/peak.json with the load average it was measured under; a value measured on a
// busy machine is measured again the first time the machine is quiet.
#pragma once

namespace tetra {

/** GFLOP/s of an fp32 2048^3 matmul at `threads` threads (measured or from the cache). */
double fp32_peak_gflops(int threads, bool* from_cache = nullptr);

}  // namespace tetra
