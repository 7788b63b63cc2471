#include "sockets/zmq_api.h"

#include <dlfcn.h>

#include <map>
#include <memory>
#include <mutex>

namespace mltuner {
namespace {

template <typename Fn>
bool Resolve(void* handle, const char* name, Fn* out, std::string* missing) {
  *out = reinterpret_cast<Fn>(dlsym(handle, name));
  if (*out == nullptr) *missing += std::string(missing->empty() ? "" : ", ") + name;
  return *out != nullptr;
}

}  // namespace

Status ZmqApi::Load(const std::string& library, const ZmqApi** out) {
  static std::mutex mu;
  static std::map<std::string, std::unique_ptr<ZmqApi>> loaded;
  std::lock_guard<std::mutex> lock(mu);
  auto found = loaded.find(library);
  if (found != loaded.end()) {
    *out = found->second.get();
    return Status::Ok();
  }
  // RTLD_NOLOAD: only a library the process has loaded already (pyzmq's).
  void* handle = dlopen(library.c_str(), RTLD_NOW | RTLD_NOLOAD);
  if (handle == nullptr) {
    const char* why = dlerror();
    return Status::InvalidArgument("libzmq '" + library + "' is not loaded in this process" +
                                   (why ? std::string(": ") + why : std::string()));
  }
  auto api = std::make_unique<ZmqApi>();
  std::string missing;
  Resolve(handle, "zmq_msg_init", &api->msg_init, &missing);
  Resolve(handle, "zmq_msg_init_size", &api->msg_init_size, &missing);
  Resolve(handle, "zmq_msg_init_data", &api->msg_init_data, &missing);
  Resolve(handle, "zmq_msg_send", &api->msg_send, &missing);
  Resolve(handle, "zmq_msg_recv", &api->msg_recv, &missing);
  Resolve(handle, "zmq_msg_close", &api->msg_close, &missing);
  Resolve(handle, "zmq_msg_data", &api->msg_data, &missing);
  Resolve(handle, "zmq_msg_size", &api->msg_size, &missing);
  Resolve(handle, "zmq_msg_more", &api->msg_more, &missing);
  Resolve(handle, "zmq_poll", &api->poll, &missing);
  Resolve(handle, "zmq_errno", &api->errno_, &missing);
  Resolve(handle, "zmq_strerror", &api->strerror, &missing);
  Resolve(handle, "zmq_version", &api->version, &missing);
  // The handle stays open: dlopen counted a reference, which keeps the
  // library mapped for as long as the pointers above are used.
  if (!missing.empty()) {
    return Status::InvalidArgument("'" + library + "' lacks libzmq's " + missing);
  }
  int major = 0, minor = 0, patch = 0;
  api->version(&major, &minor, &patch);
  if (major < 4) {
    return Status::InvalidArgument("'" + library + "' is libzmq " + std::to_string(major) + "." +
                                   std::to_string(minor) + "; the socket pump needs 4.0 or later");
  }
  *out = api.get();
  loaded.emplace(library, std::move(api));
  return Status::Ok();
}

std::string ZmqApi::Describe(int error) const {
  return std::string(strerror(error)) + " (errno " + std::to_string(error) + ")";
}

}  // namespace mltuner
