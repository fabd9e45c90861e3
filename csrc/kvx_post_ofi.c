/*
 * The "ofi" provider of kvx_post.h: libfabric, FI_EP_RDM with FI_RMA
 * (tcp;ofi_rxm on any host, efa, verbs;ofi_rxm).
 *
 * Memory-registration modes: kvx asks for FI_MR_LOCAL, FI_MR_VIRT_ADDR,
 * FI_MR_ALLOCATED and FI_MR_ENDPOINT, and handles whichever the provider
 * grants. It first asks without FI_MR_PROV_KEY, so that keys are kvx's own:
 * each drawn from getrandom (a CSPRNG), because with offset addressing the
 * key is all a process that reaches the libfabric port would need to guess.
 * Providers that must choose keys themselves (efa, verbs) get FI_MR_PROV_KEY
 * on the second try, and their keys are used as they come.
 *
 * GPU memory (device >= 0) is registered with fi_mr_regattr, iface
 * FI_HMEM_CUDA and the CUDA device id, on an endpoint opened with FI_HMEM.
 * No GPU or HMEM-capable provider was available where this was written:
 * that path compiles but is untested.
 */
#define _GNU_SOURCE
#include "kvx_post.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include <sys/socket.h>
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

#define OFI_VERSION FI_VERSION(1, 10)

struct ofi_ep {
    struct fi_info *info;
    struct fid_fabric *fabric;
    struct fid_domain *domain;
    struct fid_av *av;
    struct fid_cq *cq;
    struct fid_ep *ep;
    uint64_t key_mask;
    int prov_key;
    int mr_endpoint;
    int hmem;
};

static void say(char *err, const char *what, int rc)
{
    snprintf(err, KVX_ERR_LEN, "%s: %s (%d)", what, fi_strerror(rc < 0 ? -rc : rc), rc);
}

static struct fi_info *hints_for(const struct kvx_open_args *args, uint64_t mr_mode)
{
    struct fi_info *h = fi_allocinfo();
    if (h == NULL)
        return NULL;
    h->caps = FI_RMA | FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE;
    if (args->hmem)
        h->caps |= FI_HMEM;
    h->ep_attr->type = FI_EP_RDM;
    /* Every context kvx passes starts with KVX_CTX_SCRATCH bytes for the provider. */
    h->mode = FI_CONTEXT | FI_CONTEXT2;
    h->domain_attr->mr_mode = (int)mr_mode;
    h->domain_attr->threading = FI_THREAD_SAFE;
    if (args->provider != NULL)
        h->fabric_attr->prov_name = strdup(args->provider);
    if (args->domain != NULL)
        h->domain_attr->name = strdup(args->domain);
    return h;
}

/* libfabric loads its providers once, on first use, and some of their libraries
 * (PSM2's, say) install signal handlers of their own: a SIGTERM then killed the
 * process with status 1 instead of running the application's handler (a daemon's
 * drain). Around the calls that may load them, every signal's disposition is put
 * back as it was. */
static pthread_mutex_t signals_lock = PTHREAD_MUTEX_INITIALIZER;
static struct sigaction signals_saved[NSIG];

static void keep_signals(void)
{
    pthread_mutex_lock(&signals_lock);
    for (int sig = 1; sig < NSIG; sig++)
        if (sigaction(sig, NULL, &signals_saved[sig]) != 0)
            signals_saved[sig].sa_handler = SIG_ERR; /* not a signal this process may handle */
}

static void put_signals_back(void)
{
    for (int sig = 1; sig < NSIG; sig++) {
        if (sig == SIGKILL || sig == SIGSTOP || signals_saved[sig].sa_handler == SIG_ERR)
            continue;
        struct sigaction now;
        if (sigaction(sig, NULL, &now) == 0 && now.sa_handler != signals_saved[sig].sa_handler)
            sigaction(sig, &signals_saved[sig], NULL);
    }
    pthread_mutex_unlock(&signals_lock);
}

