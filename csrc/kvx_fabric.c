/*
 * kvx._fabric: one-sided READ and WRITE through a posting provider
 * (kvx_post.h): libfabric ("ofi") or the provider that moves no data
 * ("null"). Python reaches it through kvx/backends/rdma/fabric.py only;
 * the design is written down there.
 *
 * This file is the engine: the Python types, the table of registered
 * memory (sorted by address, so a local piece finds its descriptor), the
 * peers, the work-request builder, the completion dispatch and the
 * progress thread. It owns no policy beyond the limits it enforces.
 *
 * Memory safety of late completions: every work request's context lives in
 * a batch that is reference counted (the poster holds one reference, each
 * outstanding request one more). A poster that times out cancels what it
 * can, drops its reference and returns; completions that arrive later
 * still find their batch, and the last one frees it. Batches nobody will
 * complete are freed when the endpoint closes, after the provider is
 * closed.
 *
 * Reset (Endpoint.reset): software providers (tcp;ofi_rxm) keep moving the
 * bytes of a request they have started after the MR is closed and after the
 * initiator gave up on it; only closing the provider's endpoint stops them.
 * A reset fails the posts in flight (status "RESET"), waits until every
 * caller has left, stops the progress thread, opens a new provider endpoint,
 * closes the old one (MRs, connections), frees every batch (no completion
 * can arrive any more) and registers each live region again under its old
 * key. Peer numbers carry the reset generation in their top bits, so a
 * number from before a reset never names a peer connected after it.
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <rdma/fabric.h>

#include "kvx_post.h"

int kvx_ofi_list(const char *node, void (*each)(void *arg, const struct fi_info *fi), void *arg, char *err);

#define MAX_PIECES ((Py_ssize_t)1 << 24)
#define MAX_TIMEOUT_MS (24LL * 3600 * 1000)
#define MAX_PEERS 65536
#define MAX_PEER_REFS 65536
#define DRAIN_NS 1000000000ull /* what is still posted gets this long to finish before a close */
#define MAX_DROP 64 /* regions closed with one reset (a region's registration per call, say) */
#define MAX_MRS 1048576
#define POLL_BATCH 64
/* Peer numbers: the provider's in the low bits, the reset generation above them. */
#define PEER_GEN_SHIFT 40
#define PEER_PROV_MASK ((UINT64_C(1) << PEER_GEN_SHIFT) - 1)
#define RESET_WAIT_NS (30ull * 1000000000ull)

static PyObject *FabricError;

/* ---- the engine's state ---- */

struct batch;

struct wr_ctx {
    unsigned char scratch[KVX_CTX_SCRATCH]; /* the provider's (FI_CONTEXT2); must stay first */
    struct batch *batch;
    uint32_t slot;
    uint8_t busy;
};

struct batch {
    struct batch *prev, *next; /* the endpoint's list of live batches */
    size_t refs;               /* the poster's one, plus one per outstanding request */
    size_t outstanding;
    int status;
    const char *status_name;
    char text[KVX_ERR_LEN];
    size_t nslots, nfree;
    uint32_t *free;
    struct wr_ctx *ctx;
};

struct mr_entry {
    uint64_t addr, len;
    void *desc;
    void *handle;
    uint64_t id; /* what the MemoryRegion object names it by (the handle changes on reset) */
    uint64_t key;
    int access, device;
};

struct kvx_ep {
    const struct kvx_provider *prov;
    void *impl;
    struct kvx_ep_info info;
    size_t max_sge, max_msg, max_outstanding;

    pthread_mutex_t lock; /* inflight, batches, peers, users, closed, counters */
    pthread_cond_t cond;  /* broadcast on completions and on leaving */
    size_t inflight;
    size_t users;
    int closed;
    struct batch *batches;
    uint64_t *peers; /* sorted */
    uint32_t *peer_refs; /* per peer: the complete() calls not yet disconnected */
    size_t n_peers;
    uint64_t c_posts, c_wrs, c_sges, c_completions, c_errors, c_eagain, c_timeouts, c_orphans, c_resets;
    int resetting;        /* a reset is under way: posts fail, other calls wait */
    uint64_t gen;         /* resets so far: the top bits of every peer number */
    char reset_reason[KVX_ERR_LEN];

    /* What the endpoint was opened with, to open it again on reset. */
    char *arg_provider, *arg_node, *arg_domain;
    struct kvx_open_args open_args;
    size_t want_sge, want_msg, want_outstanding;

    pthread_t thread;
    int thread_running;
    atomic_int stop;

    pthread_rwlock_t mr_lock; /* posts read, register/close write */
    struct mr_entry *mrs;     /* sorted by addr */
    size_t n_mrs, cap_mrs;
    int mrs_closed;
    uint64_t next_mr_id;
};

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void timed_wait(struct kvx_ep *ep, uint64_t until_ns)
{
    struct timespec ts = {.tv_sec = (time_t)(until_ns / 1000000000ull),
                          .tv_nsec = (long)(until_ns % 1000000000ull)};
    pthread_cond_timedwait(&ep->cond, &ep->lock, &ts);
}

static void batch_free_locked(struct kvx_ep *ep, struct batch *b)
{
    if (b->prev)
        b->prev->next = b->next;
    else
        ep->batches = b->next;
    if (b->next)
        b->next->prev = b->prev;
    free(b); /* contexts and slots live in the same block */
}

/* Hand completions to their batches. Called with ep->lock held. */
static void dispatch_locked(struct kvx_ep *ep, struct kvx_cqe *c, int n)
{
    for (int i = 0; i < n; i++) {
        struct wr_ctx *x = c[i].context;
        if (x == NULL || !x->busy) {
            ep->c_orphans++;
            continue;
        }
        struct batch *b = x->batch;
        x->busy = 0;
        b->free[b->nfree++] = x->slot;
        b->outstanding--;
        ep->inflight--;
        ep->c_completions++;
        if (c[i].status != 0) {
            ep->c_errors++;
            if (b->status == 0) {
                b->status = c[i].status;
                b->status_name = c[i].status_name ? c[i].status_name : ep->prov->status_name(c[i].status);
                memcpy(b->text, c[i].text, KVX_ERR_LEN);
                b->text[KVX_ERR_LEN - 1] = 0;
            }
        }
        if (--b->refs == 0)
            batch_free_locked(ep, b);
    }
    if (n > 0)
        pthread_cond_broadcast(&ep->cond);
}

/* Poll once; returns the number of completions dispatched (0 when none or on error). */
static int poll_dispatch(struct kvx_ep *ep, int timeout_ms)
{
    struct kvx_cqe c[POLL_BATCH];
    int n = ep->prov->poll(ep->impl, c, POLL_BATCH, timeout_ms);
    if (n <= 0)
        return 0;
    pthread_mutex_lock(&ep->lock);
    dispatch_locked(ep, c, n);
    pthread_mutex_unlock(&ep->lock);
    return n;
}

/* libfabric's manual progress: the target must drive it too, or a peer's READ never
 * gets its data. One thread per endpoint blocks in the provider's poll for a short
 * while, and the stop flag ends it. */
static void *progress_main(void *arg)
{
    struct kvx_ep *ep = arg;
    while (!atomic_load(&ep->stop)) {
        struct kvx_cqe c[POLL_BATCH];
        int n = ep->prov->poll(ep->impl, c, POLL_BATCH, 20);
        if (n > 0) {
            pthread_mutex_lock(&ep->lock);
            dispatch_locked(ep, c, n);
            pthread_mutex_unlock(&ep->lock);
        } else if (n < 0) {
            struct timespec ts = {0, 1000000};
            nanosleep(&ts, NULL);
        }
    }
    return NULL;
}

/* ---- registered memory ---- */

/* Index of the entry that holds [addr, addr+len), or -1. Read lock held. */
static ssize_t mr_find(const struct kvx_ep *ep, uint64_t addr, uint64_t len)
{
    size_t lo = 0, hi = ep->n_mrs;
    while (lo < hi) { /* first entry with start > addr */
        size_t mid = (lo + hi) / 2;
        if (ep->mrs[mid].addr <= addr)
            lo = mid + 1;
        else
            hi = mid;
    }
    /* Ranges may overlap (one buffer registered twice): look back until one holds it. */
    for (size_t i = lo; i-- > 0;) {
        const struct mr_entry *m = &ep->mrs[i];
        if (addr - m->addr <= m->len && len <= m->len - (addr - m->addr))
            return (ssize_t)i;
    }
    return -1;
}

