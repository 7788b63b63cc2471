// ServerShard: BSP application of update rules, determinism under any arrival
// order, pushes exactly when a clock finishes, and rejection of every kind of
// bad message without changing the shard.
//
// Every process hosts one shard, so with 3 workers a 7-row table is split
// over 3 shards as rows [0,3), [3,5), [5,7).
#include "server/shard.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <deque>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "rule_reference.h"
#include "wire/table_schema.h"
#include "test_util.h"

using namespace mltuner;

namespace {

constexpr int kWorkers = 3;
constexpr TableId kTable = 5;
constexpr int64_t kRows = 7;
constexpr int64_t kWidth = 4;

TableInfo Table(TableId id = kTable, int64_t rows = kRows, int64_t width = kWidth) {
  TableInfo info;
  info.id = id;
  info.name = "t" + std::to_string(id);
  info.num_rows = rows;
  info.row_width = width;
  return info;
}

UpdateRuleConfig Rule(UpdateRuleKind kind) {
  UpdateRuleConfig config;
  config.kind = kind;
  config.learning_rate = 0.1f;
  config.momentum = 0.7f;
  config.beta1 = 0.9f;
  config.beta2 = 0.99f;
  config.epsilon = 1e-6f;
  return config;
}

// A message's host values (a pushed row's host frame, or its vector).
std::vector<float> HostValues(const Message& m) {
  const float* data = m.host_values();
  return data == nullptr ? std::vector<float>() : std::vector<float>(data, data + m.num_values());
}

std::vector<float> RandomValues(std::mt19937* rng, int64_t n) {
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = dist(*rng);
  return v;
}

Message Header(MessageType type, WorkerId sender, int shard, TableId table) {
  Message m;
  m.header.type = static_cast<uint16_t>(type);
  m.header.sender = sender;
  m.header.receiver = shard;
  m.header.table = table;
  return m;
}

Message Start(WorkerId sender, int shard) { return Header(MessageType::kStart, sender, shard, -1); }

Message WithRows(Message m, std::vector<RowSpan> spans, std::vector<float> values,
                 int64_t width = kWidth) {
  m.spans = std::move(spans);
  m.values = std::move(values);
  m.header.num_spans = static_cast<uint32_t>(m.spans.size());
  m.header.row_width = width;
  return m;
}

Message ClockUpdate(WorkerId sender, int shard, Clock clock, std::vector<RowSpan> spans = {},
                    std::vector<float> values = {}, TableId table = kTable) {
  Message m = Header(MessageType::kClockUpdate, sender, shard, table);
  m.header.clock = clock;
  return WithRows(std::move(m), std::move(spans), std::move(values));
}

Message Fetch(WorkerId sender, int shard, int64_t request_id, std::vector<RowSpan> spans,
              TableId table = kTable) {
  Message m = Header(MessageType::kFetch, sender, shard, table);
  m.header.request_id = request_id;
  return WithRows(std::move(m), std::move(spans), {});
}

Message InitAdd(WorkerId sender, int shard, int64_t request_id, std::vector<RowSpan> spans,
                std::vector<float> values) {
  Message m = Header(MessageType::kInitAdd, sender, shard, kTable);
  m.header.request_id = request_id;
  return WithRows(std::move(m), std::move(spans), std::move(values));
}

// The slice of a whole-table row vector that shard `shard` owns.
std::vector<float> Slice(const std::vector<float>& table_values, int shard) {
  const RowSpan range = ShardRange(kRows, shard, kWorkers);
  return std::vector<float>(table_values.begin() + range.begin * kWidth,
                            table_values.begin() + (range.begin + range.count) * kWidth);
}

std::vector<std::unique_ptr<ServerShard>> MakeShards(UpdateRuleKind kind, const TableInfo& table = Table(),
                                                     int max_branches = 40) {
  std::vector<std::unique_ptr<ServerShard>> shards;
  for (int rank = 0; rank < kWorkers; ++rank) {
    shards.push_back(std::make_unique<ServerShard>(rank, kWorkers, Rule(kind), max_branches));
    Status status = shards.back()->AddTable(table);
    if (!status.ok()) mltuner::testing::ReportFailure(__FILE__, __LINE__, status.ToString());
  }
  return shards;
}

// Initialises every shard with `initial` (whole table) through worker 0's
// kInitAdd, then starts all workers.
void InitialiseAndStart(const std::vector<std::unique_ptr<ServerShard>>& shards,
                        const std::vector<float>& initial) {
  for (int s = 0; s < kWorkers; ++s) {
    std::vector<Message> out;
    const RowSpan range = ShardRange(kRows, s, kWorkers);
    EXPECT_OK(shards[s]->Handle(InitAdd(0, s, 1, {range}, Slice(initial, s)), &out));
    for (int w = 0; w < kWorkers; ++w) EXPECT_OK(shards[s]->Handle(Start(w, s), &out));
  }
}

// One worker's update for one clock: random values on a random subset of its
// rows (sent as per-shard spans), or nothing at all (a bare clock).
struct WorkerUpdate {
  std::vector<float> dense;  // kRows * kWidth, zeros where nothing was sent
  std::vector<Message> per_shard;
};

WorkerUpdate MakeUpdate(std::mt19937* rng, WorkerId worker, Clock clock, bool bare) {
  WorkerUpdate update;
  update.dense.assign(kRows * kWidth, 0.0f);
  for (int s = 0; s < kWorkers; ++s) {
    const RowSpan range = ShardRange(kRows, s, kWorkers);
    if (bare) {
      update.per_shard.push_back(ClockUpdate(worker, s, clock));
      continue;
    }
    // Two spans: the first row alone and the rest, so multi-span payloads
    // are exercised; values are never all zero.
    std::vector<RowSpan> spans = {{range.begin, 1}, {range.begin + 1, range.count - 1}};
    std::vector<float> values = RandomValues(rng, range.count * kWidth);
    std::copy(values.begin(), values.end(), update.dense.begin() + range.begin * kWidth);
    update.per_shard.push_back(ClockUpdate(worker, s, clock, spans, values));
  }
  return update;
}

// The whole table's values, gathered from every shard.
std::vector<float> Gather(const std::vector<std::unique_ptr<ServerShard>>& shards, BranchId branch = 0) {
  std::vector<float> all;
  for (const auto& shard : shards) {
    const std::vector<float> part = *shard->values(kTable, branch);
    all.insert(all.end(), part.begin(), part.end());
  }
  return all;
}

// Delivers every worker's update of one clock (on `branch`), the messages of
// the workers in `with_rate` carrying `rate`; the status of the first failure.
Status DeliverClock(const std::vector<std::unique_ptr<ServerShard>>& shards, std::mt19937* rng, Clock clock,
                    std::vector<float>* sum, const std::vector<WorkerId>& with_rate = {}, float rate = 0,
                    BranchId branch = 0) {
  sum->assign(kRows * kWidth, 0.0f);
  for (WorkerId worker = 0; worker < kWorkers; ++worker) {
    WorkerUpdate update = MakeUpdate(rng, worker, clock, false);
    for (size_t i = 0; i < sum->size(); ++i) (*sum)[i] += update.dense[i];
    const bool carries = std::find(with_rate.begin(), with_rate.end(), worker) != with_rate.end();
    for (int s = 0; s < kWorkers; ++s) {
      Message& m = update.per_shard[s];
      m.header.branch = branch;
      if (carries) {
        m.header.flags |= kNewLearningRate;
        m.header.learning_rate = rate;
      }
      std::vector<Message> out;
      MLT_RETURN_IF_ERROR(shards[s]->Handle(m, &out));
    }
  }
  return Status::Ok();
}

// Every worker asks every shard to fork `child` with `settings`.
Status ForkEverywhere(const std::vector<std::unique_ptr<ServerShard>>& shards, BranchId child, BranchId parent,
                      const BranchSettings& settings) {
  for (int s = 0; s < kWorkers; ++s) {
    for (WorkerId worker = 0; worker < kWorkers; ++worker) {
      Message fork = Header(MessageType::kFork, worker, s, -1);
      fork.header.branch = child;
      fork.text = EncodeBranchSettings(parent, settings);
      std::vector<Message> out;
      MLT_RETURN_IF_ERROR(shards[s]->Handle(fork, &out));
    }
  }
  return Status::Ok();
}

UpdateRuleConfig TorchSgd() {
  UpdateRuleConfig rule;
  rule.kind = UpdateRuleKind::kSgd;
  rule.learning_rate = 0.05f;
  rule.momentum = 0.9f;
  rule.weight_decay = 0.01f;
  return rule;
}

}  // namespace

