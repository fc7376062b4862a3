/* The AVX-512 build of the kernels (included by cpu_kernels.c): VNNI for calls of a few rows, AMX
 * int8 tiles for more. */

#define HAS_TILES
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define TILE_BYTES (QUADS * UNIT)  /* a group of 16 outputs as int8 codes: one B tile */
#define INT4_TILE_BYTES (2 * TILE_BYTES)  /* the same for int4 codes: 16 c over c, one B tile */
#define BLOCK 64               /* outputs the tile path takes at once: four column tiles */
#define CHUNK 8                /* groups the int4 tile path unpacks at a time */
#define ATTENTION_ROWS 8       /* query rows an attention tile holds in registers */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Linux hands out the tile state only to a process that asks for it. */
int sf_amx_enable(void) {
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

/* Row r of x quantized into `a`. */
static void quantize_row(const float *rows, const activations *a, int r, int k_all) {
    const float *x = rows + (size_t)r * k_all;
    int8_t *halves = a->halves + (size_t)r * k_all * 2;
    float *step = a->step + (size_t)r * (k_all / GROUP), *total = a->total + (size_t)r * (k_all / GROUP);
    const __m512i half = _mm512_set1_epi32(1 << (SPLIT_BITS - 1));
    for (int g = 0; g < k_all / GROUP; g++) {
        __m512 a = _mm512_loadu_ps(x + g * GROUP), b = _mm512_loadu_ps(x + g * GROUP + 16);
        float peak = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
        __m512 scale = _mm512_set1_ps(peak > 0 ? QMAX / peak : 0);
        __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, scale)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, scale));
        __m512i ha = _mm512_srai_epi32(_mm512_add_epi32(qa, half), SPLIT_BITS),
                hb = _mm512_srai_epi32(_mm512_add_epi32(qb, half), SPLIT_BITS);
        __m512i la = _mm512_sub_epi32(qa, _mm512_slli_epi32(ha, SPLIT_BITS)),
                lb = _mm512_sub_epi32(qb, _mm512_slli_epi32(hb, SPLIT_BITS));
        int8_t *at = halves + 2 * g * GROUP;
        _mm_storeu_si128((__m128i *)at, _mm512_cvtepi32_epi8(ha));
        _mm_storeu_si128((__m128i *)(at + 16), _mm512_cvtepi32_epi8(hb));
        _mm_storeu_si128((__m128i *)(at + GROUP), _mm512_cvtepi32_epi8(la));
        _mm_storeu_si128((__m128i *)(at + GROUP + 16), _mm512_cvtepi32_epi8(lb));
        step[g] = peak / QMAX;
        total[g] = (float)_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
    }
}

static inline __m512 from_fp16(const uint16_t *at) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)at));
}

/* acc + this group's share for 16 outputs, from D = sum(q * c) (exact), each output's scale and for
 * int4 minimum. */
static inline __m512 finish_with(__m512 acc, __m512i d, __m512 scale, __m512 minimum, int bits, float step,
                                 float total) {
    __m512 t = _mm512_mul_ps(scale, _mm512_cvtepi32_ps(d));
    if (bits == 4)
        t = _mm512_fmadd_ps(minimum, _mm512_set1_ps(total), t);
    return _mm512_fmadd_ps(_mm512_set1_ps(step), t, acc);
}

/* The same with the fp16 values as `weight` lays them out at `scales`. */
static inline __m512 finish_group(__m512 acc, __m512i d, const uint16_t *scales, int bits, float step,
                                  float total) {
    __m512 minimum = bits == 4 ? from_fp16(scales + 16) : _mm512_setzero_ps();
    return finish_with(acc, d, from_fp16(scales), minimum, bits, step, total);
}

/* A group's codes for 16 outputs as eight vectors of unsigned bytes, one per 4 inputs: int4
 * codes as they are, int8 codes plus 128 (VPDPBUSD multiplies unsigned by signed bytes). */
static inline __attribute__((always_inline)) void group_quads(const uint8_t *codes, int bits, __m512i *quads) {
    if (bits == 4) {
#pragma GCC unroll 4
        for (int o = 0; o < QUADS / 2; o++) {
            __m512i v = _mm512_loadu_si512(codes + o * UNIT);
            quads[2 * o] = _mm512_and_si512(v, _mm512_set1_epi8(15));
            quads[2 * o + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(15));
        }
    } else {
#pragma GCC unroll 8
        for (int o = 0; o < QUADS; o++)
            quads[o] = _mm512_xor_si512(_mm512_loadu_si512(codes + o * UNIT), _mm512_set1_epi8((char)0x80));
    }
}

