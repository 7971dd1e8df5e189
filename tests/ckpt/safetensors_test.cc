#include "ckpt/safetensors.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "core/error.h"

namespace tetra {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::path(::testing::TempDir()) /
           fmt::format("tetra_safetensors_{}_{}", ::getpid(), info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string file(const std::string& name) const { return (dir_ / name).string(); }

  /** Writes u64 length + header + data, with no validation: the way to build corrupt files. */
  std::string write_raw(const std::string& header, const std::string& data = "",
                        uint64_t header_len_override = UINT64_MAX) {
    std::string path = file("raw.safetensors");
    uint64_t n = header_len_override == UINT64_MAX ? header.size() : header_len_override;
    std::ofstream out(path, std::ios::binary);
    for (int i = 0; i < 8; ++i) out.put(char(n >> (8 * i)));
    out << header << data;
    return path;
  }

  /** The error message read_safetensors gives for a file, or "" when it reads fine. */
  static std::string read_error(const std::string& path) {
    try {
      read_safetensors(path);
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  }

  fs::path dir_;
};

SafeTensor make_tensor(DType dtype, const Shape& shape, uint8_t seed) {
  SafeTensor t;
  t.dtype = dtype;
  t.shape = shape;
  t.bytes.resize(size_t(shape_numel(shape)) * dtype_size(dtype));
  for (size_t i = 0; i < t.bytes.size(); ++i) t.bytes[i] = uint8_t(seed + 7 * i);
  return t;
}

TEST_F(SafetensorsTest, RoundTripF32WithMetadata) {
  std::vector<float> w = {1.5f, -2.25f, 3.0f, 0.0f, 1e-30f, -7.0f};
  float scalar = 42.0f;
  SafeTensorsFile f;
  f.tensors["wte"] = safetensor_f32({2, 3}, w.data());
  f.tensors["scalar"] = safetensor_f32({}, &scalar);
  f.tensors["empty"] = safetensor_f32({0, 4}, nullptr);
  f.metadata["format"] = "pt";
  f.metadata["step"] = "1200";
  std::string path = file("a.safetensors");
  write_safetensors(path, f);

  SafeTensorsFile g = read_safetensors(path);
  EXPECT_EQ(g.metadata, f.metadata);
  ASSERT_EQ(g.tensors.size(), 3u);
  EXPECT_EQ(g.tensors["wte"].dtype, DType::f32);
  EXPECT_EQ(g.tensors["wte"].shape, (Shape{2, 3}));
  EXPECT_EQ(g.tensors["wte"].to_f32(), w);
  EXPECT_EQ(g.tensors["scalar"].shape, Shape{});
  EXPECT_EQ(g.tensors["scalar"].to_f32(), std::vector<float>{42.0f});
  EXPECT_EQ(g.tensors["empty"].shape, (Shape{0, 4}));
  EXPECT_TRUE(g.tensors["empty"].bytes.empty());

  // The header is space-padded so the data section starts 8-byte aligned.
  std::ifstream in(path, std::ios::binary);
  uint64_t n = 0;
  in.read(reinterpret_cast<char*>(&n), 8);
  EXPECT_EQ(n % 8, 0u);
  EXPECT_EQ(fs::file_size(path), 8 + n + 6 * 4 + 4);
}

TEST_F(SafetensorsTest, RoundTripBf16AndIntegers) {
  std::vector<float> values = {1.0f, -0.5f, 3.14159265f, 1.0f / 3.0f, 65504.0f, -1e-3f};
  SafeTensor b;
  b.dtype = DType::bf16;
  b.shape = {3, 2};
  for (float v : values) {
    bf16 h = bf16::from_float(v);
    b.bytes.push_back(uint8_t(h.bits));
    b.bytes.push_back(uint8_t(h.bits >> 8));
  }
  SafeTensorsFile f;
  f.tensors["h.0.attn.bf16"] = b;
  f.tensors["i32"] = make_tensor(DType::i32, {5}, 1);
  f.tensors["u16"] = make_tensor(DType::u16, {3, 1}, 2);
  f.tensors["u32"] = make_tensor(DType::u32, {2, 2, 2}, 3);
  std::string path = file("b.safetensors");
  write_safetensors(path, f);

  SafeTensorsFile g = read_safetensors(path);
  ASSERT_EQ(g.tensors.size(), 4u);
  for (const auto& [name, t] : f.tensors) {
    SCOPED_TRACE(name);
    EXPECT_EQ(g.tensors[name].dtype, t.dtype);
    EXPECT_EQ(g.tensors[name].shape, t.shape);
    EXPECT_EQ(g.tensors[name].bytes, t.bytes);
  }
  std::vector<float> back = g.tensors["h.0.attn.bf16"].to_f32();
  for (size_t i = 0; i < values.size(); ++i) {
    EXPECT_EQ(back[i], bf16::from_float(values[i]).to_float());
    EXPECT_NEAR(back[i], values[i], std::abs(values[i]) / 128);
  }
  EXPECT_THROW(g.tensors["i32"].to_f32(), Error);
}

TEST_F(SafetensorsTest, WriteReplacesAtomically) {
  std::string path = file("c.safetensors");
  float one = 1.0f, two = 2.0f;
  SafeTensorsFile f;
  f.tensors["x"] = safetensor_f32({1}, &one);
  write_safetensors(path, f);
  f.tensors["x"] = safetensor_f32({1}, &two);
  write_safetensors(path, f);
  EXPECT_EQ(read_safetensors(path).tensors["x"].to_f32(), std::vector<float>{2.0f});
  EXPECT_EQ(std::distance(fs::directory_iterator(dir_), fs::directory_iterator()), 1)
      << "a temporary file was left behind";
}

TEST_F(SafetensorsTest, WriteRefusesInconsistentTensor) {
  SafeTensorsFile f;
  f.tensors["bad"] = make_tensor(DType::f32, {2, 2}, 0);
  f.tensors["bad"].bytes.pop_back();
  try {
    write_safetensors(file("d.safetensors"), f);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("tensor 'bad' has 15 bytes but shape (2, 2) of f32 needs 16"));
  }
  EXPECT_FALSE(fs::exists(file("d.safetensors")));
}

TEST_F(SafetensorsTest, ParsesFromMemoryAsFromAFile) {
  SafeTensorsFile f;
  f.tensors["w"] = make_tensor(DType::f32, {3, 2}, 9);
  f.metadata["format"] = "pt";
  const std::string path = file("m.safetensors");
  write_safetensors(path, f);
  std::ifstream in(path, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto* p = reinterpret_cast<const uint8_t*>(bytes.data());
  const SafeTensorsFile g = parse_safetensors({p, bytes.size()}, "<mem>");
  EXPECT_EQ(g.tensors.at("w").bytes, f.tensors.at("w").bytes);
  EXPECT_EQ(g.metadata, f.metadata);
  try {
    parse_safetensors({p, bytes.size() - 1}, "<mem>");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("[safetensors] <mem>: tensor 'w': data_offsets [0, 24] run "
                                    "past the data section (23 bytes)"));
  }
}

TEST_F(SafetensorsTest, RefusesMissingFile) {
  EXPECT_THAT(read_error(file("nope.safetensors")), HasSubstr("cannot open"));
}

TEST_F(SafetensorsTest, RefusesShortFile) {
  std::string path = file("short.safetensors");
  std::ofstream(path, std::ios::binary) << "abc";
  std::string err = read_error(path);
  EXPECT_THAT(err, HasSubstr("[safetensors] " + path));
  EXPECT_THAT(err, HasSubstr("file has 3 bytes, shorter than the 8-byte header length"));
}

TEST_F(SafetensorsTest, RefusesHeaderLengthBeyondFile) {
  std::string path = write_raw("{}", "", 1000);
  EXPECT_THAT(read_error(path), HasSubstr("header length 1000 runs past the end of the file"));
  path = write_raw("{}", "", uint64_t(1) << 40);
  EXPECT_THAT(read_error(path), HasSubstr("exceeds the 100 MB limit"));
}

TEST_F(SafetensorsTest, RefusesInvalidJson) {
  EXPECT_THAT(read_error(write_raw(R"({"a": {"dtype": "F32",)")),
              HasSubstr("the header is not valid JSON"));
  EXPECT_THAT(read_error(write_raw(R"([1, 2])")), HasSubstr("does not start with '{'"));
  EXPECT_THAT(read_error(write_raw("")), HasSubstr("does not start with '{'"));
}

TEST_F(SafetensorsTest, RefusesDuplicateTensor) {
  std::string h = R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                      "a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})";
  EXPECT_THAT(read_error(write_raw(h, std::string(8, '\0'))), HasSubstr("'a' appears twice"));
}

TEST_F(SafetensorsTest, RefusesMissingFields) {
  std::string four(4, '\0');
  EXPECT_THAT(read_error(write_raw(R"({"a": {"shape": [1], "data_offsets": [0, 4]}})", four)),
              HasSubstr("tensor 'a' has no string \"dtype\" field"));
  EXPECT_THAT(read_error(write_raw(R"({"a": {"dtype": "F32", "data_offsets": [0, 4]}})", four)),
              HasSubstr("tensor 'a' has no \"shape\" field"));
  EXPECT_THAT(read_error(write_raw(R"({"a": {"dtype": "F32", "shape": [1]}})", four)),
              HasSubstr("tensor 'a' has no \"data_offsets\" field"));
  EXPECT_THAT(read_error(write_raw(R"({"a": [1, 2]})", four)),
              HasSubstr("tensor 'a' must be an object"));
}

TEST_F(SafetensorsTest, RefusesUnknownDtype) {
  std::string h = R"({"a": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]}})";
  EXPECT_THAT(read_error(write_raw(h, std::string(4, '\0'))),
              HasSubstr("tensor 'a' has unsupported dtype 'F16'"));
}

TEST_F(SafetensorsTest, RefusesBadShapeAndOffsetValues) {
  std::string four(4, '\0');
  EXPECT_THAT(read_error(write_raw(
                  R"({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}})", four)),
              HasSubstr("\"shape\" must hold non-negative integers"));
  EXPECT_THAT(
      read_error(write_raw(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0]}})", four)),
      HasSubstr("\"data_offsets\" must be [begin, end], got 1 values"));
  EXPECT_THAT(
      read_error(write_raw(
          R"({"a": {"dtype": "F32", "shape": [4294967296, 4294967296], "data_offsets": [0, 4]}})",
          four)),
      HasSubstr("overflows 64 bits"));
}

