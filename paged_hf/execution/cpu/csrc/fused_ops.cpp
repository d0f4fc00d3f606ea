// paged_hf's fused element-wise ops for the CPU step: RMSNorm, SiLU-and-multiply, rotary embedding.
//
// Each is one pass over its rows where transformers' module code makes several (RMSNorm: a cast,
// pow, mean, add, rsqrt, mul, a cast back and the weight's mul, each a new tensor). They reproduce
// that code's arithmetic and its roundings in the input dtype, step by step, so outputs are equal
// up to the order of one sum (RMSNorm's mean of squares) and the exponential's last bit (SiLU).
// paged_hf/execution/cpu/fused_ops.py uses each only where the engine checked it against the model's
// own module on the model itself, during engine steps on a CPU only.
//
//   rms_norm(x [N, H], weight [H], eps, gemma, out [N, H])
//       llama-style (gemma false): out = weight * to_dtype(x_f32 * rsqrt(mean(x_f32^2) + eps))
//       gemma-style (gemma true):  out = to_dtype(x_f32 * rsqrt(mean(x_f32^2) + eps) * (1 + weight_f32))
//   silu_and_mul(gate [N, I], up [N, I], out [N, I])      out = to_dtype(silu(gate)) * up
//   rotary(x [B, H, T, D], cos [B, T, R], sin [B, T, R], out)   R <= D, even: the first R of each row
//       rotated, out = x * cos + rotate_half(x) * sin, the other D - R passed through (partial rotary)
// Rows may be strided (x of rotary is q or k transposed, gate and up are slices of one GEMM's
// output); the last dimension is contiguous. Arithmetic in fp32, each intermediate rounded to the
// dtype where transformers' code rounds it (this file is built with -ffp-contract=off).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t VL = Vec::size();

#if defined(CPU_CAPABILITY_AVX512)
// fp32 -> bf16 bits (round to nearest even, NaN kept a NaN: c10::BFloat16's rule), in each lane's low half
inline __m512i bf16_bits(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7FC00000));
  return _mm512_srli_epi32(r, 16);
}
#endif

// a value rounded to T and back (what storing an intermediate tensor of dtype T does)
template <typename T>
inline float round_to(float x) {
  return static_cast<float>(static_cast<T>(x));
}

template <typename T>
inline Vec round_to(const Vec& x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
#if defined(CPU_CAPABILITY_AVX512)
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      return Vec(_mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(x), 16)));
    }
#endif
    float buf[VL];
    x.store(buf);
    T tmp[VL];
    at::vec::convert(buf, tmp, VL);
    Vec out;
    at::vec::load_to_float<T>(tmp, out);
    return out;
  }
}

template <typename T>
inline Vec load_f32(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(p);
  } else {
    Vec out;
    at::vec::load_to_float<T>(p, out);
    return out;
  }
}

template <typename T>
inline void store_from_f32(T* p, const Vec& v) {
  if constexpr (std::is_same_v<T, float>) {
    v.store(p);
  } else {
#if defined(CPU_CAPABILITY_AVX512)
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits(v)));
      return;
    }
#endif
    float buf[VL];
    v.store(buf);
    at::vec::convert(buf, p, VL);
  }
}

template <typename T, typename W>
void rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, double eps, bool gemma, at::Tensor& out) {
  const int64_t n = x.size(0), h = x.size(1), xs = x.stride(0), os = out.stride(0);
  const T* xp = x.data_ptr<T>();
  const W* wp = weight.data_ptr<W>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = xp + r * xs;
      T* dst = op + r * os;
      Vec acc(0.f);
      int64_t i = 0;
      for (; i + VL <= h; i += VL) {
        Vec v = load_f32(row + i);
        acc = at::vec::fmadd(v, v, acc);
      }
      float sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc);
      for (; i < h; ++i) sum += static_cast<float>(row[i]) * static_cast<float>(row[i]);
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(h) + static_cast<float>(eps));
      const Vec vinv(inv), one(1.f);
      for (i = 0; i + VL <= h; i += VL) {
        Vec normed = load_f32(row + i) * vinv;
        Vec y = gemma ? normed * (one + load_f32(wp + i)) : load_f32(wp + i) * round_to<T>(normed);
        store_from_f32(dst + i, y);
      }
      for (; i < h; ++i) {
        float normed = static_cast<float>(row[i]) * inv;
        float w = static_cast<float>(wp[i]);
        dst[i] = static_cast<T>(gemma ? normed * (1.f + w) : w * round_to<T>(normed));
      }
    }
  });
}

template <typename T>
void silu_and_mul_rows(const at::Tensor& gate, const at::Tensor& up, at::Tensor& out) {
  const int64_t n = gate.size(0), width = gate.size(1);
  const int64_t gs = gate.stride(0), us = up.stride(0), os = out.stride(0);
  const T *gp = gate.data_ptr<T>(), *upp = up.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, n, 4, [&](int64_t begin, int64_t end) {
    const Vec one(1.f);
    for (int64_t r = begin; r < end; ++r) {
      const T *g = gp + r * gs, *u = upp + r * us;
      T* dst = op + r * os;
      int64_t i = 0;
      for (; i + VL <= width; i += VL) {
        Vec x = load_f32(g + i);
        Vec s = round_to<T>(x / (one + x.neg().exp_u20()));
        store_from_f32(dst + i, s * load_f32(u + i));
      }
      for (; i < width; ++i) {
        float x = static_cast<float>(g[i]);
        dst[i] = static_cast<T>(round_to<T>(x / (1.f + std::exp(-x))) * static_cast<float>(u[i]));
      }
    }
  });
}

