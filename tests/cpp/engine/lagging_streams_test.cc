// The engine's tickets between its streams and the application's, checked
// on the CPU: two workers whose devices run every stream late and out of
// step, the application's included (lagging_device.h), must train exactly
// as two whose devices run everything at once, at every budget
// from the least pool to unlimited, with one region and with two. Each
// clock's values depend on what it read, so a row read stale, an activation
// fetched before its write-back landed, or a buffer filled while another
// user still reads it changes the result. Also with branches: a fork, a
// switch to it and back, each reloading the cache.
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "engine/two_layer_model.h"
#include "lagging_device.h"
#include "mltuner/cluster.h"
#include "mltuner/engine.h"
#include "test_util.h"

using namespace mltuner;

namespace {

constexpr int kWorkers = 2;
constexpr int kClocks = 6;

float Mod(float value, float by) { return std::fmod(std::fabs(value), by); }

constexpr int kAppStreams = 2;

// The application's side of one worker, per stream it uses: what it read,
// folded into small integers (every sum is exact), and everything it saw.
struct App {
  float carried[kAppStreams] = {};
  std::vector<float> seen[kAppStreams];
};

// A recording whose least pool has a buffer over two earlier ones that
// lived side by side: the second read of layer 0 takes the addresses of
// layer 1's read and of layer 1's update, and the read closes last. (Any
// lookahead needs a larger pool, so the least budget keeps this layout.)
Status RecordSpanningBuffer(Engine* e, Model* m) {
  MLT_RETURN_IF_ERROR(CreateLayerTables(e, m));
  Script s(e, m);
  Handle r0, r1, u1, r0b;
  MLT_RETURN_IF_ERROR(s.Read(m->layer0, Range(0, 16), &r0));
  MLT_RETURN_IF_ERROR(s.PostRead(r0));
  MLT_RETURN_IF_ERROR(s.Read(m->layer1, Range(0, 16), &r1));
  MLT_RETURN_IF_ERROR(s.PreUpdate(m->layer1, Range(0, 8), &u1));
  MLT_RETURN_IF_ERROR(s.PostUpdate(u1));
  MLT_RETURN_IF_ERROR(s.PostRead(r1));
  MLT_RETURN_IF_ERROR(s.Read(m->layer0, Range(0, 16), &r0b));
  MLT_RETURN_IF_ERROR(s.Update(m->layer0, Range(0, 4)));
  MLT_RETURN_IF_ERROR(s.PostRead(r0b));
  MLT_RETURN_IF_ERROR(e->VirtualClock());
  return e->FinishVirtualIteration();
}

// Two reads of layer 1 side by side, each used on a stream of its own (see
// StreamOf), then layer 0's second read over both: it waits for the read
// that closed last, whose ticket covers the other only if the two streams
// are joined. (Any lookahead needs a larger pool.)
Status RecordReadsSideBySide(Engine* e, Model* m) {
  MLT_RETURN_IF_ERROR(CreateLayerTables(e, m));
  Script s(e, m);
  Handle r0, ra, rb, r0b;
  MLT_RETURN_IF_ERROR(s.Read(m->layer0, Range(0, 16), &r0));
  MLT_RETURN_IF_ERROR(s.PostRead(r0));
  MLT_RETURN_IF_ERROR(s.Read(m->layer1, Range(0, 8), &ra));
  MLT_RETURN_IF_ERROR(s.Read(m->layer1, Range(8, 8), &rb));
  MLT_RETURN_IF_ERROR(s.PostRead(ra));
  MLT_RETURN_IF_ERROR(s.PostRead(rb));
  MLT_RETURN_IF_ERROR(s.Read(m->layer0, Range(0, 16), &r0b));
  MLT_RETURN_IF_ERROR(s.Update(m->layer0, Range(0, 4)));
  MLT_RETURN_IF_ERROR(s.Update(m->layer1, Range(0, 16)));
  MLT_RETURN_IF_ERROR(s.PostRead(r0b));
  MLT_RETURN_IF_ERROR(e->VirtualClock());
  return e->FinishVirtualIteration();
}

// The PyTorch adapter's light clock (held reads): both layers read for the
// forward pass and held through the backward pass; at step() each layer's
// read posted, its update posted and the next update opened, in forward order.
Status RecordLightClock(Engine* e, Model* m) {
  MLT_RETURN_IF_ERROR(CreateLayerTables(e, m));
  Script s(e, m);
  Handle r0, r1, u0, u1;
  MLT_RETURN_IF_ERROR(s.Read(m->layer0, Range(0, 16), &r0));
  MLT_RETURN_IF_ERROR(s.Read(m->layer1, Range(0, 16), &r1));
  MLT_RETURN_IF_ERROR(s.PreUpdate(m->layer0, Range(0, 16), &u0));
  MLT_RETURN_IF_ERROR(s.PostRead(r0));
  MLT_RETURN_IF_ERROR(s.PostUpdate(u0));
  MLT_RETURN_IF_ERROR(s.PreUpdate(m->layer1, Range(0, 16), &u1));
  MLT_RETURN_IF_ERROR(s.PostRead(r1));
  MLT_RETURN_IF_ERROR(s.PostUpdate(u1));
  MLT_RETURN_IF_ERROR(e->VirtualClock());
  return e->FinishVirtualIteration();
}

Status RecordTwoLayers(Engine* e, Model* m) { return Record(e, m, /*read_back_at_once=*/true); }

using RecordFn = Status (*)(Engine*, Model*);

// What one test trains: the recording, the regions, the clock's calls, and
// whether clocks run on branches and the application on two streams.
struct Setup {
  RecordFn record = RecordTwoLayers;
  int prefetch_clocks = 0;
  bool batched = false;   // the clock as the PyTorch adapter makes it (BatchedClock; LightClock for
                          // RecordLightClock)
  bool branches = false;  // kBranchBlocks
  bool two_streams = false;  // each buffer's work on the stream of its handle's parity
  uint32_t seeds = 3;        // lagging runs per budget
};

uintptr_t StreamOf(const Setup& setup, Handle h) { return setup.two_streams ? static_cast<uintptr_t>(h % 2) : 0; }

// One clock of worker `rank`. The application's work on each buffer goes on
// its (lagging) stream, as a GPU application's kernels do; what it writes
// depends on what it read on that stream.
Status RunClock(Engine* e, LaggingDevice* device, const Model& m, const Setup& setup, int rank, int clock, App* app) {
  for (int stream = 0; stream < kAppStreams; ++stream) {
    device->OnAppStream([app, rank, clock, stream] { app->carried[stream] = static_cast<float>(rank + clock); },
                        static_cast<uintptr_t>(stream));
  }
  for (size_t i = 0; i < m.kinds.size(); ++i) {
    AccessBuffer buffer;
    const Handle h = m.handles[i];
    const uintptr_t stream = StreamOf(setup, h);
    switch (m.kinds[i]) {
      case OpKind::kRead:
        MLT_RETURN_IF_ERROR(e->Read(h, &buffer, stream));
        break;
      case OpKind::kPreUpdate:
        MLT_RETURN_IF_ERROR(e->PreUpdate(h, &buffer, stream));
        break;
      case OpKind::kLocalAccess:
        MLT_RETURN_IF_ERROR(e->LocalAccess(h, &buffer, stream));
        break;
      case OpKind::kPostRead: MLT_RETURN_IF_ERROR(e->PostRead(h, stream)); continue;
      case OpKind::kUpdate: MLT_RETURN_IF_ERROR(e->Update(h, stream)); continue;
      case OpKind::kPostLocalAccess: MLT_RETURN_IF_ERROR(e->PostLocalAccess(h, stream)); continue;
      default: return Status::Internal("unexpected op");
    }
    float* data = buffer.data;
    const int64_t count = buffer.rows * buffer.row_width;
    const OpKind kind = m.kinds[i];
    const bool fetch = m.fetches[i];
    device->OnAppStream([=] {
      float& carried = app->carried[stream];
      if (kind == OpKind::kRead || fetch) {  // a read, or stored rows read back (then changed: kept)
        for (int64_t k = 0; k < count; ++k) carried = Mod(carried + data[k], 7.0f);
        app->seen[stream].push_back(carried);
        if (fetch) {
          for (int64_t k = 0; k < count; ++k) data[k] += 1.0f;
        }
      } else if (kind == OpKind::kPreUpdate) {
        for (int64_t k = 0; k < count; ++k) data[k] = Mod(carried + static_cast<float>(k), 5.0f);
      } else {  // an activation stored
        for (int64_t k = 0; k < count; ++k) data[k] = Mod(carried + 3.0f * static_cast<float>(k), 11.0f);
      }
    }, stream);
  }
  return e->Clock();
}

// The same clock as the PyTorch adapter makes it: ops batched into
// Engine::Run calls, stores and updates copied in from the application's
// memory by fill pieces as they are posted (the copies on its stream), and a
// batch run only when the application needs a buffer it opened.
class BatchedClock {
 public:
  BatchedClock(Engine* e, LaggingDevice* device, const Model& m)
      : e_(e), device_(device), m_(m), staged_(m.kinds.size()) {
    for (size_t i = 0; i < m.kinds.size(); ++i) staged_[i].resize(static_cast<size_t>(m.values[i]));
  }

