// Pulls the `Example:` blocks out of the public headers' comments into one C++ file, so that the
// build compiles (and links) every documented example; with --check it also requires an
// `Example:` for every public options struct (a struct or class named *Options or *Policy).
//
//   extract_examples OUT.cpp INCLUDE_ROOT HEADER...          # writes OUT.cpp (only when changed)
//   extract_examples --check INCLUDE_ROOT HEADER...          # lists the examples; exit 1 naming
//                                                            # each options struct without one
//
// The forms it reads (in // comments, at any indentation):
//   // Example: LoadOptions o; o.strict = false;           one line of code after the colon
//   // Example:                                             or the lines below it that are
//   //   fsdp::FullyShardOptions opts;                      indented by at least two more
//   //   fsdp::fully_shard(block, opts);                    spaces than the comment's text
// Each example becomes the body of a function in its own scope, inside `using namespace` of the
// namespace that encloses it in the header, where the names of tests/examples/example_context.h
// (model, block, optimizer, tokens, ...) are in scope. `#line` points errors at the header.
#include <algorithm>
#include <fstream>
#include <iostream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

namespace {

struct Example {
  std::string header;   // as given on the command line
  std::string include;  // relative to the include root
  int line = 0;         // 1-based line of the first code line
  std::string ns;       // enclosing namespace ("" at file scope)
  std::vector<std::string> code;
};

struct MissingExample {
  std::string header;
  int line;
  std::string name;
};

std::vector<std::string> read_lines(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("extract_examples: cannot read " + path);
  std::vector<std::string> lines;
  std::string line;
  while (std::getline(in, line)) lines.push_back(line);
  return lines;
}

// "  // text" -> {indent of the text after "//", text}; false when the line is no comment.
bool comment_text(const std::string& line, size_t& indent, std::string& text) {
  const size_t slash = line.find_first_not_of(' ');
  if (slash == std::string::npos || line.compare(slash, 2, "//") != 0) return false;
  const std::string rest = line.substr(slash + 2);
  const size_t first = rest.find_first_not_of(' ');
  indent = first == std::string::npos ? rest.size() : first;
  text = first == std::string::npos ? "" : rest.substr(first);
  return true;
}

void scan(const std::string& header, const std::string& include, std::vector<Example>& examples,
          std::vector<MissingExample>& missing) {
  const auto lines = read_lines(header);
  static const std::regex open_ns(R"(^namespace ([A-Za-z_][A-Za-z0-9_:]*) \{)");
  static const std::regex options_type(R"(^\s*(struct|class) ([A-Za-z0-9_]*(Options|Policy))\b[^;]*$)");
  // Open namespaces and the brace depth at which each opened (braces counted outside comments).
  std::vector<std::pair<std::string, int>> namespaces;
  int depth = 0;
  for (size_t i = 0; i < lines.size(); ++i) {
    std::smatch m;
    const std::string code = lines[i].substr(0, lines[i].find("//"));
    if (std::regex_search(code, m, open_ns)) namespaces.emplace_back(m[1].str(), depth);
    depth += static_cast<int>(std::count(code.begin(), code.end(), '{') - std::count(code.begin(), code.end(), '}'));
    while (!namespaces.empty() && depth <= namespaces.back().second) namespaces.pop_back();
    if (std::regex_search(lines[i], m, options_type)) {
      // The comment block right above, or the body, must hold an Example.
      bool found = false;
      for (size_t j = i; j-- > 0;) {
        size_t indent;
        std::string text;
        if (!comment_text(lines[j], indent, text)) break;
        if (text.find("Example:") != std::string::npos) found = true;
      }
      for (size_t j = i + 1; j < lines.size() && !found; ++j) {
        if (lines[j].find("Example:") != std::string::npos) found = true;
        if (lines[j].rfind("};", 0) == 0 || lines[j].find_first_not_of(' ') == lines[j].find("};")) break;
      }
      if (!found) missing.push_back({header, static_cast<int>(i + 1), m[2].str()});
    }
    size_t indent;
    std::string text;
    if (!comment_text(lines[i], indent, text) || text.rfind("Example:", 0) != 0) continue;
    Example ex;
    ex.header = header;
    ex.include = include;
    ex.ns = namespaces.empty() ? "" : namespaces.back().first;
    const std::string inline_code = text.substr(8);
    if (inline_code.find_first_not_of(' ') != std::string::npos) {
      ex.line = static_cast<int>(i + 1);
      ex.code.push_back(inline_code.substr(inline_code.find_first_not_of(' ')));
    }
    // Lines below, indented by two or more spaces beyond the "Example:" line's text.
    for (size_t j = i + 1; j < lines.size(); ++j) {
      size_t more;
      std::string code;
      if (!comment_text(lines[j], more, code) || code.empty() || more < indent + 2) break;
      if (ex.code.empty()) ex.line = static_cast<int>(j + 1);
      // Keep the code's own indentation relative to the block.
      ex.code.push_back(std::string(more - indent - 2, ' ') + code);
    }
    if (ex.code.empty()) throw std::runtime_error(header + ":" + std::to_string(i + 1) + ": an Example: without code");
    examples.push_back(std::move(ex));
  }
}

std::string generate(const std::vector<Example>& examples) {
  std::ostringstream out;
  out << "// Generated by tests/examples/extract_examples.cpp from the public headers' Example: blocks.\n"
         "// Do not edit: edit the header comment the #line names.\n"
         "#include \"example_context.h\"\n";
  std::vector<std::string> seen;
  for (const auto& ex : examples) {
    if (std::find(seen.begin(), seen.end(), ex.include) != seen.end()) continue;
    seen.push_back(ex.include);
    out << "#include \"" << ex.include << "\"\n";
  }
  out << "\nnamespace fsdp_header_examples {\n";
  for (size_t n = 0; n < examples.size(); ++n) {
    const auto& ex = examples[n];
    out << "\n// " << ex.include << ":" << ex.line << "\nnamespace ex" << n << " {\n";
    if (!ex.ns.empty()) out << "using namespace ::" << ex.ns << ";\n";
    out << "[[maybe_unused]] void run(ExampleContext& ctx) {\n  FSDP_EXAMPLE_CONTEXT(ctx);\n  {\n";
    out << "#line " << ex.line << " \"" << ex.header << "\"\n";
    for (const auto& code : ex.code) out << "    " << code << "\n";
    out << "  }\n}\n}  // namespace ex" << n << "\n";
  }
  out << "\n// Every example, so that none is discarded unseen (never called: the examples are not run).\n"
         "extern void (*const all[])(ExampleContext&);\n"
         "extern const int count;\n"
         "void (*const all[])(ExampleContext&) = {";
  for (size_t n = 0; n < examples.size(); ++n) out << (n ? ", " : "") << "&ex" << n << "::run";
  out << "};\nconst int count = " << examples.size() << ";\n\n}  // namespace fsdp_header_examples\n";
  return out.str();
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const bool check = argc > 1 && std::string(argv[1]) == "--check";
    const int first = check ? 2 : 3;
    if (argc < first + 1) {
      std::cerr << "usage: extract_examples OUT.cpp INCLUDE_ROOT HEADER... | --check INCLUDE_ROOT HEADER...\n";
      return 2;
    }
    std::string root = argv[first - 1];
    if (!root.empty() && root.back() != '/') root += '/';
    std::vector<Example> examples;
    std::vector<MissingExample> missing;
    for (int i = first; i < argc; ++i) {
      const std::string header = argv[i];
      const std::string include = header.rfind(root, 0) == 0 ? header.substr(root.size()) : header;
      scan(header, include, examples, missing);
    }
    if (check) {
      for (const auto& ex : examples) std::cout << ex.include << ":" << ex.line << ": " << ex.code.front() << "\n";
      std::cout << examples.size() << " examples\n";
      for (const auto& m : missing)
        std::cout << m.header << ":" << m.line << ": " << m.name
                  << " has no Example: in the comment above it or in its body; add one (it is compiled by "
                     "tests/examples)\n";
      return missing.empty() ? 0 : 1;
    }
    const std::string text = generate(examples);
    std::ifstream old(argv[1]);
    std::stringstream old_text;
    old_text << old.rdbuf();
    if (old && old_text.str() == text) return 0;  // unchanged: no rebuild
    std::ofstream(argv[1], std::ios::trunc) << text;
    return 0;
  } catch (const std::exception& e) {
    std::cerr << e.what() << "\n";
    return 1;
  }
}
