// Context parallelism (seed 004, "ロングシーケンスと低精度"; docs/context_parallel.md): the cp
// ranks of a group each hold T/cp tokens of every sequence, so every per-token activation is ÷ cp.
// Attention is the one layer that mixes tokens; it runs blockwise over the key/value chunks of the
// other ranks, merged with the log-sum-exp rule (Kernels::attention_block_*).
//
// The split. A sequence is cut into 2·cp chunks of c = T/(2cp) tokens; cp rank r holds chunk r and
// chunk 2cp−1−r, in that order, as its local rows [0, c) and [c, 2c). Under the causal mask query
// chunk q sees key chunks 0..q, q full blocks and the causal diagonal (½): rank r's pair costs
// (r + ½) + (2cp−1−r + ½) = 2cp blocks, the same on every rank, where a contiguous split (chunks
// 2r and 2r+1) costs 4r + 2: 2 on rank 0 and 4cp−2 on the last.
//
// Ring attention (CpAttention::ring). Step s = 0..cp−1 computes the local queries against the key
// and value chunks of rank r−s, while the next step's keys and values come in from rank r−1 and
// this step's go out to rank r+1 (cp−1 exchanges of the local K and V, overlapped with the blocks).
// At every step a rank computes two chunk blocks' worth (step 0: two causal diagonal blocks and one
// full block; later steps: two full blocks; the rest are masked and skipped). Backward sends the
// keys and values around again; the gradients of rank o's keys and values start at rank o+1, which
// sends its share on, each next rank adds its own (the partial sum arrives while it computes), and
// after cp−1 hops they reach o, which adds its own share. Per layer and micro-batch a rank sends
// (cp−1)·B·2c·2·kv_width elements forward and twice that backward.
//
// All-gather (CpAttention::all_gather), for comparison: every rank's K and V gathered up front
// (the same (cp−1)/cp of the bytes, in one exposed collective), the blocks computed locally, and
// the key/value gradients of every chunk summed onto their owners by an all-to-all in rank order.
//
// Ulysses (CpAttention::ulysses; DeepSpeed-Ulysses): an all-to-all turns sequence shards into head
// shards. Rank j receives every rank's rows of its NH/cp query heads (and their key/value heads),
// attends over the whole sequences locally (the same chunk blocks, addressed where each rank's
// rows landed, so no reordering copy), and a second all-to-all returns each rank's rows of every
// head group. Key/value heads split cp ways when cp divides them; when there are fewer than cp
// (cp a multiple of KVH) each rank takes the one its query heads read, and the copies' gradients
// are summed on the way back. Backward repeats forward's qkv all-to-all rather than keep the
// gathered copy, and sends each row's softmax term (NH values) instead of the output (C values).
// Per layer and micro-batch a rank sends (cp−1)/cp of: forward qkv and out; backward qkv, dout,
// delta and dqkv — the ring's K/V payload divided by cp, times (W + C)/(2·kv_width).
//
// Ulysses inside, the ring across (the 2-D "hybrid" layout; cp.ulysses = u < cp): the cp group is
// r = cp/u Ulysses groups of u consecutive cp ranks (the mesh places cp ranks next to each other,
// so a Ulysses group shares a node's fast links when it fits one). Rank g·u + j (group g, member
// j) exchanges heads inside its group as above, which leaves it the 2u chunks of its group's
// members for NH/u heads; their keys and values then go around the ring of the r ranks that hold
// the same heads (members j of every group), the ring's steps and gradient hops as above. A hop
// is u·B·2c·2·kv_heads·hs elements (the group's rows of this rank's kv_heads: KVH/u, or 1 when
// replicated), r−1 of them forward and 2(r−1) backward, beside the all-to-alls over u ranks. u = cp
// is plain Ulysses (a ring of one); a rank computes its group's u chunk pairs' blocks on NH/u
// heads, 4·u·cp halves.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/cp_attention.h"
#include "kernels/backend.h"
#include "kernels/kernels.h"

namespace tetra::parallel {

/** Where rank `rank` of a cp group's tokens lie in a sequence of T tokens. */
class CpSplit {
 public:
  /** Refuses T that 2·cp does not divide, saying what would. */
  CpSplit(int T, int cp, int rank);

