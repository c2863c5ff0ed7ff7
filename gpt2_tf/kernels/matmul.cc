// Gpt2Int8MatMul: float32 x times int8 weights with one float32 scale per output channel, -> float32.
// Gpt2FloatMatMul: float32 x times float32 weights in the plain layout, for few rows of x (a decode step).
// Gpt2CachedAttention: a decode step's attention, one query a row, over a layer's float32 key/value cache: its
//   two small products and the softmax between them, reading the cache in place (see Attention below).
//
//   transpose_w = false: w holds [K, N] (a conv1d's [nx, nf]) in panels of `panel` columns, laid out
//     [N / panel, K, panel] (panel = N: the plain row-major [K, N]), scale [N]:
//     y[m, n] = scale[n] * sum_k x[m, k] w[k, n], with w[k, n] at ((n / panel) * K + k) * panel + n % panel
//   transpose_w = true:  w [N, K] (wte's [n_vocab, n_embd]), scale [N]: y[m, n] = scale[n] * sum_k x[m, k] w[n, k]
//
// The weights are read as int8 and widened to float32 in vector registers next to the multiply, so a product
// reads a quarter of the bytes a float32 one does; sums are float32. In the panel layout a block of output
// channels is one contiguous stream of int8 (the hardware prefetchers follow it; in the plain layout each k
// is a jump of N bytes, a new page every few rows). A register tile of ROWS rows of x times V vectors of
// output channels accumulates over the whole of K, then is scaled and stored. Vector width comes from the
// compiler's target (built with -march=native: AVX-512, AVX2, or plain C++ elsewhere). Blocks of output
// channels are split over TensorFlow's intra-op threads; all rows of x are done per block, so each weight
// byte comes from memory once.
//
// Built with GPT2_TF_XLA and linked with matmul_xla.cc, the op also compiles under XLA (tf.function(jit_compile=
// True)): it becomes a custom call into the same code, with the shapes fixed at compile time, on threads of this
// library's own and the calling one (XLA passes a custom call none). The decoding loops then run int8 models
// under XLA too.
//
// Float32 weights keep their plain [K, N] layout (training, saving and export read it), so a tile walking down
// a block of columns would jump N floats at every k. Their few-row product instead reads whole rows of w: below
// 17 rows of x (a decode step at batch 1-16), each thread a band of w's rows, one contiguous stream (from 7 rows
// on, each band's sums in register tiles a chunk of its rows at a time); from 17 rows on, a segment of columns a
// unit of work, its rows' runs copied into panels that stay in the caches. [N, K] weights (wte) take the same row
// tiles as int8's.

#define EIGEN_USE_THREADS  // Eigen's GEMM on TensorFlow's threads (before any Eigen header)

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor_types.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/util/work_sharder.h"

#include "matmul.h"

#ifdef GPT2_TF_XLA
#include "xla/service/custom_call_target_registry.h"
#endif

using namespace tensorflow;
using namespace gpt2_tf;

// y [M, N] from x [M, K] and w [K, N] (or [N, K] with transpose_w), for both ops.
Status ProductShape(shape_inference::InferenceContext* c) {
  bool transpose_w;
  TF_RETURN_IF_ERROR(c->GetAttr("transpose_w", &transpose_w));
  shape_inference::ShapeHandle x, w;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &x));
  TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 2, &w));
  c->set_output(0, c->Matrix(c->Dim(x, 0), c->Dim(w, transpose_w ? 0 : 1)));
  return OkStatus();
}

REGISTER_OP("Gpt2Int8MatMul")
    .Input("x: float")
    .Input("w: int8")
    .Input("scale: float")
    .Output("y: float")
    .Attr("transpose_w: bool = false")
    .Attr("panel: int = 0")  // 0: the plain [K, N] layout (panel = N)
    .Attr("threads: int = 0")  // XLA's custom call: see Attrs
    .SetShapeFn(ProductShape);

REGISTER_OP("Gpt2FloatMatMul")
    .Input("x: float")
    .Input("w: float")
    .Output("y: float")
    .Attr("transpose_w: bool = false")  // float32 weights keep the plain layout: no panels
    .Attr("threads: int = 0")
    .SetShapeFn(ProductShape);

REGISTER_OP("Gpt2CachedAttention")
    .Input("q: float")      // [B, H, F]: one query a row and head
    .Input("cache: float")  // [B, 2, H, S, F]: a layer's keys, then values, at S slots
    .Input("mask: float")   // [B, S]: 1 where the row's query sees the slot, else 0
    .Output("a: float")     // [B, H, F]
    .Attr("threads: int = 0")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      shape_inference::ShapeHandle q;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 3, &q));
      c->set_output(0, q);
      return OkStatus();
    });

