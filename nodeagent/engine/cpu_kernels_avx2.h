/* The AVX2 build of the kernels (included by cpu_kernels.c), for processors without AVX-512 VNNI:
 * the vector path only, 8 outputs a vector. Its integer sums are the same exact D and each output
 * takes the same fp32 operations in the same order, so it gives the AVX-512 build's bits.
 *
 * int4: VPMADDUBSW multiplies unsigned by signed bytes into pairs of int16, which saturate: the
 * codes (0..15) go in as they are, and a group's eight pair sums stay below 8 * 2 * 15 * 127 =
 * 30480. int8: VPMADDWD multiplies q (|q| <= 2039) by the codes widened to int16, a group's sums
 * at most 32 * 2039 * 128, far inside int32. */

#define ATTENTION_ROWS 4       /* query rows an attention tile holds in registers */

static inline float max_of(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

static inline int32_t sum_of(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1))));
}

/* Four vectors of 8 int32 (in range) as 32 int8 in order. */
static inline __m256i narrowed(const __m256i *v) {
    __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
    return _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* Row r of x quantized into `a`, as the AVX-512 build does it. */
static void quantize_row(const float *rows, const activations *a, int r, int k_all) {
    const float *x = rows + (size_t)r * k_all;
    int8_t *halves = a->halves + (size_t)r * k_all * 2;
    float *step = a->step + (size_t)r * (k_all / GROUP), *total = a->total + (size_t)r * (k_all / GROUP);
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256i half = _mm256_set1_epi32(1 << (SPLIT_BITS - 1));
    for (int g = 0; g < k_all / GROUP; g++) {
        __m256 v[4], peaks = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(x + g * GROUP + 8 * i);
            peaks = _mm256_max_ps(peaks, _mm256_and_ps(v[i], magnitude));
        }
        float peak = max_of(peaks);
        __m256 scale = _mm256_set1_ps(peak > 0 ? QMAX / peak : 0);
        __m256i q[4], highs[4], lows[4], sum = _mm256_setzero_si256();
        for (int i = 0; i < 4; i++) {
            q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], scale));
            highs[i] = _mm256_srai_epi32(_mm256_add_epi32(q[i], half), SPLIT_BITS);
            lows[i] = _mm256_sub_epi32(q[i], _mm256_slli_epi32(highs[i], SPLIT_BITS));
            sum = _mm256_add_epi32(sum, q[i]);
        }
        int8_t *at = halves + 2 * g * GROUP;
        _mm256_storeu_si256((__m256i *)at, narrowed(highs));
        _mm256_storeu_si256((__m256i *)(at + GROUP), narrowed(lows));
        step[g] = peak / QMAX;
        total[g] = (float)sum_of(sum);
    }
}

static inline __m256 from_fp16(const uint16_t *at) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)at));
}

/* acc + this group's share for 8 outputs, from D (exact); `scales` at those outputs' first. The
 * AVX-512 build's finish_group at half the width: the same operations in the same order, on which
 * the two builds' equal bits rest. */
static inline __m256 finish_group(__m256 acc, __m256i d, const uint16_t *scales, int bits, float step,
                                  float total) {
    __m256 t = _mm256_mul_ps(from_fp16(scales), _mm256_cvtepi32_ps(d));
    if (bits == 4)
        t = _mm256_fmadd_ps(from_fp16(scales + 16), _mm256_set1_ps(total), t);
    return _mm256_fmadd_ps(_mm256_set1_ps(step), t, acc);
}

/* v, as a value GCC may not regroup: left free, it reorders a chain of integer sums into all the
 * products first, which spills them out of the registers. */
static inline __attribute__((always_inline)) __m256i kept(__m256i v) {
    __asm__("" : "+x"(v));
    return v;
}

#define PAIR 2  /* rows a tile's inner loop holds: each broadcast of a row's quad feeds both halves */

/* int4: one group's D for 16 outputs, as two halves of 8 (the codes at `codes`, a group's UNITs),
 * and `rows` (1 or PAIR) rows. A broadcast from memory costs about what a VPMADDUBSW does here,
 * so each one feeds both halves' products. */
static inline __attribute__((always_inline)) void group_d4(const activations *a, const uint8_t *codes, int r0,
                                                           int rows, int k_all, int g, __m256i d[][2]) {
    const __m256i ones = _mm256_set1_epi16(1), nibble = _mm256_set1_epi8(15);
    __m256i hs[PAIR][2], ls[PAIR][2];
    const int32_t *h[PAIR];
#pragma GCC unroll 2
    for (int r = 0; r < rows; r++) {
        hs[r][0] = hs[r][1] = ls[r][0] = ls[r][1] = _mm256_setzero_si256();
        h[r] = (const int32_t *)(a->halves + 2 * ((size_t)(r0 + r) * k_all + g * GROUP));
    }
#pragma GCC unroll 8
    for (int p = 0; p < QUADS; p++) {
        __m256i c[2];
#pragma GCC unroll 2
        for (int half = 0; half < 2; half++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(codes + p / 2 * UNIT + half * (UNIT / 2)));
            c[half] = _mm256_and_si256(p % 2 ? _mm256_srli_epi16(v, 4) : v, nibble);
        }
#pragma GCC unroll 2
        for (int r = 0; r < rows; r++) {
            __m256i high = _mm256_set1_epi32(h[r][p]), low = _mm256_set1_epi32(h[r][QUADS + p]);
#pragma GCC unroll 2
            for (int half = 0; half < 2; half++) {
                hs[r][half] = kept(_mm256_add_epi16(hs[r][half], _mm256_maddubs_epi16(c[half], high)));
                ls[r][half] = kept(_mm256_add_epi16(ls[r][half], _mm256_maddubs_epi16(c[half], low)));
            }
        }
    }