TEST_F(SafetensorsTest, RefusesInvertedOffsets) {
  std::string h = R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}})";
  EXPECT_THAT(read_error(write_raw(h, std::string(4, '\0'))),
              HasSubstr("data_offsets [4, 0] are inverted"));
}

TEST_F(SafetensorsTest, RefusesOffsetsPastData) {
  // Also the shape of a truncated download: the header promises more data than there is.
  std::string h = R"({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})";
  EXPECT_THAT(read_error(write_raw(h, std::string(10, '\0'))),
              HasSubstr("data_offsets [0, 16] run past the data section (10 bytes)"));
}

TEST_F(SafetensorsTest, RefusesSizeMismatch) {
  std::string h = R"({"a": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 8]}})";
  EXPECT_THAT(read_error(write_raw(h, std::string(8, '\0'))),
              HasSubstr("span 8 bytes but shape (3) of BF16 needs 6 bytes"));
}

TEST_F(SafetensorsTest, RefusesOverlap) {
  std::string h = R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                      "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})";
  EXPECT_THAT(read_error(write_raw(h, std::string(12, '\0'))),
              HasSubstr("tensor 'b' (bytes [4, 12)) overlaps tensor 'a'"));
}

TEST_F(SafetensorsTest, RefusesGap) {
  std::string h = R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                      "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}})";
  EXPECT_THAT(read_error(write_raw(h, std::string(12, '\0'))),
              HasSubstr("4 unused bytes in the data section before tensor 'b'"));
}