namespace {

// One vector of float32 lanes, and int8 weights widened into it.
#if defined(__AVX512F__)
constexpr int kLanes = 16;
using Vec = __m512;
inline Vec Zero() { return _mm512_setzero_ps(); }
inline Vec Widen(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline Vec Load(const float* p) { return _mm512_loadu_ps(p); }
inline Vec Broadcast(float v) { return _mm512_set1_ps(v); }
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline void Store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec Widen(const float* p) { return Load(p); }
inline float Sum(Vec v) { return _mm512_reduce_add_ps(v); }
constexpr int kVectors = 4;  // a tile: up to 6 rows x 4 vectors of output channels, 24 of the 32 registers
constexpr int kMaxRows = 6;
constexpr int kTallRows = 8;  // from 7 rows on, tiles of up to 8 rows x 1 vector (8 sums)
constexpr int kTallVectors = 1;
constexpr int kRowChannels = 2;  // [N, K] layout, from 2 rows on: 2 channels x up to 8 rows (16 registers)
constexpr int kRowRows = 8;
constexpr int kRowVectors = 8;  // one row of x: a tile of 8 vectors, a whole int8 panel's row a k (16 registers)
#elif defined(__AVX2__)
constexpr int kLanes = 8;
using Vec = __m256;
inline Vec Zero() { return _mm256_setzero_ps(); }
inline Vec Widen(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline Vec Load(const float* p) { return _mm256_loadu_ps(p); }
inline Vec Broadcast(float v) { return _mm256_set1_ps(v); }
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline void Store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec Widen(const float* p) { return Load(p); }
inline float Sum(Vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}
constexpr int kVectors = 4;  // up to 2 rows x 4 vectors: 8 of the 16 registers, 4 sums in flight at 1 row
constexpr int kMaxRows = 2;
constexpr int kTallRows = 4;  // from 3 rows on, tiles of up to 4 rows x 2 vectors (8 registers)
constexpr int kTallVectors = 2;
constexpr int kRowChannels = 2;  // [N, K] layout, from 2 rows on: 2 channels x up to 4 rows (8 registers)
constexpr int kRowRows = 4;
// One row of x: a tile of 16 vectors, a whole int8 panel's row a k, its sums in all 16 registers (the compiler
// spills what else it needs). In AVX2's code on an Intel Xeon the 48 block products of a step took 3.5-3.7 ms so,
// 3.7-3.9 with 8 vectors and 4.9-5.9 with 4 (every fourth 32-byte run of the panel's stream a tile).
constexpr int kRowVectors = 16;
#else
constexpr int kLanes = 1;
using Vec = float;
inline Vec Zero() { return 0.0f; }
inline Vec Widen(const int8_t* p) { return static_cast<float>(*p); }
inline Vec Load(const float* p) { return *p; }
inline Vec Broadcast(float v) { return v; }
inline Vec Fma(Vec a, Vec b, Vec c) { return a * b + c; }
inline void Store(float* p, Vec v) { *p = v; }
inline Vec Widen(const float* p) { return *p; }
inline float Sum(Vec v) { return v; }
constexpr int kVectors = 8;
constexpr int kMaxRows = 4;
constexpr int kTallRows = kMaxRows;
constexpr int kTallVectors = kVectors;
constexpr int kRowChannels = 1;
constexpr int kRowRows = kMaxRows;
constexpr int kRowVectors = kVectors;
#endif

// The hardware prefetchers of some CPUs (seen on a virtualised AMD EPYC) follow one stream of int8 well and
// several interleaved ones badly: the loops ask for the weights kAhead ahead themselves (2.5x on wte's rows).
constexpr int64_t kAhead = 256;    // weights along a row of wte: 256 bytes of int8, 1 KB of float32
// Rows of a panel: 32 (4 KB of a 128-channel panel) rather than 8 took an Intel Xeon's 48 block products of a step
// at 8 rows from 13.4-14.7 to 10.9-13.6 ms (one round of three level; 32, 64 and 128 ahead level).
constexpr int64_t kRowsAhead = 32;
// From two rows of x on, the tiles also ask for lines further on into L2: a panel's kFarRows rows on (16 KB of
// int8) and wte's rows kFarChannels on (the first row tile of those channels), once per line. A decode step's
// products chained in an XLA loop (bench/bench_products.py --parts chained,logits, alternating, Zen 4; two
// rounds for the block products, one for the logits): the int8 block products, with whole-panel units
// (ColumnWidth), took 0.70-0.76x the time at 2 rows, 0.82-0.92x at 4, 0.88-0.89x at 8 and level at 1 and 16
// (AVX2's code 0.59-0.66x, 0.67-0.75x, 0.80-0.89x, 0.82-1.01x); the int8 logits 0.54x at 2 rows, 0.69x at 4,
// 0.81x at 8, 0.86x at 16 (AVX2's code 0.51-0.57x, 0.83-0.97x, 0.87x, 0.95x), and the float32 logits 0.75x and
// 0.73x at 4 and 8 rows (AVX2's code, two rounds: 0.51-0.57x and 0.60-0.62x, 0.80x at 16). Either change alone
// (the far lines with 64-channel units, or the units alone) left 8 rows level.
constexpr int64_t kFarRows = 128;
constexpr int64_t kFarChannels = 8;
template <typename W>
constexpr int64_t kLineElements = 64 / sizeof(W);  // weights in a cache line
inline void Prefetch(const void* p) {
#if defined(__AVX512F__) || defined(__AVX2__)
  _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0);
#endif
}
// Into L2 only: the float32 segments' chunks ask for the next chunk's rows while L1 holds the panels.
inline void PrefetchL2(const void* p) {
#if defined(__AVX512F__) || defined(__AVX2__)
  _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1);
#endif
}
// A line of a row of wte, kAhead on: int8's into L1; float32's, four times the lines, into L2, which keeps more
// misses in flight (one float32 row into L1 streamed 20-22 GB/s on a Zen 4, into L2 26-33, a plain read 28-36;
// int8's into L2 took 1.25x the time).
template <typename W>
inline void PrefetchRow(const W* p) {
  if constexpr (sizeof(W) == 1) {
    Prefetch(p + kAhead);
  } else {
    PrefetchL2(p + kAhead);
  }
}

constexpr int kBlock = kLanes * kVectors;    // output channels per tile (a unit of work where panels are narrower)

// W: int8_t (scale holds N scales) or float (scale is null).
template <typename W>
struct Problem {
  const float* x;
  const W* w;
  const float* scale;
  float* y;
  int64_t M, K, N, panel;
};

template <typename W>
inline Vec Scaled(const Problem<W>& p, int64_t n, Vec v) {
  return p.scale ? v * Load(p.scale + n) : v;
}
template <typename W>
inline float ScaleOf(const Problem<W>& p, int64_t n) {
  return p.scale ? p.scale[n] : 1.0f;
}

// y[m0:m0+R, n0:n0+V*kLanes] for the panel layout: V vectors of channels, whole of K, inside one panel.
template <int R, int V, typename W>
void Tile(const Problem<W>& p, int64_t m0, int64_t n0) {
  Vec acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = Zero();
  const W* w = p.w + (n0 / p.panel) * p.K * p.panel + n0 % p.panel;
  const float* x = p.x + m0 * p.K;
  for (int64_t k = 0; k < p.K; ++k, w += p.panel) {
    Prefetch(w + kRowsAhead * p.panel);  // the line this tile reads kRowsAhead rows on
    if constexpr (R > 1) PrefetchL2(w + kFarRows * p.panel);  // ... and kFarRows on
    Vec wide[V];
    for (int v = 0; v < V; ++v) wide[v] = Widen(w + v * kLanes);
    for (int r = 0; r < R; ++r) {
      const Vec xk = Broadcast(x[r * p.K + k]);
      for (int v = 0; v < V; ++v) acc[r][v] = Fma(xk, wide[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) {
      const int64_t n = n0 + v * kLanes;
      Store(p.y + (m0 + r) * p.N + n, Scaled(p, n, acc[r][v]));
    }
}

// Channels [n0, n1) one at a time, in plain C++: the tail of the plain layout.
template <typename W>
void Narrow(const Problem<W>& p, int64_t n0, int64_t n1) {
  for (int64_t m = 0; m < p.M; ++m)
    for (int64_t n = n0; n < n1; ++n) {
      const W* w = p.w + (n / p.panel) * p.K * p.panel + n % p.panel;
      float sum = 0.0f;
      for (int64_t k = 0; k < p.K; ++k) sum += p.x[m * p.K + k] * static_cast<float>(w[k * p.panel]);
      p.y[m * p.N + n] = sum * ScaleOf(p, n);
    }
}

// A tile function as a type, so that one row loop serves both layouts' tiles.
template <int R, int V>
struct PanelTile {
  template <typename W>
  static void Run(const Problem<W>& p, int64_t m0, int64_t n0) { Tile<R, V>(p, m0, n0); }
};

// One tile of `rows` rows of x (1 to R, known at run time) as T<rows, C>::Run(args...).
template <template <int, int> class T, int R, int C, typename... Args>
void ByRows(int64_t rows, const Args&... args) {
  if (rows == R) {
    T<R, C>::Run(args...);
  } else if constexpr (R > 1) {
    ByRows<T, R - 1, C>(rows, args...);
  }
}

// Rows [0, M) in the fewest tiles of at most Rows rows, as even as they go (9 rows in tiles of 8: 4 and 5, not 8
// and 1, whose few sums would wait on the multiply-add's latency): tile(t, first row, rows) for each in turn.
template <int Rows, typename Fn>
void EvenTiles(int64_t M, const Fn& tile) {
  const int64_t tiles = (M + Rows - 1) / Rows;
  for (int64_t t = 0, r0 = 0; t < tiles; ++t) {
    const int64_t rows = (M - r0) / (tiles - t);
    tile(t, r0, rows);
    r0 += rows;
  }
}

// Every row of x for the C-wide channel group at n0, in tiles of at most Rows rows.
template <template <int, int> class T, int C, int Rows = kMaxRows, typename W>
void AllRows(const Problem<W>& p, int64_t n0) {
  EvenTiles<Rows>(p.M, [&](int64_t, int64_t m, int64_t rows) { ByRows<T, Rows, C>(rows, p, m, n0); });
}

// Output channels a unit of the panel layout: kRowWidth (a whole 128-channel panel, so that one thread reads
// each of its lines) where a panel holds a whole number of them, else kBlock. At one row of x a unit is one tile
// of kRowVectors vectors, reading the whole of each of the panel's rows (one contiguous stream, where AVX-512's
// two 64-channel tiles each read every other cache line: a step's 48 block products at one row took 5.3-6.0
// against 9.2-10.1 ms on an Intel Xeon with AVX-512); from two rows on, kBlock-wide tiles in turn (see kFarRows).
constexpr int64_t kRowWidth = kLanes * kRowVectors;

template <typename W>
int64_t ColumnWidth(const Problem<W>& p) {
  return p.panel % kRowWidth == 0 ? kRowWidth : kBlock;
}

// The kBlock output channels at n0, inside one panel, for every row of x. With AVX-512, from 7 rows on, a pass
// of one vector of channels a tile (8 sums, each widened weight met by 8 rows) rather than 2 vectors x 12 rows:
// in a one-off harness on one core of a Zen 4, over copies of c_attn's and mlp's c_proj's weights (so that they
// come from memory), 8 rows took 0.79-0.85x the time and 32-256 rows 0.86-0.89x. The 48 block products chained
// as in a step (bench/bench_products.py --dtypes int8 --parts chained, alternating): 0.80-0.93x the time at 16
// rows, 0.96x at 12, 0.93-1.04x at 8, 1.02-1.07x at 9. AVX2's 16 registers keep 4 x 2 (4 x 3 within 10% either
// way, 8 x 1 and 6 + 2 rows level or slower on that core).
template <typename W>
void Block(const Problem<W>& p, int64_t n0) {
  static_assert(kVectors % kTallVectors == 0, "the narrower passes cover a tile's vectors exactly");
  if constexpr (kTallRows > kMaxRows) {
    if (p.M > kMaxRows) {  // narrower passes: each vector of weights widened once per kTallRows rows
      for (int v = 0; v < kVectors; v += kTallVectors) AllRows<PanelTile, kTallVectors, kTallRows>(p, n0 + v * kLanes);
      return;
    }
  }
  AllRows<PanelTile, kVectors>(p, n0);
}

// Output channels [b * width, (b + 1) * width) for every row of x (width: ColumnWidth).
template <typename W>
void Columns(const Problem<W>& p, int64_t width, int64_t b) {
  const int64_t n0 = b * width, n1 = std::min(p.N, n0 + width);
  if (n1 - n0 == width && (n0 % p.panel) + width <= p.panel) {
    if (p.M == 1 && width == kRowWidth) {
      Tile<1, kRowVectors>(p, 0, n0);
    } else {
      for (int64_t n = n0; n < n1; n += kBlock) Block(p, n);
    }
    return;
  }
  int64_t n = n0;
  for (; n + kLanes <= n1 && (n % p.panel) + kLanes <= p.panel; n += kLanes) AllRows<PanelTile, 1>(p, n);
  Narrow(p, n, n1);
}

// y[m0:m0+R, n0:n0+U] for w [N, K]: U output channels as dot products along their contiguous rows of w.
// With few outputs a tile, each output keeps S partial sums along k (4 at one row and one channel), so that
// S multiply-adds are in flight rather than one waiting on the last: one sum made the logits at batch 1 bound
// by the multiply-add's latency.
template <int R, int U, typename W>
void RowTile(const Problem<W>& p, int64_t m0, int64_t n0) {
  constexpr int S = R * U >= 4 ? 1 : 4 / (R * U);
  Vec acc[S][R][U];
  for (int s = 0; s < S; ++s)
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < U; ++u) acc[s][r][u] = Zero();
  const W* w = p.w + n0 * p.K;
  const float* x = p.x + m0 * p.K;
  const bool far = p.M > 1 && m0 == 0;
  int64_t k = 0;
  for (; k + S * kLanes <= p.K; k += S * kLanes) {
    if (k % kLineElements<W> == 0)
      for (int u = 0; u < U; ++u)  // every line of the weights this step starts
        for (int64_t j = 0; j < S * kLanes; j += kLineElements<W>) {
          PrefetchRow(w + u * p.K + k + j);
          if (far) PrefetchL2(w + (u + kFarChannels) * p.K + k + j);
        }
    for (int s = 0; s < S; ++s) {
      const int64_t ks = k + s * kLanes;
      Vec wide[U];
      for (int u = 0; u < U; ++u) wide[u] = Widen(w + u * p.K + ks);
      for (int r = 0; r < R; ++r) {
        const Vec xk = Load(x + r * p.K + ks);
        for (int u = 0; u < U; ++u) acc[s][r][u] = Fma(xk, wide[u], acc[s][r][u]);
      }
    }
  }
  for (; k + kLanes <= p.K; k += kLanes) {  // what is left of k, a vector at a time, into the first sums
    for (int u = 0; u < U; ++u) {
      const Vec wide = Widen(w + u * p.K + k);
      for (int r = 0; r < R; ++r) acc[0][r][u] = Fma(Load(x + r * p.K + k), wide, acc[0][r][u]);
    }
  }
  for (int s = 1; s < S; ++s)
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < U; ++u) acc[0][r][u] = acc[0][r][u] + acc[s][r][u];
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < U; ++u) {
      float sum = Sum(acc[0][r][u]);
      for (int64_t t = k; t < p.K; ++t) sum += x[r * p.K + t] * static_cast<float>(w[u * p.K + t]);
      p.y[(m0 + r) * p.N + n0 + u] = sum * ScaleOf(p, n0 + u);
    }
}

template <int R, int U>
struct RowsTile {
  template <typename W>
  static void Run(const Problem<W>& p, int64_t m0, int64_t n0) { RowTile<R, U>(p, m0, n0); }
};

// Output channels [b * kRowChannels, ...) of the [N, K] layout, for every row of x. One row of x takes one
// channel at a time (one stream of weights, see Prefetch); more rows take kRowChannels at once, so that each
// vector of x loaded serves that many channels (one at a time, 16 rows of 768 took 4.3x the time of 8: x's
// rows came from L2 once they outgrew L1). Tiles of 2 channels x up to kRowRows rows (AVX-512 8, AVX2 4) rather
// than 4 x 6 and 2 x 2: wte's products chained (bench_products.py --parts logits, alternating, Zen 4) took 0.90-0.98x
// the time at 8 rows and 0.89-0.95x at 16 with AVX-512, 0.75-0.77x at 4-8, 0.74x at 12 and 0.70-0.77x at 16 in
// AVX2's code, level at 2 rows; 12 and 6 rows a tile were level or slower. float32's tied logits, on the same
// tiles: level at 8 and 16 rows with AVX-512 (1.02-1.07x at 12), 0.78-0.86x at 8-16 rows in AVX2's code.
template <typename W>
void Channels(const Problem<W>& p, int64_t b) {
  const int64_t n0 = b * kRowChannels, n1 = std::min(p.N, n0 + kRowChannels);
  if (n1 - n0 == kRowChannels && p.M > 1) {
    AllRows<RowsTile, kRowChannels, kRowRows>(p, n0);
  } else {
    for (int64_t n = n0; n < n1; ++n) AllRows<RowsTile, 1>(p, n);
  }
}

// From this many rows of x on (a long prompt, a forward pass), the product is compute-bound: the weights are
// widened kChunk output channels at a time into a float32 temporary, scaled, and multiplied by Eigen's
// threaded GEMM, which keeps the multipliers busier than the tiles above (they widen each weight again for
// every few rows). The temporary stays small (wte's float32 copy would be 154 MB for 124M). Float32 weights
// (no widening) from kFloatGemmRows on. int8's is where the tiles stop beating TensorFlow's product over a
// dequantized copy (kernels.MANY_ROWS has the figures), which is what the library takes from there.
constexpr int64_t kGemmRows = 384;
constexpr int64_t kFloatGemmRows = 64;
template <typename W>
constexpr int64_t GemmRows() { return std::is_same<W, float>::value ? kFloatGemmRows : kGemmRows; }
constexpr int64_t kChunk = 2048;  // a multiple of the panel width

// wide = w * scale for output channels [n0, n0 + c): [K, c] from w [K, N] in any panel layout, or [c, K]
// from w [N, K]; units are rows of wide.
void Widened(const Problem<int8_t>& p, bool transpose_w, int64_t n0, int64_t c, float* wide, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    if (transpose_w) {
      const int8_t* row = p.w + (n0 + r) * p.K;
      for (int64_t k = 0; k < p.K; ++k) wide[r * p.K + k] = static_cast<float>(row[k]) * p.scale[n0 + r];
    } else {
      for (int64_t j = 0; j < c; ++j) {
        const int64_t n = n0 + j;
        const int8_t q = p.w[((n / p.panel) * p.K + r) * p.panel + n % p.panel];
        wide[r * c + j] = static_cast<float>(q) * p.scale[n];
      }
    }
  }
}