/* The vector path: 16 outputs (column tile `t`) for `rows` rows from `r0`, written to y. Unrolled
 * into registers, each quad's codes feed every row's sums; one or two rows split each sum over two
 * chains, whose VPDPBUSD latency would otherwise set the pace (the integer total is the same). */
static inline __attribute__((always_inline)) void vector_tile(const activations *a, const weight *w, int t, float *y,
                                                              int r0, int rows, int n, int k_all) {
    int groups = k_all / GROUP;
    const uint8_t *codes = w->codes + t * column_tile_bytes(w->bits, k_all);
    __m512 acc[VECTOR_ROWS];
    for (int r = 0; r < rows; r++)
        acc[r] = _mm512_setzero_ps();
    for (int g = 0; g < groups; g++) {
        __m512i quads[QUADS], hs[VECTOR_ROWS][2], ls[VECTOR_ROWS][2];
        const uint8_t *here = codes + (size_t)g * GROUP * w->bits * 2;
        prefetch_ahead(here, w->bits);
        group_quads(here, w->bits, quads);
        const int32_t *h[VECTOR_ROWS];
#pragma GCC unroll 4
        for (int r = 0; r < rows; r++) {
            h[r] = (const int32_t *)(a->halves + 2 * ((size_t)(r0 + r) * k_all + g * GROUP));
            hs[r][0] = hs[r][1] = ls[r][0] = ls[r][1] = _mm512_setzero_si512();
        }
#pragma GCC unroll 8
        for (int p = 0; p < QUADS; p++)
#pragma GCC unroll 4
            for (int r = 0; r < rows; r++) {
                int chain = rows <= 2 ? p % 2 : 0;
                hs[r][chain] = _mm512_dpbusd_epi32(hs[r][chain], quads[p], _mm512_set1_epi32(h[r][p]));
                ls[r][chain] = _mm512_dpbusd_epi32(ls[r][chain], quads[p], _mm512_set1_epi32(h[r][QUADS + p]));
            }
        const uint16_t *scales = group_scales(w, t, groups, g);
#pragma GCC unroll 4
        for (int r = 0; r < rows; r++) {
            size_t at = (size_t)(r0 + r) * groups + g;
            __m512i high = _mm512_add_epi32(hs[r][0], hs[r][1]), low = _mm512_add_epi32(ls[r][0], ls[r][1]);
            __m512i d = _mm512_add_epi32(_mm512_slli_epi32(high, SPLIT_BITS), low);
            if (w->bits == 8)  /* the codes were shifted by 128: take 128 * sum(q) back off */
                d = _mm512_sub_epi32(d, _mm512_set1_epi32(128 * (int32_t)a->total[at]));
            acc[r] = finish_group(acc[r], d, scales, w->bits, a->step[at], a->total[at]);
        }
    }
    for (int r = 0; r < rows; r++)
        _mm512_storeu_ps(y + (size_t)(r0 + r) * n + 16 * t, acc[r]);
}

/* Tiles 0-3 hold sums for `rows` rows and 16 outputs each, tile 4 the activations. int4: tile 4
 * is a group's highs and lows (64 inputs), 5-7 the codes as [16 c, c] (16 rows of 4 inputs by 16
 * outputs), and the sums are D for four column tiles. int8: tile 4 holds the highs, 5 the lows,
 * 6 and 7 the codes (8 rows), and the sums are the highs' and the lows' for two column tiles. */
static void configure(int rows, int bits) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        int activations = bits == 4 ? t == 4 : t == 4 || t == 5;
        cfg.colsb[t] = activations && bits == 8 ? GROUP : 64;
        cfg.rows[t] = t < 4 || activations ? rows : bits == 4 ? 2 * QUADS : QUADS;
    }
    _tile_loadconfig(&cfg);
}

/* `groups` groups from `g0` of a block's four column tiles of int4 codes as B tiles
 * [group][column tile][INT4_TILE_BYTES]: 16 c for the highs' 32 inputs, then c for the lows'. */
