/*
 * kvx_post.h: the posting interface under kvx._fabric (csrc/kvx_fabric.c).
 *
 * A provider is one table of functions: open an endpoint, register memory,
 * connect a peer (prepare/complete, the same exchange for every provider),
 * post one work request (local gather + one remote range) and poll
 * completions. The engine in kvx_fabric.c builds work requests from
 * descriptor arrays, bounds what is outstanding, dispatches completions to
 * the batch that posted them and owns every policy; a provider does the
 * calls into its library and nothing else.
 *
 * Providers: "ofi" (libfabric, kvx_post_ofi.c) and "null" (kvx_post_null.c:
 * moves no data, completes every work request at once). A verbs provider
 * fits the same table (prepare: create an RC QP and return qpn/psn/gid;
 * complete: move it to RTR then RTS and return a peer number).
 *
 * Threading: the engine may call post/poll/cancel from several threads at
 * once (posters and the progress thread); open/close/reg/dereg/prepare/
 * complete/disconnect are called with no data call in flight on the same
 * object only where noted. A provider must be safe for that.
 *
 * Errors: functions return 0 (or a count) on success, a negative errno-style
 * value on failure (libfabric's FI_E* values, which are errno values below
 * 256) and write a message into err[KVX_ERR_LEN].
 */
#ifndef KVX_POST_H
#define KVX_POST_H

#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#define KVX_ERR_LEN 256
#define KVX_NAME_LEN 128
#define KVX_ADDR_MAX 1024
/* Bytes at the start of every work-request context that a provider may use
 * (libfabric's FI_CONTEXT2 mode: struct fi_context2 is 8 pointers). */
#define KVX_CTX_SCRATCH (8 * sizeof(void *))
/* The engine never gathers more local pieces than this into one request. */
#define KVX_SGE_CAP 64
/* -EAGAIN from post: the provider's queue is full; poll and try again. */
#define KVX_EAGAIN 11

enum kvx_op { KVX_READ = 0, KVX_WRITE = 1 };

struct kvx_open_args {
    const char *provider; /* libfabric provider name, or NULL for the best one */
    const char *node;     /* local address to bind, or NULL */
    const char *domain;   /* libfabric domain (NIC) name, or NULL */
    int hmem;             /* ask for FI_HMEM (GPU memory registration) */
};

struct kvx_ep_info {
    char provider[KVX_NAME_LEN];
    char fabric[KVX_NAME_LEN];
    char domain[KVX_NAME_LEN];
    unsigned char address[KVX_ADDR_MAX];
    size_t address_len;
    int virt_addr;          /* remote addresses are virtual, else offsets from the MR start */
    int prov_key;           /* the provider picks MR keys */
    uint64_t mr_mode;       /* libfabric FI_MR_* bits granted (0 for null) */
    size_t key_size;        /* bytes of an MR key the provider honours */
    size_t max_sge;
    size_t max_msg;
    size_t max_outstanding;
    int needs_progress;     /* run a progress thread (the target must progress too) */
    int mr_close_final;     /* closing an MR is known to stop remote access already in flight */
};

struct kvx_wr {
    int op;                 /* enum kvx_op */
    uint64_t peer;
    const struct iovec *local;
    void **local_desc;      /* one per local piece (NULL entries when not needed) */
    size_t local_count;
    uint64_t remote_addr;
    uint64_t remote_key;
    void *context;          /* KVX_CTX_SCRATCH bytes the provider may use, then the engine's */
};

struct kvx_cqe {
    void *context;          /* the kvx_wr's context; NULL: none (ignored) */
    int status;             /* 0, or a positive errno-style status */
    const char *status_name; /* static string, e.g. "FI_EACCES" */
    char text[KVX_ERR_LEN];  /* provider's explanation when status != 0 */
};

struct kvx_provider {
    const char *name;
    int (*open)(const struct kvx_open_args *args, void **impl, struct kvx_ep_info *info, char *err);
    /* Called once, with no poster or progress thread running. */
    void (*close)(void *impl);
    /* Tear the connections down (no byte moves through them after it returns) but keep
     * the memory registrations, which the caller closes next, then close(). Called with no
     * poster or progress thread running. May be NULL. */
    void (*quiesce)(void *impl);
    /* access: KVX_ACCESS_* bits. device >= 0: GPU memory of that CUDA device. keep_key: *key
     * holds the key to register under (only where the user chooses keys: !prov_key); else
     * the provider, or a fresh random draw, picks it. */
    int (*reg)(void *impl, uint64_t addr, uint64_t len, int access, int device, int keep_key, uint64_t *key,
               void **desc, void **handle, char *err);
    /* After this returns no peer can reach the range through the key. */
    int (*dereg)(void *impl, void *handle, char *err);
    /* Connecting: prepare writes this side's info; complete takes the other side's. */
    int (*prepare)(void *impl, uint64_t *half, unsigned char *info, size_t *info_len, char *err);
    int (*complete)(void *impl, uint64_t half, const unsigned char *info, size_t info_len, uint64_t *peer,
                    char *err);
    int (*disconnect)(void *impl, uint64_t peer, char *err);
    int (*post)(void *impl, const struct kvx_wr *wr);
    /* Up to max completions; timeout_ms 0 does not block. Returns the count or a negative error. */
    int (*poll)(void *impl, struct kvx_cqe *out, int max, int timeout_ms);
    /* Best effort: ask that a posted request complete (with ECANCELED) soon. May be NULL. */
    void (*cancel)(void *impl, void *context);
    const char *(*status_name)(int status);
};

#define KVX_ACCESS_REMOTE_READ 1
#define KVX_ACCESS_REMOTE_WRITE 2

extern const struct kvx_provider kvx_provider_ofi;
extern const struct kvx_provider kvx_provider_null;

#endif