static int mr_insert_locked(struct kvx_ep *ep, const struct mr_entry *e)
{
    if (ep->n_mrs == ep->cap_mrs) {
        size_t cap = ep->cap_mrs ? ep->cap_mrs * 2 : 16;
        struct mr_entry *m = realloc(ep->mrs, cap * sizeof(*m));
        if (m == NULL)
            return -ENOMEM;
        ep->mrs = m;
        ep->cap_mrs = cap;
    }
    size_t at = ep->n_mrs;
    while (at > 0 && ep->mrs[at - 1].addr > e->addr)
        at--;
    memmove(&ep->mrs[at + 1], &ep->mrs[at], (ep->n_mrs - at) * sizeof(*e));
    ep->mrs[at] = *e;
    ep->n_mrs++;
    return 0;
}

/* Removes the entry and returns its provider handle, or NULL when there is none (a reset
 * could not register it again). */
static void *mr_remove_locked(struct kvx_ep *ep, uint64_t id)
{
    for (size_t i = 0; i < ep->n_mrs; i++) {
        if (ep->mrs[i].id == id) {
            void *handle = ep->mrs[i].handle;
            memmove(&ep->mrs[i], &ep->mrs[i + 1], (ep->n_mrs - i - 1) * sizeof(ep->mrs[0]));
            ep->n_mrs--;
            return handle;
        }
    }
    return NULL;
}

/* ---- peers (sorted array, under ep->lock) ---- */

static ssize_t peer_index(const struct kvx_ep *ep, uint64_t peer, size_t *insert_at)
{
    size_t lo = 0, hi = ep->n_peers;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (ep->peers[mid] < peer)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (insert_at)
        *insert_at = lo;
    return (lo < ep->n_peers && ep->peers[lo] == peer) ? (ssize_t)lo : -1;
}

/* ---- building work requests ---- */

struct gen {
    const uint64_t *la, *ll;
    void **ldesc;
    size_t nl, li;
    uint64_t loff;
    const uint64_t *ra, *rl, *rk;
    size_t nr, ri;
    uint64_t roff;
};

/* The next work request: at most max_msg bytes of one remote piece, gathered from at most
 * max_sge local pieces. Returns 0 when every remote byte has been handed out. */
static int next_wr(struct gen *g, size_t max_sge, size_t max_msg, struct iovec *iov, void **desc,
                   struct kvx_wr *wr)
{
    while (g->ri < g->nr && g->rl[g->ri] == g->roff) {
        g->ri++;
        g->roff = 0;
    }
    if (g->ri == g->nr)
        return 0;
    uint64_t want = g->rl[g->ri] - g->roff;
    if (want > max_msg)
        want = max_msg;
    size_t n = 0;
    uint64_t got = 0;
    while (got < want && n < max_sge) {
        while (g->ll[g->li] == g->loff) { /* totals match, so li stays in range */
            g->li++;
            g->loff = 0;
        }
        uint64_t take = g->ll[g->li] - g->loff;
        if (take > want - got)
            take = want - got;
        iov[n].iov_base = (void *)(uintptr_t)(g->la[g->li] + g->loff);
        iov[n].iov_len = (size_t)take;
        desc[n] = g->ldesc[g->li];
        n++;
        got += take;
        g->loff += take;
    }
    wr->local = iov;
    wr->local_desc = desc;
    wr->local_count = n;
    wr->remote_addr = g->ra[g->ri] + g->roff;
    wr->remote_key = g->rk[g->ri];
    g->roff += got;
    return 1;
}

enum { RUN_OK = 0, RUN_ERROR = 1, RUN_TIMEOUT = 2, RUN_NOMEM = 3, RUN_RESET = 4 };

struct run_result {
    int status;
    const char *status_name;
    char text[KVX_ERR_LEN];
};

static void fail_batch_locked(struct batch *b, int status, const char *name, const char *text)
{
    if (b->status == 0) {
        b->status = status;
        b->status_name = name;
        snprintf(b->text, KVX_ERR_LEN, "%s", text);
    }
}

/* Post every work request of one call and wait for them all. GIL released, mr_lock read-held. */
static int run_batch(struct kvx_ep *ep, int op, uint64_t peer, struct gen *g, size_t n_wr_max,
                     uint64_t deadline_ns, struct run_result *res)
{
    size_t nslots = n_wr_max < ep->max_outstanding ? n_wr_max : ep->max_outstanding;
    if (nslots == 0)
        nslots = 1;
    /* One allocation per batch: the batch, its contexts, its free-slot stack and the
     * poster's reservation scratch (the last is only the poster's, but lives as long). */
    size_t ctx_at = (sizeof(struct batch) + 63) & ~(size_t)63;
    size_t free_at = ctx_at + nslots * sizeof(struct wr_ctx);
    size_t mine_at = free_at + nslots * sizeof(uint32_t);
    char *block = malloc(mine_at + nslots * sizeof(uint32_t));
    if (block == NULL)
        return RUN_NOMEM;
    struct batch *b = (struct batch *)block;
    memset(b, 0, sizeof(*b));
    b->ctx = (struct wr_ctx *)(block + ctx_at);
    b->free = (uint32_t *)(block + free_at);
    uint32_t *mine = (uint32_t *)(block + mine_at);
    b->nslots = nslots;
    for (size_t i = 0; i < nslots; i++) {
        b->ctx[i].batch = b;
        b->ctx[i].slot = (uint32_t)i;
        b->ctx[i].busy = 0;
        b->free[i] = (uint32_t)(nslots - 1 - i);
    }
    b->nfree = nslots;
    b->refs = 1;

    pthread_mutex_lock(&ep->lock);
    b->next = ep->batches;
    if (ep->batches)
        ep->batches->prev = b;
    ep->batches = b;
    pthread_mutex_unlock(&ep->lock);

    int inline_poll = !ep->info.needs_progress;
    int posting_done = 0;
    int rc = RUN_OK;
    uint64_t wrs = 0, sges = 0, eagain = 0;
    struct iovec iov[KVX_SGE_CAP];
    void *desc[KVX_SGE_CAP];
    for (;;) {
        /* Reserve what the batch and the endpoint's queue allow. */
        size_t k = 0;
        pthread_mutex_lock(&ep->lock);
        if (b->status != 0 || ep->resetting)
            posting_done = 1; /* an error completion or a reset: post nothing more */
        if (!posting_done) {
            size_t room = ep->max_outstanding > ep->inflight ? ep->max_outstanding - ep->inflight : 0;
            k = b->nfree < room ? b->nfree : room;
            for (size_t j = 0; j < k; j++) {
                uint32_t s = b->free[--b->nfree];
                mine[j] = s;
                b->ctx[s].busy = 1;
            }
            b->outstanding += k;
            b->refs += k;
            ep->inflight += k;
        }
        pthread_mutex_unlock(&ep->lock);

        size_t used = 0;
        int post_rc = 0;
        while (used < k) {
            struct kvx_wr wr = {.op = op, .peer = peer};
            struct gen saved = *g;
            if (!next_wr(g, ep->max_sge, ep->max_msg, iov, desc, &wr)) {
                posting_done = 1;
                break;
            }
            wr.context = &b->ctx[mine[used]];
            post_rc = ep->prov->post(ep->impl, &wr);
            if (post_rc != 0) {
                *g = saved; /* not posted: build it again next time */
                break;
            }
            used++;
            wrs++;
            sges += wr.local_count;
        }
        if (used == k && !posting_done && k > 0) {
            /* Every reserved slot went out; is anything left? */
            struct gen probe = *g;
            struct kvx_wr wr;
            if (!next_wr(&probe, ep->max_sge, ep->max_msg, iov, desc, &wr))
                posting_done = 1;
        }
        if (used < k) {
            pthread_mutex_lock(&ep->lock);
            for (size_t j = used; j < k; j++) {
                b->ctx[mine[j]].busy = 0;
                b->free[b->nfree++] = mine[j];
            }
            b->outstanding -= k - used;
            b->refs -= k - used;
            ep->inflight -= k - used;
            if (post_rc != 0 && post_rc != -KVX_EAGAIN) {
                int st = post_rc < 0 ? -post_rc : post_rc;
                char text[KVX_ERR_LEN];
                snprintf(text, sizeof(text), "posting failed: %s", strerror(st < 256 ? st : EIO));
                fail_batch_locked(b, st, ep->prov->status_name(st), text);
                posting_done = 1;
            }
            pthread_mutex_unlock(&ep->lock);
            if (post_rc == -KVX_EAGAIN)
                eagain++;
        }

        /* Done? Otherwise wait for completions (or poll them ourselves). */
        pthread_mutex_lock(&ep->lock);
        int finished = posting_done && b->outstanding == 0;
        int reset = ep->resetting;
        pthread_mutex_unlock(&ep->lock);
        if (finished)
            break;
        if (reset) {
            /* What is outstanding stays with the batch; the reset frees it once the
             * provider is closed. */
            rc = RUN_RESET;
            break;
        }
        uint64_t t = now_ns();
        if (t >= deadline_ns) {
            rc = RUN_TIMEOUT;
            break;
        }
        if (poll_dispatch(ep, 0) > 0)
            continue;
        if (inline_poll) {
            sched_yield();
            continue;
        }
        if (post_rc == -KVX_EAGAIN) {
            /* The provider is busy (connecting, out of buffers): let its progress run. */
            struct timespec pause = {0, 20000};
            nanosleep(&pause, NULL);
            continue;
        }
        pthread_mutex_lock(&ep->lock);
        int blocked = b->outstanding > 0 && (posting_done || b->nfree == 0 || ep->inflight >= ep->max_outstanding ||
                                             post_rc == -KVX_EAGAIN);
        if (blocked || (posting_done && b->outstanding > 0)) {
            uint64_t until = t + 10000000ull; /* recheck every 10 ms: EAGAIN has no signal */
            timed_wait(ep, until < deadline_ns ? until : deadline_ns);
        } else if (!posting_done && k == 0) {
            /* The endpoint's queue is full of other posters' requests. */
            uint64_t until = t + 1000000ull;
            timed_wait(ep, until < deadline_ns ? until : deadline_ns);
        }
        pthread_mutex_unlock(&ep->lock);
    }

    if (rc == RUN_TIMEOUT && ep->prov->cancel != NULL) {
        /* Ask for the rest back; whatever completes later finds its batch alive. */
        for (size_t s = 0; s < b->nslots; s++) {
            pthread_mutex_lock(&ep->lock);
            int busy = b->ctx[s].busy;
            pthread_mutex_unlock(&ep->lock);
            if (busy)
                ep->prov->cancel(ep->impl, &b->ctx[s]);
        }
    }
    pthread_mutex_lock(&ep->lock);
    if (rc == RUN_OK && b->status != 0)
        rc = RUN_ERROR;
    if ((rc == RUN_TIMEOUT || rc == RUN_RESET) && b->status != 0)
        rc = RUN_ERROR; /* an error completion explains the stall better than the clock */

    res->status = b->status;
    res->status_name = b->status_name;
    if (rc == RUN_RESET)
        snprintf(res->text, KVX_ERR_LEN, "the endpoint was reset (%.180s)", ep->reset_reason);
    else
        memcpy(res->text, b->text, KVX_ERR_LEN);
    ep->c_posts++;
    ep->c_wrs += wrs;
    ep->c_sges += sges;
    ep->c_eagain += eagain;
    if (rc == RUN_TIMEOUT)
        ep->c_timeouts++;
    if (--b->refs == 0)
        batch_free_locked(ep, b);
    pthread_mutex_unlock(&ep->lock);
    return rc;
}

