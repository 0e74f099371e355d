// The tuning database file: tolerant reads, locked read-merge-write with an atomic replace.
#include "tuning_db.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "bounded_json.h"
#include "jit/base/log.h"
#include "jit/files.h"
#include "lock.h"

namespace fs = std::filesystem;

namespace kspec::cache {
namespace {

// Checks a parsed database document; "" when good, else why it is not usable.
std::string check_document(const nlohmann::json& doc) {
  if (!doc.is_object()) return "not a JSON object";
  if (!doc.contains("version") || !doc["version"].is_number_integer()) return "no integer \"version\" field";
  if (doc["version"] != kTuningDbVersion)
    return "version " + doc["version"].dump() + ", this kspec reads version " + std::to_string(kTuningDbVersion);
  if (!doc.contains("entries") || !doc["entries"].is_object()) return "no \"entries\" object";
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
nlohmann::json read_document(const std::string& path, bool user_file, std::string* problem, bool* exists) {
  bool missing = false;
  auto doc = read_json_file(path, kMaxTuningDbBytes, /*own=*/!user_file, problem, &missing);
  *exists = !missing;
  if (missing) {
    problem->clear();
    return fresh_document({});
  }
  if (doc) *problem = check_document(*doc);
  if (!problem->empty()) {
    if (!user_file)  // an import's problem is the caller's error message
      jit::warn_once("tuning-db:" + path + ":" + *problem,
                   "the tuning database " + path + " is ignored: " + *problem +
                       " (kspec uses its heuristics; a tuner will move it aside to .corrupt and start a new file)");
    return fresh_document({});
  }
  return std::move(*doc);
}

}  // namespace

std::string sanitize_file_part(const std::string& text) {
  constexpr size_t kMaxPart = 64;
  std::string out;
  for (char c : text) {
    if (out.size() >= kMaxPart) break;
    unsigned char u = static_cast<unsigned char>(c);
    if (std::isalnum(u) || c == '.' || c == '_') out += c;
    else if (!out.empty() && out.back() != '-') out += '-';
  }
  while (!out.empty() && out.back() == '-') out.pop_back();
  if (out.find_first_not_of('.') == std::string::npos) return "unknown";
  return out;
}

nlohmann::json TuningDb::document(std::string* problem) const {
  std::string why;
  bool exists = false;
  nlohmann::json doc = read_document(path_, user_file_, &why, &exists);
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
  fs::path dir = fs::path(path_).parent_path();
  std::string derr;
  if (!jit::make_private_dir(dir.empty() ? "." : dir.string(), &derr)) return fail(derr);
  FileLock lock(path_ + ".lock");
  if (!lock.held()) return fail("cannot lock " + path_ + ".lock: " + std::strerror(lock.error()));
  bool exists = false;
  nlohmann::json doc = read_document(path_, user_file_, &why, &exists);
  if (exists && !why.empty()) {
    // Never overwrite what we could not read: keep it aside for a person to look at. A rename moves a
    // symlink itself and replaces whatever <file>.corrupt was, without following it.
    std::string aside = path_ + ".corrupt";
    if (::rename(path_.c_str(), aside.c_str()) != 0)
      return fail("it is unusable (" + why + ") and could not be moved to " + aside + ": " + std::strerror(errno));
    jit::warn("the unusable tuning database " + path_ + " was moved to " + aside + "; starting a new file");
  }
  if (!exists || !why.empty()) doc = fresh_document(header);
  nlohmann::json& entries = doc["entries"];
  for (auto it = incoming.begin(); it != incoming.end(); ++it) {
    auto have = entries.find(it.key());
    if (have == entries.end() || prefer(*have, it.value())) entries[it.key()] = it.value();
  }
  std::string werr;
  if (!jit::write_file_atomic(path_, doc.dump(1) + "\n", &werr)) return fail(werr);
  return true;
}

}  // namespace kspec::cache
