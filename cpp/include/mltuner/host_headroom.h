// Host memory this process may still allocate, and which limit says so: the
// smallest of what the kernel reports available (MemAvailable), what the
// cgroups it runs in allow (v2 memory.max minus memory.current at every
// level up to the root, or v1 memory.limit_in_bytes minus usage), and
// RLIMIT_AS minus its address space. MemAvailable alone is the host's view:
// inside a container it can be many times what the container may use, and
// the kernel's OOM killer then stops the process instead of a clear error.
//
// The plan's check (plan/host_memory.h), the shard's check before a fork
// (ServerShard::Fork) and the Python guard before create_table
// (mltuner.client._host_memory) all ask this one function.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace mltuner {

struct HostHeadroom {
  int64_t bytes = -1;  // -1: no limit could be read (no check)
  std::string source;  // in words, for error messages
  bool known() const { return bytes >= 0; }
};

// One cgroup level with a memory limit.
struct CgroupMemory {
  int64_t limit = 0;
  int64_t usage = 0;
  std::string where;  // the cgroup's directory
};

// What the limits are made of, read from /proc and the cgroup file system.
struct HostMemoryFacts {
  int64_t mem_available = -1;  // bytes; -1 unreadable
  std::vector<CgroupMemory> cgroups;
  int64_t address_space_limit = -1;  // RLIMIT_AS's soft limit; -1 unlimited
  int64_t address_space_used = 0;    // VmSize
};

// The smallest headroom the facts allow (negative room counts as 0 bytes).
HostHeadroom SmallestHeadroom(const HostMemoryFacts& facts);

// The facts of this process, with /proc and the cgroup mount under the given
// roots ("/proc" and "/sys/fs/cgroup"; tests pass a directory of their own).
HostMemoryFacts ReadHostMemoryFacts(const std::string& proc_root, const std::string& cgroup_root);

// SmallestHeadroom(ReadHostMemoryFacts("/proc", "/sys/fs/cgroup")).
HostHeadroom HostMemoryHeadroom();

}  // namespace mltuner
