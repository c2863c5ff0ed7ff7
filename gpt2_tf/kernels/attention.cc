// Gpt2CausalAttention: the original's attention over one whole sequence (no past), each query against the keys
//   up to its own position, for q, k, v [B, H, T, F] -> a [B, H, T, F] and each query's log-sum-exp [B, H, T].
// Gpt2CausalAttentionGrad: its gradient, from q, k, v, the log-sum-exp and a's gradient -> dq, dk, dv.
//
// The original scores w = (q . k) / sqrt(F), sets every later key's to -1e10 (whose softmax weight, exp(-1e10 -
// max), is 0 in float32), softmaxes and sums the values. TensorFlow's ops hold those scores and weights whole,
// [B, H, T, T] a layer (48 MB for 12 heads at T = 1024), and read and write them once an op: the mask, the scale,
// the softmax, and in the backward pass the softmax's gradient, each a pass over memory. Here a unit of work is
// one head's block of kBlock queries: its scores against the keys it sees stay in the caches ([kBlock, T] floats,
// 256 KB at T = 1024), a later key is skipped rather than masked, and the two products are Eigen's. The backward
// pass takes one head a unit, its blocks in turn: it recomputes the weights from the scores and the saved
// log-sum-exp (p = exp(w - lse), over its row's sum: with scores in the tens to hundreds, lse's rounding alone put
// dq and dk 3-12x further from float64 than TensorFlow's ops) and adds each block's share to the head's dk and
// dv, which it alone writes.
//
// The sums run in another float32 order than TensorFlow's ops; the tests hold both to the original graph's
// tolerance, forward and backward. Inputs where the original's later keys do not get 0 stay apart: every score a
// query sees below -1e10 (the original's weight goes to the later keys), or inf or NaN in a later key or value
// (the original's earlier rows turn NaN; here they stay finite, or, for a value, NaN only within its block).
//
// A library of its own (gpt2_tf.kernels builds it apart from matmul.cc's): linked with matmul.cc, the linker kept
// that source's copy of Eigen's AVX-512 product kernel for both, which ran this attention at half the speed (an
// Intel Xeon with AVX-512: 20 against 10 ms a 124M layer at T = 1024).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <functional>

#include "Eigen/Core"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/platform/blocking_counter.h"

using namespace tensorflow;

namespace {

using Matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using Rows = Eigen::Map<const Matrix>;  // rows of a [.., T, F] input, in place
using OutRows = Eigen::Map<Matrix>;

constexpr int64_t kBlock = 64;  // queries a unit of work

struct Heads {
  const float *q, *k, *v;  // [B * H, T, F]
  int64_t heads, T, F;     // heads: B * H
  float scale;             // 1 / sqrt(F)

