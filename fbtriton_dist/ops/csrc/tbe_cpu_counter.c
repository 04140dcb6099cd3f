/* Rowwise Adagrad with counter (fbtriton_dist.optim.RowWiseAdagradWithCounter, FBGEMM's
 * rowwise_adagrad_with_counter, weight_decay_mode COUNTER or COWCLIP): one row's update, called
 * by tbe_cpu_backward.c's row update (OPT_ROWWISE_ADAGRAD_WITH_COUNTER). The formulas:
 * docs/optimizers_counter.md; the spec: reference/counter.py.
 *
 * Not built alone: tbe_cpu_backward.c includes this file, so that the row update is inlined
 * into the run loop's clones (built for their target, as the other optimizers' updates): a
 * call per row into a separately built function, with its scalar sum of squares, made the
 * counter's backward on C0 2.3 ms slower than rowwise Adagrad's; inlined and vectorised,
 * 0.3 to 0.9 ms (docs/results/tbe-cpu-counter-2026-12-05.md).
 *
 * Operation for operation the torch step's (ops/cpu.py, the reference's counter_rows) in fp32:
 * a Python number meets an fp32 tensor as an fp32 value, `x / tensor` is the tensor's
 * reciprocal times x (torch's __rtruediv__), `tensor ** p` takes torch's shortcuts for
 * p = 0, 0.5, 1, 2, 3. What can differ (within fp32 rounding): the order of the two sums over
 * D (the squared gradient, COWCLIP's row norm), exp / pow (libm here, SLEEF in torch's
 * vector loops), and the new row (written here, added as w + (new - w) by the torch step). */
#ifndef TBE_CPU_COUNTER_C
#define TBE_CPU_COUNTER_C
#include "tbe_cpu.h"

/* The slots of `const double *counter` (optim_counter.NATIVE_COUNTER_FIELDS: a test checks
 * them against it) and the codes of the modes (their index in optim_counter's tuples). */
enum { CTR_COWCLIP = 0, CTR_DECAY_MODE = 1, CTR_LEARNING_RATE_MODE = 2, CTR_HALFLIFE = 3,
       CTR_DECAY_RATE = 4, CTR_ADJUSTMENT_ITER = 5, CTR_ADJUSTMENT_UB = 6, CTR_THRESHOLD = 7,
       CTR_MAX_COUNTER = 8, CTR_WEIGHT_NORM_COEFFICIENT = 9, CTR_LOWER_BOUND = 10,
       CTR_COUNT = 11 };
enum { DECAY_NONE = 0, DECAY_L2 = 1, DECAY_DECOUPLED = 2, DECAY_ADAGRADW = 3 };
enum { LR_EQUAL = 0, LR_TAIL_ID_INCREASE = 1, LR_TAIL_ID_DECREASE = 2, LR_COUNTER_SGD = 3 };

/* The parameters, read once per backward from the `counter` array (CTR_* slots) and the
 * hyper-parameters */
typedef struct {
    int cowclip, decay, lr_mode, enabled; /* enabled: the step is past adjustment_iter */
    int64_t halflife;
    float t, lr, eps, wd, halflife_f, decay_rate, ub, threshold, max_counter, coef, lower, base,
        gap_cap;
    double ub_d;
} counter_args;

static void counter_setup(counter_args *c, const double *counter, double lr, double eps,
                          double wd, double t) {
    const double adjustment_iter = counter[CTR_ADJUSTMENT_ITER];
    *c = (counter_args){
        .cowclip = counter[CTR_COWCLIP] != 0.0,
        .decay = (int)counter[CTR_DECAY_MODE],
        .lr_mode = (int)counter[CTR_LEARNING_RATE_MODE],
        .halflife = (int64_t)counter[CTR_HALFLIFE],
        .enabled = adjustment_iter <= 0.0 || t > adjustment_iter,
        .t = (float)t, .lr = (float)lr, .eps = (float)eps, .wd = (float)wd,
        .halflife_f = (float)counter[CTR_HALFLIFE],
        .decay_rate = (float)counter[CTR_DECAY_RATE],
        .ub = (float)counter[CTR_ADJUSTMENT_UB], .ub_d = counter[CTR_ADJUSTMENT_UB],
        .threshold = (float)counter[CTR_THRESHOLD],
        .max_counter = (float)counter[CTR_MAX_COUNTER],
        .coef = (float)counter[CTR_WEIGHT_NORM_COEFFICIENT],
        .lower = (float)counter[CTR_LOWER_BOUND],
        .base = (float)(1.0 - wd * lr),
        .gap_cap = (float)(t - adjustment_iter),
    };
}