// Where a product's work runs: TensorFlow's intra-op threads for the op, this library's own team (and an Eigen
// pool for the GEMM) for XLA's custom call. For(units, cost, fn) runs fn(start, limit) over [0, units); device
// runs Eigen's GEMM.
struct Threads {
  const Eigen::ThreadPoolDevice& device;
  std::function<void(int64_t, int64_t, const std::function<void(int64_t, int64_t)>&)> For;
  int64_t count;  // how many
};

// wide holds K * min(N, kChunk) floats.
void Gemm(const Problem<int8_t>& p, bool transpose_w, float* wide, const Threads& threads) {
  typename TTypes<float>::ConstMatrix x(p.x, p.M, p.K);
  typename TTypes<float>::Matrix y(p.y, p.M, p.N);
  for (int64_t n0 = 0; n0 < p.N; n0 += kChunk) {
    const int64_t c = std::min(kChunk, p.N - n0);
    threads.For(transpose_w ? c : p.K, 2 * (transpose_w ? p.K : c),
                [&](int64_t r0, int64_t r1) { Widened(p, transpose_w, n0, c, wide, r0, r1); });
    const Eigen::array<Eigen::Index, 2> offsets = {0, n0}, extents = {p.M, c};
    if (transpose_w) {
      typename TTypes<float>::ConstMatrix w(wide, c, p.K);
      const Eigen::array<Eigen::IndexPair<int>, 1> dims = {Eigen::IndexPair<int>(1, 1)};
      y.slice(offsets, extents).device(threads.device) = x.contract(w, dims);
    } else {
      typename TTypes<float>::ConstMatrix w(wide, p.K, c);
      const Eigen::array<Eigen::IndexPair<int>, 1> dims = {Eigen::IndexPair<int>(1, 0)};
      y.slice(offsets, extents).device(threads.device) = x.contract(w, dims);
    }
  }
}

