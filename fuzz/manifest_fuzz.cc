// manifest.json reader on arbitrary text: parses into a manifest whose shards can be found by
// name, or is refused with tetra::Error.
#include <cstdint>
#include <string_view>

#include "core/error.h"
#include "data/manifest.h"
#include "fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  tetra::fuzz::quiet_logs();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tetra;
  try {
    const Manifest m =
        parse_manifest(std::string_view(reinterpret_cast<const char*>(data), size), "<fuzz>");
    fuzz::require(m.eot_token < m.vocab_size, "eot below vocab");
    for (const auto* split : {&m.train, &m.val}) {
      for (const auto& s : *split) {
        fuzz::require(m.find(s.file) == &s, "find returns the entry");
        fuzz::require(s.file.find('/') == std::string::npos, "plain file name");
      }
    }
  } catch (const Error&) {
  }
  return 0;
}
