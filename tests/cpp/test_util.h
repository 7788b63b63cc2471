// A minimal test harness: no dependency beyond the standard library.
//
//   TEST(PoolFitsThePeak) { EXPECT_EQ(1, 1); ASSERT_OK(status); }
//   int main() { return mltuner::testing::RunAll(); }   // via MLT_TEST_MAIN
//
// EXPECT_* records a failure and continues; ASSERT_* returns from the test.
// The process exits non-zero when any test failed, which CTest reports.
#pragma once

#include <cmath>
#include <cstdio>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "mltuner/status.h"

namespace mltuner::testing {

struct TestCase {
  const char* name;
  std::function<void()> body;
};

inline std::vector<TestCase>& Registry() {
  static std::vector<TestCase> tests;
  return tests;
}
inline int& Failures() {
  static int failures = 0;
  return failures;
}
struct Registrar {
  Registrar(const char* name, std::function<void()> body) { Registry().push_back({name, std::move(body)}); }
};

inline void ReportFailure(const char* file, int line, const std::string& what) {
  std::fprintf(stderr, "%s:%d: FAILED: %s\n", file, line, what.c_str());
  ++Failures();
}

inline int RunAll() {
  int failed_tests = 0;
  for (const TestCase& test : Registry()) {
    const int before = Failures();
    std::fprintf(stderr, "[ RUN  ] %s\n", test.name);
    test.body();
    const bool ok = Failures() == before;
    if (!ok) ++failed_tests;
    std::fprintf(stderr, "[ %s ] %s\n", ok ? " OK " : "FAIL", test.name);
  }
  const int total = static_cast<int>(Registry().size());
  std::printf("%d passed, %d failed\n", total - failed_tests, failed_tests);
  return failed_tests == 0 ? 0 : 1;
}

template <typename A, typename B>
std::string DescribePair(const A& a, const B& b) {
  std::ostringstream out;
  out << a << " vs " << b;
  return out.str();
}

}  // namespace mltuner::testing

#define TEST(name)                                                        \
  static void name();                                                     \
  static ::mltuner::testing::Registrar name##_registrar(#name, &name);    \
  static void name()

#define MLT_TEST_MAIN \
  int main() { return ::mltuner::testing::RunAll(); }

#define EXPECT_TRUE(cond) \
  do { if (!(cond)) ::mltuner::testing::ReportFailure(__FILE__, __LINE__, #cond); } while (0)
#define ASSERT_TRUE(cond) \
  do { if (!(cond)) { ::mltuner::testing::ReportFailure(__FILE__, __LINE__, #cond); return; } } while (0)
#define EXPECT_EQ(a, b)                                                                      \
  do { auto _a = (a); auto _b = (b);                                                         \
       if (!(_a == _b)) ::mltuner::testing::ReportFailure(__FILE__, __LINE__,               \
           std::string(#a " == " #b ": ") + ::mltuner::testing::DescribePair(_a, _b)); } while (0)
#define ASSERT_EQ(a, b)                                                                      \
  do { auto _a = (a); auto _b = (b);                                                         \
       if (!(_a == _b)) { ::mltuner::testing::ReportFailure(__FILE__, __LINE__,             \
           std::string(#a " == " #b ": ") + ::mltuner::testing::DescribePair(_a, _b)); return; } } while (0)
#define EXPECT_NEAR(a, b, tol)                                                               \
  do { double _a = (a); double _b = (b);                                                     \
       if (!(std::fabs(_a - _b) <= (tol))) ::mltuner::testing::ReportFailure(__FILE__, __LINE__, \
           std::string(#a " ~= " #b ": ") + ::mltuner::testing::DescribePair(_a, _b)); } while (0)
#define EXPECT_OK(expr)                                                                      \
  do { ::mltuner::Status _s = (expr);                                                        \
       if (!_s.ok()) ::mltuner::testing::ReportFailure(__FILE__, __LINE__, #expr ": " + _s.ToString()); } while (0)
#define ASSERT_OK(expr)                                                                      \
  do { ::mltuner::Status _s = (expr);                                                        \
       if (!_s.ok()) { ::mltuner::testing::ReportFailure(__FILE__, __LINE__, #expr ": " + _s.ToString()); return; } } while (0)
#define EXPECT_CODE(expr, want)                                                              \
  do { ::mltuner::Status _s = (expr);                                                        \
       if (_s.code() != (want)) ::mltuner::testing::ReportFailure(__FILE__, __LINE__,       \
           std::string(#expr " gave ") + _s.ToString()); } while (0)