  int T() const { return T_; }
  int cp() const { return cp_; }
  int rank() const { return rank_; }
  /** c = T / (2·cp): tokens per chunk. */
  int chunk() const { return T_ / (2 * cp_); }
  /** 2c = T / cp: tokens this rank holds per sequence. */
  int local_tokens() const { return T_ / cp_; }
  /** The global chunk index of local chunk i (0 or 1) of cp rank r. */
  static int chunk_of(int r, int i, int cp) { return i == 0 ? r : 2 * cp - 1 - r; }
  /** The sequence position of local row t (0 <= t < 2c). */
  int position(int t) const;
  /** Calls f(row, position, count) for each run of local rows among [first, first + rows) of
   *  (B·2c) whose positions are consecutive: a chunk of a sequence, or its part in range. */
  template <typename Fn>
  void for_each_run(int64_t first, int64_t rows, Fn&& f) const {
    const int64_t c = chunk();
    for (int64_t r = first, end = first + rows; r < end;) {
      const int64_t n = std::min(c - r % c, end - r);
      f(r, position(int(r % (2 * c))), n);
      r += n;
    }
  }
  /** Copies this rank's rows of B sequences: local (B, 2c, width) from full (B, T, width). Host
   *  memory: the token ids and targets a rank feeds its model. */
  template <typename V>
  void take(V* local, const V* full, int B, int width = 1) const;
  /** The inverse: this rank's rows of full (B, T, width) from local (B, 2c, width). */
  template <typename V>
  void put(V* full, const V* local, int B, int width = 1) const;

 private:
  int T_, cp_, rank_;
};

using tetra::cp_attention_from_string;
using tetra::cp_attention_name;
using tetra::CpAttention;

/** What the attention exchanges moved, and how long the compute thread waited for them. */
struct CpCounters {
  double sent_bytes = 0.0;  // ring model (comm::Work::sent_bytes) of every send and collective
  double wait_ms = 0.0;     // exposed: time blocked on an exchange after the blocks it overlaps
  int64_t blocks = 0;  // c x c chunk blocks computed, in halves (a causal diagonal counts 1), over
                       // this rank's heads (ulysses: u·cp times as many on 1/u of them)
};

struct UlyssesHeads;

/** Causal self-attention of one cp rank's 2c tokens of B sequences (AttentionShape with T = 2c
 *  local rows; C, NH, KVH this rank's heads), across the cp group. */
template <typename F>
class ContextAttention {
 public:
  /** Over `group` (the mesh's cp group; its size is cp, its rank this rank's chunk pair). Under
   *  ulysses, `ulysses` ranks form each all-to-all group and cp/ulysses of them a ring (0: the
   *  whole group, no ring); it must divide cp. Collective over the group when it splits it. */
  ContextAttention(Backend& backend, comm::Communicator group, CpAttention variant,
                   int ulysses = 0);

  Backend& backend() const { return *backend_; }
  int cp() const { return cp_; }
  int rank() const { return rank_; }
  CpAttention variant() const { return variant_; }
  /** Ulysses: the ranks of one all-to-all group (cp / ulysses() of them form a ring). */
  int ulysses() const { return u_; }
  /** This rank's split of sequences of which it holds `local_T` = 2c tokens. */
  CpSplit split(int local_T) const { return CpSplit(local_T * cp_, cp_, rank_); }

  /** Elements forward keeps for backward next to its output: the row log-sum-exp (B, 2c, NH;
   *  ulysses: of its group's rows for this rank's NH/u heads, as many). */
  size_t saved_elements(const AttentionShape& s) const;
  /** Elements of the scratch forward and backward take. Under ulysses, refuses heads that do not
   *  split over the group (check_ulysses_heads). */
  size_t scratch_elements(const AttentionShape& s) const;
  /** out (B,2c,C) = causal attention of the local queries over the whole sequences' keys and
   *  values; qkv (B,2c,W) is the local rows' fused [q | k | v]. Collective over the group. */
  void forward(F* out, F* saved, const F* qkv, const AttentionShape& s, F* scratch);
  /** dqkv (B,2c,W) overwritten from dout (B,2c,C), given forward's qkv, out and saved.
   *  Collective over the group. */
  void backward(F* dqkv, const F* dout, const F* qkv, const F* out, const F* saved,
                const AttentionShape& s, F* scratch);

  const CpCounters& counters() const { return counters_; }
  void reset_counters() { counters_ = CpCounters(); }

