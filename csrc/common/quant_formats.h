// The packed weight formats of torch_topg/formats.py: names, block sizes and row
// bytes, shared by the CPU kernels (cpu/quant_kernels.h) and the CUDA ones
// (cuda/quant.cuh). Torch-free and intrinsics-free; usable in device code.
#pragma once

#include <cstdint>
#include <string>

#if defined(__CUDACC__)
#define TOPG_HD __host__ __device__
#else
#define TOPG_HD
#endif

namespace topg::quant {

enum class Fmt : int { q8_0, q4_0, q4_1, q4_k, q5_k, q6_k, int8, int4, q5_0, q5_1 };

struct Format {
  Fmt fmt;
  int64_t block;        // weights per block (0: the whole row, int8)
  int64_t block_bytes;  // bytes per block (int8: the row's float32 scale)
  // Blocks per row of k weights; the activations are padded with zeros to blocks * block.
  TOPG_HD int64_t blocks(int64_t k) const { return block == 0 ? 1 : (k + block - 1) / block; }
  TOPG_HD int64_t row_bytes(int64_t k) const {
    return block == 0 ? block_bytes + k : blocks(k) * block_bytes;
  }
  // fp32 activations per row a kernel reads (a multiple of 32).
  TOPG_HD int64_t padded(int64_t k) const {
    return block == 0 ? (k + 31) / 32 * 32 : blocks(k) * block;
  }
};

// The format names of torch_topg/formats.py.
struct NamedFormat {
  const char* name;
  Format f;
};
inline constexpr NamedFormat kFormats[] = {
    {"q8_0", {Fmt::q8_0, 32, 34}},     {"q4_0", {Fmt::q4_0, 32, 18}},
    {"q4_1", {Fmt::q4_1, 32, 20}},     {"q5_0", {Fmt::q5_0, 32, 22}},
    {"q5_1", {Fmt::q5_1, 32, 24}},     {"q4_k", {Fmt::q4_k, 256, 144}},
    {"q5_k", {Fmt::q5_k, 256, 176}},   {"q6_k", {Fmt::q6_k, 256, 210}},
    {"int8", {Fmt::int8, 0, 4}},       {"int4_g32", {Fmt::int4, 32, 20}},
    {"int4_g64", {Fmt::int4, 64, 36}}, {"int4_g128", {Fmt::int4, 128, 68}},
};
inline const Format* find_format(const std::string& name) {
  for (const auto& nf : kFormats)
    if (name == nf.name) return &nf.f;
  return nullptr;
}
// int8 activations share one scale per act_group values: 256 for the K-quants (a weight
// super-block, as llama.cpp's Q8_K, so a super-block's products sum in int32), else 32.
// Model in Python: torch_topg.formats.activation_group.
TOPG_HD inline int64_t act_group(Fmt f) {
  return f == Fmt::q4_k || f == Fmt::q5_k || f == Fmt::q6_k ? 256 : 32;
}

// Formats whose rows take any k (the last group padded); the GGUF ones need whole blocks.
TOPG_HD inline bool pads(const Format& f) { return f.fmt == Fmt::int8 || f.fmt == Fmt::int4; }

}  // namespace topg::quant
