#include "device/cpu/shared_memory_ipc.h"

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#if defined(__linux__)
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#endif

#include "common/mutex.h"
#include "device/cpu/pass_split.h"

namespace mltuner {

#if defined(__linux__)
namespace {

constexpr char kHandlePrefix[] = "mltuner-memfd";
constexpr char kNamePrefix[] = "mltuner-ipc-";  // then 16 random hex digits
constexpr size_t kNameBytes = sizeof(kNamePrefix) - 1 + 16;

std::string Errno(const std::string& what) { return what + ": " + std::strerror(errno); }

// "mltuner-memfd:<pid>:<fd>:<name>", all that a peer needs to find the file.
std::string MakeHandle(pid_t pid, int fd, const std::string& name) {
  return std::string(kHandlePrefix) + ":" + std::to_string(pid) + ":" + std::to_string(fd) + ":" + name;
}

bool ParseHandle(const std::string& handle, long* pid, int* fd, std::string* name) {
  const std::string prefix = std::string(kHandlePrefix) + ":";
  if (handle.compare(0, prefix.size(), prefix) != 0) return false;
  char tail[64] = {};
  if (handle.size() - prefix.size() >= sizeof(tail)) return false;
  if (std::sscanf(handle.c_str() + prefix.size(), "%ld:%d:%63s", pid, fd, tail) != 3) return false;
  *name = tail;
  return *pid > 0 && *fd >= 0 && name->size() == kNameBytes &&
         name->compare(0, sizeof(kNamePrefix) - 1, kNamePrefix) == 0;
}

class SharedMemoryIpc final : public DeviceIpc {
 public:
  ~SharedMemoryIpc() override {
    MutexLock lock(&mu_);
    for (const Mapping& peer : peers_) {
      if (peer.base != nullptr) munmap(peer.base, peer.bytes);
    }
    if (region_ != nullptr) munmap(region_, region_bytes_);
    if (fd_ >= 0) close(fd_);
  }

  static Status Make(size_t region_bytes, std::unique_ptr<DeviceIpc>* out) {
    std::unique_ptr<SharedMemoryIpc> ipc(new SharedMemoryIpc());
    char name[32];
    std::random_device random;
    std::snprintf(name, sizeof(name), "%s%08x%08x", kNamePrefix, random(), random());
    ipc->fd_ = memfd_create(name, MFD_CLOEXEC);
    if (ipc->fd_ < 0) return Status::InvalidArgument(Errno("memfd_create"));
    if (ftruncate(ipc->fd_, static_cast<off_t>(region_bytes)) != 0) {
      return Status::ResourceExhausted(Errno("sizing a shared-memory region of " + std::to_string(region_bytes) +
                                             " bytes"));
    }
    void* base = mmap(nullptr, region_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, ipc->fd_, 0);
    if (base == MAP_FAILED) return Status::ResourceExhausted(Errno("mapping the shared-memory region"));
    ipc->region_ = static_cast<float*>(base);
    ipc->region_bytes_ = region_bytes;
    ipc->handle_ = MakeHandle(getpid(), ipc->fd_, name);
    *out = std::move(ipc);
    return Status::Ok();
  }

  float* region() const override { return region_; }
  size_t region_bytes() const override { return region_bytes_; }
  const std::string& handle() const override { return handle_; }

