// Pipeline schedules as data: per pipeline rank, the ordered list of instructions it executes in
// one optimizer step. The same lists are simulated (pipeline/simulate.h: the planner's bubble and
// step time) and are what an executor runs, so the figures the planner prints are those of the
// schedule that trains.
//
// Stages: with p ranks and v chunks per rank there are p*v model chunks ("virtual stages"); chunk
// c of rank r is virtual stage c*p + r (Megatron's interleaving), so a micro-batch's forward
// visits ranks 0, 1, ..., p-1, 0, 1, ... and its backward the reverse.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tetra::pipeline {

enum class Kind : uint8_t { gpipe, one_f_one_b, interleaved };

/** "gpipe" | "1f1b" | "interleaved"; throws tetra::Error listing them. */
Kind parse_kind(const std::string& text);
const char* to_string(Kind k);

enum class Op : uint8_t {
  recv_act,        // receive micro-batch mb's input activations of `chunk` from rank `peer`
  forward,         // forward of micro-batch mb through this rank's `chunk`
  send_act,        // send its output activations to rank `peer`
  recv_grad,       // receive the gradient of `chunk`'s output from rank `peer`
  backward,        // backward of micro-batch mb through `chunk`
  send_grad,       // send the gradient of `chunk`'s input to rank `peer`
  reduce_grads,    // every backward of this rank is done: data-parallel gradient reduction
  optimizer_step,  // the update
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
  int stage(int rank, int chunk) const { return chunk * p + rank; }
};

/** The program of every rank for p ranks, m micro-batches and v chunks per rank (interleaved
 * only; 1 otherwise). Refuses, with the reason and what would work, what cannot be scheduled:
 * p or m below 1, v != 1 outside interleaved, interleaved with v < 2 or p < 2 or m not a
 * multiple of p. */
Schedule make_schedule(Kind kind, int p, int m, int v = 1);

/** The forward-only program (evaluation) of every rank for p ranks, m micro-batches and v chunks
 * per rank: each micro-batch through the virtual stages in order, no backward, no reduction and
 * no update. A rank only ever waits for a lower virtual stage, so the programs cannot wait in a
 * cycle. */
Schedule make_forward_schedule(int p, int m, int v = 1);

/** The most micro-batches whose activations each of `rank`'s chunks holds at once (forwarded, not
 * yet backward): how many a stage model must keep for the program (GPipe m, 1F1B p - rank). */
std::vector<int> peak_inflight_per_chunk(const Schedule& s, int rank);

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
