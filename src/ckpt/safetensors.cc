#include "ckpt/safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string_view>

#include "core/atomic_file.h"
#include "core/error.h"

namespace tetra {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; tetra reads it in place");

namespace {

using nlohmann::json;

// The reference implementation refuses headers over 100 MB so a hostile length cannot make the
// reader allocate and parse without bound; we do the same.
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

constexpr std::string_view kMetadataKey = "__metadata__";

std::string_view safetensors_dtype_name(DType t) {
  switch (t) {
    case DType::f32:
      return "F32";
    case DType::bf16:
      return "BF16";
    case DType::i32:
      return "I32";
    case DType::u16:
      return "U16";
    case DType::u32:
      return "U32";
    case DType::f64:
      return "F64";
  }
  return "?";
}

std::optional<DType> parse_safetensors_dtype(std::string_view name) {
  for (DType t : {DType::f32, DType::bf16, DType::i32, DType::u16, DType::u32, DType::f64}) {
    if (safetensors_dtype_name(t) == name) return t;
  }
  return std::nullopt;
}

/** numel * dtype_size of a header entry, or nullopt when it overflows 64 bits. */
std::optional<uint64_t> byte_size(const Shape& shape, DType dtype) {
  uint64_t n = dtype_size(dtype);
  for (int64_t d : shape) {
    if (__builtin_mul_overflow(n, uint64_t(d), &n)) return std::nullopt;
  }
  return n;
}

/** A file descriptor that closes itself. */
struct Fd {
  int fd = -1;
  explicit Fd(int f) : fd(f) {}
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
};

/** Reads exactly n bytes at offset; false on a short read or an I/O error (errno set). */
bool pread_all(int fd, void* dst, size_t n, uint64_t offset) {
  auto* p = static_cast<uint8_t*>(dst);
  while (n > 0) {
    ssize_t got = ::pread(fd, p, n, off_t(offset));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return false;
    p += got, n -= size_t(got), offset += uint64_t(got);
  }
  return true;
}

/** Where one tensor's bytes lie in the data section, for the coverage check. */
struct Extent {
  uint64_t begin, end;
  const std::string* name;
};

/** Parses the JSON header (the caller has checked it starts with '{', so it is an object),
 * refusing duplicate top-level keys: the spec disallows them, and a JSON parser would otherwise
 * keep only the last one silently. */
json parse_header(const std::string& path, const std::string& text) {
  std::set<std::string> keys;
  std::string duplicate;
  auto on_event = [&](int depth, json::parse_event_t event, json& parsed) {
    if (depth == 1 && event == json::parse_event_t::key && duplicate.empty() &&
        !keys.insert(parsed.get<std::string>()).second) {
      duplicate = parsed.get<std::string>();
    }
    return true;
  };
  json header;
  try {
    header = json::parse(text, on_event);
  } catch (const json::exception& e) {
    fail(
        "[safetensors] {}: the header is not valid JSON ({}); the file is corrupt or not a "
        "safetensors file",
        path, e.what());
  }
  TETRA_CHECK(duplicate.empty(),
              "[safetensors] {}: tensor '{}' appears twice in the header; the file is corrupt",
              path, duplicate);
  return header;
}

/** Reads a JSON array of non-negative integers (shape or data_offsets). */
std::vector<uint64_t> read_uints(const std::string& path, const std::string& name,
                                 const json& entry, const char* field) {
  auto it = entry.find(field);
  TETRA_CHECK(it != entry.end(),
              "[safetensors] {}: tensor '{}' has no \"{}\" field; the file is corrupt", path, name,
              field);
  TETRA_CHECK(it->is_array(),
              "[safetensors] {}: tensor '{}': \"{}\" must be an array, got {}; the file is corrupt",
              path, name, field, it->dump());
  std::vector<uint64_t> out;
  for (const json& v : *it) {
    TETRA_CHECK(v.is_number_unsigned(),
                "[safetensors] {}: tensor '{}': \"{}\" must hold non-negative integers, got {}; "
                "the file is corrupt",
                path, name, field, it->dump());
    out.push_back(v.get<uint64_t>());
  }
  return out;
}

}  // namespace

std::vector<float> SafeTensor::to_f32() const {
  size_t n = bytes.size() / dtype_size(dtype);
  std::vector<float> out(n);
  switch (dtype) {
    case DType::f32:
      std::memcpy(out.data(), bytes.data(), n * sizeof(float));
      break;
    case DType::bf16:
      for (size_t i = 0; i < n; ++i) {
        bf16 b;
        std::memcpy(&b.bits, bytes.data() + 2 * i, 2);
        out[i] = b.to_float();
      }
      break;
    case DType::f64:
      for (size_t i = 0; i < n; ++i) {
        double d;
        std::memcpy(&d, bytes.data() + 8 * i, 8);
        out[i] = float(d);
      }
      break;
    default:
      fail(
          "[safetensors] to_f32: tensor of dtype {} is not floating point; read its bytes "
          "directly",
          dtype_name(dtype));
  }
  return out;
}

SafeTensor safetensor_f32(const Shape& shape, const float* data) {
  SafeTensor t;
  t.dtype = DType::f32;
  t.shape = shape;
  t.bytes.resize(size_t(shape_numel(shape)) * sizeof(float));
  if (!t.bytes.empty()) std::memcpy(t.bytes.data(), data, t.bytes.size());
  return t;
}

namespace {

// Parses a file of file_bytes bytes whose contents read_at(dst, n, offset) fetches (false on
// failure, errno set): one validation path for files and for bytes in memory.
using ReadAt = std::function<bool(void* dst, size_t n, uint64_t offset)>;
SafeTensorsFile parse_safetensors_from(const std::string& path, uint64_t file_bytes,
                                       const ReadAt& read_at) {
  // Layout: u64 header length N | N bytes of JSON | data section.
  TETRA_CHECK(file_bytes >= 8,
              "[safetensors] {}: file has {} bytes, shorter than the 8-byte header length; the "
              "file is truncated or not a safetensors file",
              path, file_bytes);
  uint8_t len_bytes[8];
  TETRA_CHECK(read_at(len_bytes, 8, 0), "[safetensors] {}: read failed ({})", path,
              std::strerror(errno));
  uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; --i) header_bytes = (header_bytes << 8) | len_bytes[i];
  TETRA_CHECK(header_bytes <= kMaxHeaderBytes,
              "[safetensors] {}: header length {} exceeds the 100 MB limit; the file is corrupt "
              "or not a safetensors file",
              path, header_bytes);
  TETRA_CHECK(header_bytes <= file_bytes - 8,
              "[safetensors] {}: header length {} runs past the end of the file ({} bytes); the "
              "file is truncated or not a safetensors file",
              path, header_bytes, file_bytes);
  std::string text(header_bytes, '\0');
  TETRA_CHECK(read_at(text.data(), text.size(), 8), "[safetensors] {}: read failed ({})", path,
              std::strerror(errno));
  TETRA_CHECK(!text.empty() && text[0] == '{',
              "[safetensors] {}: the header does not start with '{{'; the file is not a "
              "safetensors file",
              path);
  const json header = parse_header(path, text);
  const uint64_t data_start = 8 + header_bytes;
  const uint64_t data_bytes = file_bytes - data_start;

