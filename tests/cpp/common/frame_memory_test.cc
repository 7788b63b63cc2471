// The allocator tuning for received frames: left alone wherever the
// environment tunes malloc itself or opts out, applied at most once.
#include "mltuner/frame_memory.h"

#include <cstdlib>
#include <map>
#include <string>

#include "test_util.h"

using namespace mltuner;

namespace {

bool LeftToUs(const std::map<std::string, std::string>& environment, std::string* why) {
  return MallocLeftToUs(
      [&](const char* name) {
        auto found = environment.find(name);
        return found == environment.end() ? nullptr : found->second.c_str();
      },
      why);
}

}  // namespace

TEST(MallocIsLeftAloneWhereTheEnvironmentTunesIt) {
  std::string why;
  EXPECT_TRUE(LeftToUs({}, &why));
  EXPECT_TRUE(LeftToUs({{"MLTUNER_MALLOC_TUNING", "1"}, {"GLIBC_TUNABLES", "glibc.pthread.rseq=0"}}, &why));
  EXPECT_TRUE(!LeftToUs({{"MLTUNER_MALLOC_TUNING", "0"}}, &why));
  EXPECT_EQ(why, std::string("MLTUNER_MALLOC_TUNING=0"));
  EXPECT_TRUE(!LeftToUs({{"MALLOC_TRIM_THRESHOLD_", "1000"}}, &why));
  EXPECT_TRUE(why.find("MALLOC_TRIM_THRESHOLD_") != std::string::npos);
  EXPECT_TRUE(!LeftToUs({{"MALLOC_MMAP_THRESHOLD_", "1000"}}, &why));
  EXPECT_TRUE(!LeftToUs({{"GLIBC_TUNABLES", "glibc.malloc.trim_threshold=5"}}, &why));
  EXPECT_TRUE(why.find("GLIBC_TUNABLES") != std::string::npos);
}

TEST(TheTuningIsDoneOnceAndSaysWhat) {
  std::string first, second;
  const bool changed = KeepFreedMemoryForFrames(&first);
  EXPECT_TRUE(!first.empty());
  EXPECT_EQ(KeepFreedMemoryForFrames(&second), changed);
  EXPECT_EQ(second, first);
#if defined(__GLIBC__) && !defined(__SANITIZE_ADDRESS__)  // ASan's malloc takes no mallopt
  // This test binary's environment: unless CI tunes malloc, it is applied.
  std::string why;
  if (MallocLeftToUs([](const char* name) { return std::getenv(name); }, &why)) EXPECT_TRUE(changed);
#endif
}

MLT_TEST_MAIN