TEST(AddTableRejectsLocalDuplicateAndEmptyTables) {
  ServerShard shard(0, kWorkers, Rule(UpdateRuleKind::kAdd));
  TableInfo local = Table(1);
  local.local = true;
  EXPECT_CODE(shard.AddTable(local), StatusCode::kInvalidArgument);
  EXPECT_CODE(shard.AddTable(Table(2, 0, 4)), StatusCode::kInvalidArgument);
  EXPECT_CODE(shard.AddTable(Table(3, 5, 0)), StatusCode::kInvalidArgument);
  ASSERT_OK(shard.AddTable(Table(4)));
  EXPECT_CODE(shard.AddTable(Table(4)), StatusCode::kInvalidArgument);
  EXPECT_TRUE(shard.values(1) == nullptr);
  EXPECT_TRUE(shard.values(2) == nullptr);
  ASSERT_TRUE(shard.values(4) != nullptr);
  EXPECT_EQ(shard.values(4)->size(), static_cast<size_t>(3 * kWidth));  // rows [0,3)
  const std::vector<float> zeros = *shard.values(4);
  for (float v : zeros) EXPECT_EQ(v, 0.0f);
  EXPECT_EQ(shard.global_clock(4), kNoClock);
  EXPECT_EQ(shard.global_clock(99), kNoClock);
}

TEST(DropTableForgetsATableUntilEveryWorkerIsReady) {
  ServerShard shard(0, 1, Rule(UpdateRuleKind::kAdd));
  shard.PlaceStateWhenReady(Config());
  ASSERT_OK(shard.AddTable(Table(kTable, 9, 4)));
  ASSERT_OK(shard.DropTable(kTable));
  EXPECT_CODE(shard.DropTable(kTable), StatusCode::kNotFound);
  const TableInfo again = Table();  // the id again, another shape
  ASSERT_OK(shard.AddTable(again));
  Message ready = Header(MessageType::kReady, 0, 0, -1);
  ready.header.request_id = 7;
  ready.text = EncodeTableSchema({again});  // the worker's tables: the dropped one is gone from both
  ready.header.text_bytes = static_cast<uint32_t>(ready.text.size());
  std::vector<Message> replies;
  ASSERT_OK(shard.Handle(ready, &replies));
  ASSERT_EQ(replies.size(), size_t{1});
  EXPECT_TRUE(replies[0].type() == MessageType::kAck);
  EXPECT_CODE(shard.DropTable(kTable), StatusCode::kOutOfOrder);
  ASSERT_TRUE(shard.values(kTable) != nullptr);
  EXPECT_EQ(shard.values(kTable)->size(), static_cast<size_t>(kRows * kWidth));
}

TEST(InitAddAccumulatesAndAcks) {
  std::mt19937 rng(11);
  ServerShard shard(1, kWorkers, Rule(UpdateRuleKind::kAdd));  // rows [3,5)
  ASSERT_OK(shard.AddTable(Table()));
  const std::vector<float> a = RandomValues(&rng, 2 * kWidth);
  const std::vector<float> b = RandomValues(&rng, kWidth);
  std::vector<Message> out;
  ASSERT_OK(shard.Handle(InitAdd(0, 1, 41, {{3, 2}}, a), &out));
  ASSERT_OK(shard.Handle(InitAdd(2, 1, 42, {{4, 1}}, b), &out));
  ASSERT_EQ(out.size(), size_t{2});
  EXPECT_TRUE(out[0].type() == MessageType::kAck);
  EXPECT_EQ(out[0].header.request_id, 41);
  EXPECT_EQ(out[0].header.receiver, 0);
  EXPECT_EQ(out[1].header.request_id, 42);
  EXPECT_EQ(out[1].header.receiver, 2);
  const std::vector<float> values = *shard.values(kTable);
  for (int64_t i = 0; i < kWidth; ++i) EXPECT_EQ(values[i], a[i]);
  for (int64_t i = 0; i < kWidth; ++i) EXPECT_EQ(values[kWidth + i], a[kWidth + i] + b[i]);
}

TEST(StartPushesInitialRowsWhenTheLastWorkerStarts) {
  std::mt19937 rng(12);
  ServerShard shard(2, kWorkers, Rule(UpdateRuleKind::kAdd));  // rows [5,7)
  ASSERT_OK(shard.AddTable(Table()));
  ASSERT_OK(shard.AddTable(Table(kTable + 1, 3, 2)));  // 3 rows over 3 shards: row [2,3)
  const std::vector<float> initial = RandomValues(&rng, 2 * kWidth);
  std::vector<Message> out;
  ASSERT_OK(shard.Handle(InitAdd(1, 2, 7, {{5, 2}}, initial), &out));
  out.clear();
  ASSERT_OK(shard.Handle(Start(1, 2), &out));
  ASSERT_OK(shard.Handle(Start(0, 2), &out));
  EXPECT_TRUE(out.empty());
  EXPECT_EQ(shard.global_clock(kTable), kNoClock);
  ASSERT_OK(shard.Handle(Start(2, 2), &out));
  EXPECT_EQ(shard.global_clock(kTable), kInitClock);
  EXPECT_EQ(shard.global_clock(kTable + 1), kInitClock);
  ASSERT_EQ(out.size(), size_t{2 * kWorkers});  // both tables, every client
  for (size_t i = 0; i < out.size(); ++i) {
    const Message& rows = out[i];
    const bool first_table = i < kWorkers;
    EXPECT_TRUE(rows.type() == MessageType::kRows);
    EXPECT_EQ(rows.header.sender, 2);
    EXPECT_EQ(rows.header.receiver, static_cast<int>(i % kWorkers));
    EXPECT_EQ(rows.header.clock, kInitClock);
    EXPECT_EQ(rows.header.table, first_table ? kTable : kTable + 1);
    ASSERT_EQ(rows.spans.size(), size_t{1});
    EXPECT_EQ(rows.spans[0].begin, first_table ? 5 : 2);
    if (first_table) EXPECT_TRUE(HostValues(rows) == initial);
  }
}

TEST(ShardWithoutRowsStillPushesEmptyRows) {
  ServerShard shard(2, kWorkers, Rule(UpdateRuleKind::kDampedMomentum));
  ASSERT_OK(shard.AddTable(Table(kTable, 2, kWidth)));  // shard 2 of 3 owns no row
  EXPECT_TRUE(shard.values(kTable)->empty());
  std::vector<Message> out;
  for (int w = 0; w < kWorkers; ++w) ASSERT_OK(shard.Handle(Start(w, 2), &out));
  for (int w = 0; w < kWorkers; ++w) ASSERT_OK(shard.Handle(ClockUpdate(w, 2, 0), &out));
  ASSERT_EQ(out.size(), size_t{2 * kWorkers});
  for (const Message& rows : out) {
    EXPECT_TRUE(rows.type() == MessageType::kRows);
    EXPECT_TRUE(rows.spans.empty());
    EXPECT_TRUE(rows.num_values() == 0);
  }
  EXPECT_EQ(out.back().header.clock, 0);
}

// BSP: after clock c every shard holds the initial values with the rule
// applied once per clock to the mean of that clock's updates, computed here
// in double from the formulas; pushes appear exactly when the last worker
// finishes a clock. Clock 2 is bare for everyone: a zero-gradient step that
// momentum still takes.
void RunBsp(UpdateRuleKind kind) {
  std::mt19937 rng(21 + static_cast<int>(kind));
  auto shards = MakeShards(kind);
  const std::vector<float> initial = RandomValues(&rng, kRows * kWidth);
  InitialiseAndStart(shards, initial);

  const UpdateRuleConfig config = Rule(kind);
  std::vector<double> w(initial.begin(), initial.end());
  std::vector<double> h(w.size(), 0.0);
  for (Clock clock = 0; clock < 5; ++clock) {
    std::vector<double> sum(w.size(), 0.0);
    for (WorkerId worker = 0; worker < kWorkers; ++worker) {
      const bool bare = clock == 2 || (clock == 3 && worker == 1);
      WorkerUpdate update = MakeUpdate(&rng, worker, clock, bare);
      for (size_t i = 0; i < sum.size(); ++i) sum[i] += update.dense[i];
      for (int s = 0; s < kWorkers; ++s) {
        std::vector<Message> out;
        ASSERT_OK(shards[s]->Handle(update.per_shard[s], &out));
        const bool last = worker == kWorkers - 1;
        EXPECT_EQ(out.size(), last ? size_t{kWorkers} : size_t{0});
        EXPECT_EQ(shards[s]->global_clock(kTable), last ? clock : clock - 1);
        for (const Message& rows : out) {
          EXPECT_TRUE(rows.type() == MessageType::kRows);
          EXPECT_EQ(rows.header.clock, clock);
          EXPECT_TRUE(HostValues(rows) == *shards[s]->values(kTable));
        }
      }
    }
    for (size_t i = 0; i < w.size(); ++i) {
      if (kind == UpdateRuleKind::kAdd) {
        w[i] += sum[i];
      } else {
        const double g = sum[i] / kWorkers;
        h[i] = (1 - double{config.momentum}) * g + double{config.momentum} * h[i];
        w[i] -= double{config.learning_rate} * h[i];
      }
    }
    for (int s = 0; s < kWorkers; ++s) {
      const RowSpan range = ShardRange(kRows, s, kWorkers);
      const std::vector<float> values = *shards[s]->values(kTable);
      for (int64_t i = 0; i < range.count * kWidth; ++i) {
        EXPECT_NEAR(values[i], w[range.begin * kWidth + i], 1e-5);
      }
    }
  }
}

