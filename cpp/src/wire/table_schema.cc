#include "wire/table_schema.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "mltuner/config.h"

namespace mltuner {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the wire structs are copied as they lie in memory");

namespace {

constexpr int kMaxRuleKind = static_cast<int>(UpdateRuleKind::kAdamW);

// The fields `rule`'s formula reads (those UpdateRuleText prints); the
// others stay zero.
void PutRule(const UpdateRuleConfig& rule, TableSchemaRecord* record) {
  record->has_rule = 1;
  record->rule_kind = static_cast<uint8_t>(rule.kind);
  switch (rule.kind) {
    case UpdateRuleKind::kSgd:
      record->learning_rate = rule.learning_rate;
      record->momentum = rule.momentum;
      record->dampening = rule.dampening;
      record->nesterov = rule.nesterov ? 1 : 0;
      record->weight_decay = rule.weight_decay;
      break;
    case UpdateRuleKind::kDampedMomentum:
      record->learning_rate = rule.learning_rate;
      record->momentum = rule.momentum;
      break;
    case UpdateRuleKind::kAdam:
    case UpdateRuleKind::kAdamW:
      record->learning_rate = rule.learning_rate;
      record->beta1 = rule.beta1;
      record->beta2 = rule.beta2;
      record->epsilon = rule.epsilon;
      record->weight_decay = rule.weight_decay;
      record->amsgrad = rule.amsgrad ? 1 : 0;
      break;
    case UpdateRuleKind::kAdd:
      break;
  }
}

UpdateRuleConfig GetRule(const TableSchemaRecord& record) {
  UpdateRuleConfig rule;
  rule.kind = static_cast<UpdateRuleKind>(record.rule_kind);
  rule.learning_rate = record.learning_rate;
  rule.momentum = record.momentum;
  rule.dampening = record.dampening;
  rule.weight_decay = record.weight_decay;
  rule.beta1 = record.beta1;
  rule.beta2 = record.beta2;
  rule.epsilon = record.epsilon;
  rule.nesterov = record.nesterov == 1;
  rule.amsgrad = record.amsgrad == 1;
  return rule;
}

Status Corrupt(size_t table, const std::string& why) {
  return Status::CorruptMessage("table schema, table " + std::to_string(table) + ": " + why);
}

}  // namespace

std::string EncodeTableSchema(const std::vector<TableInfo>& tables) {
  TableSchemaHeader header;
  std::string out(sizeof(header), '\0');
  for (const TableInfo& table : tables) {
    if (table.local) continue;
    TableSchemaRecord record;
    record.id = table.id;
    // Names are at most 256 characters (checked where tables are created).
    record.name_bytes = static_cast<uint16_t>(std::min<size_t>(table.name.size(), UINT16_MAX));
    record.num_rows = table.num_rows;
    record.row_width = table.row_width;
    record.part_bytes = table.part_bytes;
    if (table.update_rule) PutRule(*table.update_rule, &record);
    out.append(reinterpret_cast<const char*>(&record), sizeof(record));
    out.append(table.name, 0, record.name_bytes);
    ++header.num_tables;
  }
  std::memcpy(&out[0], &header, sizeof(header));
  return out;
}

Status DecodeTableSchema(const std::string& bytes, std::vector<TableInfo>* out) {
  TableSchemaHeader header;
  if (bytes.size() < sizeof(header)) {
    return Status::CorruptMessage("table schema of " + std::to_string(bytes.size()) + " bytes: shorter than its " +
                                  std::to_string(sizeof(header)) + "-byte header");
  }
  std::memcpy(&header, bytes.data(), sizeof(header));
  if (header.version != kTableSchemaWireVersion) {
    return Status::CorruptMessage("table schema of version " + std::to_string(header.version) + ", expected " +
                                  std::to_string(kTableSchemaWireVersion));
  }
  if (header.record_bytes != sizeof(TableSchemaRecord)) {
    return Status::CorruptMessage("table schema records of " + std::to_string(header.record_bytes) +
                                  " bytes, expected " + std::to_string(sizeof(TableSchemaRecord)));
  }
  // Every table takes at least a record: a count the payload cannot hold is
  // refused before anything is allocated.
  const size_t room = (bytes.size() - sizeof(header)) / sizeof(TableSchemaRecord);
  if (header.num_tables > room) {
    return Status::CorruptMessage("table schema of " + std::to_string(bytes.size()) + " bytes cannot hold " +
                                  std::to_string(header.num_tables) + " tables");
  }
  std::vector<TableInfo> tables;
  tables.reserve(header.num_tables);
  size_t at = sizeof(header);
  for (size_t t = 0; t < header.num_tables; ++t) {
    TableSchemaRecord record;
    if (bytes.size() - at < sizeof(record)) return Corrupt(t, "truncated record");
    std::memcpy(&record, bytes.data() + at, sizeof(record));
    at += sizeof(record);
    if (bytes.size() - at < record.name_bytes) return Corrupt(t, "its name runs past the payload");
    if (record.id < 0 || record.num_rows <= 0 || record.row_width <= 0 || record.part_bytes < 0) {
      return Corrupt(t, "id " + std::to_string(record.id) + ", " + std::to_string(record.num_rows) + " x " +
                            std::to_string(record.row_width) + " rows, parts of " +
                            std::to_string(record.part_bytes) + " bytes");
    }
    if (record.has_rule > 1 || record.nesterov > 1 || record.amsgrad > 1 || record.rule_kind > kMaxRuleKind ||
        (record.has_rule == 0 && record.rule_kind != 0) || record.reserved[0] != 0 || record.reserved[1] != 0) {
      return Corrupt(t, "a flag other than 0 or 1, an unknown update rule kind " + std::to_string(record.rule_kind) +
                            ", or nonzero reserved bytes");
    }
    TableInfo info;
    info.id = record.id;
    info.name.assign(bytes.data() + at, record.name_bytes);
    at += record.name_bytes;
    info.num_rows = record.num_rows;
    info.row_width = record.row_width;
    info.part_bytes = record.part_bytes;
    if (record.has_rule == 1) info.update_rule = GetRule(record);
    tables.push_back(std::move(info));
  }
  if (at != bytes.size()) {
    return Status::CorruptMessage("table schema has " + std::to_string(bytes.size() - at) +
                                  " bytes after its last table");
  }
  *out = std::move(tables);
  return Status::Ok();
}

std::string DescribeTables(const std::vector<TableInfo>& tables) {
  std::string text;
  for (const TableInfo& table : tables) {
    if (table.local) continue;
    text += std::to_string(table.id) + ":" + table.name + ":" + std::to_string(table.num_rows) + ":" +
            std::to_string(table.row_width);
    if (table.update_rule) text += ":" + UpdateRuleText(*table.update_rule);
    if (table.part_bytes > 0) text += ":parts of " + std::to_string(table.part_bytes) + " B";
    text += ";";
  }
  return text;
}

}  // namespace mltuner
