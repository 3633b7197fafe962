/* SkipToIter: the decisions a resumed fit makes, kept apart from fastai so
 * they can be tested directly.  The Python callback asks; this answers. */
#include "frk.h"

#include <stdio.h>
#include <string.h>

enum { IDLE = 0, ARMED = 1, IN_EPOCH = 2, DONE = 3 };

int frk_skip_plan(int has_saved, int64_t saved_epoch, int64_t saved_iter, int64_t start_epoch,
                  int64_t start_iter, int64_t *epoch, int64_t *iter)
{
    if (start_epoch >= 0 || start_iter >= 0) {
        /* An explicit start wins; a missing half is the saved one, or zero. */
        *epoch = start_epoch >= 0 ? start_epoch : (has_saved ? saved_epoch : 0);
        *iter = start_iter >= 0 ? start_iter : 0;
        return 1;
    } else if (has_saved) {
        *epoch = saved_epoch;
        *iter = saved_iter;
    } else {
        return 0;
    }
    return 1;
}

static int bad(frk_error *err, const char *msg, int64_t a, int64_t b)
{
    snprintf(err->msg, sizeof err->msg, msg, (long long)a, (long long)b);
    err->status = FRK_EINVAL;
    err->sys_errno = 0;
    return FRK_EINVAL;
}

int frk_skip_arm(frk_skip *s, int64_t epoch, int64_t iter, int64_t n_epoch, int64_t n_iter,
                 frk_error *err)
{
    memset(s, 0, sizeof *s);
    if (n_epoch < 0 || n_iter < 0)
        return bad(err, "a fit of %lld epochs of %lld batches cannot be resumed", n_epoch, n_iter);
    if (epoch < 0 || epoch > n_epoch)
        return bad(err, "cannot resume at epoch %lld of a fit of %lld epochs", epoch, n_epoch);
    if (iter < 0 || iter > n_iter)
        return bad(err, "cannot resume at batch %lld of an epoch of %lld batches", iter, n_iter);
    if (epoch == n_epoch && iter > 0)
        return bad(err, "cannot resume at batch %lld after the last epoch (%lld)", iter, n_epoch);
    s->epoch = epoch;
    s->iter = iter;
    s->n_epoch = n_epoch;
    s->n_iter = n_iter;
    s->state = ARMED;
    return FRK_OK;
}

void frk_skip_disarm(frk_skip *s) { memset(s, 0, sizeof *s); }

frk_skip_step frk_skip_before_epoch(frk_skip *s, int64_t epoch)
{
    frk_skip_step step = {FRK_SKIP_RUN, FRK_RNG_NONE, 0};
    if (s->state != ARMED)
        return step;
    if (epoch < s->epoch) {
        step.action = FRK_SKIP_SKIP;
        return step;
    }
    if (epoch > s->epoch) { /* resumed past the target: nothing left to do */
        s->state = DONE;
        return step;
    }
    step.action = FRK_SKIP_RESUME;
    step.first_iter = s->iter;
    if (s->iter == 0) {
        step.rng = FRK_RNG_SAVED;
    } else {
        step.rng = FRK_RNG_EPOCH_START;
        s->rng_pending = 1;
    }
    s->state = IN_EPOCH;
    return step;
}

int frk_skip_take_rng(frk_skip *s)
{
    if (s->state != IN_EPOCH || !s->rng_pending)
        return 0;
    s->rng_pending = 0;
    return 1;
}

void frk_skip_after_epoch(frk_skip *s, int64_t epoch)
{
    if (s->state == IN_EPOCH && epoch >= s->epoch) {
        s->state = DONE;
        s->rng_pending = 0;
    }
}

int frk_skip_pending(const frk_skip *s) { return s->state == ARMED || s->state == IN_EPOCH; }

int frk_skip_after_last_epoch(frk_skip *s)
{
    /* A fit resumed at its very end (every epoch done when it was saved) resumed in no epoch: the
       state it was saved with (its RNG, loaders, schedule) is due now, once. */
    if (s->state != ARMED || s->epoch != s->n_epoch)
        return 0;
    s->state = DONE;
    return 1;
}
