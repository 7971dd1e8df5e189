// The report of `tetra plan`: one JSON object, and the same content as a readable table.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "plan/layout_search.h"
#include "plan/plan_config.h"

namespace tetra::plan {

/** The layout a report is about: given in full, else the best of the (constrained) search. */
struct ChosenLayout {
  SearchResult search;
  LayoutEstimate chosen;
  std::string source;  // "given", "search", "search (nothing fits; smallest shown)"
};
ChosenLayout choose_layout(const PlanInputs& in);

/** Ledgers, communication, bubble, checkpoint and layout for `in`; `top` best layouts listed. */
nlohmann::json plan_report(const PlanInputs& in, int top);

/** The report as aligned text tables; `explain` adds why each listed layout beats the next and
 *  the chosen layout's step time in the audit order (`tetra plan --explain`). */
std::string format_report(const nlohmann::json& report, bool explain = false);

}  // namespace tetra::plan
