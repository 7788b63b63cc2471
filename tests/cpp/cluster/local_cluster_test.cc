// LocalCluster: creation, tables on every worker, the kStart handshake that
// gives every table data age -1, rejection of invalid client-bound messages
// by an engine (through its public HandleMessage), the start race
// between workers that have and have not yet created their tables, and a
// fork that one shard refuses.
//
// The Hub (transport) has no public injection hook, so invalid messages are
// handed to Engine::HandleMessage directly, as the Hub's inbox thread would.
#include "mltuner/cluster.h"

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "forwarding_device.h"
#include "gpu_like_device.h"
#include "mltuner/engine.h"
#include "test_util.h"
#include "wire/message.h"

using namespace mltuner;

namespace {

constexpr int kWorkers = 3;

// Two parameter tables and a local one, read and updated once per clock.
struct Tables {
  TableId a = -1, b = -1, local = -1;
  Handle ra = -1, ub = -1, l = -1;
};

Status CreateTables(Engine* e, Tables* t) {
  MLT_RETURN_IF_ERROR(e->CreateTable("a", 7, 3, false, &t->a));
  MLT_RETURN_IF_ERROR(e->CreateTable("b", 2, 5, false, &t->b));  // fewer rows than shards
  MLT_RETURN_IF_ERROR(e->CreateTable("scratch", 4, 2, true, &t->local));
  return Status::Ok();
}

// The clock's accesses, recorded; Record also finishes the recording.
Status RecordOps(Engine* e, Tables* t) {
  MLT_RETURN_IF_ERROR(e->VirtualRead(t->a, {0, 6, 3}, 0, &t->ra));
  MLT_RETURN_IF_ERROR(e->VirtualPreUpdate(t->b, {1}, &t->ub));
  MLT_RETURN_IF_ERROR(e->VirtualLocalAccess(t->local, {0, 1}, false, &t->l));
  MLT_RETURN_IF_ERROR(e->VirtualPostLocalAccess(t->l, true));
  MLT_RETURN_IF_ERROR(e->VirtualUpdate(t->ub));
  MLT_RETURN_IF_ERROR(e->VirtualPostRead(t->ra));
  return e->VirtualClock();
}

Status Record(Engine* e, Tables* t) {
  MLT_RETURN_IF_ERROR(RecordOps(e, t));
  return e->FinishVirtualIteration();
}

// FinishVirtualIteration is a rendezvous (kReady): every worker records and
// finishes on its own thread.
Status RecordAll(LocalCluster* cluster, std::vector<Tables>* tables) {
  const int n = cluster->num_workers();
  std::vector<Status> status(n);
  std::vector<std::thread> threads;
  for (int k = 0; k < n; ++k) {
    threads.emplace_back([&, k] { status[k] = Record(cluster->worker(k), &(*tables)[k]); });
  }
  for (std::thread& t : threads) t.join();
  for (const Status& s : status) MLT_RETURN_IF_ERROR(s);
  return Status::Ok();
}

Config Quick(int64_t timeout_ms = 5000) {
  Config config;
  config.wait_timeout_ms = timeout_ms;
  return config;
}

Message RowsMessage(int sender, int receiver, TableId table, Clock clock, RowSpan span, int64_t width,
                    float value) {
  Message m;
  m.header.type = static_cast<uint16_t>(MessageType::kRows);
  m.header.sender = sender;
  m.header.receiver = receiver;
  m.header.table = table;
  m.header.clock = clock;
  m.header.row_width = width;
  m.spans = {span};
  m.header.num_spans = 1;
  m.values.assign(static_cast<size_t>(span.count * width), value);
  return m;
}

// Runs `clocks` clocks of the Tables clock on every worker (worker k adds
// k + 1 to row 1 of b; each read sees data age c - 1) until every worker
// has both tables' rows of the last clock; *tables: the handles.
void RunClocks(LocalCluster* cluster, int clocks, std::vector<Tables>* tables) {
  const int n = cluster->num_workers();
  tables->assign(n, Tables());
  for (int k = 0; k < n; ++k) ASSERT_OK(CreateTables(cluster->worker(k), &(*tables)[k]));
  ASSERT_OK(RecordAll(cluster, tables));
  for (int k = 0; k < n; ++k) ASSERT_OK(cluster->worker(k)->StartIterations());
  std::vector<std::string> errors(n);
  std::vector<std::thread> threads;
  for (int k = 0; k < n; ++k) {
    threads.emplace_back([&, k] {
      Engine* e = cluster->worker(k);
      const Tables& t = (*tables)[k];
      Status s;
      for (int c = 0; c < clocks && s.ok(); ++c) {
        AccessBuffer r, u, l;
        s = e->Read(t.ra, &r);
        if (s.ok() && r.data_age != c - 1) errors[k] += "age;";
        if (s.ok()) s = e->PreUpdate(t.ub, &u);
        for (int j = 0; s.ok() && j < 5; ++j) u.data[j] = static_cast<float>(k + 1);
        if (s.ok()) s = e->LocalAccess(t.l, &l);
        if (s.ok()) s = e->PostLocalAccess(t.l);
        if (s.ok()) s = e->Update(t.ub);
        if (s.ok()) s = e->PostRead(t.ra);
        if (s.ok()) s = e->Clock();
      }
      if (s.ok()) s = e->Flush();
      // Each table's rows come in their own messages: wait for both.
      if (s.ok()) s = e->WaitForDataAge(t.b, clocks - 1);
      if (s.ok()) s = e->WaitForDataAge(t.a, clocks - 1);
      if (!s.ok()) errors[k] += s.ToString();
    });
  }
  for (std::thread& t : threads) t.join();
  for (int k = 0; k < n; ++k) {
    if (!errors[k].empty()) ::mltuner::testing::ReportFailure(__FILE__, __LINE__, errors[k]);
  }
}

// The CPU backend with allocations that fail while armed (a shard out of
// memory for a fork's copy).
class AllocationFailingDevice final : public ForwardingDevice {
 public:
  explicit AllocationFailingDevice(std::atomic<bool>* armed) : armed_(armed) {}
  Status Allocate(size_t b, void** out) override {
    if (armed_->load()) return Status::ResourceExhausted("injected: no memory for " + std::to_string(b) + " bytes");
    return ForwardingDevice::Allocate(b, out);
  }
  Status AllocateHost(size_t b, void** out) override {
    if (armed_->load()) return Status::ResourceExhausted("injected: no host memory for " + std::to_string(b) + " bytes");
    return ForwardingDevice::AllocateHost(b, out);
  }