  int64_t blocks() const { return (T + kBlock - 1) / kBlock; }
  // Block c's first query and its count; it sees keys [0, first + count).
  int64_t first(int64_t c) const { return c * kBlock; }
  int64_t count(int64_t c) const { return std::min(kBlock, T - c * kBlock); }
  Rows rows(const float* x, int64_t head, int64_t start, int64_t n) const {
    return Rows(x + (head * T + start) * F, n, F);
  }
};

// fn(unit) for every unit in [0, units), on the pool's threads and the calling one, each taking the next unit
// left: units that cost differently (blocks late in a sequence see more keys) still share out evenly.
void ForEach(OpKernelContext* context, int64_t units, const std::function<void(int64_t)>& fn) {
  auto* workers = context->device()->tensorflow_cpu_worker_threads();
  std::atomic<int64_t> next{0};
  auto work = [&]() {
    for (int64_t u = next.fetch_add(1); u < units; u = next.fetch_add(1)) fn(u);
  };
  const int64_t helpers = std::max<int64_t>(0, std::min<int64_t>(workers->num_threads, units) - 1);
  BlockingCounter done(static_cast<int>(helpers));
  for (int64_t i = 0; i < helpers; ++i) {
    workers->workers->Schedule([&]() {
      work();
      done.DecrementCount();
    });
  }
  work();
  done.Wait();
}

// Block c of a head: its scores s [count, seen keys] -> the softmaxed weights, 0 past each query's own position;
// lse[i] = max + log(sum of exp): each query's log-sum-exp of its scores.
void Softmax(const Heads& t, int64_t c, Matrix* s, float* lse) {
  for (int64_t i = 0; i < s->rows(); ++i) {
    const int64_t seen = t.first(c) + i + 1;
    auto w = s->row(i).head(seen).array();
    w *= t.scale;
    const float top = w.maxCoeff();
    w = (w - top).exp();
    const float total = w.sum();
    w /= total;
    s->row(i).tail(s->cols() - seen).setZero();
    lse[i] = top + std::log(total);
  }
}

// Unit u: block c of head h, the heaviest blocks (the last) first.
void Forward(const Heads& t, int64_t u, float* a, float* lse) {
  const int64_t c = t.blocks() - 1 - u / t.heads, h = u % t.heads;
  const int64_t start = t.first(c), n = t.count(c), seen = start + n;
  Matrix s(n, seen);
  s.noalias() = t.rows(t.q, h, start, n) * t.rows(t.k, h, 0, seen).transpose();
  Softmax(t, c, &s, lse + h * t.T + start);
  OutRows(a + (h * t.T + start) * t.F, n, t.F).noalias() = s * t.rows(t.v, h, 0, seen);
}

// Head h's gradients: dq's rows block by block, dk's and dv's as sums over the blocks that see them.
void Backward(const Heads& t, int64_t h, const float* lse, const float* da, float* dq, float* dk, float* dv) {
  OutRows dK(dk + h * t.T * t.F, t.T, t.F), dV(dv + h * t.T * t.F, t.T, t.F);
  dK.setZero();
  dV.setZero();
  Matrix p, dp;
  for (int64_t c = 0; c < t.blocks(); ++c) {
    const int64_t start = t.first(c), n = t.count(c), seen = start + n;
    const Rows q = t.rows(t.q, h, start, n), k = t.rows(t.k, h, 0, seen), v = t.rows(t.v, h, 0, seen);
    const Rows d = t.rows(da, h, start, n);
    p.resize(n, seen);
    dp.resize(n, seen);
    p.noalias() = q * k.transpose();
    dp.noalias() = d * v.transpose();
    for (int64_t i = 0; i < n; ++i) {  // p: the weights again; dp: the scores' gradient, the softmax's and scale's
      const int64_t sees = start + i + 1;
      auto w = p.row(i).head(sees).array();
      w = (w * t.scale - lse[h * t.T + start + i]).exp();
      w /= w.sum();  // lse's own rounding (up to half an ulp of lse) scales the whole row by one factor: taken out
      p.row(i).tail(seen - sees).setZero();
      auto g = dp.row(i).head(sees).array();
      g = w * (g - (w * g).sum()) * t.scale;
      dp.row(i).tail(seen - sees).setZero();
    }
    dV.topRows(seen).noalias() += p.transpose() * d;
    OutRows(dq + (h * t.T + start) * t.F, n, t.F).noalias() = dp * k;
    dK.topRows(seen).noalias() += dp.transpose() * q;
  }
}

// [B, H, T]: one log-sum-exp per query, for q's shape [B, H, T, F].
TensorShape LseShape(const TensorShape& q) { return TensorShape({q.dim_size(0), q.dim_size(1), q.dim_size(2)}); }

// Inputs 0-2, q, k and v, checked against each other -> t.
Status CheckedHeads(OpKernelContext* context, Heads* t) {
  const Tensor &q = context->input(0), &k = context->input(1), &v = context->input(2);
  if (q.dims() != 4 || q.shape() != k.shape() || q.shape() != v.shape() || q.dim_size(3) == 0) {
    return errors::InvalidArgument("q, k and v must be float32 [batch, heads, sequence, features > 0] alike, got ",
                                   q.shape().DebugString(), ", ", k.shape().DebugString(), ", ",
                                   v.shape().DebugString());
  }
  const int64_t F = q.dim_size(3);
  *t = Heads{q.flat<float>().data(), k.flat<float>().data(), v.flat<float>().data(),
             q.dim_size(0) * q.dim_size(1), q.dim_size(2), F, 1.0f / std::sqrt(static_cast<float>(F))};
  return OkStatus();
}

class CausalAttentionOp : public OpKernel {
 public:
  explicit CausalAttentionOp(OpKernelConstruction* context) : OpKernel(context) {}

