// A parallel layout: how the GPUs are split into TP x PP x DP (EP borrowing DP ranks), the ZeRO
// stage, and the pipeline schedule.
#pragma once

#include <cstdint>
#include <string>

namespace tetra::plan {

enum class Schedule { GPipe, OneFOneB, Interleaved };

Schedule parse_schedule(const std::string& text);
const char* to_string(Schedule s);

/** gpus = tp * pp * dp. Rank order is tp fastest, then dp, then pp (DESIGN.md: tp-ep-dp-pp);
 *  the ep expert groups are carved out of consecutive dp ranks, so ep divides dp. */
struct Layout {
  int64_t tp = 1;
  int64_t pp = 1;
  int64_t dp = 1;
  int64_t ep = 1;
  int zero = 0;  // 0 = plain DP, 1/2/3 = ZeRO stage
  Schedule schedule = Schedule::OneFOneB;
  int64_t v = 1;             // model chunks per pipeline rank (interleaved only)
  int64_t micro_batch = 1;   // sequences per micro-batch
  int64_t microbatches = 1;  // m: micro-batches per step per pipeline
};

/** "TP 8 x PP 4 x DP 16, ZeRO-1, 1f1b, m=32" */
std::string describe(const Layout& l);

}  // namespace tetra::plan