// Float32 weights are multiplied as they are: Eigen's threaded GEMM straight over w.
void Gemm(const Problem<float>& p, bool transpose_w, float* /*wide*/, const Threads& threads) {
  typename TTypes<float>::ConstMatrix x(p.x, p.M, p.K);
  typename TTypes<float>::Matrix y(p.y, p.M, p.N);
  typename TTypes<float>::ConstMatrix w(p.w, transpose_w ? p.N : p.K, transpose_w ? p.K : p.N);
  const Eigen::array<Eigen::IndexPair<int>, 1> dims = {Eigen::IndexPair<int>(1, transpose_w ? 1 : 0)};
  y.device(threads.device) = x.contract(w, dims);
}

// Float32 weights in the plain [K, N] layout, kPackedRows to kFloatGemmRows rows of x (more than a decode step): a
// unit of work is a segment of output channels, kSegment wide (half that below 2048 channels, so that 768 makes
// six units for the threads), taken kChunkRows rows of w at a time. The chunk is first copied into this thread's
// buffer as panels [panel][k][kPanel], read in runs of the segment's width, each asking for the run kChunkRows
// rows on into L2. Then every row of x meets each panel from L1, kPanelRows rows at a time, their sums in
// registers over the whole chunk, through y from chunk to chunk: each sum runs over k in order. In an XLA loop
// on a Zen 3 (bench/bench_products.py, alternating), 0.82-0.92x the time of the 48 block products at 12 rows
// and 0.72-0.83x at 16 against the row groups that preceded the bands below. Since the bands read eight rows of
// w a step they take 12-16 rows too: chained as in a step on a Zen 4, 25-27 against 32 ms a step at 12 rows and
// 31-35 against 36-39 at 16 (AVX2's code: 30-31 against 33, and 32-37 against 37-47).
constexpr int64_t kSegment = 256;
constexpr int kSegmentVectors = 4;  // the tail past the last panel: 4 vectors a tile
constexpr int64_t kPackedRows = 17;
constexpr int64_t kChunkRows = 128;  // rows of w a chunk: at most 128 KB of panels, in L2
constexpr int kPanelVectors = 2;
constexpr int64_t kPanel = kPanelVectors * kLanes;  // channels a panel
constexpr int kPanelRows = 6;  // rows of x a register tile: 12 sums, 2 vectors of w, a broadcast (AVX2 has 16)
constexpr int64_t kFloatsPerLine = 64 / sizeof(float);

constexpr int64_t SegmentWidth(int64_t N) { return N >= 2048 ? kSegment : kSegment / 2; }