static int get_info_unguarded(const struct kvx_open_args *args, struct fi_info **out, char *err)
{
    uint64_t base = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_ENDPOINT;
    if (args->hmem)
        base |= FI_MR_HMEM;
    uint64_t tries[2] = {base, base | FI_MR_PROV_KEY};
    int rc = -FI_ENODATA;
    for (int i = 0; i < 2; i++) {
        struct fi_info *hints = hints_for(args, tries[i]);
        if (hints == NULL) {
            snprintf(err, KVX_ERR_LEN, "out of memory");
            return -FI_ENOMEM;
        }
        rc = fi_getinfo(OFI_VERSION, args->node, NULL, args->node != NULL ? FI_SOURCE : 0, hints, out);
        fi_freeinfo(hints);
        if (rc == 0)
            return 0;
    }
    snprintf(err, KVX_ERR_LEN,
             "no libfabric provider %s%s%s with one-sided RMA (FI_EP_RDM, FI_RMA)%s%s: %s "
             "(list them with: fi_info -c FI_RMA -t FI_EP_RDM)",
             args->provider ? "'" : "", args->provider ? args->provider : "", args->provider ? "'" : "",
             args->node ? " on " : "", args->node ? args->node : "", fi_strerror(-rc));
    return rc;
}

static int get_info(const struct kvx_open_args *args, struct fi_info **out, char *err)
{
    keep_signals();
    int rc = get_info_unguarded(args, out, err);
    put_signals_back();
    return rc;
}

/* Providers whose MRs live in a NIC: closing one invalidates it there, so a remote
 * access already in flight fails. Software providers (tcp, sockets, udp, shm) keep
 * moving bytes of a request they have started after fi_close(mr). */
static int hardware_core(const char *prov_name)
{
    static const char *const hardware[] = {"efa", "verbs", "psm2", "psm3", "opx", "cxi"};
    if (prov_name == NULL)
        return 0;
    size_t len = strcspn(prov_name, ";");
    for (size_t i = 0; i < sizeof(hardware) / sizeof(hardware[0]); i++)
        if (strlen(hardware[i]) == len && strncmp(prov_name, hardware[i], len) == 0)
            return 1;
    return 0;
}

static void ofi_close(void *impl)
{
    struct ofi_ep *o = impl;
    if (o->ep)
        fi_close(&o->ep->fid);
    if (o->av)
        fi_close(&o->av->fid);
    if (o->cq)
        fi_close(&o->cq->fid);
    if (o->domain)
        fi_close(&o->domain->fid);
    if (o->fabric)
        fi_close(&o->fabric->fid);
    if (o->info)
        fi_freeinfo(o->info);
    free(o);
}

/* Close the endpoint first: a transfer a peer started must not meet its memory
 * registration closed under it (closing the registrations while the connections
 * still carried one crashed libfabric 1.17's tcp provider in fi_close(ep)). */
static void ofi_quiesce(void *impl)
{
    struct ofi_ep *o = impl;
    if (o->ep) {
        fi_close(&o->ep->fid);
        o->ep = NULL;
    }
}

