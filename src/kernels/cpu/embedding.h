// Token + position embedding (GPT-2 encoder). T is float (training) or double (gradient checks).
#pragma once

#include <cstdint>

namespace tetra::cpu {

// out is (B,T,C); tokens is (B,T); wte is (Vp,C); wpe is (maxT,C). Token t of a row sits at
// position pos0 + t (pos0 > 0 when generation continues a cached sequence).
template <typename F>
void embedding_forward(F* out, const int32_t* tokens, const F* wte, const F* wpe, int B, int T,
                       int C, int pos0 = 0);
// dwte (Vp,C) and dwpe (maxT,C) accumulate dout (B,T,C).
template <typename F>
void embedding_backward(F* dwte, F* dwpe, const F* dout, const int32_t* tokens, int B, int T,
                        int C);

}  // namespace tetra::cpu
