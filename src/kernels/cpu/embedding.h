// Token + position embedding (GPT-2 encoder). T is float (training) or double (gradient checks).
#pragma once

#include <cstdint>

namespace tetra::cpu {

// out is (B,T,C); tokens is (B,T); wte is (Vl,C), rows [v0, v0+Vl) of the vocabulary (a
// vocabulary-parallel slice; Vl <= 0: every row, v0 = 0); a token outside them contributes zero.
// wpe is (maxT,C), or null to add no positions. Token t of a row sits at position pos0 + t (pos0 >
// 0 when generation continues a cached sequence).
template <typename F>
void embedding_forward(F* out, const int32_t* tokens, const F* wte, const F* wpe, int B, int T,
                       int C, int pos0 = 0, int v0 = 0, int Vl = 0);
// dwte (Vl,C) (rows [v0, v0+Vl) as above) and dwpe (maxT,C) accumulate dout (B,T,C).
template <typename F>
void embedding_backward(F* dwte, F* dwpe, const F* dout, const int32_t* tokens, int B, int T, int C,
                        int v0 = 0, int Vl = 0);

}  // namespace tetra::cpu
