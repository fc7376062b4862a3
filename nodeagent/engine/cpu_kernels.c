/* The node's quantized CPU kernels, int4 and int8 weights in groups of 32, in integer arithmetic.
 * Two builds of this file, loaded by nodeagent/engine/cpu_kernels.py: AVX-512 VNNI for calls of a
 * few rows and AMX int8 tiles for more (cpu_kernels_avx512.h), or AVX2 for every call
 * (cpu_kernels_avx2.h, built with SF_AVX2). This file holds what they share: the layouts, the
 * worker pool and the entry points.
 *
 * Every sum is an exact integer, so every path gives the same bits and a row's products never
 * depend on the rows beside it (decode and a prefill of the same tokens agree to the bit):
 * - each group of 32 activations a becomes q = round(a / step), step = max|a| / QMAX, split as
 *   q = 16 * high + low with both in int8 (12 bits in all);
 * - per group and output, the codes c give D = 16 * sum(high * c) + sum(low * c) = sum(q * c)
 *   exactly in int32 (int4 on the tiles: one product of [high, low] by [16 c, c]);
 * - the group then adds step * scale * D (int8: w = scale * c) or step * (scale * D + minimum *
 *   sum(q)) (int4: w = scale * c + minimum) to each output, one fixed order of fp32 operations;
 *   scales and minimums come in fp16, as GGUF keeps them.
 *
 * Codes come in the kernels' own layouts (`pack_int4`, `pack_int8` in cpu_kernels.py), 64 bytes
 * for each 16 outputs: int4 by 8 inputs, byte 4 i + j holding output i's code at input j (low
 * nibble) and j + 4 (high); int8 by 4 inputs, byte 4 i + j holding output i's code at input j.
 * Scales too (`pack_scales`): each 16 outputs' scales group after group, so that one row's
 * product reads its weight in two streams.
 */
#include <immintrin.h>
#include <limits.h>
#include <linux/futex.h>
#include <omp.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define GROUP 32               /* inputs per scale */
#define QUADS (GROUP / 4)      /* 4-input steps of a group: one VNNI lane, one tile row */
#define UNIT 64                /* bytes of codes for 16 outputs: 8 inputs of int4, 4 of int8 */
#define SPLIT_BITS 4           /* q = 2^SPLIT_BITS * high + low */
#define QMAX 2039.0f           /* |q| whose high byte still fits int8: 127 * 16 + 7 */
#define VECTOR_ROWS 4          /* rows the vector path holds in registers at once */
#define MAX_THREADS 64
#define SPIN_PAUSES 2000       /* a pool worker's wait for the next call before it sleeps: tens of us */

/* A weight: codes, fp16 scales and its code width. For each 16 outputs (a column tile) the scales
 * run group by group, 16 scales and for int4 then 16 minimums: a tile's scales are one stream. */
typedef struct {
    const uint8_t *codes;
    const uint16_t *scales;
    int bits;
} weight;

/* fp16 values a group holds for each 16 outputs: scale, and for int4 minimum. */
static inline int parts(const weight *w) {
    return w->bits == 4 ? 2 : 1;
}

static inline const uint16_t *group_scales(const weight *w, int t, int groups, int g) {
    return w->scales + ((size_t)t * groups + g) * parts(w) * 16;
}

/* The activations quantized per group: for each row and group 64 bytes, the 32 highs of q then
 * the 32 lows ([m][2 k]), and per [m][k / GROUP] the step and sum(q). */
typedef struct {
    int8_t *halves;
    float *step, *total;
} activations;

static size_t column_tile_bytes(int bits, int k_all) {
    return (size_t)k_all * 16 * bits / 8;
}

#ifdef SF_AVX2
#include "cpu_kernels_avx2.h"
#else
#include "cpu_kernels_avx512.h"
#endif

static void vector_rows(const activations *a, const weight *w, int t, float *y, int m, int n, int k_all) {
    for (int r0 = 0; r0 < m; r0 += VECTOR_ROWS) {
        int rows = m - r0 < VECTOR_ROWS ? m - r0 : VECTOR_ROWS;
        if (w->bits == 4) {
            switch (rows) {
            case 1: vector_tile(a, &(weight){w->codes, w->scales, 4}, t, y, r0, 1, n, k_all); break;
            case 2: vector_tile(a, &(weight){w->codes, w->scales, 4}, t, y, r0, 2, n, k_all); break;
            case 3: vector_tile(a, &(weight){w->codes, w->scales, 4}, t, y, r0, 3, n, k_all); break;
            default: vector_tile(a, &(weight){w->codes, w->scales, 4}, t, y, r0, 4, n, k_all);
            }
        } else {
            switch (rows) {
            case 1: vector_tile(a, &(weight){w->codes, w->scales, 8}, t, y, r0, 1, n, k_all); break;
            case 2: vector_tile(a, &(weight){w->codes, w->scales, 8}, t, y, r0, 2, n, k_all); break;
            case 3: vector_tile(a, &(weight){w->codes, w->scales, 8}, t, y, r0, 3, n, k_all); break;
            default: vector_tile(a, &(weight){w->codes, w->scales, 8}, t, y, r0, 4, n, k_all);
            }
        }
    }
}