  Status Run(int rank, int clock, App* app) {
    device_->OnAppStream([app, rank, clock] { app->carried[0] = static_cast<float>(rank + clock); });
    for (size_t i = 0; i < m_.kinds.size(); ++i) {
      const OpKind kind = m_.kinds[i];
      const Handle h = m_.handles[i];
      const bool paired = i + 1 < m_.kinds.size() && m_.handles[i + 1] == h;  // posted by the next op
      if ((kind == OpKind::kPreUpdate || (kind == OpKind::kLocalAccess && !m_.fetches[i])) && paired) {
        // Written whole by the application: staged in its memory, copied in at the post.
        float* staged = staged_[i].data();
        const int64_t count = m_.values[i];
        const bool update = kind == OpKind::kPreUpdate;
        device_->OnAppStream([=] {
          for (int64_t k = 0; k < count; ++k) {
            staged[k] = update ? Mod(app->carried[0] + static_cast<float>(k), 5.0f)
                               : Mod(app->carried[0] + 3.0f * static_cast<float>(k), 11.0f);
          }
        });
        // In two pieces, as a group of saved tensors is stored.
        const int64_t half = count / 2;
        batch_.push_back(OpCall{kind, h, {}, {}});
        const std::vector<CopyPiece> pieces = {{staged, 0, half}, {staged + half, half, count - half}};
        batch_.push_back(OpCall{m_.kinds[i + 1], h, pieces, {}});
        ++i;
        continue;
      }
      if (kind == OpKind::kLocalAccess && m_.fetches[i] && paired && m_.kinds[i + 1] == OpKind::kPostLocalAccess) {
        // Read back and dropped at once: copied out into the application's memory at the post.
        float* staged = staged_[i].data();
        const int64_t count = m_.values[i];
        batch_.push_back(OpCall{kind, h, {}, {}});
        batch_.push_back(OpCall{m_.kinds[i + 1], h, {}, {CopyPiece{staged, 0, count}}});
        ++i;
        std::vector<AccessBuffer> opened;
        MLT_RETURN_IF_ERROR(Flush(&opened));
        device_->OnAppStream([=] {
          for (int64_t k = 0; k < count; ++k) app->carried[0] = Mod(app->carried[0] + staged[k], 7.0f);
          app->seen[0].push_back(app->carried[0]);
        });
        continue;
      }
      batch_.push_back(OpCall{kind, h, {}, {}});
      if (kind != OpKind::kRead && kind != OpKind::kLocalAccess && kind != OpKind::kPreUpdate) continue;
      std::vector<AccessBuffer> opened;
      MLT_RETURN_IF_ERROR(Flush(&opened));
      const AccessBuffer& buffer = opened.back();
      float* data = buffer.data;
      const int64_t count = buffer.rows * buffer.row_width;
      const bool fetch = m_.fetches[i];
      device_->OnAppStream([=] {
        if (kind == OpKind::kPreUpdate) {
          for (int64_t k = 0; k < count; ++k) data[k] = Mod(app->carried[0] + static_cast<float>(k), 5.0f);
          return;
        }
        for (int64_t k = 0; k < count; ++k) app->carried[0] = Mod(app->carried[0] + data[k], 7.0f);
        app->seen[0].push_back(app->carried[0]);
        if (fetch) {
          for (int64_t k = 0; k < count; ++k) data[k] += 1.0f;
        }
      });
    }
    batch_.push_back(OpCall{OpKind::kClock, -1, {}, {}});
    std::vector<AccessBuffer> opened;
    return Flush(&opened);
  }

