// benchmarks/activations.py --floor's probe, built apart from the kernels' module (outrider.native.product_rate_probe)
// with the same flags, so it times this build's instructions.

#include "../kernels/isa.h"

#include <chrono>
#include <cstdint>

#if defined(INT8_KERNELS)
// The products a second that one core gives a row in this build's lane tiles on registers alone: nothing
// loaded, no codes unpacked, no x to lay out, only what each (row, group of 32 codes) pair itself costs.
// A k-row pass over P weights cannot take less than k * P / rate, whatever the tiles around it do
// (benchmarks/activations.py --floor). The integer step: AVX512-VNNI a zmm `dpbusd` (64 products),
// AVX-VNNI a ymm one (32), signed codes alike (they meet x + 128); plain AVX2, 4- and 5-bit codes
// `maddubs` pairs added in int16 and one `madd` per group, 8-bit codes (signed_codes) a `sign`, a `maddubs`,
// a `madd` and an add per 32 products (a pair of `maddubs` of them could overflow int16). With float_steps,
// each group's float step too, as the tiles take it: the sum to float, times the weight scales x d, added;
// for 4- and 5-bit codes the zero's multiply-add. Independent chains (rows) hide the steps' latency.
extern "C" double int8_product_rate(double seconds, bool signed_codes, bool float_steps) {
#if defined(INT8_VNNI512)
  using Reg = __m512i;
  using Acc = __m512;
  constexpr int CHAINS = 8, WIDTH = 64;
  auto group = [](Reg u, Reg v, bool, Reg& sum) {
    for (int m = 0; m < 8; ++m) {
      asm volatile("" : "+x"(u), "+x"(v));  // operands unknown to the compiler (volatile: nor hoisted): no product is folded or shared
      sum = _mm512_dpbusd_epi32(sum, u, v);
    }
  };
  auto to_float = [](Reg sum) { return _mm512_cvtepi32_ps(sum); };
  auto times = [](Acc a, Acc b) { return _mm512_mul_ps(a, b); };
  auto fma = [](Acc a, Acc b, Acc c) { return _mm512_fmadd_ps(a, b, c); };
  const Reg u = _mm512_set1_epi8(3), v = _mm512_set1_epi8(5);
  const Acc one = _mm512_set1_ps(1.0f);
#else
  using Reg = __m256i;
  using Acc = __m256;
  constexpr int CHAINS = 6, WIDTH = 32;
  auto group = [](Reg u, Reg v, bool signed_codes, Reg& sum) {
    if (HAS_DPBUSD256) {
      for (int m = 0; m < 8; ++m) {
        asm volatile("" : "+x"(u), "+x"(v));
        sum = dot4_add(sum, u, v);
      }
    } else if (signed_codes) {  // |w| once per register of codes, for every row (as in the tiles)
      Reg magnitude = _mm256_abs_epi8(u);
      for (int m = 0; m < 8; ++m) {
        asm volatile("" : "+x"(u), "+x"(v), "+x"(magnitude));
        const Reg p = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(v, u));
        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
      }
    } else {
      Reg pairs;
      for (int m = 0; m < 4; ++m) {
        asm volatile("" : "+x"(u), "+x"(v));
        const Reg t = _mm256_add_epi16(_mm256_maddubs_epi16(u, v), _mm256_maddubs_epi16(v, u));
        pairs = m == 0 ? t : _mm256_add_epi16(pairs, t);
      }
      sum = _mm256_add_epi32(sum, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
    }
  };
  auto to_float = [](Reg sum) { return _mm256_cvtepi32_ps(sum); };
  auto times = [](Acc a, Acc b) { return _mm256_mul_ps(a, b); };
  auto fma = [](Acc a, Acc b, Acc c) { return _mm256_fmadd_ps(a, b, c); };
  const Reg u = _mm256_set1_epi8(3), v = _mm256_set1_epi8(5);
  const Acc one = _mm256_set1_ps(1.0f);
#endif
  Acc acc[CHAINS];
  for (int i = 0; i < CHAINS; ++i) acc[i] = one;
  int64_t groups = 0;
  const auto start = std::chrono::steady_clock::now();
  double elapsed = 0;
  do {
    for (int n = 0; n < 1000; ++n)
      for (int i = 0; i < CHAINS; ++i) {
        Reg sum = u;  // a group's sum starts afresh (at x's start for signed codes), as in the tiles
        group(u, v, signed_codes, sum);
        if (!float_steps) {
          asm volatile("" ::"x"(sum));  // used: the products stay
          continue;
        }
        Acc ws = one, d = one;
        asm volatile("" : "+x"(ws), "+x"(d));
        acc[i] = fma(times(ws, d), to_float(sum), acc[i]);
        if (!signed_codes) acc[i] = fma(ws, d, acc[i]);  // the zero times d x sum(x)
      }
    groups += 1000 * CHAINS;
    elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  } while (elapsed < seconds);
  for (int i = 0; i < CHAINS; ++i) asm volatile("" ::"x"(acc[i]));  // used: the loops stay
  return static_cast<double>(groups) * 8 * WIDTH / elapsed;
}
#else
extern "C" double int8_product_rate(double, bool, bool) { return 0.0; }
#endif
