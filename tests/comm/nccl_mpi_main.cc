// The communicator on GPU buffers (CUDA builds). Run under mpirun; every rank checks its results.
//   nccl:      dist.backend=nccl. Every operation on device buffers and on host buffers (bounced
//              through device memory) against an exact reference, and device against host bit for
//              bit. Ranks that share a GPU must be refused with the one-GPU-per-rank error instead
//              (a one-GPU machine running 2 ranks); that refusal is then what is checked.
//   mpi:       dist.backend=mpi with device buffers (ranks may share a GPU): every operation bit
//              for bit equal to the same operation on host buffers, and the exact reference.
//   mpi-hang:  dist.backend=mpi: the last rank never joins an all_reduce of a device buffer; the
//              others must report it and exit 75 (run under expect_abort.sh).
//   nccl-hang: dist.backend=nccl, one rank: an all_reduce ordered after compute-stream work that
//              outlasts dist.timeout_s; the watchdog reports, aborts the NCCL communicator and
//              exits 75 (run under expect_abort.sh).
// Device inputs are written by copies queued on the compute stream behind a 5 ms host callback
// and are not waited for, so a collective that did not order itself after the compute stream
// would read the buffer's stale bytes. On a machine without a usable GPU every mode prints
// "skipped: <why>" and exits 0.
#include <cuda_runtime_api.h>
#include <unistd.h>
#include <xxhash.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "comm/communicator.h"
#include "core/error.h"
#include "core/timer.h"
#include "kernels/backend.h"
#include "kernels/cuda/runtime.h"

using namespace tetra;
using namespace tetra::comm;

namespace {

int g_failures = 0;
int g_rank = 0;
bool g_nccl = false;

#define EXPECT(cond, ...)                                                                        \
  do {                                                                                           \
    if (!(cond)) {                                                                               \
      ++g_failures;                                                                              \
      std::fprintf(stderr, "rank %d: %s:%d: %s failed: %s\n", g_rank, __FILE__, __LINE__, #cond, \
                   fmt::format(__VA_ARGS__).c_str());                                            \
    }                                                                                            \
  } while (0)

void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "rank %d: %s failed: %s\n", g_rank, what, cudaGetErrorString(e));
    std::exit(3);
  }
}

cudaStream_t compute() { return cuda::compute_stream(); }

void sleep_5ms(void*) { std::this_thread::sleep_for(std::chrono::milliseconds(5)); }

/** Device memory holding `init`, written by a copy queued on the compute stream behind a 5 ms
 *  callback and not waited for; the bytes there before are 0xAB. */
template <typename T>
class Dev {
 public:
  explicit Dev(const std::vector<T>& init) : n_(init.size()) {
    const size_t bytes = std::max<size_t>(n_ * sizeof(T), 1);
    void* d = nullptr;
    void* h = nullptr;
    cuda_ok(cudaMalloc(&d, bytes), "cudaMalloc");
    cuda_ok(cudaMallocHost(&h, bytes), "cudaMallocHost");
    d_ = static_cast<T*>(d);
    pinned_ = static_cast<T*>(h);
    cuda_ok(cudaMemsetAsync(d_, 0xAB, bytes, compute()), "cudaMemsetAsync");
    if (n_) std::memcpy(pinned_, init.data(), n_ * sizeof(T));
    cuda_ok(cudaLaunchHostFunc(compute(), sleep_5ms, nullptr), "cudaLaunchHostFunc");
    cuda_ok(cudaMemcpyAsync(d_, pinned_, n_ * sizeof(T), cudaMemcpyHostToDevice, compute()),
            "cudaMemcpyAsync");
  }
  ~Dev() {
    cudaStreamSynchronize(compute());
    cudaFree(d_);
    cudaFreeHost(pinned_);
  }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;