  Status OpenPeer(int peer, const std::string& handle, size_t region_bytes) override {
    long pid = 0;
    int fd = -1;
    std::string name;
    if (peer < 0) return Status::InvalidArgument("no peer rank " + std::to_string(peer));
    if (!ParseHandle(handle, &pid, &fd, &name)) {
      return Status::InvalidArgument("not a shared-memory handle of a CPU engine (a CUDA engine's peer?)");
    }
    const std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
    // The link names the memory file; a recycled pid or fd names another.
    char target[128] = {};
    const ssize_t length = readlink(path.c_str(), target, sizeof(target) - 1);
    if (length < 0) return Status::InvalidArgument(Errno("opening " + path + " (another PID namespace?)"));
    if (std::string(target, static_cast<size_t>(length)).find("/memfd:" + name) != 0) {
      return Status::InvalidArgument(path + " is not the peer's shared-memory region");
    }
    const int opened = open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (opened < 0) return Status::InvalidArgument(Errno("opening " + path));
    struct stat info {};
    void* base = MAP_FAILED;
    std::string problem;
    if (fstat(opened, &info) != 0) {
      problem = Errno("fstat " + path);
    } else if (static_cast<uint64_t>(info.st_size) < region_bytes) {
      problem = "the peer's shared-memory region has " + std::to_string(info.st_size) + " bytes, not " +
                std::to_string(region_bytes);
    } else {
      base = mmap(nullptr, region_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, opened, 0);
      if (base == MAP_FAILED) problem = Errno("mapping the peer's shared-memory region");
    }
    close(opened);  // the mapping keeps the file
    if (!problem.empty()) return Status::InvalidArgument(problem);
    MutexLock lock(&mu_);
    if (peers_.size() <= static_cast<size_t>(peer)) peers_.resize(static_cast<size_t>(peer) + 1);
    Mapping& mapping = peers_[static_cast<size_t>(peer)];
    if (mapping.base != nullptr) munmap(mapping.base, mapping.bytes);
    mapping = Mapping{static_cast<char*>(base), region_bytes};
    return Status::Ok();
  }

  // The CPU device's work is done when queued, so `after` is complete.
  Status CopyToPeer(int peer, size_t offset, const void* src, size_t bytes, const DeviceEvent& /*after*/, int event,
                    DeviceEvent* done) override {
    if (event < 0 || event >= kCopyEvents) return Status::InvalidArgument("no copy event " + std::to_string(event));
    Mapping mapping;
    MLT_RETURN_IF_ERROR(Mapped(peer, &mapping));
    if (offset > mapping.bytes || bytes > mapping.bytes - offset) {
      return Status::InvalidArgument("bytes [" + std::to_string(offset) + ", +" + std::to_string(bytes) +
                                     ") are outside rank " + std::to_string(peer) + "'s region");
    }
    CopyBytes(mapping.base + offset, src, bytes);
    // The notice leaves after this: the peer that takes it sees the bytes.
    std::atomic_thread_fence(std::memory_order_release);
    done->reset();
    return Status::Ok();
  }

  Status PeerWrites(int peer, int event, DeviceEvent* ready) override {
    if (event < 0 || event >= kCopyEvents) return Status::InvalidArgument("no copy event " + std::to_string(event));
    Mapping mapping;
    MLT_RETURN_IF_ERROR(Mapped(peer, &mapping));
    std::atomic_thread_fence(std::memory_order_acquire);
    ready->reset();
    return Status::Ok();
  }

  Status WaitDone(const DeviceEvent& /*event*/, int64_t /*timeout_ms*/) override { return Status::Ok(); }

 private:
  struct Mapping {
    char* base = nullptr;
    size_t bytes = 0;
  };
  SharedMemoryIpc() = default;

  // Peer's mapping (fixed once opened: peers are opened before traffic).
  Status Mapped(int peer, Mapping* out) const {
    MutexLock lock(&mu_);
    if (peer < 0 || static_cast<size_t>(peer) >= peers_.size() || peers_[peer].base == nullptr) {
      return Status::InvalidArgument("shared memory with rank " + std::to_string(peer) + " is not open");
    }
    *out = peers_[static_cast<size_t>(peer)];
    return Status::Ok();
  }

  int fd_ = -1;
  float* region_ = nullptr;
  size_t region_bytes_ = 0;
  std::string handle_;
  mutable Mutex mu_;
  std::vector<Mapping> peers_ GUARDED_BY(mu_);
};

}  // namespace

Status ExportSharedMemoryIpc(size_t region_bytes, std::unique_ptr<DeviceIpc>* out) {
  out->reset();
  if (region_bytes == 0) return Status::InvalidArgument("a shared-memory region of 0 bytes");
  return SharedMemoryIpc::Make(region_bytes, out);
}

#else

Status ExportSharedMemoryIpc(size_t /*region_bytes*/, std::unique_ptr<DeviceIpc>* out) {
  out->reset();
  return Status::InvalidArgument("shared memory between CPU engines needs Linux (memfd)");
}

#endif

}  // namespace mltuner
