// Multi-rank conformance test of every collective against a local reference. Run under mpirun with
// any number of ranks; every rank checks its own results and the job fails (exit 1) if any rank
// saw a mismatch. Sizes include 0, 1, sizes not divisible by the rank count, and one large enough
// for OpenMPI's large-message algorithms.
#include <unistd.h>
#include <xxhash.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "comm/communicator.h"
#include "core/error.h"
#include "core/timer.h"

using namespace tetra;
using namespace tetra::comm;

namespace {

int g_failures = 0;
int g_rank = 0;

#define EXPECT(cond, ...)                                                                        \
  do {                                                                                           \
    if (!(cond)) {                                                                               \
      ++g_failures;                                                                              \
      std::fprintf(stderr, "rank %d: %s:%d: %s failed: %s\n", g_rank, __FILE__, __LINE__, #cond, \
                   fmt::format(__VA_ARGS__).c_str());                                            \
    }                                                                                            \
  } while (0)

// Integer-valued inputs keep float sums exact, so the reference does not depend on sum order.
float exact_value(int rank, size_t i) { return float(int((i * 7 + size_t(rank) * 13) % 97) - 40); }

// Arbitrary floats for determinism checks: a hash of (rank, i) mapped to [-1, 1).
float noisy_value(int rank, size_t i) {
  uint64_t key[2] = {uint64_t(rank), uint64_t(i)};
  uint64_t h = XXH3_64bits(key, sizeof(key));
  return float(double(h >> 11) / double(1ull << 53) * 2.0 - 1.0) * (1.0f + float(i % 5));
}

uint64_t hash_bytes(const void* p, size_t n) { return XXH3_64bits(p, n); }

/** True when `h` is the same on every rank of `c`. */
bool same_on_all_ranks(const Communicator& c, uint64_t h) {
  std::vector<uint8_t> all(size_t(c.size()) * 8);
  c.all_gather<uint8_t>(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(&h), 8), all)
      .wait();
  for (int r = 0; r < c.size(); ++r) {
    if (std::memcmp(all.data() + size_t(r) * 8, &h, 8) != 0) return false;
  }
  return true;
}

void test_all_reduce(const Communicator& c, const std::vector<size_t>& sizes) {
  const int n = c.size(), r = c.rank();
  for (size_t count : sizes) {
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max}) {
      std::vector<float> x(count), ref(count);
      for (size_t i = 0; i < count; ++i) {
        x[i] = exact_value(r, i);
        float s = 0, m = -1e30f;
        for (int q = 0; q < n; ++q) s += exact_value(q, i), m = std::max(m, exact_value(q, i));
        ref[i] = op == ReduceOp::max ? m : op == ReduceOp::avg ? s / float(n) : s;
      }
      c.all_reduce(x, op).wait();
      EXPECT(std::memcmp(x.data(), ref.data(), count * 4) == 0, "all_reduce {} f32 of {} on '{}'",
             reduce_op_name(op), count, c.name());
    }
    std::vector<int32_t> xi(count), si(count), mi(count);
    for (size_t i = 0; i < count; ++i) {
      xi[i] = int32_t(i) * (r + 1) - 3 * r;
      si[i] = 0;
      mi[i] = INT32_MIN;
      for (int q = 0; q < n; ++q)
        si[i] += int32_t(i) * (q + 1) - 3 * q,
            mi[i] = std::max(mi[i], int32_t(i) * (q + 1) - 3 * q);
    }
    std::vector<int32_t> xm = xi;
    c.all_reduce(std::span<int32_t>(xi), ReduceOp::sum).wait();
    c.all_reduce(std::span<int32_t>(xm), ReduceOp::max).wait();
    EXPECT(xi == si, "all_reduce sum i32 of {}", count);
    EXPECT(xm == mi, "all_reduce max i32 of {}", count);

    // Arbitrary floats: close to a double reference, bit-identical across ranks and repeats.
    std::vector<float> a(count), b(count);
    for (size_t i = 0; i < count; ++i) a[i] = b[i] = noisy_value(r, i);
    c.all_reduce(a).wait();
    c.all_reduce(b).wait();
    double worst = 0;
    for (size_t i = 0; i < count; ++i) {
      double s = 0;
      for (int q = 0; q < n; ++q) s += double(noisy_value(q, i));
      worst = std::max(worst, std::abs(double(a[i]) - s) / (1.0 + std::abs(s)));
    }
    EXPECT(worst < 1e-5, "all_reduce of noisy floats off by {} relative (count {})", worst, count);
    EXPECT(std::memcmp(a.data(), b.data(), count * 4) == 0, "repeat all_reduce differs ({})",
           count);
    EXPECT(same_on_all_ranks(c, hash_bytes(a.data(), count * 4)),
           "all_reduce result differs across ranks (count {})", count);
  }
}