  SafeTensorsFile out;
  std::vector<Extent> extents;
  for (const auto& [name, entry] : header.items()) {
    if (name == kMetadataKey) {
      TETRA_CHECK(
          entry.is_object(),
          "[safetensors] {}: \"__metadata__\" must be an object, got {}; the file is corrupt", path,
          entry.dump());
      for (const auto& [k, v] : entry.items()) {
        TETRA_CHECK(v.is_string(),
                    "[safetensors] {}: \"__metadata__\" value of '{}' must be a string, got {}; "
                    "the file is corrupt",
                    path, k, v.dump());
        out.metadata[k] = v.get<std::string>();
      }
      continue;
    }
    TETRA_CHECK(entry.is_object(),
                "[safetensors] {}: tensor '{}' must be an object, got {}; the file is corrupt",
                path, name, entry.dump());
    auto dt = entry.find("dtype");
    TETRA_CHECK(dt != entry.end() && dt->is_string(),
                "[safetensors] {}: tensor '{}' has no string \"dtype\" field; the file is corrupt",
                path, name);
    std::optional<DType> dtype = parse_safetensors_dtype(dt->get<std::string>());
    TETRA_CHECK(dtype.has_value(),
                "[safetensors] {}: tensor '{}' has unsupported dtype '{}'; tetra reads F32, BF16, "
                "I32, U16 and U32 (convert the tensor before loading)",
                path, name, dt->get<std::string>());
    std::vector<uint64_t> dims = read_uints(path, name, entry, "shape");
    std::vector<uint64_t> offsets = read_uints(path, name, entry, "data_offsets");
    TETRA_CHECK(offsets.size() == 2,
                "[safetensors] {}: tensor '{}': \"data_offsets\" must be [begin, end], got {} "
                "values; the file is corrupt",
                path, name, offsets.size());
    const uint64_t begin = offsets[0], end = offsets[1];
    TETRA_CHECK(begin <= end,
                "[safetensors] {}: tensor '{}': data_offsets [{}, {}] are inverted (begin > end); "
                "the file is corrupt",
                path, name, begin, end);
    TETRA_CHECK(end <= data_bytes,
                "[safetensors] {}: tensor '{}': data_offsets [{}, {}] run past the data section "
                "({} bytes); the file is truncated",
                path, name, begin, end, data_bytes);
    Shape shape;
    for (uint64_t d : dims) {
      TETRA_CHECK(d <= uint64_t(INT64_MAX),
                  "[safetensors] {}: tensor '{}': dimension {} too large; the file is corrupt",
                  path, name, d);
      shape.push_back(int64_t(d));
    }
    std::optional<uint64_t> expected = byte_size(shape, *dtype);
    TETRA_CHECK(expected.has_value(),
                "[safetensors] {}: tensor '{}': shape {} overflows 64 bits; the file is corrupt",
                path, name, shape_str(shape));
    TETRA_CHECK(end - begin == *expected,
                "[safetensors] {}: tensor '{}': data_offsets [{}, {}] span {} bytes but shape {} "
                "of {} needs {} bytes; the file is corrupt",
                path, name, begin, end, end - begin, shape_str(shape), dt->get<std::string>(),
                *expected);
    SafeTensor& t = out.tensors[name];
    t.dtype = *dtype;
    t.shape = std::move(shape);
    extents.push_back({begin, end, &out.tensors.find(name)->first});
  }