TEST_F(SafetensorsTest, RefusesTrailingBytes) {
  std::string h = R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})";
  EXPECT_THAT(read_error(write_raw(h, std::string(9, '\0'))),
              HasSubstr("5 trailing bytes after the last tensor"));
}

TEST_F(SafetensorsTest, RefusesNonStringMetadata) {
  EXPECT_THAT(read_error(write_raw(R"({"__metadata__": {"step": 5}})")),
              HasSubstr("\"__metadata__\" value of 'step' must be a string"));
  EXPECT_THAT(read_error(write_raw(R"({"__metadata__": "x"})")),
              HasSubstr("\"__metadata__\" must be an object"));
}

TEST_F(SafetensorsTest, AcceptsUnpaddedHeaderInAnyKeyOrder) {
  // Other writers need not pad or sort; offsets need only tile the data section.
  std::string h = R"({"z":{"dtype":"U16","shape":[1],"data_offsets":[4,6]},)"
                  R"("__metadata__":{},"a":{"dtype":"I32","shape":[],"data_offsets":[0,4]}})";
  SafeTensorsFile g = read_safetensors(write_raw(h, std::string("\x01\0\0\0\x02\0", 6)));
  EXPECT_EQ(g.tensors["a"].bytes, (std::vector<uint8_t>{1, 0, 0, 0}));
  EXPECT_EQ(g.tensors["z"].bytes, (std::vector<uint8_t>{2, 0}));
}

