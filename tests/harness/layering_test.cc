// The layer diagram of docs/ARCHITECTURE.md as a test: every `#include "<layer>/..."` under src/
// must be of the file's own layer or of one the page's layering table lets it include, so the
// page and the code cannot drift apart; and the device seam holds: no backend's own names
// (`cpu::`, `kernels/cpu/`; `cuda::`, `kernels/cuda/` but in the NCCL groups of src/comm/nccl/)
// outside src/kernels/, and no raw byte copies (memcpy, memmove) of
// tensor data outside the layers whose bytes are not tensors on a device (the backends, the
// host device, MPI messages, token and file bytes).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;

const fs::path kSource = TETRA_SOURCE_DIR;

std::string read(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string trim(std::string s) {
  const auto b = s.find_first_not_of(" \t");
  const auto e = s.find_last_not_of(" \t");
  return b == std::string::npos ? "" : s.substr(b, e - b + 1);
}

// The table after the "layering" marker: layer -> the layers it may include.
std::map<std::string, std::set<std::string>> layering_table() {
  const std::string page = read(kSource / "docs/ARCHITECTURE.md");
  const size_t at = page.find("<!-- layering:");
  EXPECT_NE(at, std::string::npos) << "docs/ARCHITECTURE.md has no layering table";
  std::map<std::string, std::set<std::string>> table;
  std::istringstream lines(page.substr(at == std::string::npos ? page.size() : at));
  std::string line;
  std::getline(lines, line);  // the marker
  while (std::getline(lines, line) && !line.empty() && line[0] == '|') {
    std::vector<std::string> cells;
    std::stringstream row(line.substr(1));
    for (std::string cell; std::getline(row, cell, '|');) cells.push_back(trim(cell));
    if (cells.size() < 2 || cells[0] == "layer" || cells[0].starts_with("---")) continue;
    std::set<std::string>& allowed = table[cells[0]];
    std::stringstream list(cells[1]);
    for (std::string dep; std::getline(list, dep, ',');) {
      if (!trim(dep).empty()) allowed.insert(trim(dep));
    }
  }
  return table;
}

struct SourceFile {
  std::string layer;
  fs::path path;  // relative to src/
  std::string text;
};

std::vector<SourceFile> sources() {
  std::vector<SourceFile> out;
  for (const auto& e : fs::recursive_directory_iterator(kSource / "src")) {
    const std::string ext = e.path().extension().string();
    if (!e.is_regular_file() || (ext != ".h" && ext != ".cc" && ext != ".cu" && ext != ".cuh")) {
      continue;
    }
    const fs::path rel = fs::relative(e.path(), kSource / "src");
    out.push_back({rel.begin()->string(), rel, read(e.path())});
  }
  return out;
}

// The text without comments and string literals, line structure kept.
std::string code_only(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    if (text.compare(i, 2, "//") == 0) {
      while (i < text.size() && text[i] != '\n') ++i;
      out += '\n';
    } else if (text.compare(i, 2, "/*") == 0) {
      const size_t end = text.find("*/", i + 2);
      for (size_t j = i; j < std::min(end, text.size()); ++j) {
        if (text[j] == '\n') out += '\n';
      }
      i = end == std::string::npos ? text.size() : end + 1;
    } else if (text[i] == '"') {
      out += '"';
      for (++i; i < text.size() && text[i] != '"'; ++i) {
        if (text[i] == '\\') ++i;
      }
      out += '"';
    } else {
      out += text[i];
    }
  }
  return out;
}

TEST(Layering, EveryIncludeFollowsTheArchitecturePage) {
  const auto table = layering_table();
  ASSERT_FALSE(table.empty());
  const std::regex include(R"(#include\s+"([a-z_]+)/)");
  int checked = 0;
  for (const SourceFile& f : sources()) {
    auto it = table.find(f.layer);
    ASSERT_NE(it, table.end()) << "src/" << f.layer << " is a folder the layering table lacks";
    for (std::sregex_iterator m(f.text.begin(), f.text.end(), include), end; m != end; ++m) {
      const std::string target = (*m)[1];
      ++checked;
      if (target == f.layer) continue;
      EXPECT_TRUE(it->second.count(target))
          << "src/" << f.path.string() << " includes " << target
          << "/, which the layering table of docs/ARCHITECTURE.md does not let " << f.layer
          << " include";
      // comm reaches kernels only for the CUDA backend's compute stream.
      if (f.layer == "comm" && target == "kernels") {
        EXPECT_TRUE(f.path.string().starts_with("comm/nccl/"))
            << "src/" << f.path.string() << ": only comm/nccl/ may include kernels/";
      }
    }
  }
  EXPECT_GT(checked, 200);
}

TEST(Layering, NoBackendNamesOutsideTheKernels) {
  int files = 0;
  for (const SourceFile& f : sources()) {
    if (f.layer == "kernels") continue;
    ++files;
    const std::string code = code_only(f.text);
    EXPECT_EQ(f.text.find("#include \"kernels/cpu/"), std::string::npos)
        << "src/" << f.path.string() << " includes a CPU kernel header: call the backend's table";
    EXPECT_EQ(code.find("cpu::"), std::string::npos)
        << "src/" << f.path.string() << " names cpu::: call the backend's table";
    // The CUDA backend's own names: its kernels, and the NCCL groups that order their streams
    // after its compute stream (comm/nccl/); nothing else reaches past the device seam.
    if (f.path.string().starts_with("comm/nccl/")) continue;
    EXPECT_EQ(f.text.find("#include \"kernels/cuda/"), std::string::npos)
        << "src/" << f.path.string() << " includes a CUDA kernel header: call the backend's table";
    EXPECT_EQ(code.find("cuda::"), std::string::npos)
        << "src/" << f.path.string() << " names cuda::: call the backend's table or the Device";
    // A CUDA build differs from a CPU one in the kernels and comm/nccl/ only: the MPI backend
    // reaches device buffers through its DeviceLink (comm/device_link.h), null without CUDA.
    EXPECT_EQ(f.text.find("TETRA_HAVE_CUDA"), std::string::npos)
        << "src/" << f.path.string()
        << " branches on TETRA_HAVE_CUDA: put the difference behind the backend or the link";
  }
  EXPECT_GT(files, 100);
}

TEST(Layering, TensorDataMovesThroughTheDevice) {
  // Layers whose byte copies are not tensors on a device: the backends, the host device itself,
  // MPI messages, token and file bytes.
  const std::set<std::string> raw_bytes = {"kernels", "comm", "data", "ckpt"};
  for (const SourceFile& f : sources()) {
    if (raw_bytes.count(f.layer) || f.path == "core/device.cc") continue;
    const std::string code = code_only(f.text);
    for (const char* call : {"memcpy", "memmove"}) {
      EXPECT_EQ(code.find(call), std::string::npos)
          << "src/" << f.path.string() << " calls " << call
          << ": copy tensor data with the backend (Kernels::copy, Device::to_host/from_host)";
    }
  }
}

}  // namespace