template <typename T>
void rotary_rows(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out) {
  const int64_t b = x.size(0), heads = x.size(1), t = x.size(2), width = x.size(3);
  const int64_t d = cos.size(2), half = d / 2;  // the rotated part: the first d of each row
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1), xs2 = x.stride(2);
  const int64_t cs0 = cos.stride(0), cs1 = cos.stride(1), ss0 = sin.stride(0), ss1 = sin.stride(1);
  const int64_t os0 = out.stride(0), os1 = out.stride(1), os2 = out.stride(2);
  const T *xp = x.data_ptr<T>(), *cp = cos.data_ptr<T>(), *sp = sin.data_ptr<T>();
  T* op = out.data_ptr<T>();
  // token by token, its heads in turn: q and k are views of one projection's [T, heads * D] rows, so
  // a token's heads lie side by side (head by head, each row was a cache line of its own: SmolLM2's
  // q and k at 900 tokens 187 -> 155 us), and its cos and sin are read once for all of them
  at::parallel_for(0, b * t, std::max<int64_t>(1, 64 / heads), [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t bi = item / t, ti = item % t;
      const T* c = cp + bi * cs0 + ti * cs1;
      const T* s = sp + bi * ss0 + ti * ss1;
      for (int64_t hi = 0; hi < heads; ++hi) {
        const T* row = xp + bi * xs0 + hi * xs1 + ti * xs2;
        T* dst = op + bi * os0 + hi * os1 + ti * os2;
        // rotate_half(x) = cat(-x[half:], x[:half]); each product rounded, then the sum
        int64_t i = 0;
        if (half % VL == 0) {
          for (; i < d; i += VL) {
            Vec rot = i < half ? load_f32(row + i + half).neg() : load_f32(row + i - half);
            store_from_f32(dst + i, round_to<T>(load_f32(row + i) * load_f32(c + i)) + round_to<T>(rot * load_f32(s + i)));
          }
        }
        for (; i < d; ++i) {
          float rot = i < half ? -static_cast<float>(row[i + half]) : static_cast<float>(row[i - half]);
          float a = round_to<T>(static_cast<float>(row[i]) * static_cast<float>(c[i]));
          float bb = round_to<T>(rot * static_cast<float>(s[i]));
          dst[i] = static_cast<T>(a + bb);
        }
        std::copy(row + d, row + width, dst + d);
      }
    }
  });
}

// f(T{}) for the dtypes these ops take: fp32, bf16, fp16
template <typename F>
void dispatch(at::ScalarType dtype, const char* op, F&& f) {
  switch (dtype) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kHalf: f(c10::Half{}); break;
    default: TORCH_CHECK(false, "paged_hf::", op, " takes fp32, bf16 or fp16, not ", dtype);
  }
}

void check_rows(const at::Tensor& t, int64_t dim, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == dim && t.stride(-1) == 1, "paged_hf: ", what,
              " must be a CPU tensor of ", dim, " dimensions with a contiguous last dimension");
}

void rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool gemma, at::Tensor& out) {
  check_rows(x, 2, "rms_norm's input");
  check_rows(out, 2, "rms_norm's output");
  TORCH_CHECK(weight.is_contiguous() && weight.dim() == 1 && weight.size(0) == x.size(1) &&
                  out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type(),
              "paged_hf::rms_norm: bad shapes or dtypes");
  TORCH_CHECK(gemma || weight.scalar_type() == x.scalar_type(), "paged_hf::rms_norm: llama-style needs the input's dtype");
  dispatch(x.scalar_type(), "rms_norm", [&](auto x_tag) {
    dispatch(weight.scalar_type(), "rms_norm", [&](auto w_tag) {
      rms_norm_rows<decltype(x_tag), decltype(w_tag)>(x, weight, eps, gemma, out);
    });
  });
}

void silu_and_mul(const at::Tensor& gate, const at::Tensor& up, at::Tensor& out) {
  check_rows(gate, 2, "silu_and_mul's gate");
  check_rows(up, 2, "silu_and_mul's up");
  check_rows(out, 2, "silu_and_mul's output");
  TORCH_CHECK(gate.sizes() == up.sizes() && out.sizes() == gate.sizes() && gate.scalar_type() == up.scalar_type() &&
                  out.scalar_type() == gate.scalar_type(),
              "paged_hf::silu_and_mul: bad shapes or dtypes");
  dispatch(gate.scalar_type(), "silu_and_mul", [&](auto tag) { silu_and_mul_rows<decltype(tag)>(gate, up, out); });
}

void rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out) {
  check_rows(x, 4, "rotary's input");
  check_rows(cos, 3, "rotary's cos");
  check_rows(sin, 3, "rotary's sin");
  check_rows(out, 4, "rotary's output");
  TORCH_CHECK(out.sizes() == x.sizes() && cos.sizes() == sin.sizes() && cos.size(0) == x.size(0) &&
                  cos.size(1) == x.size(2) && cos.size(2) <= x.size(3) && cos.size(2) % 2 == 0 &&
                  cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type() &&
                  out.scalar_type() == x.scalar_type(),
              "paged_hf::rotary: bad shapes or dtypes");
  dispatch(x.scalar_type(), "rotary", [&](auto tag) { rotary_rows<decltype(tag)>(x, cos, sin, out); });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(paged_hf, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, bool gemma, Tensor(a!) out) -> ()");
  m.def("silu_and_mul(Tensor gate, Tensor up, Tensor(a!) out) -> ()");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(paged_hf, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary", &rotary);
}