TEST(BspAddAppliesTheSumOncePerClock) { RunBsp(UpdateRuleKind::kAdd); }
TEST(BspMomentumStepsOncePerClockIncludingBareClocks) { RunBsp(UpdateRuleKind::kDampedMomentum); }

// The same updates delivered in random interleavings (workers running clocks
// ahead of each other, shards seeing different orders) give bit-identical
// values to delivery in worker order.
void RunArrivalOrder(UpdateRuleKind kind) {
  std::mt19937 rng(31);
  const std::vector<float> initial = RandomValues(&rng, kRows * kWidth);
  const int clocks = 6;
  // queue[w] holds worker w's messages to all shards in clock order.
  std::vector<std::deque<Message>> queue(kWorkers);
  for (Clock clock = 0; clock < clocks; ++clock) {
    for (WorkerId worker = 0; worker < kWorkers; ++worker) {
      WorkerUpdate update = MakeUpdate(&rng, worker, clock, clock == 4 && worker == 0);
      for (Message& m : update.per_shard) queue[worker].push_back(std::move(m));
    }
  }

  auto ordered = MakeShards(kind);
  InitialiseAndStart(ordered, initial);
  for (Clock clock = 0; clock < clocks; ++clock) {
    for (WorkerId worker = 0; worker < kWorkers; ++worker) {
      for (int s = 0; s < kWorkers; ++s) {
        std::vector<Message> out;
        ASSERT_OK(ordered[s]->Handle(queue[worker][clock * kWorkers + s], &out));
      }
    }
  }

  for (int trial = 0; trial < 10; ++trial) {
    auto shuffled = MakeShards(kind);
    InitialiseAndStart(shuffled, initial);
    std::vector<std::deque<Message>> remaining = queue;
    size_t pushes = 0;
    for (;;) {
      std::vector<int> ready;
      for (int w = 0; w < kWorkers; ++w) if (!remaining[w].empty()) ready.push_back(w);
      if (ready.empty()) break;
      const int worker = ready[rng() % ready.size()];
      Message m = std::move(remaining[worker].front());
      remaining[worker].pop_front();
      std::vector<Message> out;
      ASSERT_OK(shuffled[m.header.receiver]->Handle(m, &out));
      pushes += out.size();
    }
    EXPECT_EQ(pushes, size_t{clocks * kWorkers * kWorkers});
    for (int s = 0; s < kWorkers; ++s) {
      EXPECT_EQ(shuffled[s]->global_clock(kTable), clocks - 1);
      EXPECT_TRUE(*shuffled[s]->values(kTable) == *ordered[s]->values(kTable));
      EXPECT_TRUE(*shuffled[s]->values(kTable) != Slice(initial, s));  // something happened
    }
  }
}

// A shard's part of a whole-shard update message: the spans and values that
// fall in `part`, with the same header (a bare message when none do).
Message PartOf(const Message& whole, const RowSpan& part) {
  Message m = Header(whole.type(), whole.header.sender, whole.header.receiver, whole.header.table);
  m.header.clock = whole.header.clock;
  std::vector<RowSpan> spans;
  std::vector<float> values;
  const float* source = whole.values.data();
  for (const RowSpan& span : whole.spans) {
    const int64_t begin = std::max(span.begin, part.begin);
    const int64_t end = std::min(span.begin + span.count, part.begin + part.count);
    if (begin < end) {
      spans.push_back({begin, end - begin});
      values.insert(values.end(), source + (begin - span.begin) * kWidth, source + (end - span.begin) * kWidth);
    }
    source += span.count * kWidth;
  }
  return WithRows(std::move(m), std::move(spans), std::move(values));
}

// A table whose clock moves in parts of one row (TableInfo::part_bytes):
// each worker sends each shard its parts in order, interleaved with the
// other workers' at random. Each part is applied once every worker's is in
// and pushed at once, stamped with its clock; the values equal those of
// whole-shard updates bit for bit (Adam: its step count moves once a clock).
void RunInParts(UpdateRuleKind kind) {
  std::mt19937 rng(57);
  const std::vector<float> initial = RandomValues(&rng, kRows * kWidth);
  TableInfo in_parts = Table();
  in_parts.part_bytes = kWidth * sizeof(float);  // one row a part: 3, 2 and 2 parts
  const int clocks = 5;
  std::vector<std::deque<Message>> whole_queue(kWorkers), part_queue(kWorkers);
  for (Clock clock = 0; clock < clocks; ++clock) {
    for (WorkerId worker = 0; worker < kWorkers; ++worker) {
      WorkerUpdate update = MakeUpdate(&rng, worker, clock, clock == 3 && worker == 2);
      for (int s = 0; s < kWorkers; ++s) {
        for (const RowSpan& part : ShardParts(in_parts, s, kWorkers)) {
          part_queue[worker].push_back(PartOf(update.per_shard[s], part));
        }
        whole_queue[worker].push_back(std::move(update.per_shard[s]));
      }
    }
  }
  auto whole = MakeShards(kind);
  InitialiseAndStart(whole, initial);
  for (std::deque<Message>& messages : whole_queue) {
    for (const Message& m : messages) {
      std::vector<Message> out;
      ASSERT_OK(whole[m.header.receiver]->Handle(m, &out));
    }
  }
  for (int trial = 0; trial < 5; ++trial) {
    auto shards = MakeShards(kind, in_parts);
    InitialiseAndStart(shards, initial);
    std::vector<std::deque<Message>> remaining = part_queue;
    size_t pushes = 0;
    for (;;) {
      std::vector<int> ready;
      for (int w = 0; w < kWorkers; ++w) if (!remaining[w].empty()) ready.push_back(w);
      if (ready.empty()) break;
      Message m = std::move(remaining[ready[rng() % ready.size()]].front());
      remaining[m.header.sender].pop_front();
      const int s = m.header.receiver;
      const Clock before = shards[s]->global_clock(kTable);
      std::vector<Message> out;
      ASSERT_OK(shards[s]->Handle(m, &out));
      pushes += out.size();
      for (const Message& rows : out) {  // one part's rows, of the clock this message finished
        ASSERT_EQ(rows.spans.size(), size_t{1});
        EXPECT_EQ(rows.spans[0].count, 1);
        EXPECT_EQ(rows.header.clock, m.header.clock);
      }
      // The global clock moves only once the shard's last part is in.
      const RowSpan range = ShardRange(kRows, s, kWorkers);
      const bool last_part = !out.empty() && out[0].spans[0].begin == range.begin + range.count - 1;
      EXPECT_EQ(shards[s]->global_clock(kTable), last_part ? m.header.clock : before);
    }
    EXPECT_EQ(pushes, size_t{clocks * kRows * kWorkers});  // every part of every clock, to every worker
    for (int s = 0; s < kWorkers; ++s) {
      EXPECT_EQ(shards[s]->global_clock(kTable), clocks - 1);
      EXPECT_TRUE(*shards[s]->values(kTable) == *whole[s]->values(kTable));
    }
  }
}

TEST(AClockInPartsEqualsAWholeOneWithAdd) { RunInParts(UpdateRuleKind::kAdd); }
TEST(AClockInPartsEqualsAWholeOneWithAdam) { RunInParts(UpdateRuleKind::kAdam); }

TEST(APartOutOfOrderIsRefusedWithoutChange) {
  TableInfo in_parts = Table();
  in_parts.part_bytes = kWidth * sizeof(float);
  auto shards = MakeShards(UpdateRuleKind::kAdd, in_parts);
  std::mt19937 rng(5);
  const std::vector<float> initial = RandomValues(&rng, kRows * kWidth);
  InitialiseAndStart(shards, initial);
  // Shard 0 owns rows 0-2 in three parts: worker 0's first message of clock 0
  // must be part 0 (row 0); rows of part 1 are refused.
  std::vector<Message> out;
  EXPECT_CODE(shards[0]->Handle(ClockUpdate(0, 0, 0, {{1, 1}}, std::vector<float>(kWidth, 1.0f)), &out),
              StatusCode::kInvalidArgument);
  EXPECT_CODE(shards[0]->Handle(ClockUpdate(0, 0, 1), &out), StatusCode::kOutOfOrder);  // a clock ahead
  EXPECT_TRUE(out.empty());
  EXPECT_TRUE(*shards[0]->values(kTable) == Slice(initial, 0));
  // In order, the three parts go through.
  for (int64_t row = 0; row < 3; ++row) {
    ASSERT_OK(shards[0]->Handle(ClockUpdate(0, 0, 0, {{row, 1}}, std::vector<float>(kWidth, 1.0f)), &out));
  }
  EXPECT_CODE(shards[0]->Handle(ClockUpdate(0, 0, 0), &out), StatusCode::kOutOfOrder);  // a fourth part
}

TEST(ArrivalOrderDoesNotChangeAddResults) { RunArrivalOrder(UpdateRuleKind::kAdd); }
TEST(ArrivalOrderDoesNotChangeAdamResults) { RunArrivalOrder(UpdateRuleKind::kAdam); }

