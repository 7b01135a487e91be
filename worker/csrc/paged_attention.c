/* Causal attention of a batch of runs over a paged KV pool, reading each block in place.
 *
 * The torch path gathers every sequence's blocks into a padded [B, K, T, d] copy per layer and
 * then reads that copy again in SDPA; on a CPU the copy costs more than the attention. Here
 * each sequence's K and V rows are read straight from the pool, once per KV head, and shared
 * by all the query rows of that head (the γ+1 verify tokens × the H/K query heads).
 *
 * Plain C (GCC vector extensions, pthreads) with no torch headers, so that it compiles in
 * about a second: worker/attention.py builds it on first use.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));
#define TILE 8  /* query rows scored together: 8 independent FMA chains hide the FMA latency */

typedef struct {
    const float *q, *kc, *vc;
    const int64_t *tables, *pos;
    float *out;
    int64_t B, Q, H, K, d, bs, max_blocks, q_stride;
    float scale;
    int64_t b0, b1;
    int status;
} Args;

static inline float hsum(v8 x) {
    return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7]));
}

#define INLINE static inline __attribute__((always_inline))

/* scores of nr (<= TILE) query rows against key t; called with constant nr and nc, so that the
 * accumulators and the loops unroll into registers */
INLINE void score_tile(const float *qh, int64_t nr, const float *kt, int64_t nc, float scale, float *s,
                       int64_t T) {
    v8 acc[TILE] = {0};
    for (int64_t c = 0; c < nc; c++) {
        v8 k;
        memcpy(&k, kt + 8 * c, sizeof k);
        for (int64_t r = 0; r < nr; r++) {
            v8 qv;
            memcpy(&qv, qh + r * nc * 8 + 8 * c, sizeof qv);
            acc[r] += qv * k;
        }
    }
    for (int64_t r = 0; r < nr; r++) s[r * T] = hsum(acc[r]) * scale;
}

/* qh: [K, R, d] query rows grouped by KV head; s: [K, R, T] */
INLINE void score_rows_nc(const float *qh, int64_t K, int64_t R, const float *kc, const int64_t *table,
                          int64_t T, int64_t bs, int64_t nc, float scale, float *s) {
    const int64_t d = 8 * nc;
    for (int64_t t = 0; t < T; t++) {
        const float *kt = kc + (table[t / bs] * bs + t % bs) * K * d;  /* [K, d]: one key row, all heads */
        for (int64_t kh = 0; kh < K; kh++) {
            const float *qk = qh + kh * R * d, *k = kt + kh * d;
            float *sk = s + kh * R * T + t;
            int64_t r0 = 0;
            for (; r0 + TILE <= R; r0 += TILE) score_tile(qk + r0 * d, TILE, k, nc, scale, sk + r0 * T, T);
            switch (R - r0) {  /* the remainder, as a constant tile */
#define TAIL(n) case n: score_tile(qk + r0 * d, n, k, nc, scale, sk + r0 * T, T); break;
                TAIL(1) TAIL(2) TAIL(3) TAIL(4) TAIL(5) TAIL(6) TAIL(7)
#undef TAIL
                default: break;
            }
        }
    }
}

/* out_row = sum_{t < n} p[t] * v_t for one query row */
INLINE void weigh_values_nc(const float *p, int64_t n, const float *vc, const int64_t *table, int64_t bs,
                            int64_t kstride, int64_t nc, float *out_row) {
    v8 acc[32] = {0};
    for (int64_t t = 0; t < n; t++) {
        const float *vt = vc + (table[t / bs] * bs + t % bs) * kstride;
        const v8 w = {p[t], p[t], p[t], p[t], p[t], p[t], p[t], p[t]};
        for (int64_t c = 0; c < nc; c++) {
            v8 v;
            memcpy(&v, vt + 8 * c, sizeof v);
            acc[c] += w * v;
        }
    }
    memcpy(out_row, acc, sizeof(float) * 8 * nc);
}

/* s[(kh * R + r) * T + t] = scale * q[kh, r] . k_t[kh] for keys t in [0, T) */
static void score_rows(const float *qh, int64_t K, int64_t R, const float *kc, const int64_t *table, int64_t T,
                       int64_t bs, int64_t d, float scale, float *s) {
    switch (d) {  /* the common head sizes get loops of constant length */
        case 64: score_rows_nc(qh, K, R, kc, table, T, bs, 8, scale, s); break;
        case 128: score_rows_nc(qh, K, R, kc, table, T, bs, 16, scale, s); break;
        default: score_rows_nc(qh, K, R, kc, table, T, bs, d / 8, scale, s); break;
    }
}