static int ofi_open(const struct kvx_open_args *args, void **impl, struct kvx_ep_info *info, char *err)
{
    struct ofi_ep *o = calloc(1, sizeof(*o));
    if (o == NULL) {
        snprintf(err, KVX_ERR_LEN, "out of memory");
        return -FI_ENOMEM;
    }
    int rc = get_info(args, &o->info, err);
    if (rc != 0)
        goto fail;
    struct fi_info *fi = o->info;
    rc = fi_fabric(fi->fabric_attr, &o->fabric, NULL);
    if (rc) {
        say(err, "fi_fabric", rc);
        goto fail;
    }
    rc = fi_domain(o->fabric, fi, &o->domain, NULL);
    if (rc) {
        say(err, "fi_domain", rc);
        goto fail;
    }
    struct fi_av_attr av_attr = {.type = FI_AV_TABLE};
    rc = fi_av_open(o->domain, &av_attr, &o->av, NULL);
    if (rc) {
        av_attr.type = FI_AV_UNSPEC;
        rc = fi_av_open(o->domain, &av_attr, &o->av, NULL);
    }
    if (rc) {
        say(err, "fi_av_open", rc);
        goto fail;
    }
    struct fi_cq_attr cq_attr = {
        .format = FI_CQ_FORMAT_CONTEXT,
        .wait_obj = FI_WAIT_UNSPEC,
        .size = fi->tx_attr->size * 2 + 64,
    };
    rc = fi_cq_open(o->domain, &cq_attr, &o->cq, NULL);
    if (rc) {
        say(err, "fi_cq_open", rc);
        goto fail;
    }
    rc = fi_endpoint(o->domain, fi, &o->ep, NULL);
    if (rc) {
        say(err, "fi_endpoint", rc);
        goto fail;
    }
    rc = fi_ep_bind(o->ep, &o->av->fid, 0);
    if (rc == 0)
        rc = fi_ep_bind(o->ep, &o->cq->fid, FI_TRANSMIT | FI_RECV);
    if (rc) {
        say(err, "fi_ep_bind", rc);
        goto fail;
    }
    rc = fi_enable(o->ep);
    if (rc) {
        say(err, "fi_enable", rc);
        goto fail;
    }
    size_t len = KVX_ADDR_MAX;
    rc = fi_getname(&o->ep->fid, info->address, &len);
    if (rc) {
        say(err, "fi_getname", rc);
        goto fail;
    }
    info->address_len = len;
    uint64_t mode = (uint64_t)fi->domain_attr->mr_mode;
    /* FI_MR_BASIC (libfabric < 1.5 spelling) means local + virtual + provider keys. */
    if (mode == FI_MR_BASIC)
        mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_PROV_KEY | FI_MR_ALLOCATED;
    info->mr_mode = mode;
    info->virt_addr = (mode & FI_MR_VIRT_ADDR) != 0;
    info->prov_key = (mode & FI_MR_PROV_KEY) != 0;
    o->prov_key = info->prov_key;
    o->mr_endpoint = (mode & FI_MR_ENDPOINT) != 0;
    o->hmem = args->hmem;
    info->key_size = fi->domain_attr->mr_key_size ? fi->domain_attr->mr_key_size : 8;
    o->key_mask = info->key_size >= 8 ? UINT64_MAX : (((uint64_t)1 << (8 * info->key_size)) - 1);
    info->max_sge = fi->tx_attr->iov_limit ? fi->tx_attr->iov_limit : 1;
    info->max_msg = fi->ep_attr->max_msg_size ? fi->ep_attr->max_msg_size : ((size_t)1 << 30);
    info->max_outstanding = fi->tx_attr->size ? fi->tx_attr->size : 64;
    info->needs_progress = 1;
    info->mr_close_final = info->prov_key && hardware_core(fi->fabric_attr->prov_name);
    snprintf(info->provider, KVX_NAME_LEN, "%s", fi->fabric_attr->prov_name);
    snprintf(info->fabric, KVX_NAME_LEN, "%s", fi->fabric_attr->name);
    snprintf(info->domain, KVX_NAME_LEN, "%s", fi->domain_attr->name);
    *impl = o;
    return 0;
fail:
    ofi_close(o);
    return rc < 0 ? rc : -rc;
}