 private:
  std::atomic<bool>* armed_;
};

// Every worker forks `child` from branch 0 at once (the shards wait for all).
std::vector<Status> ForkOnEveryWorker(LocalCluster* cluster, BranchId child) {
  std::vector<Status> status(cluster->num_workers());
  std::vector<std::thread> threads;
  for (int k = 0; k < cluster->num_workers(); ++k) {
    threads.emplace_back([&, k] {
      BranchSettings settings;
      settings.training = true;
      status[k] = cluster->worker(k)->ForkBranch(child, 0, settings);
    });
  }
  for (std::thread& t : threads) t.join();
  return status;
}

}  // namespace

TEST(CreateRejectsZeroWorkers) {

  std::unique_ptr<LocalCluster> cluster;
  EXPECT_CODE(LocalCluster::Create(Config(), 0, &cluster), StatusCode::kInvalidArgument);
  Config bad;
  bad.wait_timeout_ms = 0;
  EXPECT_CODE(LocalCluster::Create(bad, 2, &cluster), StatusCode::kInvalidArgument);
}

TEST(ThreeWorkersStartOnlyGivesDataAgeMinusOne) {
  std::unique_ptr<LocalCluster> cluster;
  ASSERT_OK(LocalCluster::Create(Quick(), kWorkers, &cluster));
  ASSERT_EQ(cluster->num_workers(), kWorkers);
  std::vector<Tables> tables(kWorkers);
  for (int k = 0; k < kWorkers; ++k) {
    Engine* e = cluster->worker(k);
    EXPECT_EQ(e->rank(), k);
    EXPECT_EQ(e->num_workers(), kWorkers);
    ASSERT_OK(CreateTables(e, &tables[k]));
    EXPECT_EQ(tables[k].a, TableId{0});
    EXPECT_EQ(tables[k].b, TableId{1});
    EXPECT_EQ(tables[k].local, TableId{2});
    TableInfo info;
    ASSERT_OK(e->FindTable("b", &info));
    EXPECT_EQ(info.num_rows, int64_t{2});
    EXPECT_EQ(info.row_width, int64_t{5});
    EXPECT_TRUE(!info.local);
    EXPECT_EQ(e->tables().size(), size_t{3});
    EXPECT_CODE(e->FindTable("nope", &info), StatusCode::kNotFound);
    TableId dup = -1;
    EXPECT_CODE(e->CreateTable("a", 1, 1, false, &dup), StatusCode::kInvalidArgument);
  }
  ASSERT_OK(RecordAll(cluster.get(), &tables));
  for (int k = 0; k < kWorkers; ++k) EXPECT_EQ(cluster->worker(k)->DataAge(tables[k].a), kNoClock);
  for (int k = 0; k < kWorkers; ++k) ASSERT_OK(cluster->worker(k)->StartIterations());
  for (int k = 0; k < kWorkers; ++k) {
    Engine* e = cluster->worker(k);
    for (TableId t : {tables[k].a, tables[k].b}) {
      ASSERT_OK(e->WaitForDataAge(t, kInitClock));
      EXPECT_EQ(e->DataAge(t), kInitClock);
    }
    // No clock was run: the age stays at -1.
    EXPECT_EQ(e->Stats().clock, Clock{0});
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  for (int k = 0; k < kWorkers; ++k) {
    EXPECT_EQ(cluster->worker(k)->DataAge(tables[k].a), kInitClock);
    EXPECT_EQ(cluster->worker(k)->DataAge(tables[k].b), kInitClock);
    // A local table has no data age and cannot be waited on.
    EXPECT_CODE(cluster->worker(k)->WaitForDataAge(tables[k].local, kInitClock), StatusCode::kInvalidArgument);
  }
  EXPECT_EQ(cluster->rejected_messages(), int64_t{0});
  EXPECT_OK(cluster->Shutdown());
  EXPECT_OK(cluster->Shutdown());  // idempotent
}

// A fork one shard refuses (it cannot allocate its copy) fails on every
// worker, and the shards that did fork free the child again: the same fork
// succeeds once there is room, and no shard still holds the first attempt.
TEST(AForkOneShardRefusesIsUndoneOnTheOthers) {
  Config config = Quick();
  config.update_rule.kind = UpdateRuleKind::kAdd;
  config.branches = true;
  std::atomic<bool> armed{false};
  std::unique_ptr<LocalCluster> cluster;
  ASSERT_OK(LocalCluster::Create(config, 2, &cluster, [&](int rank, std::unique_ptr<Device>* out) {
    if (rank == 1) {
      *out = std::make_unique<AllocationFailingDevice>(&armed);
    } else {
      *out = NewCpuDevice();
    }
    return Status::Ok();
  }));
  std::vector<Tables> tables(2);
  for (int k = 0; k < 2; ++k) ASSERT_OK(CreateTables(cluster->worker(k), &tables[k]));
  ASSERT_OK(RecordAll(cluster.get(), &tables));
  for (int k = 0; k < 2; ++k) ASSERT_OK(cluster->worker(k)->StartIterations());
  for (int k = 0; k < 2; ++k) {
    // Every shard has started (and allocated) once its start rows are here.
    ASSERT_OK(cluster->worker(k)->WaitForDataAge(tables[k].a, -1));
    ASSERT_OK(cluster->worker(k)->WaitForDataAge(tables[k].b, -1));
  }
  armed = true;
  for (const Status& status : ForkOnEveryWorker(cluster.get(), 1)) {
    EXPECT_CODE(status, StatusCode::kResourceExhausted);  // the shard's own code
    EXPECT_TRUE(status.message().find("shard 1 refused") != std::string::npos);
    EXPECT_TRUE(status.message().find("injected") != std::string::npos);
  }
  armed = false;
  for (const Status& status : ForkOnEveryWorker(cluster.get(), 1)) EXPECT_OK(status);  // not "already exists"
  EXPECT_OK(cluster->Shutdown());
}

// Three workers run five clocks under `config` on `make_device`'s devices:
// the sums, data ages and traffic are right.
void ExpectThreeWorkersRun(const Config& config, const DeviceFactory& make_device) {
  std::unique_ptr<LocalCluster> cluster;
  ASSERT_OK(LocalCluster::Create(config, kWorkers, &cluster, make_device));
  constexpr int kClocks = 5;
  std::vector<Tables> tables;
  RunClocks(cluster.get(), kClocks, &tables);
  // Row 1 of b got (1 + 2 + 3) per clock; row 0 nothing.
  std::vector<float> b(10);
  ASSERT_OK(cluster->worker(2)->Fetch(tables[2].b, {0, 1}, b.data()));
  for (int j = 0; j < 5; ++j) {
    EXPECT_EQ(b[j], 0.0f);
    EXPECT_EQ(b[5 + j], static_cast<float>(6 * kClocks));
  }
  for (int k = 0; k < kWorkers; ++k) {
    EXPECT_EQ(cluster->worker(k)->DataAge(tables[k].a), Clock{kClocks - 1});
    const EngineStats stats = cluster->worker(k)->Stats();
    EXPECT_TRUE(stats.messages_sent > 0);
    EXPECT_TRUE(stats.messages_received > 0);
  }
  EXPECT_EQ(cluster->rejected_messages(), int64_t{0});
  EXPECT_OK(cluster->Shutdown());
}

TEST(ThreeWorkersRunAFewClocks) {
  Config config = Quick();
  config.update_rule.kind = UpdateRuleKind::kAdd;
  ExpectThreeWorkersRun(config, nullptr);
}

// The same on GPU-like devices (gpu_like_device.h) under the least budget
// the plan accepts: parameter rows and the local table live in host memory
// and are swapped in and out through the device's copies.
TEST(ThreeWorkersRunUnderTheLeastBudgetOnGpuLikeDevices) {
  Config config = Quick();
  config.update_rule.kind = UpdateRuleKind::kAdd;
  config.device_memory_reserve = 0;
  const DeviceFactory gpu_like = [](int, std::unique_ptr<Device>* out) {
    *out = std::make_unique<GpuLikeDevice>();
    return Status::Ok();
  };
  // Worker 0's plan under `budget` (0: none).
  const auto preview = [&](int64_t budget) {
    Config previewed = config;
    previewed.device_memory_budget = budget;
    PlanPreview out;
    std::unique_ptr<LocalCluster> cluster;
    EXPECT_OK(LocalCluster::Create(previewed, kWorkers, &cluster, gpu_like));
    Tables t;
    EXPECT_OK(CreateTables(cluster->worker(0), &t));
    EXPECT_OK(RecordOps(cluster->worker(0), &t));
    EXPECT_OK(cluster->worker(0)->PreviewPlan(&out));
    return out;
  };
  const int64_t least = preview(0).pool_min_bytes;
  ASSERT_TRUE(least > 0);
  const PlanPreview squeezed = preview(least);
  EXPECT_TRUE(squeezed.host_store_bytes > 0 && squeezed.host_to_device_bytes > 0);  // rows do move
  config.device_memory_budget = least;
  ExpectThreeWorkersRun(config, gpu_like);
}

// Three GPU-like devices of different ordinals, as a LocalCluster on three
// GPUs: each shard's push reaches the two other workers as one host frame,
// which both install at once from their own threads (each through its own
// view: sharing the frame itself once crashed such clusters on real GPUs).
TEST(ThreeWorkersRunOnThreeGpuLikeDevicesOfDifferentOrdinals) {
  Config config = Quick();
  config.update_rule.kind = UpdateRuleKind::kAdd;
  const DeviceFactory three_gpus = [](int rank, std::unique_ptr<Device>* out) {
    *out = std::make_unique<GpuLikeDevice>(-1, nullptr, rank);
    return Status::Ok();
  };
  ExpectThreeWorkersRun(config, three_gpus);
}

TEST(EngineRejectsInvalidClientMessagesAndFails) {
  std::unique_ptr<LocalCluster> cluster;
  ASSERT_OK(LocalCluster::Create(Quick(), kWorkers, &cluster));
  std::vector<Tables> tables(kWorkers);
  for (int k = 0; k < kWorkers; ++k) ASSERT_OK(CreateTables(cluster->worker(k), &tables[k]));
  Engine* e = cluster->worker(0);
  // Rows before the virtual iteration is finished.
  EXPECT_CODE(e->HandleMessage(RowsMessage(0, 0, 0, 0, {0, 3}, 3, 1.0f)), StatusCode::kOutOfOrder);
  ASSERT_OK(RecordAll(cluster.get(), &tables));
  for (int k = 0; k < kWorkers; ++k) ASSERT_OK(cluster->worker(k)->StartIterations());
  ASSERT_OK(e->WaitForDataAge(0, kInitClock));

  // Table 'a' (7 rows, width 3) over 3 shards: [0,3), [3,5), [5,7).
  EXPECT_CODE(e->HandleMessage(RowsMessage(0, 0, 9, 0, {0, 3}, 3, 1.0f)), StatusCode::kNotFound);
  EXPECT_CODE(e->HandleMessage(RowsMessage(0, 0, 2, 0, {0, 3}, 2, 1.0f)), StatusCode::kNotFound);  // local
  EXPECT_CODE(e->HandleMessage(RowsMessage(5, 0, 0, 0, {0, 3}, 3, 1.0f)), StatusCode::kInvalidArgument);
  EXPECT_CODE(e->HandleMessage(RowsMessage(-1, 0, 0, 0, {0, 3}, 3, 1.0f)), StatusCode::kInvalidArgument);
  // Not the sender shard's whole range, a wrong width, a short payload.
  EXPECT_CODE(e->HandleMessage(RowsMessage(1, 0, 0, 0, {0, 3}, 3, 1.0f)), StatusCode::kInvalidArgument);
  EXPECT_CODE(e->HandleMessage(RowsMessage(0, 0, 0, 0, {0, 2}, 3, 1.0f)), StatusCode::kInvalidArgument);
  EXPECT_CODE(e->HandleMessage(RowsMessage(0, 0, 0, 0, {0, 3}, 4, 1.0f)), StatusCode::kInvalidArgument);
  Message short_payload = RowsMessage(0, 0, 0, 0, {0, 3}, 3, 1.0f);
  short_payload.values.pop_back();
  EXPECT_CODE(e->HandleMessage(std::move(short_payload)), StatusCode::kInvalidArgument);
  // A server-bound type, and a reply to a request nobody made.
  Message fetch;
  fetch.header.type = static_cast<uint16_t>(MessageType::kFetch);
  fetch.header.sender = 1;
  fetch.header.table = 0;
  EXPECT_CODE(e->HandleMessage(std::move(fetch)), StatusCode::kInvalidArgument);
  Message ack;
  ack.header.type = static_cast<uint16_t>(MessageType::kAck);
  ack.header.sender = 1;
  ack.header.request_id = 123456;
  EXPECT_CODE(e->HandleMessage(std::move(ack)), StatusCode::kInvalidArgument);
  // A stale push (not newer than what the shard sent) is ignored, not applied.
  EXPECT_OK(e->HandleMessage(RowsMessage(0, 0, 0, kInitClock, {0, 3}, 3, 99.0f)));
  EXPECT_EQ(e->DataAge(0), kInitClock);

  // Rows that cannot be installed fail the engine at once, with the first
  // cause and the thread it happened on, on every later call (rather than a
  // timeout that blames a slow worker); the other workers are unaffected.
  AccessBuffer r;
  const Status failed = e->Read(tables[0].ra, &r);
  EXPECT_CODE(failed, StatusCode::kOutOfOrder);
  EXPECT_TRUE(failed.message().find("worker 0's receive thread") != std::string::npos);
  EXPECT_TRUE(failed.message().find("before the virtual iteration was finished") != std::string::npos);
  EXPECT_CODE(e->Clock(), StatusCode::kOutOfOrder);
  EXPECT_OK(cluster->worker(1)->Read(tables[1].ra, &r));
  cluster->Shutdown();
}

// Updates posted right before a worker shuts down are shipped first: the
// other worker's next read, which needs them (slack 0), sees them.
TEST(ShutdownShipsWhatWasPosted) {
  Config config = Quick();
  config.update_rule.kind = UpdateRuleKind::kAdd;
  for (int round = 0; round < 20; ++round) {
    std::unique_ptr<LocalCluster> cluster;
    ASSERT_OK(LocalCluster::Create(config, 2, &cluster));
    TableId t[2];
    Handle read[2], update[2];
    std::vector<std::thread> threads;
    std::vector<Status> status(2);
    for (int k = 0; k < 2; ++k) {
      threads.emplace_back([&, k] {
        Engine* e = cluster->worker(k);
        Status s = e->CreateTable("w", 2, 4, false, &t[k]);
        if (s.ok()) s = e->VirtualRead(t[k], {0, 1}, 0, &read[k]);
        if (s.ok()) s = e->VirtualPreUpdate(t[k], {0, 1}, &update[k]);
        if (s.ok()) s = e->VirtualUpdate(update[k]);
        if (s.ok()) s = e->VirtualPostRead(read[k]);
        if (s.ok()) s = e->VirtualClock();
        if (s.ok()) s = e->FinishVirtualIteration();
        status[k] = s;
      });
    }
    for (std::thread& thread : threads) thread.join();
    ASSERT_OK(status[0]);
    ASSERT_OK(status[1]);
    for (int k = 0; k < 2; ++k) ASSERT_OK(cluster->worker(k)->StartIterations());
    for (int k = 0; k < 2; ++k) {  // clock 0 on both: every row += 1 from each worker
      Engine* e = cluster->worker(k);
      AccessBuffer r, u;
      ASSERT_OK(e->Read(read[k], &r));
      ASSERT_OK(e->PreUpdate(update[k], &u));
      for (int j = 0; j < 8; ++j) u.data[j] = 1.0f;
      ASSERT_OK(e->Update(update[k]));
      ASSERT_OK(e->PostRead(read[k]));
      ASSERT_OK(e->Clock());
    }
    ASSERT_OK(cluster->worker(0)->Shutdown());  // right after posting
    AccessBuffer r;
    ASSERT_OK(cluster->worker(1)->Read(read[1], &r));  // needs worker 0's clock 0
    for (int j = 0; j < 8; ++j) EXPECT_EQ(r.data[j], 2.0f);
    cluster->Shutdown();
  }
}

// Each worker registers its tables only with its own shard, inside
// CreateTable; FinishVirtualIteration is the rendezvous that makes sure no
// kStart or initial value reaches a shard before its tables. A fast worker
// waits there for a slow one, and both then start normally.
TEST(FastWorkerWaitsForSlowOneAtFinish) {
  std::unique_ptr<LocalCluster> cluster;
  ASSERT_OK(LocalCluster::Create(Quick(5000), 2, &cluster));
  Tables t0, t1;
  Status fast_status;
  double fast_waited = 0;
  std::thread fast([&] {
    const auto start = std::chrono::steady_clock::now();
    fast_status = CreateTables(cluster->worker(1), &t1);
    if (fast_status.ok()) fast_status = Record(cluster->worker(1), &t1);
    fast_waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (fast_status.ok()) fast_status = cluster->worker(1)->StartIterations();
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  ASSERT_OK(CreateTables(cluster->worker(0), &t0));
  ASSERT_OK(Record(cluster->worker(0), &t0));
  fast.join();
  ASSERT_OK(fast_status);
  EXPECT_TRUE(fast_waited >= 0.15);
  ASSERT_OK(cluster->worker(0)->StartIterations());
  for (int k = 0; k < 2; ++k) {
    EXPECT_OK(cluster->worker(k)->WaitForDataAge(0, kInitClock));
    EXPECT_OK(cluster->worker(k)->WaitForDataAge(1, kInitClock));
  }
  EXPECT_EQ(cluster->rejected_messages(), int64_t{0});
  EXPECT_OK(cluster->Shutdown());
}

TEST(MismatchedTablesFailEveryWorkerAtFinish) {
  std::unique_ptr<LocalCluster> cluster;
  ASSERT_OK(LocalCluster::Create(Quick(3000), 2, &cluster));
  std::vector<Status> status(2);
  std::vector<std::thread> threads;
  for (int k = 0; k < 2; ++k) {
    threads.emplace_back([&, k] {
      Engine* e = cluster->worker(k);
      TableId t = -1;
      Handle r = -1;
      status[k] = e->CreateTable("w", k == 0 ? 8 : 9, 4, false, &t);  // row counts differ
      if (status[k].ok()) status[k] = e->VirtualRead(t, {0}, 0, &r);
      if (status[k].ok()) status[k] = e->VirtualPostRead(r);
      if (status[k].ok()) status[k] = e->VirtualClock();
      if (status[k].ok()) status[k] = e->FinishVirtualIteration();
    });
  }
  for (std::thread& t : threads) t.join();
  for (int k = 0; k < 2; ++k) {
    EXPECT_CODE(status[k], StatusCode::kInvalidArgument);
    EXPECT_TRUE(status[k].message().find("same tables") != std::string::npos);
  }
  EXPECT_OK(cluster->Shutdown());
}

TEST(FinishTimesOutWhenAWorkerNeverFinishes) {
  std::unique_ptr<LocalCluster> cluster;
  ASSERT_OK(LocalCluster::Create(Quick(400), 2, &cluster));
  Tables t0, t1;
  ASSERT_OK(CreateTables(cluster->worker(0), &t0));
  ASSERT_OK(CreateTables(cluster->worker(1), &t1));
  const auto start = std::chrono::steady_clock::now();
  const Status s = Record(cluster->worker(0), &t0);  // worker 1 never finishes
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_CODE(s, StatusCode::kTimeout);
  EXPECT_TRUE(waited >= 0.35 && waited < 0.4 + 2.0);
  const auto start2 = std::chrono::steady_clock::now();
  EXPECT_OK(cluster->Shutdown());
  EXPECT_TRUE(std::chrono::duration<double>(std::chrono::steady_clock::now() - start2).count() < 2.0);
}

MLT_TEST_MAIN
