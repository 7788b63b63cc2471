// Batches: a round trip gives back every part's frames byte for byte (each
// then decodes to its message), every envelope rejection path, the refusal
// of a batch where one message belongs, and fuzzing of the envelope.
#include "wire/batch.h"

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "test_util.h"
#include "wire/message.h"

namespace mltuner {
namespace {

constexpr size_t kHeader = sizeof(MessageHeader);

// An encoded message: a kRows of `rows` rows of width 3 (values from
// `seed`), or a bare kFetch when rows is 0.
struct Encoded {
  std::string frame0;
  std::vector<float> values;
  FramePair pair() const {
    return {frame0.data(), frame0.size(), values.empty() ? nullptr : values.data(), values.size() * sizeof(float)};
  }
};

Encoded Rows(int table, int64_t rows, float seed) {
  Message m = NewMessage(rows > 0 ? MessageType::kRows : MessageType::kFetch, 1, 0, table);
  m.header.row_width = 3;
  m.header.clock = 7;
  m.spans = {{10, rows > 0 ? rows : 2}};
  for (int64_t i = 0; i < rows * 3; ++i) m.values.push_back(seed + static_cast<float>(i));
  return {EncodeHeaderFrame(m), m.values};
}

Status Split(const std::string& frame0, const std::vector<float>& payload, std::vector<FramePair>* parts) {
  int sender = -1, receiver = -1;
  return DecodeBatch(frame0.data(), frame0.size(), payload.data(), payload.size() * sizeof(float), parts, &sender,
                     &receiver);
}

TEST(ARoundTripGivesEveryPartBackByteForByte) {
  const std::vector<Encoded> messages = {Rows(0, 2, 1.f), Rows(1, 0, 0.f), Rows(2, 5, 100.f), Rows(3, 1, -4.f)};
  std::vector<FramePair> parts;
  for (const Encoded& m : messages) parts.push_back(m.pair());
  std::string frame0;
  std::vector<float> payload;
  ASSERT_OK(EncodeBatch(1, 0, parts, &frame0, &payload));
  EXPECT_TRUE(IsBatch(frame0.data(), frame0.size()));
  EXPECT_EQ(payload.size(), size_t{(2 + 5 + 1) * 3});

  std::vector<FramePair> back;
  int sender = -1, receiver = -1;
  ASSERT_OK(DecodeBatch(frame0.data(), frame0.size(), payload.data(), payload.size() * sizeof(float), &back, &sender,
                        &receiver));
  EXPECT_EQ(sender, 1);
  EXPECT_EQ(receiver, 0);
  ASSERT_EQ(back.size(), messages.size());
  for (size_t i = 0; i < messages.size(); ++i) {
    ASSERT_EQ(back[i].frame0_bytes, messages[i].frame0.size());
    EXPECT_TRUE(std::memcmp(back[i].frame0, messages[i].frame0.data(), back[i].frame0_bytes) == 0);
    ASSERT_EQ(back[i].payload_bytes, messages[i].values.size() * sizeof(float));
    if (back[i].payload_bytes > 0) {
      EXPECT_TRUE(std::memcmp(back[i].payload, messages[i].values.data(), back[i].payload_bytes) == 0);
    }
    Message decoded;
    ASSERT_OK(DecodeMessage(back[i].frame0, back[i].frame0_bytes, back[i].payload, back[i].payload_bytes, &decoded));
    EXPECT_TRUE(decoded.values == messages[i].values);
    EXPECT_EQ(decoded.header.table, static_cast<int32_t>(i));
  }
}

TEST(EncodingRefusesNoPartsTooManyAndPartialFloats) {
  std::string frame0;
  std::vector<float> payload;
  EXPECT_TRUE((EncodeBatch(0, 1, {}, &frame0, &payload).code() == StatusCode::kInvalidArgument));
  const Encoded one = Rows(0, 1, 1.f);
  EXPECT_TRUE((EncodeBatch(0, 1, std::vector<FramePair>(kMaxBatchParts + 1, one.pair()), &frame0, &payload).code() == StatusCode::kInvalidArgument));
  FramePair odd = one.pair();
  odd.payload_bytes = 5;
  EXPECT_TRUE((EncodeBatch(0, 1, {odd}, &frame0, &payload).code() == StatusCode::kInvalidArgument));
}

// A valid two-part batch to break in the tests below.
struct Batch {
  std::string frame0;
  std::vector<float> payload;
};
Batch TwoParts() {
  const Encoded a = Rows(0, 2, 1.f), b = Rows(1, 1, 9.f);
  Batch batch;
  EXPECT_TRUE(EncodeBatch(1, 0, {a.pair(), b.pair()}, &batch.frame0, &batch.payload).ok());
  return batch;
}

void ExpectCorrupt(const Batch& batch, size_t payload_bytes, const char* why) {
  std::vector<FramePair> parts;
  int sender = -1, receiver = -1;
  std::vector<unsigned char> payload(payload_bytes + 1, 0);
  if (!batch.payload.empty()) std::memcpy(payload.data(), batch.payload.data(), std::min(payload_bytes, batch.payload.size() * 4));
  const Status s =
      DecodeBatch(batch.frame0.data(), batch.frame0.size(), payload.data(), payload_bytes, &parts, &sender, &receiver);
  if (s.code() != StatusCode::kCorruptMessage) testing::ReportFailure(__FILE__, __LINE__, std::string("accepted: ") + why);
  EXPECT_TRUE(parts.empty());
}

TEST(DecodingRefusesEveryMalformedEnvelope) {
  const Batch good = TwoParts();
  const size_t bytes = good.payload.size() * sizeof(float);
  ExpectCorrupt(good, bytes - 4, "a payload frame shorter than the parts claim");
  ExpectCorrupt(good, bytes + 4, "payload bytes no part claims");
  Batch cut = good;
  cut.frame0.resize(cut.frame0.size() - 1);
  ExpectCorrupt(cut, bytes, "frame 0 shorter than its header says");
  Batch empty = good;
  empty.frame0.resize(kHeader);
  const uint32_t zero = 0;
  std::memcpy(&empty.frame0[offsetof(MessageHeader, text_bytes)], &zero, 4);
  ExpectCorrupt(empty, 0, "a batch of no parts");
  Batch spans = good;
  const uint32_t one = 1;
  std::memcpy(&spans.frame0[offsetof(MessageHeader, num_spans)], &one, 4);
  ExpectCorrupt(spans, bytes, "an envelope with spans");
  Batch overlong = good;
  const uint64_t huge = uint64_t{1} << 40;
  std::memcpy(&overlong.frame0[kHeader], &huge, 8);  // the first entry's frame 0 size
  ExpectCorrupt(overlong, bytes, "a part's frame 0 past the end");
  Batch greedy = good;
  std::memcpy(&greedy.frame0[kHeader + 8], &huge, 8);  // the first entry's payload size
  ExpectCorrupt(greedy, bytes, "a part's payload past the end");
  Batch partial = good;
  const uint64_t six = 6;
  std::memcpy(&partial.frame0[kHeader + 8], &six, 8);
  ExpectCorrupt(partial, bytes, "a payload of part of a float");
  Batch trailing = good;
  trailing.frame0.append(8, '\0');
  const uint32_t longer = static_cast<uint32_t>(trailing.frame0.size() - kHeader);
  std::memcpy(&trailing.frame0[offsetof(MessageHeader, text_bytes)], &longer, 4);
  ExpectCorrupt(trailing, bytes, "half an entry at the end");
}

TEST(ABatchWhereOneMessageBelongsIsRefused) {
  const Batch batch = TwoParts();
  Message out;
  const Status s = DecodeMessage(batch.frame0.data(), batch.frame0.size(), batch.payload.data(),
                                 batch.payload.size() * sizeof(float), &out);
  EXPECT_TRUE((s.code() == StatusCode::kCorruptMessage));
  const Encoded plain = Rows(0, 1, 1.f);
  EXPECT_TRUE(!IsBatch(plain.frame0.data(), plain.frame0.size()));
  EXPECT_TRUE(!IsBatch(plain.frame0.data(), 10));
}

TEST(FuzzedEnvelopesNeverReadPastTheirFrames) {
  std::mt19937_64 rng(17);
  const Batch good = TwoParts();
  for (int i = 0; i < 20000; ++i) {
    Batch mutated = good;
    const size_t where = rng() % mutated.frame0.size();
    mutated.frame0[where] = static_cast<char>(rng());
    if (rng() % 4 == 0) mutated.frame0.resize(rng() % (mutated.frame0.size() + 1));
    // Exact-size heap copies, so that a read past either frame is a real overrun.
    std::vector<char> frame0(mutated.frame0.begin(), mutated.frame0.end());
    size_t payload_bytes = good.payload.size() * sizeof(float);
    if (rng() % 4 == 0) payload_bytes = rng() % (payload_bytes + 9);
    std::vector<unsigned char> payload(payload_bytes);
    std::vector<FramePair> parts;
    int sender = -1, receiver = -1;
    const Status s = DecodeBatch(frame0.data(), frame0.size(), payload.data(), payload.size(), &parts, &sender,
                                 &receiver);
    if (!s.ok()) {
      EXPECT_TRUE((s.code() == StatusCode::kCorruptMessage));
      continue;
    }
    size_t claimed = 0;
    for (const FramePair& part : parts) {
      const auto* begin = static_cast<const char*>(part.frame0);
      EXPECT_TRUE(begin >= frame0.data() && begin + part.frame0_bytes <= frame0.data() + frame0.size());
      claimed += part.payload_bytes;
    }
    EXPECT_EQ(claimed, payload.size());
  }
}

}  // namespace
}  // namespace mltuner

MLT_TEST_MAIN