 private:
  Status Flush(std::vector<AccessBuffer>* opened) {
    const Status status = e_->Run(batch_, opened);
    batch_.clear();
    return status;
  }

  Engine* e_;
  LaggingDevice* device_;
  const Model& m_;
  std::vector<std::vector<float>> staged_;  // by op: the application's memory of a store or an update
  std::vector<OpCall> batch_;
};

// With branches: clocks 0-1 on branch 0, 2-3 on a fork of it with half the
// rate, 4-5 on branch 0 again (the cache reloaded at each switch).
const std::vector<std::pair<BranchId, int>> kBranchBlocks = {{0, 2}, {1, 2}, {0, 2}};

// RecordLightClock's clock as the adapter runs it: one engine call opens
// the reads and the first update; the application reads both layers and
// stages both layers' updates in its memory; one call at step() posts each
// read and each update (copied in by fill pieces), opens the second update
// and ends the clock.
class LightClock {
 public:
  // The staged memory is made once: only the application's stream touches it.
  LightClock(Engine* e, LaggingDevice* device, const Model& m)
      : e_(e), device_(device), m_(m), staged0_(static_cast<size_t>(m.values[2])),
        staged1_(static_cast<size_t>(m.values[5])) {}

  Status Run(int rank, int clock, App* app) {
    const std::vector<Handle>& h = m_.handles;  // r0, r1, u0, _, _, u1 (by op)
    const Handle r0 = h[0], r1 = h[1], u0 = h[2], u1 = h[5];
    std::vector<AccessBuffer> opened;
    MLT_RETURN_IF_ERROR(e_->Run({{OpKind::kRead, r0, {}, {}}, {OpKind::kRead, r1, {}, {}},
                                 {OpKind::kPreUpdate, u0, {}, {}}}, &opened));
    const AccessBuffer read0 = opened[0], read1 = opened[1];
    float* staged0 = staged0_.data();
    float* staged1 = staged1_.data();
    const int64_t count0 = static_cast<int64_t>(staged0_.size()), count1 = static_cast<int64_t>(staged1_.size());
    device_->OnAppStream([=] {
      float& carried = app->carried[0];
      carried = static_cast<float>(rank + clock);
      for (const AccessBuffer& read : {read0, read1}) {
        for (int64_t k = 0; k < read.rows * read.row_width; ++k) carried = Mod(carried + read.data[k], 7.0f);
        app->seen[0].push_back(carried);
      }
      for (int64_t k = 0; k < count0; ++k) staged0[k] = Mod(carried + static_cast<float>(k), 5.0f);
      for (int64_t k = 0; k < count1; ++k) staged1[k] = Mod(carried + static_cast<float>(k), 5.0f);
    });
    return e_->Run({{OpKind::kPostRead, r0, {}, {}},
                    {OpKind::kUpdate, u0, {CopyPiece{staged0, 0, count0}}, {}},
                    {OpKind::kPreUpdate, u1, {}, {}},
                    {OpKind::kPostRead, r1, {}, {}},
                    {OpKind::kUpdate, u1, {CopyPiece{staged1, 0, count1}}, {}},
                    {OpKind::kClock, -1, {}, {}}},
                   &opened);
  }

