// The fixed structs that travel in a message's text frame: kFork's branch
// settings and kReady's table schema. They round-trip exactly, and every
// short, trailing, foreign or malformed payload is a Status, never a crash.
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "test_util.h"
#include "wire/branch_settings.h"
#include "wire/table_schema.h"

namespace mltuner {
namespace {

template <typename T>
void Patch(std::string* bytes, size_t offset, T value) {
  std::memcpy(&(*bytes)[offset], &value, sizeof(value));
}

BranchSettings Settings() {
  BranchSettings settings;
  settings.learning_rate = 0.1f;
  settings.momentum = 0.9f;
  settings.training = false;
  settings.slack = 2;
  return settings;
}

std::vector<TableInfo> Tables() {
  std::vector<TableInfo> tables(3);
  tables[0].id = 0;
  tables[0].name = "weights";
  tables[0].num_rows = 10;
  tables[0].row_width = 4;
  tables[0].part_bytes = 1 << 20;
  tables[1].id = 1;
  tables[1].name = "data";
  tables[1].num_rows = 5;
  tables[1].row_width = 2;
  tables[1].local = true;  // never on the wire
  tables[2].id = 2;
  tables[2].name = "bias";
  tables[2].num_rows = 1;
  tables[2].row_width = 4;
  UpdateRuleConfig rule;
  rule.kind = UpdateRuleKind::kAdam;
  rule.learning_rate = 0.001f;
  rule.amsgrad = true;
  tables[2].update_rule = rule;
  return tables;
}

TEST(BranchSettingsRoundTrip) {
  const std::string bytes = EncodeBranchSettings(7, Settings());
  EXPECT_EQ(bytes.size(), sizeof(BranchSettingsWire));
  BranchId parent = -1;
  BranchSettings out;
  ASSERT_OK(DecodeBranchSettings(bytes, &parent, &out));
  EXPECT_EQ(parent, 7);
  EXPECT_EQ(out.learning_rate, 0.1f);
  EXPECT_EQ(out.momentum, 0.9f);
  EXPECT_EQ(out.training, false);
  EXPECT_EQ(out.slack, 2);
  EXPECT_EQ(out.keep_rate_ratios, false);
  BranchSettings ratios = Settings();
  ratios.keep_rate_ratios = true;
  ASSERT_OK(DecodeBranchSettings(EncodeBranchSettings(7, ratios), &parent, &out));
  EXPECT_EQ(out.keep_rate_ratios, true);
}

TEST(BranchSettingsRejectShortLongAndForeignPayloads) {
  const std::string good = EncodeBranchSettings(1, Settings());
  BranchId parent = 42;
  BranchSettings out;
  for (size_t n = 0; n < good.size(); ++n) {
    EXPECT_CODE(DecodeBranchSettings(good.substr(0, n), &parent, &out), StatusCode::kCorruptMessage);
  }
  EXPECT_CODE(DecodeBranchSettings(good + "x", &parent, &out), StatusCode::kCorruptMessage);
  std::string version = good;
  Patch<uint16_t>(&version, 0, 1);  // the version before keep_rate_ratios
  EXPECT_CODE(DecodeBranchSettings(version, &parent, &out), StatusCode::kCorruptMessage);
  std::string size = good;
  Patch<uint16_t>(&size, 2, 28);
  EXPECT_CODE(DecodeBranchSettings(size, &parent, &out), StatusCode::kCorruptMessage);
  std::string training = good;
  training[20] = 2;
  EXPECT_CODE(DecodeBranchSettings(training, &parent, &out), StatusCode::kCorruptMessage);
  std::string ratios = good;
  ratios[21] = 2;
  EXPECT_CODE(DecodeBranchSettings(ratios, &parent, &out), StatusCode::kCorruptMessage);
  std::string reserved = good;
  reserved[23] = 1;
  EXPECT_CODE(DecodeBranchSettings(reserved, &parent, &out), StatusCode::kCorruptMessage);
  // The old text format is refused, not misread.
  EXPECT_CODE(DecodeBranchSettings("parent=0;lr=0.1;momentum=0;training=1;slack=-1", &parent, &out),
              StatusCode::kCorruptMessage);
  EXPECT_EQ(parent, 42);  // untouched by every refusal
}

TEST(BranchSettingsRejectValuesOutOfRange) {
  BranchId parent = -1;
  BranchSettings out;
  const auto with = [](size_t offset, auto value) {
    std::string bytes = EncodeBranchSettings(0, BranchSettings());
    Patch(&bytes, offset, value);
    return bytes;
  };
  EXPECT_CODE(DecodeBranchSettings(with(4, int32_t{-1}), &parent, &out), StatusCode::kInvalidArgument);
  EXPECT_CODE(DecodeBranchSettings(with(8, -2.0f), &parent, &out), StatusCode::kInvalidArgument);
  EXPECT_CODE(DecodeBranchSettings(with(8, std::nanf("")), &parent, &out), StatusCode::kInvalidArgument);
  EXPECT_CODE(DecodeBranchSettings(with(12, 1.0f), &parent, &out), StatusCode::kInvalidArgument);
  EXPECT_CODE(DecodeBranchSettings(with(16, int32_t{-2}), &parent, &out), StatusCode::kInvalidArgument);
  ASSERT_OK(DecodeBranchSettings(with(12, 0.0f), &parent, &out));  // no momentum is fine
}

TEST(TableSchemaRoundTripsCommunicatedTables) {
  const std::vector<TableInfo> tables = Tables();
  std::vector<TableInfo> out;
  ASSERT_OK(DecodeTableSchema(EncodeTableSchema(tables), &out));
  ASSERT_EQ(out.size(), 2u);  // the local table stays home
  EXPECT_EQ(out[0].name, std::string("weights"));
  EXPECT_EQ(out[0].num_rows, 10);
  EXPECT_EQ(out[0].part_bytes, 1 << 20);
  EXPECT_EQ(out[1].part_bytes, 0);
  EXPECT_TRUE(!out[0].update_rule);
  EXPECT_EQ(out[1].id, 2);
  ASSERT_TRUE(out[1].update_rule.has_value());
  EXPECT_TRUE(out[1].update_rule->kind == UpdateRuleKind::kAdam);
  EXPECT_EQ(out[1].update_rule->amsgrad, true);
  EXPECT_EQ(DescribeTables(out), DescribeTables(tables));
  std::vector<TableInfo> none;
  ASSERT_OK(DecodeTableSchema(EncodeTableSchema({}), &none));
  EXPECT_EQ(none.size(), 0u);
}

// Two workers agree when their rules differ only in fields the rule does not
// read, as UpdateRuleText prints them; a field it reads makes them differ.
TEST(TableSchemaSendsOnlyTheFieldsTheRuleReads) {
  std::vector<TableInfo> a = Tables();
  std::vector<TableInfo> b = Tables();
  b[2].update_rule->momentum = 0.5f;  // adam does not read momentum
  EXPECT_TRUE(EncodeTableSchema(a) == EncodeTableSchema(b));
  b[2].update_rule->beta2 = 0.99f;
  EXPECT_TRUE(EncodeTableSchema(a) != EncodeTableSchema(b));
  // Workers that would split a table's clock differently disagree.
  std::vector<TableInfo> c = Tables();
  c[0].part_bytes = 4 << 20;
  EXPECT_TRUE(EncodeTableSchema(a) != EncodeTableSchema(c));
  EXPECT_TRUE(DescribeTables(c).find(":parts of 4194304 B") != std::string::npos);
}

TEST(TableSchemaRejectsMalformedPayloads) {
  const std::string good = EncodeTableSchema(Tables());
  std::vector<TableInfo> out(1);
  for (size_t n = 0; n < good.size(); ++n) {
    EXPECT_CODE(DecodeTableSchema(good.substr(0, n), &out), StatusCode::kCorruptMessage);
  }
  EXPECT_CODE(DecodeTableSchema(good + "x", &out), StatusCode::kCorruptMessage);
  const auto patched = [&](size_t offset, auto value) {
    std::string bytes = good;
    Patch(&bytes, offset, value);
    return bytes;
  };
  EXPECT_CODE(DecodeTableSchema(patched(0, uint16_t{9}), &out), StatusCode::kCorruptMessage);    // version
  EXPECT_CODE(DecodeTableSchema(patched(2, uint16_t{48}), &out), StatusCode::kCorruptMessage);   // record size
  EXPECT_CODE(DecodeTableSchema(patched(4, uint32_t{~0u}), &out), StatusCode::kCorruptMessage);  // count
  const size_t record = sizeof(TableSchemaHeader);
  EXPECT_CODE(DecodeTableSchema(patched(record + 4, uint16_t{60000}), &out), StatusCode::kCorruptMessage);
  EXPECT_CODE(DecodeTableSchema(patched(record + 8, int64_t{0}), &out), StatusCode::kCorruptMessage);
  EXPECT_CODE(DecodeTableSchema(patched(record + 6, uint8_t{2}), &out), StatusCode::kCorruptMessage);
  EXPECT_CODE(DecodeTableSchema(patched(record + 7, uint8_t{3}), &out), StatusCode::kCorruptMessage);  // rule, no flag
  EXPECT_CODE(DecodeTableSchema(patched(record + 54, uint8_t{1}), &out), StatusCode::kCorruptMessage);
  EXPECT_CODE(DecodeTableSchema(patched(record + 56, int64_t{-1}), &out), StatusCode::kCorruptMessage);  // parts
  EXPECT_CODE(DecodeTableSchema("0:w:10:4;", &out), StatusCode::kCorruptMessage);  // the old text
  EXPECT_EQ(out.size(), 1u);  // untouched by every refusal
}

TEST(FuzzStructPayloads) {
  std::mt19937_64 rng(17);
  const std::string schema = EncodeTableSchema(Tables());
  const std::string settings = EncodeBranchSettings(3, Settings());
  for (int i = 0; i < 20000; ++i) {
    std::string s = schema;
    std::string b = settings;
    s[rng() % s.size()] = static_cast<char>(rng());
    b[rng() % b.size()] = static_cast<char>(rng());
    if (rng() % 4 == 0) s.resize(rng() % (s.size() + 8));
    std::vector<TableInfo> tables;
    const Status st = DecodeTableSchema(s, &tables);
    EXPECT_TRUE(st.ok() || st.code() == StatusCode::kCorruptMessage);
    BranchId parent;
    BranchSettings out;
    const Status sb = DecodeBranchSettings(b, &parent, &out);
    EXPECT_TRUE(sb.ok() || sb.code() == StatusCode::kCorruptMessage || sb.code() == StatusCode::kInvalidArgument);
  }
}

}  // namespace
}  // namespace mltuner

MLT_TEST_MAIN
