#include "plan/run_memory.h"

#include <algorithm>
#include <cmath>
#include <map>

namespace tetra::plan {

namespace {

int64_t align(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// Rows of one expert's product are padded to a multiple of this (model/moe.h, kMoeRowAlign).
constexpr int64_t kMoeRowAlign = 32;

// The chunks run_memory prices: the shape's, or the whole model with one micro-batch in flight.
std::vector<RunShape::Chunk> chunks_of(const RunShape& s) {
  return s.chunks.empty() ? std::vector<RunShape::Chunk>{{s.model.n_layer, 1, 0}} : s.chunks;
}

// ZeRO workspaces one class of `units` interchangeable units holds at once (parallel/
// data_parallel.cc, DataParallel::workspace_bound): gradients (stages 2, 3) of two units, one
// produced while the previous one reduces; parameters (stage 3) of the unit computed and the
// zero.prefetch gathers ahead, or every unit of the class and one more without resharding.
double workspace_bound(const RunShape& s, double units) {
  if (s.zero < 2 || units <= 0) return 0;
  const double grads = std::min(2.0, units);
  if (s.zero == 2) return grads;
  if (!s.reshard_after_forward) return units + 1;
  return std::min(1.0 + double(s.prefetch), units) + grads;
}

}  // namespace

int64_t RunShape::local_layers() const {
  if (chunks.empty()) return model.n_layer;
  int64_t n = 0;
  for (const Chunk& c : chunks) n += c.layers;
  return n;
}

int64_t RunShape::local_moe_layers() const {
  int64_t n = 0;
  for (const Chunk& c : chunks_of(*this)) {
    n += model.moe_layers(c.first, c.first + c.layers);
  }
  return n;
}

MoeRows moe_rows(const RunShape& s) {
  // model/moe.cc, MoeShape::of: an expert takes each token at most once and, with a capacity,
  // at most `cap` routes of each of the ep·B sequences that meet at it; this rank's E/ep experts
  // take at most every route of the ep group. The capacity is model/moe_routing.cc's
  // moe_capacity, ceil(cf·T·k/E) in double as there.
  MoeRows r;
  if (s.model.moe.experts <= 0) return r;
  const int64_t B = s.micro_batch, T = s.seq, k = s.model.moe.top_k, E = s.model.moe.experts;
  const int64_t ep = std::max<int64_t>(1, s.ep), El = E / ep, N = B * T;
  const int64_t per_rank = s.model.moe.capacity_factor > 0.0
                               ? std::min(int64_t(std::ceil(s.model.moe.capacity_factor *
                                                            double(T) * double(k) / double(E))) *
                                              B,
                                          N)
                               : N;
  const int64_t routed = std::min(El * per_rank * ep, N * k * ep);
  r.tokens = double(N);
  r.expert_rows = double(routed + El * (kMoeRowAlign - 1));
  if (ep > 1) {
    r.send_rows = double(N * k);
    r.recv_rows = double(routed);
  }
  return r;
}

FlatLayout flat_layout(const RunShape& s) {
  check_model_shape(s.model);  // a resolved shape: every width given, none left at 0
  const int64_t C = s.model.d_model, tp = s.tp;
  const int64_t unit = 16 * s.dp_cp(), expert_unit = 16 * s.edp();
  int64_t block = 0, moe_block = align(s.model.moe.experts * C, 16);
  const int64_t F = s.model.ffn;
  if (s.model.llama()) {
    // A Llama block (model/block_spec.h, the parts' registrations): mlp.down_proj (C, ffn),
    // mlp.up_proj and mlp.gate_proj (ffn, C), post_attention_layernorm (C), self_attn.o_proj
    // (C, C), v_proj and k_proj (KVH·hs, C), q_proj (C, C), input_layernorm (C); no biases. A
    // tensor-parallel rank holds 1/tp of every matrix (whole key/value heads with their query
    // heads). A MoE block (Mixtral) has the router (E, C), whole, in place of the MLP.
    const int64_t KV = s.model.n_kv_head * (C / s.model.n_head);
    const int64_t attention[] = {C, C * C / tp, KV * C / tp, KV * C / tp, C * C / tp, C};
    const int64_t mlp[] = {C * F / tp, F * C / tp, F * C / tp};
    for (int64_t n : attention) block += align(n, 16);
    moe_block += block;
    for (int64_t n : mlp) block += align(n, 16);
  } else {
    // A block: mlp.c_proj (w, b), mlp.c_fc (w, b), ln_2 (w, b), attn.c_proj (w, b), attn.c_attn
    // (w, b), ln_1 (w, b); a tensor-parallel rank holds 1/tp of the matrices and of the column-
    // parallel biases. A MoE block has the router (E, C), whole on every tp rank, in place of the
    // MLP (model/block.cc).
    const int64_t attention[] = {C, C, C * C / tp, C, 3 * C * C / tp, 3 * C / tp, C, C};
    const int64_t mlp[] = {C * 4 * C / tp, C, 4 * C * C / tp, 4 * C / tp};
    for (int64_t n : attention) block += align(n, 16);
    moe_block += block;
    for (int64_t n : mlp) block += align(n, 16);
  }
  // An expert unit: this rank's E/ep experts, each of the dense MLP's shape, whole (model/moe.cc,
  // register_experts): GPT-2's c_proj (w, b) and c_fc (w, b); Mixtral's w2, w3 and w1.
  const int64_t expert = s.model.llama()
                             ? 3 * align(C * F, 16)
                             : align(C * F, 16) + align(C, 16) + align(F * C, 16) + align(F, 16);
  // GPT-2's root: wpe, wte (this rank's padded rows), ln_f (w, b); on a pipeline's end stages wte
  // is a unit of its own next to the root (wpe) or the head (ln_f). Llama's (model/gpt.cc):
  // embed_tokens, lm_head (untied: the embedding's shape and slice) and model.norm; its first
  // stage's root is embed_tokens alone, its last stage's head lm_head (or a "wte" unit with the
  // tied copy before it) and model.norm.
  const int64_t wte = align(s.padded_vocab / tp * C, 16);
  FlatLayout f;
  if (s.model.llama()) {
    const int64_t lm_head = s.model.tie_embeddings ? 0 : wte, norm = align(C, 16);
    if (s.embedding && s.head) {
      f.ends = {double(align(wte + lm_head + norm, unit))};
    } else if (s.embedding) {
      f.ends = {double(align(wte, unit))};
    } else if (s.head && s.model.tie_embeddings) {
      f.ends = {double(align(wte, unit)), double(align(norm, unit))};
    } else if (s.head) {
      f.ends = {double(align(lm_head + norm, unit))};
    }
  } else {
    const int64_t wpe = align(s.model.max_seq * C, 16), ln_f = 2 * align(C, 16);
    if (s.embedding && s.head) {
      f.ends = {double(align(wpe + wte + ln_f, unit))};
    } else if (s.embedding) {
      f.ends = {double(align(wte, unit)), double(align(wpe, unit))};
    } else if (s.head) {
      f.ends = {double(align(wte, unit)), double(align(ln_f, unit))};
    }
  }
  f.block = double(align(block, unit));
  if (s.model.moe.experts > 0) {
    f.moe_block = double(align(moe_block, unit));
    f.experts =
        double(align(s.model.moe.experts / std::max<int64_t>(1, s.ep) * expert, expert_unit));
  }
  for (double e : f.ends) f.root += e;
  // The store's order (model/gpt.cc): a head without the embedding first (wte, head), the chunks
  // from last to first with their blocks from last to first, each MoE block's experts before it,
  // then the embedding (wte and the root, or the whole root).
  const bool head_alone = s.head && !s.embedding;
  if (head_alone) {
    for (double e : f.ends) f.units.push_back({e, false, false});
  }
  const std::vector<RunShape::Chunk> chunks = chunks_of(s);
  for (auto c = chunks.rbegin(); c != chunks.rend(); ++c) {
    for (int64_t l = c->first + c->layers - 1; l >= c->first; --l) {
      if (s.model.is_moe(l)) {
        f.units.push_back({f.experts, false, true});
        f.units.push_back({f.moe_block, true, false});
      } else {
        f.units.push_back({f.block, true, false});
      }
    }
  }
  if (s.embedding) {
    for (double e : f.ends) f.units.push_back({e, false, false});
  }
  const double N = double(s.dp_cp()), edp = double(s.edp());
  for (const FlatUnit& u : f.units) {
    f.total += u.elements;
    if (u.expert) f.expert_total += u.elements;
    f.shard += u.elements / (u.expert ? edp : N);
  }
  return f;
}

double weight_grad_copies(const RunShape& s) {
  if (s.pending_weight_grads.empty()) return 0;
  // Every product's rows: B·T/cp (gathered under sequence parallelism, as the products take them).
  const double BT = double(s.micro_batch) * double(s.seq) / double(s.cp);
  const double C = double(s.model.d_model), NH = double(s.model.n_head), tp = double(s.tp);
  const double Cl = C / tp, KVl = double(s.model.n_kv_head) / tp * (C / NH);
  const double Hl = double(s.model.ffn) / tp, H = double(s.model.ffn);
  const double Vl = double(s.padded_vocab) / tp;
  const MoeRows mr = moe_rows(s);
  const double E = double(s.model.moe.experts), N = mr.tokens, R = mr.expert_rows;
  // One B of a chunk keeps, per weight product dW (out, in) += dyᵀ·x, a copy of dy (rows x out)
  // and of x (rows x in), in buffers the pool hands out again only at the same size: counted by
  // size. model/attention.cc, mlp.cc, moe.cc and head.cc's linears, in their backward order.
  std::vector<std::map<double, double>> copies(s.chunks.size());
  for (size_t c = 0; c < s.chunks.size(); ++c) {
    std::map<double, double>& n = copies[c];
    auto product = [&](double rows, double out, double in, double times = 1) {
      n[rows * out] += times;
      n[rows * in] += times;
    };
    const bool head_here = s.head && c + 1 == s.chunks.size();
    if (head_here) product(BT, Vl, C);
    const RunShape::Chunk& ch = s.chunks[c];
    for (int64_t l = ch.first; l < ch.first + ch.layers; ++l) {
      product(BT, C, Cl);  // the attention's output projection
      if (s.model.llama()) {
        product(BT, KVl, C, 2);  // v, k
        product(BT, Cl, C);      // q
      } else {
        product(BT, Cl + 2 * KVl, C);  // the fused qkv
      }
      if (!s.model.is_moe(l)) {
        product(BT, C, Hl);                           // down
        product(BT, Hl, C, s.model.llama() ? 2 : 1);  // up (SwiGLU), in
        continue;
      }
      // The experts' products take their routed rows, which the routing decides: at most R
      // together, counted at that bound. The router's product takes every token.
      product(R, C, H);
      product(R, H, C, s.model.llama() ? 2 : 1);
      product(N, E, C);
    }
  }
  std::map<double, double> peak;
  for (const std::vector<int>& pending : s.pending_weight_grads) {
    std::map<double, double> held;
    for (size_t c = 0; c < copies.size() && c < pending.size(); ++c) {
      for (const auto& [size, count] : copies[c]) held[size] += double(pending[c]) * count;
    }
    for (const auto& [size, count] : held) peak[size] = std::max(peak[size], count);
  }
  double elements = 0;
  for (const auto& [size, count] : peak) elements += size * count;
  return 4.0 * elements;
}

RunMemory run_memory(const RunShape& s) {
  // This rank's tokens of a sequence: T/cp under context parallelism.
  const double B = double(s.micro_batch), T = double(s.seq), Tl = T / double(s.cp);
  const double C = double(s.model.d_model), NH = double(s.model.n_head);
  const double tp = double(s.tp), BT = B * Tl, BTC = BT * C;
  // This rank's query columns C/tp, columns of the fused q, k, v activation W (3C/tp; Llama's
  // C/tp + 2·(KVH/tp)·hs) and MLP channels Hl (4C/tp; Llama's ffn/tp).
  const double Cl = C / tp, KVl = double(s.model.n_kv_head) / tp * (C / NH);
  const double W = Cl + 2 * KVl, Hl = double(s.model.ffn) / tp;
  // Attention's saved state and backward scratch per layer (RunShape::flash_attention): per query
  // head, whatever the key/value heads. Under context parallelism (parallel/context_parallel.cc)
  // the saved state is each local row's log-sum-exp, and the scratch holds the packed K|V of the
  // local rows (n elements) six times for the ring (two in flight, two partial gradient sums, this
  // rank's own share and the one arriving) or three times cp for the all-gather (every rank's,
  // their gradients, the all-to-all's), the delta rows, and one c x c block's scratch of the
  // backend's kernel (the CPU's scores and probabilities; none on the GPU), c = T/(2cp). Ulysses
  // over groups of u ranks holds u blocks of its heads' qkv three times (sent, received, their
  // gradients), the output's blocks twice, a replicated key/value head's summed gradients, three
  // of the delta rows, a c x c block of its NH/(tp·u) heads and, with a ring across the groups
  // (u < cp), six of a hop's packed keys and values as the ring.
  const double NHl = NH / tp;
  const bool cp = s.cp > 1;
  const bool ulysses = cp && s.cp_attention == CpAttention::ulysses;
  const double u = ulysses ? double(s.cp_ulysses > 0 ? s.cp_ulysses : s.cp) : 1.0;
  const double att_saved = cp ? B * NHl * Tl : B * NHl * Tl * (s.flash_attention ? 1.0 : T);
  const double n_kv = B * Tl * 2 * KVl, chunk = Tl / 2;
  const double block_heads = NHl / u;
  const double block = s.flash_attention ? 0.0 : 2 * B * block_heads * chunk * chunk;
  double att_scratch = att_saved;
  if (ulysses) {
    const double hs = C / NH, kvh = double(s.model.n_kv_head) / tp;
    const bool replicated = kvh < u;
    const double kv = replicated ? 1.0 : kvh / u;
    const double hop = u < double(s.cp) ? u * BT * 2 * kv * hs : 0.0;
    att_scratch = 3 * u * BT * (block_heads + 2 * kv) * hs + 2 * BT * Cl +
                  (replicated ? kvh * BT * 2 * hs : 0.0) + 3 * BT * NHl + block + 6 * hop;
  } else if (cp) {
    att_scratch = (s.cp_attention == CpAttention::all_gather ? 3.0 * double(s.cp) : 6.0) * n_kv +
                  B * Tl * NHl + block;
  }
  const double rows = s.sequence_parallel ? BT / tp : BT;  // of the residual stream, per rank
  // A norm's statistics per row: a LayerNorm's mean and rstd, an RMSNorm's rstd.
  const double stats = s.model.llama() ? 1.0 : 2.0;
  constexpr double f32 = 4.0;
  const FlatLayout flat = flat_layout(s);
  const bool moe = s.model.moe.experts > 0;
  const MoeRows mr = moe_rows(s);
  // Experts are whole: each of the dense MLP's width, SwiGLU (gate, up, product) in a Llama.
  const double E = double(s.model.moe.experts), k = double(s.model.moe.top_k),
               H = double(s.model.ffn);
  const double expert_hidden = s.model.llama() ? 3.0 : 2.0;
  const double N = mr.tokens, R = mr.expert_rows, send = mr.send_rows, recv = mr.recv_rows;

  RunMemory m;
  m.params = f32 * (s.zero >= 3 ? flat.shard : flat.total);
  if (s.bf16_weights) m.params += 2.0 * flat.total;  // their bf16 copy (2 bytes each)
  m.grads = f32 * (s.zero >= 2 ? flat.shard : flat.total);
  m.optimizer = 2 * f32 * (s.zero >= 1 ? flat.shard : flat.total);  // AdamW m and v

  // What a block saves for backward (model/block.cc, BlockActs): ln_1 and ln_2 outputs (whole)
  // with their statistics, qkv (B,T,W), the attention output, the residual after attention, and
  // attention's saved state unless it is recomputed; then a dense block's MLP input and GELU
  // output (Llama: gate, up and their SwiGLU product), or a MoE block's (model/moe.cc, MoeActs)
  // router logits (N,E) and gates (N,k), its experts' rows in and out (R,C) and hidden
  // activations before and after GELU (R,ffn; Mixtral: gate, up, product), and under expert
  // parallelism the rows back from the
  // experts (send_rows,C). Tensor parallelism splits the column-parallel ones; sequence
  // parallelism the residual and the statistics.
  const double moe_acts = N * E + N * k + R * (2 * C + expert_hidden * H) + send * C;
  const double mlp_acts = BT * Hl * (s.model.llama() ? 3.0 : 2.0);
  auto block_saves = [&](bool with_att, bool moe_block) {
    return 2 * BTC + 2 * stats * rows + rows * C + BT * Cl + BT * W + (with_att ? att_saved : 0.0) +
           (moe_block ? moe_acts : mlp_acts);
  };
  // A MoE block's routing kept from forward to backward (MoeRoute): its int32 index vectors, a
  // route's row (N,k), the row each expert row gathers (R) and under expert parallelism the
  // received and sent rows' (recv_rows + send_rows), 4 bytes each like an f32 element.
  const double route = moe ? N * k + R + recv + send : 0.0;
  // ln_f (whole) and its statistics, this rank's logits, losses (model/head.cc).
  const double head = s.head ? BTC + stats * rows + BT * double(s.padded_vocab) / tp + BT : 0.0;
  // Per chunk and micro-batch in flight: the residual stream at every block boundary, and what
  // each block keeps (with each MoE block's routing).
  const bool keep = s.recompute != Recompute::full;
  const bool with_att = s.recompute == Recompute::none;
  double held = 0;
  for (const RunShape::Chunk& c : chunks_of(s)) {
    double kept = 0;
    for (int64_t l = c.first; keep && l < c.first + c.layers; ++l) {
      kept +=
          s.model.is_moe(l) ? block_saves(with_att, true) + route : block_saves(with_att, false);
    }
    held += double(c.slots) * ((double(c.layers) + 1) * rows * C + kept);
  }
  m.activations = f32 * (held + head) + weight_grad_copies(s);

  // Backward's residual gradient and scratch (model/block.cc, BlockScratch: dln, dqkv, attention's
  // scratch and a recomputed saved state, datty, dfch (Llama: and dup); under sequence parallelism
  // gathered rows and one block's norm weight (and bias) gradients; in a model with MoE blocks
  // their shared MoeScratch: dlogits (N,E), dgate (N,k), the received, sent and expert rows'
  // gradients and the experts' hidden gradient (R,ffn; Mixtral: and the up gradient)), and under
  // full recomputation one block's
  // activations (a dense or a MoE block's, whichever is larger: the two are views of one buffer)
  // with its output, and a MoE model's routing for it.
  const double moe_scratch =
      moe ? N * E + N * k + (recv + send + R) * C + R * H * (expert_hidden - 1) : 0.0;
  const double norm_grads = s.model.llama() ? 2 * C : 4 * C;
  const double scratch = BTC + BT * W + att_saved + att_scratch + BT * Cl +
                         BT * Hl * (s.model.llama() ? 2.0 : 1.0) +
                         (s.sequence_parallel ? BTC + norm_grads : 0.0) + moe_scratch;
  const double rerun =
      s.recompute == Recompute::full
          ? std::max(block_saves(false, false), moe ? block_saves(false, true) : 0.0) + rows * C +
                route
          : 0.0;
  m.temporaries = f32 * (rows * C + scratch + rerun);
  // A checkpoint's snapshot: parameters and both moments of what this rank writes (all of them
  // on data-parallel rank 0 without ZeRO, its shard with ZeRO; padding is not written).
  if (s.checkpoint) m.temporaries += 3 * f32 * (s.zero >= 1 ? flat.shard : flat.total);
  // Mixed precision: the bf16 copies of the largest product's operands (model/gpt.cc), an MLP
  // product's or the head's backward with the (BT,Vp/tp) logit gradient, a MoE block's expert
  // product over all its R rows with a (4C,C) weight, or attention's q, k and v (B,T,W) (or v and
  // dy) with its probabilities on the CPU backend (its attention kernel). gpt.cc reserves 32
  // elements more for the operands' alignment, and the CPU attention rounds its q, k, v copy up
  // to 32 elements: at most 126 bytes this ledger leaves out (tests/train/memory_test.cc pins the
  // copies' formula).
  if (s.bf16) {
    const double V = double(s.padded_vocab) / tp;
    const double attention = s.flash_attention ? 0.0 : BT * W + att_saved;
    const double experts = moe ? R * H + std::max(H, R) * C : 0.0;
    m.temporaries += 2.0 * std::max({BT * Hl + std::max(Hl, BT) * C, BT * V + std::max(BT, V) * C,
                                     experts, attention});
  }

  // ZeRO workspaces (parallel/data_parallel.cc, reserve_workspaces): each end unit (the root, or a
  // pipeline stage's wte and root or head) alone, its gradient under stages 2 and 3 and its
  // parameters under 3; the blocks ("h.N", at the largest block's size) and the expert units
  // ("h.N.experts") each a class of workspace_bound workspaces.
  const double blocks = double(s.local_layers()), expert_units = double(s.local_moe_layers());
  double block_size = 0;
  for (const FlatUnit& u : flat.units) {
    if (u.block) block_size = std::max(block_size, u.elements);
  }
  const double ends = s.zero == 3 ? 2.0 : s.zero == 2 ? 1.0 : 0.0;
  const double dense_ws = ends * flat.root + workspace_bound(s, blocks) * block_size;
  const double expert_ws = workspace_bound(s, expert_units) * flat.experts;
  m.comm = f32 * (dense_ws + expert_ws);
  // dp.reduce_dtype=bf16: a bf16 staging buffer of the flat gradient (stages 0, 1) or of each
  // workspace whose reductions communicate (2, 3: the dense ones over dp > 1 ranks, the experts'
  // over edp > 1).
  if (s.reduce_bf16 && s.dp_cp() > 1) {
    m.comm += s.zero < 2 ? 2.0 * flat.total : 2.0 * dense_ws + (s.edp() > 1 ? 2.0 * expert_ws : 0);
  }
  return m;
}

RunMemory expert_memory(const RunShape& s) {
  RunMemory m;
  if (s.model.moe.experts <= 0) return m;
  constexpr double f32 = 4.0;
  const FlatLayout flat = flat_layout(s);
  const double shard = flat.expert_total / double(s.edp());
  m.params = f32 * (s.zero >= 3 ? shard : flat.expert_total);
  if (s.bf16_weights) m.params += 2.0 * flat.expert_total;
  m.grads = f32 * (s.zero >= 2 ? shard : flat.expert_total);
  m.optimizer = 2 * f32 * (s.zero >= 1 ? shard : flat.expert_total);
  const double ws = workspace_bound(s, double(s.local_moe_layers())) * flat.experts;
  m.comm = f32 * ws * (s.reduce_bf16 && s.dp_cp() > 1 && s.zero >= 2 && s.edp() > 1 ? 1.5 : 1.0);
  return m;
}

}  // namespace tetra::plan