/* ---- Python types ---- */

typedef struct {
    PyObject_HEAD struct kvx_ep *ep;
} EndpointObject;

typedef struct {
    PyObject_HEAD EndpointObject *owner;
    uint64_t addr, len, key;
    uint64_t id;
    int closed;
    int device;
    int access;
} MRObject;

static PyTypeObject EndpointType;
static PyTypeObject MRType;

static PyObject *raise_reset(struct kvx_ep *ep, uint64_t peer);

/* Become a user of the endpoint (it is not closed or reset under a user). While a reset
 * is under way a post fails with status RESET at once (its peer number dies with the
 * reset); any other call waits for the reset, a bounded while. GIL held. */
static int ep_enter_as(struct kvx_ep *ep, int is_post, uint64_t peer)
{
    if (ep == NULL) {
        PyErr_SetString(PyExc_ValueError, "the endpoint is closed");
        return -1;
    }
    int closed, resetting;
    /* The fast path (every post): the lock is free and there is nothing to wait
     * for, so the GIL is kept and no clock is read. */
    int decided = 0;
    if (pthread_mutex_trylock(&ep->lock) == 0) {
        if (is_post || !ep->resetting) {
            closed = ep->closed;
            resetting = ep->resetting;
            if (!closed && !resetting)
                ep->users++;
            decided = 1;
        }
        pthread_mutex_unlock(&ep->lock);
    }
    if (!decided) {
        Py_BEGIN_ALLOW_THREADS pthread_mutex_lock(&ep->lock);
        uint64_t deadline = now_ns() + RESET_WAIT_NS;
        while (!is_post && ep->resetting && !ep->closed && now_ns() < deadline)
            timed_wait(ep, now_ns() + 100000000ull);
        closed = ep->closed;
        resetting = ep->resetting;
        if (!closed && !resetting)
            ep->users++;
        pthread_mutex_unlock(&ep->lock);
        Py_END_ALLOW_THREADS
    }
    if (closed) {
        PyErr_SetString(PyExc_ValueError, "the endpoint is closed");
        return -1;
    }
    if (resetting) {
        raise_reset(ep, peer);
        return -1;
    }
    return 0;
}

static int ep_enter(struct kvx_ep *ep)
{
    return ep_enter_as(ep, 0, 0);
}

static void ep_leave(struct kvx_ep *ep)
{
    pthread_mutex_lock(&ep->lock);
    ep->users--;
    pthread_cond_broadcast(&ep->cond);
    pthread_mutex_unlock(&ep->lock);
}

static PyObject *raise_provider(int rc, const char *err)
{
    int e = rc < 0 ? -rc : rc;
    PyErr_Format(PyExc_OSError, "%s", err[0] ? err : strerror(e < 256 ? e : EIO));
    return NULL;
}

static void raise_fabric(const char *status, const char *text, uint64_t peer)
{
    PyObject *exc_args = Py_BuildValue("(ssK)", status, text, (unsigned long long)peer);
    if (exc_args != NULL) {
        PyErr_SetObject(FabricError, exc_args);
        Py_DECREF(exc_args);
    }
}

static PyObject *raise_reset(struct kvx_ep *ep, uint64_t peer)
{
    char text[KVX_ERR_LEN + 64];
    pthread_mutex_lock(&ep->lock);
    snprintf(text, sizeof(text), "the endpoint was reset (%s)", ep->reset_reason);
    pthread_mutex_unlock(&ep->lock);
    raise_fabric("RESET", text, peer);
    return NULL;
}

static void free_open_args(struct kvx_ep *ep)
{
    free(ep->arg_provider);
    free(ep->arg_node);
    free(ep->arg_domain);
}

/* The provider's limits, lowered to what the caller asked for (0: as the provider says). */
static void apply_limits(struct kvx_ep *ep)
{
    ep->max_sge = ep->info.max_sge > KVX_SGE_CAP ? KVX_SGE_CAP : ep->info.max_sge;
    if (ep->want_sge > 0 && ep->want_sge < ep->max_sge)
        ep->max_sge = ep->want_sge;
    ep->max_msg = ep->info.max_msg;
    if (ep->want_msg > 0 && ep->want_msg < ep->max_msg)
        ep->max_msg = ep->want_msg;
    ep->max_outstanding = ep->info.max_outstanding;
    if (ep->want_outstanding > 0 && ep->want_outstanding < ep->max_outstanding)
        ep->max_outstanding = ep->want_outstanding;
}

