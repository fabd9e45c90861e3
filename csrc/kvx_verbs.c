/*
 * kvx._verbs: the ibverbs provider of the rdma backend (InfiniBand and RoCE),
 * with the same Python Endpoint contract as kvx._fabric.
 *
 *   Endpoint(device=None, port=1, gid_index=None)
 *   ep.prepare() -> (half, info)         a new RC QP in INIT; info: 32 bytes
 *   ep.complete(half, info) -> peer      the QP to RTR, then RTS
 *   ep.disconnect(peer); ep.close()
 *   ep.register(addr, length, remote_read, remote_write, device=-1) -> MR
 *   ep.post(op, peer, local_addrs, local_lens, remote_addrs, remote_lens,
 *           remote_keys, timeout_ms)     GIL released; returns when done
 *   load(path=None) -> str               which libibverbs (default: at first use)
 *
 * libibverbs is opened with dlopen("libibverbs.so.1") at first use, not
 * linked: kvx then builds wherever the headers exist and imports where the
 * library does not (Endpoint says what is missing), and KVX_IBVERBS_LIB (or
 * load(path)) swaps in the test double tests/rdma_double/fake_ibverbs.c
 * without LD_PRELOAD. The inline ibv_post_send/ibv_poll_cq go through the
 * context's ops table, so they need no symbol.
 *
 * Why C for the hot path and pyverbs only for listing devices: one RDMA
 * READ of a 16 KiB piece takes 0.33 us of a 400 Gb/s link, so posting and
 * polling must stay near 0.5 us per work request. A pyverbs SendWR is a
 * Python object with a Python SGE list and post_send walks them in Cython.
 * Measured on a 2-core x86-64 VM with Debian's pyverbs 44 (no device, so
 * before any post): building one SGE and one SendWR and setting its RDMA
 * address costs 2.4 us (median of 3 x 200,000), which caps Python at about
 * 0.4 M work requests per second per core, a fifth of the 2 M goal. The
 * post_send cost itself could not be measured without a device. The same
 * chain building from uint64 descriptor arrays in C is what
 * benchmarks/rdma_post_rate.py measures through kvx._fabric's null provider.
 *
 * Data path: one work request per remote-contiguous piece, split at the
 * port's max_msg_sz and where the local gather would pass max_send_sge;
 * chains of up to CHAIN_MAX WRs linked by next and posted in one
 * ibv_post_send, only each chain's last WR signalled (RC completes in order,
 * so its completion retires the whole chain). In-flight WRs are bounded per
 * QP by its send queue depth and per endpoint by half the CQ (so flushes of
 * a QP in error cannot overrun it); the QP's max_rd_atomic is the device's
 * max_qp_rd_atom, so the NIC bounds outstanding READs itself. An error
 * completion fails every transfer on that QP, names ibv_wc_status_str and
 * the peer, and destroys the QP at once (no later DMA into memory the caller
 * frees): the peer is "broken" and the backend reconnects with
 * prepare/complete. A timeout does the same.
 *
 * Threads: one mutex per endpoint guards the QPs, the CQ and the waiters;
 * each posting thread posts its chains and polls the shared CQ, dispatching
 * completions to whichever transfer owns them (wr_id = ticket << 16 | chain
 * length). The GIL is released in post and in memory registration.
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <errno.h>
#include <infiniband/verbs.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#define INFO_VERSION 1
#define INFO_SIZE 32
#define INFO_GLOBAL 0x1
#define CHAIN_MAX 32
#define PEERS_MAX 4096
#define MRS_MAX 65536
#define SQ_DEPTH_MAX 1024
#define SEND_SGE_MAX 16
#define CQ_DEPTH_MAX 16384
#define PIECES_MAX (1u << 24)

/* ---- libibverbs, opened at first use ---------------------------------- */

static struct {
    void *handle;
    char path[256];
    struct ibv_device **(*get_device_list)(int *);
    void (*free_device_list)(struct ibv_device **);
    const char *(*get_device_name)(struct ibv_device *);
    struct ibv_context *(*open_device)(struct ibv_device *);
    int (*close_device)(struct ibv_context *);
    int (*query_device)(struct ibv_context *, struct ibv_device_attr *);
    int (*query_port)(struct ibv_context *, uint8_t, void *);
    int (*query_gid)(struct ibv_context *, uint8_t, int, union ibv_gid *);
    struct ibv_pd *(*alloc_pd)(struct ibv_context *);
    int (*dealloc_pd)(struct ibv_pd *);
    struct ibv_mr *(*reg_mr)(struct ibv_pd *, void *, size_t, int);
    struct ibv_mr *(*reg_dmabuf_mr)(struct ibv_pd *, uint64_t, size_t, uint64_t, int, int);
    int (*dereg_mr)(struct ibv_mr *);
    struct ibv_cq *(*create_cq)(struct ibv_context *, int, void *, struct ibv_comp_channel *, int);
    int (*destroy_cq)(struct ibv_cq *);
    struct ibv_qp *(*create_qp)(struct ibv_pd *, struct ibv_qp_init_attr *);
    int (*modify_qp)(struct ibv_qp *, struct ibv_qp_attr *, int);
    int (*destroy_qp)(struct ibv_qp *);
    const char *(*wc_status_str)(enum ibv_wc_status);
} V;

static pthread_mutex_t load_mu = PTHREAD_MUTEX_INITIALIZER;

#define SYM(field, name, required)                                   \
    do {                                                             \
        *(void **)&V.field = dlsym(h, name);                         \
        if (!V.field && (required)) {                                \
            snprintf(why, why_len, "%s lacks %s", path, name);       \
            goto fail;                                               \
        }                                                            \
    } while (0)

/* Returns 0, or -1 with why filled; a second call with another path fails. */
static int load_library(const char *path, char *why, size_t why_len)
{
    pthread_mutex_lock(&load_mu);
    if (!path && V.handle) { /* first use after load(path): keep what is loaded */
        pthread_mutex_unlock(&load_mu);
        return 0;
    }
    if (!path)
        path = getenv("KVX_IBVERBS_LIB");
    if (!path || !*path)
        path = "libibverbs.so.1";
    if (V.handle) {
        int same = strcmp(V.path, path) == 0;
        pthread_mutex_unlock(&load_mu);
        if (!same)
            snprintf(why, why_len, "%s is already loaded; cannot switch to %s in one process",
                     V.path, path);
        return same ? 0 : -1;
    }
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        snprintf(why, why_len,
                 "cannot load %s (%s): install rdma-core's libibverbs1 and the NIC's provider "
                 "(Debian: apt-get install libibverbs1 ibverbs-providers)",
                 path, dlerror());
        pthread_mutex_unlock(&load_mu);
        return -1;
    }
    SYM(get_device_list, "ibv_get_device_list", 1);
    SYM(free_device_list, "ibv_free_device_list", 1);
    SYM(get_device_name, "ibv_get_device_name", 1);
    SYM(open_device, "ibv_open_device", 1);
    SYM(close_device, "ibv_close_device", 1);
    SYM(query_device, "ibv_query_device", 1);
    SYM(query_port, "ibv_query_port", 1);
    SYM(query_gid, "ibv_query_gid", 1);
    SYM(alloc_pd, "ibv_alloc_pd", 1);
    SYM(dealloc_pd, "ibv_dealloc_pd", 1);
    SYM(reg_mr, "ibv_reg_mr", 1);
    SYM(reg_dmabuf_mr, "ibv_reg_dmabuf_mr", 0); /* rdma-core >= 34 */
    SYM(dereg_mr, "ibv_dereg_mr", 1);
    SYM(create_cq, "ibv_create_cq", 1);
    SYM(destroy_cq, "ibv_destroy_cq", 1);
    SYM(create_qp, "ibv_create_qp", 1);
    SYM(modify_qp, "ibv_modify_qp", 1);
    SYM(destroy_qp, "ibv_destroy_qp", 1);
    SYM(wc_status_str, "ibv_wc_status_str", 1);
    V.handle = h;
    snprintf(V.path, sizeof V.path, "%s", path);
    pthread_mutex_unlock(&load_mu);
    return 0;