static int ofi_reg(void *impl, uint64_t addr, uint64_t len, int access, int device, int keep_key, uint64_t *key,
                   void **desc, void **handle, char *err)
{
    struct ofi_ep *o = impl;
    if (keep_key && o->prov_key) {
        snprintf(err, KVX_ERR_LEN, "this provider picks MR keys itself: a key cannot be kept");
        return -FI_EINVAL;
    }
    uint64_t acc = FI_READ | FI_WRITE;
    if (access & KVX_ACCESS_REMOTE_READ)
        acc |= FI_REMOTE_READ;
    if (access & KVX_ACCESS_REMOTE_WRITE)
        acc |= FI_REMOTE_WRITE;
    struct iovec iov = {.iov_base = (void *)(uintptr_t)addr, .iov_len = (size_t)len};
    struct fi_mr_attr attr = {
        .mr_iov = &iov,
        .iov_count = 1,
        .access = acc,
        .iface = FI_HMEM_SYSTEM,
    };
    if (device >= 0) {
        if (!o->hmem) {
            snprintf(err, KVX_ERR_LEN,
                     "GPU memory needs an endpoint opened with hmem=True (libfabric FI_HMEM)");
            return -FI_EINVAL;
        }
        attr.iface = FI_HMEM_CUDA;
        attr.device.cuda = device;
    }
    struct fid_mr *mr = NULL;
    int rc = -FI_ENOKEY;
    /* A random key can collide with one already in use: draw again, a few times. */
    for (int attempt = 0; attempt < (keep_key ? 1 : 4) && rc == -FI_ENOKEY; attempt++) {
        uint64_t want = keep_key ? *key : 0;
        if (!o->prov_key && !keep_key) {
            if (getrandom(&want, sizeof(want), 0) != sizeof(want)) {
                snprintf(err, KVX_ERR_LEN, "getrandom failed: %s", strerror(errno));
                return -FI_EIO;
            }
            want &= o->key_mask;
        }
        attr.requested_key = want;
        rc = fi_mr_regattr(o->domain, &attr, 0, &mr);
    }
    if (rc) {
        say(err, "fi_mr_regattr", rc);
        return rc;
    }
    if (o->mr_endpoint) {
        rc = fi_mr_bind(mr, &o->ep->fid, 0);
        if (rc == 0)
            rc = fi_mr_enable(mr);
        if (rc) {
            say(err, "fi_mr_bind/fi_mr_enable", rc);
            fi_close(&mr->fid);
            return rc;
        }
    }
    *key = fi_mr_key(mr);
    if (*key == FI_KEY_NOTAVAIL) {
        snprintf(err, KVX_ERR_LEN, "the provider's MR keys are larger than 64 bits (not supported)");
        fi_close(&mr->fid);
        return -FI_ENOSYS;
    }
    *desc = fi_mr_desc(mr);
    *handle = mr;
    return 0;
}

static int ofi_dereg(void *impl, void *handle, char *err)
{
    (void)impl;
    int rc = fi_close(&((struct fid_mr *)handle)->fid);
    if (rc)
        say(err, "fi_close(mr)", rc);
    return rc;
}

static int ofi_prepare(void *impl, uint64_t *half, unsigned char *info, size_t *info_len, char *err)
{
    struct ofi_ep *o = impl;
    size_t len = KVX_ADDR_MAX;
    int rc = fi_getname(&o->ep->fid, info, &len);
    if (rc) {
        say(err, "fi_getname", rc);
        return rc;
    }
    *info_len = len;
    *half = 0;
    return 0;
}

static int ofi_complete(void *impl, uint64_t half, const unsigned char *info, size_t info_len, uint64_t *peer,
                        char *err)
{
    struct ofi_ep *o = impl;
    (void)half;
    unsigned char mine[KVX_ADDR_MAX];
    size_t len = sizeof(mine);
    int rc = fi_getname(&o->ep->fid, mine, &len);
    if (rc) {
        say(err, "fi_getname", rc);
        return rc;
    }
    if (info_len != len) {
        snprintf(err, KVX_ERR_LEN, "peer info is %zu bytes, a %s address is %zu: not from a %s endpoint",
                 info_len, o->info->fabric_attr->prov_name, len, o->info->fabric_attr->prov_name);
        return -FI_EINVAL;
    }
    /* Socket addresses: the family must be this endpoint's own. tcp;ofi_rxm
     * takes an address of an unknown family into its AV and then refuses
     * every later insert, so one bad peer would shut rdma off for all. */
    uint32_t format = o->info->addr_format;
    if (format == FI_SOCKADDR || format == FI_SOCKADDR_IN || format == FI_SOCKADDR_IN6) {
        sa_family_t theirs, ours;
        memcpy(&theirs, info, sizeof(theirs));
        memcpy(&ours, mine, sizeof(ours));
        if (theirs != ours || (ours != AF_INET && ours != AF_INET6)) {
            snprintf(err, KVX_ERR_LEN, "peer info is a socket address of family %u, this endpoint's is %u",
                     (unsigned)theirs, (unsigned)ours);
            return -FI_EINVAL;
        }
    }
    fi_addr_t addr = FI_ADDR_UNSPEC;
    rc = fi_av_insert(o->av, info, 1, &addr, 0, NULL);
    if (rc != 1) {
        say(err, "fi_av_insert", rc < 0 ? rc : -FI_EINVAL);
        return rc < 0 ? rc : -FI_EINVAL;
    }
    *peer = (uint64_t)addr;
    return 0;
}