  std::span<T> span(size_t off = 0, size_t n = size_t(-1)) {
    return std::span<T>(d_ + off, n == size_t(-1) ? n_ - off : n);
  }
  /** The contents, read on the compute stream (after the operation's wait()). */
  std::vector<T> read() {
    std::vector<T> out(n_);
    cuda_ok(cudaMemcpyAsync(pinned_, d_, n_ * sizeof(T), cudaMemcpyDeviceToHost, compute()),
            "cudaMemcpyAsync");
    cuda_ok(cudaStreamSynchronize(compute()), "cudaStreamSynchronize");
    if (n_) std::memcpy(out.data(), pinned_, n_ * sizeof(T));
    return out;
  }

 private:
  size_t n_;
  T* d_ = nullptr;
  T* pinned_ = nullptr;
};

template <typename T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

template <typename T>
double as_double(T v);

/** Where `a` and `b` first differ, for failure messages. */
template <typename T>
std::string first_diff(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return fmt::format("sizes {} and {}", a.size(), b.size());
  size_t count = 0, first = a.size();
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0) {
      if (first == a.size()) first = i;
      ++count;
    }
  }
  if (count == 0) return "equal";
  return fmt::format("{} of {} differ, first [{}]: {} vs {}", count, a.size(), first,
                     as_double(a[first]), as_double(b[first]));
}

// Integer-valued inputs: every summation order gives the same exact result.
float exact(int rank, size_t i) { return float(int((i * 7 + size_t(rank) * 13) % 97) - 40); }
// Small integers stay exact in bf16 sums of a few ranks.
float small(int rank, size_t i) { return float(int((i * 7 + size_t(rank) * 13) % 9) - 4); }
float noisy(int rank, size_t i) {
  uint64_t key[2] = {uint64_t(rank), uint64_t(i)};
  const uint64_t h = XXH3_64bits(key, sizeof(key));
  return float(double(h >> 11) / double(1ull << 53) * 2.0 - 1.0) * (1.0f + float(i % 5));
}

template <typename T>
T make(float v) {
  if constexpr (std::is_same_v<T, bf16>) {
    return bf16::from_float(v);
  } else {
    return T(v);
  }
}
template <typename T>
double as_double(T v) {
  if constexpr (std::is_same_v<T, bf16>) {
    return v.to_float();
  } else {
    return double(v);
  }
}

/** The reduction of inputs `value(q, i)` over ranks q, rounded as T. */
template <typename T, typename F>
std::vector<T> reference(const Communicator& c, size_t count, ReduceOp op, F value) {
  std::vector<T> ref(count);
  for (size_t i = 0; i < count; ++i) {
    double s = 0, m = -1e300;
    for (int q = 0; q < c.size(); ++q) {
      const double v = as_double(make<T>(value(q, i)));
      s += v, m = std::max(m, v);
    }
    // The inputs are integers, so s is exact; avg divides in f32 like the MPI backend.
    ref[i] = make<T>(op == ReduceOp::max   ? float(m)
                     : op == ReduceOp::avg ? float(s) / float(c.size())
                                           : float(s));
  }
  return ref;
}

/** Exact inputs: both backends give exactly the reference (an average is the exact sum divided
 *  by n in f32). */
template <typename T>
bool matches(const std::vector<T>& got, const std::vector<T>& ref, ReduceOp) {
  return same_bits(got, ref);
}

template <typename T>
void check_all_reduce(const Communicator& c, size_t count, ReduceOp op, bool exact_inputs) {
  const int r = c.rank();
  auto value = [&](int q, size_t i) {
    if (!exact_inputs) return noisy(q, i);
    return std::is_same_v<T, bf16> ? small(q, i) : exact(q, i);
  };
  std::vector<T> host(count);
  for (size_t i = 0; i < count; ++i) host[i] = make<T>(value(r, i));
  Dev<T> dev(host);
  Work wd = c.all_reduce(dev.span(), op);
  c.all_reduce(std::span<T>(host), op).wait();
  wd.wait();
  const std::vector<T> got = dev.read();
  const char* type = std::is_same_v<T, bf16> ? "bf16" : std::is_same_v<T, float> ? "f32" : "i32";
  EXPECT(same_bits(got, host), "all_reduce {} {} of {} ({} inputs): device differs from host: {}",
         reduce_op_name(op), type, count, exact_inputs ? "exact" : "noisy", first_diff(got, host));
  if (exact_inputs) {
    EXPECT(matches(got, reference<T>(c, count, op, value), op),
           "all_reduce {} {} of {} differs from the reference", reduce_op_name(op), type, count);
  }
}

