// Clang's thread-safety attributes (-Wthread-safety), as LevelDB's
// port/thread_annotations.h: the lock that guards a field, the locks a
// function needs, takes or releases. Under other compilers they are empty.
// scripts/check_thread_safety.sh runs the analysis over the engine.
#pragma once

#if defined(__clang__)
#define MLT_THREAD_ANNOTATION(x) __attribute__((x))
#else
#define MLT_THREAD_ANNOTATION(x)
#endif

#define CAPABILITY(x) MLT_THREAD_ANNOTATION(capability(x))
#define SCOPED_CAPABILITY MLT_THREAD_ANNOTATION(scoped_lockable)
#define GUARDED_BY(x) MLT_THREAD_ANNOTATION(guarded_by(x))
#define PT_GUARDED_BY(x) MLT_THREAD_ANNOTATION(pt_guarded_by(x))
#define REQUIRES(...) MLT_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
#define EXCLUDES(...) MLT_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))
#define ACQUIRE(...) MLT_THREAD_ANNOTATION(acquire_capability(__VA_ARGS__))
#define RELEASE(...) MLT_THREAD_ANNOTATION(release_capability(__VA_ARGS__))
#define ASSERT_CAPABILITY(x) MLT_THREAD_ANNOTATION(assert_capability(x))
#define NO_THREAD_SAFETY_ANALYSIS MLT_THREAD_ANNOTATION(no_thread_safety_analysis)