void test_reduce_scatter(const Communicator& c, const std::vector<size_t>& sizes) {
  const int n = c.size(), r = c.rank();
  for (size_t count : sizes) {
    Range mine = even_split(count, n, r);
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max}) {
      std::vector<float> in(count), out(mine.count), ref(mine.count);
      for (size_t i = 0; i < count; ++i) in[i] = exact_value(r, i);
      for (size_t i = 0; i < mine.count; ++i) {
        float s = 0, m = -1e30f;
        for (int q = 0; q < n; ++q) {
          float v = exact_value(q, mine.offset + i);
          s += v, m = std::max(m, v);
        }
        ref[i] = op == ReduceOp::max ? m : op == ReduceOp::avg ? s / float(n) : s;
      }
      c.reduce_scatter(in, out, op).wait();
      EXPECT(std::memcmp(out.data(), ref.data(), mine.count * 4) == 0,
             "reduce_scatter {} of {} (shard {}+{})", reduce_op_name(op), count, mine.offset,
             mine.count);
      // In place: out is this rank's shard of in.
      std::vector<float> inplace(count);
      for (size_t i = 0; i < count; ++i) inplace[i] = exact_value(r, i);
      std::span<float> shard(inplace.data() + mine.offset, mine.count);
      c.reduce_scatter(inplace, shard, op).wait();
      EXPECT(std::memcmp(shard.data(), ref.data(), mine.count * 4) == 0,
             "in-place reduce_scatter {} of {}", reduce_op_name(op), count);
    }
    // reduce_scatter + all_gather of arbitrary floats: identical on every rank, every repeat.
    std::vector<float> in(count), whole(count), again(count);
    for (size_t i = 0; i < count; ++i) in[i] = noisy_value(r, i);
    std::vector<float> shard(mine.count);
    c.reduce_scatter(in, shard).wait();
    c.all_gather<float>(shard, whole).wait();
    c.reduce_scatter(in, shard).wait();
    c.all_gather<float>(shard, again).wait();
    EXPECT(std::memcmp(whole.data(), again.data(), count * 4) == 0, "repeat rs+ag differs");
    EXPECT(same_on_all_ranks(c, hash_bytes(whole.data(), count * 4)), "rs+ag differs across ranks");
  }
}