// y[m0:m0+R, n:n+V*kLanes] += x[m0:m0+R, k0:k1] w[k0:k1, n:...] (y is overwritten when k0 is 0).
template <int R, int V>
void SegmentTile(const Problem<float>& p, int64_t m0, int64_t n, int64_t k0, int64_t k1) {
  Vec acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = k0 ? Load(p.y + (m0 + r) * p.N + n + v * kLanes) : Zero();
  const float* w = p.w + k0 * p.N + n;
  for (int64_t k = k0; k < k1; ++k, w += p.N) {
    Vec row[V];
    for (int v = 0; v < V; ++v) row[v] = Load(w + v * kLanes);
    for (int r = 0; r < R; ++r) {
      const Vec xk = Broadcast(p.x[(m0 + r) * p.K + k]);
      for (int v = 0; v < V; ++v) acc[r][v] = Fma(xk, row[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) Store(p.y + (m0 + r) * p.N + n + v * kLanes, acc[r][v]);
}

// R rows of x over channels [n0, n1) for rows k0..k1 of w: whole tiles, single vectors, then one channel at a time.
template <int R>
void SegmentRows(const Problem<float>& p, int64_t m0, int64_t n0, int64_t n1, int64_t k0, int64_t k1) {
  int64_t n = n0;
  for (; n + kSegmentVectors * kLanes <= n1; n += kSegmentVectors * kLanes) {
    SegmentTile<R, kSegmentVectors>(p, m0, n, k0, k1);
  }
  for (; n + kLanes <= n1; n += kLanes) SegmentTile<R, 1>(p, m0, n, k0, k1);
  for (; n < n1; ++n)
    for (int r = 0; r < R; ++r) {
      float* y = p.y + (m0 + r) * p.N + n;
      float sum = k0 ? *y : 0.0f;
      for (int64_t k = k0; k < k1; ++k) sum += p.x[(m0 + r) * p.K + k] * p.w[k * p.N + n];
      *y = sum;
    }
}

// y[0:R, 0:V*kLanes] (+)= x[0:R, 0:kc] w[0:kc][0:V*kLanes]: a register tile's sums over kc rows of w, ldw apart
// (a panel's, or a band's in the plain layout); x's rows ldx apart, y's ldy; add: y holds the sums so far; ahead > 0:
// each row of w asks for its line that many floats on.
template <int R, int V, int64_t ahead = 0>
void RegisterSums(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t kc, float* y, int64_t ldy,
                  bool add) {
  Vec acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = add ? Load(y + r * ldy + v * kLanes) : Zero();
  for (int64_t k = 0; k < kc; ++k, w += ldw) {
    if constexpr (ahead > 0) Prefetch(w + ahead);
    Vec row[V];
    for (int v = 0; v < V; ++v) row[v] = Load(w + v * kLanes);
    for (int r = 0; r < R; ++r) {
      const Vec xk = Broadcast(x[r * ldx + k]);
      for (int v = 0; v < V; ++v) acc[r][v] = Fma(xk, row[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) Store(y + r * ldy + v * kLanes, acc[r][v]);
}

// A panel's tile, as PackedSegment's row loop takes it: the panel's rows V * kLanes apart.
template <int R, int V>
struct ChunkTile {
  static void Run(const float* x, int64_t ldx, const float* panel, int64_t kc, float* y, int64_t ldy, bool add) {
    RegisterSums<R, V>(x, ldx, panel, V * kLanes, kc, y, ldy, add);
  }
};

// Channels [n0, n1) from kPackedRows rows of x on: panels of chunks, then the channels past the last panel.
void PackedSegment(const Problem<float>& p, int64_t n0, int64_t n1) {
  const int64_t panels = (n1 - n0) / kPanel, tail = n0 + panels * kPanel;
  static thread_local std::vector<float> buffer;  // this thread's panels
  buffer.resize(kChunkRows * kSegment);
  for (int64_t k0 = 0; k0 < p.K; k0 += kChunkRows) {
    const int64_t kc = std::min(kChunkRows, p.K - k0);
    for (int64_t k = 0; k < kc; ++k) {  // the chunk's rows, into panels
      const float* row = p.w + (k0 + k) * p.N + n0;
      for (int64_t j = 0; j < n1 - n0; j += kFloatsPerLine) PrefetchL2(row + kChunkRows * p.N + j);
      for (int64_t t = 0; t < panels; ++t)
        for (int v = 0; v < kPanelVectors; ++v)
          Store(&buffer[(t * kc + k) * kPanel + v * kLanes], Load(row + t * kPanel + v * kLanes));
    }
    for (int64_t t = 0; t < panels; ++t)
      for (int64_t m = 0; m < p.M; m += kPanelRows)
        ByRows<ChunkTile, kPanelRows, kPanelVectors>(std::min<int64_t>(kPanelRows, p.M - m), p.x + m * p.K + k0,
                                                     p.K, &buffer[t * kc * kPanel], kc,
                                                     p.y + m * p.N + n0 + t * kPanel, p.N, k0 > 0);
    for (int64_t m = 0; m < p.M; ++m) SegmentRows<1>(p, m, tail, n1, k0, k0 + kc);
  }
}

void Segment(const Problem<float>& p, int64_t b) {
  const int64_t width = SegmentWidth(p.N);
  const int64_t n0 = b * width;
  PackedSegment(p, n0, std::min(p.N, n0 + width));
}

// Float32 weights [K, N], fewer than kPackedRows rows of x (a decode step at batch 1-16): the product is bound
// by reading w once, and one sequential stream a thread is what the prefetchers follow best. So w's rows are cut
// into two bands a thread (one a thread left whole calls waiting on a late thread: batch 4 took 1.4x XLA's
// time in two of six runs), each read kBandStep rows at a time (eight streams, each one contiguous) into its own
// sums y[M, N] (in L1 and L2); the bands' sums are added in order at the end, each band's over its k in order.
// (From kTiledRows rows on, each band's sums are held in register tiles instead: TiledBand, below.)
// Against the row segments they replace (bench/bench_products.py with the kernel forced, alternating processes,
// on a Zen 4): 0.56-0.82x the time of the 48 block products at 2-8 rows with AVX-512, 0.66-0.68x with AVX2's
// code, 0.8-1.0x at 10 rows; level with XLA's dot at one row with AVX-512, 1.3x with AVX2's (when the products
// are independent; in a decode step, one after another, ahead of XLA's: kernels.FEW_ROWS).
// Eight rows of w a step rather than four halve the passes over y, which at many rows lives in L2: the 48 block
// products chained as in a step at 8 rows took 20-24 against 23-30 ms a step with AVX-512 and 21-27 against
// 27-31 with AVX2's code (fastest of 15, alternating processes, three rounds each; level at one row).
constexpr int64_t kBandStep = 8;

// Rows of x a pass over kBandStep rows of w takes (their broadcasts are read from L1 where the registers run
// out; AVX2 has 16).
// Against all the rows in one pass, the 48 block products at 10 rows took 25 against 27-29 ms a step with
// AVX-512 (0.85-0.91x XLA's dots) and 24-26 against 32-33 with AVX2's code (0.91-0.98x), on the Zen 4.
constexpr int kBandTile = kLanes >= 16 ? 8 : 4;

// y[r0:r0+R, :] += x[r0:r0+R, k:k+kBandStep] w[k:k+kBandStep, :], channels kLanes at a time (a scalar tail past
// the last vector); more than kBandTile rows pass over the same rows of w again, from the caches.
template <int R>
void BandStep(const Problem<float>& p, int64_t k, int64_t r0, float* y) {
  if constexpr (R > kBandTile) {
    BandStep<kBandTile>(p, k, r0, y);
    BandStep<R - kBandTile>(p, k, r0 + kBandTile, y);
  } else {
    const int64_t N = p.N, vectors = N / kLanes * kLanes;
    const float* w = p.w + k * N;
    const float* x = p.x + r0 * p.K + k;
    y += r0 * N;
    Vec xk[R][kBandStep];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < kBandStep; ++j) xk[r][j] = Broadcast(x[r * p.K + j]);
    for (int64_t n = 0; n < vectors; n += kLanes) {
      Vec row[kBandStep];
      for (int j = 0; j < kBandStep; ++j) row[j] = Load(w + j * N + n);
      for (int r = 0; r < R; ++r) {
        Vec acc = Load(y + r * N + n);
        for (int j = 0; j < kBandStep; ++j) acc = Fma(xk[r][j], row[j], acc);
        Store(y + r * N + n, acc);
      }
    }
    for (int64_t n = vectors; n < N; ++n)
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < kBandStep; ++j) y[r * N + n] += x[r * p.K + j] * w[j * N + n];
  }
}

// y[0:R, :] = x[0:R, k0:k1] w[k0:k1, :].
template <int R>
void Band(const Problem<float>& p, int64_t k0, int64_t k1, float* y) {
  const int64_t N = p.N;
  std::fill(y, y + R * N, 0.0f);
  int64_t k = k0;
  for (; k + kBandStep <= k1; k += kBandStep) BandStep<R>(p, k, 0, y);
  for (; k < k1; ++k)
    for (int r = 0; r < R; ++r)
      for (int64_t n = 0; n < N; ++n) y[r * N + n] += p.x[r * p.K + k] * p.w[k * N + n];
}

// Band<R> for R = p.M, from 1 to Max rows (below kTiledRows: TiledBand takes the rest).
template <int Max>
void BandOf(const Problem<float>& p, int64_t k0, int64_t k1, float* y) {
  if constexpr (Max > 1) {
    if (p.M < Max) return BandOf<Max - 1>(p, k0, k1, y);
  }
  Band<Max>(p, k0, k1, y);
}

// From kTiledRows rows of x on, a band's sums pass through y once per kTileK rows of w rather than once per
// kBandStep: a register tile of up to kTileRows rows of x times one cache line of channels (12 sums) keeps its sums
// over kTileK rows of w, whose lines for those channels stay in L1 for the chunk's other row tiles; the first row
// tile asks for the lines kTileAhead lines of channels on (each row of w, one line at a time, is a stream the
// prefetchers do not follow). Each sum still runs over its band's k in order. The 48 block products chained as in
// a step (bench/bench_products.py --dtypes float32-decoding --parts chained, fastest of 7, alternating with the
// bands, two rounds, Zen 4): with AVX2's code 0.86-0.92x the bands' time at 7 rows, 0.83-0.85x at 8, 0.75-0.80x
// at 10, 0.73-0.83x at 12 and 0.78-0.82x at 16 (level at 6, 1.07-1.19x at 4-5); with AVX-512 0.81-1.00x at 7-12
// and 0.76-0.78x at 16 (1.03-1.28x at 4-6). Two vectors a tile with AVX-512 (12 rows, 24 sums) took 1.14-1.28x
// the bands' time at 12 and 16 rows. Whole greedy calls at batch 8 and 16: 0.90-0.97x the time (BENCHMARKS.md).
constexpr int64_t kTiledRows = 7;
constexpr int64_t kTileWidth = kFloatsPerLine;  // channels a tile
constexpr int kTileVectors = kTileWidth / kLanes;
// AVX-512 12 rows, AVX2 6: 12 sums, a line of w and a broadcast (AVX2 has 16 registers); plain C++ one row.
constexpr int kTileRows = kTileVectors >= 12 ? 1 : 12 / kTileVectors;
constexpr int64_t kTileK = 128;  // rows of w a chunk: 8 KB of lines for one tile's channels
constexpr int64_t kTileAhead = 4;  // lines of channels

// y[r0:r0+R, n:n+kTileWidth] (+)= x[r0:r0+R, k0:k1] w[k0:k1, n:n+kTileWidth]; add: y holds the band's sums so
// far; first: the chunk's first row tile, which asks for the lines ahead.
template <int R, int C>
struct RegisterTiles {
  static void Run(const Problem<float>& p, int64_t r0, int64_t n, int64_t k0, int64_t k1, float* const& y,
                  bool add, bool first) {
    const float* x = p.x + r0 * p.K + k0;
    const float* w = p.w + k0 * p.N + n;
    float* sums = y + r0 * p.N + n;
    if (first) {
      RegisterSums<R, C, kTileAhead * kTileWidth>(x, p.K, w, p.N, k1 - k0, sums, p.N, add);
    } else {
      RegisterSums<R, C>(x, p.K, w, p.N, k1 - k0, sums, p.N, add);
    }
  }
};

// y[0:M, :] = x[0:M, k0:k1] w[k0:k1, :], the rows split evenly into tiles of at most kTileRows.
void TiledBand(const Problem<float>& p, int64_t k0, int64_t k1, float* y) {
  const int64_t N = p.N, M = p.M, wide = N / kTileWidth * kTileWidth;
  if (wide < N) std::fill(y, y + M * N, 0.0f);  // the tail's sums start at 0; the tiles' first chunk writes theirs
  for (int64_t kc = k0; kc < k1; kc += kTileK) {
    const int64_t ke = std::min(k1, kc + kTileK);
    for (int64_t n = 0; n < wide; n += kTileWidth) {
      EvenTiles<kTileRows>(M, [&](int64_t t, int64_t r0, int64_t rows) {
        ByRows<RegisterTiles, kTileRows, kTileVectors>(rows, p, r0, n, kc, ke, y, kc > k0, t == 0);
      });
    }
    for (int64_t n = wide; n < N; ++n)  // channels past the last tile
      for (int64_t r = 0; r < M; ++r)
        for (int64_t k = kc; k < ke; ++k) y[r * N + n] += p.x[r * p.K + k] * p.w[k * N + n];
  }
}

int64_t BandCount(const Problem<float>& p, const Threads& threads) {
  return std::max<int64_t>(1, std::min(2 * threads.count, p.K / kBandStep));
}

// sums holds (BandCount - 1) * M * N floats: the first band's go straight to y.
void Bands(const Problem<float>& p, float* sums, const Threads& threads) {
  const int64_t bands = BandCount(p, threads);
  const int64_t size = p.M * p.N;
  threads.For(bands, 2 * p.M * p.N * p.K / bands + p.N * p.K / bands, [&](int64_t start, int64_t limit) {
    for (int64_t b = start; b < limit; ++b) {
      const int64_t k0 = (p.K * b / bands) / kBandStep * kBandStep;
      const int64_t k1 = b + 1 == bands ? p.K : (p.K * (b + 1) / bands) / kBandStep * kBandStep;
      float* y = b ? sums + (b - 1) * size : p.y;
      if (p.M >= kTiledRows) {
        TiledBand(p, k0, k1, y);
      } else {
        BandOf<kTiledRows - 1>(p, k0, k1, y);
      }
    }
  });
  for (int64_t b = 1; b < bands; ++b)
    for (int64_t i = 0; i < size; ++i) p.y[i] += sums[(b - 1) * size + i];
}

// Floats of temporary the product needs: int8's Gemm its widened weights, float32's bands their partial sums;
// 0 for the tiles.
template <typename W>
int64_t Temporary(const Problem<W>& p, bool transpose_w, const Threads& threads) {
  if constexpr (std::is_same<W, int8_t>::value) {
    return p.M >= kGemmRows ? p.K * std::min(p.N, kChunk) : 0;
  } else {
    return !transpose_w && p.M < kPackedRows ? (BandCount(p, threads) - 1) * p.M * p.N : 0;
  }
}

// The whole product, by tiles (blocks of output channels split over the threads), by bands (float32 [K, N],
// few rows) or, from GemmRows rows, by Gemm, each with its Temporary.
template <typename W>
void Multiply(const Problem<W>& p, bool transpose_w, float* temporary, const Threads& threads) {
  if (p.M == 0 || p.N == 0) return;
  if (p.K == 0) {  // an empty sum: the Gemm and the packed segments would leave y unwritten
    std::fill(p.y, p.y + p.M * p.N, 0.0f);
    return;
  }
  if (p.M >= GemmRows<W>()) {
    Gemm(p, transpose_w, temporary, threads);
    return;
  }
  constexpr bool kFloat = std::is_same<W, float>::value;
  if constexpr (kFloat) {
    if (!transpose_w && p.M < kPackedRows) {
      Bands(p, temporary, threads);
      return;
    }
  }
  const int64_t width = transpose_w ? kRowChannels : kFloat ? SegmentWidth(p.N) : ColumnWidth(p);
  const int64_t units = (p.N + width - 1) / width;
  const int64_t cost = 2 * p.K * width * p.M + p.K * width;  // multiply-adds per unit, plus reading its weights
  threads.For(units, cost, [&p, transpose_w, width](int64_t start, int64_t limit) {
    for (int64_t b = start; b < limit; ++b) {
      if (transpose_w) {
        Channels(p, b);
      } else if constexpr (kFloat) {
        Segment(p, b);
      } else {
        Columns(p, width, b);
      }
    }
  });
}

// One query a row over a decode step's key/value cache (Gpt2CachedAttention), the original's attention for it:
// w_s = (q . k_s) / sqrt(F), masked as w_s m_s - 1e10 (1 - m_s), softmaxed over the slots, a = sum_s p_s v_s. A
// slot the row does not see gets exp(-1e10 - max) = 0 in float32 (for finite scores), so it is skipped (all of
// them are kept when none is seen, as the original's uniform weights): a step reads only the slots written so
// far, in place.
// XLA's own attention copies each layer's keys and values out of the cache before its small dots.
struct Attention {
  const float* q;      // [B, H, F]
  const float* cache;  // [B, 2, H, S, F]
  const float* mask;   // [B, S]
  float* a;            // [B, H, F]
  int64_t B, H, S, F;
};

inline float Dot(const float* x, const float* y, int64_t n) {
  Vec acc = Zero();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc = Fma(Load(x + i), Load(y + i), acc);
  float sum = Sum(acc);
  for (; i < n; ++i) sum += x[i] * y[i];
  return sum;
}

// out[0:n] += p * v[0:n]
inline void AddScaled(float p, const float* v, float* out, int64_t n) {
  const Vec pv = Broadcast(p);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) Store(out + i, Fma(pv, Load(v + i), Load(out + i)));
  for (; i < n; ++i) out[i] += p * v[i];
}

// Row and head u = b * H + h; w holds S floats (the scores, then their weights).
void Attend(const Attention& t, int64_t u, float* w) {
  const int64_t b = u / t.H, h = u % t.H, F = t.F;
  const float* q = t.q + u * F;
  const float* keys = t.cache + (b * 2 * t.H + h) * t.S * F;
  const float* values = keys + t.H * t.S * F;
  const float* m = t.mask + b * t.S;
  const bool none = std::all_of(m, m + t.S, [](float x) { return x == 0.0f; });
  const auto skipped = [m, none](int64_t s) { return m[s] == 0.0f && !none; };
  const float scale = 1.0f / std::sqrt(static_cast<float>(F));
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t s = 0; s < t.S; ++s) {
    if (skipped(s)) continue;
    w[s] = Dot(q, keys + s * F, F) * scale * m[s] - 1e10f * (1.0f - m[s]);
    top = std::max(top, w[s]);
  }
  float total = 0.0f;
  for (int64_t s = 0; s < t.S; ++s) {
    if (skipped(s)) continue;
    w[s] = std::exp(w[s] - top);
    total += w[s];
  }
  float* a = t.a + u * F;
  std::fill(a, a + F, 0.0f);
  for (int64_t s = 0; s < t.S; ++s) {
    if (skipped(s)) continue;
    AddScaled(w[s] / total, values + s * F, a, F);
  }
}

void AttendAll(const Attention& t, const Threads& threads) {
  threads.For(t.B * t.H, 4 * t.S * t.F, [&t](int64_t start, int64_t limit) {
    std::vector<float> w(t.S);
    for (int64_t u = start; u < limit; ++u) Attend(t, u, w.data());
  });
}

// The op's threads: TensorFlow's intra-op pool.
Threads ContextThreads(OpKernelContext* context) {
  auto* workers = context->device()->tensorflow_cpu_worker_threads();
  return Threads{context->eigen_device<Eigen::ThreadPoolDevice>(),
                 [workers](int64_t units, int64_t cost, const std::function<void(int64_t, int64_t)>& fn) {
                   Shard(workers->num_threads, workers->workers, units, cost, fn);
                 },
                 workers->num_threads};
}

class AttentionOp : public OpKernel {
 public:
  explicit AttentionOp(OpKernelConstruction* context) : OpKernel(context) {}

  void Compute(OpKernelContext* context) override {
    const Tensor& q = context->input(0);
    const Tensor& cache = context->input(1);
    const Tensor& mask = context->input(2);
    AttentionSizes n;
    OP_REQUIRES_OK(context, CheckedAttention(q.shape(), cache.shape(), mask.shape(), &n));
    Tensor* a = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, q.shape(), &a));
    const Attention t{q.flat<float>().data(), cache.flat<float>().data(), mask.flat<float>().data(),
                      a->flat<float>().data(), n.B, n.H, n.S, n.F};
    AttendAll(t, ContextThreads(context));
  }
};

