// The tuning database file: tolerant reads, locked read-merge-write with an atomic replace.
#include "tuning_db.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "jit/log.h"
#include "lock.h"

namespace fs = std::filesystem;

namespace kspec::cache {
namespace {

// Parses and checks a database document; "" when good, else why it is not usable.
std::string parse_document(const std::string& text, nlohmann::json* doc) {
  try {
    *doc = nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    return std::string("not valid JSON (") + e.what() + ")";
  }
  if (!doc->is_object()) return "not a JSON object";
  if (!doc->contains("version") || !(*doc)["version"].is_number_integer())
    return "no integer \"version\" field";
  if ((*doc)["version"].get<int>() != kTuningDbVersion)
    return "version " + std::to_string((*doc)["version"].get<int>()) + ", this kspec reads version " +
           std::to_string(kTuningDbVersion);
  if (!doc->contains("entries") || !(*doc)["entries"].is_object()) return "no \"entries\" object";
  return "";
}

nlohmann::json fresh_document(const nlohmann::json& header) {
  nlohmann::json doc = {{"version", kTuningDbVersion}, {"kind", "kspec-tuning"}};
  if (header.is_object())
    for (auto it = header.begin(); it != header.end(); ++it) doc[it.key()] = it.value();
  doc["entries"] = nlohmann::json::object();
  return doc;
}

// Reads the file; `problem` is "" for a good or missing file. `exists` says whether there was one.
nlohmann::json read_document(const std::string& path, std::string* problem, bool* exists) {
  *problem = "";
  std::error_code ec;
  *exists = fs::exists(path, ec);
  nlohmann::json doc;
  if (!*exists) return fresh_document({});
  std::string text;
  if (!read_file(path, &text)) {
    *problem = std::string("unreadable: ") + std::strerror(errno);
  } else {
    *problem = parse_document(text, &doc);
  }
  if (!problem->empty()) {
    jit::warn_once("tuning-db:" + path + ":" + *problem,
                   "the tuning database " + path + " is ignored: " + *problem +
                       " (kspec uses its heuristics; a tuner will keep a copy as .corrupt and start a new file)");
    return fresh_document({});
  }
  return doc;
}

}  // namespace

std::string sanitize_file_part(const std::string& text) {
  std::string out;
  for (char c : text) {
    unsigned char u = static_cast<unsigned char>(c);
    if (std::isalnum(u) || c == '.' || c == '_') out += c;
    else if (!out.empty() && out.back() != '-') out += '-';
  }
  while (!out.empty() && out.back() == '-') out.pop_back();
  return out.empty() ? "unknown" : out;
}

nlohmann::json TuningDb::document(std::string* problem) const {
  std::string why;
  bool exists = false;
  nlohmann::json doc = read_document(path_, &why, &exists);
  if (problem) *problem = why;
  return doc;
}

nlohmann::json TuningDb::entries(std::string* problem) const { return document(problem)["entries"]; }

std::optional<nlohmann::json> TuningDb::get(const std::string& key) const {
  nlohmann::json e = entries();
  auto it = e.find(key);
  if (it == e.end()) return std::nullopt;
  return *it;
}

bool TuningDb::merge(const nlohmann::json& incoming, const nlohmann::json& header, const Prefer& prefer,
                     std::string* err) {
  std::string why;
  auto fail = [&](const std::string& msg) {
    jit::warn("cannot write the tuning database " + path_ + ": " + msg);
    if (err) *err = msg;
    return false;
  };
  fs::path p(path_);
  std::error_code ec;
  if (!p.parent_path().empty()) fs::create_directories(p.parent_path(), ec);
  FileLock lock(path_ + ".lock");
  if (!lock.held()) return fail("cannot lock " + path_ + ".lock: " + std::strerror(errno));
  bool exists = false;
  nlohmann::json doc = read_document(path_, &why, &exists);
  if (exists && !why.empty()) {
    // Never overwrite what we could not read: keep it aside for a person to look at.
    std::string aside = path_ + ".corrupt";
    fs::copy_file(path_, aside, fs::copy_options::overwrite_existing, ec);
    if (ec) return fail("it is unusable (" + why + ") and could not be copied to " + aside + ": " + ec.message());
    jit::warn("the unusable tuning database " + path_ + " was copied to " + aside + "; starting a new file");
  }
  if (!exists || !why.empty()) doc = fresh_document(header);
  nlohmann::json& entries = doc["entries"];
  for (auto it = incoming.begin(); it != incoming.end(); ++it) {
    auto have = entries.find(it.key());
    if (have == entries.end() || prefer(*have, it.value())) entries[it.key()] = it.value();
  }
  std::string werr;
  if (!write_file_atomic(path_, doc.dump(1) + "\n", &werr)) return fail(werr);
  return true;
}

}  // namespace kspec::cache
