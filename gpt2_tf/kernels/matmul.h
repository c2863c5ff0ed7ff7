// What the library's two translation units share: the ops' attributes and their shape check, read by the op's
// kernels in matmul.cc and by its XLA kernel in matmul_xla.cc, and the names of the custom calls between them.
// matmul_xla.cc alone includes XLA's op-kernel header, which takes most of a build's time to parse: apart, the
// two compile at once.

#ifndef GPT2_TF_KERNELS_MATMUL_H_
#define GPT2_TF_KERNELS_MATMUL_H_

#include <cstdint>
#include <type_traits>

#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor_shape.h"

namespace gpt2_tf {

// The op's attributes, as each of its kernels reads them.
struct Attrs {
  bool transpose_w = false;
  int64_t panel = 0;  // 0: the plain layout
  // XLA's custom call runs on this many of the library's threads (0: one per CPU this process may use; the
  // Python side writes TensorFlow's intra-op setting); the op itself runs on TensorFlow's intra-op threads.
  int64_t threads = 0;

  explicit Attrs(tensorflow::OpKernelConstruction* context) {
    OP_REQUIRES_OK(context, context->GetAttr("transpose_w", &transpose_w));
    if (context->HasAttr("panel")) OP_REQUIRES_OK(context, context->GetAttr("panel", &panel));
    OP_REQUIRES_OK(context, context->GetAttr("threads", &threads));
  }
};

struct Sizes {
  int64_t M, K, N, panel;  // panel: N for the plain layout
};

// x [M, K], w and scale (null for float32 weights) checked against each other and the attributes -> sizes.
tensorflow::Status Checked(const tensorflow::TensorShape& x, const tensorflow::TensorShape& w,
                           const tensorflow::TensorShape* scale, const Attrs& attrs, Sizes* sizes);

struct AttentionSizes {
  int64_t B, H, S, F;  // rows, heads, cache slots, features a head
};

// Gpt2CachedAttention's q [B, H, F], cache [B, 2, H, S, F] and mask [B, S], checked against each other -> sizes.
tensorflow::Status CheckedAttention(const tensorflow::TensorShape& q, const tensorflow::TensorShape& cache,
                                    const tensorflow::TensorShape& mask, AttentionSizes* sizes);

// int8 weights come with their scales (a third input), float32 ones alone.
template <typename W>
constexpr bool kScaled = std::is_same<W, int8_t>::value;

// The custom call XLA's kernel for weights W emits, and the library registers (matmul.cc).
template <typename W>
constexpr const char* kCallTarget = kScaled<W> ? "gpt2_tf_int8_matmul" : "gpt2_tf_float_matmul";

// The attention's custom call.
constexpr const char* kAttentionTarget = "gpt2_tf_cached_attention";

}  // namespace gpt2_tf

#endif  // GPT2_TF_KERNELS_MATMUL_H_
