// Gpt2Int8MatMul: float32 x times int8 weights with one float32 scale per output channel, -> float32.
//
//   transpose_w = false: w [K, N] (a conv1d's [nx, nf]), scale [N]:  y[m, n] = scale[n] * sum_k x[m, k] w[k, n]
//   transpose_w = true:  w [N, K] (wte's [n_vocab, n_embd]), scale [N]: y[m, n] = scale[n] * sum_k x[m, k] w[n, k]
//
// The weights are read as int8 and widened to float32 in registers next to the multiply, so a product reads
// a quarter of the bytes a float32 one does; sums are float32. Output channels are split over TensorFlow's
// intra-op threads. Rows of x are taken a few at a time, so each weight byte read serves all of them.

#include <algorithm>
#include <cstdint>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/util/work_sharder.h"

using namespace tensorflow;

REGISTER_OP("Gpt2Int8MatMul")
    .Input("x: float")
    .Input("w: int8")
    .Input("scale: float")
    .Output("y: float")
    .Attr("transpose_w: bool = false")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      bool transpose_w;
      TF_RETURN_IF_ERROR(c->GetAttr("transpose_w", &transpose_w));
      shape_inference::ShapeHandle x, w;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &x));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 2, &w));
      c->set_output(0, c->Matrix(c->Dim(x, 0), c->Dim(w, transpose_w ? 0 : 1)));
      return OkStatus();
    });

namespace {

constexpr int kRows = 4;      // rows of x per pass over a block of weights
constexpr int kColumns = 64;  // output channels per block of the [K, N] layout: one cache line of int8

// y[m0:m0+ROWS, n0:n0+COLS] for w [K, N]: a block of output channels over the whole of K.
template <int ROWS, int COLS>
void ColumnBlock(const float* __restrict x, const int8_t* __restrict w, const float* __restrict scale,
                 float* __restrict y, int64_t K, int64_t N, int64_t m0, int64_t n0) {
  float acc[ROWS][COLS] = {};
  for (int64_t k = 0; k < K; ++k) {
    const int8_t* row = w + k * N + n0;
    float wide[COLS];
    for (int j = 0; j < COLS; ++j) wide[j] = static_cast<float>(row[j]);
    for (int r = 0; r < ROWS; ++r) {
      const float xk = x[(m0 + r) * K + k];
      for (int j = 0; j < COLS; ++j) acc[r][j] += xk * wide[j];
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < COLS; ++j) y[(m0 + r) * N + n0 + j] = acc[r][j] * scale[n0 + j];
}

// The last, narrower block.
template <int ROWS>
void ColumnTail(const float* x, const int8_t* w, const float* scale, float* y, int64_t K, int64_t N,
                int64_t m0, int64_t n0) {
  for (int r = 0; r < ROWS; ++r)
    for (int64_t n = n0; n < N; ++n) {
      float sum = 0.0f;
      for (int64_t k = 0; k < K; ++k) sum += x[(m0 + r) * K + k] * static_cast<float>(w[k * N + n]);
      y[(m0 + r) * N + n] = sum * scale[n];
    }
}

// y[m0:m0+ROWS, n] for w [N, K]: one output channel as dot products along a contiguous row of w.
template <int ROWS>
void RowDot(const float* x, const int8_t* w, const float* scale, float* y, int64_t K, int64_t N,
            int64_t m0, int64_t n) {
  constexpr int kLanes = 16;  // independent partial sums, so the loop vectorizes without reassociation
  float acc[ROWS][kLanes] = {};
  const int8_t* row = w + n * K;
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    float wide[kLanes];
    for (int j = 0; j < kLanes; ++j) wide[j] = static_cast<float>(row[k + j]);
    for (int r = 0; r < ROWS; ++r)
      for (int j = 0; j < kLanes; ++j) acc[r][j] += x[(m0 + r) * K + k + j] * wide[j];
  }
  for (int r = 0; r < ROWS; ++r) {
    float sum = 0.0f;
    for (int j = 0; j < kLanes; ++j) sum += acc[r][j];
    for (int64_t t = k; t < K; ++t) sum += x[(m0 + r) * K + t] * static_cast<float>(row[t]);
    y[(m0 + r) * N + n] = sum * scale[n];
  }
}

template <int ROWS>
void Rows(bool transpose_w, const float* x, const int8_t* w, const float* scale, float* y, int64_t K, int64_t N,
          int64_t m0, int64_t start, int64_t limit) {
  if (transpose_w) {
    for (int64_t n = start; n < limit; ++n) RowDot<ROWS>(x, w, scale, y, K, N, m0, n);
  } else {
    for (int64_t b = start; b < limit; ++b) {
      const int64_t n0 = b * kColumns;
      if (n0 + kColumns <= N) {
        ColumnBlock<ROWS, kColumns>(x, w, scale, y, K, N, m0, n0);
      } else {
        ColumnTail<ROWS>(x, w, scale, y, K, N, m0, n0);
      }
    }
  }
}

class Int8MatMulOp : public OpKernel {
 public:
  explicit Int8MatMulOp(OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("transpose_w", &transpose_w_));
  }

  void Compute(OpKernelContext* context) override {
    const Tensor& x = context->input(0);
    const Tensor& w = context->input(1);
    const Tensor& scale = context->input(2);
    OP_REQUIRES(context, x.dims() == 2 && w.dims() == 2 && scale.dims() == 1,
                errors::InvalidArgument("x and w must be matrices and scale a vector"));
    const int64_t M = x.dim_size(0), K = x.dim_size(1);
    const int64_t N = transpose_w_ ? w.dim_size(0) : w.dim_size(1);
    OP_REQUIRES(context, (transpose_w_ ? w.dim_size(1) : w.dim_size(0)) == K && scale.dim_size(0) == N,
                errors::InvalidArgument("x [M, K], w and scale do not agree"));
    Tensor* y = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, TensorShape({M, N}), &y));
    const float* xs = x.flat<float>().data();
    const int8_t* ws = w.flat<int8_t>().data();
    const float* ss = scale.flat<float>().data();
    float* ys = y->flat<float>().data();
    const int64_t units = transpose_w_ ? N : (N + kColumns - 1) / kColumns;
    const int64_t cost = (transpose_w_ ? K : K * kColumns) * std::min<int64_t>(M, kRows) * 2;
    auto* threads = context->device()->tensorflow_cpu_worker_threads();
    const bool t = transpose_w_;
    for (int64_t m0 = 0; m0 < M; m0 += kRows) {
      const int64_t rows = std::min<int64_t>(kRows, M - m0);
      Shard(threads->num_threads, threads->workers, units, cost, [&](int64_t start, int64_t limit) {
        switch (rows) {
          case 4: Rows<4>(t, xs, ws, ss, ys, K, N, m0, start, limit); break;
          case 3: Rows<3>(t, xs, ws, ss, ys, K, N, m0, start, limit); break;
          case 2: Rows<2>(t, xs, ws, ss, ys, K, N, m0, start, limit); break;
          default: Rows<1>(t, xs, ws, ss, ys, K, N, m0, start, limit); break;
        }
      });
    }
  }

 private:
  bool transpose_w_;
};

}  // namespace

REGISTER_KERNEL_BUILDER(Name("Gpt2Int8MatMul").Device(DEVICE_CPU), Int8MatMulOp);