template <typename T>
void check_reduce_scatter(const Communicator& c, size_t count, ReduceOp op, bool exact_inputs,
                          bool in_place) {
  const int r = c.rank();
  auto value = [&](int q, size_t i) {
    if (!exact_inputs) return noisy(q, i);
    return std::is_same_v<T, bf16> ? small(q, i) : exact(q, i);
  };
  const Range mine = even_split(count, c.size(), r);
  std::vector<T> in(count), out(mine.count);
  for (size_t i = 0; i < count; ++i) in[i] = make<T>(value(r, i));
  Dev<T> din(in);
  std::vector<T> got;
  if (in_place) {
    c.reduce_scatter(std::span<const T>(din.span()), din.span(mine.offset, mine.count), op).wait();
    const std::vector<T> all = din.read();
    got.assign(all.begin() + long(mine.offset), all.begin() + long(mine.offset + mine.count));
  } else {
    Dev<T> dout{std::vector<T>(mine.count)};
    c.reduce_scatter(std::span<const T>(din.span()), dout.span(), op).wait();
    got = dout.read();
  }
  c.reduce_scatter(std::span<const T>(in), std::span<T>(out), op).wait();
  EXPECT(same_bits(got, out), "reduce_scatter {} of {}{} ({} inputs): device differs from host: {}",
         reduce_op_name(op), count, in_place ? " in place" : "", exact_inputs ? "exact" : "noisy",
         first_diff(got, out));
  if (exact_inputs) {
    std::vector<T> ref = reference<T>(c, count, op, value);
    ref = std::vector<T>(ref.begin() + long(mine.offset),
                         ref.begin() + long(mine.offset + mine.count));
    EXPECT(matches(got, ref, op), "reduce_scatter {} of {} differs from the reference",
           reduce_op_name(op), count);
  }
}

template <typename T>
void check_all_gather(const Communicator& c, size_t count, bool in_place) {
  const int n = c.size(), r = c.rank();
  auto val = [](int q, size_t i) { return make<T>(float((q * 131 + int(i) * 7 + 1) & 0x7f)); };
  const Range mine = even_split(count, n, r);
  std::vector<T> in(mine.count), ref(count);
  for (size_t i = 0; i < mine.count; ++i) in[i] = val(r, mine.offset + i);
  for (int q = 0; q < n; ++q) {
    const Range rq = even_split(count, n, q);
    for (size_t i = 0; i < rq.count; ++i) ref[rq.offset + i] = val(q, rq.offset + i);
  }
  std::vector<T> got;
  if (in_place) {
    std::vector<T> io(count, make<T>(0));
    std::copy(in.begin(), in.end(), io.begin() + long(mine.offset));
    Dev<T> dio(io);
    c.all_gather(std::span<const T>(dio.span(mine.offset, mine.count)), dio.span()).wait();
    got = dio.read();
  } else {
    Dev<T> din(in), dout{std::vector<T>(count)};
    c.all_gather(std::span<const T>(din.span()), dout.span()).wait();
    got = dout.read();
  }
  std::vector<T> host(count);
  c.all_gather(std::span<const T>(in), std::span<T>(host)).wait();
  EXPECT(same_bits(got, ref), "all_gather {}-byte elements of {}{} on device", sizeof(T), count,
         in_place ? " in place" : "");
  EXPECT(same_bits(host, ref), "all_gather {}-byte elements of {} on host", sizeof(T), count);
}