static int ofi_disconnect(void *impl, uint64_t peer, char *err)
{
    struct ofi_ep *o = impl;
    fi_addr_t addr = (fi_addr_t)peer;
    int rc = fi_av_remove(o->av, &addr, 1, 0);
    if (rc)
        say(err, "fi_av_remove", rc);
    return rc;
}

static int ofi_post(void *impl, const struct kvx_wr *wr)
{
    struct ofi_ep *o = impl;
    struct fi_rma_iov rma = {.addr = wr->remote_addr, .key = wr->remote_key};
    for (size_t i = 0; i < wr->local_count; i++)
        rma.len += wr->local[i].iov_len;
    struct fi_msg_rma msg = {
        .msg_iov = wr->local,
        .desc = wr->local_desc,
        .iov_count = wr->local_count,
        .addr = (fi_addr_t)wr->peer,
        .rma_iov = &rma,
        .rma_iov_count = 1,
        .context = wr->context,
    };
    ssize_t rc;
    if (wr->op == KVX_READ)
        rc = fi_readmsg(o->ep, &msg, FI_COMPLETION);
    else
        /* Delivery complete: the completion means the bytes are in the target's memory (kvx
         * notifies the peer after it), and a refused write (bad key, read-only region, out of
         * bounds) comes back as an error completion instead of a silent local success. */
        rc = fi_writemsg(o->ep, &msg, FI_COMPLETION | FI_DELIVERY_COMPLETE);
    if (rc == -FI_EAGAIN)
        return -KVX_EAGAIN;
    return (int)rc;
}

static const char *ofi_status_name(int status)
{
    switch (status) {
    case 0: return "OK";
    case FI_EPERM: return "FI_EPERM";
    case FI_ENOENT: return "FI_ENOENT";
    case FI_EIO: return "FI_EIO";
    case FI_E2BIG: return "FI_E2BIG";
    case FI_EAGAIN: return "FI_EAGAIN";
    case FI_ENOMEM: return "FI_ENOMEM";
    case FI_EACCES: return "FI_EACCES";
    case FI_EFAULT: return "FI_EFAULT";
    case FI_EBUSY: return "FI_EBUSY";
    case FI_EINVAL: return "FI_EINVAL";
    case FI_ENOSPC: return "FI_ENOSPC";
    case FI_ENOSYS: return "FI_ENOSYS";
    case FI_EMSGSIZE: return "FI_EMSGSIZE";
    case FI_ENOPROTOOPT: return "FI_ENOPROTOOPT";
    case FI_EOPNOTSUPP: return "FI_EOPNOTSUPP";
    case FI_EADDRINUSE: return "FI_EADDRINUSE";
    case FI_EADDRNOTAVAIL: return "FI_EADDRNOTAVAIL";
    case FI_ENETDOWN: return "FI_ENETDOWN";
    case FI_ENETUNREACH: return "FI_ENETUNREACH";
    case FI_ECONNABORTED: return "FI_ECONNABORTED";
    case FI_ECONNRESET: return "FI_ECONNRESET";
    case FI_ENOBUFS: return "FI_ENOBUFS";
    case FI_EISCONN: return "FI_EISCONN";
    case FI_ENOTCONN: return "FI_ENOTCONN";
    case FI_ESHUTDOWN: return "FI_ESHUTDOWN";
    case FI_ETIMEDOUT: return "FI_ETIMEDOUT";
    case FI_ECONNREFUSED: return "FI_ECONNREFUSED";
    case FI_EHOSTDOWN: return "FI_EHOSTDOWN";
    case FI_EHOSTUNREACH: return "FI_EHOSTUNREACH";
    case FI_EALREADY: return "FI_EALREADY";
    case FI_EINPROGRESS: return "FI_EINPROGRESS";
    case FI_EREMOTEIO: return "FI_EREMOTEIO";
    case FI_ECANCELED: return "FI_ECANCELED";
    case FI_EKEYREJECTED: return "FI_EKEYREJECTED";
    case FI_EOTHER: return "FI_EOTHER";
    case FI_ETOOSMALL: return "FI_ETOOSMALL";
    case FI_EOPBADSTATE: return "FI_EOPBADSTATE";
    case FI_EAVAIL: return "FI_EAVAIL";
    case FI_EBADFLAGS: return "FI_EBADFLAGS";
    case FI_ENOEQ: return "FI_ENOEQ";
    case FI_EDOMAIN: return "FI_EDOMAIN";
    case FI_ENOCQ: return "FI_ENOCQ";
    case FI_ECRC: return "FI_ECRC";
    case FI_ETRUNC: return "FI_ETRUNC";
    case FI_ENOKEY: return "FI_ENOKEY";
    case FI_ENOAV: return "FI_ENOAV";
    case FI_EOVERRUN: return "FI_EOVERRUN";
    default: return "FI_E_UNKNOWN";
    }
}

