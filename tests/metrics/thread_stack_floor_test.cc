// Note [Thread stack floor]: in a process with a large static TLS block (here 1 MiB from
// big_tls.cc; libtorch_cuda on a GPU machine), a thread asking for CivetWeb's 100 KiB stack cannot
// start; with Spillway's floor it can, and the exporter listens and serves.
#include "thread_stack_floor.h"

#include <dlfcn.h>
#include <gtest/gtest.h>
#include <pthread.h>

#include <cstdio>

#include "http_util.h"
#include "spillway/metrics/exporter.h"

extern "C" int BigTlsTouch(int i);

namespace spillway::metrics {
namespace {

constexpr size_t kCivetWebStack = kCivetWebThreadStack;

void* Nothing(void*) { return nullptr; }

int StartWithStack(int (*set)(pthread_attr_t*, size_t), size_t bytes, size_t* got) {
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  EXPECT_EQ(set(&attr, bytes), 0);
  pthread_attr_getstacksize(&attr, got);
  pthread_t t;
  const int rc = pthread_create(&t, &attr, Nothing, nullptr);
  pthread_attr_destroy(&attr);
  if (rc == 0) pthread_join(t, nullptr);
  return rc;
}

TEST(ThreadStackFloorTest, CivetWebSizedThreadsStartDespiteALargeStaticTls) {
  ASSERT_EQ(BigTlsTouch(7), 7);  // the library is loaded and its TLS is in use
  // Negative control: glibc's own pthread_attr_setstacksize, as CivetWeb would get it without the
  // floor, gives a thread that cannot be created.
  using Set = int (*)(pthread_attr_t*, size_t);
  auto real = reinterpret_cast<Set>(dlsym(RTLD_NEXT, "pthread_attr_setstacksize"));
  ASSERT_NE(real, nullptr);
  ASSERT_NE(real, &pthread_attr_setstacksize) << "the executable does not interpose it";
  EXPECT_TRUE(ThreadStackFloorActive());
  size_t got = 0;
#if defined(__SANITIZE_THREAD__)
  // TSan's pthread_create makes room for the TLS itself, so the control cannot fail under it.
  std::printf("ThreadStackFloorTest: the negative control is not checked under TSan\n");
#else
  EXPECT_EQ(StartWithStack(real, kCivetWebStack, &got), EINVAL)
      << "1 MiB of static TLS should not fit a 100 KiB stack";
  EXPECT_EQ(got, kCivetWebStack);
#endif
  // Through the interposed function (what CivetWeb calls): raised to the floor, and it starts.
  EXPECT_EQ(StartWithStack(&pthread_attr_setstacksize, kCivetWebStack, &got), 0);
  EXPECT_GE(got, size_t{1} << 20);
  // Larger requests are left alone.
  EXPECT_EQ(StartWithStack(&pthread_attr_setstacksize, size_t{64} << 20, &got), 0);
  EXPECT_EQ(got, size_t{64} << 20);

  auto e = Exporter::Start({"127.0.0.1:0", true});
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  const std::string body = testing::Body(testing::HttpGet((*e)->port(), "/metrics"));
  EXPECT_NE(body.find("# TYPE"), std::string::npos) << body;
}

}  // namespace
}  // namespace spillway::metrics
