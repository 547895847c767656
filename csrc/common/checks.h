// The argument checker (Arg, TOPG_CHECK) of every binding file, CPU and CUDA; the per-op
// checks built from it are in op_checks.h.
//
// Wording matches torch_topg/ops/_checks.py so the native kernels and the reference
// fallback fail the same way:
//   topg::<op>: argument '<name>' (shape [..], dtype .., device ..) expected <what>
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <initializer_list>
#include <sstream>
#include <string>

namespace topg {

// torch's Python spelling of a dtype ("bfloat16", not "BFloat16").
inline std::string dtype_name(at::ScalarType s) { return std::string(c10::getDtypeNames(s).first); }

inline std::string describe(const at::Tensor& t) {
  std::ostringstream s;
  s << "(shape " << t.sizes() << ", dtype " << dtype_name(t.scalar_type()) << ", device "
    << t.device() << ")";
  return s.str();
}

inline bool is_float_dtype(at::ScalarType s) {
  return s == at::kFloat || s == at::kBFloat16 || s == at::kHalf;
}

// Fluent checker for one tensor argument:
//   Arg(op, "weight", weight).dim(1).size(0, hidden).same_dtype(input, "input");
class Arg {
 public:
  Arg(const char* op, const char* name, const at::Tensor& t) : op_(op), name_(name), t_(t) {
    TORCH_CHECK(t.defined(), "topg::", op, ": argument '", name, "' expected a defined tensor");
  }

  [[noreturn]] void fail(const std::string& what) const {
    TORCH_CHECK(false, "topg::", op_, ": argument '", name_, "' ", describe(t_), " expected ",
                what);
  }

  const Arg& dim(int64_t n) const {
    if (t_.dim() != n) fail(std::to_string(n) + " dimensions");
    return *this;
  }
  const Arg& dim(std::initializer_list<int64_t> ns) const {
    for (int64_t n : ns)
      if (t_.dim() == n) return *this;
    std::string what;
    for (int64_t n : ns) what += (what.empty() ? "" : " or ") + std::to_string(n);
    fail(what + " dimensions");
  }
  const Arg& min_dim(int64_t n) const {
    if (t_.dim() < n) fail("at least " + std::to_string(n) + " dimensions");
    return *this;
  }
  const Arg& size(int64_t d, int64_t expected, const char* what = nullptr) const {
    if (t_.size(d) != expected)
      fail("size " + std::to_string(expected) + " at dim " + std::to_string(d) +
           (what ? std::string(" (") + what + ")" : std::string()));
    return *this;
  }
  const Arg& floating() const {
    if (!is_float_dtype(t_.scalar_type())) fail("dtype float32 or bfloat16 or float16");
    return *this;
  }
  const Arg& index() const {
    if (t_.scalar_type() != at::kInt && t_.scalar_type() != at::kLong) fail("dtype int32 or int64");
    return *this;
  }
  const Arg& dtype(at::ScalarType s) const {
    if (t_.scalar_type() != s) fail("dtype " + dtype_name(s));
    return *this;
  }
  const Arg& same_dtype(const at::Tensor& o, const char* oname) const {
    if (t_.scalar_type() != o.scalar_type())
      fail("dtype " + dtype_name(o.scalar_type()) + " (the dtype of '" + oname + "')");
    return *this;
  }
  const Arg& same_device(const at::Tensor& o, const char* oname) const {
    if (t_.device() != o.device())
      fail("device " + o.device().str() + " (the device of '" + oname + "')");
    return *this;
  }
  const Arg& device(c10::DeviceType type) const {
    if (t_.device().type() != type)
      fail(std::string("a tensor on ") + c10::DeviceTypeName(type, true));
    return *this;
  }
  const Arg& contiguous() const {
    if (!t_.is_contiguous()) fail("a contiguous tensor");
    return *this;
  }
  const Arg& last_dim_contiguous() const {
    if (t_.dim() > 0 && t_.size(-1) != 1 && t_.stride(-1) != 1)
      fail("stride 1 in the last dimension");
    return *this;
  }

 private:
  const char* op_;
  const char* name_;
  const at::Tensor& t_;
};

}  // namespace topg

// A check that concerns several arguments or a non-tensor argument.
#define TOPG_CHECK(cond, op, ...) TORCH_CHECK(cond, "topg::", op, ": ", __VA_ARGS__)