TEST(FetchReturnsCurrentValuesOfSpans) {
  std::mt19937 rng(41);
  auto shards = MakeShards(UpdateRuleKind::kAdd);
  const std::vector<float> initial = RandomValues(&rng, kRows * kWidth);
  InitialiseAndStart(shards, initial);
  std::vector<Message> out;
  ASSERT_OK(shards[0]->Handle(Fetch(2, 0, 77, {{2, 1}, {0, 2}}), &out));
  ASSERT_EQ(out.size(), size_t{1});
  const Message& reply = out[0];
  EXPECT_TRUE(reply.type() == MessageType::kFetchReply);
  EXPECT_EQ(reply.header.receiver, 2);
  EXPECT_EQ(reply.header.request_id, 77);
  EXPECT_EQ(reply.header.row_width, kWidth);
  ASSERT_EQ(reply.spans.size(), size_t{2});
  std::vector<float> want(initial.begin() + 2 * kWidth, initial.begin() + 3 * kWidth);
  want.insert(want.end(), initial.begin(), initial.begin() + 2 * kWidth);
  EXPECT_TRUE(reply.values == want);
}

// A shard that saw a valid history, to throw bad messages at: rank 1 owns
// rows [3,5); every worker has started and finished clock 0.
struct BadMessageFixture {
  std::mt19937 rng{51};
  ServerShard shard{1, kWorkers, Rule(UpdateRuleKind::kDampedMomentum)};
  std::vector<float> before;

  bool Setup() {
    if (!shard.AddTable(Table()).ok()) return false;
    std::vector<Message> out;
    if (!shard.Handle(InitAdd(0, 1, 1, {{3, 2}}, RandomValues(&rng, 2 * kWidth)), &out).ok()) return false;
    for (int w = 0; w < kWorkers; ++w) {
      if (!shard.Handle(Start(w, 1), &out).ok()) return false;
      if (!shard.Handle(ClockUpdate(w, 1, 0, {{3, 2}}, RandomValues(&rng, 2 * kWidth)), &out).ok()) return false;
    }
    before = *shard.values(kTable);
    return shard.global_clock(kTable) == 0;
  }
  // Handles `m`, expects `code`, and checks that nothing changed and only an
  // error reply (if `error_reply`) was produced.
  void ExpectRejected(const Message& m, StatusCode code, bool error_reply = false) {
    std::vector<Message> out;
    EXPECT_CODE(shard.Handle(m, &out), code);
    EXPECT_TRUE(*shard.values(kTable) == before);
    EXPECT_EQ(shard.global_clock(kTable), 0);
    ASSERT_EQ(out.size(), error_reply ? size_t{1} : size_t{0});
    if (error_reply) {
      EXPECT_TRUE(out[0].type() == MessageType::kError);
      EXPECT_EQ(out[0].header.receiver, m.header.sender);
      EXPECT_EQ(out[0].header.request_id, m.header.request_id);
      EXPECT_TRUE(!out[0].text.empty());
      EXPECT_EQ(out[0].header.text_bytes, static_cast<uint32_t>(out[0].text.size()));
    }
  }
};

TEST(BadClockUpdatesAreRejectedWithoutChange) {
  BadMessageFixture f;
  ASSERT_TRUE(f.Setup());
  const auto two_rows = [&] { return RandomValues(&f.rng, 2 * kWidth); };
  f.ExpectRejected(ClockUpdate(0, 1, 2, {{3, 2}}, two_rows()), StatusCode::kOutOfOrder);  // skips 1
  f.ExpectRejected(ClockUpdate(0, 1, 0, {{3, 2}}, two_rows()), StatusCode::kOutOfOrder);  // repeats 0
  f.ExpectRejected(ClockUpdate(0, 1, 1, {{3, 2}}, two_rows(), 99), StatusCode::kNotFound);
  f.ExpectRejected(ClockUpdate(0, 1, 1, {{2, 2}}, two_rows()), StatusCode::kInvalidArgument);
  f.ExpectRejected(ClockUpdate(0, 1, 1, {{4, 2}}, two_rows()), StatusCode::kInvalidArgument);
  f.ExpectRejected(ClockUpdate(0, 1, 1, {{4, -1}}, {}), StatusCode::kInvalidArgument);
  f.ExpectRejected(ClockUpdate(0, 1, 1, {{3, 2}}, RandomValues(&f.rng, 2 * kWidth - 1)),
                   StatusCode::kInvalidArgument);  // wrong values size
  Message wrong_width = ClockUpdate(0, 1, 1, {{3, 2}}, RandomValues(&f.rng, 2 * (kWidth + 1)));
  wrong_width.header.row_width = kWidth + 1;
  f.ExpectRejected(wrong_width, StatusCode::kInvalidArgument);
  f.ExpectRejected(ClockUpdate(kWorkers, 1, 1, {{3, 2}}, two_rows()), StatusCode::kInvalidArgument);
  f.ExpectRejected(ClockUpdate(-1, 1, 1, {{3, 2}}, two_rows()), StatusCode::kInvalidArgument);

  // None of the rejected updates was kept, not even for a later clock: bare
  // clocks 1 and 2 under momentum are zero-gradient steps from the state
  // after clock 0, the same as on a twin shard that never saw the bad
  // messages. Worker 0 also repeats clock 1 with values while clock 1 is
  // still open.
  BadMessageFixture twin;
  ASSERT_TRUE(twin.Setup());
  ASSERT_TRUE(twin.before == f.before);
  for (Clock clock = 1; clock <= 2; ++clock) {
    for (int w = 0; w < kWorkers; ++w) {
      std::vector<Message> out;
      ASSERT_OK(f.shard.Handle(ClockUpdate(w, 1, clock), &out));
      ASSERT_OK(twin.shard.Handle(ClockUpdate(w, 1, clock), &out));
      if (clock == 1 && w == 0) f.ExpectRejected(ClockUpdate(0, 1, 1, {{3, 2}}, two_rows()), StatusCode::kOutOfOrder);
    }
  }
  EXPECT_EQ(f.shard.global_clock(kTable), 2);
  EXPECT_TRUE(*f.shard.values(kTable) == *twin.shard.values(kTable));
  EXPECT_TRUE(*f.shard.values(kTable) != f.before);  // momentum kept moving
}

// Config::check_finite: a clock update holding NaN or an infinity, in host
// values or in a device buffer, is refused before any of it is kept, naming
// the table, the clock and the worker; the same worker's finite update for
// that clock is then accepted, and the result equals a shard that never saw
// the bad ones. Without the check the NaN is applied (as before).
TEST(CheckFiniteRefusesNonFiniteUpdatesNamingTableAndWorker) {
  const float nan = std::nanf(""), inf = std::numeric_limits<float>::infinity();
  BadMessageFixture f;
  f.shard.set_check_finite(true);
  ASSERT_TRUE(f.Setup());
  const std::vector<float> good = RandomValues(&f.rng, 2 * kWidth);
  for (const float bad : {nan, inf, -inf}) {
    std::vector<float> values = good;
    values[5] = bad;
    f.ExpectRejected(ClockUpdate(2, 1, 1, {{3, 2}}, values), StatusCode::kNonFinite);
  }
  // A device payload (as from a worker of the same process).
  DeviceBufferPool pool(std::shared_ptr<Device>(NewCpuDevice()), 0);
  std::shared_ptr<DeviceBuffer> on_device;
  ASSERT_OK(pool.Acquire(good.size(), Stream::kWriteback, &on_device));
  std::copy(good.begin(), good.end(), on_device->data);
  on_device->data[0] = nan;
  on_device->data[7] = -inf;
  Message device_update = ClockUpdate(2, 1, 1, {{3, 2}}, {});
  device_update.device_values = on_device;
  std::vector<Message> out;
  const Status refused = f.shard.Handle(device_update, &out);
  EXPECT_CODE(refused, StatusCode::kNonFinite);
  EXPECT_TRUE(out.empty());
  for (const char* part : {"table 't5' (id 5)", "branch 0, clock 1", "worker 2's update", "2 of 8 values"}) {
    if (refused.message().find(part) == std::string::npos) {
      mltuner::testing::ReportFailure(__FILE__, __LINE__, "'" + std::string(part) + "' not in: " + refused.message());
    }
  }
  EXPECT_TRUE(*f.shard.values(kTable) == f.before);

  BadMessageFixture twin;
  ASSERT_TRUE(twin.Setup());
  for (int w = 0; w < kWorkers; ++w) {
    ASSERT_OK(f.shard.Handle(ClockUpdate(w, 1, 1, {{3, 2}}, good), &out));
    ASSERT_OK(twin.shard.Handle(ClockUpdate(w, 1, 1, {{3, 2}}, good), &out));
  }
  EXPECT_EQ(f.shard.global_clock(kTable), 1);
  EXPECT_TRUE(*f.shard.values(kTable) == *twin.shard.values(kTable));

  // Off (the twin): accepted, and the parameters become NaN.
  std::vector<float> values = good;
  values[0] = nan;
  for (int w = 0; w < kWorkers; ++w) {
    ASSERT_OK(twin.shard.Handle(ClockUpdate(w, 1, 2, {{3, 2}}, w == 0 ? values : good), &out));
  }
  EXPECT_TRUE(std::isnan((*twin.shard.values(kTable))[0]));
}