/* Vector-path calls run on a pool of their own rather than OpenMP's: called from the scheduler's thread,
 * libgomp counts more threads than CPUs on a small machine and puts its workers to sleep between
 * calls, so every call paid a wake-up. The pool's workers spin briefly for the next call first. */
typedef struct {
    const activations *a;
    const weight *w;
    float *y;
    int m, n, k_all;
} call;

static struct {
    pthread_mutex_t lock;  /* one caller at a time */
    atomic_uint generation;  /* bumped for each call; workers wait on it */
    atomic_int pending, sleepers;
    const call *job;
    int parts, workers;
} pool = {.lock = PTHREAD_MUTEX_INITIALIZER};

typedef struct {
    int part;
    unsigned seen;
} worker_start;

/* Part `part` of `parts` of the call: a contiguous share of its column tiles. */
static void run_part(const call *c, int part, int parts) {
    int tiles = c->n / 16;
    for (int t = tiles * part / parts; t < tiles * (part + 1) / parts; t++)
        vector_rows(c->a, c->w, t, c->y, c->m, c->n, c->k_all);
}

static void *pool_worker(void *arg) {
    worker_start start = *(worker_start *)arg;
    free(arg);
    for (unsigned seen = start.seen;;) {
        unsigned now;
        for (int spins = 0; (now = atomic_load(&pool.generation)) == seen;) {
            if (++spins < SPIN_PAUSES) {
                _mm_pause();
                continue;
            }
            atomic_fetch_add(&pool.sleepers, 1);
            syscall(SYS_futex, &pool.generation, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
            atomic_fetch_sub(&pool.sleepers, 1);
        }
        seen = now;
        if (start.part < pool.parts)
            run_part(pool.job, start.part, pool.parts);
        atomic_fetch_sub(&pool.pending, 1);
    }
    return NULL;
}

/* A forked child has none of the parent's workers. */
static void forget_workers(void) {
    pthread_mutex_init(&pool.lock, NULL);
    pool.workers = 0;
    atomic_store(&pool.sleepers, 0);
}

static void watch_forks(void) {
    pthread_atfork(NULL, NULL, forget_workers);
}

/* Starts workers up to `wanted` (with the caller, `wanted` + 1 threads); how many there are. */
static int hire(int wanted) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, watch_forks);
    while (pool.workers < wanted) {
        worker_start *start = malloc(sizeof *start);
        pthread_t thread;
        if (start == NULL)
            break;
        *start = (worker_start){pool.workers + 1, atomic_load(&pool.generation)};
        if (pthread_create(&thread, NULL, pool_worker, start) != 0) {
            free(start);
            break;
        }
        pthread_detach(thread);
        pool.workers++;
    }
    return pool.workers;
}

static void pooled(const call *c) {
    pthread_mutex_lock(&pool.lock);
    int threads = omp_get_max_threads();
    int workers = hire((threads < MAX_THREADS ? threads : MAX_THREADS) - 1);
    pool.job = c;
    pool.parts = workers + 1;
    atomic_store(&pool.pending, workers);
    atomic_fetch_add(&pool.generation, 1);
    if (atomic_load(&pool.sleepers) > 0)
        syscall(SYS_futex, &pool.generation, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
    run_part(c, 0, workers + 1);
    while (atomic_load(&pool.pending) > 0)
        _mm_pause();
    pthread_mutex_unlock(&pool.lock);
}

/* The vector path: the rows quantized here, the column tiles shared out on the pool. */
static void vectored(const float *x, const activations *a, const weight *w, float *y, int m, int n, int k_all) {
    for (int r = 0; r < m; r++)
        quantize_row(x, a, r, k_all);
    pooled(&(call){a, w, y, m, n, k_all});
}

static int product(const float *x, const weight *w, float *y, int m, int n, int k_all, int tile_rows) {
    int groups = k_all / GROUP, status = 0;
    activations a = {malloc((size_t)m * k_all * 2), malloc((size_t)m * groups * 4), malloc((size_t)m * groups * 4)};
    if (a.halves == NULL || a.step == NULL || a.total == NULL) {
        free(a.halves), free(a.step), free(a.total);
        return -1;
    }
#ifdef HAS_TILES
    if (m >= tile_rows)
        status = tiled(x, &a, w, y, m, n, k_all);
    else
#endif
        vectored(x, &a, w, y, m, n, k_all);
    free(a.halves), free(a.step), free(a.total);
    return status;
}

/* y[m, n] = x[m, k_all] @ W.T in fp32, w = scale * code + minimum with codes 0..15, the scales laid
 * out as `weight` says. Calls of `tile_rows` rows or more take the tile path (pass more rows than
 * any call has where the process has no tiles). Returns -1 where memory ran out. */
int sf_int4_mm(const float *x, const uint8_t *codes, const uint16_t *scales, float *y, int m, int n, int k_all,
               int tile_rows) {
    weight w = {codes, scales, 4};
    return product(x, &w, y, m, n, k_all, tile_rows);
}

/* The same for int8: w = scale * code, codes -128..127. */
int sf_int8_mm(const float *x, const int8_t *codes, const uint16_t *scales, float *y, int m, int n, int k_all,
               int tile_rows) {
    weight w = {(const uint8_t *)codes, scales, 8};
    return product(x, &w, y, m, n, k_all, tile_rows);
}
