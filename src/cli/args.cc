#include "cli/args.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdio>

#include "core/error.h"

namespace tetra::cli {

namespace {

bool starts_with(const std::string& s, const std::string& prefix) {
  return s.rfind(prefix, 0) == 0;
}

// A following argument that is itself a long flag is not taken as a value: `--config --json`
// means the value was forgotten. A value that starts with "--" can still be given as --flag=--x.
bool looks_like_flag(const std::string& s) { return s.size() > 2 && starts_with(s, "--"); }

std::string valid_and_default(const KeySpec& spec) {
  std::string out;
  if (spec.kind == ValueKind::Int || spec.kind == ValueKind::Float || !spec.valid.empty()) {
    out = describe_valid(spec);
  }
  if (spec.kind != ValueKind::Bool && spec.default_value != "\"\"" && !spec.default_value.empty()) {
    out += (out.empty() ? "" : "; ") + std::string("default ") + spec.default_value;
  }
  return out.empty() ? "" : " (" + out + ")";
}

// Help text is wrapped to 100 columns, continuation lines under the first.
const std::string kIndent(25, ' ');

std::string wrapped(const std::string& text, const std::string& indent = kIndent) {
  std::string out, line;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find(' ', start);
    if (end == std::string::npos) end = text.size();
    const std::string word = text.substr(start, end - start);
    if (!line.empty() && indent.size() + line.size() + 1 + word.size() > 100) {
      out += line + "\n" + indent;
      line.clear();
    }
    line += (line.empty() ? "" : " ") + word;
    start = end + 1;
  }
  return out + line;
}

}  // namespace

ArgParser::ArgParser(std::string module, std::string command, std::string usage,
                     std::vector<Flag> flags)
    : module_(std::move(module)),
      command_(std::move(command)),
      usage_(std::move(usage)),
      flags_(std::move(flags)) {
  for (const Flag& f : flags_) {
    if (f.repeatable) continue;
    values_[f.spec.key] =
        parse_value(f.spec, f.spec.default_value, "[" + module_ + "] internal: the default of ");
  }
}

void ArgParser::allow_overrides(const ConfigSchema& schema, const std::string& prefix) {
  override_schema_ = &schema;
  override_prefix_ = prefix;
}

void ArgParser::allow_rest() { rest_allowed_ = true; }

const Flag* ArgParser::find(const std::string& name) const {
  for (const Flag& f : flags_) {
    if (f.spec.key == name ||
        std::find(f.aliases.begin(), f.aliases.end(), name) != f.aliases.end())
      return &f;
  }
  return nullptr;
}

const Flag& ArgParser::flag(const std::string& name) const {
  const Flag* f = find(name);
  TETRA_CHECK(f, "[{}] internal: no flag '{}'", module_, name);
  return *f;
}

void ArgParser::unknown(const std::string& arg) const {
  const std::string name = arg.substr(0, arg.find('='));
  if (!starts_with(arg, "-") && rest_allowed_) {
    fail("[{}] unexpected argument '{}'; the command to run goes after --: {} [flags] -- {} ...",
         module_, arg, command_, arg);
  }
  if (!starts_with(arg, "-")) {
    fail("[{}] unexpected argument '{}'; {} takes flags only, see {} --help", module_, arg,
         command_, command_);
  }
  if (override_schema_ && name.find('.') != std::string::npos) {
    fail("[{}] {}: only --{}KEY=VALUE overrides apply to {}; see {} --help", module_, name,
         override_prefix_, command_, command_);
  }
  std::vector<std::string> names = {"--help"};
  for (const Flag& f : flags_) {
    names.push_back(f.spec.key);
    names.insert(names.end(), f.aliases.begin(), f.aliases.end());
  }
  if (override_schema_) {
    for (const KeySpec& k : *override_schema_) {
      if (starts_with(k.key, override_prefix_)) names.push_back("--" + k.key);
    }
  }
  std::string hint = closest_suggestion(names, name);
  if (hint.empty() && override_schema_) {
    hint = fmt::format(" Config keys are given as --{}section.key=value.", override_prefix_);
  }
  fail("[{}] unknown option '{}'.{} See {} --help.", module_, name, hint, command_);
}

