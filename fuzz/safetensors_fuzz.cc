// safetensors reader on arbitrary bytes: a file either parses into tensors whose sizes match
// their shapes, or is refused with tetra::Error.
#include <cstdint>
#include <cstring>
#include <span>

#include "ckpt/safetensors.h"
#include "core/error.h"
#include "fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  tetra::fuzz::quiet_logs();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tetra;
  try {
    const SafeTensorsFile f = parse_safetensors({data, size}, "<fuzz>");
    for (const auto& [name, t] : f.tensors) {
      fuzz::require(t.bytes.size() == size_t(shape_numel(t.shape)) * dtype_size(t.dtype),
                    "tensor bytes match shape");
      if (t.dtype == DType::f32 || t.dtype == DType::bf16 || t.dtype == DType::f64) {
        fuzz::require(t.to_f32().size() == size_t(shape_numel(t.shape)), "to_f32 size");
      }
    }
  } catch (const Error&) {
  }
  return 0;
}