static int Endpoint_init(EndpointObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"provider", "node", "domain", "hmem", "max_sge", "max_msg", "max_outstanding", NULL};
    const char *provider = NULL, *node = NULL, *domain = NULL;
    int hmem = 0;
    Py_ssize_t max_sge = 0, max_msg = 0, max_outstanding = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|zzz$pnnn", kwlist, &provider, &node, &domain, &hmem, &max_sge,
                                     &max_msg, &max_outstanding))
        return -1;
    if (self->ep != NULL) {
        PyErr_SetString(PyExc_ValueError, "Endpoint is already open");
        return -1;
    }
    if (max_sge < 0 || max_msg < 0 || max_outstanding < 0) {
        PyErr_SetString(PyExc_ValueError, "max_sge, max_msg and max_outstanding must be >= 0 (0: the provider's)");
        return -1;
    }
    const struct kvx_provider *prov = &kvx_provider_ofi;
    if (provider != NULL && strcmp(provider, "null") == 0) {
        prov = &kvx_provider_null;
        provider = NULL;
    }
    struct kvx_ep *ep = calloc(1, sizeof(*ep));
    if (ep == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    /* Kept for a reset, which opens the endpoint again with the same arguments. */
    ep->arg_provider = provider ? strdup(provider) : NULL;
    ep->arg_node = node ? strdup(node) : NULL;
    ep->arg_domain = domain ? strdup(domain) : NULL;
    if ((provider && !ep->arg_provider) || (node && !ep->arg_node) || (domain && !ep->arg_domain)) {
        free_open_args(ep);
        free(ep);
        PyErr_NoMemory();
        return -1;
    }
    ep->open_args = (struct kvx_open_args){
        .provider = ep->arg_provider, .node = ep->arg_node, .domain = ep->arg_domain, .hmem = hmem};
    ep->want_sge = (size_t)max_sge;
    ep->want_msg = (size_t)max_msg;
    ep->want_outstanding = (size_t)max_outstanding;
    char err[KVX_ERR_LEN] = "";
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = prov->open(&ep->open_args, &ep->impl, &ep->info, err);
    Py_END_ALLOW_THREADS if (rc != 0)
    {
        free_open_args(ep);
        free(ep);
        raise_provider(rc, err);
        return -1;
    }
    ep->prov = prov;
    apply_limits(ep);
    pthread_mutex_init(&ep->lock, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&ep->cond, &ca);
    pthread_condattr_destroy(&ca);
    pthread_rwlockattr_t ra;
    pthread_rwlockattr_init(&ra);
    /* A waiting mr.close must not starve behind a stream of posts. */
    pthread_rwlockattr_setkind_np(&ra, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
    pthread_rwlock_init(&ep->mr_lock, &ra);
    pthread_rwlockattr_destroy(&ra);
    if (ep->info.needs_progress) {
        if (pthread_create(&ep->thread, NULL, progress_main, ep) != 0) {
            prov->close(ep->impl);
            free_open_args(ep);
            free(ep);
            PyErr_SetString(PyExc_OSError, "could not start the progress thread");
            return -1;
        }
        ep->thread_running = 1;
    }
    self->ep = ep;
    return 0;
}

static void drain(struct kvx_ep *ep);

static void ep_destroy(struct kvx_ep *ep)
{
    /* Wait for posts in flight (each bounded by its timeout), then stop everything. */
    pthread_mutex_lock(&ep->lock);
    ep->closed = 1;
    while (ep->users > 0)
        timed_wait(ep, now_ns() + 100000000ull);
    pthread_mutex_unlock(&ep->lock);
    if (ep->thread_running) {
        atomic_store(&ep->stop, 1);
        pthread_join(ep->thread, NULL);
        ep->thread_running = 0;
    }
    char err[KVX_ERR_LEN];
    drain(ep);
    pthread_rwlock_wrlock(&ep->mr_lock);
    if (ep->prov->quiesce != NULL)
        ep->prov->quiesce(ep->impl); /* the connections before the registrations */
    for (size_t i = 0; i < ep->n_mrs; i++)
        ep->prov->dereg(ep->impl, ep->mrs[i].handle, err);
    ep->n_mrs = 0;
    ep->mrs_closed = 1;
    pthread_rwlock_unlock(&ep->mr_lock);
    ep->prov->close(ep->impl); /* no completion can arrive after this */
    pthread_mutex_lock(&ep->lock);
    while (ep->batches)
        batch_free_locked(ep, ep->batches);
    pthread_mutex_unlock(&ep->lock);
}

static PyObject *Endpoint_close(EndpointObject *self, PyObject *Py_UNUSED(ignored))
{
    struct kvx_ep *ep = self->ep;
    if (ep == NULL)
        Py_RETURN_NONE;
    pthread_mutex_lock(&ep->lock);
    int already = ep->closed;
    ep->closed = 1;
    pthread_mutex_unlock(&ep->lock);
    if (already)
        Py_RETURN_NONE;
    Py_BEGIN_ALLOW_THREADS ep_destroy(ep);
    Py_END_ALLOW_THREADS
    /* The struct stays (MRs may still point at it) until the object goes. */
    Py_RETURN_NONE;
}

/* ---- reset ---- */

/* Become the only user: fail posts in flight, wait (bounded) until every other caller
 * has left and any other reset is over. Returns 0, or -1 with err set. */
static int reset_begin(struct kvx_ep *ep, const char *reason, char *err)
{
    pthread_mutex_lock(&ep->lock);
    uint64_t deadline = now_ns() + RESET_WAIT_NS;
    while (ep->resetting && !ep->closed && now_ns() < deadline)
        timed_wait(ep, now_ns() + 100000000ull);
    if (ep->closed || ep->resetting) {
        snprintf(err, KVX_ERR_LEN, "%s", ep->closed ? "the endpoint is closed" : "another reset did not finish");
        pthread_mutex_unlock(&ep->lock);
        return -1;
    }
    ep->resetting = 1;
    ep->users++;
    snprintf(ep->reset_reason, KVX_ERR_LEN, "%s", reason[0] ? reason : "no reason given");
    pthread_cond_broadcast(&ep->cond); /* posters waiting for completions look again */
    /* Posters see `resetting` within 10 ms; register/prepare/complete are short. */
    while (ep->users > 1 && now_ns() < deadline)
        timed_wait(ep, now_ns() + 10000000ull);
    if (ep->users > 1) {
        snprintf(err, KVX_ERR_LEN, "%zu calls on the endpoint did not return within %llu s", ep->users - 1,
                 RESET_WAIT_NS / 1000000000ull);
        ep->resetting = 0;
        ep->users--;
        pthread_cond_broadcast(&ep->cond);
        pthread_mutex_unlock(&ep->lock);
        return -1;
    }
    /* Every peer number dies here; the next ones carry the new generation. */
    ep->gen = (ep->gen + 1) & (UINT64_MAX >> PEER_GEN_SHIFT);
    ep->n_peers = 0;
    pthread_mutex_unlock(&ep->lock);
    return 0;
}

/* Before the provider's endpoint closes: cancel what is still posted and let it
 * complete, for at most DRAIN_NS. Closing a tcp;ofi_rxm endpoint with requests still
 * outstanding crashed libfabric 1.17 in fi_close(ep) (four threads posting while the
 * endpoint was reset, under load). Called with no poster and no progress thread. */
static void drain(struct kvx_ep *ep)
{
    if (ep->impl == NULL)
        return;
    pthread_mutex_lock(&ep->lock);
    if (ep->prov->cancel != NULL)
        for (struct batch *b = ep->batches; b != NULL; b = b->next)
            for (size_t i = 0; i < b->nslots; i++)
                if (b->ctx[i].busy)
                    ep->prov->cancel(ep->impl, &b->ctx[i]);
    pthread_mutex_unlock(&ep->lock);
    uint64_t until = now_ns() + DRAIN_NS;
    for (;;) {
        pthread_mutex_lock(&ep->lock);
        size_t left = ep->inflight;
        pthread_mutex_unlock(&ep->lock);
        if (left == 0 || now_ns() >= until)
            return;
        struct kvx_cqe c[POLL_BATCH];
        int n = ep->prov->poll(ep->impl, c, POLL_BATCH, 10);
        if (n > 0) {
            pthread_mutex_lock(&ep->lock);
            dispatch_locked(ep, c, n);
            pthread_mutex_unlock(&ep->lock);
        }
    }
}

static void stop_progress(struct kvx_ep *ep)
{
    if (ep->thread_running) {
        atomic_store(&ep->stop, 1);
        pthread_join(ep->thread, NULL);
        ep->thread_running = 0;
        atomic_store(&ep->stop, 0);
    }
}

/* The only user, GIL released. Swaps in a new provider endpoint and closes the old one.
 * Returns 0 (regions that could not be registered again are dropped and counted in
 * *lost), or -1 with err set: then the endpoint is closed. */
static int reset_swap(struct kvx_ep *ep, const uint64_t *drop, size_t n_drop, struct kvx_ep_info *fresh,
                      size_t *lost, char *err)
{
    stop_progress(ep);
    pthread_rwlock_wrlock(&ep->mr_lock);
    /* The new one opens while the old one still holds its port, so the address differs. */
    void *impl = NULL;
    memset(fresh, 0, sizeof(*fresh));
    int rc = ep->prov->open(&ep->open_args, &impl, fresh, err);
    /* The connections go first, then the registrations: the regions dropped with this
     * reset, and every other one (registered again below). */
    drain(ep);
    if (ep->prov->quiesce != NULL)
        ep->prov->quiesce(ep->impl);
    char ignored[KVX_ERR_LEN];
    for (size_t i = 0; i < n_drop; i++) {
        void *handle = mr_remove_locked(ep, drop[i]);
        if (handle != NULL)
            ep->prov->dereg(ep->impl, handle, ignored);
    }
    for (size_t i = 0; i < ep->n_mrs; i++)
        ep->prov->dereg(ep->impl, ep->mrs[i].handle, ignored);
    ep->prov->close(ep->impl); /* tears the connections down: no byte moves through them now */
    ep->impl = NULL;
    pthread_mutex_lock(&ep->lock);
    while (ep->batches) /* every poster has left; no completion can arrive */
        batch_free_locked(ep, ep->batches);
    ep->inflight = 0;
    pthread_mutex_unlock(&ep->lock);
    if (rc == 0 && fresh->prov_key) {
        ep->prov->close(impl);
        snprintf(err, KVX_ERR_LEN, "the provider reopened with provider-chosen MR keys");
        rc = -EINVAL;
    }
    if (rc != 0) {
        ep->n_mrs = 0;
        ep->mrs_closed = 1;
        pthread_rwlock_unlock(&ep->mr_lock);
        pthread_mutex_lock(&ep->lock);
        ep->closed = 1;
        pthread_mutex_unlock(&ep->lock);
        return -1;
    }
    ep->impl = impl;
    /* Each live region again, under the key peers were given for it. */
    size_t kept = 0;
    *lost = 0;
    for (size_t i = 0; i < ep->n_mrs; i++) {
        struct mr_entry e = ep->mrs[i];
        uint64_t key = e.key;
        char why[KVX_ERR_LEN] = "";
        if (ep->prov->reg(impl, e.addr, e.len, e.access, e.device, 1, &key, &e.desc, &e.handle, why) != 0 ||
            key != e.key) {
            if (*lost == 0)
                snprintf(err, KVX_ERR_LEN, "%s", why[0] ? why : "the provider changed the key");
            (*lost)++;
            continue;
        }
        ep->mrs[kept++] = e;
    }
    ep->n_mrs = kept;
    pthread_rwlock_unlock(&ep->mr_lock);
    if (fresh->needs_progress) {
        if (pthread_create(&ep->thread, NULL, progress_main, ep) != 0) {
            snprintf(err, KVX_ERR_LEN, "could not start the progress thread");
            return -2;
        }
        ep->thread_running = 1;
    }
    return 0;
}

static PyObject *Endpoint_reset(EndpointObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"reason", "drop", NULL};
    const char *reason = "";
    PyObject *drop_obj = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|sO", kwlist, &reason, &drop_obj))
        return NULL;
    struct kvx_ep *ep = self->ep;
    if (ep == NULL)
        return PyErr_Format(PyExc_ValueError, "the endpoint is not open");
    /* Regions to close with the reset, after the connections: a peer's transfer into one
     * must not meet its registration closed while the connection still carries it. */
    uint64_t drop[MAX_DROP];
    size_t n_drop = 0;
    if (drop_obj != NULL && drop_obj != Py_None) {
        PyObject *seq = PySequence_Fast(drop_obj, "drop must be a sequence of MemoryRegion");
        if (seq == NULL)
            return NULL;
        Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
        if (n > MAX_DROP) {
            Py_DECREF(seq);
            return PyErr_Format(PyExc_ValueError, "at most %d regions dropped with one reset", MAX_DROP);
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
            if (!PyObject_TypeCheck(item, &MRType) || ((MRObject *)item)->owner != self) {
                Py_DECREF(seq);
                return PyErr_Format(PyExc_ValueError, "drop: item %zd is not a region of this endpoint", i);
            }
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            MRObject *mr = (MRObject *)PySequence_Fast_GET_ITEM(seq, i);
            if (!mr->closed) {
                mr->closed = 1;
                drop[n_drop++] = mr->id;
            }
        }
        Py_DECREF(seq);
    }
    if (ep->info.prov_key)
        return PyErr_Format(PyExc_ValueError,
                            "provider %s picks MR keys itself, so a reset could not keep them; closing a region "
                            "there invalidates it in the NIC, so no reset is needed (see mr_close_is_final)",
                            ep->info.provider);
    char err[KVX_ERR_LEN] = "";
    struct kvx_ep_info fresh;
    size_t lost = 0;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = reset_begin(ep, reason, err);
    if (rc == 0) {
        rc = reset_swap(ep, drop, n_drop, &fresh, &lost, err);
    } else if (n_drop > 0) {
        /* No reset: the dropped regions are closed as MemoryRegion.close would. */
        char ignored[KVX_ERR_LEN];
        pthread_rwlock_wrlock(&ep->mr_lock);
        for (size_t i = 0; i < n_drop && !ep->mrs_closed; i++) {
            void *handle = mr_remove_locked(ep, drop[i]);
            if (handle != NULL)
                ep->prov->dereg(ep->impl, handle, ignored);
        }
        pthread_rwlock_unlock(&ep->mr_lock);
    }
    Py_END_ALLOW_THREADS if (rc == 0 || rc == -2)
    {
        /* With the GIL: the getters read info without the engine's lock. */
        memcpy(&ep->info, &fresh, sizeof(fresh));
        apply_limits(ep);
    }
    if (rc != -1 || ep->resetting) {
        pthread_mutex_lock(&ep->lock);
        if (rc != -1)
            ep->c_resets++;
        if (ep->resetting) {
            ep->resetting = 0;
            ep->users--;
        }
        pthread_cond_broadcast(&ep->cond);
        pthread_mutex_unlock(&ep->lock);
    }
    if (rc == -1) {
        int closed = ep->closed;
        return PyErr_Format(PyExc_OSError, "resetting the endpoint failed: %s%s", err,
                            closed ? " (the endpoint is closed now)" : "");
    }
    if (rc == -2)
        return PyErr_Format(PyExc_OSError, "resetting the endpoint: %s", err);
    if (lost > 0)
        return PyErr_Format(PyExc_OSError,
                            "the endpoint was reset but %zu memory regions could not be registered again (%s); "
                            "they are unreachable now: register them again",
                            lost, err);
    Py_RETURN_NONE;
}