 private:
  Engine* e_;
  LaggingDevice* device_;
  const Model& m_;
  std::vector<float> staged0_, staged1_;  // the application's memory of the updates
};

struct Trained {
  std::vector<std::vector<float>> seen;  // by worker
  std::vector<float> layer0, layer1;     // the servers' values at the end (of branch 0)
  std::vector<float> fork0, fork1;       // with branches: the fork's
  std::vector<int64_t> host_store_bytes;
  int64_t pool_min_bytes = 0;
};

// Trains kClocks clocks on kWorkers workers with lagging devices of `seed`
// (0: synchronous, the reference).
void Train(const Setup& setup, uint32_t seed, int64_t budget, Trained* out, bool* refused) {
  const bool branches = setup.branches;
  std::vector<LaggingDevice*> devices(kWorkers, nullptr);
  const DeviceFactory factory = [seed, &devices](int rank, std::unique_ptr<Device>* made) {
    auto device = std::make_unique<LaggingDevice>(seed + 1000u * static_cast<uint32_t>(rank), 300, seed == 0);
    devices[static_cast<size_t>(rank)] = device.get();
    *made = std::move(device);
    return Status::Ok();
  };
  Config config;
  config.update_rule.kind = UpdateRuleKind::kAdd;
  config.device_memory_budget = budget;
  config.prefetch_clocks = setup.prefetch_clocks;
  config.wait_timeout_ms = 20000;
  if (branches) {
    config.branches = true;
    config.update_rule.kind = UpdateRuleKind::kSgd;  // a rate for the fork to change
    config.update_rule.learning_rate = 1.0f;
  }
  std::unique_ptr<LocalCluster> cluster;
  ASSERT_OK(LocalCluster::Create(config, kWorkers, &cluster, factory));
  std::vector<Model> models(kWorkers);
  std::vector<Status> recorded(kWorkers);
  std::vector<std::thread> threads;
  for (int r = 0; r < kWorkers; ++r) {
    threads.emplace_back([&, r] {
      recorded[r] = setup.record(cluster->worker(r), &models[r]);
    });
  }
  for (std::thread& t : threads) t.join();
  threads.clear();
  *refused = recorded[0].code() == StatusCode::kResourceExhausted;
  if (*refused) {
    ASSERT_OK(cluster->Shutdown());
    return;
  }
  for (const Status& s : recorded) ASSERT_OK(s);
  std::vector<App> apps(kWorkers);
  std::vector<Status> ran(kWorkers);
  for (int r = 0; r < kWorkers; ++r) {
    threads.emplace_back([&, r] {
      Engine* e = cluster->worker(r);
      Status s = e->StartIterations();
      BatchedClock batches(e, devices[r], models[r]);
      LightClock light(e, devices[r], models[r]);
      const bool held_reads = setup.record == RecordLightClock;
      const std::vector<std::pair<BranchId, int>> blocks =
          branches ? kBranchBlocks : std::vector<std::pair<BranchId, int>>{{0, kClocks}};
      int c = 0;
      for (const auto& [branch, clocks] : blocks) {
        if (s.ok() && branches && branch == 1) {
          BranchSettings half_rate;
          half_rate.learning_rate = 0.5f;
          s = e->ForkBranch(1, 0, half_rate);
        }
        if (s.ok() && branches) s = e->ScheduleBranch(branch, clocks);
        for (int k = 0; s.ok() && k < clocks; ++k, ++c) {
          if (!setup.batched) {
            s = RunClock(e, devices[r], models[r], setup, r, c, &apps[r]);
          } else {
            s = held_reads ? light.Run(r, c, &apps[r]) : batches.Run(r, c, &apps[r]);
          }
        }
      }
      devices[r]->FinishApp();
      if (s.ok()) s = e->Flush();
      // Branch 0's clocks; the fork's updates were sent before its last ones.
      const int age = branches ? 3 : kClocks - 1;
      if (s.ok()) s = e->WaitForDataAge(models[r].layer0, age);
      if (s.ok()) s = e->WaitForDataAge(models[r].layer1, age);
      ran[r] = s;
    });
  }
  for (std::thread& t : threads) t.join();
  for (const Status& s : ran) ASSERT_OK(s);
  for (const App& app : apps) {
    for (const std::vector<float>& seen : app.seen) out->seen.push_back(seen);
  }
  Engine* e = cluster->worker(0);
  out->layer0.assign(16 * kWidth, 0.0f);
  out->layer1.assign(16 * (kWidth / 2), 0.0f);
  ASSERT_OK(e->Fetch(models[0].layer0, Range(0, 16), out->layer0.data()));
  ASSERT_OK(e->Fetch(models[0].layer1, Range(0, 16), out->layer1.data()));
  if (branches) {
    out->fork0.assign(16 * kWidth, 0.0f);
    out->fork1.assign(16 * (kWidth / 2), 0.0f);
    ASSERT_OK(e->Fetch(models[0].layer0, Range(0, 16), out->fork0.data(), 1));
    ASSERT_OK(e->Fetch(models[0].layer1, Range(0, 16), out->fork1.data(), 1));
  }
  for (int r = 0; r < kWorkers; ++r) out->host_store_bytes.push_back(cluster->worker(r)->Stats().host_store_bytes);
  out->pool_min_bytes = e->Stats().pool_min_bytes;
  ASSERT_OK(cluster->Shutdown());
}

// Against the reference of the same setup, synchronous, with one call per op.
void CheckEveryBudget(const Setup& setup) {
  Trained reference;
  bool refused = false;
  Setup unbatched = setup;
  unbatched.batched = false;
  Train(unbatched, 0, 0, &reference, &refused);
  if (setup.branches) EXPECT_TRUE(reference.fork0 != reference.layer0);  // the fork's own rate took
  ASSERT_TRUE(!refused);
  const int64_t least = reference.pool_min_bytes;  // the least pool of this plan's regions
  ASSERT_TRUE(least > 0);
  int tried = 0;
  bool swapped = false;
  for (const int64_t budget : {int64_t{0}, least, least + least / 2, 2 * least, 4 * least}) {
    for (uint32_t seed = 1; seed <= setup.seeds; ++seed) {
      Trained lagging;
      Train(setup, seed, budget, &lagging, &refused);
      if (refused) break;
      ++tried;
      swapped = swapped || lagging.host_store_bytes[0] > 0;
      const std::string where = "budget " + std::to_string(budget) + ", prefetch_clocks " +
                                std::to_string(setup.prefetch_clocks) + ", seed " + std::to_string(seed) +
                                (setup.batched ? ", batched" : "") + (setup.branches ? ", branches" : "") +
                                (setup.two_streams ? ", two streams" : "");
      EXPECT_TRUE(lagging.seen == reference.seen);
      EXPECT_TRUE(lagging.layer0 == reference.layer0);
      EXPECT_TRUE(lagging.layer1 == reference.layer1);
      EXPECT_TRUE(lagging.fork0 == reference.fork0 && lagging.fork1 == reference.fork1);
      if (lagging.seen != reference.seen || lagging.layer0 != reference.layer0 || lagging.fork0 != reference.fork0) {
        std::fprintf(stderr, "  differs at %s\n", where.c_str());
      }
    }
  }
  EXPECT_TRUE(tried >= 6);
  EXPECT_TRUE(swapped);  // some budget put rows in host memory
}

}  // namespace

