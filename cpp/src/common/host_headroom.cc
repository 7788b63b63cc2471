#include "mltuner/host_headroom.h"

#include <sys/resource.h>

#include <algorithm>
#include <fstream>
#include <sstream>

namespace mltuner {
namespace {

std::string ReadText(const std::string& path) {
  std::ifstream file(path);
  if (!file) return "";
  std::ostringstream text;
  text << file.rdbuf();
  return text.str();
}

// A file holding one non-negative integer ("max" and the like: -1).
int64_t ReadCount(const std::string& path) {
  std::istringstream in(ReadText(path));
  int64_t value = -1;
  if (!(in >> value) || value < 0) return -1;
  return value;
}

// The value of a "Name:   123 kB" line of /proc/meminfo or /proc/self/status
// in bytes; -1 when it has none.
int64_t ReadKibField(const std::string& text, const std::string& name) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(name, 0) != 0) continue;
    std::istringstream fields(line.substr(name.size()));
    int64_t kib = -1;
    std::string unit;
    if (!(fields >> kib) || kib < 0) return -1;
    fields >> unit;
    return unit == "kB" || unit.empty() ? kib * 1024 : -1;
  }
  return -1;
}

// v1 reports "no limit" as a huge page-rounded number rather than "max".
constexpr int64_t kNoLimit = int64_t{1} << 62;

void AddCgroup(const std::string& directory, const std::string& limit_file, const std::string& usage_file,
               std::vector<CgroupMemory>* out) {
  const int64_t limit = ReadCount(directory + "/" + limit_file);
  const int64_t usage = ReadCount(directory + "/" + usage_file);
  if (limit >= 0 && limit < kNoLimit && usage >= 0) out->push_back({limit, usage, directory});
}

std::string Parent(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  return slash == std::string::npos || slash == 0 ? "" : path.substr(0, slash);
}

}  // namespace

HostHeadroom SmallestHeadroom(const HostMemoryFacts& facts) {
  HostHeadroom best;
  auto consider = [&best](int64_t bytes, std::string source) {
    if (bytes < 0) bytes = 0;
    if (!best.known() || bytes < best.bytes) best = {bytes, std::move(source)};
  };
  if (facts.mem_available >= 0) {
    consider(facts.mem_available, "the memory the kernel reports available (MemAvailable)");
  }
  for (const CgroupMemory& group : facts.cgroups) {
    consider(group.limit - group.usage, "the cgroup's memory limit of " + std::to_string(group.limit) +
                                            " bytes minus its usage of " + std::to_string(group.usage) + " bytes (" +
                                            group.where + ")");
  }
  if (facts.address_space_limit >= 0) {
    consider(facts.address_space_limit - facts.address_space_used,
             "RLIMIT_AS of " + std::to_string(facts.address_space_limit) + " bytes minus this process's address " +
                 "space of " + std::to_string(facts.address_space_used) + " bytes");
  }
  return best;
}

HostMemoryFacts ReadHostMemoryFacts(const std::string& proc_root, const std::string& cgroup_root) {
  HostMemoryFacts facts;
  facts.mem_available = ReadKibField(ReadText(proc_root + "/meminfo"), "MemAvailable:");
  std::istringstream cgroups(ReadText(proc_root + "/self/cgroup"));
  std::string line;
  while (std::getline(cgroups, line)) {  // "id:controllers:path"
    const size_t first = line.find(':');
    const size_t second = first == std::string::npos ? first : line.find(':', first + 1);
    if (second == std::string::npos) continue;
    const std::string controllers = line.substr(first + 1, second - first - 1);
    std::string path = line.substr(second + 1);
    while (!path.empty() && path.back() == '/') path.pop_back();
    if (path.find("..") != std::string::npos) continue;
    if (controllers.empty()) {  // v2: every level up to the root may set a limit
      for (std::string level = path; !level.empty(); level = Parent(level)) {
        AddCgroup(cgroup_root + level, "memory.max", "memory.current", &facts.cgroups);
      }
    } else if (("," + controllers + ",").find(",memory,") != std::string::npos) {
      AddCgroup(cgroup_root + "/memory" + path, "memory.limit_in_bytes", "memory.usage_in_bytes", &facts.cgroups);
    }
  }
  rlimit limit{};
  if (getrlimit(RLIMIT_AS, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY) {
    facts.address_space_limit = static_cast<int64_t>(limit.rlim_cur);
    facts.address_space_used = std::max<int64_t>(0, ReadKibField(ReadText(proc_root + "/self/status"), "VmSize:"));
  }
  return facts;
}

HostHeadroom HostMemoryHeadroom() { return SmallestHeadroom(ReadHostMemoryFacts("/proc", "/sys/fs/cgroup")); }

}  // namespace mltuner
