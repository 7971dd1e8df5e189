// The one command-line parser of every tetra command: `--flag VALUE` and `--flag=VALUE`,
// switches, repeatable flags, `--section.key=value` config overrides and `--` before a
// pass-through command. Flag values are checked like config keys (core/config.h parse_value):
// the same 64-bit parsing, ranges and messages.
#pragma once

#include <map>
#include <set>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "core/config.h"

namespace tetra::cli {

/** One flag: spec.key is its name ("--top-k"); kind, default, help and valid range as for a
 * config key. A Bool flag is a switch: it takes no value. */
struct Flag {
  KeySpec spec;
  std::string metavar = {};               // the value's name in the help, "FILE"
  std::vector<std::string> aliases = {};  // other names, "-n"
  bool repeatable = false;                // a String flag given several times
};

class ArgParser {
 public:
  /** `module` prefixes errors ("generate" -> "[generate] ..."); `command` is how the user calls
   * it ("tetra generate"); `usage` is the help text above the flag list. */
  ArgParser(std::string module, std::string command, std::string usage, std::vector<Flag> flags);

  /** Also take `--<prefix>...=value` (or `--<prefix>... value`) as overrides of the keys of
   * `schema` (checked later by Config; here they serve to suggest a key for a wrong flag). */
  void allow_overrides(const ConfigSchema& schema, const std::string& prefix = "");
  /** Also take everything after `--` as a command passed on untouched (see rest()). */
  void allow_rest();
  /** Extra help text after the flag list (e.g. the config keys). */
  void set_epilog(std::string epilog) { epilog_ = std::move(epilog); }

  /** Parses `args`. Returns false after printing the help for --help or -h; throws tetra::Error
   * naming the flag for an unknown flag, a missing or bad value. */
  bool parse(const Args& args);

  /** True when the command line gave the flag. */
  bool given(const std::string& name) const;
  int64_t i(const std::string& name) const;
  double f(const std::string& name) const;
  bool b(const std::string& name) const;
  const std::string& s(const std::string& name) const;
  /** Every value of a repeatable flag, in order. */
  const std::vector<std::string>& all(const std::string& name) const;
  /** The "section.key=value" overrides, in order, without the leading "--". */
  const std::vector<std::string>& overrides() const { return overrides_; }
  const Args& rest() const { return rest_; }

  std::string help() const;

 private:
  const Flag* find(const std::string& name) const;
  const Flag& flag(const std::string& name) const;
  [[noreturn]] void unknown(const std::string& arg) const;

  std::string module_, command_, usage_, epilog_;
  std::vector<Flag> flags_;
  const ConfigSchema* override_schema_ = nullptr;
  bool rest_allowed_ = false;
  std::string override_prefix_;
  std::map<std::string, ConfigValue> values_;
  std::map<std::string, std::vector<std::string>> repeated_;
  std::set<std::string> given_;
  std::vector<std::string> overrides_;
  Args rest_;
};

/** The keys of `schema` for a --help: name, default, valid range and help, one per line. */
std::string describe_keys(const ConfigSchema& schema);

}  // namespace tetra::cli
