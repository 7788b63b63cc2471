// Wire codec: round trips, every rejection path, and fuzzing.
#include "wire/message.h"

#include <cmath>
#include <cstddef>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "test_util.h"
#include "wire/branch_settings.h"
#include "wire/table_schema.h"

namespace mltuner {
namespace {

constexpr size_t kHeader = sizeof(MessageHeader);

// A message of `type` with random non-zero fields, spans and values.
Message RandomMessage(MessageType type, std::mt19937_64& rng) {
  Message m;
  m.header.type = static_cast<uint16_t>(type);
  m.header.sender = static_cast<int32_t>(rng() % 100) + 1;
  m.header.receiver = static_cast<int32_t>(rng() % 100) + 1;
  m.header.table = static_cast<int32_t>(rng() % 50) + 1;
  m.header.branch = static_cast<int32_t>(rng() % 7) + 1;
  m.header.clock = static_cast<int64_t>(rng() % 100000) + 1;
  m.header.request_id = static_cast<int64_t>(rng() >> 2) + 1;
  m.header.row_width = static_cast<int64_t>(rng() % 33) + 1;
  const int num_spans = static_cast<int>(rng() % 6) + 1;
  for (int i = 0; i < num_spans; ++i) {
    m.spans.push_back({static_cast<int64_t>(rng() % 1000000) + 1, static_cast<int64_t>(rng() % 20) + 1});
  }
  std::uniform_real_distribution<float> value(-100.f, 100.f);
  m.values.resize(static_cast<size_t>(m.total_rows() * m.header.row_width));
  for (float& v : m.values) v = value(rng) + 1000.f;  // never zero
  if (type == MessageType::kError) m.text = "shard 3 rejected clock " + std::to_string(m.header.clock);
  return m;
}

Status Decode(const std::string& frame0, const std::vector<float>& values, Message* out) {
  return DecodeMessage(frame0.data(), frame0.size(), values.data(), values.size() * sizeof(float), out);
}

Status DecodeBytes(const std::string& frame0, size_t payload_bytes, Message* out) {
  std::vector<unsigned char> payload(payload_bytes + 1, 0);
  return DecodeMessage(frame0.data(), frame0.size(), payload.data(), payload_bytes, out);
}

// The header as the encoder sends it: the counts come from the vectors.
MessageHeader SentHeader(const Message& m) {
  MessageHeader h = m.header;
  h.num_spans = static_cast<uint32_t>(m.spans.size());
  h.text_bytes = static_cast<uint32_t>(m.text.size());
  return h;
}

bool SameMessage(const Message& a, const Message& b) {
  const MessageHeader ha = SentHeader(a), hb = SentHeader(b);
  if (std::memcmp(&ha, &hb, kHeader) != 0) return false;
  if (a.spans.size() != b.spans.size()) return false;
  for (size_t i = 0; i < a.spans.size(); ++i) {
    if (a.spans[i].begin != b.spans[i].begin || a.spans[i].count != b.spans[i].count) return false;
  }
  return a.values == b.values && a.text == b.text;
}

// Overwrites one header field in an encoded frame 0.
template <typename T>
void Patch(std::string* frame, size_t offset, T value) {
  std::memcpy(&(*frame)[offset], &value, sizeof(T));
}

bool MessageMentions(const Status& s, const std::string& word) { return s.message().find(word) != std::string::npos; }

// A small valid kRows message: 2 spans, 3 rows, width 2.
Message SmallRows() {
  Message m;
  m.header.type = static_cast<uint16_t>(MessageType::kRows);
  m.header.row_width = 2;
  m.spans = {{10, 1}, {20, 2}};
  m.values = {1, 2, 3, 4, 5, 6};
  return m;
}

TEST(RoundTripsEveryType) {
  std::mt19937_64 rng(7);
  for (uint16_t t = 1; t <= kMaxMessageType; ++t) {
    if (t == static_cast<uint16_t>(MessageType::kBatch)) continue;  // an envelope: wire/batch_test.cc
    if (t == static_cast<uint16_t>(MessageType::kIpcNotice)) continue;   // envelopes:
    if (t == static_cast<uint16_t>(MessageType::kIpcRelease)) continue;  //   wire/ipc_envelope_test.cc
    for (int rep = 0; rep < 20; ++rep) {
      const Message m = RandomMessage(static_cast<MessageType>(t), rng);
      const std::string frame0 = EncodeHeaderFrame(m);
      EXPECT_EQ(frame0.size(), kHeader + m.spans.size() * sizeof(RowSpan) + m.text.size());
      Message back;
      ASSERT_OK(Decode(frame0, m.values, &back));
      EXPECT_TRUE(SameMessage(m, back));
      EXPECT_EQ(back.header.num_spans, static_cast<uint32_t>(m.spans.size()));
      EXPECT_EQ(back.total_rows(), m.total_rows());
    }
  }
}

// kFork and kReady carry fixed structs (zero bytes included) in the text
// frame: they arrive byte for byte, a truncated frame is refused by the
// message decoder, and a struct cut short inside a well-formed frame by the
// struct's own decoder.
TEST(StructPayloadsTravelInTheTextFrame) {
  BranchSettings settings;
  settings.learning_rate = 0.5f;
  Message fork = NewMessage(MessageType::kFork, 1, 0, -1);
  fork.text = EncodeBranchSettings(0, settings);
  fork.header.text_bytes = static_cast<uint32_t>(fork.text.size());
  std::string frame0 = EncodeHeaderFrame(fork);
  Message back;
  ASSERT_OK(Decode(frame0, {}, &back));
  EXPECT_TRUE(back.text == fork.text);
  BranchId parent = -1;
  BranchSettings decoded;
  ASSERT_OK(DecodeBranchSettings(back.text, &parent, &decoded));
  EXPECT_EQ(decoded.learning_rate, 0.5f);
  EXPECT_CODE(Decode(frame0.substr(0, frame0.size() - 1), {}, &back), StatusCode::kCorruptMessage);

  Message ready = NewMessage(MessageType::kReady, 1, 0, -1);
  TableInfo table;
  table.name = "w";
  table.num_rows = 3;
  table.row_width = 2;
  ready.text = EncodeTableSchema({table}).substr(0, 20);  // a schema cut inside its first record
  ready.header.text_bytes = static_cast<uint32_t>(ready.text.size());
  ASSERT_OK(Decode(EncodeHeaderFrame(ready), {}, &back));
  std::vector<TableInfo> tables;
  EXPECT_CODE(DecodeTableSchema(back.text, &tables), StatusCode::kCorruptMessage);
}

TEST(RoundTripsEmptyMessages) {
  // A bare clock: no spans, no payload, zero row width.
  Message m;
  m.header.type = static_cast<uint16_t>(MessageType::kClockUpdate);
  m.header.clock = 3;
  Message back;
  ASSERT_OK(DecodeMessage(EncodeHeaderFrame(m).data(), kHeader, nullptr, 0, &back));
  EXPECT_TRUE(SameMessage(m, back));
  EXPECT_EQ(back.total_rows(), int64_t{0});

  // A fetch names rows but carries no values.
  Message fetch;
  fetch.header.type = static_cast<uint16_t>(MessageType::kFetch);
  fetch.header.row_width = 8;
  fetch.spans = {{0, 5}};
  ASSERT_OK(Decode(EncodeHeaderFrame(fetch), {}, &back));
  EXPECT_EQ(back.total_rows(), int64_t{5});
  EXPECT_TRUE(back.values.empty());
}

TEST(NamesAndDirections) {
  EXPECT_EQ(std::string(MessageTypeName(MessageType::kClockUpdate)), std::string("ClockUpdate"));
  EXPECT_EQ(std::string(MessageTypeName(MessageType::kError)), std::string("Error"));
  EXPECT_EQ(std::string(MessageTypeName(static_cast<MessageType>(99))), std::string("Unknown"));
  EXPECT_TRUE(IsServerBound(MessageType::kClockUpdate));
  EXPECT_TRUE(IsServerBound(MessageType::kStart));
  EXPECT_TRUE(IsServerBound(MessageType::kFetch));
  EXPECT_TRUE(IsServerBound(MessageType::kInitAdd));
  EXPECT_TRUE(!IsServerBound(MessageType::kRows));
  EXPECT_TRUE(!IsServerBound(MessageType::kFetchReply));
  EXPECT_TRUE(!IsServerBound(MessageType::kAck));
  EXPECT_TRUE(!IsServerBound(MessageType::kError));
  const std::string line = SmallRows().DebugString();
  EXPECT_TRUE(line.find("Rows") != std::string::npos);
  EXPECT_TRUE(line.find("rows=3") != std::string::npos);
}

TEST(RejectsTruncatedHeader) {
  const std::string frame0 = EncodeHeaderFrame(SmallRows());
  for (size_t len = 0; len < kHeader; ++len) {
    Message out;
    EXPECT_CODE(DecodeMessage(frame0.data(), len, nullptr, 0, &out), StatusCode::kCorruptMessage);
  }
  Message out;
  EXPECT_CODE(DecodeMessage(nullptr, 0, nullptr, 0, &out), StatusCode::kCorruptMessage);
}

TEST(RejectsBadMagicAndVersion) {
  const Message m = SmallRows();
  std::string frame0 = EncodeHeaderFrame(m);
  Patch<uint32_t>(&frame0, offsetof(MessageHeader, magic), 0x12345678u);
  Message out;
  Status s = Decode(frame0, m.values, &out);
  EXPECT_CODE(s, StatusCode::kCorruptMessage);
  EXPECT_TRUE(MessageMentions(s, "not an mltuner message"));

  frame0 = EncodeHeaderFrame(m);
  Patch<uint16_t>(&frame0, offsetof(MessageHeader, version), 2);
  s = Decode(frame0, m.values, &out);
  EXPECT_CODE(s, StatusCode::kCorruptMessage);
  EXPECT_TRUE(MessageMentions(s, "wire version 2, expected 1"));
}

TEST(RejectsUnknownTypes) {
  const Message m = SmallRows();
  for (uint16_t type : {uint16_t{0}, uint16_t{kMaxMessageType + 1}, uint16_t{99}, uint16_t{0xFFFF}}) {
    std::string frame0 = EncodeHeaderFrame(m);
    Patch<uint16_t>(&frame0, offsetof(MessageHeader, type), type);
    Message out;
    const Status s = Decode(frame0, m.values, &out);
    EXPECT_CODE(s, StatusCode::kCorruptMessage);
    EXPECT_TRUE(MessageMentions(s, "type"));
  }
}

TEST(RejectsFrameSizeMismatch) {
  const Message m = SmallRows();
  const std::string good = EncodeHeaderFrame(m);
  Message out;
  // num_spans one too many / one too few / absurd.
  for (uint32_t n : {3u, 1u, 0u, 0xFFFFFFFFu}) {
    std::string frame0 = good;
    Patch<uint32_t>(&frame0, offsetof(MessageHeader, num_spans), n);
    EXPECT_CODE(Decode(frame0, m.values, &out), StatusCode::kCorruptMessage);
  }
  // Frame shorter or longer than the header says.
  EXPECT_CODE(DecodeMessage(good.data(), good.size() - 1, m.values.data(), m.values.size() * 4, &out),
              StatusCode::kCorruptMessage);
  std::string longer = good + "x";
  EXPECT_CODE(Decode(longer, m.values, &out), StatusCode::kCorruptMessage);
  // text_bytes pointing past the frame.
  for (uint32_t t : {1u, 1000u, 0xFFFFFFFFu}) {
    std::string frame0 = good;
    Patch<uint32_t>(&frame0, offsetof(MessageHeader, text_bytes), t);
    EXPECT_CODE(Decode(frame0, m.values, &out), StatusCode::kCorruptMessage);
  }
}

TEST(RejectsNegativeSpansAndRowWidth) {
  Message m = SmallRows();
  Message out;
  m.spans[1].count = -2;
  EXPECT_CODE(Decode(EncodeHeaderFrame(m), m.values, &out), StatusCode::kCorruptMessage);
  m = SmallRows();
  m.spans[0].begin = -1;
  EXPECT_CODE(Decode(EncodeHeaderFrame(m), m.values, &out), StatusCode::kCorruptMessage);
  m = SmallRows();
  m.header.row_width = -2;
  EXPECT_CODE(Decode(EncodeHeaderFrame(m), m.values, &out), StatusCode::kCorruptMessage);
  // Payload with zero row width.
  m = SmallRows();
  m.header.row_width = 0;
  EXPECT_CODE(Decode(EncodeHeaderFrame(m), m.values, &out), StatusCode::kCorruptMessage);
}

// A clock update may carry a new learning rate (and nothing else a flag).
TEST(LearningRateTravelsOnlyOnClockUpdates) {
  Message m = SmallRows();
  m.header.type = static_cast<uint16_t>(MessageType::kClockUpdate);
  m.header.flags = kNewLearningRate;
  m.header.learning_rate = 0.0125f;
  Message out;
  ASSERT_OK(Decode(EncodeHeaderFrame(m), m.values, &out));
  EXPECT_EQ(out.header.flags, static_cast<uint32_t>(kNewLearningRate));
  EXPECT_EQ(out.header.learning_rate, 0.0125f);
  EXPECT_TRUE(out.DebugString().find("new_lr=0.0125") != std::string::npos);
  for (float bad : {-1.0f, std::nanf(""), INFINITY}) {
    m.header.learning_rate = bad;
    EXPECT_CODE(Decode(EncodeHeaderFrame(m), m.values, &out), StatusCode::kCorruptMessage);
  }
  m.header.learning_rate = 0.5f;
  m.header.flags = kNewLearningRate | (1u << 7);
  EXPECT_CODE(Decode(EncodeHeaderFrame(m), m.values, &out), StatusCode::kCorruptMessage);
  Message rows = SmallRows();
  rows.header.flags = kNewLearningRate;
  EXPECT_CODE(Decode(EncodeHeaderFrame(rows), rows.values, &out), StatusCode::kCorruptMessage);
}

// A skipped step travels on clock updates only.
TEST(SkippedStepTravelsOnlyOnClockUpdates) {
  Message m = SmallRows();
  m.header.type = static_cast<uint16_t>(MessageType::kClockUpdate);
  m.header.flags = kSkipStep;
  Message out;
  ASSERT_OK(Decode(EncodeHeaderFrame(m), m.values, &out));
  EXPECT_EQ(out.header.flags, static_cast<uint32_t>(kSkipStep));
  EXPECT_TRUE(out.DebugString().find("skip_step") != std::string::npos);
  Message rows = SmallRows();
  rows.header.flags = kSkipStep;
  EXPECT_CODE(Decode(EncodeHeaderFrame(rows), rows.values, &out), StatusCode::kCorruptMessage);
}

TEST(RejectsWrongPayloadSize) {
  const Message m = SmallRows();
  const std::string frame0 = EncodeHeaderFrame(m);
  const size_t want = m.values.size() * sizeof(float);
  Message out;
  ASSERT_OK(DecodeBytes(frame0, want, &out));
  EXPECT_CODE(DecodeBytes(frame0, want - 4, &out), StatusCode::kCorruptMessage);
  EXPECT_CODE(DecodeBytes(frame0, want + 4, &out), StatusCode::kCorruptMessage);
  EXPECT_CODE(DecodeBytes(frame0, want - 1, &out), StatusCode::kCorruptMessage);
  EXPECT_CODE(DecodeBytes(frame0, 0, &out), StatusCode::kCorruptMessage);
  // A non-empty payload size with no payload pointer.
  EXPECT_CODE(DecodeMessage(frame0.data(), frame0.size(), nullptr, want, &out), StatusCode::kCorruptMessage);
}

TEST(RejectsOverflowingCounts) {
  const int64_t big = std::numeric_limits<int64_t>::max();
  Message out;
  // Counts whose sum overflows int64.
  Message m = SmallRows();
  m.spans = {{0, big}, {0, big}};
  EXPECT_CODE(Decode(EncodeHeaderFrame(m), m.values, &out), StatusCode::kCorruptMessage);
  // begin + count past the row-id range.
  m.spans = {{big, 1}};
  EXPECT_CODE(Decode(EncodeHeaderFrame(m), m.values, &out), StatusCode::kCorruptMessage);
  // rows * row_width * 4 overflows, or wraps to a small number.
  m.spans = {{0, int64_t{1} << 40}};
  m.header.row_width = int64_t{1} << 30;
  EXPECT_CODE(Decode(EncodeHeaderFrame(m), m.values, &out), StatusCode::kCorruptMessage);
  m.spans = {{0, int64_t{1} << 62}};
  m.header.row_width = 4;  // (1<<62) * 4 * 4 == 0 mod 2^64
  EXPECT_CODE(DecodeBytes(EncodeHeaderFrame(m), 0, &out), StatusCode::kCorruptMessage);
  // Large but not overflowing: over the sanity cap.
  m.spans = {{0, int64_t{1} << 35}};
  m.header.row_width = 64;
  EXPECT_CODE(Decode(EncodeHeaderFrame(m), m.values, &out), StatusCode::kCorruptMessage);
}

TEST(RejectionLeavesOutputUntouched) {
  Message out = SmallRows();
  std::string frame0 = EncodeHeaderFrame(out);
  Patch<uint32_t>(&frame0, 0, 0u);
  EXPECT_CODE(Decode(frame0, {}, &out), StatusCode::kCorruptMessage);
  EXPECT_TRUE(SameMessage(out, SmallRows()));
}

TEST(DecodesUnalignedFrames) {
  const Message m = SmallRows();
  const std::string frame0 = EncodeHeaderFrame(m);
  std::vector<char> buffer(frame0.size() + 1 + m.values.size() * 4 + 1);
  std::memcpy(buffer.data() + 1, frame0.data(), frame0.size());
  char* payload = buffer.data() + 1 + frame0.size();
  std::memcpy(payload, m.values.data(), m.values.size() * 4);
  Message out;
  ASSERT_OK(DecodeMessage(buffer.data() + 1, frame0.size(), payload, m.values.size() * 4, &out));
  EXPECT_TRUE(SameMessage(m, out));
}

// Decoding must never crash and must answer OK or kCorruptMessage.
void ExpectSafeDecode(const std::string& frame0, const std::vector<unsigned char>& payload) {
  Message out;
  const Status s = DecodeMessage(frame0.data(), frame0.size(), payload.data(), payload.size(), &out);
  EXPECT_TRUE(s.ok() || s.code() == StatusCode::kCorruptMessage);
  if (s.ok()) EXPECT_EQ(out.values.size() * 4, payload.size());
}

TEST(FuzzRandomBytes) {
  std::mt19937_64 rng(11);
  for (int i = 0; i < 20000; ++i) {
    std::string frame0(rng() % 200, '\0');
    for (char& c : frame0) c = static_cast<char>(rng());
    // Half the time give it a valid identity so the deeper checks get fuzzed.
    if (frame0.size() >= kHeader && rng() % 2 == 0) {
      Patch<uint32_t>(&frame0, 0, kWireMagic);
      Patch<uint16_t>(&frame0, 4, kWireVersion);
      Patch<uint16_t>(&frame0, 6, static_cast<uint16_t>(rng() % (kMaxMessageType + 1)));
    }
    std::vector<unsigned char> payload(rng() % 64);
    for (unsigned char& c : payload) c = static_cast<unsigned char>(rng());
    ExpectSafeDecode(frame0, payload);
  }
}

TEST(FuzzSingleByteMutations) {
  std::mt19937_64 rng(13);
  for (int i = 0; i < 20000; ++i) {
    const Message m = RandomMessage(static_cast<MessageType>(rng() % kMaxMessageType + 1), rng);
    std::string frame0 = EncodeHeaderFrame(m);
    std::vector<unsigned char> payload(m.values.size() * 4);
    if (!payload.empty()) std::memcpy(payload.data(), m.values.data(), payload.size());
    const size_t where = rng() % frame0.size();
    frame0[where] = static_cast<char>(rng());
    switch (rng() % 4) {  // sometimes also disturb the sizes
      case 0: frame0.resize(rng() % (frame0.size() + 1)); break;
      case 1: payload.resize(rng() % (payload.size() + 9)); break;
      default: break;
    }
    ExpectSafeDecode(frame0, payload);
  }
}

}  // namespace
}  // namespace mltuner

MLT_TEST_MAIN
