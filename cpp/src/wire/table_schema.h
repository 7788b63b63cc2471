// The table schema on the wire: the text frame of a kReady message, so a
// shard can refuse a worker whose tables differ from its own. It holds the
// communicated tables (local ones never reach a shard) as fixed structs,
// little-endian, packed:
//
//   TableSchemaHeader (8 bytes), then per table a TableSchemaRecord
//   (64 bytes) followed by its name (name_bytes of UTF-8, no terminator).
//
// A rule's fields that its formula does not read are sent as zero, so two
// workers whose rules differ only there agree (as UpdateRuleText prints
// them). Equal tables encode to equal bytes: a shard compares the bytes and
// decodes only to describe a mismatch. Decoding checks every size first and
// returns kCorruptMessage, never reads past the buffer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "mltuner/status.h"
#include "mltuner/types.h"

namespace mltuner {

constexpr uint16_t kTableSchemaWireVersion = 2;  // 2: part_bytes

#pragma pack(push, 1)
struct TableSchemaHeader {
  uint16_t version = kTableSchemaWireVersion;
  uint16_t record_bytes = 64;  // sizeof(TableSchemaRecord): another layout is refused
  uint32_t num_tables = 0;
};
struct TableSchemaRecord {
  int32_t id = 0;
  uint16_t name_bytes = 0;  // the name follows the record
  uint8_t has_rule = 0;     // 0: the shard's rule (Config.update_rule); 1: the fields below
  uint8_t rule_kind = 0;    // UpdateRuleKind
  int64_t num_rows = 0;
  int64_t row_width = 0;
  float learning_rate = 0;  // the rule's fields; zero where the rule does not read them
  float momentum = 0;
  float dampening = 0;
  float weight_decay = 0;
  float beta1 = 0;
  float beta2 = 0;
  float epsilon = 0;
  uint8_t nesterov = 0;
  uint8_t amsgrad = 0;
  uint8_t reserved[2] = {0, 0};
  int64_t part_bytes = 0;   // TableInfo::part_bytes: how a clock's rows travel
};
#pragma pack(pop)
static_assert(sizeof(TableSchemaHeader) == 8, "TableSchemaHeader must stay 8 bytes");
static_assert(sizeof(TableSchemaRecord) == 64, "TableSchemaRecord must stay 64 bytes");
static_assert(offsetof(TableSchemaRecord, num_rows) == 8 && offsetof(TableSchemaRecord, learning_rate) == 24 &&
                  offsetof(TableSchemaRecord, nesterov) == 52 && offsetof(TableSchemaRecord, part_bytes) == 56,
              "TableSchemaRecord's layout is the wire format");

// The bytes of kReady's text frame for `tables` (local tables are left out).
std::string EncodeTableSchema(const std::vector<TableInfo>& tables);

// Parses and checks `bytes` into *out (kCorruptMessage with the reason on a
// short or trailing payload, a wrong version or record size, a name that
// overruns, an unknown rule kind, a flag other than 0 or 1, nonzero
// reserved bytes, or sizes <= 0, or a negative part_bytes).
Status DecodeTableSchema(const std::string& bytes, std::vector<TableInfo>* out);

// For messages: the communicated tables as one line
// ("0:name:rows:width;..." with ":<rule>" after the width of a table with its
// own update rule, and ":parts of N B" after that of a table split into parts).
std::string DescribeTables(const std::vector<TableInfo>& tables);

}  // namespace mltuner