#pragma GCC unroll 2
    for (int r = 0; r < rows; r++)
#pragma GCC unroll 2
        for (int half = 0; half < 2; half++) {
            __m256i high = _mm256_madd_epi16(hs[r][half], ones);
            d[r][half] = _mm256_add_epi32(_mm256_slli_epi32(high, SPLIT_BITS), _mm256_madd_epi16(ls[r][half], ones));
        }
}

/* int8: the same with VPMADDWD on q itself (16 high + low in int16) and the codes widened to int16:
 * 16 products an instruction, where the halves take two VPSIGNB and two VPMADDUBSW for 32. Each
 * row's q for the group is widened once into `wide`, 4 inputs (one broadcast) a quad; each int32
 * lane sums two of an output's inputs, and a horizontal add pairs them at the end. */
static inline __attribute__((always_inline)) void group_d8(const activations *a, const uint8_t *codes, int r0,
                                                           int rows, int k_all, int g, __m256i d[][2]) {
    int64_t wide[PAIR][QUADS];
    __m256i sums[PAIR][4];
#pragma GCC unroll 2
    for (int r = 0; r < rows; r++) {
        const int8_t *halves = a->halves + 2 * ((size_t)(r0 + r) * k_all + g * GROUP);
        for (int i = 0; i < 2; i++) {
            __m256i high = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(halves + 16 * i)));
            __m256i low = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(halves + GROUP + 16 * i)));
            _mm256_storeu_si256((__m256i *)wide[r] + i, _mm256_add_epi16(_mm256_slli_epi16(high, SPLIT_BITS), low));
        }
        sums[r][0] = sums[r][1] = sums[r][2] = sums[r][3] = _mm256_setzero_si256();
    }
#pragma GCC unroll 8
    for (int p = 0; p < QUADS; p++) {
        __m256i c[4];
#pragma GCC unroll 4
        for (int v = 0; v < 4; v++)
            c[v] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(codes + p * UNIT + 16 * v)));
#pragma GCC unroll 2
        for (int r = 0; r < rows; r++) {
            __m256i q = _mm256_set1_epi64x(wide[r][p]);
#pragma GCC unroll 4
            for (int v = 0; v < 4; v++)
                sums[r][v] = kept(_mm256_add_epi32(sums[r][v], _mm256_madd_epi16(c[v], q)));
        }
    }
#pragma GCC unroll 2
    for (int r = 0; r < rows; r++)
#pragma GCC unroll 2
        for (int half = 0; half < 2; half++) {
            __m256i pairs = _mm256_hadd_epi32(sums[r][2 * half], sums[r][2 * half + 1]);
            d[r][half] = _mm256_permute4x64_epi64(pairs, _MM_SHUFFLE(3, 1, 2, 0));
        }
}

/* Column tile `t`'s 16 outputs for `rows` (1 or PAIR) rows from `r0`, summed in y itself: held
 * in registers across groups, these sums would push the products' sums out of them. */
static inline __attribute__((always_inline)) void pair_tile(const activations *a, const weight *w, int t, float *y,
                                                            int r0, int rows, int n, int k_all) {
    int groups = k_all / GROUP;
    const uint8_t *codes = w->codes + t * column_tile_bytes(w->bits, k_all);
    float *out[PAIR];
#pragma GCC unroll 2
    for (int r = 0; r < rows; r++) {
        out[r] = y + (size_t)(r0 + r) * n + 16 * t;
        _mm256_storeu_ps(out[r], _mm256_setzero_ps());
        _mm256_storeu_ps(out[r] + 8, _mm256_setzero_ps());
    }
    for (int g = 0; g < groups; g++) {
        __m256i d[PAIR][2];
        const uint8_t *here = codes + (size_t)g * GROUP * w->bits * 2;
        prefetch_ahead(here, w->bits);
        if (w->bits == 4)
            group_d4(a, here, r0, rows, k_all, g, d);
        else
            group_d8(a, here, r0, rows, k_all, g, d);
        const uint16_t *scales = group_scales(w, t, groups, g);
#pragma GCC unroll 2
        for (int r = 0; r < rows; r++) {
            size_t at = (size_t)(r0 + r) * groups + g;
#pragma GCC unroll 2
            for (int half = 0; half < 2; half++) {
                float *sum = out[r] + 8 * half;
                _mm256_storeu_ps(sum, finish_group(_mm256_loadu_ps(sum), d[r][half], scales + 8 * half, w->bits,
                                                   a->step[at], a->total[at]));
            }
        }
    }
}