TEST(BadFetchAndInitAddGetErrorReplies) {
  BadMessageFixture f;
  ASSERT_TRUE(f.Setup());
  f.ExpectRejected(Fetch(1, 1, 5, {{0, 1}}), StatusCode::kInvalidArgument, /*error_reply=*/true);
  f.ExpectRejected(Fetch(1, 1, 6, {{4, 2}}), StatusCode::kInvalidArgument, true);
  f.ExpectRejected(Fetch(1, 1, 7, {{3, 1}}, 99), StatusCode::kNotFound, true);
  f.ExpectRejected(InitAdd(2, 1, 8, {{3, 1}}, RandomValues(&f.rng, kWidth)), StatusCode::kOutOfOrder, true);
  f.ExpectRejected(InitAdd(2, 1, 9, {{5, 1}}, RandomValues(&f.rng, kWidth)), StatusCode::kInvalidArgument, true);
}

TEST(InitAddBeforeStartRejectsBadPayloadWithoutChange) {
  std::mt19937 rng(61);
  ServerShard shard(0, kWorkers, Rule(UpdateRuleKind::kAdd));
  ASSERT_OK(shard.AddTable(Table()));
  std::vector<Message> out;
  ASSERT_OK(shard.Handle(InitAdd(0, 0, 1, {{0, 3}}, RandomValues(&rng, 3 * kWidth)), &out));
  const std::vector<float> before = *shard.values(kTable);
  out.clear();
  EXPECT_CODE(shard.Handle(InitAdd(1, 0, 2, {{0, 3}}, RandomValues(&rng, 3 * kWidth + 1)), &out),
              StatusCode::kInvalidArgument);
  Message wrong_width = InitAdd(1, 0, 3, {{0, 1}}, RandomValues(&rng, kWidth));
  wrong_width.header.row_width = kWidth - 1;
  EXPECT_CODE(shard.Handle(wrong_width, &out), StatusCode::kInvalidArgument);
  EXPECT_EQ(out.size(), size_t{2});
  for (const Message& reply : out) EXPECT_TRUE(reply.type() == MessageType::kError);
  EXPECT_TRUE(*shard.values(kTable) == before);
}

TEST(StartTwiceAndClockBeforeStartAreOutOfOrder) {
  std::mt19937 rng(71);
  ServerShard shard(0, kWorkers, Rule(UpdateRuleKind::kAdd));
  ASSERT_OK(shard.AddTable(Table()));
  std::vector<Message> out;
  ASSERT_OK(shard.Handle(InitAdd(0, 0, 1, {{0, 3}}, RandomValues(&rng, 3 * kWidth)), &out));
  const std::vector<float> before = *shard.values(kTable);
  out.clear();
  EXPECT_CODE(shard.Handle(ClockUpdate(0, 0, 0, {{0, 1}}, RandomValues(&rng, kWidth)), &out),
              StatusCode::kOutOfOrder);
  EXPECT_CODE(shard.Handle(ClockUpdate(0, 0, kInitClock), &out), StatusCode::kOutOfOrder);
  ASSERT_OK(shard.Handle(Start(0, 0), &out));
  EXPECT_CODE(shard.Handle(Start(0, 0), &out), StatusCode::kOutOfOrder);
  EXPECT_CODE(shard.Handle(Start(kWorkers, 0), &out), StatusCode::kInvalidArgument);
  EXPECT_TRUE(out.empty());
  EXPECT_TRUE(*shard.values(kTable) == before);
  EXPECT_EQ(shard.global_clock(kTable), kNoClock);
}

TEST(ClientBoundMessagesAreRejected) {
  ServerShard shard(0, kWorkers, Rule(UpdateRuleKind::kAdd));
  ASSERT_OK(shard.AddTable(Table()));
  for (MessageType type : {MessageType::kRows, MessageType::kFetchReply, MessageType::kAck,
                           MessageType::kError}) {
    std::vector<Message> out;
    EXPECT_CODE(shard.Handle(Header(type, 0, 0, kTable), &out), StatusCode::kInvalidArgument);
    EXPECT_TRUE(out.empty());
  }
  Message unknown = Header(MessageType::kStart, 0, 0, kTable);
  unknown.header.type = 99;
  std::vector<Message> out;
  EXPECT_CODE(shard.Handle(unknown, &out), StatusCode::kInvalidArgument);
  EXPECT_EQ(shard.global_clock(kTable), kNoClock);
}

// A table created with its own rule uses it, not the shard's default, and
// names it in the schema every worker must agree on.
TEST(TableWithItsOwnRuleUsesIt) {
  TableInfo info = Table();
  info.update_rule = TorchSgd();
  auto shards = MakeShards(UpdateRuleKind::kAdd, info);
  std::mt19937 rng(61);
  const std::vector<float> initial = RandomValues(&rng, kRows * kWidth);
  InitialiseAndStart(shards, initial);
  mltuner::testing::ReferenceRule reference(TorchSgd(), initial);
  std::vector<float> sum;
  for (Clock clock = 0; clock < 5; ++clock) {
    ASSERT_OK(DeliverClock(shards, &rng, clock, &sum));
    reference.Step(sum, kWorkers);
  }
  const std::vector<float> got = Gather(shards);
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], reference.values()[i], 1e-5);
  const std::string schema = DescribeTables({info});
  EXPECT_TRUE(schema.find("sgd lr=0.0500000007 momentum=0.899999976") != std::string::npos);
  EXPECT_TRUE(DescribeTables({Table()}).find("sgd") == std::string::npos);
  EXPECT_TRUE(EncodeTableSchema({info}) != EncodeTableSchema({Table()}));
}

// A rate carried by every worker's update of clock 2 is used from clock 2 on.
TEST(NewLearningRateTakesEffectAtItsClock) {
  TableInfo info = Table();
  info.update_rule = TorchSgd();
  auto shards = MakeShards(UpdateRuleKind::kAdd, info);
  std::mt19937 rng(62);
  const std::vector<float> initial = RandomValues(&rng, kRows * kWidth);
  InitialiseAndStart(shards, initial);
  mltuner::testing::ReferenceRule reference(TorchSgd(), initial);
  std::vector<float> sum;
  for (Clock clock = 0; clock < 5; ++clock) {
    if (clock == 2) {
      ASSERT_OK(DeliverClock(shards, &rng, clock, &sum, {0, 1, 2}, 0.004f));
      reference.set_learning_rate(0.004f);
    } else {
      ASSERT_OK(DeliverClock(shards, &rng, clock, &sum));
    }
    reference.Step(sum, kWorkers);
  }
  const std::vector<float> got = Gather(shards);
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], reference.values()[i], 1e-5);
}

// A clock that any worker's updates mark kSkipStep (a mixed-precision
// overflow) changes neither values nor optimizer state, Adam's step count
// included: the result is the reference rule stepped on the other clocks.
// The clock still finishes and its rows are pushed.
TEST(ASkippedStepLeavesValuesAndOptimizerStateAsTheyWere) {
  TableInfo info = Table();
  UpdateRuleConfig adam = Rule(UpdateRuleKind::kAdam);
  adam.weight_decay = 0.01f;
  info.update_rule = adam;
  auto shards = MakeShards(UpdateRuleKind::kAdd, info);
  std::mt19937 rng(64);
  const std::vector<float> initial = RandomValues(&rng, kRows * kWidth);
  InitialiseAndStart(shards, initial);
  mltuner::testing::ReferenceRule reference(adam, initial);
  // clock -> the workers that mark it skipped
  const std::map<Clock, std::vector<WorkerId>> skipped = {{1, {1}}, {3, {0, 1, 2}}};
  for (Clock clock = 0; clock < 6; ++clock) {
    std::vector<float> sum(kRows * kWidth, 0.0f);
    const auto marks = skipped.find(clock);
    size_t pushes = 0;
    for (WorkerId worker = 0; worker < kWorkers; ++worker) {
      WorkerUpdate update = MakeUpdate(&rng, worker, clock, false);
      for (size_t i = 0; i < sum.size(); ++i) sum[i] += update.dense[i];
      const bool marked = marks != skipped.end() &&
                          std::count(marks->second.begin(), marks->second.end(), worker) != 0;
      for (int s = 0; s < kWorkers; ++s) {
        Message& m = update.per_shard[s];
        if (marked) m.header.flags |= kSkipStep;
        std::vector<Message> out;
        ASSERT_OK(shards[s]->Handle(m, &out));
        pushes += out.size();
      }
    }
    EXPECT_EQ(pushes, static_cast<size_t>(kWorkers * kWorkers));  // every shard pushed to every worker
    if (marks == skipped.end()) reference.Step(sum, kWorkers);
    for (const auto& shard : shards) EXPECT_EQ(shard->global_clock(kTable), clock);
  }
  const std::vector<float> got = Gather(shards);
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], reference.values()[i], 1e-5);
}

