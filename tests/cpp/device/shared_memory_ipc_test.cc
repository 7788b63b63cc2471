// SharedMemoryIpc: a process's landing region, written by another process
// (a forked child) through the handle alone, and the refusals of handles
// and copies that do not fit.
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "device/cpu/shared_memory_ipc.h"
#include "test_util.h"

namespace mltuner {
namespace {

constexpr size_t kRegionBytes = size_t{1} << 20;

TEST(AnotherProcessWritesTheRegionThroughTheHandle) {
  std::unique_ptr<DeviceIpc> mine;
  ASSERT_OK(ExportSharedMemoryIpc(kRegionBytes, &mine));
  EXPECT_EQ(mine->region_bytes(), kRegionBytes);
  for (size_t i = 0; i < kRegionBytes / sizeof(float); ++i) EXPECT_EQ(mine->region()[i], 0.0f);
  const std::string handle = mine->handle();
  const pid_t child = fork();
  ASSERT_TRUE(child >= 0);
  if (child == 0) {
    // The child: its own export (as every rank has), then the parent's.
    std::unique_ptr<DeviceIpc> theirs;
    if (!ExportSharedMemoryIpc(4096, &theirs).ok()) _exit(2);
    if (!theirs->OpenPeer(0, handle, kRegionBytes).ok()) _exit(3);
    std::vector<float> values(1000);
    for (size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(i) + 0.5f;
    DeviceEvent done;
    if (!theirs->CopyToPeer(0, 4096, values.data(), values.size() * sizeof(float), DeviceEvent(), 5, &done).ok()) {
      _exit(4);
    }
    _exit(done ? 5 : 0);  // a copy on the CPU is complete when it returns
  }
  int status = 0;
  ASSERT_TRUE(waitpid(child, &status, 0) == child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
  DeviceEvent ready;
  ASSERT_OK(mine->OpenPeer(1, mine->handle(), kRegionBytes));  // a peer must be open to be waited on
  ASSERT_OK(mine->PeerWrites(1, 5, &ready));
  EXPECT_TRUE(!ready);
  const float* landed = mine->region() + 4096 / sizeof(float);
  for (size_t i = 0; i < 1000; ++i) EXPECT_EQ(landed[i], static_cast<float>(i) + 0.5f);
  EXPECT_EQ(mine->region()[4096 / sizeof(float) - 1], 0.0f);
  EXPECT_EQ(landed[1000], 0.0f);
}

TEST(RefusesHandlesThatNameNoRegionOfTheirs) {
  std::unique_ptr<DeviceIpc> mine;
  ASSERT_OK(ExportSharedMemoryIpc(kRegionBytes, &mine));
  const std::string good = mine->handle();
  // This process's standard input under the region's name, a CUDA engine's
  // binary handle, a truncated handle, the right file with another name.
  const std::string name = good.substr(good.rfind(':') + 1);
  std::string other_name = name;
  other_name.back() = other_name.back() == '0' ? '1' : '0';
  const std::vector<std::string> bad = {
      "mltuner-memfd:" + std::to_string(getpid()) + ":0:" + name,
      std::string(64, '\x01'),
      good.substr(0, good.size() - 3),
      good.substr(0, good.rfind(':') + 1) + other_name,
      "mltuner-memfd:999999999:3:" + name,
  };
  for (const std::string& handle : bad) {
    const Status status = mine->OpenPeer(1, handle, kRegionBytes);
    EXPECT_CODE(status, StatusCode::kInvalidArgument);
  }
  // More bytes than the peer exported.
  EXPECT_CODE(mine->OpenPeer(1, good, 2 * kRegionBytes), StatusCode::kInvalidArgument);
  EXPECT_CODE(mine->OpenPeer(-1, good, kRegionBytes), StatusCode::kInvalidArgument);
  std::unique_ptr<DeviceIpc> none;
  EXPECT_CODE(ExportSharedMemoryIpc(0, &none), StatusCode::kInvalidArgument);
}

TEST(RefusesCopiesOutsideTheRegionOrToPeersNotOpen) {
  std::unique_ptr<DeviceIpc> mine;
  ASSERT_OK(ExportSharedMemoryIpc(kRegionBytes, &mine));
  std::vector<float> values(256, 1.0f);
  DeviceEvent done;
  EXPECT_CODE(mine->CopyToPeer(1, 0, values.data(), 1024, DeviceEvent(), 0, &done),
            StatusCode::kInvalidArgument);  // not open
  ASSERT_OK(mine->OpenPeer(1, mine->handle(), kRegionBytes));
  ASSERT_OK(mine->CopyToPeer(1, kRegionBytes - 1024, values.data(), 1024, DeviceEvent(), 0, &done));
  EXPECT_EQ(mine->region()[kRegionBytes / sizeof(float) - 1], 1.0f);  // the same file, mapped twice
  EXPECT_CODE(mine->CopyToPeer(1, kRegionBytes - 1020, values.data(), 1024, DeviceEvent(), 0, &done),
            StatusCode::kInvalidArgument);
  EXPECT_CODE(mine->CopyToPeer(1, SIZE_MAX - 10, values.data(), 1024, DeviceEvent(), 0, &done),
            StatusCode::kInvalidArgument);
  EXPECT_CODE(mine->CopyToPeer(1, 0, values.data(), 1024, DeviceEvent(), DeviceIpc::kCopyEvents, &done),
            StatusCode::kInvalidArgument);
  DeviceEvent ready;
  EXPECT_CODE(mine->PeerWrites(2, 0, &ready), StatusCode::kInvalidArgument);
  EXPECT_CODE(mine->PeerWrites(1, -1, &ready), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace mltuner

MLT_TEST_MAIN
