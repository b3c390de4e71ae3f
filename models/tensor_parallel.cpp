#include "models/tensor_parallel.h"

#include <mutex>

#include "fsdp/tensor_parallel/parallelize.h"
#include "models/gpt.h"

namespace fsdp::models {

void register_tp_module_types() {
  static std::once_flag once;
  std::call_once(once, [] {
    tp::register_linear_type<LinearImpl>("fsdp::models::Linear");
    tp::register_embedding_type<EmbeddingImpl>("fsdp::models::Embedding");
  });
}

}  // namespace fsdp::models