TEST(WorkersThatDisagreeOnTheRateFailTheClock) {
  TableInfo info = Table();
  info.update_rule = TorchSgd();
  auto shards = MakeShards(UpdateRuleKind::kAdd, info);
  std::mt19937 rng(63);
  InitialiseAndStart(shards, RandomValues(&rng, kRows * kWidth));
  std::vector<float> sum;
  const Status status = DeliverClock(shards, &rng, 0, &sum, {0, 2}, 0.01f);
  EXPECT_CODE(status, StatusCode::kInvalidArgument);
  EXPECT_TRUE(status.message().find("worker 1: kept 0.05") != std::string::npos);
}

// A fork copies the parent's values and optimizer state; where they live in
// host memory (here: the CPU backend) a copy the host cannot hold is refused
// with the sizes, every worker is told, and nothing of it stays allocated.
TEST(AForkTheHostCannotHoldIsRefusedWithTheSizes) {
  auto shards = MakeShards(UpdateRuleKind::kDampedMomentum);
  std::mt19937 rng(66);
  InitialiseAndStart(shards, RandomValues(&rng, kRows * kWidth));
  const int64_t allocated = shards[0]->state_bytes_allocated();
  const int64_t need = allocated;  // one branch: values and momentum of shard 0's rows
  ASSERT_TRUE(need > 0);
  for (auto& shard : shards) {
    shard->set_host_memory_available([need] { return HostHeadroom{need - 1, "a test's limit"}; });
  }
  BranchSettings settings;
  settings.training = true;
  std::vector<Message> replies;
  for (WorkerId worker = 0; worker < kWorkers; ++worker) {
    Message fork = Header(MessageType::kFork, worker, 0, -1);
    fork.header.branch = 1;
    fork.header.request_id = 100 + worker;
    fork.text = EncodeBranchSettings(0, settings);
    const Status status = shards[0]->Handle(fork, &replies);
    if (worker + 1 < kWorkers) {
      ASSERT_OK(status);  // waits for the other workers' requests
    } else {
      EXPECT_CODE(status, StatusCode::kResourceExhausted);
      EXPECT_TRUE(status.message().find("needs " + std::to_string(need) + " bytes of host memory, but only " +
                                        std::to_string(need - 1) + " are available (a test's limit)") !=
                  std::string::npos);
    }
  }
  ASSERT_EQ(replies.size(), size_t{kWorkers});
  for (const Message& reply : replies) {
    EXPECT_TRUE(reply.type() == MessageType::kError);
    EXPECT_TRUE(reply.text.find("cannot fork branch 1 from branch 0") != std::string::npos);
  }
  EXPECT_EQ(shards[0]->state_bytes_allocated(), allocated);
  EXPECT_TRUE(shards[0]->values(kTable, 1) == nullptr);
  // Exactly enough: the fork goes ahead, on every shard.
  for (auto& shard : shards) {
    shard->set_host_memory_available([need] { return HostHeadroom{need, "a test's limit"}; });
  }
  ASSERT_OK(ForkEverywhere(shards, 1, 0, settings));
  EXPECT_EQ(shards[0]->state_bytes_allocated(), 2 * allocated);
  EXPECT_TRUE(Gather(shards, 1) == Gather(shards, 0));
}

// Param groups of different rates (one at 0, as a part frozen until later)
// keep their ratio on a branch forked with keep_rate_ratios: the branch's
// rate is its fastest table's (an add table, which has no rate, aside).
// A chain of such forks rounds once. Without it, or where every rate is 0,
// every table takes the branch's rate.
TEST(AForkThatKeepsRateRatiosScalesEveryTableWithTheFastest) {
  const std::vector<float> rates = {0.1f, 0.025f, 0.0f, 0.7f};  // the last: an add table's
  std::vector<std::unique_ptr<ServerShard>> shards;
  for (int rank = 0; rank < kWorkers; ++rank) {
    shards.push_back(std::make_unique<ServerShard>(rank, kWorkers, Rule(UpdateRuleKind::kSgd), 40));
    for (TableId id = 0; id < static_cast<TableId>(rates.size()); ++id) {
      TableInfo info = Table(id);
      info.update_rule = Rule(id == 3 ? UpdateRuleKind::kAdd : UpdateRuleKind::kSgd);
      info.update_rule->learning_rate = rates[static_cast<size_t>(id)];
      ASSERT_OK(shards.back()->AddTable(info));
    }
  }
  const auto fork = [&](BranchId child, BranchId parent, float rate, bool ratios) {
    BranchSettings settings;
    settings.learning_rate = rate;
    settings.keep_rate_ratios = ratios;
    return ForkEverywhere(shards, child, parent, settings);
  };
  ASSERT_OK(fork(1, 0, 0.5f, true));
  ASSERT_OK(fork(2, 1, 0.3f, true));  // from a forked branch: the same ratios
  ASSERT_OK(fork(3, 0, 0.5f, false));
  ASSERT_OK(fork(4, 0, 0.0f, false));
  ASSERT_OK(fork(5, 4, 0.5f, true));  // a parent of rates 0 gives no ratio to keep
  ASSERT_OK(fork(8, 0, 0.0f, true));
  ASSERT_OK(fork(9, 8, 0.5f, true));  // ...but one forked at 0 remembers its ratios
  ASSERT_OK(fork(6, 2, 0.013f, true));
  ASSERT_OK(fork(7, 6, 0.29f, true));  // rounded once, from branch 0's ratio
  const double ratio = static_cast<double>(rates[1]) / rates[0];
  for (auto& shard : shards) {
    for (TableId id = 0; id < 3; ++id) {
      EXPECT_EQ(shard->learning_rate(id, 0), rates[static_cast<size_t>(id)]);
      EXPECT_EQ(shard->learning_rate(id, 3), 0.5f);
      EXPECT_EQ(shard->learning_rate(id, 4), 0.0f);
      EXPECT_EQ(shard->learning_rate(id, 5), 0.5f);
    }
    for (BranchId branch : {1, 2, 6, 7}) EXPECT_EQ(shard->learning_rate(2, branch), 0.0f);
    EXPECT_EQ(shard->learning_rate(0, 1), 0.5f);  // exactly the branch's rate
    EXPECT_EQ(shard->learning_rate(1, 1), static_cast<float>(ratio * 0.5f));
    EXPECT_EQ(shard->learning_rate(0, 2), 0.3f);
    EXPECT_EQ(shard->learning_rate(1, 2), static_cast<float>(ratio * 0.3f));
    EXPECT_EQ(shard->learning_rate(0, 7), 0.29f);
    EXPECT_EQ(shard->learning_rate(1, 7), static_cast<float>(ratio * 0.29f));
    EXPECT_NEAR(shard->learning_rate(1, 7), 0.0725f, 1e-8);
    EXPECT_EQ(shard->learning_rate(1, 8), 0.0f);
    EXPECT_EQ(shard->learning_rate(1, 9), shard->learning_rate(1, 1));
    EXPECT_EQ(shard->learning_rate(0, 10), -1.0f);  // no such branch
  }
}

TEST(BranchSettingsKeepTheParentsRateAndMomentumWhenNotGiven) {
  BranchSettings keep;
  keep.training = true;
  BranchId parent = -1;
  BranchSettings parsed;
  ASSERT_OK(DecodeBranchSettings(EncodeBranchSettings(3, keep), &parent, &parsed));
  EXPECT_EQ(parent, 3);
  EXPECT_EQ(parsed.learning_rate, BranchSettings::kKeepParent);
  EXPECT_EQ(parsed.momentum, BranchSettings::kKeepParent);
  BranchSettings bad = keep;
  bad.learning_rate = -2;
  EXPECT_CODE(DecodeBranchSettings(EncodeBranchSettings(0, bad), &parent, &parsed), StatusCode::kInvalidArgument);

  // A child that keeps the parent's (changed) rate steps like the parent; one
  // with a rate of its own steps differently.
  TableInfo info = Table();
  info.update_rule = TorchSgd();
  auto shards = MakeShards(UpdateRuleKind::kAdd, info);
  std::mt19937 rng(64);
  InitialiseAndStart(shards, RandomValues(&rng, kRows * kWidth));
  std::vector<float> sum;
  ASSERT_OK(DeliverClock(shards, &rng, 0, &sum, {0, 1, 2}, 0.02f));
  ASSERT_OK(ForkEverywhere(shards, 1, 0, keep));
  BranchSettings own = keep;
  own.learning_rate = 0.5f;
  ASSERT_OK(ForkEverywhere(shards, 2, 0, own));
  for (BranchId branch : {0, 1, 2}) {
    std::mt19937 same(65);  // the same updates on every branch
    const Clock clock = branch == 0 ? 1 : 0;
    ASSERT_OK(DeliverClock(shards, &same, clock, &sum, {}, 0, branch));
  }
  EXPECT_TRUE(Gather(shards, 1) == Gather(shards, 0));
  EXPECT_TRUE(Gather(shards, 2) != Gather(shards, 0));
}