template <typename W>
class MatMulOp : public OpKernel {
 public:
  explicit MatMulOp(OpKernelConstruction* context) : OpKernel(context), attrs_(context) {}

  void Compute(OpKernelContext* context) override {
    const Tensor& x = context->input(0);
    const Tensor& w = context->input(1);
    const Tensor* scale = kScaled<W> ? &context->input(2) : nullptr;
    Sizes n;
    OP_REQUIRES_OK(context, Checked(x.shape(), w.shape(), scale ? &scale->shape() : nullptr, attrs_, &n));
    Tensor* y = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, TensorShape({n.M, n.N}), &y));
    const Problem<W> p{x.flat<float>().data(), w.flat<W>().data(), scale ? scale->flat<float>().data() : nullptr,
                       y->flat<float>().data(), n.M, n.K, n.N, n.panel};
    const Threads threads = ContextThreads(context);
    const int64_t floats = Temporary(p, attrs_.transpose_w, threads);
    Tensor temporary;
    if (floats) OP_REQUIRES_OK(context, context->allocate_temp(DT_FLOAT, TensorShape({floats}), &temporary));
    Multiply(p, attrs_.transpose_w, floats ? temporary.flat<float>().data() : nullptr, threads);
  }

 private:
  const Attrs attrs_;
};

