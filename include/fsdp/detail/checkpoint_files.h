#pragma once
// Durable files for the checkpoint layer and the writers that follow its commit protocol (a
// temporary folder, every file and the folder fsynced, then a rename): src/checkpoint and
// models/llama/hf_folder.cpp's Hugging Face exports. Not an API.
//
// Example:
//   const std::filesystem::path tmp = "out.tmp";
//   if (auto why = fsdp::checkpoint::detail::fsync_path(tmp / "model.safetensors", false)) fail(*why);
#include <filesystem>
#include <optional>
#include <string>

namespace fsdp::checkpoint::detail {

// fsync of the file `path` (a folder when `directory`: its entries, after renames into it).
// nullopt on success, else one line naming the path and the cause: "cannot open '<path>' to sync
// it: <errno text>" or "fsync of '<path>' failed: <errno text>", for the caller's own exception.
std::optional<std::string> fsync_path(const std::filesystem::path& path, bool directory);

}  // namespace fsdp::checkpoint::detail