// A shard whose state lives in host memory (a device too small for it) gives
// the worker of its process views of the state, not copies, and its rule
// waits until the view of the last push is given back; the results equal a
// device-resident shard's bit for bit. (The device holds the update
// payloads of one worker but not values and momentum: worker 1's clocks are
// bare.) Another process's worker still gets
// a copy. A view never given back is a Timeout naming the wait.
TEST(HostResidentStateIsLentToLocalWorkersAndTheRuleWaitsForTheViews) {
  constexpr int kTwo = 2;
  const TableInfo info = Table(kTable, 4, kWidth);  // shard 0 of 2 owns rows [0, 2)
  const std::vector<RowSpan> mine = {{0, 2}};
  auto make = [&](bool small, std::unique_ptr<ServerShard>* out) {
    std::shared_ptr<Device> device(NewCpuDevice(small ? 48 : 0));  // values 32 B, momentum 32 B
    auto shard = std::make_unique<ServerShard>(0, kTwo, Rule(UpdateRuleKind::kDampedMomentum), 40, device);
    shard->set_rows_routes([](int worker) { return worker == 0 ? RowsRoute::kDeviceBuffer : RowsRoute::kHostFrame; });
    Config config;
    config.device_memory_reserve = 0;
    config.wait_timeout_ms = 400;
    shard->PlaceStateWhenReady(config);
    ASSERT_OK(shard->AddTable(info));
    std::vector<Message> replies;
    for (WorkerId w = 0; w < kTwo; ++w) {
      Message ready = Header(MessageType::kReady, w, 0, -1);
      ready.header.request_id = 10 + w;
      ready.text = EncodeTableSchema({info});
      ready.header.text_bytes = static_cast<uint32_t>(ready.text.size());
      ASSERT_OK(shard->Handle(ready, &replies));
    }
    EXPECT_EQ(shard->state_in_host_memory(), small);
    *out = std::move(shard);
  };
  std::unique_ptr<ServerShard> lent, reference;
  make(true, &lent);
  make(false, &reference);
  std::mt19937 rng(91);
  const std::vector<float> initial = RandomValues(&rng, 2 * kWidth);
  const std::vector<float> update0 = RandomValues(&rng, 2 * kWidth);

  std::vector<Message> pushed, ignored;
  for (ServerShard* shard : {lent.get(), reference.get()}) {
    std::vector<Message>& out = shard == lent.get() ? pushed : ignored;
    ASSERT_OK(shard->Handle(InitAdd(0, 0, 1, mine, initial), &out));
    out.clear();
    for (WorkerId w = 0; w < kTwo; ++w) ASSERT_OK(shard->Handle(Start(w, 0), &out));
  }
  ASSERT_EQ(pushed.size(), size_t{kTwo});
  ASSERT_TRUE(pushed[0].host_frame != nullptr && pushed[0].host_frame->borrowed);  // a view, to worker 0
  EXPECT_TRUE(pushed[0].device_values == nullptr);
  ASSERT_TRUE(pushed[1].host_frame != nullptr);  // a copy, to worker 1
  EXPECT_TRUE(pushed[1].host_frame->data != pushed[0].host_frame->data);
  EXPECT_TRUE(HostValues(pushed[0]) == initial && HostValues(pushed[1]) == initial);

  // Worker 0 holds its view while the clock finishes: the rule waits, and the
  // view still shows the initial values until it is given back.
  std::vector<float> seen_when_returned;
  std::thread installer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    seen_when_returned = HostValues(pushed[0]);
    pushed.clear();
  });
  const auto started = std::chrono::steady_clock::now();
  std::vector<Message> out;
  ASSERT_OK(lent->Handle(ClockUpdate(0, 0, 0, mine, update0), &out));
  ASSERT_OK(lent->Handle(ClockUpdate(1, 0, 0), &out));
  const auto waited = std::chrono::steady_clock::now() - started;
  installer.join();
  EXPECT_TRUE(waited >= std::chrono::milliseconds(90));
  EXPECT_TRUE(seen_when_returned == initial);
  ignored.clear();  // on the CPU a device-resident shard lends its own worker views too
  for (WorkerId w = 0; w < kTwo; ++w) {
    ASSERT_OK(reference->Handle(w == 0 ? ClockUpdate(0, 0, 0, mine, update0) : ClockUpdate(1, 0, 0), &ignored));
  }
  EXPECT_TRUE(*lent->values(kTable) == *reference->values(kTable));
  EXPECT_TRUE(*lent->values(kTable) != initial);

  // The clock-0 rows' view is never given back: the next clock times out.
  ASSERT_EQ(out.size(), size_t{kTwo});
  ASSERT_OK(lent->Handle(ClockUpdate(0, 0, 1, mine, update0), &out));
  const Status stuck = lent->Handle(ClockUpdate(1, 0, 1), &out);
  EXPECT_CODE(stuck, StatusCode::kTimeout);
  EXPECT_TRUE(stuck.message().find("did not install the shard's last rows within 400 ms") != std::string::npos);
}

// A shard whose state lives in host memory allocates each table's state when
// a message first needs it: worker 0's initial values arrive table by table
// (its process frees its copy of each as it is written), and kStart takes
// the rest; the values are what a device-resident shard holds.
TEST(HostResidentStateIsAllocatedTableByTableAsMessagesNeedIt) {
  constexpr TableId kOther = 6;
  std::shared_ptr<Device> device(NewCpuDevice(48));  // an update payload, not the 160 B of state
  ServerShard shard(0, 1, Rule(UpdateRuleKind::kDampedMomentum), 40, device);
  Config config;
  config.device_memory_reserve = 0;
  shard.PlaceStateWhenReady(config);
  ASSERT_OK(shard.AddTable(Table(kTable, 2, kWidth)));
  ASSERT_OK(shard.AddTable(Table(kOther, 3, kWidth)));
  std::vector<Message> out;
  Message ready = Header(MessageType::kReady, 0, 0, -1);
  ready.header.request_id = 1;
  ready.text = EncodeTableSchema({Table(kTable, 2, kWidth), Table(kOther, 3, kWidth)});
  ready.header.text_bytes = static_cast<uint32_t>(ready.text.size());
  ASSERT_OK(shard.Handle(ready, &out));
  EXPECT_TRUE(shard.state_in_host_memory());
  EXPECT_EQ(shard.state_bytes_allocated(), int64_t{0});

  const int64_t table_bytes = 2 * kWidth * 4 * 2;  // values and momentum
  std::mt19937 rng(5);
  const std::vector<float> initial = RandomValues(&rng, 2 * kWidth);
  ASSERT_OK(shard.Handle(InitAdd(0, 0, 2, {{0, 2}}, initial), &out));
  EXPECT_EQ(shard.state_bytes_allocated(), table_bytes);  // this table's only
  EXPECT_TRUE(*shard.values(kTable) == initial);
  ASSERT_OK(shard.Handle(Start(0, 0), &out));
  EXPECT_EQ(shard.state_bytes_allocated(), table_bytes + 3 * kWidth * 4 * 2);  // kStart: the rest
  EXPECT_TRUE(*shard.values(kTable) == initial);
  EXPECT_TRUE(*shard.values(kOther) == std::vector<float>(3 * kWidth, 0.0f));
}

// The state is placed only once every worker is ready, but a table whose
// rule is unknown is refused when it is added (CreateTable), naming it.
TEST(AnUnknownRuleKindIsRefusedByAddTableWhenTheStateIsDeferred) {
  ServerShard shard(0, kWorkers, Rule(UpdateRuleKind::kAdd));
  shard.PlaceStateWhenReady(Config());
  TableInfo info = Table();
  UpdateRuleConfig bad = Rule(UpdateRuleKind::kAdd);
  bad.kind = static_cast<UpdateRuleKind>(42);
  info.update_rule = bad;
  const Status refused = shard.AddTable(info);
  EXPECT_CODE(refused, StatusCode::kInvalidArgument);
  EXPECT_TRUE(refused.message().find("table 5 (t5): unknown update rule kind 42") != std::string::npos);
  ASSERT_OK(shard.AddTable(Table()));  // nothing was kept
}

MLT_TEST_MAIN

