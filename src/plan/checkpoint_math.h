// Failure arithmetic: cluster MTBF, the Young/Daly checkpoint interval, loss per failure, goodput.
#pragma once

#include <cstdint>

#include "plan/training_spec.h"

namespace tetra::plan {

/** Failures are Poisson and add up: one device's MTBF divided by the device count. */
double cluster_mtbf_hours(double device_mtbf_hours, int64_t devices);

/** Young/Daly first-order optimum: tau* = sqrt(2 * delta * MTBF), all in the same unit. */
double young_daly_interval(double write_time, double mtbf);

/** Bytes per parameter a checkpoint holds: bf16 weights + fp32 master + Adam m, v = 14 (gradients
 *  are not saved); fp32: weights + m + v = 12. */
double checkpoint_bytes_per_param(Precision p);

struct CheckpointPlan {
  double bytes = 0;               // whole checkpoint, all shards
  double write_seconds = 0;       // delta: bytes / storage bandwidth
  double mtbf_seconds = 0;        // of the whole job
  double interval_seconds = 0;    // Young/Daly tau*
  double loss_per_failure_s = 0;  // wall-clock: tau/2 redone + restart
  double loss_per_failure_gpu_h = 0;
  double goodput = 0;  // 1 - delta/tau - (tau/2 + restart)/MTBF
};

/** The checkpoint plan for `params` parameters on `devices` devices. */
CheckpointPlan checkpoint_plan(double params, Precision precision, double storage_bw,
                               double device_mtbf_hours, int64_t devices, double restart_seconds);

}  // namespace tetra::plan
