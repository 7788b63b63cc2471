// HopLog: see hop_log.h.
#include "cluster/hop_log.h"

#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>

#if defined(__linux__)
#include <pthread.h>
#endif

namespace mltuner {
namespace {

constexpr int kFlushEvery = 512;  // lines

class HopFile {
 public:
  explicit HopFile(std::FILE* file) : file_(file) {}
  ~HopFile() { std::fclose(file_); }  // at exit: writes what is buffered
  HopFile(const HopFile&) = delete;
  HopFile& operator=(const HopFile&) = delete;

  void Write(int rank, const char* hop, int type, int table, long long clock, int sender, int receiver,
             size_t bytes) {
    const long long now = std::chrono::duration_cast<std::chrono::microseconds>(
                              std::chrono::steady_clock::now().time_since_epoch())
                              .count();
    char thread[16] = "?";
#if defined(__linux__)
    pthread_getname_np(pthread_self(), thread, sizeof thread);
#endif
    std::lock_guard<std::mutex> lock(mu_);
    std::fprintf(file_, "%lld\t%d\t%s\t%s\t%d\t%d\t%lld\t%d\t%d\t%zu\n", now, rank, thread, hop, type, table, clock,
                 sender, receiver, bytes);
    if (++unflushed_ >= kFlushEvery) {
      std::fflush(file_);
      unflushed_ = 0;
    }
  }

 private:
  std::mutex mu_;
  std::FILE* const file_;
  int unflushed_ = 0;
};

// Null when off (no MLTUNER_HOP_LOG, or a folder that cannot be written:
// said once on stderr). The folder itself is made if missing (not its parents),
// so launching a job with a new folder name needs no step before.
HopFile* File() {
  static const std::unique_ptr<HopFile> file = []() -> std::unique_ptr<HopFile> {
    const char* folder = std::getenv("MLTUNER_HOP_LOG");
    if (folder == nullptr || *folder == '\0') return nullptr;
    mkdir(folder, 0755);  // EEXIST (or any failure) shows at the fopen below
    const std::string path = std::string(folder) + "/hops-" + std::to_string(getpid()) + ".tsv";
    std::FILE* opened = std::fopen(path.c_str(), "w");
    if (opened == nullptr) {
      std::fprintf(stderr, "mltuner: MLTUNER_HOP_LOG: cannot write %s; no hop log\n", path.c_str());
      return nullptr;
    }
    return std::make_unique<HopFile>(opened);
  }();
  return file.get();
}

}  // namespace

bool HopLog::on() { return File() != nullptr; }

void HopLog::Record(int rank, const char* hop, const Message& message) {
  if (File() != nullptr) Record(rank, hop, message.header, message.num_values() * sizeof(float));
}

void HopLog::Record(int rank, const char* hop, const MessageHeader& header, size_t bytes) {
  HopFile* file = File();
  if (file == nullptr) return;
  file->Write(rank, hop, header.type, header.table, static_cast<long long>(header.clock), header.sender,
              header.receiver, bytes);
}

void HopLog::Record(int rank, const char* hop, int receiver, size_t bytes) {
  HopFile* file = File();
  if (file == nullptr) return;
  file->Write(rank, hop, -1, -1, -1, -1, receiver, bytes);
}

}  // namespace mltuner