/* The vector path: column tile `t` for `rows` rows from `r0`, a pair of rows at a time (the
 * tile's codes stay in cache for the next pair). */
static inline __attribute__((always_inline)) void vector_tile(const activations *a, const weight *w, int t, float *y,
                                                              int r0, int rows, int n, int k_all) {
#pragma GCC unroll 2
    for (int r = 0; r < rows; r += PAIR)
        pair_tile(a, w, t, y, r0 + r, rows - r < PAIR ? rows - r : PAIR, n, k_all);
}

/* Sixteen floats, the attention kernel's vector (cpu_attention.h): two ymm, each operation the
 * AVX-512 build's on both halves, so the two builds' attention gives the same bits too. */
typedef struct {
    __m256 lo, hi;
} v16;

static inline v16 v16_load(const float *at) {
    return (v16){_mm256_loadu_ps(at), _mm256_loadu_ps(at + 8)};
}

static inline void v16_store(float *at, v16 v) {
    _mm256_storeu_ps(at, v.lo);
    _mm256_storeu_ps(at + 8, v.hi);
}

static inline v16 v16_set1(float x) {
    return (v16){_mm256_set1_ps(x), _mm256_set1_ps(x)};
}

/* One fp16 value as a float. */
static inline float float_of_fp16(uint16_t h) {
    return _cvtsh_ss(h);
}

static inline __m256 floats_of_int8(const int8_t *at) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)at)));
}

/* A float as the nearest fp16 value (ties to even). */
static inline uint16_t fp16_of_float(float x) {
    return _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT);
}

/* Sixteen fp16 values as floats. */
static inline v16 v16_from_fp16(const uint16_t *at) {
    return (v16){_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)at)),
                 _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(at + 8)))};
}

/* Sixteen int8 as floats. */
static inline v16 v16_from_int8(const int8_t *at) {
    return (v16){floats_of_int8(at), floats_of_int8(at + 8)};
}

static inline v16 v16_fma(v16 a, v16 b, v16 c) {
    return (v16){_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}

static inline v16 v16_mul(v16 a, v16 b) {
    return (v16){_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)};
}

static inline v16 v16_sub(v16 a, v16 b) {
    return (v16){_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)};
}

static inline v16 v16_add(v16 a, v16 b) {
    return (v16){_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)};
}

static inline v16 v16_div(v16 a, v16 b) {
    return (v16){_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)};
}

static inline v16 v16_abs(v16 v) {
    __m256 sign = _mm256_set1_ps(-0.0f);
    return (v16){_mm256_andnot_ps(sign, v.lo), _mm256_andnot_ps(sign, v.hi)};
}

/* Lane by lane, `negative` where `sign`'s sign bit is set, else `otherwise`. */
static inline v16 v16_by_sign(v16 sign, v16 negative, v16 otherwise) {
    return (v16){_mm256_blendv_ps(otherwise.lo, negative.lo, sign.lo),
                 _mm256_blendv_ps(otherwise.hi, negative.hi, sign.hi)};
}

static inline float v16_max_all(v16 v) {
    return max_of(_mm256_max_ps(v.lo, v.hi));
}

static inline __m256 outside_half(__m256 v, __m256i lane, int from, int to) {
    __m256i out = _mm256_or_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32(from), lane),
                                  _mm256_cmpgt_epi32(lane, _mm256_set1_epi32(to)));
    return _mm256_blendv_ps(v, _mm256_set1_ps(-INFINITY), _mm256_castsi256_ps(out));
}

/* v with the lanes before `from` and after `to` set to -inf. */
static inline v16 v16_outside(v16 v, int from, int to) {
    __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return (v16){outside_half(v.lo, lane, from, to),
                 outside_half(v.hi, _mm256_add_epi32(lane, _mm256_set1_epi32(8)), from, to)};
}

static inline __m256 exp2_half(__m256 x) {
    __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_sub_ps(x, n), p = _mm256_set1_ps(EXP2_TERMS[7]);
    for (int i = 6; i >= 0; i--)
        p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP2_TERMS[i]));
    __m256i power = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    __m256 normal = _mm256_cmp_ps(x, _mm256_set1_ps(EXP2_FLOOR), _CMP_GE_OQ);
    return _mm256_and_ps(normal, _mm256_mul_ps(p, _mm256_castsi256_ps(power)));
}

/* 2^x for x <= 0 (EXP2_TERMS in cpu_kernels.c), 0 below the normal range. */
static inline v16 v16_exp2(v16 x) {
    return (v16){exp2_half(x.lo), exp2_half(x.hi)};
}
