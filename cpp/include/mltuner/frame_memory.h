// Received frames and the C library's allocator. ZeroMQ allocates every
// received message larger than its batch buffer with malloc, and a clock's
// payloads (a table's parts, a model's layers) are freed together once
// installed. glibc then trims the top of its arena, or unmaps chunks below
// its dynamic mmap threshold, so the next clock's messages fault in fresh,
// zeroed pages on ZeroMQ's I/O thread: measured on 2 cores, 1.3 ms of a
// 10-ms clock of one 10-MiB table in 1 MiB parts between 2 processes, and
// 16 tables of 1 MiB went from 16.2 to 13.8 ms a clock without it
// (docs/results.md, stop 40).
//
// KeepFreedMemoryForFrames raises glibc's mmap threshold to 32 MiB (its own
// dynamic maximum) and its trim threshold to 64 MiB, once per process: up to
// 64 MiB freed at the top of an arena stays with the process for the next
// clock instead of going back to the kernel. It leaves malloc alone where
// the environment already tunes it (MALLOC_MMAP_THRESHOLD_,
// MALLOC_TRIM_THRESHOLD_, or glibc.malloc in GLIBC_TUNABLES), where
// MLTUNER_MALLOC_TUNING=0, and on C libraries other than glibc.
//
// Thread safety: any thread, any time (mallopt takes glibc's own lock).
#pragma once

#include <functional>
#include <string>

namespace mltuner {

constexpr int kFrameMmapThresholdBytes = 32 << 20;
constexpr int kFrameTrimThresholdBytes = 64 << 20;

// Whether the environment leaves the allocator's thresholds to mltuner;
// `getenv` returns a variable's value, or null when it is not set. *why
// says which setting decided (for the log).
bool MallocLeftToUs(const std::function<const char*(const char*)>& getenv, std::string* why);

// The tuning above, at most once per process. True when it changed the
// thresholds (now or before); *why says what was done or why not.
bool KeepFreedMemoryForFrames(std::string* why);

}  // namespace mltuner
