// HostMemoryHeadroom: the smallest of MemAvailable, every cgroup level's
// limit less its usage (v2 up to the root, and v1) and RLIMIT_AS less the
// address space, each named in words; read from a /proc and a cgroup mount
// laid out in a directory of the test's own.
#include "mltuner/host_headroom.h"

#include <stdlib.h>

#include <filesystem>
#include <fstream>

#include "test_util.h"

namespace mltuner {
namespace {

namespace fs = std::filesystem;

// A directory removed at the end of the test.
class TempDir {
 public:
  TempDir() {
    std::string pattern = (fs::temp_directory_path() / "headroom-XXXXXX").string();
    path_ = mkdtemp(pattern.data()) ? pattern : "";
  }
  ~TempDir() {
    std::error_code ignored;
    if (!path_.empty()) fs::remove_all(path_, ignored);
  }
  const std::string& path() const { return path_; }
  void Write(const std::string& relative, const std::string& text) const {
    const fs::path file = fs::path(path_) / relative;
    fs::create_directories(file.parent_path());
    std::ofstream(file) << text;
  }

 private:
  std::string path_;
};

TEST(TheSmallestLimitWinsAndIsNamed) {
  HostMemoryFacts facts;
  EXPECT_TRUE(!SmallestHeadroom(facts).known());  // nothing readable: no check
  facts.mem_available = 8000;
  EXPECT_EQ(SmallestHeadroom(facts).bytes, int64_t{8000});
  EXPECT_TRUE(SmallestHeadroom(facts).source.find("MemAvailable") != std::string::npos);
  facts.cgroups.push_back({10000, 1000, "/outer"});
  facts.cgroups.push_back({5000, 2000, "/outer/inner"});
  const HostHeadroom cgroup = SmallestHeadroom(facts);
  EXPECT_EQ(cgroup.bytes, int64_t{3000});
  EXPECT_TRUE(cgroup.source.find("/outer/inner") != std::string::npos);
  facts.address_space_limit = 4000;
  facts.address_space_used = 2500;
  const HostHeadroom address = SmallestHeadroom(facts);
  EXPECT_EQ(address.bytes, int64_t{1500});
  EXPECT_TRUE(address.source.find("RLIMIT_AS") != std::string::npos);
  facts.cgroups.push_back({100, 200, "/over"});  // over its limit: no room at all
  EXPECT_EQ(SmallestHeadroom(facts).bytes, int64_t{0});
}

TEST(CgroupV2LimitsAreReadAtEveryLevelUpToTheRoot) {
  TempDir dir;
  ASSERT_TRUE(!dir.path().empty());
  dir.Write("proc/meminfo", "MemTotal:  67108864 kB\nMemAvailable:  33554432 kB\n");
  dir.Write("proc/self/cgroup", "0::/jobs/job7/\n");
  dir.Write("cg/jobs/memory.max", "1073741824\n");  // 1 GiB for all jobs, 0.25 GiB used
  dir.Write("cg/jobs/memory.current", "268435456\n");
  dir.Write("cg/jobs/job7/memory.max", "max\n");  // no limit of its own
  dir.Write("cg/jobs/job7/memory.current", "4096\n");
  const HostMemoryFacts facts = ReadHostMemoryFacts(dir.path() + "/proc", dir.path() + "/cg");
  EXPECT_EQ(facts.mem_available, int64_t{33554432} * 1024);
  ASSERT_EQ(facts.cgroups.size(), size_t{1});
  const HostHeadroom room = SmallestHeadroom(facts);
  EXPECT_EQ(room.bytes, int64_t{1073741824 - 268435456});
  EXPECT_TRUE(room.source.find(dir.path() + "/cg/jobs)") != std::string::npos);
}

TEST(CgroupV1LimitsAreReadAndItsNoLimitIgnored) {
  TempDir dir;
  ASSERT_TRUE(!dir.path().empty());
  dir.Write("proc/meminfo", "MemAvailable:  1000 kB\n");
  dir.Write("proc/self/cgroup", "12:cpu,cpuacct:/box\n7:memory:/box\n");
  dir.Write("cg/memory/box/memory.limit_in_bytes", "524288\n");
  dir.Write("cg/memory/box/memory.usage_in_bytes", "262144\n");
  HostMemoryFacts facts = ReadHostMemoryFacts(dir.path() + "/proc", dir.path() + "/cg");
  EXPECT_EQ(SmallestHeadroom(facts).bytes, int64_t{262144});
  dir.Write("cg/memory/box/memory.limit_in_bytes", "9223372036854771712\n");  // v1's "unlimited"
  facts = ReadHostMemoryFacts(dir.path() + "/proc", dir.path() + "/cg");
  EXPECT_TRUE(facts.cgroups.empty());
  EXPECT_EQ(SmallestHeadroom(facts).bytes, int64_t{1000} * 1024);
}

TEST(UnreadableOrMalformedFilesGiveNoLimit) {
  TempDir dir;
  ASSERT_TRUE(!dir.path().empty());
  dir.Write("proc/meminfo", "MemAvailable: lots\n");
  dir.Write("proc/self/cgroup", "garbage\n0::/../../etc\n0::/missing\n");
  const HostMemoryFacts facts = ReadHostMemoryFacts(dir.path() + "/proc", dir.path() + "/cg");
  EXPECT_EQ(facts.mem_available, int64_t{-1});
  EXPECT_TRUE(facts.cgroups.empty());
}

TEST(ThisMachineHasAHeadroom) {
  const HostHeadroom room = HostMemoryHeadroom();  // Linux: /proc/meminfo at least
  EXPECT_TRUE(room.known() && room.bytes > 0);
  EXPECT_TRUE(!room.source.empty());
}

}  // namespace
}  // namespace mltuner

MLT_TEST_MAIN