// Compatibility with PyTorch, through a hand-written Python reader/writer (the safetensors
// package is not a dependency); torch supplies the reference bf16 rounding.
class SafetensorsPythonTest : public SafetensorsTest {
 protected:
  static constexpr const char* kPython = "/usr/bin/python3";

  void SetUp() override {
    SafetensorsTest::SetUp();
    std::string probe = fmt::format("{} -c 'import torch, numpy' >/dev/null 2>&1", kPython);
    // scripts/install-deps.sh installs both; their absence is a broken setup, not a skip.
    ASSERT_EQ(std::system(probe.c_str()), 0)
        << kPython << " lacks torch or numpy: run scripts/install-deps.sh";
  }

  int run_python(const std::string& script, const std::string& arg) {
    std::string py = file("script.py");
    std::ofstream(py) << script;
    return std::system(fmt::format("{} {} {}", kPython, py, arg).c_str());
  }
};

TEST_F(SafetensorsPythonTest, ReadsFileWrittenByPython) {
  const char* script = R"PY(
import json, struct, sys, torch
torch.manual_seed(0)
f32 = torch.randn(3, 5)
tensors = {"f32": f32, "bf16": f32.bfloat16(), "i32": torch.arange(-3, 3, dtype=torch.int32)}
names = {torch.float32: "F32", torch.bfloat16: "BF16", torch.int32: "I32"}
header, blobs, off = {"__metadata__": {"format": "pt"}}, [], 0
for k, t in reversed(list(tensors.items())):  # unsorted names, no padding
    b = t.contiguous().view(torch.uint8).numpy().tobytes()
    header[k] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + len(b)]}
    blobs.append(b)
    off += len(b)
h = json.dumps(header).encode()
with open(sys.argv[1], "wb") as out:
    out.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))
)PY";
  std::string path = file("py.safetensors");
  ASSERT_EQ(run_python(script, path), 0);

  SafeTensorsFile g = read_safetensors(path);
  EXPECT_EQ(g.metadata.at("format"), "pt");
  const SafeTensor& f32 = g.tensors.at("f32");
  const SafeTensor& b16 = g.tensors.at("bf16");
  EXPECT_EQ(f32.shape, (Shape{3, 5}));
  EXPECT_EQ(b16.shape, (Shape{3, 5}));
  std::vector<float> x = f32.to_f32(), y = b16.to_f32();
  for (size_t i = 0; i < x.size(); ++i) {
    // Our bf16 rounding must agree bit for bit with torch's.
    EXPECT_EQ(bf16::from_float(x[i]).to_float(), y[i]) << "element " << i;
  }
  std::vector<int32_t> ints(6);
  std::memcpy(ints.data(), g.tensors.at("i32").bytes.data(), 24);
  EXPECT_EQ(ints, (std::vector<int32_t>{-3, -2, -1, 0, 1, 2}));
}

TEST_F(SafetensorsPythonTest, PythonReadsFileWeWrote) {
  std::vector<float> v(12);
  for (size_t i = 0; i < v.size(); ++i) v[i] = float(i) / 3.0f - 1.0f;
  SafeTensor b;
  b.dtype = DType::bf16;
  b.shape = {4, 3};
  for (float x : v) {
    bf16 h = bf16::from_float(x);
    b.bytes.push_back(uint8_t(h.bits));
    b.bytes.push_back(uint8_t(h.bits >> 8));
  }
  SafeTensorsFile f;
  f.tensors["w"] = safetensor_f32({4, 3}, v.data());
  f.tensors["w_bf16"] = b;
  f.metadata["producer"] = "tetra";
  std::string path = file("ours.safetensors");
  write_safetensors(path, f);

  const char* script = R"PY(
import json, struct, sys, torch
data = open(sys.argv[1], "rb").read()
n = struct.unpack("<Q", data[:8])[0]
assert n % 8 == 0, "header not padded to 8 bytes"
header = json.loads(data[8:8 + n])
body = data[8 + n:]
assert header.pop("__metadata__") == {"producer": "tetra"}
dtypes = {"F32": torch.float32, "BF16": torch.bfloat16}
got = {}
for k, e in header.items():
    b, end = e["data_offsets"]
    got[k] = torch.frombuffer(bytearray(body[b:end]), dtype=dtypes[e["dtype"]]).reshape(e["shape"])
want = (torch.arange(12, dtype=torch.float32) / 3 - 1).reshape(4, 3)
assert torch.equal(got["w"], want), (got["w"], want)
assert torch.equal(got["w_bf16"], want.bfloat16()), (got["w_bf16"], want.bfloat16())
)PY";
  EXPECT_EQ(run_python(script, path), 0);
}

}  // namespace
}  // namespace tetra
