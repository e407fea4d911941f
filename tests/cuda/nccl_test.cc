// The NCCL data plane (runtime/cuda/nccl_communicator.h) on one GPU: a group of one rank, which
// is what one GPU allows (NCCL refuses two ranks on a device), so every collective is checked
// for what a group of one must give, with device and host pointers, on split groups too; then a
// whole training run on the NCCL data plane against the host-staged one. Multi-GPU exchanges run
// under mpirun on a machine with several GPUs (docs/gpu.md). Skips, with the reason, where no GPU
// is visible.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "runtime/cuda/nccl_communicator.h"
#include "runtime/trainer.h"
#include "tests/cuda/cuda_test_util.h"
#include "tests/cuda/tiny_run.h"

namespace ptdp {
namespace {

std::vector<float> iota(size_t n, float first) {
  std::vector<float> v(n);
  std::iota(v.begin(), v.end(), first);
  return v;
}

struct Device {
  float* p = nullptr;
  size_t n = 0;
  explicit Device(const std::vector<float>& h) : n(h.size()) {
    EXPECT_EQ(cudaMalloc(reinterpret_cast<void**>(&p), n * sizeof(float)), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(p, h.data(), n * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  }
  ~Device() { cudaFree(p); }
  std::vector<float> host() const {
    std::vector<float> h(n);
    EXPECT_EQ(cudaMemcpy(h.data(), p, n * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
    return h;
  }
};

// Each collective gives what a sum over one rank gives, on device and host pointers.
void check_collectives(Communicator& c) {
  const std::vector<float> x = iota(1000, 1.0f);
  Device a(x), b(std::vector<float>(1000, -1.0f));
  c.all_reduce(a.p, x.size(), DType::kF32);  // the sum over one rank
  EXPECT_EQ(a.host(), x) << c.name();
  c.all_gather(a.p, b.p, x.size(), DType::kF32);
  EXPECT_EQ(b.host(), x) << c.name();
  c.reduce_scatter(a.p, a.p, x.size(), DType::kF32);  // in place: the block at the start
  EXPECT_EQ(a.host(), x) << c.name();
  c.broadcast(a.p, x.size(), DType::kF32, 0);
  EXPECT_EQ(a.host(), x) << c.name();
  const size_t all[] = {x.size()};  // the uneven forms with one block
  c.reduce_scatter_v(a.p, b.p, all, DType::kF32);
  EXPECT_EQ(b.host(), x) << c.name();
  c.reduce_scatter_v(a.p, a.p, all, DType::kF32);  // in place (the distributed optimizer's)
  EXPECT_EQ(a.host(), x) << c.name();
  c.all_gather_v(a.p, a.p, all, DType::kF32);  // in place
  EXPECT_EQ(a.host(), x) << c.name();
  std::vector<float> gathered(x.size(), 0.0f);  // to host memory, staged
  c.all_gather_v(a.p, gathered.data(), all, DType::kF32);
  EXPECT_EQ(gathered, x) << c.name();
  double host = 2.5;  // host memory is staged through the device
  c.all_reduce(&host, 1, DType::kF64);
  EXPECT_EQ(host, 2.5) << c.name();
  c.barrier();
  auto work = c.all_reduce_async(a.p, x.size(), DType::kF32);
  work->wait();
  EXPECT_TRUE(work->test());
}

std::unique_ptr<Communicator> group_of_one() {
  auto control = make_self_control_plane();
  return make_nccl_communicator(*control, 0, nullptr, CommDuration(60));
}

// The steps separately, so that a crash inside NCCL (scripts/gpu-check.sh runs each test in a
// process of its own) says which step it was: set up and torn down; the collectives; a split.
TEST(NcclCommunicator, AGroupOfOneIsSetUpAndTornDown) {
  PTDP_REQUIRE_GPU();
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  auto world = group_of_one();
  EXPECT_EQ(world->size(), 1);
  EXPECT_EQ(world->rank(), 0);
}

TEST(NcclCommunicator, AGroupOfOneGivesWhatEachCollectiveMust) {
  PTDP_REQUIRE_GPU();
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  auto world = group_of_one();
  check_collectives(*world);
}

TEST(NcclCommunicator, ASplitGroupGivesWhatEachCollectiveMust) {
  PTDP_REQUIRE_GPU();
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  auto world = group_of_one();
  auto child = world->split(3, 0, "child");
  ASSERT_EQ(child->size(), 1);
  check_collectives(*child);
}

// ptdp run on one GPU: the NCCL data plane (a group of one) gives the staged plane's losses to
// the bit, since a sum over one rank changes nothing.
TEST(NcclCommunicator, TrainingOnTheNcclDataPlaneGivesTheStagedLosses) {
  PTDP_REQUIRE_GPU();
  std::vector<std::vector<double>> runs;
  for (const char* plane : {"staged", "nccl"}) {
    setenv("PTDP_DATA_PLANE", plane, 1);
    runs.push_back(
        cuda_test::losses_of_one_rank(cuda_test::tiny_training(cuda_test::tiny_gpt(), "cuda", 5)));
  }
  unsetenv("PTDP_DATA_PLANE");
  EXPECT_EQ(runs[1], runs[0]);
}

}  // namespace
}  // namespace ptdp
