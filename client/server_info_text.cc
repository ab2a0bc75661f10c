#include "client/server_info_text.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace mlaverify::client {

std::string FormatServerInfo(const v1::ServerInfo& info) {
  std::string text;
  absl::StrAppendFormat(&text, "version:               %s\n", info.version());
  absl::StrAppendFormat(&text, "instance:              %s\n", info.instance_id());
  absl::StrAppendFormat(&text, "shared memory:         %s\n",
                        info.client_shared_memory() ? "accepted (system; CUDA on the CUDA backend)"
                                                    : "off (--allow-client-shm)");
  absl::StrAppendFormat(&text, "backend:               %s (%s mode, %d heads per device, %s)\n",
                        info.backend(), info.parallel_mode(), info.heads_per_device(),
                        info.cuda_graphs() ? "CUDA graphs per bucket" : "eager launches");
  for (int d = 0; d < info.devices_size(); ++d) {
    absl::StrAppendFormat(&text, "device %d:              %s (%.1f GiB)\n", d,
                          info.devices(d).name(),
                          static_cast<double>(info.devices(d).memory_bytes()) / (1 << 30));
  }
  absl::StrAppendFormat(&text, "layers:                %d\n", info.num_layers());
  absl::StrAppendFormat(&text, "heads:                 %d\n", info.num_heads());
  absl::StrAppendFormat(&text, "latent dim:            %d (value %d + rope %d)\n",
                        info.latent_dim(), info.value_dim(), info.rope_dim());
  absl::StrAppendFormat(&text, "page size:             %d tokens\n", info.page_size());
  absl::StrAppendFormat(&text, "kv dtype:              %s (%d bytes per token and layer)\n",
                        info.kv_dtype(), info.kv_row_bytes());
  absl::StrAppendFormat(&text, "pages:                 %d free of %d\n", info.free_pages(),
                        info.total_pages());
  for (const v1::PoolInfo& pool : info.pools()) {
    absl::StrAppendFormat(&text, "  pool %-18s %d free of %d, %d sequences\n", pool.devices() + ":",
                          pool.free_pages(), pool.total_pages(), pool.live_sequences());
  }
  absl::StrAppendFormat(&text, "live sequences:        %d\n", info.live_sequences());
  absl::StrAppendFormat(&text, "max sequence length:   %d tokens\n", info.max_sequence_len());
  absl::StrAppendFormat(&text, "max draft length:      %d\n", info.max_draft_len());
  absl::StrAppendFormat(&text, "draft buckets:         %s\n",
                        absl::StrJoin(info.draft_buckets(), " "));
  absl::StrAppendFormat(&text, "batch buckets:         %s\n",
                        absl::StrJoin(info.batch_buckets(), " "));
  absl::StrAppendFormat(&text, "max batch:             %d items\n", info.max_batch());
  absl::StrAppendFormat(&text, "max message:           %d bytes\n", info.max_message_bytes());
  absl::StrAppendFormat(&text, "default softmax scale: %.6g\n", info.default_softmax_scale());
  absl::StrAppendFormat(
      &text, "limits:                %d queued calls, %d queued bytes, %d live sequences\n",
      info.max_queued_calls(), info.max_queued_bytes(), info.max_live_sequences());
  absl::StrAppendFormat(&text, "idle timeout:          %s\n",
                        info.idle_timeout_seconds() > 0
                            ? absl::StrCat(info.idle_timeout_seconds(), " s")
                            : std::string("none"));
  return text;
}

std::string ServerInfoSummaryLine(const v1::ServerInfo& info) {
  std::string devices;
  for (const v1::DeviceInfo& device : info.devices()) {
    absl::StrAppend(&devices, devices.empty() ? " on " : ", ", device.name());
  }
  return absl::StrFormat(
      "backend %s%s (%s mode, server %s), %d layers x %d heads, page %d tokens, %s KV, "
      "%d/%d pages free, max draft %d, max batch %d, softmax scale %.6g",
      info.backend(), devices, info.parallel_mode(), info.version(), info.num_layers(),
      info.num_heads(), info.page_size(), info.kv_dtype(), info.free_pages(), info.total_pages(),
      info.max_draft_len(), info.max_batch(), info.default_softmax_scale());
}

nlohmann::ordered_json ServerInfoToJson(const v1::ServerInfo& info) {
  nlohmann::ordered_json devices = nlohmann::ordered_json::array();
  for (const v1::DeviceInfo& device : info.devices()) {
    devices.push_back({{"name", device.name()}, {"memory_bytes", device.memory_bytes()}});
  }
  nlohmann::ordered_json pools = nlohmann::ordered_json::array();
  for (const v1::PoolInfo& pool : info.pools()) {
    pools.push_back({{"devices", pool.devices()},
                     {"total_pages", pool.total_pages()},
                     {"free_pages", pool.free_pages()},
                     {"live_sequences", pool.live_sequences()}});
  }
  return {
      {"version", info.version()},
      {"instance_id", info.instance_id()},
      {"backend", info.backend()},
      {"parallel_mode", info.parallel_mode()},
      {"heads_per_device", info.heads_per_device()},
      {"cuda_graphs", info.cuda_graphs()},
      {"client_shared_memory", info.client_shared_memory()},
      {"devices", devices},
      {"pools", pools},
      {"max_queued_calls", info.max_queued_calls()},
      {"max_queued_bytes", info.max_queued_bytes()},
      {"max_live_sequences", info.max_live_sequences()},
      {"num_layers", info.num_layers()},
      {"num_heads", info.num_heads()},
      {"latent_dim", info.latent_dim()},
      {"value_dim", info.value_dim()},
      {"rope_dim", info.rope_dim()},
      {"page_size", info.page_size()},
      {"kv_dtype", info.kv_dtype()},
      {"kv_row_bytes", info.kv_row_bytes()},
      {"total_pages", info.total_pages()},
      {"free_pages", info.free_pages()},
      {"max_draft_len", info.max_draft_len()},
      {"draft_buckets", std::vector<int>(info.draft_buckets().begin(), info.draft_buckets().end())},
      {"batch_buckets", std::vector<int>(info.batch_buckets().begin(), info.batch_buckets().end())},
      {"max_batch", info.max_batch()},
      {"max_message_bytes", info.max_message_bytes()},
      {"default_softmax_scale", info.default_softmax_scale()},
      {"idle_timeout_seconds", info.idle_timeout_seconds()},
      {"live_sequences", info.live_sequences()},
      {"max_sequence_len", info.max_sequence_len()},
  };
}

}  // namespace mlaverify::client