#ifdef GPT2_TF_XLA

// XLA passes a custom call no threads: the library's own (a Team for the products' units, an Eigen pool for
// Gemm's), as many as the op's `threads` attribute says, at most one per CPU this process may run on.
int Cpus() {
  cpu_set_t set;
  return sched_getaffinity(0, sizeof(set), &set) == 0 ? std::max(1, CPU_COUNT(&set)) : 1;
}

// A fork-join team for the custom calls: the calling thread (XLA's, already running) and helpers, started as
// a call first asks for them (a call on `size` threads takes the first size - 1; none for one thread).
// A decode step's products come one after another, a few hundred microseconds each, with little between them;
// a helper that finishes spins for the next product a while (kSpin) before it sleeps, since waking a sleeping
// thread costs tens of microseconds on a virtual machine, and the caller works instead of waiting. Units are
// taken a few at a time from the product's counter, so a thread the system delays holds up few of them. A call
// that finds the team busy (another product at once) runs its units alone.
class Team {
 public:
  // fn(start, limit) over [0, units) on at most `size` threads, the caller's included.
  void For(int64_t units, int64_t size, const std::function<void(int64_t, int64_t)>& fn) {
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (!busy.owns_lock() || units < 2 || size < 2) {
      fn(0, units);
      return;
    }
    for (; started_ < size - 1; ++started_) std::thread([this, index = started_] { Help(index); }).detach();
    Job job{fn, units, std::max<int64_t>(1, units / (kShares * size)), size - 1};
    job_.store(&job);
    generation_.fetch_add(1);
    if (sleeping_.load() > 0) {
      std::lock_guard<std::mutex> lock(mutex_);
      wake_.notify_all();
    }
    job.Run();
    for (int spins = 0; job.remaining.load() > 0; ++spins) Pause(spins);
    job_.store(nullptr);  // a helper that still holds it finds no unit left; wait until none does
    for (int spins = 0; users_.load() > 0; ++spins) Pause(spins);
  }

 private:
  struct Job {
    const std::function<void(int64_t, int64_t)>& fn;
    const int64_t units, grain, helpers;  // helpers: how many of the team's take part (the first ones)
    std::atomic<int64_t> next{0}, remaining{units};

    void Run() {
      for (int64_t start; (start = next.fetch_add(grain)) < units;) {
        const int64_t limit = std::min(units, start + grain);
        fn(start, limit);
        remaining.fetch_sub(limit - start);
      }
    }
  };

  // Each take is 1 / (kShares x threads) of the units (at least one: the bands, four of them). Taken one at a
  // time, the counter shared between the cores cost more than the work: int8 wte's 12565 units at one row took
  // 3.7-3.8 against 1.2-2.0 ms with Eigen's blocks.
  static constexpr int64_t kShares = 4;

  // How long a helper that finished waits for the next product awake. Whole greedy calls, one process
  // alternating: batch 1 took 1375-1399 ms with 100-400 us, 1508-1516 with 0-30 (batch 8 level).
  static constexpr std::chrono::microseconds kSpin{100};

  // One turn of a spin: the CPU's pause hint where there is one.
  static void Relax() {
#if defined(__AVX2__)
    _mm_pause();
#endif
  }

  // A wait on another thread of the team: spins, then gives the CPU away (a helper the system delayed).
  static void Pause(int spins) {
    if (spins < 4096) {
      Relax();
    } else {
      std::this_thread::yield();
    }
  }