fail:
    dlclose(h);
    memset(&V, 0, sizeof V);
    pthread_mutex_unlock(&load_mu);
    return -1;
}

/* ---- libcuda, only for dma-buf registration of GPU memory -------------- */

typedef int CUresult;
static struct {
    int tried;
    void *handle;
    CUresult (*init)(unsigned);
    CUresult (*device_get)(int *, int);
    CUresult (*primary_retain)(void **, int);
    CUresult (*primary_release)(int);
    CUresult (*ctx_push)(void *);
    CUresult (*ctx_pop)(void **);
    CUresult (*get_range)(uint64_t *, size_t *, uint64_t);
    CUresult (*get_handle)(void *, uint64_t, size_t, int, unsigned long long);
} C;

static const char *load_cuda(void)
{
    if (C.tried)
        return C.handle ? NULL : "libcuda.so.1 not loadable or too old for dma-buf";
    C.tried = 1;
    const char *path = getenv("KVX_CUDA_LIB");
    void *h = dlopen(path && *path ? path : "libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h)
        return "libcuda.so.1 not loadable or too old for dma-buf";
    *(void **)&C.init = dlsym(h, "cuInit");
    *(void **)&C.device_get = dlsym(h, "cuDeviceGet");
    *(void **)&C.primary_retain = dlsym(h, "cuDevicePrimaryCtxRetain");
    *(void **)&C.primary_release = dlsym(h, "cuDevicePrimaryCtxRelease_v2");
    *(void **)&C.ctx_push = dlsym(h, "cuCtxPushCurrent_v2");
    *(void **)&C.ctx_pop = dlsym(h, "cuCtxPopCurrent_v2");
    *(void **)&C.get_range = dlsym(h, "cuMemGetAddressRange_v2");
    *(void **)&C.get_handle = dlsym(h, "cuMemGetHandleForAddressRange");
    if (!C.init || !C.device_get || !C.primary_retain || !C.primary_release || !C.ctx_push ||
        !C.ctx_pop || !C.get_range || !C.get_handle) {
        dlclose(h);
        return "libcuda.so.1 not loadable or too old for dma-buf";
    }
    C.handle = h;
    return NULL;
}

/* A dma-buf fd for the whole allocation holding [addr, addr+len), or -1 with why. */
static int cuda_dmabuf(int device, uint64_t addr, size_t len, uint64_t *base, char *why,
                       size_t why_len)
{
    const char *no = load_cuda();
    if (no) {
        snprintf(why, why_len, "%s", no);
        return -1;
    }
    int dev, fd = -1;
    void *ctx = NULL, *popped;
    size_t size = 0;
    CUresult rc = C.init(0);
    if (!rc)
        rc = C.device_get(&dev, device);
    if (!rc)
        rc = C.primary_retain(&ctx, dev);
    if (rc) {
        snprintf(why, why_len, "CUDA device %d unusable (CUresult %d)", device, rc);
        return -1;
    }
    C.ctx_push(ctx);
    rc = C.get_range(base, &size, addr);
    if (!rc && addr + len > *base + size)
        rc = 1; /* CUDA_ERROR_INVALID_VALUE: the range spans allocations */
    if (!rc)
        rc = C.get_handle(&fd, *base, size, 1 /* CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD */, 0);
    C.ctx_pop(&popped);
    C.primary_release(dev);
    if (rc) {
        snprintf(why, why_len,
                 "cuMemGetHandleForAddressRange failed (CUresult %d: needs CUDA >= 11.7, "
                 "an open GPU kernel module and a kernel with dma-buf)",
                 rc);
        return -1;
    }
    return fd;
}

/* ---- endpoint state ---------------------------------------------------- */

enum { PEER_FREE, PEER_PREPARED, PEER_CONNECTED, PEER_BROKEN };

struct peer {
    struct ibv_qp *qp;
    int state;
    uint32_t psn;
    uint32_t inflight; /* WRs posted, not retired by a signalled completion */
    char why[160];     /* PEER_BROKEN: what broke it */
};

struct waiter {
    uint64_t ticket;
    int peer;
    uint64_t chains_posted, chains_done;
    int failed; /* 0, 1 error completion or break, 2 timeout */
    char status[64];
    char text[200];
    struct waiter *next;
};

struct mr_entry {
    uint64_t addr, len;
    uint32_t lkey;
    struct ibv_mr *mr;
};

typedef struct {
    PyObject_HEAD
    pthread_mutex_t mu;
    int ready, closed;
    struct ibv_context *ctx;
    struct ibv_pd *pd;
    struct ibv_cq *cq;
    char name[64];
    uint8_t port;
    int gid_index, global;
    union ibv_gid gid;
    uint16_t lid;
    uint8_t link_layer, active_mtu;
    uint32_t max_msg, sq_depth, send_sge, cq_depth, rd_atom;
    struct peer *peers;
    struct mr_entry *mrs;
    size_t n_mrs;
    struct waiter *waiters;
    uint64_t next_ticket;
    uint32_t inflight; /* WRs in flight over all QPs */
} Endpoint;

typedef struct {
    PyObject_HEAD
    Endpoint *ep;
    struct ibv_mr *mr;
    uint64_t addr, len;
    uint32_t key;
    PyObject *how;
} MR;

static PyObject *VerbsError;
static PyTypeObject EndpointType, MRType;

static void raise_error(const char *status, const char *text, int peer)
{
    PyObject *e = Py_BuildValue("(ssi)", status, text, peer);
    if (e) {
        PyErr_SetObject(VerbsError, e);
        Py_DECREF(e);
    }
}

/* Destroys the peer's QP (no DMA through it after this) and fails its transfers. */
static void break_peer(Endpoint *ep, int p, const char *status, const char *text)
{
    struct peer *pr = &ep->peers[p];
    for (struct waiter *w = ep->waiters; w; w = w->next) {
        if (w->peer == p && !w->failed) {
            w->failed = 1;
            snprintf(w->status, sizeof w->status, "%s", status);
            snprintf(w->text, sizeof w->text, "%s", text);
        }
    }
    if (pr->qp) {
        struct ibv_qp_attr a = {.qp_state = IBV_QPS_ERR};
        V.modify_qp(pr->qp, &a, IBV_QP_STATE);
        V.destroy_qp(pr->qp); /* providers drop its CQEs from the CQ */
        pr->qp = NULL;
    }
    ep->inflight -= pr->inflight;
    pr->inflight = 0;
    if (pr->state != PEER_FREE) {
        pr->state = PEER_BROKEN;
        snprintf(pr->why, sizeof pr->why, "%s: %s", status, text);
    }
}

static int find_peer_by_qpn(Endpoint *ep, uint32_t qpn)
{
    for (int i = 0; i < PEERS_MAX; i++)
        if (ep->peers[i].qp && ep->peers[i].qp->qp_num == qpn)
            return i;
    return -1;
}

static void dispatch(Endpoint *ep, const struct ibv_wc *wc)
{
    uint64_t ticket = wc->wr_id >> 16;
    uint32_t length = (uint32_t)(wc->wr_id & 0xffff);
    struct waiter *w = ep->waiters;
    while (w && w->ticket != ticket)
        w = w->next;
    int p = w ? w->peer : find_peer_by_qpn(ep, wc->qp_num);
    if (wc->status == IBV_WC_SUCCESS) {
        if (w)
            w->chains_done++;
        if (p >= 0 && ep->peers[p].qp && ep->peers[p].qp->qp_num == wc->qp_num) {
            ep->peers[p].inflight -= length;
            ep->inflight -= length;
        }
        return;
    }
    if (p < 0 || !ep->peers[p].qp || ep->peers[p].qp->qp_num != wc->qp_num)
        return; /* a late completion of a QP already destroyed */
    char text[160];
    snprintf(text, sizeof text, "work request failed on the QP to peer %d (vendor error 0x%x)", p,
             wc->vendor_err);
    break_peer(ep, p, V.wc_status_str(wc->status), text);
}

static uint64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

/* ---- Endpoint ---------------------------------------------------------- */

static int ep_open(Endpoint *ep, const char *device, int port, int gid_index, char *why,
                   size_t why_len)
{
    int n = 0;
    struct ibv_device **list = V.get_device_list(&n);
    if (!list || n == 0) {
        if (list)
            V.free_device_list(list);
        snprintf(why, why_len, "no RDMA device found (ibv_devices lists none; is the NIC's "
                               "kernel driver loaded?)");
        return -1;
    }
    struct ibv_device *dev = NULL;
    for (int i = 0; i < n; i++)
        if (!device || strcmp(V.get_device_name(list[i]), device) == 0) {
            dev = list[i];
            break;
        }
    if (!dev) {
        V.free_device_list(list);
        snprintf(why, why_len, "RDMA device %s not found (see ibv_devices)", device);
        return -1;
    }
    snprintf(ep->name, sizeof ep->name, "%s", V.get_device_name(dev));
    ep->ctx = V.open_device(dev);
    V.free_device_list(list);
    if (!ep->ctx) {
        snprintf(why, why_len, "ibv_open_device(%s): %s", ep->name, strerror(errno));
        return -1;
    }
    struct ibv_device_attr da;
    struct ibv_port_attr pa;
    memset(&pa, 0, sizeof pa);
    if (V.query_device(ep->ctx, &da) || V.query_port(ep->ctx, (uint8_t)port, &pa)) {
        snprintf(why, why_len, "querying %s port %d failed: %s", ep->name, port, strerror(errno));
        return -1;
    }
    if (pa.state != IBV_PORT_ACTIVE) {
        snprintf(why, why_len, "%s port %d is not ACTIVE (state %d): check the cable and "
                 "ibv_devinfo", ep->name, port, (int)pa.state);
        return -1;
    }
    ep->port = (uint8_t)port;
    ep->lid = pa.lid;
    ep->link_layer = pa.link_layer;
    ep->active_mtu = (uint8_t)pa.active_mtu;
    ep->max_msg = pa.max_msg_sz ? pa.max_msg_sz : (1u << 31);
    ep->sq_depth = da.max_qp_wr < SQ_DEPTH_MAX ? (uint32_t)da.max_qp_wr : SQ_DEPTH_MAX;
    ep->send_sge = da.max_sge < SEND_SGE_MAX ? (uint32_t)da.max_sge : SEND_SGE_MAX;
    ep->cq_depth = da.max_cqe < CQ_DEPTH_MAX ? (uint32_t)da.max_cqe : CQ_DEPTH_MAX;
    ep->rd_atom = da.max_qp_rd_atom > 0 ? (uint32_t)da.max_qp_rd_atom : 1;
    if (ep->sq_depth < 2 || ep->send_sge < 1 || ep->cq_depth < 4) {
        snprintf(why, why_len, "%s reports unusable limits", ep->name);
        return -1;
    }
    int eth = pa.link_layer == IBV_LINK_LAYER_ETHERNET;
    ep->global = eth || gid_index >= 0;
    if (gid_index < 0 && eth) {
        /* RoCE: prefer the last IPv4-mapped GID (RoCE v2 follows v1 per address);
         * kvx.backends.rdma.verbs_info picks from sysfs and passes it explicitly. */
        for (int i = 0; i < pa.gid_tbl_len && i < 256; i++) {
            union ibv_gid g;
            if (V.query_gid(ep->ctx, (uint8_t)port, i, &g) || !g.global.interface_id)
                continue;
            static const uint8_t v4[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
            if (gid_index < 0 || memcmp(g.raw, v4, 12) == 0)
                gid_index = i;
        }
        if (gid_index < 0) {
            snprintf(why, why_len, "%s port %d (RoCE) has no usable GID: give the NIC an IP "
                     "address or pass gid_index", ep->name, port);
            return -1;
        }
    }
    ep->gid_index = gid_index < 0 ? 0 : gid_index;
    if (V.query_gid(ep->ctx, (uint8_t)port, ep->gid_index, &ep->gid)) {
        snprintf(why, why_len, "%s port %d has no GID %d", ep->name, port, ep->gid_index);
        return -1;
    }
    ep->pd = V.alloc_pd(ep->ctx);
    ep->cq = ep->pd ? V.create_cq(ep->ctx, (int)ep->cq_depth, NULL, NULL, 0) : NULL;
    if (!ep->cq) {
        snprintf(why, why_len, "%s: allocating the PD or CQ failed: %s (raise ulimit -l?)",
                 ep->name, strerror(errno));
        return -1;
    }
    ep->peers = calloc(PEERS_MAX, sizeof *ep->peers);
    ep->mrs = calloc(MRS_MAX, sizeof *ep->mrs);
    if (!ep->peers || !ep->mrs) {
        snprintf(why, why_len, "out of memory");
        return -1;
    }
    return 0;
}

static void ep_release(Endpoint *ep)
{
    for (struct waiter *w = ep->waiters; w; w = w->next)
        if (!w->failed) {
            w->failed = 1;
            snprintf(w->status, sizeof w->status, "CLOSED");
            snprintf(w->text, sizeof w->text, "the endpoint was closed");
        }
    if (ep->peers)
        for (int i = 0; i < PEERS_MAX; i++)
            if (ep->peers[i].qp)
                break_peer(ep, i, "CLOSED", "the endpoint was closed");
    for (size_t i = 0; i < ep->n_mrs; i++)
        V.dereg_mr(ep->mrs[i].mr);
    ep->n_mrs = 0;
    if (ep->cq)
        V.destroy_cq(ep->cq);
    if (ep->pd)
        V.dealloc_pd(ep->pd);
    if (ep->ctx)
        V.close_device(ep->ctx);
    ep->cq = NULL;
    ep->pd = NULL;
    ep->ctx = NULL;
    ep->closed = 1;
}

static int Endpoint_init(Endpoint *ep, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"device", "port", "gid_index", NULL};
    const char *device = NULL;
    int port = 1;
    PyObject *gid_obj = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|ziO", kwlist, &device, &port, &gid_obj))
        return -1;
    int gid_index = -1;
    if (gid_obj != Py_None) {
        gid_index = (int)PyLong_AsLong(gid_obj);
        if (gid_index == -1 && PyErr_Occurred())
            return -1;
        if (gid_index < 0 || gid_index > 255) {
            PyErr_SetString(PyExc_ValueError, "gid_index must be None or 0..255");
            return -1;
        }
    }
    if (port < 1 || port > 255) {
        PyErr_SetString(PyExc_ValueError, "port must be 1..255");
        return -1;
    }
    if (ep->ready) {
        PyErr_SetString(PyExc_RuntimeError, "Endpoint already initialised");
        return -1;
    }
    char why[512];
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = load_library(NULL, why, sizeof why);
    if (!rc)
        rc = ep_open(ep, device, port, gid_index, why, sizeof why);
    if (rc)
        ep_release(ep);
    Py_END_ALLOW_THREADS
    if (rc) {
        raise_error("UNAVAILABLE", why, -1);
        return -1;
    }
    pthread_mutex_init(&ep->mu, NULL);
    ep->ready = 1;
    ep->closed = 0;
    return 0;
}

static void Endpoint_dealloc(Endpoint *ep)
{
    if (ep->ready) {
        if (!ep->closed)
            ep_release(ep);
        pthread_mutex_destroy(&ep->mu);
    }
    free(ep->peers);
    free(ep->mrs);
    Py_TYPE(ep)->tp_free((PyObject *)ep);
}

static int check_open(Endpoint *ep)
{
    if (!ep->ready || ep->closed) {
        raise_error("CLOSED", "the endpoint is closed", -1);
        return -1;
    }
    return 0;
}

static PyObject *Endpoint_close(Endpoint *ep, PyObject *unused)
{
    (void)unused;
    if (ep->ready && !ep->closed) {
        Py_BEGIN_ALLOW_THREADS
        pthread_mutex_lock(&ep->mu);
        ep_release(ep);
        pthread_mutex_unlock(&ep->mu);
        Py_END_ALLOW_THREADS
    }
    Py_RETURN_NONE;
}

static void put_le(uint8_t *p, uint64_t v, int n)
{
    for (int i = 0; i < n; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static uint64_t get_le(const uint8_t *p, int n)
{
    uint64_t v = 0;
    for (int i = 0; i < n; i++)
        v |= (uint64_t)p[i] << (8 * i);
    return v;
}

/* info: version u8, flags u8, mtu u8, reserved u8, lid u16, reserved u16,
 * qpn u32 (24 bits used), psn u32 (24 bits), gid 16 bytes = 32 bytes, little-endian. */
static PyObject *Endpoint_prepare(Endpoint *ep, PyObject *unused)
{
    (void)unused;
    if (check_open(ep))
        return NULL;
    uint32_t psn;
    if (getrandom(&psn, sizeof psn, 0) != sizeof psn)
        return PyErr_SetFromErrno(PyExc_OSError);
    psn &= 0xffffff;
    int p = -1;
    char why[200] = "";
    uint8_t info[INFO_SIZE] = {0};
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&ep->mu);
    for (int i = 0; i < PEERS_MAX && !ep->closed; i++)
        if (ep->peers[i].state == PEER_FREE) {
            p = i;
            break;
        }
    if (p < 0) {
        snprintf(why, sizeof why, "all %d QP slots in use: disconnect peers first", PEERS_MAX);
    } else {
        struct ibv_qp_init_attr ia = {
            .send_cq = ep->cq,
            .recv_cq = ep->cq,
            .cap = {.max_send_wr = ep->sq_depth, .max_recv_wr = 1,
                    .max_send_sge = ep->send_sge, .max_recv_sge = 1},
            .qp_type = IBV_QPT_RC,
            .sq_sig_all = 0,
        };
        struct ibv_qp *qp = V.create_qp(ep->pd, &ia);
        struct ibv_qp_attr a = {
            .qp_state = IBV_QPS_INIT,
            .pkey_index = 0,
            .port_num = ep->port,
            .qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ |
                               IBV_ACCESS_REMOTE_WRITE,
        };
        if (!qp) {
            snprintf(why, sizeof why, "ibv_create_qp: %s", strerror(errno));
            p = -1;
        } else if (V.modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
                                           IBV_QP_ACCESS_FLAGS)) {
            snprintf(why, sizeof why, "QP to INIT: %s", strerror(errno));
            V.destroy_qp(qp);
            p = -1;
        } else {
            ep->peers[p] = (struct peer){.qp = qp, .state = PEER_PREPARED, .psn = psn};
        }
    }
    if (p >= 0) {
        info[0] = INFO_VERSION;
        info[1] = ep->global ? INFO_GLOBAL : 0;
        info[2] = ep->active_mtu;
        put_le(info + 4, ep->lid, 2);
        put_le(info + 8, ep->peers[p].qp->qp_num, 4);
        put_le(info + 12, psn, 4);
        memcpy(info + 16, ep->gid.raw, 16);
    }
    pthread_mutex_unlock(&ep->mu);
    Py_END_ALLOW_THREADS
    if (p < 0) {
        raise_error(ep->closed ? "CLOSED" : "QP_CREATE", why, -1);
        return NULL;
    }
    return Py_BuildValue("(iy#)", p, (const char *)info, (Py_ssize_t)INFO_SIZE);
}

static int connect_qp(Endpoint *ep, struct peer *pr, const uint8_t *info, char *why,
                      size_t why_len)
{
    uint8_t mtu = info[2] < ep->active_mtu ? info[2] : ep->active_mtu;
    struct ibv_qp_attr a = {
        .qp_state = IBV_QPS_RTR,
        .path_mtu = (enum ibv_mtu)mtu,
        .dest_qp_num = (uint32_t)get_le(info + 8, 4),
        .rq_psn = (uint32_t)get_le(info + 12, 4),
        .max_dest_rd_atomic = (uint8_t)(ep->rd_atom > 255 ? 255 : ep->rd_atom),
        .min_rnr_timer = 12,
        .ah_attr = {.dlid = (uint16_t)get_le(info + 4, 2), .sl = 0, .src_path_bits = 0,
                    .port_num = ep->port},
    };
    if (ep->global || (info[1] & INFO_GLOBAL)) {
        a.ah_attr.is_global = 1;
        memcpy(a.ah_attr.grh.dgid.raw, info + 16, 16);
        a.ah_attr.grh.sgid_index = (uint8_t)ep->gid_index;
        a.ah_attr.grh.hop_limit = 64;
    }
    if (V.modify_qp(pr->qp, &a,
                    IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                        IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER)) {
        snprintf(why, why_len, "QP to RTR: %s (peer's GID or LID unreachable from %s port %d?)",
                 strerror(errno), ep->name, ep->port);
        return -1;
    }
    struct ibv_qp_attr b = {
        .qp_state = IBV_QPS_RTS,
        .timeout = 14, /* 4.096 us * 2^14 = 67 ms per try */
        .retry_cnt = 7,
        .rnr_retry = 7,
        .sq_psn = pr->psn,
        .max_rd_atomic = (uint8_t)(ep->rd_atom > 255 ? 255 : ep->rd_atom),
    };
    if (V.modify_qp(pr->qp, &b,
                    IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                        IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC)) {
        snprintf(why, why_len, "QP to RTS: %s", strerror(errno));
        return -1;
    }
    return 0;
}

static PyObject *Endpoint_complete(Endpoint *ep, PyObject *args)
{
    int p;
    Py_buffer info;
    if (!PyArg_ParseTuple(args, "iy*", &p, &info))
        return NULL;
    const uint8_t *b = info.buf;
    const char *bad = NULL;
    if (info.len != INFO_SIZE)
        bad = "connection info must be exactly 32 bytes";
    else if (b[0] != INFO_VERSION)
        bad = "connection info has an unknown version (peer runs another kvx?)";
    else if ((b[1] & ~INFO_GLOBAL) || b[3] || get_le(b + 6, 2) || get_le(b + 8, 4) >> 24 ||
             get_le(b + 12, 4) >> 24)
        bad = "connection info has reserved bits set or a QPN/PSN beyond 24 bits";
    else if (b[2] < IBV_MTU_256 || b[2] > IBV_MTU_4096)
        bad = "connection info has an invalid MTU";
    if (bad) {
        PyBuffer_Release(&info);
        PyErr_SetString(PyExc_ValueError, bad);
        return NULL;
    }
    if (check_open(ep)) {
        PyBuffer_Release(&info);
        return NULL;
    }
    uint8_t copy[INFO_SIZE];
    memcpy(copy, b, INFO_SIZE);
    PyBuffer_Release(&info);
    if (p < 0 || p >= PEERS_MAX) {
        PyErr_SetString(PyExc_ValueError, "unknown half-open connection");
        return NULL;
    }
    char why[200] = "";
    int rc = -1;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&ep->mu);
    struct peer *pr = &ep->peers[p];
    if (ep->closed || pr->state != PEER_PREPARED || !pr->qp) {
        snprintf(why, sizeof why, "connection %d is not half-open (prepare first)", p);
    } else if ((rc = connect_qp(ep, pr, copy, why, sizeof why)) == 0) {
        pr->state = PEER_CONNECTED;
    }
    pthread_mutex_unlock(&ep->mu);
    Py_END_ALLOW_THREADS
    if (rc) {
        raise_error("CONNECT", why, p);
        return NULL;
    }
    return PyLong_FromLong(p);
}