Setup With(int prefetch_clocks, bool batched, RecordFn record = RecordTwoLayers) {
  Setup setup;
  setup.prefetch_clocks = prefetch_clocks;
  setup.batched = batched;
  setup.record = record;
  return setup;
}

TEST(LaggingStreamsTrainAsTheCpuWithTwoRegions) { CheckEveryBudget(With(1, false)); }
TEST(LaggingStreamsTrainAsTheCpuWithOneRegion) { CheckEveryBudget(With(0, false)); }
TEST(BatchedClocksOnLaggingStreamsTrainAsTheCpuWithTwoRegions) { CheckEveryBudget(With(1, true)); }
TEST(BatchedClocksOnLaggingStreamsTrainAsTheCpuWithOneRegion) { CheckEveryBudget(With(0, true)); }
TEST(BranchesOnLaggingStreamsTrainAsTheCpuWithTwoRegions) {
  Setup setup = With(1, false);
  setup.branches = true;
  CheckEveryBudget(setup);
}
TEST(BatchedBranchesOnLaggingStreamsTrainAsTheCpuWithOneRegion) {
  Setup setup = With(0, true);
  setup.branches = true;
  CheckEveryBudget(setup);
}
TEST(ABufferOverTwoEarlierOnesWaitsForBoth) { CheckEveryBudget(With(0, false, RecordSpanningBuffer)); }
TEST(ABufferOverTwoEarlierOnesWaitsForBothBatched) { CheckEveryBudget(With(0, true, RecordSpanningBuffer)); }
TEST(TheLightClockOnLaggingStreamsTrainsAsTheCpu) {
  CheckEveryBudget(With(1, true, RecordLightClock));
  CheckEveryBudget(With(0, true, RecordLightClock));
}
TEST(ApplicationStreamsAreJoinedWherePostsSwitchStreams) {
  // Each buffer used on a stream of its own: a fill over two reads posted on
  // different streams waits for the later post's ticket, which must cover
  // the other stream's work too.
  Setup setup = With(0, false, RecordReadsSideBySide);
  setup.two_streams = true;
  setup.seeds = 10;  // the race needs the other stream to lag at the right moment
  CheckEveryBudget(setup);
  setup.record = RecordTwoLayers;
  setup.seeds = 3;
  CheckEveryBudget(setup);
}

MLT_TEST_MAIN