  void Compute(OpKernelContext* context) override {
    Heads t;
    OP_REQUIRES_OK(context, CheckedHeads(context, &t));
    const TensorShape& shape = context->input(0).shape();
    Tensor *a = nullptr, *lse = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, shape, &a));
    OP_REQUIRES_OK(context, context->allocate_output(1, LseShape(shape), &lse));
    float *out = a->flat<float>().data(), *sums = lse->flat<float>().data();
    ForEach(context, t.heads * t.blocks(), [&](int64_t u) { Forward(t, u, out, sums); });
  }
};

class CausalAttentionGradOp : public OpKernel {
 public:
  explicit CausalAttentionGradOp(OpKernelConstruction* context) : OpKernel(context) {}

  void Compute(OpKernelContext* context) override {
    Heads t;
    OP_REQUIRES_OK(context, CheckedHeads(context, &t));
    const Tensor &lse = context->input(3), &da = context->input(4);
    const TensorShape& shape = context->input(0).shape();
    OP_REQUIRES(context, da.shape() == shape && lse.shape() == LseShape(shape),
                errors::InvalidArgument("da must be shaped as q ", shape.DebugString(), " and lse as its first three "
                                        "axes, got ", da.shape().DebugString(), " and ", lse.shape().DebugString()));
    Tensor *dq = nullptr, *dk = nullptr, *dv = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, shape, &dq));
    OP_REQUIRES_OK(context, context->allocate_output(1, shape, &dk));
    OP_REQUIRES_OK(context, context->allocate_output(2, shape, &dv));
    const float *sums = lse.flat<float>().data(), *grad = da.flat<float>().data();
    float *gq = dq->flat<float>().data(), *gk = dk->flat<float>().data(), *gv = dv->flat<float>().data();
    ForEach(context, t.heads, [&](int64_t h) { Backward(t, h, sums, grad, gq, gk, gv); });
  }
};

Status SameAsInputs(shape_inference::InferenceContext* c, int outputs) {
  shape_inference::ShapeHandle q;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 4, &q));
  for (int i = 0; i < outputs; ++i) c->set_output(i, q);
  return OkStatus();
}

}  // namespace

REGISTER_OP("Gpt2CausalAttention")
    .Input("q: float")
    .Input("k: float")
    .Input("v: float")
    .Output("a: float")
    .Output("lse: float")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      TF_RETURN_IF_ERROR(SameAsInputs(c, 1));
      shape_inference::ShapeHandle lse;
      TF_RETURN_IF_ERROR(c->Subshape(c->input(0), 0, 3, &lse));
      c->set_output(1, lse);
      return OkStatus();
    });

REGISTER_OP("Gpt2CausalAttentionGrad")
    .Input("q: float")
    .Input("k: float")
    .Input("v: float")
    .Input("lse: float")
    .Input("da: float")
    .Output("dq: float")
    .Output("dk: float")
    .Output("dv: float")
    .SetShapeFn([](shape_inference::InferenceContext* c) { return SameAsInputs(c, 3); });

REGISTER_KERNEL_BUILDER(Name("Gpt2CausalAttention").Device(DEVICE_CPU), CausalAttentionOp);
REGISTER_KERNEL_BUILDER(Name("Gpt2CausalAttentionGrad").Device(DEVICE_CPU), CausalAttentionGradOp);
