#include "train/metrics.h"

#include <filesystem>

#include "core/error.h"
#include "core/log.h"

namespace tetra {

MetricsWriter::MetricsWriter(const std::string& path) : path_(path) {
  namespace fs = std::filesystem;
  if (fs::exists(path)) {
    for (int i = 1;; ++i) {
      std::string aside = path + "." + std::to_string(i);
      if (!fs::exists(aside)) {
        fs::rename(path, aside);
        log_info("[train] kept the previous {} as {}", path, aside);
        break;
      }
    }
  }
  file_ = std::fopen(path.c_str(), "w");
  TETRA_CHECK(file_, "[train] cannot write {}; check that run.dir is writable", path);
}

MetricsWriter::~MetricsWriter() {
  if (file_) std::fclose(file_);
}

void MetricsWriter::write(const nlohmann::json& record) {
  std::string line = record.dump() + "\n";
  std::fwrite(line.data(), 1, line.size(), file_);
  std::fflush(file_);
}

}  // namespace tetra