// bf16 reductions: small integers are exact in bf16, so sums and maxima equal the reference;
// arbitrary values are rounded at every partial sum, so the all-reduce is within that rounding of
// the exact sum and the reduce-scatter equals the ring's documented order rounded step by step.
void test_bf16_reductions(const Communicator& c, const std::vector<size_t>& sizes) {
  const int n = c.size(), r = c.rank();
  auto small = [](int q, size_t i) { return float(int((i * 7 + size_t(q) * 13) % 9) - 4); };
  auto rounded = [](float v) { return bf16::from_float(v); };
  for (size_t count : sizes) {
    const Range mine = even_split(count, n, r);
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::max}) {
      std::vector<bf16> x(count), in(count), out(mine.count);
      std::vector<float> ref(count);
      for (size_t i = 0; i < count; ++i) {
        x[i] = in[i] = rounded(small(r, i));
        float s = 0, m = -1e30f;
        for (int q = 0; q < n; ++q) s += small(q, i), m = std::max(m, small(q, i));
        ref[i] = op == ReduceOp::max ? m : s;
      }
      c.all_reduce(std::span<bf16>(x), op).wait();
      c.reduce_scatter(std::span<const bf16>(in), std::span<bf16>(out), op).wait();
      bool same = true;
      for (size_t i = 0; i < count; ++i) same = same && x[i].to_float() == ref[i];
      for (size_t i = 0; i < mine.count; ++i)
        same = same && out[i].to_float() == ref[mine.offset + i];
      EXPECT(same, "bf16 {} of {} integers on '{}'", reduce_op_name(op), count, c.name());
    }
    std::vector<bf16> a(count), b(count), in(count), shard(mine.count);
    for (size_t i = 0; i < count; ++i) a[i] = b[i] = in[i] = rounded(noisy_value(r, i));
    c.all_reduce(std::span<bf16>(a)).wait();
    c.all_reduce(std::span<bf16>(b)).wait();
    std::span<bf16> inplace(in.data() + mine.offset, mine.count);
    std::vector<bf16> before(in);
    c.reduce_scatter(std::span<const bf16>(in), inplace).wait();
    bool close = true, ring_order = true;
    for (size_t i = 0; i < count; ++i) {
      double s = 0, mag = 0;
      for (int q = 0; q < n; ++q) {
        const double v = rounded(noisy_value(q, i)).to_float();
        s += v, mag += std::abs(v);
      }
      close = close && std::abs(double(a[i].to_float()) - s) <= n * std::ldexp(mag, -8);
    }
    for (size_t i = 0; i < mine.count; ++i) {
      // Chunk r ends on rank r: x[r+1] + x[r+2] + ... + x[r], rounded after every addition.
      bf16 acc = rounded(noisy_value((r + 1) % n, mine.offset + i));
      for (int k = 2; k <= n; ++k) {
        acc =
            rounded(acc.to_float() + rounded(noisy_value((r + k) % n, mine.offset + i)).to_float());
      }
      ring_order = ring_order && acc.bits == inplace[i].bits;
    }
    EXPECT(close, "bf16 all_reduce of noisy values beyond bf16 rounding (count {})", count);
    EXPECT(ring_order, "bf16 reduce_scatter is not the ring's order rounded per step ({})", count);
    EXPECT(std::memcmp(a.data(), b.data(), count * 2) == 0, "repeat bf16 all_reduce differs");
    EXPECT(same_on_all_ranks(c, hash_bytes(a.data(), count * 2)),
           "bf16 all_reduce differs across ranks (count {})", count);
  }
  bool threw = false;
  try {
    std::vector<bf16> v(4);
    c.all_reduce(std::span<bf16>(v), ReduceOp::avg).wait();
  } catch (const Error& e) {
    threw = std::string(e.what()).find("avg of bf16") != std::string::npos;
  }
  EXPECT(threw, "avg of bf16 not refused");
}

template <typename T>
void test_all_gather_type(const Communicator& c, size_t count) {
  const int n = c.size(), r = c.rank();
  auto val = [](int q, size_t i) { return T(uint32_t(q * 131 + int(i) * 7 + 1) & 0x7f); };
  Range mine = even_split(count, n, r);
  std::vector<T> in(mine.count), out(count), ref(count);
  for (size_t i = 0; i < mine.count; ++i) in[i] = val(r, mine.offset + i);
  for (int q = 0; q < n; ++q) {
    Range rq = even_split(count, n, q);
    for (size_t i = 0; i < rq.count; ++i) ref[rq.offset + i] = val(q, rq.offset + i);
  }
  c.all_gather<T>(in, out).wait();
  EXPECT(std::memcmp(out.data(), ref.data(), count * sizeof(T)) == 0,
         "all_gather {} bytes/elem of {}", sizeof(T), count);
  // In place: this rank's shard already sits inside out.
  std::vector<T> io(count, T(0));
  for (size_t i = 0; i < mine.count; ++i) io[mine.offset + i] = val(r, mine.offset + i);
  c.all_gather<T>(std::span<const T>(io.data() + mine.offset, mine.count), io).wait();
  EXPECT(std::memcmp(io.data(), ref.data(), count * sizeof(T)) == 0, "in-place all_gather of {}",
         count);
}

void test_all_gather(const Communicator& c, const std::vector<size_t>& sizes) {
  for (size_t count : sizes) {
    test_all_gather_type<float>(c, count);
    test_all_gather_type<int32_t>(c, count);
    test_all_gather_type<uint8_t>(c, count);
    // bf16 moves as raw 16-bit words.
    const int n = c.size(), r = c.rank();
    Range mine = even_split(count, n, r);
    std::vector<bf16> in(mine.count), out(count);
    for (size_t i = 0; i < mine.count; ++i) in[i] = bf16::from_float(float(mine.offset + i) * 0.5f);
    c.all_gather<bf16>(in, out).wait();
    bool ok = true;
    for (size_t i = 0; i < count; ++i) ok &= out[i].bits == bf16::from_float(float(i) * 0.5f).bits;
    EXPECT(ok, "all_gather bf16 of {}", count);
  }
}

