/*
 * The "null" provider of kvx_post.h: moves no data and completes every work
 * request at once, in order. It measures what posting and polling cost the
 * engine per work request, and lets tests check how chains are built
 * (kvx._fabric counts the work requests and gathered pieces it posts).
 */
#define _GNU_SOURCE
#include "kvx_post.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#define NULL_RING 4096

struct null_ep {
    pthread_mutex_t lock;
    void *ring[NULL_RING];
    size_t head, count;
    uint64_t next_peer;
};

static int null_open(const struct kvx_open_args *args, void **impl, struct kvx_ep_info *info, char *err)
{
    (void)args;
    struct null_ep *ep = calloc(1, sizeof(*ep));
    if (ep == NULL) {
        snprintf(err, KVX_ERR_LEN, "out of memory");
        return -ENOMEM;
    }
    pthread_mutex_init(&ep->lock, NULL);
    ep->next_peer = 1;
    snprintf(info->provider, KVX_NAME_LEN, "null");
    snprintf(info->fabric, KVX_NAME_LEN, "null");
    snprintf(info->domain, KVX_NAME_LEN, "null");
    if (getrandom(info->address, 16, 0) != 16) {
        snprintf(err, KVX_ERR_LEN, "getrandom failed");
        free(ep);
        return -EIO;
    }
    info->address_len = 16;
    info->virt_addr = 1;
    info->key_size = 8;
    info->max_sge = 4;
    info->max_msg = (size_t)1 << 30;
    info->max_outstanding = 1024;
    info->needs_progress = 0;
    *impl = ep;
    return 0;
}

static void null_close(void *impl)
{
    struct null_ep *ep = impl;
    pthread_mutex_destroy(&ep->lock);
    free(ep);
}

static int null_reg(void *impl, uint64_t addr, uint64_t len, int access, int device, int keep_key,
                    uint64_t *key, void **desc, void **handle, char *err)
{
    (void)impl, (void)addr, (void)len, (void)access, (void)device;
    if (!keep_key && getrandom(key, sizeof(*key), 0) != sizeof(*key)) {
        snprintf(err, KVX_ERR_LEN, "getrandom failed");
        return -EIO;
    }
    *desc = NULL;
    *handle = (void *)1; /* nothing to release; non-NULL marks it live */
    return 0;
}

static int null_dereg(void *impl, void *handle, char *err)
{
    (void)impl, (void)handle, (void)err;
    return 0;
}

static int null_prepare(void *impl, uint64_t *half, unsigned char *info, size_t *info_len, char *err)
{
    (void)impl, (void)err;
    *half = 0;
    memset(info, 0, 16);
    *info_len = 16;
    return 0;
}

static int null_complete(void *impl, uint64_t half, const unsigned char *info, size_t info_len,
                         uint64_t *peer, char *err)
{
    struct null_ep *ep = impl;
    (void)half, (void)info;
    if (info_len != 16) {
        snprintf(err, KVX_ERR_LEN, "peer info is %zu bytes, the null provider's is 16", info_len);
        return -EINVAL;
    }
    pthread_mutex_lock(&ep->lock);
    *peer = ep->next_peer++;
    pthread_mutex_unlock(&ep->lock);
    return 0;
}

static int null_disconnect(void *impl, uint64_t peer, char *err)
{
    (void)impl, (void)peer, (void)err;
    return 0;
}

static int null_post(void *impl, const struct kvx_wr *wr)
{
    struct null_ep *ep = impl;
    int rc = 0;
    pthread_mutex_lock(&ep->lock);
    if (ep->count == NULL_RING) {
        rc = -KVX_EAGAIN;
    } else {
        ep->ring[(ep->head + ep->count) % NULL_RING] = wr->context;
        ep->count++;
    }
    pthread_mutex_unlock(&ep->lock);
    return rc;
}

static int null_poll(void *impl, struct kvx_cqe *out, int max, int timeout_ms)
{
    struct null_ep *ep = impl;
    (void)timeout_ms; /* never waits: what was posted is complete */
    int n = 0;
    pthread_mutex_lock(&ep->lock);
    while (n < max && ep->count > 0) {
        out[n].context = ep->ring[ep->head];
        out[n].status = 0;
        ep->head = (ep->head + 1) % NULL_RING;
        ep->count--;
        n++;
    }
    pthread_mutex_unlock(&ep->lock);
    return n;
}

static const char *null_status_name(int status)
{
    return status == 0 ? "OK" : "NULL_ERROR";
}

const struct kvx_provider kvx_provider_null = {
    .name = "null",
    .open = null_open,
    .close = null_close,
    .reg = null_reg,
    .dereg = null_dereg,
    .prepare = null_prepare,
    .complete = null_complete,
    .disconnect = null_disconnect,
    .post = null_post,
    .poll = null_poll,
    .cancel = NULL,
    .status_name = null_status_name,
};