static void Endpoint_dealloc(EndpointObject *self)
{
    struct kvx_ep *ep = self->ep;
    if (ep != NULL) {
        if (!ep->closed) {
            Py_BEGIN_ALLOW_THREADS ep_destroy(ep);
            Py_END_ALLOW_THREADS
        }
        pthread_rwlock_destroy(&ep->mr_lock);
        pthread_cond_destroy(&ep->cond);
        pthread_mutex_destroy(&ep->lock);
        free(ep->mrs);
        free(ep->peers);
        free(ep->peer_refs);
        free_open_args(ep);
        free(ep);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Endpoint_register(EndpointObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"addr", "length", "remote_read", "remote_write", "device", NULL};
    unsigned long long addr, length;
    int remote_read = -1, remote_write = -1, device = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "KK|$ppi", kwlist, &addr, &length, &remote_read, &remote_write,
                                     &device))
        return NULL;
    if (remote_read < 0 || remote_write < 0) {
        PyErr_SetString(PyExc_TypeError, "register needs remote_read= and remote_write= (True or False)");
        return NULL;
    }
    if (length == 0 || addr == 0 || addr + length < addr) {
        char msg[160];
        snprintf(msg, sizeof(msg), "cannot register %llu bytes at 0x%llx: empty, null or past the end of memory",
                 length, addr);
        PyErr_SetString(PyExc_ValueError, msg);
        return NULL;
    }
    struct kvx_ep *ep = self->ep;
    if (ep_enter(ep) < 0)
        return NULL;
    int access = (remote_read ? KVX_ACCESS_REMOTE_READ : 0) | (remote_write ? KVX_ACCESS_REMOTE_WRITE : 0);
    struct mr_entry e = {.addr = addr, .len = length, .access = access, .device = device};
    uint64_t key = 0;
    char err[KVX_ERR_LEN] = "";
    int rc = 0;
    Py_BEGIN_ALLOW_THREADS pthread_rwlock_wrlock(&ep->mr_lock);
    if (ep->n_mrs >= MAX_MRS) {
        rc = -ENOSPC;
        snprintf(err, sizeof(err), "too many memory regions on one endpoint (%d)", MAX_MRS);
    } else {
        rc = ep->prov->reg(ep->impl, addr, length, access, device, 0, &key, &e.desc, &e.handle, err);
        e.key = key;
        e.id = ++ep->next_mr_id;
        if (rc == 0 && mr_insert_locked(ep, &e) != 0) {
            ep->prov->dereg(ep->impl, e.handle, err);
            rc = -ENOMEM;
            snprintf(err, sizeof(err), "out of memory");
        }
    }
    pthread_rwlock_unlock(&ep->mr_lock);
    Py_END_ALLOW_THREADS ep_leave(ep);
    if (rc != 0)
        return raise_provider(rc, err);
    MRObject *mr = PyObject_New(MRObject, &MRType);
    if (mr == NULL)
        return NULL; /* the region stays registered until the endpoint closes */
    Py_INCREF(self);
    mr->owner = self;
    mr->addr = addr;
    mr->len = length;
    mr->key = key;
    mr->id = e.id;
    mr->closed = 0;
    mr->device = device;
    mr->access = access;
    return (PyObject *)mr;
}

