// Checkpoint manifest.json reader on arbitrary text, beside a fixed 1 KiB rank file: the manifest
// is refused with tetra::Error, or every tensor it describes can be assembled from its chunks and
// verified without reading outside the file.
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "ckpt/checkpoint.h"
#include "core/error.h"
#include "fuzz/fuzz_util.h"

namespace {

std::filesystem::path dir;

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  tetra::fuzz::quiet_logs();
  dir = std::filesystem::temp_directory_path() / ("tetra_ckpt_fuzz_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::atexit([] {
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  });
  std::ofstream rank(dir / "rank-00000.safetensors", std::ios::binary);
  for (int i = 0; i < 256; ++i) {
    const float v = float(i) * 0.25f;
    rank.write(reinterpret_cast<const char*>(&v), sizeof v);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tetra;
  {
    std::ofstream m(dir / "manifest.json", std::ios::binary | std::ios::trunc);
    m.write(reinterpret_cast<const char*>(data), std::streamsize(size));
  }
  try {
    const ckpt::Manifest m = ckpt::Manifest::read(dir);
    ckpt::verify(m);
    uint64_t elements = 0;
    for (const auto& [name, rec] : m.tensors) {
      for (const char* kind : ckpt::kKinds) {
        const std::vector<float> v = ckpt::read_global(m, name, kind);
        fuzz::require(int64_t(v.size()) == shape_numel(rec.shape), "whole tensor assembled");
        elements += v.size();
      }
    }
    fuzz::require(elements * sizeof(float) == m.bytes, "chunks cover the tensors exactly");
  } catch (const Error&) {
  }
  return 0;
}