  // The spec requires the tensors to tile the data section exactly: no overlap (which would let
  // two names alias one buffer), no gap and no trailing bytes (which would let a file hide a
  // second payload).
  std::sort(extents.begin(), extents.end(), [](const Extent& a, const Extent& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t covered = 0;
  const std::string* prev = nullptr;
  for (const Extent& e : extents) {
    TETRA_CHECK(e.begin >= covered,
                "[safetensors] {}: tensor '{}' (bytes [{}, {})) overlaps tensor '{}' (which ends "
                "at {}); the file is corrupt",
                path, *e.name, e.begin, e.end, prev ? *prev : "", covered);
    TETRA_CHECK(e.begin == covered,
                "[safetensors] {}: {} unused bytes in the data section before tensor '{}' (at {}); "
                "safetensors data must be contiguous, the file is corrupt",
                path, e.begin - covered, *e.name, e.begin);
    covered = e.end;
    prev = e.name;
  }
  TETRA_CHECK(covered == data_bytes,
              "[safetensors] {}: {} trailing bytes after the last tensor (tensors cover {} of {} "
              "data bytes); the file is corrupt or was appended to",
              path, data_bytes - covered, covered, data_bytes);

  for (const Extent& e : extents) {
    SafeTensor& t = out.tensors.find(*e.name)->second;
    t.bytes.resize(e.end - e.begin);
    TETRA_CHECK(read_at(t.bytes.data(), t.bytes.size(), data_start + e.begin),
                "[safetensors] {}: reading tensor '{}' failed ({})", path, *e.name,
                std::strerror(errno));
  }
  return out;
}

}  // namespace

SafeTensorsFile read_safetensors(const std::string& path) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  TETRA_CHECK(fd.fd >= 0, "[safetensors] {}: cannot open ({}); check the path", path,
              std::strerror(errno));
  struct stat st {};
  TETRA_CHECK(::fstat(fd.fd, &st) == 0 && S_ISREG(st.st_mode),
              "[safetensors] {}: not a regular file", path);
  return parse_safetensors_from(
      path, uint64_t(st.st_size),
      [&](void* dst, size_t n, uint64_t offset) { return pread_all(fd.fd, dst, n, offset); });
}

SafeTensorsFile parse_safetensors(std::span<const uint8_t> bytes, const std::string& origin) {
  return parse_safetensors_from(origin, bytes.size(), [&](void* dst, size_t n, uint64_t offset) {
    if (offset > bytes.size() || n > bytes.size() - offset) {
      errno = EIO;
      return false;
    }
    if (n > 0) std::memcpy(dst, bytes.data() + offset, n);
    return true;
  });
}

void write_safetensors(const std::string& path, const SafeTensorsFile& file) {
  json header = json::object();
  if (!file.metadata.empty()) header[std::string(kMetadataKey)] = file.metadata;
  uint64_t offset = 0;
  for (const auto& [name, t] : file.tensors) {
    TETRA_CHECK(!name.empty() && name != kMetadataKey,
                "[safetensors] {}: cannot write a tensor named '{}'; rename it", path, name);
    bool dims_ok = std::all_of(t.shape.begin(), t.shape.end(), [](int64_t d) { return d >= 0; });
    std::optional<uint64_t> expected = dims_ok ? byte_size(t.shape, t.dtype) : std::nullopt;
    TETRA_CHECK(expected && *expected == t.bytes.size(),
                "[safetensors] {}: tensor '{}' has {} bytes but shape {} of {} needs {}; fix the "
                "tensor before saving",
                path, name, t.bytes.size(), shape_str(t.shape), dtype_name(t.dtype),
                expected ? fmt::to_string(*expected) : std::string("an invalid size"));
    header[name] = {{"dtype", safetensors_dtype_name(t.dtype)},
                    {"shape", t.shape},
                    {"data_offsets", {offset, offset + t.bytes.size()}}};
    offset += t.bytes.size();
  }
  std::string text = header.dump();
  // Space padding keeps the data section 8-byte aligned, so a reader that maps the file can use
  // the tensors in place.
  text.append((8 - text.size() % 8) % 8, ' ');
  uint8_t len_bytes[8];
  for (int i = 0; i < 8; ++i) len_bytes[i] = uint8_t(uint64_t(text.size()) >> (8 * i));

  std::vector<std::span<const uint8_t>> parts = {
      {len_bytes, 8}, {reinterpret_cast<const uint8_t*>(text.data()), text.size()}};
  for (const auto& [name, t] : file.tensors) parts.emplace_back(t.bytes.data(), t.bytes.size());
  write_file_atomically(path, parts, "safetensors");
}

}  // namespace tetra