static void unpack_int4(const uint8_t *codes, size_t tile_stride, int g0, int groups, uint8_t *tiles) {
    const __m512i nibble = _mm512_set1_epi8(15), upper = _mm512_set1_epi8((char)0xF0);
    for (int g = 0; g < groups; g++)
        for (int t = 0; t < 4; t++) {
            const uint8_t *from = codes + t * tile_stride + (size_t)(g0 + g) * GROUP * 8;
            uint8_t *tile = tiles + ((size_t)g * 4 + t) * INT4_TILE_BYTES;
            for (int o = 0; o < QUADS / 2; o++) {
                __m512i v = _mm512_loadu_si512(from + o * UNIT);
                _mm512_store_si512(tile + 2 * o * UNIT, _mm512_and_si512(_mm512_slli_epi16(v, 4), upper));
                _mm512_store_si512(tile + (2 * o + 1) * UNIT, _mm512_and_si512(v, upper));
                _mm512_store_si512(tile + TILE_BYTES + 2 * o * UNIT, _mm512_and_si512(v, nibble));
                _mm512_store_si512(tile + TILE_BYTES + (2 * o + 1) * UNIT,
                                   _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble));
            }
        }
}

/* One int4 group's D for four column tiles (B tiles at b, b + stride...) into `sums` [rows][64]. */
static void int4_sums(const uint8_t *b, size_t stride, int32_t *sums) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    _tile_loadd(5, b, UNIT);
    _tile_dpbsud(0, 4, 5);
    _tile_loadd(6, b + stride, UNIT);
    _tile_dpbsud(1, 4, 6);
    _tile_loadd(7, b + 2 * stride, UNIT);
    _tile_dpbsud(2, 4, 7);
    _tile_loadd(5, b + 3 * stride, UNIT);
    _tile_dpbsud(3, 4, 5);
    _tile_stored(0, sums, 256);
    _tile_stored(1, sums + 16, 256);
    _tile_stored(2, sums + 32, 256);
    _tile_stored(3, sums + 48, 256);
}

/* One int8 group's sums for two column tiles (B tiles at b0, b1) into `sums` [rows][4][16]:
 * highs and lows of the first, highs and lows of the second. */
static void int8_sums(const uint8_t *b0, const uint8_t *b1, int32_t *sums) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    _tile_loadd(6, b0, UNIT);
    _tile_dpbssd(0, 4, 6);
    _tile_dpbssd(1, 5, 6);
    _tile_loadd(7, b1, UNIT);
    _tile_dpbssd(2, 4, 7);
    _tile_dpbssd(3, 5, 7);
    _tile_stored(0, sums, 256);
    _tile_stored(1, sums + 16, 256);
    _tile_stored(2, sums + 32, 256);
    _tile_stored(3, sums + 48, 256);
}

/* Row r's D for column tile t from the sums a group left. */
static inline __m512i tile_d(int32_t (*sums)[16 * 64], int bits, int r, int t) {
    if (bits == 4)
        return _mm512_load_si512(sums[0] + r * 64 + 16 * t);
    const int32_t *part = sums[t / 2] + r * 64 + (t % 2) * 32;
    return _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(part), SPLIT_BITS), _mm512_load_si512(part + 16));
}

/* One group's share added into each row's four column tiles of acc [rows][BLOCK] (set, for the
 * block's first group), step and total the rows' own at a stride of `groups`. Specialized by
 * the caller for code width and first group, so that no test is left in its loop. */
static inline __attribute__((always_inline)) void finish_rows(int32_t (*sums)[16 * 64], const __m512 *scale,
                                                              const __m512 *minimum, const float *step,
                                                              const float *total, size_t groups, float *acc,
                                                              int rows, int bits, int first) {
    for (int r = 0; r < rows; r++) {
        float *out = acc + (size_t)r * BLOCK;
#pragma GCC unroll 4
        for (int t = 0; t < 4; t++) {
            __m512 prior = first ? _mm512_setzero_ps() : _mm512_load_ps(out + 16 * t);
            _mm512_store_ps(out + 16 * t, finish_with(prior, tile_d(sums, bits, r, t), scale[t], minimum[t], bits,
                                                      step[r * groups], total[r * groups]));
        }
    }
}

