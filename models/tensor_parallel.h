#pragma once
// Tensor parallelism for the example models: registers their Linear and Embedding types with
// fsdp::tp (so ColwiseParallel / RowwiseParallel accept them).
namespace fsdp::models {

// Idempotent; call before parallelize_module on a model built from models::Linear/Embedding.
void register_tp_module_types();

}  // namespace fsdp::models