static PyObject *Endpoint_disconnect(Endpoint *ep, PyObject *args)
{
    int p;
    if (!PyArg_ParseTuple(args, "i", &p))
        return NULL;
    if (p < 0 || p >= PEERS_MAX) {
        PyErr_SetString(PyExc_ValueError, "unknown peer");
        return NULL;
    }
    if (check_open(ep))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&ep->mu);
    if (!ep->closed) {
        break_peer(ep, p, "DISCONNECTED", "the peer was disconnected");
        ep->peers[p].state = PEER_FREE;
    }
    pthread_mutex_unlock(&ep->mu);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* (state, qp_num, why): 'free', 'prepared', 'connected' or 'broken'. */
static PyObject *Endpoint_peer_state(Endpoint *ep, PyObject *args)
{
    int p;
    if (!PyArg_ParseTuple(args, "i", &p))
        return NULL;
    if (p < 0 || p >= PEERS_MAX || !ep->ready) {
        PyErr_SetString(PyExc_ValueError, "unknown peer");
        return NULL;
    }
    static const char *names[] = {"free", "prepared", "connected", "broken"};
    pthread_mutex_lock(&ep->mu);
    struct peer pr = ep->peers[p];
    long qpn = pr.qp ? (long)pr.qp->qp_num : -1;
    pthread_mutex_unlock(&ep->mu);
    return Py_BuildValue("(sls)", names[pr.state], qpn, pr.why);
}