namespace {

Message EmptyClock(WorkerId sender, int shard, WorkerId late, Clock clock, BranchId branch = 0) {
  Message m = Header(MessageType::kEmptyClock, sender, shard, -1);
  m.header.clock = clock;
  m.header.branch = branch;
  m.header.request_id = late;
  return m;
}

// Zeros on every row of the shard's range (a late worker's empty clock).
Message ZeroUpdate(WorkerId sender, int shard, Clock clock) {
  const RowSpan range = ShardRange(kRows, shard, kWorkers);
  return ClockUpdate(sender, shard, clock, {range}, std::vector<float>(range.count * kWidth, 0.0f));
}

// Worker 1's clocks 1 and 2 are declared empty before the others send them:
// each shard applies them as soon as workers 0 and 2 are in, and the values
// equal a run where worker 1 sent bare clocks in its turn, bit for bit.
void RunDeclaredEmpty(UpdateRuleKind kind) {
  std::mt19937 rng(41 + static_cast<int>(kind));
  auto declared = MakeShards(kind);
  auto reference = MakeShards(kind);
  const std::vector<float> initial = RandomValues(&rng, kRows * kWidth);
  InitialiseAndStart(declared, initial);
  InitialiseAndStart(reference, initial);
  auto both = [&](int s, const Message& m, std::vector<Message>* out) {
    std::vector<Message> ignored;
    EXPECT_OK(reference[s]->Handle(m, &ignored));
    ASSERT_OK(declared[s]->Handle(m, out));
  };
  for (WorkerId worker = 0; worker < kWorkers; ++worker) {
    WorkerUpdate update = MakeUpdate(&rng, worker, 0, false);
    for (int s = 0; s < kWorkers; ++s) {
      std::vector<Message> out;
      both(s, update.per_shard[s], &out);
    }
  }
  for (int s = 0; s < kWorkers; ++s) {
    std::vector<Message> out;
    ASSERT_OK(declared[s]->Handle(EmptyClock(0, s, 1, 1), &out));
    ASSERT_OK(declared[s]->Handle(EmptyClock(2, s, 1, 2), &out));
    EXPECT_EQ(out.size(), size_t{0});  // workers 0 and 2 have not sent clock 1
  }
  for (Clock clock = 1; clock <= 2; ++clock) {
    for (WorkerId worker : {0, 2}) {
      WorkerUpdate update = MakeUpdate(&rng, worker, clock, false);
      for (int s = 0; s < kWorkers; ++s) {
        std::vector<Message> out;
        both(s, update.per_shard[s], &out);
        EXPECT_EQ(out.size(), worker == 2 ? size_t{kWorkers} : size_t{0});
        for (const Message& rows : out) EXPECT_EQ(rows.header.clock, clock);
        EXPECT_EQ(declared[s]->global_clock(kTable), worker == 2 ? clock : clock - 1);
        if (worker == 2) {
          std::vector<Message> ignored;
          ASSERT_OK(reference[s]->Handle(ClockUpdate(1, s, clock), &ignored));  // its bare clock, in its turn
        }
      }
    }
    EXPECT_TRUE(Gather(declared) == Gather(reference));
  }
  // Worker 1's own updates of the empty clocks come late: dropped.
  const std::vector<float> before = Gather(declared);
  for (Clock clock = 1; clock <= 2; ++clock) {
    for (int s = 0; s < kWorkers; ++s) {
      std::vector<Message> out;
      ASSERT_OK(declared[s]->Handle(ZeroUpdate(1, s, clock), &out));
      EXPECT_EQ(out.size(), size_t{0});
    }
  }
  EXPECT_TRUE(Gather(declared) == before);
  // Clock 3 is everyone's again.
  for (WorkerId worker = 0; worker < kWorkers; ++worker) {
    WorkerUpdate update = MakeUpdate(&rng, worker, 3, false);
    for (int s = 0; s < kWorkers; ++s) {
      std::vector<Message> out;
      both(s, update.per_shard[s], &out);
      EXPECT_EQ(out.size(), worker == kWorkers - 1 ? size_t{kWorkers} : size_t{0});
    }
  }
  EXPECT_TRUE(Gather(declared) == Gather(reference));
}

}  // namespace

TEST(AClockDeclaredEmptyIsAppliedWithoutItsWorkerWithAdd) { RunDeclaredEmpty(UpdateRuleKind::kAdd); }
TEST(AClockDeclaredEmptyIsAppliedWithoutItsWorkerWithMomentum) { RunDeclaredEmpty(UpdateRuleKind::kDampedMomentum); }

// The late worker had not sent clock 0 when its clock 1 was declared empty:
// its clock 0 then finishes clocks 0 and 1 at once, each pushed once.
TEST(ADeclarationAheadOfTheLateWorkerFinishesTwoClocksAtOnce) {
  std::mt19937 rng(5);
  auto shards = MakeShards(UpdateRuleKind::kAdd);
  InitialiseAndStart(shards, std::vector<float>(kRows * kWidth, 0.0f));
  std::vector<float> expected(kRows * kWidth, 0.0f);
  for (int s = 0; s < kWorkers; ++s) {
    std::vector<Message> out;
    ASSERT_OK(shards[s]->Handle(EmptyClock(0, s, 1, 1), &out));
  }
  for (Clock clock = 0; clock <= 1; ++clock) {
    for (WorkerId worker : {0, 2}) {
      WorkerUpdate update = MakeUpdate(&rng, worker, clock, false);
      for (size_t i = 0; i < expected.size(); ++i) expected[i] += update.dense[i];
      for (int s = 0; s < kWorkers; ++s) {
        std::vector<Message> out;
        ASSERT_OK(shards[s]->Handle(update.per_shard[s], &out));
        EXPECT_EQ(out.size(), size_t{0});
      }
    }
  }
  WorkerUpdate late = MakeUpdate(&rng, 1, 0, false);
  for (size_t i = 0; i < expected.size(); ++i) expected[i] += late.dense[i];
  for (int s = 0; s < kWorkers; ++s) {
    std::vector<Message> out;
    ASSERT_OK(shards[s]->Handle(late.per_shard[s], &out));
    EXPECT_EQ(out.size(), size_t{kWorkers});  // one push per worker, at data age 1
    for (const Message& rows : out) EXPECT_EQ(rows.header.clock, 1);
    EXPECT_EQ(shards[s]->global_clock(kTable), 1);
  }
  const std::vector<float> got = Gather(shards);
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], expected[i], 1e-5);
}

TEST(BadEmptyClocksAreRefusedWithoutChange) {
  auto shards = MakeShards(UpdateRuleKind::kAdd);
  std::vector<Message> out;
  // Before the late worker started.
  EXPECT_CODE(shards[0]->Handle(EmptyClock(0, 0, 1, 0), &out), StatusCode::kOutOfOrder);
  InitialiseAndStart(shards, std::vector<float>(kRows * kWidth, 0.0f));
  EXPECT_CODE(shards[0]->Handle(EmptyClock(0, 0, kWorkers, 0), &out), StatusCode::kInvalidArgument);
  EXPECT_CODE(shards[0]->Handle(EmptyClock(0, 0, -1, 0), &out), StatusCode::kInvalidArgument);
  EXPECT_CODE(shards[0]->Handle(EmptyClock(0, 0, 1, -1), &out), StatusCode::kInvalidArgument);
  EXPECT_CODE(shards[0]->Handle(EmptyClock(0, 0, 1, 0, /*branch=*/3), &out), StatusCode::kInvalidArgument);
  EXPECT_CODE(shards[0]->Handle(WithRows(EmptyClock(0, 0, 1, 0), {{0, 1}}, std::vector<float>(kWidth, 1.0f)), &out),
              StatusCode::kInvalidArgument);
  // A nonzero update of a declared empty clock is refused, and changes nothing.
  ASSERT_OK(shards[0]->Handle(EmptyClock(0, 0, 1, 0), &out));
  const std::vector<float> before = *shards[0]->values(kTable);
  const RowSpan range = ShardRange(kRows, 0, kWorkers);
  std::vector<float> values(range.count * kWidth, 0.0f);
  values[3] = 0.5f;
  EXPECT_CODE(shards[0]->Handle(ClockUpdate(1, 0, 0, {range}, values), &out), StatusCode::kInvalidArgument);
  EXPECT_TRUE(*shards[0]->values(kTable) == before);
  ASSERT_OK(shards[0]->Handle(ZeroUpdate(1, 0, 0), &out));
  EXPECT_TRUE(out.empty());
}

// A late worker's own update of a clock declared empty is dropped, and so is
// the skipped-step mark it carries: the others' step is taken as if it were
// unmarked (it skipped the clock for everyone).
TEST(ASkippedStepMarkOnAClockDeclaredEmptyIsDropped) {
  std::mt19937 rng(88);
  const std::vector<float> initial = RandomValues(&rng, kRows * kWidth);
  std::vector<std::vector<float>> results;
  for (const bool marked : {false, true}) {
    TableInfo info = Table();
    info.update_rule = TorchSgd();
    auto shards = MakeShards(UpdateRuleKind::kAdd, info);
    InitialiseAndStart(shards, initial);
    std::mt19937 same(89);
    for (int s = 0; s < kWorkers; ++s) {
      std::vector<Message> out;
      ASSERT_OK(shards[s]->Handle(EmptyClock(0, s, 1, 0), &out));
      Message late = ZeroUpdate(1, s, 0);  // worker 1's own, before the others'
      if (marked) late.header.flags |= kSkipStep;
      ASSERT_OK(shards[s]->Handle(late, &out));
    }
    for (WorkerId worker : {0, 2}) {
      WorkerUpdate update = MakeUpdate(&same, worker, 0, false);
      for (int s = 0; s < kWorkers; ++s) {
        std::vector<Message> out;
        ASSERT_OK(shards[s]->Handle(update.per_shard[s], &out));
      }
    }
    for (const auto& shard : shards) EXPECT_EQ(shard->global_clock(kTable), 0);
    results.push_back(Gather(shards));
  }
  EXPECT_TRUE(results[0] == results[1]);
  EXPECT_TRUE(results[0] != initial);  // the step was taken
}
