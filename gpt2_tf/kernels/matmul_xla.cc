// The ops' kernels for XLA's CPU compilation device: once the shapes are known, each op becomes a custom call
// into matmul.cc's code (registered there), with the checked sizes in its config string. Linked into the
// library built with GPT2_TF_XLA only.

#include <string>
#include <vector>

#include "matmul.h"
#include "tensorflow/compiler/tf2xla/xla_op_kernel.h"
#include "xla/hlo/builder/xla_builder.h"
#include "xla/shape_util.h"

using namespace tensorflow;
using namespace gpt2_tf;

namespace {

template <typename W>
class MatMulXla : public XlaOpKernel {
 public:
  explicit MatMulXla(OpKernelConstruction* context) : XlaOpKernel(context), attrs_(context) {}

  void Compile(XlaOpKernelContext* context) override {
    Sizes n;
    const TensorShape scale = kScaled<W> ? context->InputShape(2) : TensorShape();
    OP_REQUIRES_OK(context, Checked(context->InputShape(0), context->InputShape(1), kScaled<W> ? &scale : nullptr,
                                    attrs_, &n));
    // "M K N panel transpose_w threads", as the custom call reads it
    const std::string config = std::to_string(n.M) + " " + std::to_string(n.K) + " " + std::to_string(n.N) + " " +
                               std::to_string(n.panel) + " " + (attrs_.transpose_w ? "1" : "0") + " " +
                               std::to_string(attrs_.threads);
    std::vector<xla::XlaOp> operands = {context->Input(0), context->Input(1)};
    if (kScaled<W>) operands.push_back(context->Input(2));
    context->SetOutput(0, xla::CustomCall(context->builder(), kCallTarget<W>, operands,
                                          xla::ShapeUtil::MakeShape(xla::F32, {n.M, n.N}), config,
                                          /*has_side_effect=*/false, /*output_operand_aliasing=*/{},
                                          /*literal=*/nullptr, xla::CustomCallSchedule::SCHEDULE_NONE,
                                          xla::CustomCallApiVersion::API_VERSION_STATUS_RETURNING_UNIFIED));
  }

 private:
  const Attrs attrs_;
};

class AttentionXla : public XlaOpKernel {
 public:
  explicit AttentionXla(OpKernelConstruction* context) : XlaOpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("threads", &threads_));
  }

  void Compile(XlaOpKernelContext* context) override {
    AttentionSizes n;
    OP_REQUIRES_OK(context, CheckedAttention(context->InputShape(0), context->InputShape(1),
                                             context->InputShape(2), &n));
    const std::string config = std::to_string(n.B) + " " + std::to_string(n.H) + " " +  // "B H S F threads", as
                               std::to_string(n.S) + " " + std::to_string(n.F) + " " +  // the custom call reads it
                               std::to_string(threads_);
    context->SetOutput(0, xla::CustomCall(context->builder(), kAttentionTarget,
                                          {context->Input(0), context->Input(1), context->Input(2)},
                                          xla::ShapeUtil::MakeShape(xla::F32, {n.B, n.H, n.F}), config,
                                          /*has_side_effect=*/false, /*output_operand_aliasing=*/{},
                                          /*literal=*/nullptr, xla::CustomCallSchedule::SCHEDULE_NONE,
                                          xla::CustomCallApiVersion::API_VERSION_STATUS_RETURNING_UNIFIED));
  }

 private:
  int64_t threads_;  // as Attrs' (matmul.h)
};

}  // namespace

// Registered directly: REGISTER_XLA_OP's registry is read once per process, at its first XLA compile, and this
// library may load after that.
REGISTER_KERNEL_BUILDER(Name("Gpt2Int8MatMul").Device(DEVICE_CPU_XLA_JIT), MatMulXla<int8_t>);
REGISTER_KERNEL_BUILDER(Name("Gpt2FloatMatMul").Device(DEVICE_CPU_XLA_JIT), MatMulXla<float>);
REGISTER_KERNEL_BUILDER(Name("Gpt2CachedAttention").Device(DEVICE_CPU_XLA_JIT), AttentionXla);
