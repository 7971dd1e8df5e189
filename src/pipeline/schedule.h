// Pipeline schedules as data: per pipeline rank, the ordered list of instructions it executes in
// one optimizer step. The same lists are simulated (pipeline/simulate.h: the planner's bubble and
// step time) and are what an executor runs, so the figures the planner prints are those of the
// schedule that trains.
//
// Stages: with p ranks and v chunks per rank there are p*v model chunks ("virtual stages"); chunk
// c of rank r is virtual stage c*p + r (Megatron's interleaving), so a micro-batch's forward
// visits ranks 0, 1, ..., p-1, 0, 1, ... and its backward the reverse. The V-shaped zero-bubble
// schedule (zb_v) places its two chunks as a V instead: chunk 0 of rank r is stage r, chunk 1
// stage 2p-1-r, so the forward runs down the ranks and back up, rank 0 holding the first and the
// last stage, and the hop between stages p-1 and p stays on rank p-1 (a send to itself).
//
// Zero-bubble schedules (Qi et al., "Zero Bubble Pipeline Parallelism") split each backward into
// the input gradient the previous stage waits for (backward_input, B) and the weight gradients
// nobody waits for (backward_weight, W), and fill the pipeline's idle time with W. A chunk keeps a
// micro-batch's activations from its forward until its W.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tetra::pipeline {

enum class Kind : uint8_t { gpipe, one_f_one_b, interleaved, zb_h1, zb_v };

/** "gpipe" | "1f1b" | "interleaved" | "zb_h1" | "zb_v"; throws tetra::Error listing them. */
Kind parse_kind(const std::string& text);
const char* to_string(Kind k);

enum class Op : uint8_t {
  recv_act,         // receive micro-batch mb's input activations of `chunk` from rank `peer`
  forward,          // forward of micro-batch mb through this rank's `chunk`
  send_act,         // send its output activations to rank `peer`
  recv_grad,        // receive the gradient of `chunk`'s output from rank `peer`
  backward,         // backward of micro-batch mb through `chunk` (B and W together)
  send_grad,        // send the gradient of `chunk`'s input to rank `peer`
  backward_input,   // B: the gradient of `chunk`'s input for micro-batch mb (zero-bubble)
  backward_weight,  // W: the weight gradients of micro-batch mb in `chunk`, after its B
  reduce_grads,     // every backward of this rank is done: data-parallel gradient reduction
  optimizer_step,   // the update
};
const char* to_string(Op op);

struct Instr {
  Op op;
  int mb = -1;    // micro-batch (-1 for reduce_grads, optimizer_step)
  int chunk = 0;  // this rank's model chunk, 0..v-1
  int peer = -1;  // the other rank of a send or receive
  bool operator==(const Instr&) const = default;
};

struct Schedule {
  Kind kind = Kind::one_f_one_b;
  int p = 1, m = 1, v = 1;
  std::vector<std::vector<Instr>> ranks;  // ranks[r]: rank r's program
  /** The virtual stage (0..p*v-1) of `chunk` on `rank`. */
  int stage(int rank, int chunk) const {
    return kind == Kind::zb_v && chunk == 1 ? 2 * p - 1 - rank : chunk * p + rank;
  }
  /** The rank holding virtual stage `stage`. */
  int rank_of(int stage) const {
    return kind == Kind::zb_v && stage >= p ? 2 * p - 1 - stage : stage % p;
  }
  /** The chunk of its rank that virtual stage `stage` is. */
  int chunk_of(int stage) const { return stage / p; }
  /** Whether the backward is split into backward_input and backward_weight. */
  bool split_backward() const { return kind == Kind::zb_h1 || kind == Kind::zb_v; }
};

/** The program of every rank for p ranks, m micro-batches and v chunks per rank (interleaved:
 * 2 or more; zb_v: 2; 1 otherwise). Refuses, with the reason and what would work, what cannot be
 * scheduled: p or m below 1, v != 1 outside interleaved and zb_v, interleaved with v < 2 or p < 2
 * or m not a multiple of p, zb_v with v != 2.
 *
 * The zero-bubble programs come from list scheduling at unit costs (F = B = W, instant sends):
 * whenever a rank is free it runs a B whose gradient has arrived, a forward whose input has
 * arrived while it holds fewer than its limit of micro-batches' activations, or a pending W, by
 * a policy: rank r deferring up to r W's and running forwards before B's (the paper's ZB-H1:
 * 1F1B's order, whose idle at the end the deferred W's fill), or up to r + 1, r + 2 or 2r; or
 * running B's first and a W only when nothing else is ready. make_schedule keeps the policy whose
 * program is shortest at unit costs. Forwards and B's of a chunk go in micro-batch order. zb_h1
 * holds at most p micro-batches' activations on a rank (1F1B's peak, its first stage's), of them
 * at most 1F1B's p - r not yet through B on rank r: its idle per rank is the paper's
 * (p-1)(F+B-W) at every m >= p, a third of 1F1B's (p-1)(F+B+W) at F = B = W. zb_v holds at most
 * 2p chunks (p micro-batches of a rank's layers) on every rank and prefers chunk 1 (nearer the
 * loss): at m >= p its idle is the start-up's (p-1) chunk forwards up to p = 5, and within 1.18
 * times that up to p = 8. A program fixes only each rank's order: it runs at any costs, its
 * receives waiting for their messages. */
Schedule make_schedule(Kind kind, int p, int m, int v = 1);

/** The forward-only program (evaluation) of every rank for p ranks, m micro-batches and v chunks
 * per rank, placed as `placement`'s stages (zb_v: a V; any other: interleaved): each micro-batch
 * through the virtual stages in order, no backward, no reduction and no update. A rank only ever
 * waits for a lower virtual stage, so the programs cannot wait in a cycle. */
Schedule make_forward_schedule(int p, int m, int v = 1, Kind placement = Kind::gpipe);

/** The most micro-batches whose activations each of `rank`'s chunks holds at once (forwarded, not
 * yet through backward, or B of a split backward): the slots a stage model keeps for the program
 * (GPipe m, 1F1B and zb_h1 at most p - rank). A split backward's W reads copies of what it needs,
 * held from B to W (kernels/weight_grads.h), not the slot. */
std::vector<int> peak_inflight_per_chunk(const Schedule& s, int rank);

/** The weight gradients `rank` holds pending under a split backward: after each of its B's, how
 *  many micro-batches of each chunk have been through B and not yet through W. Each of them holds
 *  copies of its W's operands (kernels/weight_grads.h), so the most of them at once is what those
 *  copies cost (the planner's ledger, plan/run_memory.h). Empty for a schedule without a split
 *  backward. */
std::vector<std::vector<int>> pending_weight_grads(const Schedule& s, int rank);

/** A stage split: layers per pipeline stage (p*v entries, virtual stage order). */
using Split = std::vector<int>;

/** Parses "5,6,6,5" (must have `stages` entries summing to `layers`, each >= 1), "" (even: needs
 * stages to divide layers) or "auto" (balanced: see balance_split). Errors name `key`. */
Split parse_split(const std::string& text, int layers, int stages, double embedding_cost,
                  double head_cost, const std::string& key);

/** The contiguous split of `layers` unit-cost layers over `stages` that minimises the most
 * loaded stage, where the first stage also carries `embedding_cost` and the last `head_cost`
 * (in layers); among those, the most even (least sum of squared stage costs), earlier stages
 * taking the extra layer. */
Split balance_split(int layers, int stages, double embedding_cost, double head_cost);

}  // namespace tetra::pipeline