 private:
  struct Scratch;
  // A ring of `size` ranks of the group, this one at `pos`: the cp group for ring attention, the
  // ranks holding the same heads under ulysses.
  struct Ring {
    int size = 1, pos = 0, next = 0, prev = 0;  // next and prev: ranks of the group
    int src(int step) const { return (pos - step + size) % size; }
  };
  // The ring of ranks `stride` apart through this one: stride 1, the whole group (ring
  // attention); u, the members at this rank's place in every Ulysses group.
  Ring ring(int stride) const;
  Scratch carve(F* scratch, const AttentionShape& s) const;
  // Ring attention's steps: at step s, blocks(src, kv) with ring member src's n elements of keys
  // and values while the next step's come in (kv[0] holds this rank's when called).
  template <typename Fn>
  void ring_forward(const Ring& ring, F* const kv[2], size_t n, Fn&& blocks);
  // Backward's: blocks(src, kv, dkv) adds the local queries' share of src's key/value gradients
  // to dkv (zeroed), which the ring carries home, summing every member's share on the way; this
  // rank's own end up in `own`. acc[2] and `part` are scratch of n elements each.
  template <typename Fn>
  void ring_backward(const Ring& ring, F* const kv[2], F* const acc[2], F* own, F* part, size_t n,
                     Fn&& blocks);
  // Calls f(query row, key row, block) for the blocks of the local query chunks (rows [0, c) and
  // [c, 2c)) against rank src's key/value chunks that the causal mask leaves, and counts them.
  template <typename Fn>
  void for_each_block(int src, const AttentionShape& s, Fn&& f);
  // Ulysses: the all-to-alls over the u ranks of a Ulysses group around attention on this rank's
  // heads; heads_in packs this rank's rows of every member's heads into scratch kv[0] and
  // exchanges them into kv[1] (every member's rows of this rank's heads).
  void ulysses_heads_in(const F* qkv, const AttentionShape& s, const UlyssesHeads& h,
                        const Scratch& w);
  void ulysses_forward(F* out, F* saved, const F* qkv, const AttentionShape& s, F* scratch);
  void ulysses_backward(F* dqkv, const F* dout, const F* qkv, const F* out, const F* saved,
                        const AttentionShape& s, F* scratch);
  // Calls f(query member, query chunk, key member, key chunk, block) for the blocks of this
  // Ulysses group's chunks against those of group `src` (a ring member) that the causal mask
  // leaves, and counts them.
  template <typename Fn>
  void for_each_heads_block(int src, const AttentionShape& s, const UlyssesHeads& h, Fn&& f);
  // Block j (n elements) of `send` to Ulysses group member j, member j's block to `recv` block j
  // (a copy in a group of one); waited for and counted.
  void all_to_all(const F* send, F* recv, size_t n);
  // The blocks of the local queries against the key/value chunks of rank `src` held in kv
  // (B,2c,2·kv_width): forward merges into out/lse; backward accumulates dq into dqkv and dk/dv
  // into dkv (same layout as kv).
  void forward_blocks(F* out, F* lse, const F* qkv, const F* kv, int src, const AttentionShape& s,
                      F* block_scratch);
  void backward_blocks(F* dqkv, F* dkv, const F* dout, const F* delta, const F* lse, const F* qkv,
                       const F* kv, int src, const AttentionShape& s, F* block_scratch);
  comm::Work send(const F* data, size_t n, int dst, int tag) const;
  comm::Work recv(F* data, size_t n, int src, int tag) const;
  // Waits for w, counting the time and its bytes, and leaves it done (a no-op to wait again).
  void wait(comm::Work& w);

  Backend* backend_;
  Kernels<F>* k_;
  comm::Communicator group_;
  comm::Communicator ulysses_group_;  // u consecutive ranks of group_ (group_ itself at u = cp)
  CpAttention variant_;
  int cp_ = 1, rank_ = 0;
  int u_ = 1;  // Ulysses group size; ring attention's rings are cp_ / u_ ranks
  CpCounters counters_;
  std::vector<F> none_;  // -inf, the log-sum-exp of no block, copied into forward's saved state
};

/** Ulysses' head split: each of the `cp` ranks takes `heads` / cp query heads and, of `kv_heads`,
 *  kv_heads / cp, or one when there are fewer than cp (cp must then be a multiple of kv_heads).
 *  Heads are this tp rank's (model heads / tp). Refuses other counts, naming the cp that work. */
struct UlyssesHeads {
  int q = 0, kv = 0;  // per rank
  bool replicated = false;
  /** The key/value head (of kv_heads) rank j's block carries first. */
  int first_kv(int j, int cp, int kv_heads) const {
    return replicated ? j * kv_heads / cp : j * kv;
  }
};
UlyssesHeads ulysses_heads(int heads, int kv_heads, int cp);

}  // namespace tetra::parallel