bool ArgParser::parse(const Args& args) {
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      std::fputs(help().c_str(), stdout);
      return false;
    }
    if (a == "--") {
      TETRA_CHECK(rest_allowed_, "[{}] unexpected '--'; {} passes no command on; see {} --help",
                  module_, command_, command_);
      rest_.assign(args.begin() + long(i) + 1, args.end());
      return true;
    }
    const size_t eq = starts_with(a, "--") ? a.find('=') : std::string::npos;
    const std::string name = a.substr(0, eq);
    const bool inline_value = eq != std::string::npos;
    // The value of flag `what`: after '=' or the next argument.
    auto value = [&](const std::string& what, const std::string& metavar) -> std::string {
      if (inline_value) return a.substr(eq + 1);
      TETRA_CHECK(i + 1 < args.size() && !looks_like_flag(args[i + 1]),
                  "[{}] {} needs a value: {} {}; see {} --help", module_, what, what, metavar,
                  command_);
      return args[++i];
    };
    if (const Flag* f = find(name)) {
      const std::string& key = f->spec.key;
      if (f->spec.kind == ValueKind::Bool) {
        TETRA_CHECK(!inline_value, "[{}] {} is a switch and takes no value; drop '{}'", module_,
                    name, a.substr(eq));
        values_[key] = true;
      } else if (f->repeatable) {
        const std::string v = value(name, f->metavar);
        parse_value(f->spec, v, "[" + module_ + "] ");
        repeated_[key].push_back(v);
      } else {
        TETRA_CHECK(!given(key), "[{}] {} is given twice; give it once", module_, key);
        values_[key] = parse_value(f->spec, value(name, f->metavar), "[" + module_ + "] ");
      }
      given_.insert(key);
      continue;
    }
    if (override_schema_ && starts_with(name, "--" + override_prefix_) &&
        name.find('.') != std::string::npos) {
      overrides_.push_back(name.substr(2) + "=" + value(name, "VALUE"));
      continue;
    }
    unknown(a);
  }
  return true;
}

bool ArgParser::given(const std::string& name) const {
  return given_.count(flag(name).spec.key) > 0;
}

int64_t ArgParser::i(const std::string& name) const {
  return std::get<int64_t>(values_.at(flag(name).spec.key));
}
double ArgParser::f(const std::string& name) const {
  return std::get<double>(values_.at(flag(name).spec.key));
}
bool ArgParser::b(const std::string& name) const {
  return std::get<bool>(values_.at(flag(name).spec.key));
}
const std::string& ArgParser::s(const std::string& name) const {
  return std::get<std::string>(values_.at(flag(name).spec.key));
}
const std::vector<std::string>& ArgParser::all(const std::string& name) const {
  static const std::vector<std::string> none;
  auto it = repeated_.find(flag(name).spec.key);
  return it == repeated_.end() ? none : it->second;
}

std::string ArgParser::help() const {
  std::string out = usage_;
  if (!flags_.empty()) out += "\nflags:\n";
  for (const Flag& f : flags_) {
    std::string names = f.spec.key;
    for (const auto& a : f.aliases) names += ", " + a;
    if (!f.metavar.empty()) names += " " + f.metavar;
    const std::string text =
        f.spec.help + valid_and_default(f.spec) + (f.repeatable ? "; repeatable" : "");
    out += names.size() <= 22 ? fmt::format("  {:<22} ", names) : "  " + names + "\n" + kIndent;
    out += wrapped(text) + "\n";
  }
  out += fmt::format("  {:<22} this text\n", "--help, -h");
  if (!epilog_.empty()) out += "\n" + epilog_;
  return out;
}

std::string describe_keys(const ConfigSchema& schema) {
  std::string out;
  const std::string indent(6, ' ');
  for (const auto& k : schema) {
    const bool free_text = k.kind == ValueKind::String && k.valid.empty();
    out += fmt::format("  --{}={}{}\n", k.key, k.default_value,
                       free_text ? "" : "  (" + describe_valid(k) + ")");
    out += indent + wrapped(k.help, indent) + "\n";
  }
  return out;
}

}  // namespace tetra::cli
