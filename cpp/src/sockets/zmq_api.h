// ZmqApi: the few libzmq calls the socket pump makes, resolved at run time
// from the libzmq that pyzmq already loaded into the process.
//
// Why not link libzmq: the sockets are pyzmq's (it creates, configures and
// secures them, and closes them at the end), and a socket may only be used
// through the library copy that made it. pyzmq's wheels carry their own
// libzmq; linking another copy would hand our calls sockets it never made.
// So Python names the loaded library's file, and we take its symbols with
// dlopen(RTLD_NOLOAD): never a second copy.
//
// Only libzmq's stable C ABI is used (zmq.h since 4.0): the 64-byte message
// struct, the poll item and the flag values below.
#pragma once

#include <cstddef>
#include <string>

#include "mltuner/status.h"

namespace mltuner {

// libzmq's zmq_msg_t: opaque, 64 bytes, pointer-aligned.
struct alignas(void*) ZmqMessage {
  unsigned char opaque[64];
};
// libzmq's zmq_pollitem_t on POSIX.
struct ZmqPollItem {
  void* socket;
  int fd;
  short events;
  short revents;
};

struct ZmqApi {
  static constexpr int kDontWait = 1;   // ZMQ_DONTWAIT
  static constexpr int kSendMore = 2;   // ZMQ_SNDMORE
  static constexpr short kPollIn = 1;   // ZMQ_POLLIN
  static constexpr short kPollOut = 2;  // ZMQ_POLLOUT

  using FreeFn = void(void* data, void* hint);
  int (*msg_init)(ZmqMessage*) = nullptr;
  int (*msg_init_size)(ZmqMessage*, size_t) = nullptr;
  int (*msg_init_data)(ZmqMessage*, void*, size_t, FreeFn*, void*) = nullptr;
  int (*msg_send)(ZmqMessage*, void*, int) = nullptr;
  int (*msg_recv)(ZmqMessage*, void*, int) = nullptr;
  int (*msg_close)(ZmqMessage*) = nullptr;
  void* (*msg_data)(ZmqMessage*) = nullptr;
  size_t (*msg_size)(const ZmqMessage*) = nullptr;
  int (*msg_more)(const ZmqMessage*) = nullptr;
  int (*poll)(ZmqPollItem*, int, long) = nullptr;
  int (*errno_)() = nullptr;
  const char* (*strerror)(int) = nullptr;
  void (*version)(int*, int*, int*) = nullptr;

  // The API of the libzmq loaded from `library` (its path, as the dynamic
  // loader knows it); InvalidArgument naming what is missing when that file
  // is not loaded, lacks a symbol or is older than 4.0. The result lives for
  // the process (each library is resolved once; pyzmq never unloads it).
  static Status Load(const std::string& library, const ZmqApi** out);

  // libzmq's words for an errno it set, with the number.
  std::string Describe(int error) const;
};

}  // namespace mltuner