/* Groups g0..g0+groups of one block for every row, adding into acc [m][BLOCK]. The B tile of
 * group g0 + i and column tile t is at tiles + i * group_stride + t * tile_stride. */
static void tile_groups(const activations *a, const weight *w, const uint8_t *tiles, size_t group_stride,
                        size_t tile_stride, float *acc, int m, int k_all, int g0, int groups, int *configured) {
    int32_t sums[2][16 * 64] __attribute__((aligned(64)));
    int all_groups = k_all / GROUP;
    for (int m0 = 0; m0 < m; m0 += 16) {
        int rows = m - m0 < 16 ? m - m0 : 16;
        if (rows != *configured) {
            configure(rows, w->bits);
            *configured = rows;
        }
        for (int g = g0; g < g0 + groups; g++) {
            const uint8_t *b = tiles + (g - g0) * group_stride;
            const int8_t *halves = a->halves + 2 * ((size_t)m0 * k_all + g * GROUP);
            _tile_loadd(4, halves, 2 * k_all);
            if (w->bits == 4) {
                int4_sums(b, tile_stride, sums[0]);
            } else {
                _tile_loadd(5, halves + GROUP, 2 * k_all);
                int8_sums(b, b + tile_stride, sums[0]);
                int8_sums(b + 2 * tile_stride, b + 3 * tile_stride, sums[1]);
            }
            __m512 scale[4], minimum[4];
            for (int t = 0; t < 4; t++) {
                const uint16_t *values = group_scales(w, t, all_groups, g);
                scale[t] = from_fp16(values);
                minimum[t] = w->bits == 4 ? from_fp16(values + 16) : _mm512_setzero_ps();
            }
            const float *step = a->step + (size_t)m0 * all_groups + g;
            const float *total = a->total + (size_t)m0 * all_groups + g;
            float *out = acc + (size_t)m0 * BLOCK;
            if (w->bits == 4 && g == 0)
                finish_rows(sums, scale, minimum, step, total, all_groups, out, rows, 4, 1);
            else if (w->bits == 4)
                finish_rows(sums, scale, minimum, step, total, all_groups, out, rows, 4, 0);
            else if (g == 0)
                finish_rows(sums, scale, minimum, step, total, all_groups, out, rows, 8, 1);
            else
                finish_rows(sums, scale, minimum, step, total, all_groups, out, rows, 8, 0);
        }
    }
}

static _Thread_local uint8_t *held;
static _Thread_local size_t held_bytes;

/* A thread's buffers, kept between calls so that no call maps fresh pages. */
static uint8_t *scratch(size_t bytes) {
    if (bytes > held_bytes) {
        free(held);
        held = aligned_alloc(64, bytes);
        held_bytes = held == NULL ? 0 : bytes;
    }
    return held;
}

/* One block of BLOCK outputs (weight `w` already offset to it) for every row, into y. */
static int tile_block(const activations *a, const weight *w, float *y, int m, int n, int k_all, int *configured) {
    size_t unpacked = w->bits == 4 ? (size_t)CHUNK * 4 * INT4_TILE_BYTES : 0;
    uint8_t *buffer = scratch(unpacked + (size_t)m * BLOCK * 4);
    if (buffer == NULL)
        return -1;
    float *acc = (float *)(buffer + unpacked);
    size_t tile_stride = column_tile_bytes(w->bits, k_all);
    int groups = k_all / GROUP;
    if (w->bits == 4) {
        for (int g0 = 0; g0 < groups; g0 += CHUNK) {
            int count = groups - g0 < CHUNK ? groups - g0 : CHUNK;
            unpack_int4(w->codes, tile_stride, g0, count, buffer);
            tile_groups(a, w, buffer, 4 * INT4_TILE_BYTES, INT4_TILE_BYTES, acc, m, k_all, g0, count, configured);
        }
    } else {  /* int8 codes are B tiles as they lie */
        tile_groups(a, w, w->codes, TILE_BYTES, tile_stride, acc, m, k_all, 0, groups, configured);
    }
    for (int r = 0; r < m; r++)
        memcpy(y + (size_t)r * n, acc + (size_t)r * BLOCK, BLOCK * 4);
    return 0;
}