void test_all_to_all(const Communicator& c) {
  const int n = c.size(), r = c.rank();
  for (size_t block : {size_t(0), size_t(1), size_t(5), size_t(1000)}) {
    std::vector<int32_t> in(block * size_t(n)), out(in.size()), ref(in.size());
    for (int j = 0; j < n; ++j) {
      for (size_t i = 0; i < block; ++i) {
        in[size_t(j) * block + i] = r * 1000000 + j * 1000 + int(i);
        ref[size_t(j) * block + i] = j * 1000000 + r * 1000 + int(i);
      }
    }
    c.all_to_all<int32_t>(in, out).wait();
    EXPECT(out == ref, "all_to_all block {}", block);
  }
  // Variable splits, including empty ones: rank s sends (s + 2*d) % 4 elements to rank d.
  auto cnt = [](int s, int d) { return size_t((s + 2 * d) % 4) * 3; };
  std::vector<size_t> sc(static_cast<size_t>(n)), rc(static_cast<size_t>(n));
  for (int j = 0; j < n; ++j) sc[size_t(j)] = cnt(r, j), rc[size_t(j)] = cnt(j, r);
  std::vector<uint8_t> in(std::accumulate(sc.begin(), sc.end(), size_t{0}));
  std::vector<uint8_t> out(std::accumulate(rc.begin(), rc.end(), size_t{0})), ref(out.size());
  size_t o = 0;
  for (int j = 0; j < n; ++j) {
    for (size_t i = 0; i < sc[size_t(j)]; ++i) in[o++] = uint8_t(r * 16 + j + i);
  }
  o = 0;
  for (int j = 0; j < n; ++j) {
    for (size_t i = 0; i < rc[size_t(j)]; ++i) ref[o++] = uint8_t(j * 16 + r + i);
  }
  c.all_to_allv<uint8_t>(in, sc, out, rc).wait();
  EXPECT(out == ref, "all_to_allv variable splits");
}

void test_broadcast(const Communicator& c) {
  for (int root = 0; root < c.size(); ++root) {
    for (size_t count : {size_t(0), size_t(3), size_t(70001)}) {
      std::vector<float> x(count, c.rank() == root ? 0.f : -1.f);
      if (c.rank() == root) {
        for (size_t i = 0; i < count; ++i) x[i] = float(i) * 0.25f + float(root);
      }
      c.broadcast<float>(x, root).wait();
      bool ok = true;
      for (size_t i = 0; i < count; ++i) ok &= x[i] == float(i) * 0.25f + float(root);
      EXPECT(ok, "broadcast of {} from root {}", count, root);
    }
  }
}

void test_send_recv(const Communicator& c) {
  const int n = c.size(), r = c.rank();
  if (n < 2) return;
  // Both directions at once with messages above the eager limit: posting order must not deadlock.
  for (size_t count : {size_t(0), size_t(17), size_t(300000)}) {
    std::vector<float> out(count), from_left(count, -1.f), from_right(count, -1.f);
    for (size_t i = 0; i < count; ++i) out[i] = float(r) * 1000.f + float(i % 1000);
    int right = (r + 1) % n, left = (r - 1 + n) % n;
    Work s1 = c.send<float>(out, right, 1);
    Work s2 = c.send<float>(out, left, 2);
    Work r1 = c.recv<float>(from_left, left, 1);
    Work r2 = c.recv<float>(from_right, right, 2);
    r2.wait(), r1.wait(), s1.wait(), s2.wait();
    bool ok = true;
    for (size_t i = 0; i < count; ++i) {
      ok &= from_left[i] == float(left) * 1000.f + float(i % 1000);
      ok &= from_right[i] == float(right) * 1000.f + float(i % 1000);
    }
    EXPECT(ok, "ring send/recv of {}", count);
  }
  // wait_until honours its deadline: rank 1 sends only 1 s after rank 0 started waiting.
  if (r == 0) {
    std::vector<int32_t> v(4, 0);
    Work w = c.recv<int32_t>(v, 1, 9);
    double t = now_s();
    EXPECT(!w.wait_until(t + 0.05), "wait_until returned true before the message was sent");
    EXPECT(now_s() - t < 0.5, "wait_until overshot its deadline: {} s", now_s() - t);
    w.wait();
    EXPECT(v[3] == 42, "late recv got {}", v[3]);
  } else if (r == 1) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1000));
    std::vector<int32_t> v(4, 42);
    c.send<int32_t>(v, 0, 9).wait();
  }
}