/* ---- memory regions ---------------------------------------------------- */

static PyObject *Endpoint_register(Endpoint *ep, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"addr", "length", "remote_read", "remote_write", "device", NULL};
    unsigned long long addr, len;
    int rr = -1, rw = -1, device = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "KK|$ppi", kwlist, &addr, &len, &rr, &rw,
                                     &device))
        return NULL;
    if (rr < 0 || rw < 0) {
        PyErr_SetString(PyExc_TypeError, "register needs remote_read= and remote_write=");
        return NULL;
    }
    if (len == 0 || addr + len < addr) {
        PyErr_SetString(PyExc_ValueError, "register needs a non-empty range that does not wrap");
        return NULL;
    }
    if (check_open(ep))
        return NULL;
    int access = IBV_ACCESS_LOCAL_WRITE | (rr ? IBV_ACCESS_REMOTE_READ : 0) |
                 (rw ? IBV_ACCESS_REMOTE_WRITE : 0);
    struct ibv_mr *mr = NULL;
    char how[320] = "host";
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    if (device >= 0) {
        char why[200];
        uint64_t base = 0;
        int fd = -1;
        if (!V.reg_dmabuf_mr)
            snprintf(why, sizeof why, "this libibverbs lacks ibv_reg_dmabuf_mr (rdma-core < 34)");
        else
            fd = cuda_dmabuf(device, addr, len, &base, why, sizeof why);
        if (fd >= 0) {
            mr = V.reg_dmabuf_mr(ep->pd, addr - base, len, addr, fd, access);
            if (!mr)
                snprintf(why, sizeof why, "ibv_reg_dmabuf_mr: %s", strerror(errno));
            close(fd);
        }
        if (mr) {
            snprintf(how, sizeof how, "dma-buf");
        } else {
            /* nvidia_peermem (peer memory) lets ibv_reg_mr pin GPU pages directly. */
            snprintf(how, sizeof how, "peer-memory (dma-buf unavailable: %s)", why);
            mr = V.reg_mr(ep->pd, (void *)(uintptr_t)addr, len, access);
        }
    } else {
        mr = V.reg_mr(ep->pd, (void *)(uintptr_t)addr, len, access);
    }
    err = errno;
    if (mr) {
        pthread_mutex_lock(&ep->mu);
        if (ep->closed || ep->n_mrs == MRS_MAX) {
            V.dereg_mr(mr);
            mr = NULL;
            err = ep->closed ? EBADF : ENOSPC;
        } else {
            ep->mrs[ep->n_mrs++] = (struct mr_entry){addr, len, mr->lkey, mr};
        }
        pthread_mutex_unlock(&ep->mu);
    }
    Py_END_ALLOW_THREADS
    if (!mr) {
        char text[480];
        snprintf(text, sizeof text,
                 "registering %llu bytes at 0x%llx (%s) failed: %s%s", len, addr, how,
                 strerror(err),
                 err == ENOMEM || err == EPERM ? " (raise the memlock limit: ulimit -l unlimited)"
                                               : "");
        raise_error("REGISTER", text, -1);
        return NULL;
    }
    MR *m = PyObject_New(MR, &MRType);
    if (!m)
        return NULL;
    Py_INCREF(ep);
    m->ep = ep;
    m->mr = mr;
    m->addr = addr;
    m->len = len;
    m->key = mr->rkey;
    m->how = PyUnicode_FromString(how);
    return (PyObject *)m;
}