void check_all_to_all(const Communicator& c) {
  const int n = c.size(), r = c.rank();
  for (size_t block : {size_t(0), size_t(5), size_t(1000)}) {
    std::vector<int32_t> in(block * size_t(n)), ref(in.size());
    for (int j = 0; j < n; ++j) {
      for (size_t i = 0; i < block; ++i) {
        in[size_t(j) * block + i] = r * 1000000 + j * 1000 + int(i);
        ref[size_t(j) * block + i] = j * 1000000 + r * 1000 + int(i);
      }
    }
    Dev<int32_t> din(in), dout{std::vector<int32_t>(in.size())};
    c.all_to_all<int32_t>(din.span(), dout.span()).wait();
    std::vector<int32_t> host(in.size());
    c.all_to_all<int32_t>(in, host).wait();
    EXPECT(dout.read() == ref, "all_to_all block {} on device", block);
    EXPECT(host == ref, "all_to_all block {} on host", block);
  }
  auto cnt = [](int s, int d) { return size_t((s + 2 * d) % 4) * 3; };
  std::vector<size_t> sc(static_cast<size_t>(n)), rc(static_cast<size_t>(n));
  for (int j = 0; j < n; ++j) sc[size_t(j)] = cnt(r, j), rc[size_t(j)] = cnt(j, r);
  std::vector<uint8_t> in(std::accumulate(sc.begin(), sc.end(), size_t{0}));
  std::vector<uint8_t> ref(std::accumulate(rc.begin(), rc.end(), size_t{0}));
  size_t o = 0;
  for (int j = 0; j < n; ++j) {
    for (size_t i = 0; i < sc[size_t(j)]; ++i) in[o++] = uint8_t(r * 16 + j + int(i));
  }
  o = 0;
  for (int j = 0; j < n; ++j) {
    for (size_t i = 0; i < rc[size_t(j)]; ++i) ref[o++] = uint8_t(j * 16 + r + int(i));
  }
  Dev<uint8_t> din(in), dout{std::vector<uint8_t>(ref.size())};
  c.all_to_allv<uint8_t>(din.span(), sc, dout.span(), rc).wait();
  EXPECT(dout.read() == ref, "all_to_allv on device");
}

void check_broadcast(const Communicator& c) {
  for (int root = 0; root < c.size(); ++root) {
    for (size_t count : {size_t(3), size_t(70001)}) {
      std::vector<float> x(count, c.rank() == root ? 0.f : -1.f), ref(count);
      for (size_t i = 0; i < count; ++i) ref[i] = float(i) * 0.25f + float(root);
      if (c.rank() == root) x = ref;
      Dev<float> d(x);
      c.broadcast<float>(d.span(), root).wait();
      EXPECT(d.read() == ref, "broadcast of {} from root {} on device", count, root);
    }
  }
  // A host double, as the trainer broadcasts a step scalar: 8 bytes through the bounce buffer.
  double v = c.rank() == 0 ? 3.25 : 0.0;
  c.broadcast<uint8_t>(std::span<uint8_t>(reinterpret_cast<uint8_t*>(&v), sizeof v), 0).wait();
  EXPECT(v == 3.25, "broadcast of a host double got {}", v);
}

void check_send_recv(const Communicator& c) {
  const int n = c.size(), r = c.rank();
  if (n < 2) return;
  for (size_t count : {size_t(17), size_t(300000)}) {
    std::vector<float> out(count);
    for (size_t i = 0; i < count; ++i) out[i] = float(r) * 1000.f + float(i % 1000);
    const int right = (r + 1) % n, left = (r - 1 + n) % n;
    Dev<float> dout(out), from_left{std::vector<float>(count)},
        from_right{std::vector<float>(count)};
    // Receives posted before the sends, as the pipeline does; two tags in flight.
    Work r1 = c.recv<float>(from_left.span(), left, 1);
    Work r2 = c.recv<float>(from_right.span(), right, 2);
    Work s1 = c.send<float>(std::span<const float>(dout.span()), right, 1);
    Work s2 = c.send<float>(std::span<const float>(dout.span()), left, 2);
    r2.wait(), r1.wait(), s1.wait(), s2.wait();
    const std::vector<float> a = from_left.read(), b = from_right.read();
    bool ok = true;
    for (size_t i = 0; i < count; ++i) {
      ok &= a[i] == float(left) * 1000.f + float(i % 1000);
      ok &= b[i] == float(right) * 1000.f + float(i % 1000);
    }
    EXPECT(ok, "ring send/recv of {} device floats", count);
  }
}

