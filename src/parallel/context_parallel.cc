#include "parallel/context_parallel.h"

#include <algorithm>
#include <limits>
#include <span>
#include <vector>

#include "comm/flight.h"
#include "core/error.h"
#include "core/profile.h"
#include "core/timer.h"

namespace tetra::parallel {

namespace {

// Point-to-point tags of the ring: keys and values, and the partial sums of their gradients.
constexpr int kKvTag = 41, kDkvTag = 42;

}  // namespace

CpSplit::CpSplit(int T, int cp, int rank) : T_(T), cp_(cp), rank_(rank) {
  TETRA_CHECK(cp >= 1 && rank >= 0 && rank < cp, "[cp] internal: rank {} of a cp group of {}", rank,
              cp);
  TETRA_CHECK(
      T > 0 && T % (2 * cp) == 0,
      "[cp] parallel.cp={} splits each sequence into 2·cp = {} chunks, but train.seq_len={} "
      "is not a multiple of {}; use seq_len {} or {}, or a cp that 2·cp divides {} by",
      cp, 2 * cp, T, 2 * cp, T / (2 * cp) * (2 * cp), (T / (2 * cp) + 1) * (2 * cp), T);
}

int CpSplit::position(int t) const {
  const int c = chunk();
  return t < c ? rank_ * c + t : chunk_of(rank_, 1, cp_) * c + (t - c);
}

template <typename V>
void CpSplit::take(V* local, const V* full, int B, int width) const {
  const size_t c = size_t(chunk()) * size_t(width);
  for (int b = 0; b < B; ++b) {
    const V* seq = full + size_t(b) * size_t(T_) * size_t(width);
    V* out = local + size_t(b) * 2 * c;
    std::copy_n(seq + size_t(chunk_of(rank_, 0, cp_)) * c, c, out);
    std::copy_n(seq + size_t(chunk_of(rank_, 1, cp_)) * c, c, out + c);
  }
}

template <typename V>
void CpSplit::put(V* full, const V* local, int B, int width) const {
  const size_t c = size_t(chunk()) * size_t(width);
  for (int b = 0; b < B; ++b) {
    V* seq = full + size_t(b) * size_t(T_) * size_t(width);
    const V* in = local + size_t(b) * 2 * c;
    std::copy_n(in, c, seq + size_t(chunk_of(rank_, 0, cp_)) * c);
    std::copy_n(in + c, c, seq + size_t(chunk_of(rank_, 1, cp_)) * c);
  }
}

template void CpSplit::take<int32_t>(int32_t*, const int32_t*, int, int) const;
template void CpSplit::take<float>(float*, const float*, int, int) const;
template void CpSplit::take<double>(double*, const double*, int, int) const;
template void CpSplit::put<int32_t>(int32_t*, const int32_t*, int, int) const;
template void CpSplit::put<float>(float*, const float*, int, int) const;
template void CpSplit::put<double>(double*, const double*, int, int) const;

UlyssesHeads ulysses_heads(int heads, int kv_heads, int cp) {
  auto fits = [&](int n) { return heads % n == 0 && (kv_heads % n == 0 || n % kv_heads == 0); };
  if (!fits(cp)) {
    std::string valid;
    for (int n = 1; n <= heads; ++n) {
      if (fits(n)) valid += (valid.empty() ? "" : ", ") + std::to_string(n);
    }
    fail(
        "[cp] cp.attention=ulysses gives each of the {} ranks of an all-to-all group "
        "(parallel.cp, or cp.ulysses when set) whole heads, but the {} query heads and {} "
        "key/value heads of a tp rank (model heads / parallel.tp) do not split that way: the "
        "group must divide the query heads, and divide the key/value heads or be a multiple of "
        "them; use a group of {{{}}} ranks (parallel.cp, or cp.ulysses with a ring across), or "
        "cp.attention=ring",
        cp, heads, kv_heads, valid);
  }
  UlyssesHeads h;
  h.q = heads / cp;
  h.replicated = kv_heads < cp;
  h.kv = h.replicated ? 1 : kv_heads / cp;
  return h;
}

// The scratch of one call. ring: kv[2], acc[2], mine and rin, (B,2c,2·kvw) each; all_gather:
// kv[0] every rank's K/V (cp of them), acc[0] their gradients, rin the all-to-all's (cp each).
// ulysses: kv[0] and kv[1] the qkv blocks sent and received (u of (B,2c,Wj) each), acc[0] the
// gradients of the received ones, acc[1] and rin the output's (or dout's) blocks sent and received,
// mine the key/value gradients summed over the copies of a replicated head, delta the local rows'
// softmax term with its blocks (three of (B,2c,NH)); with a ring across Ulysses groups (u < cp)
// also its keys and values, packed (u blocks of (B,2c,2·kv_heads·hs)), ring[2] in flight,
// racc[2] their gradients in flight, own this rank's and part the partial sum received.
template <typename F>
struct ContextAttention<F>::Scratch {
  F* kv[2] = {nullptr, nullptr};
  F* acc[2] = {nullptr, nullptr};
  F* mine = nullptr;  // ring: this rank's queries' share of its own keys' and values' gradients
  F* rin = nullptr;
  F* delta = nullptr;
  F* block = nullptr;
  F* ring[2] = {nullptr, nullptr};
  F* racc[2] = {nullptr, nullptr};
  F* own = nullptr;
  F* part = nullptr;
  size_t n = 0;  // elements of one rank's packed K/V: B·2c·2·kvw (ulysses: one qkv block)
  size_t m = 0;  // ulysses with a ring: elements of one ring hop's packed K/V
  size_t total = 0;
};

namespace {

// Every block of a rank is c x c (c = T/2 local rows): the largest scratch a block call takes.
template <typename F>
size_t block_scratch(const Kernels<F>& k, const AttentionShape& s) {
  AttentionBlock b{s.B, s.T / 2, s.T / 2, s.C, s.NH, s.KVH, false};
  size_t n = k.attention_block_scratch_elements(b);
  b.causal = true;
  return std::max(n, k.attention_block_scratch_elements(b));
}

// A c x c block of Ulysses' whole-sequence attention on this rank's heads.
AttentionBlock ulysses_block(const AttentionShape& s, const UlyssesHeads& h, bool causal) {
  const int hs = s.head_size();
  return AttentionBlock{s.B, s.T / 2, s.T / 2, h.q * hs, h.q, h.kv, causal};
}

}  // namespace

template <typename F>
ContextAttention<F>::ContextAttention(Backend& backend, comm::Communicator group,
                                      CpAttention variant, int ulysses)
    : backend_(&backend), k_(&backend.kernels<F>()), group_(std::move(group)), variant_(variant) {
  if (group_.valid()) {
    cp_ = group_.size();
    rank_ = group_.rank();
  }
  if (variant_ != CpAttention::ulysses) {
    TETRA_CHECK(ulysses == 0,
                "[cp] cp.ulysses={} sizes the all-to-all groups of "
                "cp.attention=ulysses, not of {}; unset it or use cp.attention=ulysses",
                ulysses, cp_attention_name(variant_));
    return;
  }
  u_ = ulysses == 0 ? cp_ : ulysses;
  TETRA_CHECK(u_ >= 1 && cp_ % u_ == 0,
              "[cp] cp.ulysses={} must divide parallel.cp={}: it is the size of each all-to-all "
              "group, and cp / cp.ulysses groups form the ring across them; use a divisor of {} "
              "(or 0 for one group of all cp ranks)",
              ulysses, cp_, cp_);
  ulysses_group_ = u_ == cp_ ? group_ : group_.split(rank_ / u_, rank_ % u_, "cp.ulysses");
}

template <typename F>
size_t ContextAttention<F>::saved_elements(const AttentionShape& s) const {
  return size_t(s.B) * size_t(s.T) * size_t(s.NH);
}

template <typename F>
typename ContextAttention<F>::Scratch ContextAttention<F>::carve(F* p,
                                                                 const AttentionShape& s) const {
  TETRA_CHECK(s.T % 2 == 0, "[cp] internal: {} local rows are not two chunks", s.T);
  Scratch r;
  r.n = size_t(s.B) * size_t(s.T) * 2 * size_t(s.kv_width());
  size_t off = 0;
  auto take = [&](size_t count) {
    F* q = p ? p + off : nullptr;
    off += count;
    return q;
  };
  if (variant_ == CpAttention::ulysses) {
    const UlyssesHeads h = ulysses_heads(s.NH, s.kv_heads(), u_);
    const int hs = s.head_size();
    const size_t rows = size_t(s.B) * size_t(s.T), blocks = rows * size_t(u_);
    r.n = rows * size_t((h.q + 2 * h.kv) * hs);  // one qkv block
    r.kv[0] = take(size_t(u_) * r.n);
    r.kv[1] = take(size_t(u_) * r.n);
    r.acc[0] = take(size_t(u_) * r.n);
    r.acc[1] = take(blocks * size_t(h.q * hs));
    r.rin = take(blocks * size_t(h.q * hs));
    r.mine = h.replicated ? take(size_t(s.kv_heads()) * rows * size_t(2 * hs)) : nullptr;
    r.delta = take(3 * rows * size_t(s.NH));
    if (u_ < cp_) {
      r.m = blocks * size_t(2 * h.kv * hs);
      for (F*& b : r.ring) b = take(r.m);
      for (F*& b : r.racc) b = take(r.m);
      r.own = take(r.m);
      r.part = take(r.m);
    }
    AttentionBlock b = ulysses_block(s, h, true);
    const size_t causal = k_->attention_block_scratch_elements(b);
    b.causal = false;
    r.block = take(std::max(causal, k_->attention_block_scratch_elements(b)));
    r.total = off;
    return r;
  }
  const size_t copies = variant_ == CpAttention::ring ? 1 : size_t(cp_);
  r.kv[0] = take(copies * r.n);
  r.acc[0] = take(copies * r.n);
  if (variant_ == CpAttention::ring) {
    r.kv[1] = take(r.n);
    r.acc[1] = take(r.n);
    r.mine = take(r.n);
  }
  r.rin = take(copies * r.n);
  r.delta = take(size_t(s.B) * size_t(s.T) * size_t(s.NH));
  r.block = take(block_scratch(*k_, s));
  r.total = off;
  return r;
}

template <typename F>
size_t ContextAttention<F>::scratch_elements(const AttentionShape& s) const {
  return carve(nullptr, s).total;
}

template <typename F>
comm::Work ContextAttention<F>::send(const F* data, size_t n, int dst, int tag) const {
  const comm::flight::Site site("cp.ring");
  return group_.send(
      std::span<const std::byte>(reinterpret_cast<const std::byte*>(data), n * sizeof(F)), dst,
      tag);
}

template <typename F>
comm::Work ContextAttention<F>::recv(F* data, size_t n, int src, int tag) const {
  const comm::flight::Site site("cp.ring");
  return group_.recv(std::span<std::byte>(reinterpret_cast<std::byte*>(data), n * sizeof(F)), src,
                     tag);
}

template <typename F>
void ContextAttention<F>::wait(comm::Work& w) {
  const ProfileScope scope(ProfKind::comm, "cp attention wait");
  Stopwatch sw;
  w.wait();
  counters_.wait_ms += sw.elapsed_ms();
  counters_.sent_bytes += w.sent_bytes();
  w = comm::Work();
}

template <typename F>
template <typename Fn>
void ContextAttention<F>::for_each_block(int src, const AttentionShape& s, Fn&& f) {
  const int c = s.T / 2;
  for (int qi = 0; qi < 2; ++qi) {
    const int gq = CpSplit::chunk_of(rank_, qi, cp_);
    for (int kj = 0; kj < 2; ++kj) {
      const int gk = CpSplit::chunk_of(src, kj, cp_);
      if (gk > gq) continue;  // wholly in the queries' future
      const AttentionBlock b{s.B, c, c, s.C, s.NH, s.KVH, gk == gq};
      f(int64_t(qi) * c, int64_t(kj) * c, b);
      counters_.blocks += b.causal ? 1 : 2;
    }
  }
}

template <typename F>
void ContextAttention<F>::forward_blocks(F* out, F* lse, const F* qkv, const F* kv, int src,
                                         const AttentionShape& s, F* block_scratch) {
  const int kvw = s.kv_width();
  const int64_t W = s.width(), P = 2 * int64_t(kvw), T = s.T;
  for_each_block(src, s, [&](int64_t qrow, int64_t krow, const AttentionBlock& b) {
    const Rows<F> o{out + qrow * s.C, s.C, T * s.C};
    const Rows<F> l{lse + qrow * s.NH, s.NH, T * s.NH};
    const Rows<const F> q{qkv + qrow * W, W, T * W};
    const Rows<const F> kr{kv + krow * P, P, T * P};
    const Rows<const F> vr{kr.p + kvw, P, T * P};
    k_->attention_block_forward(o, l, q, kr, vr, b, block_scratch);
  });
}

template <typename F>
void ContextAttention<F>::backward_blocks(F* dqkv, F* dkv, const F* dout, const F* delta,
                                          const F* lse, const F* qkv, const F* kv, int src,
                                          const AttentionShape& s, F* block_scratch) {
  const int kvw = s.kv_width();
  const int64_t W = s.width(), P = 2 * int64_t(kvw), T = s.T;
  for_each_block(src, s, [&](int64_t qrow, int64_t krow, const AttentionBlock& b) {
    const Rows<F> dq{dqkv + qrow * W, W, T * W};
    const Rows<F> dk{dkv + krow * P, P, T * P};
    const Rows<F> dv{dk.p + kvw, P, T * P};
    const Rows<const F> go{dout + qrow * s.C, s.C, T * s.C};
    const Rows<const F> dl{delta + qrow * s.NH, s.NH, T * s.NH};
    const Rows<const F> l{lse + qrow * s.NH, s.NH, T * s.NH};
    const Rows<const F> q{qkv + qrow * W, W, T * W};
    const Rows<const F> kr{kv + krow * P, P, T * P};
    const Rows<const F> vr{kr.p + kvw, P, T * P};
    k_->attention_block_backward(dq, dk, dv, go, dl, l, q, kr, vr, b, block_scratch);
  });
}

template <typename F>
typename ContextAttention<F>::Ring ContextAttention<F>::ring(int stride) const {
  Ring r;
  r.size = cp_ / stride;
  r.pos = rank_ / stride;
  const int at = rank_ % stride;
  r.next = (r.pos + 1) % r.size * stride + at;
  r.prev = (r.pos + r.size - 1) % r.size * stride + at;
  return r;
}

template <typename F>
template <typename Fn>
void ContextAttention<F>::ring_forward(const Ring& ring, F* const kv[2], size_t n, Fn&& blocks) {
  for (int step = 0; step < ring.size; ++step) {
    const F* cur = kv[step % 2];
    comm::Work sent, got;
    if (step + 1 < ring.size) {
      got = recv(kv[(step + 1) % 2], n, ring.prev, kKvTag);
      sent = send(cur, n, ring.next, kKvTag);
    }
    blocks(ring.src(step), cur);
    wait(sent);
    wait(got);
  }
}

template <typename F>
template <typename Fn>
void ContextAttention<F>::ring_backward(const Ring& ring, F* const kv[2], F* const acc[2], F* own,
                                        F* part, size_t n, Fn&& blocks) {
  // The gradients of member o's keys and values start at member o+1 (step 1), gather each next
  // member's share and arrive home from member o−1 after size−1 hops, where o adds its own
  // (step 0).
  comm::Work acc_sent[2];
  for (int step = 0; step < ring.size; ++step) {
    const F* cur = kv[step % 2];
    F* a = step == 0 ? own : acc[step % 2];
    comm::Work sent, got, partial;
    if (step + 1 < ring.size) {
      got = recv(kv[(step + 1) % 2], n, ring.prev, kKvTag);
      sent = send(cur, n, ring.next, kKvTag);
    }
    if (step >= 2) partial = recv(part, n, ring.prev, kDkvTag);
    wait(acc_sent[step % 2]);  // a left two steps ago; it must be gone before it is reused
    k_->zero(a, n);
    blocks(ring.src(step), cur, a);
    if (step >= 2) {
      wait(partial);
      k_->add(a, part, n);
    }
    if (step >= 1) acc_sent[step % 2] = send(a, n, ring.next, kDkvTag);
    wait(sent);
    wait(got);
  }
  if (ring.size > 1) {
    comm::Work home = recv(part, n, ring.prev, kDkvTag);
    wait(home);
    k_->add(own, part, n);
  }
  for (comm::Work& a : acc_sent) wait(a);
}

template <typename F>
void ContextAttention<F>::all_to_all(const F* send, F* recv, size_t n) {
  if (u_ == 1) {
    k_->copy(recv, send, n);
    return;
  }
  const comm::flight::Site site("cp.ulysses");
  const size_t bytes = size_t(u_) * n * sizeof(F);
  comm::Work w = ulysses_group_.all_to_all(
      std::span<const std::byte>(reinterpret_cast<const std::byte*>(send), bytes),
      std::span<std::byte>(reinterpret_cast<std::byte*>(recv), bytes));
  wait(w);
}

namespace {

// Where Ulysses' blocks lie: `cp` blocks of (B, 2c, width), block r holding rank r's rows; the
// rows of its local chunk i (0 or 1) at column `col`.
template <typename P>
Rows<P> ulysses_rows(P* blocks, const AttentionShape& s, int64_t width, int r, int i, int64_t col) {
  const int64_t c = s.T / 2, rows = int64_t(s.B) * s.T;
  return Rows<P>{blocks + r * rows * width + i * c * width + col, width, s.T * width};
}

}  // namespace

template <typename F>
void ContextAttention<F>::ulysses_heads_in(const F* qkv, const AttentionShape& s,
                                           const UlyssesHeads& h, const Scratch& w) {
  const int hs = s.head_size(), kvw = s.kv_width();
  const int64_t rows = int64_t(s.B) * s.T, W = s.width(), Cq = int64_t(h.q) * hs;
  const int64_t kvq = int64_t(h.kv) * hs, Wj = Cq + 2 * kvq;
  // Block j: this rank's rows of member j's query heads and the key/value heads they read.
  for (int j = 0; j < u_; ++j) {
    F* block = w.kv[0] + size_t(j) * w.n;
    const int64_t kv0 = int64_t(h.first_kv(j, u_, s.kv_heads())) * hs;
    k_->copy_rows(block, Wj, qkv + j * Cq, W, rows, Cq);
    k_->copy_rows(block + Cq, Wj, qkv + s.C + kv0, W, rows, kvq);
    k_->copy_rows(block + Cq + kvq, Wj, qkv + s.C + kvw + kv0, W, rows, kvq);
  }
  all_to_all(w.kv[0], w.kv[1], w.n);
}

template <typename F>
template <typename Fn>
void ContextAttention<F>::for_each_heads_block(int src, const AttentionShape& s,
                                               const UlyssesHeads& h, Fn&& f) {
  const int group = rank_ / u_;
  for (int jq = 0; jq < u_; ++jq) {
    for (int iq = 0; iq < 2; ++iq) {
      const int gq = CpSplit::chunk_of(group * u_ + jq, iq, cp_);
      for (int jk = 0; jk < u_; ++jk) {
        for (int ik = 0; ik < 2; ++ik) {
          const int gk = CpSplit::chunk_of(src * u_ + jk, ik, cp_);
          if (gk > gq) continue;
          const AttentionBlock b = ulysses_block(s, h, gk == gq);
          f(jq, iq, jk, ik, b);
          counters_.blocks += b.causal ? 1 : 2;
        }
      }
    }
  }
}

template <typename F>
void ContextAttention<F>::ulysses_forward(F* out, F* saved, const F* qkv, const AttentionShape& s,
                                          F* scratch) {
  const Scratch w = carve(scratch, s);
  const UlyssesHeads h = ulysses_heads(s.NH, s.kv_heads(), u_);
  const int hs = s.head_size();
  const int64_t rows = int64_t(s.B) * s.T, Cq = int64_t(h.q) * hs, kvq = int64_t(h.kv) * hs;
  const int64_t Wj = Cq + 2 * kvq;
  ulysses_heads_in(qkv, s, h, w);
  // The group's rows for this rank's heads, against the keys and values of group `src`: held in
  // kv[1] (width Wj, from column Cq) for this group's own, packed (width 2·kvq) when they came
  // around the ring.
  none_.resize(saved_elements(s), -std::numeric_limits<F>::infinity());
  backend_->device().from_host(saved, none_.data(), none_.size() * sizeof(F));
  auto blocks = [&](int src, const F* kv, int64_t width, int64_t col) {
    for_each_heads_block(src, s, h, [&](int jq, int iq, int jk, int ik, const AttentionBlock& b) {
      k_->attention_block_forward(
          ulysses_rows(w.acc[1], s, Cq, jq, iq, 0), ulysses_rows(saved, s, h.q, jq, iq, 0),
          ulysses_rows<const F>(w.kv[1], s, Wj, jq, iq, 0),
          ulysses_rows<const F>(kv, s, width, jk, ik, col),
          ulysses_rows<const F>(kv, s, width, jk, ik, col + kvq), b, w.block);
    });
  };
  if (u_ == cp_) {
    blocks(0, w.kv[1], Wj, Cq);
  } else {
    k_->copy_rows(w.ring[0], 2 * kvq, w.kv[1] + Cq, Wj, rows * u_, 2 * kvq);
    ring_forward(ring(u_), w.ring, w.m, [&](int src, const F* kv) { blocks(src, kv, 2 * kvq, 0); });
  }
  // Block j of the output goes back to member j; block j received holds member j's heads.
  all_to_all(w.acc[1], w.rin, size_t(rows * Cq));
  for (int j = 0; j < u_; ++j)
    k_->copy_rows(out + j * Cq, s.C, w.rin + j * rows * Cq, Cq, rows, Cq);
}

template <typename F>
void ContextAttention<F>::ulysses_backward(F* dqkv, const F* dout, const F* qkv, const F* out,
                                           const F* saved, const AttentionShape& s, F* scratch) {
  const Scratch w = carve(scratch, s);
  const UlyssesHeads h = ulysses_heads(s.NH, s.kv_heads(), u_);
  const int hs = s.head_size(), kvw = s.kv_width();
  const int64_t rows = int64_t(s.B) * s.T, W = s.width(), Cq = int64_t(h.q) * hs;
  const int64_t kvq = int64_t(h.kv) * hs, Wj = Cq + 2 * kvq;
  ulysses_heads_in(qkv, s, h, w);  // forward's exchange again
  // The softmax term of the local rows (NH values each, every head's out and dout are here), and
  // dout, to the members holding their heads.
  F* delta = w.delta;
  F* delta_out = delta + rows * s.NH;
  F* delta_in = delta_out + rows * s.NH;
  k_->attention_block_delta(Rows<F>{delta, s.NH, int64_t(s.T) * s.NH},
                            Rows<const F>{dout, s.C, int64_t(s.T) * s.C},
                            Rows<const F>{out, s.C, int64_t(s.T) * s.C},
                            AttentionBlock{s.B, s.T, s.T, s.C, s.NH, s.KVH, false});
  for (int j = 0; j < u_; ++j) {
    k_->copy_rows(delta_out + j * rows * h.q, h.q, delta + j * h.q, s.NH, rows, h.q);
    k_->copy_rows(w.acc[1] + j * rows * Cq, Cq, dout + j * Cq, s.C, rows, Cq);
  }
  all_to_all(delta_out, delta_in, size_t(rows * h.q));
  all_to_all(w.acc[1], w.rin, size_t(rows * Cq));
  k_->zero(w.acc[0], size_t(u_) * w.n);
  // dq into acc[0]'s query columns; dk and dv of group src's keys and values into dkv, laid out
  // as kv.
  auto blocks = [&](int src, const F* kv, F* dkv, int64_t width, int64_t col) {
    for_each_heads_block(src, s, h, [&](int jq, int iq, int jk, int ik, const AttentionBlock& b) {
      k_->attention_block_backward(
          ulysses_rows(w.acc[0], s, Wj, jq, iq, 0), ulysses_rows(dkv, s, width, jk, ik, col),
          ulysses_rows(dkv, s, width, jk, ik, col + kvq),
          ulysses_rows<const F>(w.rin, s, Cq, jq, iq, 0),
          ulysses_rows<const F>(delta_in, s, h.q, jq, iq, 0),
          ulysses_rows<const F>(saved, s, h.q, jq, iq, 0),
          ulysses_rows<const F>(w.kv[1], s, Wj, jq, iq, 0),
          ulysses_rows<const F>(kv, s, width, jk, ik, col),
          ulysses_rows<const F>(kv, s, width, jk, ik, col + kvq), b, w.block);
    });
  };
  if (u_ == cp_) {
    blocks(0, w.kv[1], w.acc[0], Wj, Cq);
  } else {
    k_->copy_rows(w.ring[0], 2 * kvq, w.kv[1] + Cq, Wj, rows * u_, 2 * kvq);
    ring_backward(ring(u_), w.ring, w.racc, w.own, w.part, w.m,
                  [&](int src, const F* kv, F* dkv) { blocks(src, kv, dkv, 2 * kvq, 0); });
    k_->copy_rows(w.acc[0] + Cq, Wj, w.own, 2 * kvq, rows * u_, 2 * kvq);
  }
  // Block j of the gradients goes home to member j; block j received: its rows' gradients for
  // member j's heads.
  all_to_all(w.acc[0], w.kv[0], w.n);
  for (int j = 0; j < u_; ++j) {
    const F* block = w.kv[0] + size_t(j) * w.n;
    k_->copy_rows(dqkv + j * Cq, W, block, Wj, rows, Cq);
    if (h.replicated) continue;
    const int64_t kv0 = int64_t(h.first_kv(j, u_, s.kv_heads())) * hs;
    k_->copy_rows(dqkv + s.C + kv0, W, block + Cq, Wj, rows, kvq);
    k_->copy_rows(dqkv + s.C + kvw + kv0, W, block + Cq + kvq, Wj, rows, kvq);
  }
  if (!h.replicated) return;
  // A key/value head's copies on u / KVH members each return a share of its gradients: summed in
  // member order, packed (rows, 2·hs) per head in `mine` (acc[0], free again, holds one share).
  const size_t packed = size_t(rows) * 2 * size_t(hs);
  k_->zero(w.mine, size_t(s.kv_heads()) * packed);
  for (int j = 0; j < u_; ++j) {
    k_->copy_rows(w.acc[0], 2 * hs, w.kv[0] + size_t(j) * w.n + Cq, Wj, rows, 2 * hs);
    k_->add(w.mine + size_t(h.first_kv(j, u_, s.kv_heads())) * packed, w.acc[0], packed);
  }
  for (int g = 0; g < s.kv_heads(); ++g) {
    const F* head = w.mine + size_t(g) * packed;
    k_->copy_rows(dqkv + s.C + g * hs, W, head, 2 * hs, rows, hs);
    k_->copy_rows(dqkv + s.C + kvw + g * hs, W, head + hs, 2 * hs, rows, hs);
  }
}

template <typename F>
void ContextAttention<F>::forward(F* out, F* saved, const F* qkv, const AttentionShape& s,
                                  F* scratch) {
  if (variant_ == CpAttention::ulysses) return ulysses_forward(out, saved, qkv, s, scratch);
  const Scratch w = carve(scratch, s);
  const int64_t rows = int64_t(s.B) * s.T, P = 2 * int64_t(s.kv_width());
  // Nothing merged yet: every row's log-sum-exp is -inf.
  none_.resize(saved_elements(s), -std::numeric_limits<F>::infinity());
  backend_->device().from_host(saved, none_.data(), none_.size() * sizeof(F));
  if (variant_ == CpAttention::ring) {
    k_->copy_rows(w.kv[0], P, qkv + s.C, s.width(), rows, P);  // this rank's k | v, packed
    ring_forward(ring(1), w.kv, w.n, [&](int src, const F* kv) {
      forward_blocks(out, saved, qkv, kv, src, s, w.block);
    });
    return;
  }
  k_->copy_rows(w.rin, P, qkv + s.C, s.width(), rows, P);
  if (cp_ > 1) {
    const comm::flight::Site site("cp.kv_gather");
    comm::Work g = group_.all_gather(
        std::span<const std::byte>(reinterpret_cast<const std::byte*>(w.rin), w.n * sizeof(F)),
        std::span<std::byte>(reinterpret_cast<std::byte*>(w.kv[0]), size_t(cp_) * w.n * sizeof(F)));
    wait(g);
  } else {
    k_->copy(w.kv[0], w.rin, w.n);
  }
  for (int step = 0; step < cp_; ++step) {
    const int src = (rank_ - step + cp_) % cp_;
    forward_blocks(out, saved, qkv, w.kv[0] + size_t(src) * w.n, src, s, w.block);
  }
}

template <typename F>
void ContextAttention<F>::backward(F* dqkv, const F* dout, const F* qkv, const F* out,
                                   const F* saved, const AttentionShape& s, F* scratch) {
  if (variant_ == CpAttention::ulysses) {
    return ulysses_backward(dqkv, dout, qkv, out, saved, s, scratch);
  }
  const Scratch w = carve(scratch, s);
  const int64_t rows = int64_t(s.B) * s.T, W = s.width(), P = 2 * int64_t(s.kv_width());
  k_->zero(dqkv, size_t(rows) * size_t(W));
  const AttentionBlock all{s.B, s.T, s.T, s.C, s.NH, s.KVH, false};
  k_->attention_block_delta(Rows<F>{w.delta, s.NH, int64_t(s.T) * s.NH},
                            Rows<const F>{dout, s.C, int64_t(s.T) * s.C},
                            Rows<const F>{out, s.C, int64_t(s.T) * s.C}, all);
  const F* own = nullptr;  // this rank's key/value gradients, summed over every rank's queries
  if (variant_ == CpAttention::ring) {
    k_->copy_rows(w.kv[0], P, qkv + s.C, W, rows, P);
    ring_backward(ring(1), w.kv, w.acc, w.mine, w.rin, w.n, [&](int src, const F* kv, F* dkv) {
      backward_blocks(dqkv, dkv, dout, w.delta, saved, qkv, kv, src, s, w.block);
    });
    own = w.mine;
  } else {
    k_->copy_rows(w.rin, P, qkv + s.C, W, rows, P);
    const size_t all_n = size_t(cp_) * w.n;
    if (cp_ > 1) {
      const comm::flight::Site site("cp.kv_gather");
      comm::Work g = group_.all_gather(
          std::span<const std::byte>(reinterpret_cast<const std::byte*>(w.rin), w.n * sizeof(F)),
          std::span<std::byte>(reinterpret_cast<std::byte*>(w.kv[0]), all_n * sizeof(F)));
      wait(g);
    } else {
      k_->copy(w.kv[0], w.rin, w.n);
    }
    k_->zero(w.acc[0], all_n);
    for (int step = 0; step < cp_; ++step) {
      const int src = (rank_ - step + cp_) % cp_;
      backward_blocks(dqkv, w.acc[0] + size_t(src) * w.n, dout, w.delta, saved, qkv,
                      w.kv[0] + size_t(src) * w.n, src, s, w.block);
    }
    own = w.acc[0];
    if (cp_ > 1) {
      // Block j of every rank's gradients goes to rank j, which sums what it gets in rank order.
      const comm::flight::Site site("cp.grad_all_to_all");
      comm::Work a = group_.all_to_all(
          std::span<const std::byte>(reinterpret_cast<const std::byte*>(w.acc[0]),
                                     all_n * sizeof(F)),
          std::span<std::byte>(reinterpret_cast<std::byte*>(w.rin), all_n * sizeof(F)));
      wait(a);
      for (int j = 1; j < cp_; ++j) k_->add(w.rin, w.rin + size_t(j) * w.n, w.n);
      own = w.rin;
    }
  }
  k_->copy_rows(dqkv + s.C, W, own, P, rows, P);
}

template class ContextAttention<float>;
template class ContextAttention<double>;

}  // namespace tetra::parallel