  // Waits for a product after `seen` (spinning for kSpin, then asleep); returns its generation.
  uint64_t Await(uint64_t seen) {
    const auto start = std::chrono::steady_clock::now();
    for (int spins = 0; generation_.load() == seen; ++spins) {
      if ((spins & 63) == 0 && std::chrono::steady_clock::now() - start > kSpin) {
        std::unique_lock<std::mutex> lock(mutex_);
        sleeping_.fetch_add(1);
        wake_.wait(lock, [&] { return generation_.load() != seen; });
        sleeping_.fetch_sub(1);
        break;
      }
      Relax();
    }
    return generation_.load();
  }

  void Help(int64_t index) {
    pthread_setname_np(pthread_self(), "gpt2_tf-team");  // as top and /proc/<pid>/task name it
    for (uint64_t seen = generation_.load();;) {
      seen = Await(seen);
      users_.fetch_add(1);
      Job* job = job_.load();
      if (job && index < job->helpers) job->Run();
      users_.fetch_sub(1);
    }
  }

  std::mutex busy_;  // held by the call the team works for
  int64_t started_ = 0;  // helpers, under busy_
  std::atomic<Job*> job_{nullptr};
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> users_{0}, sleeping_{0};  // helpers holding job_; asleep
  std::mutex mutex_;
  std::condition_variable wake_;
};

// Runs every task on the calling thread: the Eigen device of a call on one thread, which starts no pool.
class Inline : public Eigen::ThreadPoolInterface {
 public:
  void Schedule(std::function<void()> fn) override { fn(); }
  int NumThreads() const override { return 1; }
  int CurrentThreadId() const override { return -1; }
};

// The Eigen device of a call on `size` threads; the pool behind them all starts with the first call on two.
const Eigen::ThreadPoolDevice& PoolDevice(int64_t size, int cpus) {
  static Eigen::ThreadPoolDevice* alone = new Eigen::ThreadPoolDevice(new Inline, 1);
  if (size == 1) return *alone;
  static Eigen::ThreadPool* pool = new Eigen::ThreadPool(cpus);
  static const std::vector<Eigen::ThreadPoolDevice*> devices = [&] {  // devices[n - 2] runs Eigen on n threads
    std::vector<Eigen::ThreadPoolDevice*> all;
    for (int n = 2; n <= cpus; ++n) all.push_back(new Eigen::ThreadPoolDevice(pool, n));
    return all;
  }();
  return *devices[size - 2];
}

// A custom call's threads: `threads` of them (0: one per CPU), at most one per CPU.
Threads PoolThreads(int64_t threads) {
  static const int cpus = Cpus();
  static Team* team = new Team();
  const int64_t size = threads > 0 ? std::min<int64_t>(threads, cpus) : cpus;
  return Threads{PoolDevice(size, cpus),
                 [size](int64_t units, int64_t /*cost*/, const std::function<void(int64_t, int64_t)>& fn) {
                   team->For(units, size, fn);
                 },
                 size};
}

// The custom calls (XLA's API_VERSION_STATUS_RETURNING_UNIFIED): in = {x, w, scale} (int8) or {x, w} (float32),
// out = y; the shapes come in `config` as "M K N panel transpose_w threads", written by MatMulXla
// (matmul_xla.cc), which has checked them.
template <typename W>
void MatMulCall(void* out, const void** in, const char* config, size_t size, void* /*status*/) {
  long long M, K, N, panel, threads;
  int transpose_w;
  if (std::sscanf(std::string(config, size).c_str(), "%lld %lld %lld %lld %d %lld", &M, &K, &N, &panel,
                  &transpose_w, &threads) != 6) {
    return;
  }
  const Problem<W> p{static_cast<const float*>(in[0]), static_cast<const W*>(in[1]),
                     kScaled<W> ? static_cast<const float*>(in[2]) : nullptr, static_cast<float*>(out), M, K, N,
                     panel};
  const Threads team = PoolThreads(threads);
  const std::unique_ptr<float[]> temporary(new float[Temporary(p, transpose_w, team)]);  // left unset
  Multiply(p, transpose_w, temporary.get(), team);
}

// in = {q, cache, mask}, out = a; `config` is "B H S F threads", written by AttentionXla (matmul_xla.cc).
void AttentionCall(void* out, const void** in, const char* config, size_t size, void* /*status*/) {
  long long B, H, S, F, threads;
  if (std::sscanf(std::string(config, size).c_str(), "%lld %lld %lld %lld %lld", &B, &H, &S, &F, &threads) != 5) {
    return;
  }
  const Attention t{static_cast<const float*>(in[0]), static_cast<const float*>(in[1]),
                    static_cast<const float*>(in[2]), static_cast<float*>(out), B, H, S, F};
  AttendAll(t, PoolThreads(threads));
}

void Int8MatMulCall(void* out, const void** in, const char* config, size_t size, void* status) {
  MatMulCall<int8_t>(out, in, config, size, status);
}
void FloatMatMulCall(void* out, const void** in, const char* config, size_t size, void* status) {
  MatMulCall<float>(out, in, config, size, status);
}

#endif  // GPT2_TF_XLA

}  // namespace

namespace gpt2_tf {

Status Checked(const TensorShape& x, const TensorShape& w, const TensorShape* scale, const Attrs& attrs,
               Sizes* sizes) {
  if (x.dims() != 2 || w.dims() != 2 || (scale && scale->dims() != 1)) {
    return errors::InvalidArgument("x and w must be matrices and scale a vector");
  }
  const int64_t K = x.dim_size(1), N = attrs.transpose_w ? w.dim_size(0) : w.dim_size(1);
  if ((attrs.transpose_w ? w.dim_size(1) : w.dim_size(0)) != K || (scale && scale->dim_size(0) != N)) {
    return errors::InvalidArgument("x [M, K], w and scale do not agree");
  }
  if (attrs.transpose_w && attrs.panel != 0) return errors::InvalidArgument("a transposed w has no panels");
  const int64_t panel = attrs.panel > 0 ? attrs.panel : std::max<int64_t>(N, 1);
  if (N % panel != 0) return errors::InvalidArgument("panel must divide the output channels");
  *sizes = Sizes{x.dim_size(0), K, N, panel};
  return OkStatus();
}

Status CheckedAttention(const TensorShape& q, const TensorShape& cache, const TensorShape& mask,
                        AttentionSizes* sizes) {
  if (q.dims() != 3 || cache.dims() != 5 || mask.dims() != 2) {
    return errors::InvalidArgument("q must be [B, H, F], cache [B, 2, H, S, F] and mask [B, S]");
  }
  const int64_t B = q.dim_size(0), H = q.dim_size(1), F = q.dim_size(2), S = cache.dim_size(3);
  if (cache.dim_size(0) != B || cache.dim_size(1) != 2 || cache.dim_size(2) != H || cache.dim_size(4) != F ||
      mask.dim_size(0) != B || mask.dim_size(1) != S) {
    return errors::InvalidArgument("q [B, H, F], cache [B, 2, H, S, F] and mask [B, S] do not agree");
  }
  *sizes = AttentionSizes{B, H, S, F};
  return OkStatus();
}

}  // namespace gpt2_tf

REGISTER_KERNEL_BUILDER(Name("Gpt2Int8MatMul").Device(DEVICE_CPU), MatMulOp<int8_t>);
REGISTER_KERNEL_BUILDER(Name("Gpt2FloatMatMul").Device(DEVICE_CPU), MatMulOp<float>);
REGISTER_KERNEL_BUILDER(Name("Gpt2CachedAttention").Device(DEVICE_CPU), AttentionOp);

#ifdef GPT2_TF_XLA
XLA_CPU_REGISTER_CUSTOM_CALL_TARGET_WITH_SYM(kCallTarget<int8_t>, Int8MatMulCall);
XLA_CPU_REGISTER_CUSTOM_CALL_TARGET_WITH_SYM(kCallTarget<float>, FloatMatMulCall);
XLA_CPU_REGISTER_CUSTOM_CALL_TARGET_WITH_SYM(kAttentionTarget, AttentionCall);
#endif