void check_mixed_and_scalars(const Communicator& c) {
  const int r = c.rank(), n = c.size();
  // Device in, host out and the reverse.
  const size_t count = 1001;
  const Range mine = even_split(count, n, r);
  std::vector<float> in(count), host_out(mine.count);
  for (size_t i = 0; i < count; ++i) in[i] = exact(r, i);
  Dev<float> din(in);
  c.reduce_scatter(std::span<const float>(din.span()), std::span<float>(host_out)).wait();
  std::vector<float> ref = reference<float>(c, count, ReduceOp::sum, exact);
  EXPECT(same_bits(host_out, std::vector<float>(ref.begin() + long(mine.offset),
                                                ref.begin() + long(mine.offset + mine.count))),
         "reduce_scatter device -> host");
  Dev<float> dall{std::vector<float>(count)};
  c.all_gather(std::span<const float>(host_out), dall.span()).wait();
  EXPECT(same_bits(dall.read(), ref), "all_gather host -> device");
  // Host scalars: an int32 max and a float sum of one element each.
  std::vector<int32_t> mx{r * 7 - 3};
  c.all_reduce(std::span<int32_t>(mx), ReduceOp::max).wait();
  EXPECT(mx[0] == (n - 1) * 7 - 3, "host int32 max got {}", mx[0]);
  std::vector<float> s{1.5f};
  c.all_reduce(std::span<float>(s)).wait();
  EXPECT(s[0] == 1.5f * float(n), "host scalar sum got {}", s[0]);
}

void check_async_and_split(const Communicator& world) {
  // Eight device all_reduces in flight, waited on in reverse order, then a barrier.
  std::vector<std::unique_ptr<Dev<float>>> bufs;
  std::vector<Work> works;
  for (size_t k = 0; k < 8; ++k) {
    std::vector<float> v(4096);
    for (size_t i = 0; i < v.size(); ++i) v[i] = float(k + i % 100);
    bufs.push_back(std::make_unique<Dev<float>>(v));
    works.push_back(world.all_reduce(bufs.back()->span()));
  }
  works.push_back(world.barrier());
  for (auto it = works.rbegin(); it != works.rend(); ++it) it->wait();
  bool ok = true;
  for (size_t k = 0; k < 8; ++k) {
    const std::vector<float> got = bufs[k]->read();
    for (size_t i = 0; i < got.size(); ++i) ok &= got[i] == float(k + i % 100) * world.size();
  }
  EXPECT(ok, "device all_reduces waited in reverse order");
  const int r = world.rank();
  Communicator half = world.split(r % 2, r, r % 2 ? "odd" : "even");
  Dev<int32_t> d(std::vector<int32_t>{r, 2 * r});
  half.all_reduce(d.span()).wait();
  int sum = 0;
  for (int q = r % 2; q < world.size(); q += 2) sum += q;
  const std::vector<int32_t> got = d.read();
  EXPECT(got[0] == sum && got[1] == 2 * sum, "device all_reduce on split group: {} {} != {}",
         got[0], got[1], sum);
  check_all_reduce<float>(half, 1000, ReduceOp::sum, true);
}