/* x ** ub as torch.pow(tensor, ub) takes it */
INLINE float pow_ub(float x, const counter_args *c) {
    if (c->ub_d == 0.0) return 1.0f;
    if (c->ub_d == 1.0) return x;
    if (c->ub_d == 0.5) return sqrtf(x);
    if (c->ub_d == 2.0) return x * x;
    if (c->ub_d == 3.0) return x * x * x;
    return (float)pow((double)x, c->ub_d);
}

INLINE float clampf(float x, float lo, float hi) {
    return x < lo ? lo : (x > hi ? hi : x);
}

/* sum over D of (x + l2 w)^2 (l2: 0 skips w), LANES lanes, the same order either way; the
 * branch outside the loops, so that both vectorise */
INLINE float squares(const float *restrict x, const float *restrict w, float l2, int64_t D) {
    float lane[LANES] = {0};
    int64_t d = 0;
    if (l2 != 0.0f) {
        for (; d + LANES <= D; d += LANES)
            for (int j = 0; j < LANES; ++j) {
                const float v = x[d + j] + l2 * w[d + j];
                lane[j] += v * v;
            }
        for (int j = 0; d < D; ++d, ++j) {
            const float v = x[d] + l2 * w[d];
            lane[j] += v * v;
        }
    } else {
        for (; d + LANES <= D; d += LANES)
            for (int j = 0; j < LANES; ++j) lane[j] += x[d + j] * x[d + j];
        for (int j = 0; d < D; ++d, ++j) lane[j] += x[d] * x[d];
    }
    float s = 0.0f;
    for (int j = 0; j < LANES; ++j) s += lane[j];
    return s;
}

INLINE void counter_row(const counter_args *c, float *restrict w, const float *restrict g,
                        int64_t D, float *m, float *prev, float *count) {
    const float gap = *prev == 0.0f ? 1.0f : c->t - *prev; /* steps since the row's last update */
    float n = *count;
    if (c->halflife > 0)
        n = 1.0f + expf(-gap * c->decay_rate) * n;
    else if (c->halflife == 0)
        n = 1.0f;
    else
        n = n + 1.0f;
    const float freq = (1.0f / n) * c->halflife_f;
    const float g_sq = squares(g, w, c->decay == DECAY_L2 ? c->wd : 0.0f, D);
    const float mv = *m + g_sq / (float)D;
    const float denom = sqrtf(mv) + c->eps;
    const float rate = (1.0f / denom) * c->lr;
    float step = rate, corr = 1.0f;
    if (!c->cowclip) {
        if (c->enabled && c->lr_mode != LR_EQUAL && n > c->threshold) { /* a head id */
            if (c->lr_mode == LR_TAIL_ID_INCREASE)
                step = rate * clampf(pow_ub((1.0f / (n + 1.0f)) * c->max_counter, c), 1.0f, 10.0f);
            else if (c->lr_mode == LR_TAIL_ID_DECREASE)
                step = rate * clampf(pow_ub((n + 1.0f) / c->max_counter, c), 0.1f, 1.0f);
            else /* counter_sgd */
                step = (1.0f / (sqrtf(n * c->ub) + c->eps)) * c->lr;
        }
        if (c->enabled && c->decay == DECAY_ADAGRADW) {
            if (c->halflife == -1) {
                step = rate * sqrtf(n);
            } else if (c->halflife == -2) {
                const float scaled = n * c->lr;
                step = (scaled > c->ub ? c->ub : scaled) / denom;
            }
            /* the decay the row missed while unseen, paid now */
            const float lazy = powf(c->base, (gap < c->gap_cap ? gap : c->gap_cap) - 1.0f);
            step = step * lazy;
            corr = lazy * c->base;
        } else if (c->enabled && c->decay == DECAY_DECOUPLED) {
            corr = 1.0f - freq * c->wd * c->lr;
        } else if (c->enabled && c->decay == DECAY_L2) {
            corr = 1.0f - freq * c->wd * rate;
        }
    } else { /* COWCLIP: the step clipped to n max(coef ||w||, lower_bound) / ||g'|| */
        const float w_norm = sqrtf(squares(w, w, 0.0f, D));
        const float scaled = w_norm * c->coef;
        const float clip = n * (scaled < c->lower ? c->lower : scaled);
        const float ratio = clip / sqrtf(g_sq);
        step = (ratio < 1.0f ? ratio : 1.0f) * rate; /* 0 / 0: 1 */
        if (c->decay == DECAY_DECOUPLED)
            corr = c->base;
        else if (c->decay == DECAY_L2)
            corr = 1.0f - step * c->wd;
    }
    for (int64_t d = 0; d < D; ++d) w[d] = corr * w[d] - step * g[d];
    *m = mv;
    *prev = c->t;
    *count = n;
}
#endif
