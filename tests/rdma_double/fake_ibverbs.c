/*
 * A libibverbs double for kvx._verbs (loaded through KVX_IBVERBS_LIB): one
 * RoCE device whose RC QPs move bytes with memcpy between QPs of this
 * process, and which checks what a NIC would and what only a double can:
 *
 *   - QP state transitions and their required/allowed attribute masks
 *     (IB spec, RC), and the attributes (port, MTU, rd_atomic, GRH on RoCE);
 *   - lkeys/rkeys, bounds and access flags as a NIC does: a bad rkey, a range
 *     outside the MR or a missing REMOTE_READ/WRITE completes with
 *     IBV_WC_REM_ACCESS_ERR, a bad local SGE with IBV_WC_LOC_PROT_ERR;
 *   - send queue depth (WRs retire only when a later signalled completion is
 *     polled), SGE counts, CQ overrun, the PSNs of both ends;
 *   - a dead peer: WRs complete with IBV_WC_RETRY_EXC_ERR after a delay.
 *
 * Every broken rule is appended to a violation log that the tests read with
 * fake_violations(). Build: gcc -shared -fPIC -o libfake_ibverbs.so this.c
 * It also answers the few libcuda calls kvx uses for dma-buf (host memory
 * stands in for GPU memory), so KVX_CUDA_LIB can point here too.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* verbs.h turns these into inline wrappers; the double defines the symbols. */
#undef ibv_query_port
#undef ibv_reg_mr

#define QPS_MAX 1024
#define MRS_MAX 4096
#define GIDS 2

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static struct {
    int max_qp_wr, max_sge, max_cqe, rd_atom;
    uint32_t max_msg;
} cfg = {256, 4, 512, 16, 1u << 30};
static int dead_qpn = 0, dead_delay_ms = 0, cuda_fail = 0;
static char violations[16384];
static int n_violations;
static unsigned long long stat_posts, stat_wrs, stat_signalled, stat_max_chain, stat_max_sge,
    stat_max_sq, stat_qps_created, stat_qps_destroyed;
static uint32_t next_key = 0x1234;

struct fake_mr {
    struct ibv_mr mr;
    int access, live;
    uint64_t iova;
};

struct cqe {
    struct ibv_wc wc;
    struct fake_qp *qp;
    uint32_t retire;
    uint64_t ready_ns;
};

struct fake_cq {
    struct ibv_cq cq;
    struct cqe *ring;
    int cap, head, count;
};

struct fake_qp {
    struct ibv_qp qp;
    int state, access, port, mtu, rd_atom, dest_rd_atom, global, sgid_index;
    uint32_t dest_qpn, rq_psn, sq_psn, max_wr, max_sge, sq_used, unsignalled;
    uint8_t dgid[16];
    char log[128];
    unsigned long long moved; /* bytes its WRs moved */
};

static struct fake_qp *qps[QPS_MAX];
static struct fake_mr *mrs[MRS_MAX];
static struct ibv_device dev;
static struct ibv_device *dev_list[2] = {&dev, NULL};
static uint8_t gids[GIDS][16] = {
    {0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0x02, 0x11, 0x22, 0xff, 0xfe, 0x33, 0x44, 0x55},
    {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 0, 1},
};