int run_checks(const Communicator& world) {
  const int n = world.size();
  const std::vector<size_t> sizes = {0, 1, size_t(n) + 1, 4099, 70001};
  for (size_t count : sizes) {
    for (bool exact_inputs : {true, false}) {
      for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max}) {
        check_all_reduce<float>(world, count, op, exact_inputs);
        check_reduce_scatter<float>(world, count, op, exact_inputs, false);
        check_reduce_scatter<float>(world, count, op, exact_inputs, true);
      }
      for (ReduceOp op : {ReduceOp::sum, ReduceOp::max}) {
        check_all_reduce<bf16>(world, count, op, exact_inputs);
        check_reduce_scatter<bf16>(world, count, op, exact_inputs, false);
        check_reduce_scatter<bf16>(world, count, op, exact_inputs, true);
      }
    }
    check_all_reduce<int32_t>(world, count, ReduceOp::sum, true);
    check_all_reduce<int32_t>(world, count, ReduceOp::max, true);
    for (bool in_place : {false, true}) {
      check_all_gather<float>(world, count, in_place);
      check_all_gather<uint8_t>(world, count, in_place);
      check_all_gather<bf16>(world, count, in_place);
    }
  }
  check_all_to_all(world);
  check_broadcast(world);
  check_send_recv(world);
  check_mixed_and_scalars(world);
  check_async_and_split(world);
  std::vector<int32_t> f{g_failures};
  world.all_reduce(std::span<int32_t>(f)).wait();
  if (world.rank() == 0) {
    std::printf("comm on device buffers, dist.backend=%s, %d ranks: %s (%d failed checks)\n",
                g_nccl ? "nccl" : "mpi", n, f[0] ? "FAILED" : "ok", f[0]);
  }
  return f[0] ? 1 : 0;
}

int local_ranks() {
  const char* s = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  return s ? std::atoi(s) : 1;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  const double timeout = argc > 2 ? std::atof(argv[2]) : 60.0;
  if (mode != "nccl" && mode != "mpi" && mode != "mpi-hang" && mode != "nccl-hang") {
    std::fprintf(stderr, "usage: %s nccl|mpi|mpi-hang|nccl-hang [timeout_s]\n", argv[0]);
    return 2;
  }
  const std::string why = cuda_unavailable();
  if (!why.empty()) {
    std::printf("skipped: %s\n", why.c_str());
    return 0;
  }
  g_nccl = mode == "nccl" || mode == "nccl-hang";
  CommOptions opts;
  opts.backend = g_nccl ? "nccl" : "mpi";
  opts.timeout_s = timeout;
  opts.debug_hash = true;  // the control path must keep working beside NCCL
  int rc = 0;
  try {
    Communicator world = init_world(opts, &argc, &argv);
    g_rank = world.rank();
    if (mode == "nccl" || mode == "mpi") {
      rc = run_checks(world);
    } else if (mode == "mpi-hang") {
      Dev<float> d(std::vector<float>(4096, 1.0f));
      world.all_reduce(d.span()).wait();
      if (world.rank() == world.size() - 1) {
        std::this_thread::sleep_for(std::chrono::seconds(60));
      } else {
        world.all_reduce(d.span()).wait();
      }
      rc = 1;  // the watchdog exits first
    } else {   // nccl-hang
      Dev<float> d(std::vector<float>(4096, 1.0f));
      world.all_reduce(d.span()).wait();
      // The compute stream stays busy past the deadline: the collective is issued but cannot
      // start, as when a peer never arrives.
      static int hold_s = int(timeout) + 4;
      cuda_ok(
          cudaLaunchHostFunc(
              compute(), [](void*) { std::this_thread::sleep_for(std::chrono::seconds(hold_s)); },
              nullptr),
          "cudaLaunchHostFunc");
      world.all_reduce(d.span()).wait();
      rc = 1;
    }
  } catch (const Error& e) {
    int devices = 0;
    cudaGetDeviceCount(&devices);
    const bool shared =
        std::string(e.what()).find("needs one GPU per rank: ranks") != std::string::npos;
    if (mode == "nccl" && shared && devices < local_ranks()) {
      std::printf("nccl: %d ranks on %d GPU(s) refused as expected: %s\n", local_ranks(), devices,
                  e.what());
      return 0;
    }
    std::fprintf(stderr, "rank %d: error: %s\n", g_rank, e.what());
    return 1;
  }
  return rc;
}