static PyObject *MR_close(MRObject *self, PyObject *Py_UNUSED(ignored))
{
    if (self->closed)
        Py_RETURN_NONE;
    self->closed = 1;
    struct kvx_ep *ep = self->owner->ep;
    char err[KVX_ERR_LEN] = "";
    int rc = 0;
    /* The write lock waits for posts that may use this region's descriptor. */
    Py_BEGIN_ALLOW_THREADS pthread_rwlock_wrlock(&ep->mr_lock);
    if (!ep->mrs_closed) {
        void *handle = mr_remove_locked(ep, self->id);
        if (handle != NULL)
            rc = ep->prov->dereg(ep->impl, handle, err);
    }
    pthread_rwlock_unlock(&ep->mr_lock);
    Py_END_ALLOW_THREADS if (rc != 0) return raise_provider(rc, err);
    Py_RETURN_NONE;
}

static void MR_dealloc(MRObject *self)
{
    if (!self->closed) {
        PyObject *r = MR_close(self, NULL);
        if (r == NULL)
            PyErr_WriteUnraisable((PyObject *)self);
        Py_XDECREF(r);
    }
    Py_XDECREF(self->owner);
    PyObject_Free(self);
}

static PyObject *Endpoint_prepare(EndpointObject *self, PyObject *Py_UNUSED(ignored))
{
    struct kvx_ep *ep = self->ep;
    if (ep_enter(ep) < 0)
        return NULL;
    unsigned char info[KVX_ADDR_MAX];
    size_t len = 0;
    uint64_t half = 0;
    char err[KVX_ERR_LEN] = "";
    int rc = ep->prov->prepare(ep->impl, &half, info, &len, err);
    ep_leave(ep);
    if (rc != 0)
        return raise_provider(rc, err);
    return Py_BuildValue("(Ky#)", (unsigned long long)half, info, (Py_ssize_t)len);
}

static PyObject *Endpoint_complete(EndpointObject *self, PyObject *args)
{
    PyObject *half_obj;
    Py_buffer info;
    if (!PyArg_ParseTuple(args, "Oy*", &half_obj, &info))
        return NULL;
    unsigned long long half = 0;
    if (half_obj != Py_None) {
        half = PyLong_AsUnsignedLongLong(half_obj);
        if (PyErr_Occurred()) {
            PyBuffer_Release(&info);
            return NULL;
        }
    }
    if (info.len <= 0 || info.len > KVX_ADDR_MAX) {
        PyErr_Format(PyExc_ValueError, "peer info is %zd bytes; expected 1..%d (is it from a kvx endpoint?)",
                     info.len, KVX_ADDR_MAX);
        PyBuffer_Release(&info);
        return NULL;
    }
    struct kvx_ep *ep = self->ep;
    if (ep_enter(ep) < 0) {
        PyBuffer_Release(&info);
        return NULL;
    }
    uint64_t peer = 0;
    char err[KVX_ERR_LEN] = "";
    int rc = 0;
    pthread_mutex_lock(&ep->lock);
    int full = ep->n_peers >= MAX_PEERS;
    pthread_mutex_unlock(&ep->lock);
    if (full) {
        rc = -ENOSPC;
        snprintf(err, sizeof(err), "too many peers on one endpoint (%d): disconnect some", MAX_PEERS);
    } else {
        rc = ep->prov->complete(ep->impl, half, info.buf, (size_t)info.len, &peer, err);
        if (rc == 0 && (peer & ~PEER_PROV_MASK) != 0) {
            rc = -ERANGE;
            snprintf(err, sizeof(err), "the provider's peer number %llu is too large for kvx",
                     (unsigned long long)peer);
        }
    }
    PyBuffer_Release(&info);
    if (rc == 0) {
        pthread_mutex_lock(&ep->lock);
        peer |= ep->gen << PEER_GEN_SHIFT; /* users never run during a reset: gen is stable */
        size_t at;
        ssize_t i = peer_index(ep, peer, &at);
        /* The provider gives one address one peer number: several users of
         * it (say, this agent's link to a peer and that peer's link to it)
         * share it, and it is forgotten only when the last one disconnects. */
        if (i >= 0) {
            if (ep->peer_refs[i] < MAX_PEER_REFS)
                ep->peer_refs[i]++;
            else
                rc = -ENOSPC;
        } else {
            uint64_t *p = realloc(ep->peers, (ep->n_peers + 1) * sizeof(*p));
            if (p != NULL)
                ep->peers = p;
            uint32_t *r = p == NULL ? NULL : realloc(ep->peer_refs, (ep->n_peers + 1) * sizeof(*r));
            if (r == NULL) {
                rc = -ENOMEM;
            } else {
                ep->peer_refs = r;
                memmove(&p[at + 1], &p[at], (ep->n_peers - at) * sizeof(*p));
                memmove(&r[at + 1], &r[at], (ep->n_peers - at) * sizeof(*r));
                p[at] = peer;
                r[at] = 1;
                ep->n_peers++;
            }
        }
        pthread_mutex_unlock(&ep->lock);
        if (rc == -ENOSPC)
            snprintf(err, sizeof(err), "peer %llu was connected %d times without disconnect",
                     (unsigned long long)peer, MAX_PEER_REFS);
    }
    ep_leave(ep);
    if (rc == -EINVAL) {
        PyErr_SetString(PyExc_ValueError, err);
        return NULL;
    }
    if (rc != 0)
        return raise_provider(rc, err);
    return PyLong_FromUnsignedLongLong(peer);
}

static PyObject *Endpoint_disconnect(EndpointObject *self, PyObject *args)
{
    unsigned long long peer;
    if (!PyArg_ParseTuple(args, "K", &peer))
        return NULL;
    struct kvx_ep *ep = self->ep;
    if (ep_enter(ep) < 0)
        return NULL;
    pthread_mutex_lock(&ep->lock);
    ssize_t i = peer_index(ep, peer, NULL);
    int last = 0;
    if (i >= 0 && --ep->peer_refs[i] == 0) {
        size_t tail = ep->n_peers - (size_t)i - 1;
        memmove(&ep->peers[i], &ep->peers[i + 1], tail * sizeof(uint64_t));
        memmove(&ep->peer_refs[i], &ep->peer_refs[i + 1], tail * sizeof(uint32_t));
        ep->n_peers--;
        last = 1;
    }
    pthread_mutex_unlock(&ep->lock);
    char err[KVX_ERR_LEN] = "";
    int rc = last ? ep->prov->disconnect(ep->impl, peer & PEER_PROV_MASK, err) : 0;
    ep_leave(ep);
    if (i < 0) {
        PyErr_Format(PyExc_ValueError, "peer %llu is not connected to this endpoint", peer);
        return NULL;
    }
    if (rc != 0)
        return raise_provider(rc, err);
    Py_RETURN_NONE;
}