static void weigh_values(const float *p, int64_t n, const float *vc, const int64_t *table, int64_t bs,
                         int64_t kstride, int64_t d, float *out_row) {
    switch (d) {
        case 64: weigh_values_nc(p, n, vc, table, bs, kstride, 8, out_row); break;
        case 128: weigh_values_nc(p, n, vc, table, bs, kstride, 16, out_row); break;
        default: weigh_values_nc(p, n, vc, table, bs, kstride, d / 8, out_row); break;
    }
}

static void softmax(float *row, int64_t n) {
    float m = row[0], sum = 0.f;
    for (int64_t t = 1; t < n; t++) m = row[t] > m ? row[t] : m;
    for (int64_t t = 0; t < n; t++) { row[t] = expf(row[t] - m); sum += row[t]; }
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < n; t++) row[t] *= inv;
}

static void *run_range(void *arg) {
    Args *a = (Args *)arg;
    const int64_t Q = a->Q, H = a->H, K = a->K, d = a->d, bs = a->bs, rep = H / K, R = Q * rep;
    /* qh: [K, R, d] the queries grouped by KV head; s: [K, R, T] their scores, then probabilities */
    float *s = NULL, *qh = (float *)malloc(sizeof(float) * K * R * d);
    int64_t s_cap = 0;
    if (!qh) { a->status = 1; return NULL; }
    for (int64_t b = a->b0; b < a->b1; b++) {
        const int64_t *pos = a->pos + b * Q;  /* [Q] last key index each query row may see */
        const int64_t *table = a->tables + b * a->max_blocks;
        int64_t T = 0;
        for (int64_t qi = 0; qi < Q; qi++) T = pos[qi] + 1 > T ? pos[qi] + 1 : T;
        if (K * R * T > s_cap) {
            free(s);
            s_cap = K * R * T;
            s = (float *)malloc(sizeof(float) * s_cap);
            if (!s) { a->status = 1; break; }
        }
        /* row r = qi * rep + j of head kh is query head kh * rep + j of token qi */
        for (int64_t kh = 0; kh < K; kh++)
            for (int64_t qi = 0; qi < Q; qi++)
                memcpy(qh + (kh * R + qi * rep) * d, a->q + (b * Q + qi) * a->q_stride + kh * rep * d,
                       sizeof(float) * rep * d);
        score_rows(qh, K, R, a->kc, table, T, bs, d, a->scale, s);
        for (int64_t kh = 0; kh < K; kh++)
            for (int64_t r = 0; r < R; r++) {
                const int64_t qi = r / rep, n = pos[qi] + 1;
                float *p = s + (kh * R + r) * T;
                softmax(p, n);
                weigh_values(p, n, a->vc + kh * d, table, bs, K * d, d,
                             a->out + ((b * Q + qi) * H + kh * rep + r % rep) * d);
            }
    }
    free(s);
    free(qh);
    return NULL;
}

/* q: rows b*Q + qi, each q_stride floats apart, holding H heads of d; kc, vc: [num_blocks, bs, K, d];
 * tables: [B, max_blocks]; pos: [B * Q]; out: [B * Q, H * d]. d must be a multiple of 8, at most 256.
 * Returns 0; 1 when out of memory; 2 for an unsupported d. */
int paged_attention(const float *q, int64_t q_stride, const float *kc, const float *vc, const int64_t *tables,
                    int64_t max_blocks, const int64_t *pos, float *out, int64_t B, int64_t Q, int64_t H, int64_t K,
                    int64_t d, int64_t bs, float scale, int threads) {
    enum { MAX_THREADS = 64 };
    if (d % 8 || d > 256) return 2;
    if (threads > B) threads = (int)B;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads < 1) threads = 1;
    Args args[MAX_THREADS];
    pthread_t tid[MAX_THREADS];
    for (int i = 0; i < threads; i++) {
        Args a = {q, kc, vc, tables, pos, out, B, Q, H, K, d, bs, max_blocks, q_stride, scale,
                  B * i / threads, B * (i + 1) / threads, 0};
        args[i] = a;
    }
    int started = 0;  /* threads 1..started run beside this one; any that failed to start run here */
    while (started + 1 < threads && pthread_create(&tid[started + 1], NULL, run_range, &args[started + 1]) == 0)
        started++;
    for (int i = started + 1; i < threads; i++) run_range(&args[i]);
    run_range(&args[0]);
    int status = 0;
    for (int i = 1; i <= started; i++) pthread_join(tid[i], NULL);
    for (int i = 0; i < threads; i++) status |= args[i].status;
    return status;
}