static int ofi_poll(void *impl, struct kvx_cqe *out, int max, int timeout_ms)
{
    struct ofi_ep *o = impl;
    struct fi_cq_entry entries[64];
    if (max > 64)
        max = 64;
    ssize_t n = timeout_ms > 0 ? fi_cq_sread(o->cq, entries, (size_t)max, NULL, timeout_ms)
                               : fi_cq_read(o->cq, entries, (size_t)max);
    if (n > 0) {
        for (ssize_t i = 0; i < n; i++) {
            out[i].context = entries[i].op_context;
            out[i].status = 0;
        }
        return (int)n;
    }
    if (n == -FI_EAGAIN || n == -FI_ETIMEDOUT || n == -FI_EINTR)
        return 0;
    if (n != -FI_EAVAIL)
        return (int)n;
    struct fi_cq_err_entry e;
    memset(&e, 0, sizeof(e));
    ssize_t r = fi_cq_readerr(o->cq, &e, 0);
    if (r == -FI_EAGAIN)
        return 0;
    if (r < 0)
        return (int)r;
    int status = e.err ? e.err : FI_EOTHER;
    out[0].context = e.op_context;
    out[0].status = status;
    out[0].status_name = ofi_status_name(status);
    const char *detail = fi_cq_strerror(o->cq, e.prov_errno, e.err_data, NULL, 0);
    snprintf(out[0].text, KVX_ERR_LEN, "%s (provider: %s)", fi_strerror(status), detail ? detail : "?");
    return 1;
}

static void ofi_cancel(void *impl, void *context)
{
    struct ofi_ep *o = impl;
    fi_cancel(&o->ep->fid, context);
}

const struct kvx_provider kvx_provider_ofi = {
    .name = "ofi",
    .open = ofi_open,
    .close = ofi_close,
    .quiesce = ofi_quiesce,
    .reg = ofi_reg,
    .dereg = ofi_dereg,
    .prepare = ofi_prepare,
    .complete = ofi_complete,
    .disconnect = ofi_disconnect,
    .post = ofi_post,
    .poll = ofi_poll,
    .cancel = ofi_cancel,
    .status_name = ofi_status_name,
};

/* The RMA-capable RDM providers this host offers (kvx._fabric.providers). Returns a list
 * through a callback so this file needs no Python. */
int kvx_ofi_list(const char *node, void (*each)(void *arg, const struct fi_info *fi), void *arg, char *err)
{
    struct kvx_open_args args = {.node = node};
    struct fi_info *list = NULL;
    int rc = get_info(&args, &list, err);
    if (rc)
        return rc;
    for (struct fi_info *fi = list; fi != NULL; fi = fi->next)
        each(arg, fi);
    fi_freeinfo(list);
    return 0;
}
