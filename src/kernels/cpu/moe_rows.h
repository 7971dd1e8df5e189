// Moving token rows between tokens and experts for a mixture-of-experts block (kernels/kernels.h,
// "mixture of experts"): a gather by index, the gate-weighted combine and its backward. Each
// output row is written by one thread, so results do not depend on the thread count.
// F is float (training) or double (gradient checks).
#pragma once

#include <cstdint>

namespace tetra::cpu {

// out (rows,C): row i = in[idx[i]], zeros where idx[i] < 0.
template <typename F>
void gather_rows(F* out, const F* in, const int32_t* idx, int64_t rows, int C);
// out (N,C) += Σ_j gate[t·k+j] · in[pos[t·k+j]] over the choices with pos >= 0 (gate null: 1).
template <typename F>
void moe_combine(F* out, const F* in, const int32_t* pos, const F* gate, int64_t N, int k, int C);
// din[p] = gate · dout[t], dgate = dout[t] · in[p] for each choice with p = pos >= 0; dgate 0
// elsewhere.
template <typename F>
void moe_combine_backward(F* din, F* dgate, const F* dout, const F* in, const int32_t* pos,
                          const F* gate, int64_t N, int k, int C);

}  // namespace tetra::cpu
