// Typed values of command-line flags (--flag VALUE), refused with the module, flag and value.
#pragma once

#include <cstdint>
#include <string>

namespace tetra::cli {

/** An integer >= min_value; "[module] flag value: expected ..." otherwise. */
int64_t flag_int(const std::string& module, const std::string& flag, const std::string& value,
                 int64_t min_value = INT64_MIN);
/** A number; the error shows `example`. */
double flag_double(const std::string& module, const std::string& flag, const std::string& value,
                   const std::string& example);

}  // namespace tetra::cli
