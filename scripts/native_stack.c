// A debugging aid for the lent GPU machines, which have no gdb: preloaded
// (LD_PRELOAD), it prints the faulting thread's native stack, as library +
// offset, on SIGSEGV or SIGBUS, then lets the signal go on (Python's
// faulthandler, enabled later, still prints the Python stacks first, then
// hands the signal back here). scripts/gpu_checks.sh builds and preloads it;
// resolve an offset with `addr2line -f -C -e LIBRARY OFFSET`.
//   cc -shared -fPIC -O1 -o /tmp/native_stack.so scripts/native_stack.c -ldl
#define _GNU_SOURCE
#include <dlfcn.h>
#include <execinfo.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

static void write_all(const char* text, int length) {
  while (length > 0) {
    const ssize_t n = write(STDERR_FILENO, text, (size_t)length);
    if (n <= 0) return;
    text += n;
    length -= (int)n;
  }
}

static void print_stack(int signal_number, siginfo_t* info, void* context) {
  (void)context;
  void* frames[64];
  const int count = backtrace(frames, 64);
  char line[1024];
  write_all(line, snprintf(line, sizeof line, "\n=== native stack: signal %d at address %p, thread %ld ===\n",
                           signal_number, info->si_addr, (long)syscall(SYS_gettid)));
  for (int i = 0; i < count; ++i) {
    Dl_info where;
    if (dladdr(frames[i], &where) && where.dli_fname) {
      write_all(line, snprintf(line, sizeof line, "#%d %s +0x%lx %s\n", i, where.dli_fname,
                               (unsigned long)((char*)frames[i] - (char*)where.dli_fbase),
                               where.dli_sname ? where.dli_sname : "?"));
    } else {
      write_all(line, snprintf(line, sizeof line, "#%d %p\n", i, frames[i]));
    }
  }
  signal(signal_number, SIG_DFL);
  raise(signal_number);
}

__attribute__((constructor)) static void install(void) {
  struct sigaction action;
  memset(&action, 0, sizeof action);
  action.sa_sigaction = print_stack;
  action.sa_flags = SA_SIGINFO;
  sigaction(SIGSEGV, &action, NULL);
  sigaction(SIGBUS, &action, NULL);
}
