// Depth and size bounds checked by a scan over the text, then nlohmann's parser.
#include "bounded_json.h"

#include "jit/files.h"

namespace kspec::cache {

std::optional<nlohmann::json> parse_json_bounded(std::string_view text, int64_t max_bytes, std::string* why,
                                                 int max_depth) {
  if (static_cast<int64_t>(text.size()) > max_bytes) {
    *why = "too large (" + std::to_string(text.size()) + " bytes, at most " + std::to_string(max_bytes) + ")";
    return std::nullopt;
  }
  // Brackets inside strings do not nest; a malformed text is left to the parser to describe.
  int depth = 0;
  bool in_string = false, escaped = false;
  for (char c : text) {
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth) {
        *why = "nested deeper than " + std::to_string(max_depth) + " levels";
        return std::nullopt;
      }
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  try {
    return nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    *why = std::string("not valid JSON (") + e.what() + ")";
    return std::nullopt;
  }
}

std::optional<nlohmann::json> read_json_file(const std::string& path, int64_t max_bytes, bool own, std::string* why,
                                             bool* missing) {
  std::string text;
  if (!jit::read_file(path, max_bytes, own ? jit::FileTrust::Own : jit::FileTrust::Named, &text, why, missing))
    return std::nullopt;
  return parse_json_bounded(text, max_bytes, why);
}

}  // namespace kspec::cache