/* A C-contiguous buffer of 8-byte unsigned integers. */
static int get_u64(PyObject *obj, Py_buffer *view, const char *name)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    const char *f = view->format ? view->format : "B";
    if (*f == '<' || *f == '=' || *f == '@')
        f++;
    if (view->itemsize != 8 || !(strcmp(f, "Q") == 0 || strcmp(f, "L") == 0 || strcmp(f, "K") == 0)) {
        PyErr_Format(PyExc_TypeError, "%s must be a contiguous uint64 array (numpy.uint64), not format '%s'",
                     name, view->format ? view->format : "B");
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static int sum_u64(const uint64_t *a, size_t n, uint64_t *out)
{
    uint64_t s = 0;
    for (size_t i = 0; i < n; i++) {
        if (s + a[i] < s)
            return -1;
        s += a[i];
    }
    *out = s;
    return 0;
}

/* METH_FASTCALL: the argument tuple and its parsing are a visible share of a short post. */
static PyObject *Endpoint_post(EndpointObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 8) {
        PyErr_Format(PyExc_TypeError,
                     "post(op, peer, local_addrs, local_lens, remote_addrs, remote_lens, remote_keys, timeout_ms) "
                     "takes 8 arguments, not %zd",
                     nargs);
        return NULL;
    }
    long op_long = PyLong_AsLong(args[0]);
    if (op_long == -1 && PyErr_Occurred())
        return NULL;
    unsigned long long peer = PyLong_AsUnsignedLongLong(args[1]);
    if (peer == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    long long timeout_ms = PyLong_AsLongLong(args[7]);
    if (timeout_ms == -1 && PyErr_Occurred())
        return NULL;
    int op = op_long < INT_MIN || op_long > INT_MAX ? -1 : (int)op_long;
    PyObject *const *objs = args + 2;
    static const char *names[5] = {"local_addrs", "local_lens", "remote_addrs", "remote_lens", "remote_keys"};
    Py_buffer v[5];
    int got = 0;
    PyObject *result = NULL;
    void **ldesc = NULL;
    for (; got < 5; got++)
        if (get_u64(objs[got], &v[got], names[got]) < 0)
            goto out;
    if (op != KVX_READ && op != KVX_WRITE) {
        PyErr_Format(PyExc_ValueError, "op must be 0 (READ) or 1 (WRITE), not %d", op);
        goto out;
    }
    if (timeout_ms <= 0 || timeout_ms > MAX_TIMEOUT_MS) {
        PyErr_Format(PyExc_ValueError, "timeout_ms must be in 1..%lld, not %lld", MAX_TIMEOUT_MS, timeout_ms);
        goto out;
    }
    size_t nl = (size_t)(v[0].len / 8), nr = (size_t)(v[2].len / 8);
    if (v[1].len / 8 != (Py_ssize_t)nl || v[3].len / 8 != (Py_ssize_t)nr || v[4].len / 8 != (Py_ssize_t)nr) {
        PyErr_SetString(PyExc_ValueError,
                        "local_addrs/local_lens and remote_addrs/remote_lens/remote_keys must pair up (same lengths)");
        goto out;
    }
    if ((Py_ssize_t)nl > MAX_PIECES || (Py_ssize_t)nr > MAX_PIECES) {
        PyErr_Format(PyExc_ValueError, "at most %zd pieces per post; split the transfer", MAX_PIECES);
        goto out;
    }
    const uint64_t *la = v[0].buf, *ll = v[1].buf, *ra = v[2].buf, *rl = v[3].buf, *rk = v[4].buf;
    uint64_t total_l, total_r;
    if (sum_u64(ll, nl, &total_l) < 0 || sum_u64(rl, nr, &total_r) < 0 || total_l != total_r) {
        PyErr_SetString(PyExc_ValueError, "the local and remote pieces must cover the same number of bytes");
        goto out;
    }
    for (size_t i = 0; i < nr; i++) {
        if (ra[i] + rl[i] < ra[i]) {
            char msg[160];
            snprintf(msg, sizeof(msg), "remote piece %zu (0x%llx + %llu) runs past the end of memory", i,
                     (unsigned long long)ra[i], (unsigned long long)rl[i]);
            PyErr_SetString(PyExc_ValueError, msg);
            goto out;
        }
    }
    if (total_l == 0) {
        result = Py_None;
        Py_INCREF(result);
        goto out;
    }
    struct kvx_ep *ep = self->ep;
    if (ep_enter_as(ep, 1, peer) < 0)
        goto out;
    pthread_mutex_lock(&ep->lock);
    int known = peer_index(ep, peer, NULL) >= 0;
    pthread_mutex_unlock(&ep->lock);
    if (!known) {
        ep_leave(ep);
        PyErr_Format(PyExc_ValueError, "peer %llu is not connected to this endpoint (ep.complete first)", peer);
        goto out;
    }
    void *ldesc_small[64];
    ldesc = nl <= 64 ? ldesc_small : malloc(nl * sizeof(void *));
    if (ldesc == NULL) {
        ep_leave(ep);
        PyErr_NoMemory();
        goto out;
    }
    ssize_t bad = -1;
    int rc = RUN_OK;
    struct run_result res = {0};
    uint64_t deadline = now_ns() + (uint64_t)timeout_ms * 1000000ull;
    size_t n_wr_max = nr + nl + (size_t)(total_l / ep->max_msg) + 1;
    Py_BEGIN_ALLOW_THREADS pthread_rwlock_rdlock(&ep->mr_lock);
    for (size_t i = 0; i < nl; i++) {
        if (ll[i] == 0) {
            ldesc[i] = NULL;
            continue;
        }
        ssize_t m = mr_find(ep, la[i], ll[i]);
        if (m < 0 || la[i] + ll[i] < la[i]) {
            bad = (ssize_t)i;
            break;
        }
        ldesc[i] = ep->mrs[m].desc;
    }
    if (bad < 0) {
        struct gen g = {.la = la, .ll = ll, .ldesc = ldesc, .nl = nl, .ra = ra, .rl = rl, .rk = rk, .nr = nr};
        rc = run_batch(ep, op, peer & PEER_PROV_MASK, &g, n_wr_max, deadline, &res);
    }
    pthread_rwlock_unlock(&ep->mr_lock);
    Py_END_ALLOW_THREADS ep_leave(ep);
    if (bad >= 0) {
        char msg[200];
        snprintf(msg, sizeof(msg),
                 "local piece %zd (0x%llx, %llu bytes) is not inside memory registered on this endpoint "
                 "(register it with ep.register first)",
                 bad, (unsigned long long)la[bad], (unsigned long long)ll[bad]);
        PyErr_SetString(PyExc_ValueError, msg);
        goto out;
    }
    if (rc == RUN_NOMEM) {
        PyErr_NoMemory();
        goto out;
    }
    if (rc == RUN_TIMEOUT) {
        PyErr_Format(PyExc_TimeoutError, "%s of %llu bytes with peer %llu did not complete within %lld ms",
                     op == KVX_READ ? "READ" : "WRITE", (unsigned long long)total_l, peer, timeout_ms);
        goto out;
    }
    if (rc == RUN_RESET) {
        raise_fabric("RESET", res.text, peer);
        goto out;
    }
    if (rc == RUN_ERROR) {
        raise_fabric(res.status_name ? res.status_name : "?", res.text, peer);
        goto out;
    }
    result = Py_None;
    Py_INCREF(result);
out:
    if (ldesc != NULL && nl > 64)
        free(ldesc);
    for (int i = 0; i < got; i++)
        PyBuffer_Release(&v[i]);
    return result;
}

static PyObject *Endpoint_counters(EndpointObject *self, PyObject *Py_UNUSED(ignored))
{
    struct kvx_ep *ep = self->ep;
    if (ep == NULL)
        return PyErr_Format(PyExc_ValueError, "the endpoint is not open");
    pthread_mutex_lock(&ep->lock);
    PyObject *d = Py_BuildValue(
        "{sKsKsKsKsKsKsKsKsKsnsnsn}", "posts", ep->c_posts, "work_requests", ep->c_wrs, "sges", ep->c_sges,
        "completions", ep->c_completions, "errors", ep->c_errors, "eagain", ep->c_eagain, "timeouts",
        ep->c_timeouts, "orphans", ep->c_orphans, "resets", ep->c_resets, "inflight", (Py_ssize_t)ep->inflight, "peers",
        (Py_ssize_t)ep->n_peers, "regions", (Py_ssize_t)ep->n_mrs);
    pthread_mutex_unlock(&ep->lock);
    return d;
}

#define EP_GET_STR(field)                                                                                  \
    static PyObject *Endpoint_get_##field(EndpointObject *self, void *c)                               \
    {                                                                                                      \
        (void)c;                                                                                           \
        if (self->ep == NULL)                                                                              \
            return PyErr_Format(PyExc_ValueError, "the endpoint is not open");                             \
        return PyUnicode_FromString(self->ep->info.field);                                                 \
    }
EP_GET_STR(provider)
EP_GET_STR(fabric)
EP_GET_STR(domain)

static PyObject *Endpoint_get_address(EndpointObject *self, void *c)
{
    (void)c;
    if (self->ep == NULL)
        return PyErr_Format(PyExc_ValueError, "the endpoint is not open");
    return PyBytes_FromStringAndSize((const char *)self->ep->info.address, (Py_ssize_t)self->ep->info.address_len);
}
static PyObject *Endpoint_get_virt_addr(EndpointObject *self, void *c)
{
    (void)c;
    if (self->ep == NULL)
        return PyErr_Format(PyExc_ValueError, "the endpoint is not open");
    return PyBool_FromLong(self->ep->info.virt_addr);
}
static PyObject *Endpoint_get_prov_key(EndpointObject *self, void *c)
{
    (void)c;
    if (self->ep == NULL)
        return PyErr_Format(PyExc_ValueError, "the endpoint is not open");
    return PyBool_FromLong(self->ep->info.prov_key);
}
static PyObject *Endpoint_get_max_sge(EndpointObject *self, void *c)
{
    (void)c;
    if (self->ep == NULL)
        return PyErr_Format(PyExc_ValueError, "the endpoint is not open");
    return PyLong_FromSize_t(self->ep->max_sge);
}
static PyObject *Endpoint_get_max_msg(EndpointObject *self, void *c)
{
    (void)c;
    if (self->ep == NULL)
        return PyErr_Format(PyExc_ValueError, "the endpoint is not open");
    return PyLong_FromSize_t(self->ep->max_msg);
}
static PyObject *Endpoint_get_max_outstanding(EndpointObject *self, void *c)
{
    (void)c;
    if (self->ep == NULL)
        return PyErr_Format(PyExc_ValueError, "the endpoint is not open");
    return PyLong_FromSize_t(self->ep->max_outstanding);
}
static PyObject *Endpoint_get_mr_mode(EndpointObject *self, void *c)
{
    (void)c;
    if (self->ep == NULL)
        return PyErr_Format(PyExc_ValueError, "the endpoint is not open");
    return PyLong_FromUnsignedLongLong(self->ep->info.mr_mode);
}
static PyObject *Endpoint_get_mr_close_is_final(EndpointObject *self, void *c)
{
    (void)c;
    if (self->ep == NULL)
        return PyErr_Format(PyExc_ValueError, "the endpoint is not open");
    return PyBool_FromLong(self->ep->info.mr_close_final);
}
static PyObject *Endpoint_get_key_size(EndpointObject *self, void *c)
{
    (void)c;
    if (self->ep == NULL)
        return PyErr_Format(PyExc_ValueError, "the endpoint is not open");
    return PyLong_FromSize_t(self->ep->info.key_size);
}

static PyGetSetDef Endpoint_getset[] = {
    {"provider", (getter)Endpoint_get_provider, NULL, "libfabric provider name (or 'null')", NULL},
    {"fabric", (getter)Endpoint_get_fabric, NULL, "fabric name", NULL},
    {"domain", (getter)Endpoint_get_domain, NULL, "domain (NIC) name", NULL},
    {"address", (getter)Endpoint_get_address, NULL, "what a peer needs to reach this endpoint", NULL},
    {"virt_addr", (getter)Endpoint_get_virt_addr, NULL, "remote addresses are virtual (else MR offsets)", NULL},
    {"prov_key", (getter)Endpoint_get_prov_key, NULL, "the provider picks MR keys", NULL},
    {"max_sge", (getter)Endpoint_get_max_sge, NULL, "local pieces gathered per work request", NULL},
    {"max_msg", (getter)Endpoint_get_max_msg, NULL, "bytes per work request", NULL},
    {"max_outstanding", (getter)Endpoint_get_max_outstanding, NULL, "work requests in flight", NULL},
    {"mr_mode", (getter)Endpoint_get_mr_mode, NULL, "libfabric FI_MR_* bits granted", NULL},
    {"key_size", (getter)Endpoint_get_key_size, NULL, "bytes of an MR key", NULL},
    {"mr_close_is_final", (getter)Endpoint_get_mr_close_is_final, NULL,
     "closing a region is known to stop remote access already in flight (else: reset)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef Endpoint_methods[] = {
    {"register", (PyCFunction)(void (*)(void))Endpoint_register, METH_VARARGS | METH_KEYWORDS,
     "register(addr, length, *, remote_read, remote_write, device) -> MemoryRegion"},
    {"prepare", (PyCFunction)Endpoint_prepare, METH_NOARGS, "prepare() -> (half, info)"},
    {"complete", (PyCFunction)Endpoint_complete, METH_VARARGS, "complete(half, remote_info) -> peer"},
    {"disconnect", (PyCFunction)Endpoint_disconnect, METH_VARARGS, "disconnect(peer)"},
    {"post", (PyCFunction)(void (*)(void))Endpoint_post, METH_FASTCALL,
     "post(op, peer, local_addrs, local_lens, remote_addrs, remote_lens, remote_keys, timeout_ms)"},
    {"counters", (PyCFunction)Endpoint_counters, METH_NOARGS, "counters() -> dict"},
    {"reset", (PyCFunction)(void (*)(void))Endpoint_reset, METH_VARARGS | METH_KEYWORDS,
     "reset(reason=''): close and reopen the provider endpoint; posts in flight fail with RESET"},
    {"close", (PyCFunction)Endpoint_close, METH_NOARGS, "close()"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject EndpointType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvx._fabric.Endpoint",
    .tp_basicsize = sizeof(EndpointObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Endpoint_init,
    .tp_dealloc = (destructor)Endpoint_dealloc,
    .tp_methods = Endpoint_methods,
    .tp_getset = Endpoint_getset,
    .tp_doc = "Endpoint(provider=None, node=None, domain=None, *, hmem=False, max_sge=0, max_msg=0, "
              "max_outstanding=0)",
};

static PyObject *MR_get_key(MRObject *self, void *c)
{
    (void)c;
    return PyLong_FromUnsignedLongLong(self->key);
}
static PyObject *MR_get_addr(MRObject *self, void *c)
{
    (void)c;
    return PyLong_FromUnsignedLongLong(self->addr);
}
static PyObject *MR_get_length(MRObject *self, void *c)
{
    (void)c;
    return PyLong_FromUnsignedLongLong(self->len);
}
static PyObject *MR_get_closed(MRObject *self, void *c)
{
    (void)c;
    return PyBool_FromLong(self->closed);
}

static PyGetSetDef MR_getset[] = {
    {"key", (getter)MR_get_key, NULL, "the remote key", NULL},
    {"addr", (getter)MR_get_addr, NULL, "start address", NULL},
    {"length", (getter)MR_get_length, NULL, "bytes", NULL},
    {"closed", (getter)MR_get_closed, NULL, "deregistered", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef MR_methods[] = {
    {"close", (PyCFunction)MR_close, METH_NOARGS, "deregister: afterwards no peer can reach the range"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject MRType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvx._fabric.MemoryRegion",
    .tp_basicsize = sizeof(MRObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)MR_dealloc,
    .tp_methods = MR_methods,
    .tp_getset = MR_getset,
};

/* ---- module ---- */

static void add_info(void *arg, const struct fi_info *fi)
{
    PyObject *list = arg;
    PyObject *t = Py_BuildValue(
        "(sssKnnKn)", fi->fabric_attr->prov_name ? fi->fabric_attr->prov_name : "",
        fi->fabric_attr->name ? fi->fabric_attr->name : "", fi->domain_attr->name ? fi->domain_attr->name : "",
        (unsigned long long)fi->ep_attr->max_msg_size, (Py_ssize_t)fi->tx_attr->iov_limit, (Py_ssize_t)fi->tx_attr->size,
        (unsigned long long)fi->domain_attr->mr_mode, (Py_ssize_t)fi->domain_attr->mr_key_size);
    if (t == NULL || PyList_Append(list, t) < 0)
        PyErr_Clear();
    Py_XDECREF(t);
}

static PyObject *mod_providers(PyObject *m, PyObject *args, PyObject *kwds)
{
    (void)m;
    static char *kwlist[] = {"node", NULL};
    const char *node = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|z", kwlist, &node))
        return NULL;
    PyObject *list = PyList_New(0);
    if (list == NULL)
        return NULL;
    char err[KVX_ERR_LEN] = "";
    int rc = kvx_ofi_list(node, add_info, list, err);
    if (rc == -FI_ENODATA)
        return list; /* none: an empty list */
    if (rc != 0) {
        Py_DECREF(list);
        return raise_provider(rc, err);
    }
    return list;
}

static PyMethodDef module_methods[] = {
    {"providers", (PyCFunction)(void (*)(void))mod_providers, METH_VARARGS | METH_KEYWORDS,
     "providers(node=None) -> [(provider, fabric, domain, max_msg, iov_limit, tx_size, mr_mode, key_size)]"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvx._fabric", "One-sided RMA posting (see kvx/backends/rdma/fabric.py).", -1,
    module_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__fabric(void)
{
    if (PyType_Ready(&EndpointType) < 0 || PyType_Ready(&MRType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    FabricError = PyErr_NewException("kvx._fabric.FabricError", NULL, NULL);
    if (FabricError == NULL || PyModule_AddObjectRef(m, "FabricError", FabricError) < 0 ||
        PyModule_AddObjectRef(m, "Endpoint", (PyObject *)&EndpointType) < 0 ||
        PyModule_AddObjectRef(m, "MemoryRegion", (PyObject *)&MRType) < 0 ||
        PyModule_AddIntConstant(m, "READ", KVX_READ) < 0 || PyModule_AddIntConstant(m, "WRITE", KVX_WRITE) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