static void mr_close(MR *m)
{
    if (!m->mr)
        return;
    Endpoint *ep = m->ep;
    pthread_mutex_lock(&ep->mu);
    for (size_t i = 0; i < ep->n_mrs; i++)
        if (ep->mrs[i].mr == m->mr) {
            V.dereg_mr(m->mr); /* after it returns, the rkey admits no access */
            ep->mrs[i] = ep->mrs[--ep->n_mrs];
            break;
        }
    pthread_mutex_unlock(&ep->mu);
    m->mr = NULL;
}

static PyObject *MR_close(MR *m, PyObject *unused)
{
    (void)unused;
    Py_BEGIN_ALLOW_THREADS
    mr_close(m);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static void MR_dealloc(MR *m)
{
    mr_close(m);
    Py_XDECREF(m->how);
    Py_XDECREF(m->ep);
    PyObject_Del(m);
}

/* ---- the data path ----------------------------------------------------- */

struct list {
    const uint64_t *addr, *len, *key;
    size_t n, at;
    uint64_t off;
};

struct job {
    Endpoint *ep;
    int op, peer;
    struct list loc, rem;
    uint32_t *lkeys;
    struct ibv_send_wr *wrs;
    struct ibv_sge *sges;
    uint64_t deadline_ns;
    struct waiter w;
};

static void skip_empty(struct list *l)
{
    while (l->at < l->n && l->off == l->len[l->at]) {
        l->at++;
        l->off = 0;
    }
}

/* Fill one WR from the cursors; returns its length. */
static uint32_t build_wr(struct job *j, struct ibv_send_wr *wr, struct ibv_sge *sge)
{
    Endpoint *ep = j->ep;
    skip_empty(&j->rem);
    skip_empty(&j->loc);
    uint64_t room = j->rem.len[j->rem.at] - j->rem.off;
    if (room > ep->max_msg)
        room = ep->max_msg;
    uint64_t total = 0;
    int n = 0;
    while (total < room && n < (int)ep->send_sge) {
        skip_empty(&j->loc);
        uint64_t take = j->loc.len[j->loc.at] - j->loc.off;
        if (take > room - total)
            take = room - total;
        sge[n].addr = j->loc.addr[j->loc.at] + j->loc.off;
        sge[n].length = (uint32_t)take;
        sge[n].lkey = j->lkeys[j->loc.at];
        j->loc.off += take;
        total += take;
        n++;
    }
    memset(wr, 0, sizeof *wr);
    wr->sg_list = sge;
    wr->num_sge = n;
    wr->opcode = j->op ? IBV_WR_RDMA_WRITE : IBV_WR_RDMA_READ;
    wr->wr.rdma.remote_addr = j->rem.addr[j->rem.at] + j->rem.off;
    wr->wr.rdma.rkey = (uint32_t)j->rem.key[j->rem.at];
    j->rem.off += total;
    skip_empty(&j->rem);
    return (uint32_t)total;
}

/* Posts chains while the QP and CQ have room; returns -1 after a failed post. */
static int post_some(struct job *j)
{
    Endpoint *ep = j->ep;
    struct peer *pr = &ep->peers[j->peer];
    while (j->rem.at < j->rem.n) {
        uint32_t room_qp = ep->sq_depth - pr->inflight;
        uint32_t room_cq = ep->cq_depth / 2 - ep->inflight;
        uint32_t room = room_qp < room_cq ? room_qp : room_cq;
        if (room > CHAIN_MAX)
            room = CHAIN_MAX;
        if (room == 0)
            return 0;
        uint32_t n = 0;
        while (n < room && j->rem.at < j->rem.n) {
            build_wr(j, &j->wrs[n], &j->sges[n * ep->send_sge]);
            if (n)
                j->wrs[n - 1].next = &j->wrs[n];
            n++;
        }
        j->wrs[n - 1].send_flags = IBV_SEND_SIGNALED;
        for (uint32_t i = 0; i < n; i++)
            j->wrs[i].wr_id = j->w.ticket << 16 | n;
        struct ibv_send_wr *bad = NULL;
        int rc = ibv_post_send(pr->qp, j->wrs, &bad);
        if (rc) {
            char text[160];
            snprintf(text, sizeof text, "ibv_post_send to peer %d: %s", j->peer, strerror(rc));
            break_peer(ep, j->peer, "POST_SEND", text);
            return -1;
        }
        pr->inflight += n;
        ep->inflight += n;
        j->w.chains_posted++;
    }
    return 0;
}

/* Called with the mutex held and the GIL released. */
static void run_job(struct job *j)
{
    Endpoint *ep = j->ep;
    struct ibv_wc wc[16];
    unsigned idle = 0;
    for (;;) {
        if (ep->closed && !j->w.failed) {
            j->w.failed = 1;
            snprintf(j->w.status, sizeof j->w.status, "CLOSED");
            snprintf(j->w.text, sizeof j->w.text, "the endpoint was closed");
        }
        if (j->w.failed)
            return;
        if (j->rem.at == j->rem.n && j->w.chains_done == j->w.chains_posted)
            return;
        if (post_some(j))
            continue;
        int n = ibv_poll_cq(ep->cq, 16, wc);
        for (int i = 0; i < n; i++)
            dispatch(ep, &wc[i]);
        if (n > 0) {
            idle = 0;
            continue;
        }
        if (now_ns() > j->deadline_ns) {
            char text[160];
            snprintf(text, sizeof text, "no completion from peer %d before the deadline",
                     j->peer);
            break_peer(ep, j->peer, "TIMEOUT", text);
            j->w.failed = 2;
            return;
        }
        /* Let other posting threads in, then back off gently when idle. */
        pthread_mutex_unlock(&ep->mu);
        if (++idle > 256) {
            struct timespec t = {0, 20000};
            nanosleep(&t, NULL);
        } else {
            sched_yield();
        }
        pthread_mutex_lock(&ep->mu);
    }
}

static int get_u64(PyObject *obj, Py_buffer *b, const char *what)
{
    if (PyObject_GetBuffer(obj, b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    if (b->itemsize != 8 || (b->format && strchr("QLK", b->format[0]) == NULL &&
                             strcmp(b->format, "<Q") != 0 && strcmp(b->format, "=Q") != 0)) {
        PyBuffer_Release(b);
        PyErr_Format(PyExc_TypeError, "%s must be a C-contiguous uint64 buffer", what);
        return -1;
    }
    return 0;
}

static int sum_lens(const uint64_t *len, size_t n, uint64_t *total)
{
    *total = 0;
    for (size_t i = 0; i < n; i++) {
        if (*total + len[i] < *total)
            return -1;
        *total += len[i];
    }
    return 0;
}

/* lkey of the registered range that holds [addr, addr+len), or -1. */
static int64_t find_lkey(Endpoint *ep, uint64_t addr, uint64_t len, size_t *hint)
{
    if (*hint < ep->n_mrs) {
        struct mr_entry *e = &ep->mrs[*hint];
        if (addr >= e->addr && addr + len <= e->addr + e->len)
            return e->lkey;
    }
    for (size_t i = 0; i < ep->n_mrs; i++) {
        struct mr_entry *e = &ep->mrs[i];
        if (addr >= e->addr && addr + len <= e->addr + e->len) {
            *hint = i;
            return e->lkey;
        }
    }
    return -1;
}

static PyObject *Endpoint_post(Endpoint *ep, PyObject *args)
{
    int op, peer;
    long long timeout_ms;
    PyObject *o[5];
    if (!PyArg_ParseTuple(args, "iiOOOOOL", &op, &peer, &o[0], &o[1], &o[2], &o[3], &o[4],
                          &timeout_ms))
        return NULL;
    if (op != 0 && op != 1) {
        PyErr_SetString(PyExc_ValueError, "op must be 0 (READ) or 1 (WRITE)");
        return NULL;
    }
    if (peer < 0 || peer >= PEERS_MAX || timeout_ms < 0) {
        PyErr_SetString(PyExc_ValueError, "unknown peer or negative timeout");
        return NULL;
    }
    if (check_open(ep))
        return NULL;
    static const char *names[] = {"local_addrs", "local_lens", "remote_addrs", "remote_lens",
                                  "remote_keys"};
    Py_buffer b[5];
    int got = 0;
    for (; got < 5; got++)
        if (get_u64(o[got], &b[got], names[got]))
            goto release;
    struct job j = {.ep = ep, .op = op, .peer = peer};
    j.loc = (struct list){b[0].buf, b[1].buf, NULL, (size_t)(b[0].len / 8), 0, 0};
    j.rem = (struct list){b[2].buf, b[3].buf, b[4].buf, (size_t)(b[2].len / 8), 0, 0};
    uint64_t lt, rt;
    const char *bad = NULL;
    if (b[1].len != b[0].len || b[3].len != b[2].len || b[4].len != b[2].len)
        bad = "address, length and key arrays of one side must have the same length";
    else if (j.loc.n > PIECES_MAX || j.rem.n > PIECES_MAX)
        bad = "too many pieces in one post (at most 2**24)";
    else if (sum_lens(j.loc.len, j.loc.n, &lt) || sum_lens(j.rem.len, j.rem.n, &rt) || lt != rt)
        bad = "local and remote pieces must cover the same number of bytes";
    else
        for (size_t i = 0; i < j.rem.n && !bad; i++)
            if (j.rem.key[i] >> 32 || j.rem.addr[i] + j.rem.len[i] < j.rem.addr[i])
                bad = "a remote key beyond 32 bits or a remote range that wraps";
    if (bad) {
        PyErr_SetString(PyExc_ValueError, bad);
        goto release;
    }
    if (rt == 0) {
        for (int i = 0; i < 5; i++)
            PyBuffer_Release(&b[i]);
        Py_RETURN_NONE;
    }
    j.lkeys = malloc(j.loc.n * sizeof *j.lkeys + 1);
    j.wrs = calloc(CHAIN_MAX, sizeof *j.wrs);
    j.sges = calloc((size_t)CHAIN_MAX * ep->send_sge, sizeof *j.sges);
    if (!j.lkeys || !j.wrs || !j.sges) {
        PyErr_NoMemory();
        goto free_job;
    }
    char status[64] = "", text[240] = "";
    int failed = 0;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&ep->mu);
    size_t hint = 0;
    struct peer *pr = &ep->peers[peer];
    if (ep->closed) {
        failed = 1;
        snprintf(status, sizeof status, "CLOSED");
        snprintf(text, sizeof text, "the endpoint is closed");
    } else if (pr->state != PEER_CONNECTED) {
        failed = 1;
        snprintf(status, sizeof status, "%s", pr->state == PEER_BROKEN ? "QP_BROKEN" : "NOT_CONNECTED");
        snprintf(text, sizeof text, "peer %d %s%s", peer,
                 pr->state == PEER_BROKEN ? "has a broken QP; reconnect (prepare/complete): "
                                          : "is not connected",
                 pr->why);
    }
    for (size_t i = 0; i < j.loc.n && !failed; i++) {
        int64_t k = j.loc.len[i] ? find_lkey(ep, j.loc.addr[i], j.loc.len[i], &hint) : 0;
        if (k < 0) {
            failed = 3;
            snprintf(text, sizeof text, "local piece %zu (0x%llx, %llu bytes) is not in a "
                     "registered region: register it with ep.register first", i,
                     (unsigned long long)j.loc.addr[i], (unsigned long long)j.loc.len[i]);
        } else {
            j.lkeys[i] = (uint32_t)k;
        }
    }
    if (!failed) {
        j.w.ticket = ++ep->next_ticket & ((1ull << 48) - 1);
        j.w.peer = peer;
        j.w.next = ep->waiters;
        ep->waiters = &j.w;
        j.deadline_ns = now_ns() + (uint64_t)timeout_ms * 1000000u;
        run_job(&j);
        struct waiter **pp = &ep->waiters;
        while (*pp != &j.w)
            pp = &(*pp)->next;
        *pp = j.w.next;
        failed = j.w.failed;
        if (failed) {
            snprintf(status, sizeof status, "%s", j.w.status);
            snprintf(text, sizeof text, "%s", j.w.text);
        }
    }
    pthread_mutex_unlock(&ep->mu);
    Py_END_ALLOW_THREADS
    if (failed == 2)
        PyErr_Format(PyExc_TimeoutError,
                     "RDMA transfer to peer %d did not complete within %lld ms (QP destroyed; "
                     "reconnect)", peer, timeout_ms);
    else if (failed == 3)
        PyErr_SetString(PyExc_ValueError, text);
    else if (failed)
        raise_error(status, text, peer);
free_job:
    free(j.lkeys);
    free(j.wrs);
    free(j.sges);
release:
    for (int i = 0; i < got; i++)
        PyBuffer_Release(&b[i]);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

/* ---- types and module -------------------------------------------------- */

static PyObject *Endpoint_get(Endpoint *ep, void *which)
{
    if (!ep->ready) {
        PyErr_SetString(PyExc_RuntimeError, "Endpoint not initialised");
        return NULL;
    }
    switch ((intptr_t)which) {
    case 0: return PyUnicode_FromString("verbs");
    case 1: return PyUnicode_FromString(ep->name);
    case 2: return PyBytes_FromStringAndSize("", 0);
    case 3: Py_RETURN_TRUE;
    case 4: return PyLong_FromUnsignedLong(ep->send_sge);
    case 5: return PyLong_FromUnsignedLong(ep->sq_depth);
    case 6: return PyLong_FromUnsignedLong(ep->max_msg);
    case 7: return PyLong_FromLong(ep->gid_index);
    case 8: return PyUnicode_FromString(ep->link_layer == IBV_LINK_LAYER_ETHERNET ? "Ethernet"
                                                                                  : "InfiniBand");
    case 9: return PyLong_FromUnsignedLong(ep->rd_atom);
    default: return PyLong_FromUnsignedLong(ep->cq_depth);
    }
}

#define GET(name, i, doc) {name, (getter)Endpoint_get, NULL, doc, (void *)(intptr_t)(i)}
static PyGetSetDef Endpoint_getset[] = {
    GET("provider", 0, "always 'verbs'"),
    GET("fabric", 1, "the device name"),
    GET("domain", 1, "the device name"),
    GET("address", 2, "empty: verbs peers are reached through prepare/complete"),
    GET("virt_addr", 3, "remote addresses are virtual addresses"),
    GET("max_sge", 4, "local pieces gathered per work request"),
    GET("max_outstanding", 5, "work requests in flight per QP (send queue depth)"),
    GET("max_msg", 6, "the largest work request, bytes (port max_msg_sz)"),
    GET("gid_index", 7, "the local GID index used"),
    GET("link_layer", 8, "'InfiniBand' or 'Ethernet' (RoCE)"),
    GET("max_rd_atomic", 9, "READs in flight per QP, as the NIC bounds them"),
    GET("cq_depth", 10, "entries in the completion queue"),
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef Endpoint_methods[] = {
    {"prepare", (PyCFunction)Endpoint_prepare, METH_NOARGS, "prepare() -> (half, info)"},
    {"complete", (PyCFunction)Endpoint_complete, METH_VARARGS, "complete(half, info) -> peer"},
    {"disconnect", (PyCFunction)Endpoint_disconnect, METH_VARARGS, "disconnect(peer)"},
    {"peer_state", (PyCFunction)Endpoint_peer_state, METH_VARARGS,
     "peer_state(peer) -> (state, qp_num, why)"},
    {"register", (PyCFunction)(void (*)(void))Endpoint_register, METH_VARARGS | METH_KEYWORDS,
     "register(addr, length, *, remote_read, remote_write, device=-1) -> MR"},
    {"post", (PyCFunction)Endpoint_post, METH_VARARGS,
     "post(op, peer, local_addrs, local_lens, remote_addrs, remote_lens, remote_keys, "
     "timeout_ms)"},
    {"close", (PyCFunction)Endpoint_close, METH_NOARGS, "close()"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject EndpointType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvx._verbs.Endpoint",
    .tp_basicsize = sizeof(Endpoint),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Endpoint(device=None, port=1, gid_index=None): one device port, PD and CQ",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Endpoint_init,
    .tp_dealloc = (destructor)Endpoint_dealloc,
    .tp_methods = Endpoint_methods,
    .tp_getset = Endpoint_getset,
};

static PyObject *MR_get(MR *m, void *which)
{
    switch ((intptr_t)which) {
    case 0: return PyLong_FromUnsignedLong(m->key);
    case 1: return PyLong_FromUnsignedLongLong(m->addr);
    case 2: return PyLong_FromUnsignedLongLong(m->len);
    default: Py_INCREF(m->how); return m->how;
    }
}

static PyGetSetDef MR_getset[] = {
    {"key", (getter)MR_get, NULL, "the rkey", (void *)0},
    {"addr", (getter)MR_get, NULL, "start address", (void *)1},
    {"length", (getter)MR_get, NULL, "bytes", (void *)2},
    {"how", (getter)MR_get, NULL, "'host', 'dma-buf' or 'peer-memory (why)'", (void *)3},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef MR_methods[] = {
    {"close", (PyCFunction)MR_close, METH_NOARGS, "deregister: the key admits no access after"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject MRType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvx._verbs.MR",
    .tp_basicsize = sizeof(MR),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A registered memory region",
    .tp_dealloc = (destructor)MR_dealloc,
    .tp_methods = MR_methods,
    .tp_getset = MR_getset,
};

static PyObject *mod_load(PyObject *self, PyObject *args)
{
    (void)self;
    const char *path = NULL;
    if (!PyArg_ParseTuple(args, "|z", &path))
        return NULL;
    char why[512];
    if (load_library(path, why, sizeof why)) {
        raise_error("UNAVAILABLE", why, -1);
        return NULL;
    }
    return PyUnicode_FromString(V.path);
}

static PyMethodDef module_methods[] = {
    {"load", mod_load, METH_VARARGS,
     "load(path=None) -> path: open libibverbs (KVX_IBVERBS_LIB, else libibverbs.so.1)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvx._verbs", "The ibverbs provider of the rdma backend.", -1,
    module_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__verbs(void)
{
    if (PyType_Ready(&EndpointType) < 0 || PyType_Ready(&MRType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    VerbsError = PyErr_NewExceptionWithDoc(
        "kvx._verbs.Error", "An ibverbs failure: args (status, text, peer).", NULL, NULL);
    Py_INCREF(&EndpointType);
    Py_INCREF(&MRType);
    if (!VerbsError || PyModule_AddObject(m, "Error", VerbsError) ||
        PyModule_AddObject(m, "Endpoint", (PyObject *)&EndpointType) ||
        PyModule_AddObject(m, "MR", (PyObject *)&MRType)) {
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(VerbsError);
    return m;
}