void test_async_order(const Communicator& c) {
  // Many operations in flight, waited on in reverse order.
  const int n = c.size();
  std::vector<std::vector<float>> bufs(8, std::vector<float>(1000));
  std::vector<Work> works;
  for (size_t k = 0; k < bufs.size(); ++k) {
    for (size_t i = 0; i < 1000; ++i) bufs[k][i] = float(k + i);
    works.push_back(c.all_reduce(bufs[k]));
  }
  works.push_back(c.barrier());
  for (auto it = works.rbegin(); it != works.rend(); ++it) it->wait();
  bool ok = true;
  for (size_t k = 0; k < bufs.size(); ++k) {
    for (size_t i = 0; i < 1000; ++i) ok &= bufs[k][i] == float(k + i) * float(n);
  }
  EXPECT(ok, "async all_reduces waited in reverse order");
  for (const Work& w : works) EXPECT(w.done(), "work not done after wait");
  EXPECT(works[1].seq() == works[0].seq() + 1, "sequence numbers not consecutive");
}

void test_split(const Communicator& world) {
  const int r = world.rank();
  Communicator half = world.split(r % 2, r, r % 2 ? "odd" : "even");
  int expect = (world.size() + (r % 2 ? 0 : 1)) / 2;
  EXPECT(half.size() == expect, "split size {} != {}", half.size(), expect);
  EXPECT(half.rank() == r / 2, "split rank {} != {}", half.rank(), r / 2);
  for (int q = 0; q < half.size(); ++q) {
    EXPECT(half.world_ranks()[size_t(q)] == 2 * q + r % 2, "split member {}", q);
  }
  std::vector<int32_t> v{r};
  half.all_reduce(std::span<int32_t>(v)).wait();
  int sum = 0;
  for (int q = r % 2; q < world.size(); q += 2) sum += q;
  EXPECT(v[0] == sum, "all_reduce on split group: {} != {}", v[0], sum);
  test_all_reduce(half, {0, 7});
  test_reduce_scatter(half, {5});
}

void test_argument_errors(const Communicator& c) {
  std::vector<float> in(10), out(10);
  bool threw = false;
  try {
    c.reduce_scatter(in, std::span<float>(out.data(), c.size() == 1 ? 2 : 9)).wait();
  } catch (const Error& e) {
    threw = std::string(e.what()).find("[comm] reduce_scatter") != std::string::npos;
  }
  EXPECT(threw, "bad reduce_scatter sizes not refused");
  threw = false;
  try {
    c.broadcast<float>(in, c.size()).wait();
  } catch (const Error& e) {
    threw = std::string(e.what()).find("root") != std::string::npos;
  }
  EXPECT(threw, "bad broadcast root not refused");
}

}  // namespace

int main(int argc, char** argv) {
  CommOptions opts;
  opts.timeout_s = 60;
  opts.debug_hash = true;  // the conformance run doubles as a check that hashing stays in step
  int failures = 0;
  {
    Communicator world = init_world(opts, &argc, &argv);
    g_rank = world.rank();
    const int n = world.size();
    std::vector<size_t> sizes = {0, 1, size_t(n) - 1, size_t(n) + 1, 1000, 4099, 70001};
    test_all_reduce(world, sizes);
    test_reduce_scatter(world, sizes);
    test_bf16_reductions(world, sizes);
    test_all_gather(world, sizes);
    test_all_to_all(world);
    test_broadcast(world);
    test_send_recv(world);
    test_async_order(world);
    test_split(world);
    test_argument_errors(world);
    std::vector<int32_t> f{g_failures};
    world.all_reduce(std::span<int32_t>(f)).wait();
    failures = f[0];
    if (g_rank == 0) {
      std::printf("comm conformance on %d ranks: %s (%d failed checks)\n", n,
                  failures ? "FAILED" : "ok", failures);
    }
  }
  return failures ? 1 : 0;
}