/* The tile path: the rows quantized, then blocks of BLOCK outputs shared out on OpenMP's threads. */
static int tiled(const float *x, const activations *a, const weight *w, float *y, int m, int n, int k_all) {
    int groups = k_all / GROUP, failed = 0;
#pragma omp parallel reduction(|| : failed)
    {
#pragma omp for schedule(static)
        for (int r = 0; r < m; r++)
            quantize_row(x, a, r, k_all);
        int configured = -1;
        size_t block_stride = 4 * column_tile_bytes(w->bits, k_all);
#pragma omp for schedule(static)
        for (int nb = 0; nb < n / BLOCK; nb++) {
            weight block = {w->codes + nb * block_stride, group_scales(w, 4 * nb, groups, 0), w->bits};
            if (!failed)
                failed = tile_block(a, &block, y + nb * BLOCK, m, n, k_all, &configured) != 0;
        }
    }
    return failed ? -1 : 0;
}

/* Sixteen floats, the attention kernel's vector (cpu_attention.h): one zmm. */
typedef __m512 v16;

static inline v16 v16_load(const float *at) {
    return _mm512_loadu_ps(at);
}

static inline void v16_store(float *at, v16 v) {
    _mm512_storeu_ps(at, v);
}

static inline v16 v16_set1(float x) {
    return _mm512_set1_ps(x);
}

/* One fp16 value as a float. */
static inline float float_of_fp16(uint16_t h) {
    return _mm_cvtss_f32(_mm512_castps512_ps128(_mm512_cvtph_ps(_mm256_set1_epi16((short)h))));
}

/* A float as the nearest fp16 value (ties to even). */
static inline uint16_t fp16_of_float(float x) {
    __m256i h = _mm512_cvtps_ph(_mm512_set1_ps(x), _MM_FROUND_TO_NEAREST_INT);
    return (uint16_t)_mm_extract_epi16(_mm256_castsi256_si128(h), 0);
}

/* Sixteen fp16 values as floats. */
static inline v16 v16_from_fp16(const uint16_t *at) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)at));
}

/* Sixteen int8 as floats. */
static inline v16 v16_from_int8(const int8_t *at) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)at)));
}

static inline v16 v16_fma(v16 a, v16 b, v16 c) {
    return _mm512_fmadd_ps(a, b, c);
}

static inline v16 v16_mul(v16 a, v16 b) {
    return _mm512_mul_ps(a, b);
}

static inline v16 v16_sub(v16 a, v16 b) {
    return _mm512_sub_ps(a, b);
}

static inline v16 v16_add(v16 a, v16 b) {
    return _mm512_add_ps(a, b);
}

static inline v16 v16_div(v16 a, v16 b) {
    return _mm512_div_ps(a, b);
}

static inline v16 v16_abs(v16 v) {
    return _mm512_castsi512_ps(_mm512_andnot_si512(_mm512_set1_epi32(INT32_MIN), _mm512_castps_si512(v)));
}

/* Lane by lane, `negative` where `sign`'s sign bit is set, else `otherwise`. */
static inline v16 v16_by_sign(v16 sign, v16 negative, v16 otherwise) {
    __mmask16 set = _mm512_test_epi32_mask(_mm512_castps_si512(sign), _mm512_set1_epi32(INT32_MIN));
    return _mm512_mask_mov_ps(otherwise, set, negative);
}

static inline float v16_max_all(v16 v) {
    return _mm512_reduce_max_ps(v);
}

/* v with the lanes before `from` and after `to` set to -inf. */
static inline v16 v16_outside(v16 v, int from, int to) {
    __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __mmask16 out = _mm512_cmplt_epi32_mask(lane, _mm512_set1_epi32(from)) |
                    _mm512_cmpgt_epi32_mask(lane, _mm512_set1_epi32(to));
    return _mm512_mask_mov_ps(v, out, _mm512_set1_ps(-INFINITY));
}

/* 2^x for x <= 0 (EXP2_TERMS in cpu_kernels.c), 0 below the normal range. */
static inline v16 v16_exp2(v16 x) {
    __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(x, n), p = _mm512_set1_ps(EXP2_TERMS[7]);
    for (int i = 6; i >= 0; i--)
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_TERMS[i]));
    __m512i power = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    __mmask16 normal = _mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP2_FLOOR), _CMP_GE_OQ);
    return _mm512_maskz_mul_ps(normal, p, _mm512_castsi512_ps(power));
}