static void violate(const char *fmt, ...)
{
    char line[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    n_violations++;
    size_t used = strlen(violations);
    if (used + strlen(line) + 2 < sizeof violations)
        snprintf(violations + used, sizeof violations - used, "%s\n", line);
}

static uint64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

/* ---- knobs for the tests --------------------------------------------- */

void fake_config(int max_qp_wr, int max_sge, int max_cqe, unsigned max_msg)
{
    cfg.max_qp_wr = max_qp_wr;
    cfg.max_sge = max_sge;
    cfg.max_cqe = max_cqe;
    cfg.max_msg = max_msg;
}
void fake_set_dead(int qpn, int delay_ms) { dead_qpn = qpn; dead_delay_ms = delay_ms; }
void fake_cuda_fail(int on) { cuda_fail = on; }
int fake_violations(char *buf, int len)
{
    pthread_mutex_lock(&mu);
    snprintf(buf, (size_t)len, "%s", violations);
    int n = n_violations;
    violations[0] = 0;
    n_violations = 0;
    pthread_mutex_unlock(&mu);
    return n;
}
void fake_stats(unsigned long long *out)
{
    pthread_mutex_lock(&mu);
    unsigned long long v[8] = {stat_posts, stat_wrs, stat_signalled, stat_max_chain,
                               stat_max_sge, stat_max_sq, stat_qps_created, stat_qps_destroyed};
    memcpy(out, v, sizeof v);
    stat_posts = stat_wrs = stat_signalled = stat_max_chain = stat_max_sge = stat_max_sq = 0;
    pthread_mutex_unlock(&mu);
}

static struct fake_qp *qp_by_num(uint32_t qpn);
/* Bytes QP ``qpn`` moved by its WRs (READ and WRITE), or -1 when no such QP. */
long long fake_qp_bytes(unsigned qpn)
{
    pthread_mutex_lock(&mu);
    struct fake_qp *q = qp_by_num(qpn);
    long long n = q ? (long long)q->moved : -1;
    pthread_mutex_unlock(&mu);
    return n;
}

static struct fake_qp *qp_by_num(uint32_t qpn)
{
    for (int i = 0; i < QPS_MAX; i++)
        if (qps[i] && qps[i]->qp.qp_num == qpn)
            return qps[i];
    return NULL;
}

int fake_qp_info(unsigned qpn, char *buf, int len)
{
    pthread_mutex_lock(&mu);
    struct fake_qp *q = qp_by_num(qpn);
    int rc = q ? 0 : -1;
    if (q)
        snprintf(buf, (size_t)len,
                 "log=%s mtu=%d rd_atomic=%d dest_rd_atomic=%d global=%d dest=%u access=%d",
                 q->log, q->mtu, q->rd_atom, q->dest_rd_atom, q->global, q->dest_qpn, q->access);
    pthread_mutex_unlock(&mu);
    return rc;
}

static const char *state_name(int s)
{
    static const char *n[] = {"RESET", "INIT", "RTR", "RTS", "SQD", "SQE", "ERR"};
    return s >= 0 && s <= 6 ? n[s] : "?";
}

/* The RC rules of the IB spec's QP state table: 0 if allowed, else why. */
const char *fake_check_transition(int cur, int next, int mask)
{
    int req = 0, opt = 0;
    if (next == IBV_QPS_RESET || next == IBV_QPS_ERR) {
        req = IBV_QP_STATE;
    } else if (cur == IBV_QPS_RESET && next == IBV_QPS_INIT) {
        req = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS;
    } else if (cur == IBV_QPS_INIT && next == IBV_QPS_RTR) {
        req = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
              IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
        opt = IBV_QP_ALT_PATH | IBV_QP_ACCESS_FLAGS | IBV_QP_PKEY_INDEX;
    } else if (cur == IBV_QPS_RTR && next == IBV_QPS_RTS) {
        req = IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
              IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC;
        opt = IBV_QP_CUR_STATE | IBV_QP_ACCESS_FLAGS | IBV_QP_MIN_RNR_TIMER | IBV_QP_ALT_PATH |
              IBV_QP_PATH_MIG_STATE;
    } else {
        return "transition not allowed";
    }
    if ((mask & req) != req)
        return "a required attribute mask bit is missing";
    if (mask & ~(req | opt))
        return "an attribute mask bit not allowed in this transition";
    return NULL;
}

/* ---- devices ------------------------------------------------------------ */

struct ibv_device **ibv_get_device_list(int *n)
{
    snprintf(dev.name, sizeof dev.name, "fake_roce0");
    if (n)
        *n = 1;
    return dev_list;
}
void ibv_free_device_list(struct ibv_device **list) { (void)list; }
const char *ibv_get_device_name(struct ibv_device *d) { return d->name; }

static int post_send(struct ibv_qp *, struct ibv_send_wr *, struct ibv_send_wr **);
static int poll_cq(struct ibv_cq *, int, struct ibv_wc *);

struct ibv_context *ibv_open_device(struct ibv_device *d)
{
    struct ibv_context *c = calloc(1, sizeof *c);
    c->device = d;
    c->ops.post_send = post_send;
    c->ops.poll_cq = poll_cq;
    return c;
}
int ibv_close_device(struct ibv_context *c) { free(c); return 0; }

int ibv_query_device(struct ibv_context *c, struct ibv_device_attr *a)
{
    (void)c;
    memset(a, 0, sizeof *a);
    a->max_qp = QPS_MAX;
    a->max_qp_wr = cfg.max_qp_wr;
    a->max_sge = cfg.max_sge;
    a->max_cq = 64;
    a->max_cqe = cfg.max_cqe;
    a->max_mr = MRS_MAX;
    a->max_pd = 64;
    a->max_qp_rd_atom = cfg.rd_atom;
    a->max_qp_init_rd_atom = cfg.rd_atom;
    return 0;
}

int ibv_query_port(struct ibv_context *c, uint8_t port, struct _compat_ibv_port_attr *compat)
{
    (void)c;
    struct ibv_port_attr *a = (struct ibv_port_attr *)compat; /* kvx passes the full struct */
    if (port != 1)
        return EINVAL;
    a->state = IBV_PORT_ACTIVE;
    a->max_mtu = IBV_MTU_4096;
    a->active_mtu = IBV_MTU_1024;
    a->gid_tbl_len = GIDS;
    a->max_msg_sz = cfg.max_msg;
    a->lid = 0;
    a->link_layer = IBV_LINK_LAYER_ETHERNET;
    return 0;
}

int ibv_query_gid(struct ibv_context *c, uint8_t port, int index, union ibv_gid *gid)
{
    (void)c;
    if (port != 1 || index < 0 || index >= GIDS)
        return EINVAL;
    memcpy(gid->raw, gids[index], 16);
    return 0;
}

struct ibv_pd *ibv_alloc_pd(struct ibv_context *c)
{
    struct ibv_pd *pd = calloc(1, sizeof *pd);
    pd->context = c;
    return pd;
}
int ibv_dealloc_pd(struct ibv_pd *pd) { free(pd); return 0; }

/* ---- memory regions ----------------------------------------------------- */

static struct ibv_mr *add_mr(struct ibv_pd *pd, uint64_t iova, size_t len, int access)
{
    if ((access & IBV_ACCESS_REMOTE_WRITE) && !(access & IBV_ACCESS_LOCAL_WRITE)) {
        errno = EINVAL; /* the verbs rule */
        return NULL;
    }
    pthread_mutex_lock(&mu);
    int slot = -1;
    for (int i = 0; i < MRS_MAX && slot < 0; i++)
        if (!mrs[i])
            slot = i;
    if (slot < 0) {
        pthread_mutex_unlock(&mu);
        errno = ENOMEM;
        return NULL;
    }
    struct fake_mr *m = calloc(1, sizeof *m);
    next_key = next_key * 2654435761u + 0x9e37;
    m->mr.context = pd->context;
    m->mr.pd = pd;
    m->mr.addr = (void *)(uintptr_t)iova;
    m->mr.length = len;
    m->mr.lkey = next_key;
    m->mr.rkey = next_key ^ 0x5a5a0000u;
    m->access = access;
    m->iova = iova;
    m->live = 1;
    mrs[slot] = m;
    pthread_mutex_unlock(&mu);
    return &m->mr;
}

struct ibv_mr *ibv_reg_mr(struct ibv_pd *pd, void *addr, size_t len, int access)
{
    return add_mr(pd, (uint64_t)(uintptr_t)addr, len, access);
}

struct ibv_mr *ibv_reg_dmabuf_mr(struct ibv_pd *pd, uint64_t offset, size_t len, uint64_t iova,
                                 int fd, int access)
{
    (void)offset;
    if (fcntl(fd, F_GETFD) < 0) {
        violate("ibv_reg_dmabuf_mr: fd %d is not open", fd);
        errno = EBADF;
        return NULL;
    }
    return add_mr(pd, iova, len, access);
}

int ibv_dereg_mr(struct ibv_mr *mr)
{
    pthread_mutex_lock(&mu);
    for (int i = 0; i < MRS_MAX; i++)
        if (mrs[i] && &mrs[i]->mr == mr) {
            free(mrs[i]);
            mrs[i] = NULL;
        }
    pthread_mutex_unlock(&mu);
    return 0;
}

static struct fake_mr *mr_by(uint32_t key, int remote, struct ibv_pd *pd)
{
    for (int i = 0; i < MRS_MAX; i++)
        if (mrs[i] && (remote ? mrs[i]->mr.rkey : mrs[i]->mr.lkey) == key && mrs[i]->mr.pd == pd)
            return mrs[i];
    return NULL;
}

/* ---- CQ and QP ---------------------------------------------------------- */

struct ibv_cq *ibv_create_cq(struct ibv_context *c, int cqe, void *ctx,
                             struct ibv_comp_channel *ch, int vec)
{
    (void)ctx;
    (void)ch;
    (void)vec;
    if (cqe < 1 || cqe > cfg.max_cqe) {
        violate("ibv_create_cq: %d entries beyond max_cqe %d", cqe, cfg.max_cqe);
        errno = EINVAL;
        return NULL;
    }
    struct fake_cq *q = calloc(1, sizeof *q);
    q->cq.context = c;
    q->cq.cqe = cqe;
    q->cap = cqe;
    q->ring = calloc((size_t)cqe, sizeof *q->ring);
    return &q->cq;
}

int ibv_destroy_cq(struct ibv_cq *cq)
{
    struct fake_cq *q = (struct fake_cq *)cq;
    free(q->ring);
    free(q);
    return 0;
}

struct ibv_qp *ibv_create_qp(struct ibv_pd *pd, struct ibv_qp_init_attr *ia)
{
    if (ia->qp_type != IBV_QPT_RC || (int)ia->cap.max_send_wr > cfg.max_qp_wr ||
        (int)ia->cap.max_send_sge > cfg.max_sge || ia->send_cq == NULL) {
        violate("ibv_create_qp: not RC or caps beyond the device's");
        errno = EINVAL;
        return NULL;
    }
    if (ia->sq_sig_all)
        violate("ibv_create_qp: sq_sig_all set (kvx signals selectively)");
    pthread_mutex_lock(&mu);
    int slot = -1;
    for (int i = 0; i < QPS_MAX && slot < 0; i++)
        if (!qps[i])
            slot = i;
    if (slot < 0) {
        pthread_mutex_unlock(&mu);
        errno = ENOMEM;
        return NULL;
    }
    static uint32_t next_qpn = 0x100;
    struct fake_qp *q = calloc(1, sizeof *q);
    q->qp.context = pd->context;
    q->qp.pd = pd;
    q->qp.send_cq = ia->send_cq;
    q->qp.recv_cq = ia->recv_cq;
    q->qp.qp_num = next_qpn++ & 0xffffff;
    q->qp.qp_type = IBV_QPT_RC;
    q->qp.state = IBV_QPS_RESET;
    q->state = IBV_QPS_RESET;
    q->max_wr = ia->cap.max_send_wr;
    q->max_sge = ia->cap.max_send_sge;
    snprintf(q->log, sizeof q->log, "RESET");
    qps[slot] = q;
    stat_qps_created++;
    pthread_mutex_unlock(&mu);
    return &q->qp;
}

int ibv_modify_qp(struct ibv_qp *qp, struct ibv_qp_attr *a, int mask)
{
    struct fake_qp *q = (struct fake_qp *)qp;
    pthread_mutex_lock(&mu);
    int next = (mask & IBV_QP_STATE) ? (int)a->qp_state : q->state;
    const char *bad = (mask & IBV_QP_STATE) ? fake_check_transition(q->state, next, mask)
                                            : "IBV_QP_STATE missing";
    if (!bad && next == IBV_QPS_INIT) {
        if (a->port_num != 1)
            bad = "INIT: port_num is not 1";
        q->access = a->qp_access_flags;
    } else if (!bad && next == IBV_QPS_RTR) {
        if (a->path_mtu > IBV_MTU_1024 || a->path_mtu < IBV_MTU_256)
            bad = "RTR: path_mtu beyond the port's active MTU";
        else if (a->max_dest_rd_atomic > cfg.rd_atom)
            bad = "RTR: max_dest_rd_atomic beyond the device's max_qp_rd_atom";
        else if (!a->ah_attr.is_global)
            bad = "RTR: RoCE needs a GRH (is_global)";
        else if (a->ah_attr.grh.hop_limit == 0 || a->ah_attr.grh.sgid_index >= GIDS ||
                 a->ah_attr.port_num != 1)
            bad = "RTR: bad GRH hop_limit, sgid_index or port";
        else if (memcmp(a->ah_attr.grh.dgid.raw, gids[a->ah_attr.grh.sgid_index], 16) != 0)
            bad = "RTR: dgid is not the peer's GID";
        else if (!qp_by_num(a->dest_qp_num))
            bad = "RTR: dest_qp_num names no QP";
        q->mtu = a->path_mtu;
        q->dest_rd_atom = a->max_dest_rd_atomic;
        q->dest_qpn = a->dest_qp_num;
        q->rq_psn = a->rq_psn;
        q->global = a->ah_attr.is_global;
        memcpy(q->dgid, a->ah_attr.grh.dgid.raw, 16);
    } else if (!bad && next == IBV_QPS_RTS) {
        if (a->max_rd_atomic > cfg.rd_atom)
            bad = "RTS: max_rd_atomic beyond the device's max_qp_rd_atom";
        q->rd_atom = a->max_rd_atomic;
        q->sq_psn = a->sq_psn;
    }
    if (bad) {
        violate("QP %u %s->%s mask 0x%x: %s", qp->qp_num, state_name(q->state), state_name(next),
                mask, bad);
        pthread_mutex_unlock(&mu);
        return EINVAL;
    }
    q->state = next;
    qp->state = (enum ibv_qp_state)next;
    size_t used = strlen(q->log);
    snprintf(q->log + used, sizeof q->log - used, ">%s", state_name(next));
    pthread_mutex_unlock(&mu);
    return 0;
}

int ibv_destroy_qp(struct ibv_qp *qp)
{
    struct fake_qp *q = (struct fake_qp *)qp;
    pthread_mutex_lock(&mu);
    /* Like mlx5: the QP's completions leave the CQ with it. */
    struct fake_cq *cq = (struct fake_cq *)qp->send_cq;
    struct cqe *keep = calloc((size_t)cq->cap, sizeof *keep);
    int n = 0;
    for (int i = 0; i < cq->count; i++) {
        struct cqe *e = &cq->ring[(cq->head + i) % cq->cap];
        if (e->qp != q)
            keep[n++] = *e;
    }
    memcpy(cq->ring, keep, (size_t)n * sizeof *keep);
    free(keep);
    cq->head = 0;
    cq->count = n;
    for (int i = 0; i < QPS_MAX; i++)
        if (qps[i] == q)
            qps[i] = NULL;
    stat_qps_destroyed++;
    pthread_mutex_unlock(&mu);
    free(q);
    return 0;
}

const char *ibv_wc_status_str(enum ibv_wc_status s)
{
    switch (s) {
    case IBV_WC_SUCCESS: return "success";
    case IBV_WC_LOC_PROT_ERR: return "local protection error";
    case IBV_WC_WR_FLUSH_ERR: return "Work Request Flushed Error";
    case IBV_WC_REM_ACCESS_ERR: return "remote access error";
    case IBV_WC_RETRY_EXC_ERR: return "transport retry counter exceeded";
    default: return "unknown";
    }
}

/* ---- the data path ------------------------------------------------------ */

static void push_cqe(struct fake_qp *q, struct ibv_send_wr *wr, enum ibv_wc_status st,
                     uint32_t retire, uint64_t delay_ns)
{
    struct fake_cq *cq = (struct fake_cq *)q->qp.send_cq;
    if (cq->count == cq->cap) {
        violate("CQ overrun: %d entries and no room (in flight beyond the CQ)", cq->cap);
        return;
    }
    struct cqe *e = &cq->ring[(cq->head + cq->count++) % cq->cap];
    memset(e, 0, sizeof *e);
    e->wc.wr_id = wr->wr_id;
    e->wc.status = st;
    e->wc.opcode = wr->opcode == IBV_WR_RDMA_READ ? IBV_WC_RDMA_READ : IBV_WC_RDMA_WRITE;
    e->wc.qp_num = q->qp.qp_num;
    e->qp = q;
    e->retire = retire;
    e->ready_ns = now_ns() + delay_ns;
}

static enum ibv_wc_status execute(struct fake_qp *q, struct ibv_send_wr *wr)
{
    struct fake_qp *r = qp_by_num(q->dest_qpn);
    if (!r || r->state < IBV_QPS_RTR || r->state == IBV_QPS_ERR || r->dest_qpn != q->qp.qp_num)
        return IBV_WC_RETRY_EXC_ERR; /* nobody answers */
    if (r->rq_psn != q->sq_psn)
        violate("QP %u: sq_psn 0x%x but the peer expects 0x%x", q->qp.qp_num, q->sq_psn,
                r->rq_psn);
    int is_read = wr->opcode == IBV_WR_RDMA_READ;
    uint64_t total = 0;
    for (int i = 0; i < wr->num_sge; i++) {
        struct ibv_sge *s = &wr->sg_list[i];
        struct fake_mr *m = mr_by(s->lkey, 0, q->qp.pd);
        if (!m || s->addr < m->iova || s->addr + s->length > m->iova + m->mr.length ||
            (is_read && !(m->access & IBV_ACCESS_LOCAL_WRITE)))
            return IBV_WC_LOC_PROT_ERR;
        total += s->length;
    }
    uint64_t raddr = wr->wr.rdma.remote_addr;
    struct fake_mr *rm = mr_by(wr->wr.rdma.rkey, 1, r->qp.pd);
    int need = is_read ? IBV_ACCESS_REMOTE_READ : IBV_ACCESS_REMOTE_WRITE;
    if (!rm || raddr < rm->iova || raddr + total > rm->iova + rm->mr.length ||
        !(rm->access & need) || !(r->access & need))
        return IBV_WC_REM_ACCESS_ERR;
    if (total > cfg.max_msg)
        violate("QP %u: a %llu-byte WR beyond max_msg_sz", q->qp.qp_num,
                (unsigned long long)total);
    for (int i = 0; i < wr->num_sge; i++) {
        struct ibv_sge *s = &wr->sg_list[i];
        void *local = (void *)(uintptr_t)s->addr, *remote = (void *)(uintptr_t)raddr;
        if (is_read)
            memcpy(local, remote, s->length);
        else
            memcpy(remote, local, s->length);
        raddr += s->length;
    }
    q->moved += total;
    return IBV_WC_SUCCESS;
}

static int post_send(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad)
{
    struct fake_qp *q = (struct fake_qp *)qp;
    pthread_mutex_lock(&mu);
    uint32_t n = 0;
    for (struct ibv_send_wr *w = wr; w; w = w->next) {
        n++;
        if (w->num_sge < 1 || (uint32_t)w->num_sge > q->max_sge ||
            (w->opcode != IBV_WR_RDMA_READ && w->opcode != IBV_WR_RDMA_WRITE)) {
            violate("QP %u: WR with %d SGEs (max %u) or opcode %d", qp->qp_num, w->num_sge,
                    q->max_sge, w->opcode);
            *bad = w;
            pthread_mutex_unlock(&mu);
            return EINVAL;
        }
        if ((uint64_t)w->num_sge > stat_max_sge)
            stat_max_sge = (uint64_t)w->num_sge;
    }
    if (q->state != IBV_QPS_RTS && q->state != IBV_QPS_ERR) {
        violate("QP %u: post_send in state %s", qp->qp_num, state_name(q->state));
        *bad = wr;
        pthread_mutex_unlock(&mu);
        return EINVAL;
    }
    if (q->sq_used + n > q->max_wr) {
        violate("QP %u: send queue overflow (%u in use + %u > %u)", qp->qp_num, q->sq_used, n,
                q->max_wr);
        *bad = wr;
        pthread_mutex_unlock(&mu);
        return ENOMEM;
    }
    q->sq_used += n;
    if (q->sq_used > stat_max_sq)
        stat_max_sq = q->sq_used;
    stat_posts++;
    stat_wrs += n;
    if (n > stat_max_chain)
        stat_max_chain = n;
    int dead = dead_qpn == -1 || (dead_qpn && (uint32_t)dead_qpn == q->dest_qpn);
    for (struct ibv_send_wr *w = wr; w; w = w->next) {
        int signalled = (w->send_flags & IBV_SEND_SIGNALED) != 0;
        stat_signalled += (unsigned long long)signalled;
        q->unsignalled++;
        if (q->state == IBV_QPS_ERR) {
            push_cqe(q, w, IBV_WC_WR_FLUSH_ERR, 1, 0);
            continue;
        }
        enum ibv_wc_status st = dead ? IBV_WC_RETRY_EXC_ERR : execute(q, w);
        if (st != IBV_WC_SUCCESS) {
            push_cqe(q, w, st, q->unsignalled, dead ? (uint64_t)dead_delay_ms * 1000000u : 0);
            q->unsignalled = 0;
            q->state = IBV_QPS_ERR;
            qp->state = IBV_QPS_ERR;
        } else if (signalled) {
            push_cqe(q, w, st, q->unsignalled, 0);
            q->unsignalled = 0;
        }
    }
    pthread_mutex_unlock(&mu);
    return 0;
}

static int poll_cq(struct ibv_cq *cq, int n, struct ibv_wc *wc)
{
    struct fake_cq *q = (struct fake_cq *)cq;
    pthread_mutex_lock(&mu);
    int got = 0;
    uint64_t now = now_ns();
    while (got < n && q->count > 0) {
        struct cqe *e = &q->ring[q->head];
        if (e->ready_ns > now)
            break;
        wc[got++] = e->wc;
        e->qp->sq_used -= e->retire <= e->qp->sq_used ? e->retire : e->qp->sq_used;
        q->head = (q->head + 1) % q->cap;
        q->count--;
    }
    pthread_mutex_unlock(&mu);
    return got;
}

/* ---- libcuda, as kvx._verbs uses it for dma-buf ------------------------- */

int cuInit(unsigned flags) { (void)flags; return 0; }
int cuDeviceGet(int *d, int ordinal) { *d = ordinal; return 0; }
int cuDevicePrimaryCtxRetain(void **ctx, int d) { *ctx = (void *)(intptr_t)(d + 1); return 0; }
int cuDevicePrimaryCtxRelease_v2(int d) { (void)d; return 0; }
int cuCtxPushCurrent_v2(void *ctx) { (void)ctx; return 0; }
int cuCtxPopCurrent_v2(void **ctx) { *ctx = NULL; return 0; }
int cuMemGetAddressRange_v2(uint64_t *base, size_t *size, uint64_t addr)
{
    *base = addr & ~(uint64_t)4095;
    *size = (size_t)1 << 40;
    return 0;
}
int cuMemGetHandleForAddressRange(void *handle, uint64_t addr, size_t size, int type,
                                  unsigned long long flags)
{
    (void)addr;
    (void)size;
    (void)flags;
    if (cuda_fail || type != 1)
        return 801; /* CUDA_ERROR_NOT_SUPPORTED */
    *(int *)handle = open("/dev/null", O_RDONLY | O_CLOEXEC);
    return 0;
}
