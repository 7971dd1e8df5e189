// The report of `tetra plan`: one JSON object, and the same content as a readable table.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "plan/plan_config.h"

namespace tetra::plan {

/** Ledgers, communication, bubble, checkpoint and layout for `in`; `top` best layouts listed. */
nlohmann::json plan_report(const PlanInputs& in, int top);

/** The report as aligned text tables. */
std::string format_report(const nlohmann::json& report);

}  // namespace tetra::plan
