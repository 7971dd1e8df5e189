#include "plan/checkpoint_math.h"

#include <algorithm>
#include <cmath>

namespace tetra::plan {

double cluster_mtbf_hours(double device_mtbf_hours, int64_t devices) {
  return device_mtbf_hours / double(devices);
}

double young_daly_interval(double write_time, double mtbf) {
  return std::sqrt(2.0 * write_time * mtbf);
}

double checkpoint_bytes_per_param(Precision p) { return p == Precision::Fp32 ? 12.0 : 14.0; }

CheckpointPlan checkpoint_plan(double params, Precision precision, double storage_bw,
                               double device_mtbf_hours, int64_t devices, double restart_seconds) {
  CheckpointPlan c;
  c.bytes = params * checkpoint_bytes_per_param(precision);
  c.write_seconds = c.bytes / storage_bw;
  c.mtbf_seconds = cluster_mtbf_hours(device_mtbf_hours, devices) * 3600.0;
  c.interval_seconds = young_daly_interval(c.write_seconds, c.mtbf_seconds);
  c.loss_per_failure_s = c.interval_seconds / 2 + restart_seconds;
  c.loss_per_failure_gpu_h = c.loss_per_failure_s * double(devices) / 3600.0;
  const double waste = c.write_seconds / c.interval_seconds + c.loss_per_failure_s / c.mtbf_seconds;
  c.goodput = std::clamp(1.0 - waste, 0.0, 1.0);
  return c;
}

}  // namespace tetra::plan
