/*
 * kvx._datapath._cma: cross-memory attach for same-host peers (the shm backend).
 *
 * Byte work only: the caller has checked that the peer process is the one it
 * authenticated; ranges are validated here against the tables the caller
 * passes (its own regions, the peer's lease) or by the caller. Moves bytes between this process and another with
 * process_vm_readv/process_vm_writev, both iovec lists batched by IOV_MAX,
 * partial transfers resumed, with the GIL released.
 *
 *   vm_readv(pid, local_addrs, local_lens, remote_addrs, remote_lens) -> None
 *   vm_writev(pid, local_addrs, local_lens, remote_addrs, remote_lens) -> None
 *   memcpyv(dsts, srcs, lens) -> None      (this process: shared segments)
 *   leased_copy(pid, writing, local_addrs, local_lens, descs, regions, lease, granted)
 *       -> -1, or the index of the first descriptor refused (nothing moved)
 *   leased_post(pid, writing, local_descs, bases, sizes, flags, need, mask,
 *               descs, regions, lease, granted, max_bytes)
 *       -> bytes moved, or (side, index) of what was refused (nothing moved)
 *   conn_leased_post(conn, pid, writing, local_descs, bases, sizes, flags,
 *                    need, mask, descs, granted, max_bytes)
 *       -> as leased_post, through the leases of connection `conn`, taken and
 *          given back in the call; None when a region is not leased
 *   post_check(local_descs, bases, sizes, flags, need, mask, descs, peer_sizes,
 *              peer_flags, peer_need, max_bytes)
 *       -> (addrs, lens, total) of a small transfer's local side, its remote
 *          side checked against the peer's published table; None when
 *          anything is refused (no copy: the tcp backend's post)
 *
 * The four arguments are C-contiguous uint64 buffers; the local and remote
 * lists may be cut differently but must cover the same number of bytes.
 * Errors raise OSError with errno (EPERM: not allowed to access that
 * process; ESRCH: no such process; EFAULT: a range is not mapped there).
 *
 * The pure-Python twin is kvx/_datapath/cma_py.py; tests run both.
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>
#include <sys/types.h>
#include <sys/uio.h>

#ifndef IOV_MAX
#define IOV_MAX 1024
#endif

struct cursor {
    const uint64_t *addr;
    const uint64_t *len;
    size_t count;
    size_t at;     /* current entry */
    size_t offset; /* bytes of it already moved */
};

/* Fill up to IOV_MAX iovecs from the cursor, without consuming them. */
static size_t fill(const struct cursor *c, struct iovec *iov)
{
    size_t n = 0;
    for (size_t i = c->at; i < c->count && n < IOV_MAX; i++) {
        size_t skip = (i == c->at) ? c->offset : 0;
        if (c->len[i] - skip == 0)
            continue;
        iov[n].iov_base = (void *)(uintptr_t)(c->addr[i] + skip);
        iov[n].iov_len = (size_t)(c->len[i] - skip);
        n++;
    }
    return n;
}

static void advance(struct cursor *c, size_t bytes)
{
    while (bytes > 0 && c->at < c->count) {
        size_t left = (size_t)c->len[c->at] - c->offset;
        if (bytes < left) {
            c->offset += bytes;
            return;
        }
        bytes -= left;
        c->at++;
        c->offset = 0;
    }
    while (c->at < c->count && c->len[c->at] == c->offset) {
        c->at++;
        c->offset = 0;
    }
}

static int total(const uint64_t *len, size_t count, uint64_t *out)
{
    uint64_t sum = 0;
    for (size_t i = 0; i < count; i++) {
        if (len[i] > UINT64_MAX - sum)
            return -1;
        sum += len[i];
    }
    *out = sum;
    return 0;
}

/* Move `total_bytes` between the local and remote lists (equal totals, checked
 * by the caller) with process_vm_readv/writev, IOV_MAX at a time, partial
 * transfers resumed. Call without the GIL. Returns 0 or an errno. */
static int move_ranges(int pid, int writing, struct cursor *local, struct cursor *remote, uint64_t total_bytes,
                       struct iovec *liov, struct iovec *riov)
{
    uint64_t moved = 0;
    while (moved < total_bytes) {
        size_t ln = fill(local, liov), rn = fill(remote, riov);
        ssize_t n = writing ? process_vm_writev(pid, liov, ln, riov, rn, 0)
                            : process_vm_readv(pid, liov, ln, riov, rn, 0);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return errno;
        }
        if (n == 0) /* no progress: the next range is not accessible */
            return EFAULT;
        moved += (uint64_t)n;
        advance(local, (size_t)n);
        advance(remote, (size_t)n);
    }
    return 0;
}

static PyObject *cma(PyObject *args, int writing)
{
    int pid;
    Py_buffer la, ll, ra, rl;
    if (!PyArg_ParseTuple(args, writing ? "iy*y*y*y*:vm_writev" : "iy*y*y*y*:vm_readv", &pid, &la, &ll,
                          &ra, &rl))
        return NULL;
    PyObject *result = NULL;
    struct iovec *liov = NULL, *riov = NULL;
    if (la.len % 8 || ll.len != la.len || ra.len % 8 || rl.len != ra.len) {
        PyErr_SetString(PyExc_ValueError, "addresses and lengths must be uint64 buffers of equal length");
        goto out;
    }
    struct cursor local = {la.buf, ll.buf, (size_t)la.len / 8, 0, 0};
    struct cursor remote = {ra.buf, rl.buf, (size_t)ra.len / 8, 0, 0};
    uint64_t lt, rt;
    if (total(local.len, local.count, &lt) || total(remote.len, remote.count, &rt) || lt != rt) {
        PyErr_SetString(PyExc_ValueError, "local and remote ranges must cover the same number of bytes");
        goto out;
    }
    liov = PyMem_RawMalloc(IOV_MAX * sizeof(struct iovec));
    riov = PyMem_RawMalloc(IOV_MAX * sizeof(struct iovec));
    if (liov == NULL || riov == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = move_ranges(pid, writing, &local, &remote, lt, liov, riov);
    Py_END_ALLOW_THREADS
    if (err) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        goto out;
    }
    result = Py_None;
    Py_INCREF(result);
out:
    PyMem_RawFree(liov);
    PyMem_RawFree(riov);
    PyBuffer_Release(&la);
    PyBuffer_Release(&ll);
    PyBuffer_Release(&ra);
    PyBuffer_Release(&rl);
    return result;
}

/* memcpy of (dst, src, len) triples, GIL released: the shm backend's copy
 * through peer segments mapped into this process. */
static PyObject *kvx_memcpyv(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer d, s, l;
    if (!PyArg_ParseTuple(args, "y*y*y*:memcpyv", &d, &s, &l))
        return NULL;
    PyObject *result = NULL;
    if (d.len % 8 || s.len != d.len || l.len != d.len) {
        PyErr_SetString(PyExc_ValueError, "dsts, srcs and lens must be uint64 buffers of equal length");
        goto out;
    }
    const uint64_t *dst = d.buf, *src = s.buf, *len = l.buf;
    size_t count = (size_t)d.len / 8;
    Py_BEGIN_ALLOW_THREADS
    for (size_t i = 0; i < count; i++)
        memcpy((void *)(uintptr_t)dst[i], (const void *)(uintptr_t)src[i], (size_t)len[i]);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
out:
    PyBuffer_Release(&d);
    PyBuffer_Release(&s);
    PyBuffer_Release(&l);
    return result;
}

static PyObject *kvx_vm_readv(PyObject *self, PyObject *args)
{
    (void)self;
    return cma(args, 0);
}

static PyObject *kvx_vm_writev(PyObject *self, PyObject *args)
{
    (void)self;
    return cma(args, 1);
}

/* A descriptor as kvx.descs.DESC_DTYPE lays it out (aligned: 24 bytes). */
struct kvx_desc {
    uint32_t region;
    uint32_t pad;
    uint64_t offset;
    uint64_t length;
};

/* descs_bad(descs, flags, sizes, need) -> index of the first descriptor whose
 * region (an index into the uint8 flags and uint64 sizes tables) lacks the
 * `need` bits, or whose range lies outside the region; -1 when all are good. */
static PyObject *kvx_descs_bad(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer descs, flags, sizes;
    unsigned int need;
    if (!PyArg_ParseTuple(args, "y*y*y*I:descs_bad", &descs, &flags, &sizes, &need))
        return NULL;
    Py_ssize_t found = -2;
    if (descs.len % (Py_ssize_t)sizeof(struct kvx_desc) || sizes.len != flags.len * (Py_ssize_t)sizeof(uint64_t)) {
        PyErr_SetString(PyExc_ValueError, "descs_bad: malformed descriptor or table buffers");
    } else {
        const struct kvx_desc *d = descs.buf;
        const uint8_t *f = flags.buf;
        const uint64_t *z = sizes.buf;
        size_t n = (size_t)descs.len / sizeof(struct kvx_desc), top = (size_t)flags.len;
        found = -1;
        for (size_t i = 0; i < n; i++) {
            uint32_t r = d[i].region;
            if (r >= top || (f[r] & need) != need || d[i].offset > z[r] || d[i].length > z[r] - d[i].offset) {
                found = (Py_ssize_t)i;
                break;
            }
        }
    }
    PyBuffer_Release(&descs);
    PyBuffer_Release(&flags);
    PyBuffer_Release(&sizes);
    return found == -2 ? NULL : PyLong_FromSsize_t(found);
}

/* Access bits of a lease, as kvx.memory names them (REMOTE_READ, REMOTE_WRITE). */
#define LEASE_READ 2u
#define LEASE_WRITE 4u

/* Merge runs of (addr, len) pieces where the next starts where one ends, in
 * place; zero-length pieces are dropped. Returns the new count. */
static size_t merge(uint64_t *addr, uint64_t *len, size_t count)
{
    size_t out = 0;
    for (size_t i = 0; i < count; i++) {
        if (len[i] == 0)
            continue;
        if (out && addr[out - 1] + len[out - 1] == addr[i] && len[i] <= UINT64_MAX - len[out - 1]) {
            len[out - 1] += len[i];
            continue;
        }
        addr[out] = addr[i];
        len[out] = len[i];
        out++;
    }
    return out;
}

/* Check every remote descriptor against the leased ranges (its region
 * leased, the access granted, the range inside the leased size, no address
 * overflow) and resolve it into (r_addr, r_len); *total gets the bytes.
 * Returns -1, or the index of the first descriptor refused. No GIL needed. */
static Py_ssize_t lease_resolve(const struct kvx_desc *d, size_t ndescs, const uint32_t *ids, size_t nregions,
                                const uint64_t *lease, int allowed, uint64_t *r_addr, uint64_t *r_len,
                                uint64_t *total)
{
    uint64_t rt = 0;
    size_t at = 0; /* the lease entry of the previous descriptor: runs name one region */
    for (size_t i = 0; i < ndescs; i++) {
        uint32_t r = d[i].region;
        if (at >= nregions || ids[at] != r) {
            size_t lo = 0, hi = nregions; /* binary search over the sorted ids */
            while (lo < hi) {
                size_t mid = lo + (hi - lo) / 2;
                if (ids[mid] < r)
                    lo = mid + 1;
                else
                    hi = mid;
            }
            at = lo;
        }
        uint64_t base = at < nregions ? lease[2 * at] : 0, size = at < nregions ? lease[2 * at + 1] : 0;
        uint64_t off = d[i].offset, n = d[i].length;
        if (at >= nregions || ids[at] != r || !allowed || off > size || n > size - off ||
            base > UINT64_MAX - off || n > UINT64_MAX - (base + off) || n > UINT64_MAX - rt)
            return (Py_ssize_t)i;
        r_addr[i] = base + off;
        r_len[i] = n;
        rt += n;
    }
    *total = rt;
    return -1;
}

/* The leased path of the shm backend in one call: every remote descriptor
 * checked against the ranges the target leased (its region leased, the
 * lease granting the access, the range inside the leased size, no address
 * overflow), resolved to addresses in the target's process, adjacent
 * pieces merged on both sides, then moved with the GIL released.
 *
 *   descs:   kvx.descs.DESC_DTYPE records (24 bytes: region, pad, offset, length)
 *   regions: uint32, sorted, distinct: the leased region ids
 *   lease:   uint64, (base, size) per region in that order, then anything
 *            (the extras a pin's kind adds)
 *   granted: LEASE_READ / LEASE_WRITE bits the target granted
 *
 * Returns -1 once every byte moved, or the index of the first descriptor
 * refused, before any byte moved. Malformed buffers and unequal totals raise
 * ValueError; the copy's failures OSError with errno, as vm_readv. */
static PyObject *kvx_leased_copy(PyObject *self, PyObject *args)
{
    (void)self;
    int pid, writing;
    unsigned int granted;
    Py_buffer la, ll, db, rb, lb;
    if (!PyArg_ParseTuple(args, "ipy*y*y*y*y*I:leased_copy", &pid, &writing, &la, &ll, &db, &rb, &lb, &granted))
        return NULL;
    PyObject *result = NULL;
    uint64_t *work = NULL;
    struct iovec *liov = NULL, *riov = NULL;
    size_t nregions = (size_t)rb.len / sizeof(uint32_t);
    if (la.len % 8 || ll.len != la.len || db.len % (Py_ssize_t)sizeof(struct kvx_desc) || rb.len % 4 ||
        lb.len % 8 || (size_t)lb.len / 8 < 2 * nregions) {
        PyErr_SetString(PyExc_ValueError, "leased_copy: malformed address, descriptor, region or lease buffers");
        goto out;
    }
    size_t nlocal = (size_t)la.len / 8, ndescs = (size_t)db.len / sizeof(struct kvx_desc);
    const uint64_t *laddr = la.buf, *llen = ll.buf, *lease = lb.buf;
    const uint32_t *ids = rb.buf;
    const struct kvx_desc *d = db.buf;
    for (size_t k = 1; k < nregions; k++) {
        if (ids[k] <= ids[k - 1]) {
            PyErr_SetString(PyExc_ValueError, "leased_copy: region ids must be sorted and distinct");
            goto out;
        }
    }
    /* One allocation: local then remote (addr, len) lists, merged in place. */
    if (nlocal > (SIZE_MAX / 32) - ndescs) {
        PyErr_NoMemory();
        goto out;
    }
    work = PyMem_RawMalloc((2 * nlocal + 2 * ndescs + 1) * sizeof(uint64_t));
    liov = PyMem_RawMalloc(IOV_MAX * sizeof(struct iovec));
    riov = PyMem_RawMalloc(IOV_MAX * sizeof(struct iovec));
    if (work == NULL || liov == NULL || riov == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    uint64_t *l_addr = work, *l_len = work + nlocal, *r_addr = work + 2 * nlocal, *r_len = r_addr + ndescs;
    Py_ssize_t bad = -1;
    int err = 0, unequal = 0;
    unsigned int need = writing ? LEASE_WRITE : LEASE_READ;
    Py_BEGIN_ALLOW_THREADS
    uint64_t lt = 0, rt = 0;
    for (size_t i = 0; i < nlocal; i++) {
        if (llen[i] > UINT64_MAX - lt) {
            unequal = 1;
            break;
        }
        lt += llen[i];
        l_addr[i] = laddr[i];
        l_len[i] = llen[i];
    }
    if (!unequal)
        bad = lease_resolve(d, ndescs, ids, nregions, lease, (granted & need) == need, r_addr, r_len, &rt);
    if (bad < 0 && !unequal && lt != rt)
        unequal = 1;
    if (bad < 0 && !unequal) {
        struct cursor local = {l_addr, l_len, merge(l_addr, l_len, nlocal), 0, 0};
        struct cursor remote = {r_addr, r_len, merge(r_addr, r_len, ndescs), 0, 0};
        err = move_ranges(pid, writing, &local, &remote, lt, liov, riov);
    }
    Py_END_ALLOW_THREADS
    if (bad >= 0) {
        result = PyLong_FromSsize_t(bad);
    } else if (unequal) {
        PyErr_SetString(PyExc_ValueError, "local and remote ranges must cover the same number of bytes");
    } else if (err) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
    } else {
        result = PyLong_FromLong(-1);
    }
out:
    PyMem_RawFree(work);
    PyMem_RawFree(liov);
    PyMem_RawFree(riov);
    PyBuffer_Release(&la);
    PyBuffer_Release(&ll);
    PyBuffer_Release(&db);
    PyBuffer_Release(&rb);
    PyBuffer_Release(&lb);
    return result;
}

/* Resolve local descriptors against this process's region table (bases,
 * sizes: uint64; flags: uint8; indexed by region id): each region's flags,
 * masked by `mask`, equal `need`, each range inside its region, no address
 * overflow. Fills (l_addr, l_len) and *total. Returns -1, or the index of
 * the first descriptor refused. No GIL needed. */
static Py_ssize_t table_resolve(const struct kvx_desc *d, size_t ndescs, const uint64_t *bases,
                                const uint64_t *sizes, const uint8_t *flags, size_t top, unsigned int need,
                                unsigned int mask, uint64_t *l_addr, uint64_t *l_len, uint64_t *total)
{
    uint64_t lt = 0;
    for (size_t i = 0; i < ndescs; i++) {
        uint32_t r = d[i].region;
        if (r >= top || (flags[r] & mask) != need)
            return (Py_ssize_t)i;
        uint64_t base = bases[r], size = sizes[r], off = d[i].offset, n = d[i].length;
        if (off > size || n > size - off || base > UINT64_MAX - off || n > UINT64_MAX - (base + off) ||
            n > UINT64_MAX - lt)
            return (Py_ssize_t)i;
        l_addr[i] = base + off;
        l_len[i] = n;
        lt += n;
    }
    *total = lt;
    return -1;
}

/* array.array, the type of post_check's results (set at import). */
static PyObject *array_type;

/* post_check: what a small transfer over a socket checks before it is posted
 * (kvx.agent Peer._post_small), in one pass. The local descriptors are
 * resolved against this process's region table as table_resolve does (each
 * region's flags masked by `mask` equal `need`; each range inside its region;
 * no overflow) into (addrs, lens), two array.array("Q"); the remote ones are
 * checked against the peer's published table as descs_bad does (its flags
 * carry `peer_need`, each range inside its size); the totals are equal, above
 * 0 and at most max_bytes. Returns (addrs, lens, total), or None when
 * anything is refused: the caller's full path checks again and names what is
 * wrong. Malformed buffers raise ValueError. */
static PyObject *kvx_post_check(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer ld, bb, sb, fb, db, zb, rb;
    unsigned int need, mask, peer_need;
    unsigned long long max_bytes;
    if (!PyArg_ParseTuple(args, "y*y*y*y*IIy*y*y*IK:post_check", &ld, &bb, &sb, &fb, &need, &mask, &db, &zb, &rb,
                          &peer_need, &max_bytes))
        return NULL;
    PyObject *result = NULL;
    uint64_t small[2 * 64];
    uint64_t *work = small;
    size_t nlocal = (size_t)ld.len / sizeof(struct kvx_desc), ndescs = (size_t)db.len / sizeof(struct kvx_desc);
    if (ld.len % (Py_ssize_t)sizeof(struct kvx_desc) || bb.len != fb.len * 8 || sb.len != bb.len ||
        db.len % (Py_ssize_t)sizeof(struct kvx_desc) || zb.len != rb.len * 8) {
        PyErr_SetString(PyExc_ValueError, "post_check: malformed descriptor or table buffers");
        goto out;
    }
    if (nlocal > 64) {
        work = PyMem_Malloc(2 * nlocal * sizeof(uint64_t));
        if (work == NULL) {
            PyErr_NoMemory();
            goto out;
        }
    }
    uint64_t lt = 0, rt = 0;
    int ok = table_resolve(ld.buf, nlocal, bb.buf, sb.buf, fb.buf, (size_t)fb.len, need, mask, work, work + nlocal,
                           &lt) < 0;
    const struct kvx_desc *d = db.buf;
    const uint8_t *pf = rb.buf;
    const uint64_t *pz = zb.buf;
    for (size_t i = 0; ok && i < ndescs; i++) {
        uint32_t r = d[i].region;
        if (r >= (size_t)rb.len || (pf[r] & peer_need) != peer_need || d[i].offset > pz[r] ||
            d[i].length > pz[r] - d[i].offset || d[i].length > UINT64_MAX - rt)
            ok = 0;
        else
            rt += d[i].length;
    }
    if (!ok || lt != rt || lt == 0 || lt > (uint64_t)max_bytes) {
        result = Py_NewRef(Py_None);
        goto out;
    }
    PyObject *addrs = PyObject_CallFunction(array_type, "sy#", "Q", (const char *)work,
                                            (Py_ssize_t)(nlocal * sizeof(uint64_t)));
    PyObject *lens = addrs == NULL ? NULL
                                   : PyObject_CallFunction(array_type, "sy#", "Q", (const char *)(work + nlocal),
                                                           (Py_ssize_t)(nlocal * sizeof(uint64_t)));
    if (addrs != NULL && lens != NULL)
        result = Py_BuildValue("(NNK)", addrs, lens, (unsigned long long)lt);
    else {
        Py_XDECREF(addrs);
        Py_XDECREF(lens);
    }
out:
    if (work != small)
        PyMem_Free(work);
    PyBuffer_Release(&ld);
    PyBuffer_Release(&bb);
    PyBuffer_Release(&sb);
    PyBuffer_Release(&fb);
    PyBuffer_Release(&db);
    PyBuffer_Release(&zb);
    PyBuffer_Release(&rb);
    return result;
}

/* The local and remote lists of leased_post and leased_triples, resolved:
 * l_addr, l_len (nlocal each), then r_addr, r_len (ndescs each), in work. */
struct leased {
    uint64_t *work, *l_addr, *l_len, *r_addr, *r_len;
    size_t nlocal, ndescs, nregions;
    uint64_t total;
};

/* What leased_post and leased_triples check of their buffers before any
 * descriptor: whole descriptors, a table of equal lengths (bases and sizes
 * uint64, flags uint8), whole region ids and lease words, a (base, size)
 * pair per leased region, the ids sorted and distinct; then room for the
 * resolved lists. 0, or -1 with a Python error set (`name` in its message). */
static int leased_prepare(const char *name, const Py_buffer *ld, const Py_buffer *bb, const Py_buffer *sb,
                          const Py_buffer *fb, const Py_buffer *db, const Py_buffer *rb, const Py_buffer *lb,
                          struct leased *r)
{
    r->work = NULL;
    r->nregions = (size_t)rb->len / sizeof(uint32_t);
    if (ld->len % (Py_ssize_t)sizeof(struct kvx_desc) || bb->len != fb->len * 8 || sb->len != bb->len ||
        db->len % (Py_ssize_t)sizeof(struct kvx_desc) || rb->len % 4 || lb->len % 8 ||
        (size_t)lb->len / 8 < 2 * r->nregions) {
        PyErr_Format(PyExc_ValueError, "%s: malformed descriptor, table, region or lease buffers", name);
        return -1;
    }
    const uint32_t *ids = rb->buf;
    for (size_t k = 1; k < r->nregions; k++) {
        if (ids[k] <= ids[k - 1]) {
            PyErr_Format(PyExc_ValueError, "%s: region ids must be sorted and distinct", name);
            return -1;
        }
    }
    r->nlocal = (size_t)ld->len / sizeof(struct kvx_desc);
    r->ndescs = (size_t)db->len / sizeof(struct kvx_desc);
    if (r->nlocal > (SIZE_MAX / 32) - r->ndescs) {
        PyErr_NoMemory();
        return -1;
    }
    r->work = PyMem_RawMalloc((2 * r->nlocal + 2 * r->ndescs + 1) * sizeof(uint64_t));
    if (r->work == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    r->l_addr = r->work;
    r->l_len = r->work + r->nlocal;
    r->r_addr = r->work + 2 * r->nlocal;
    r->r_len = r->r_addr + r->ndescs;
    return 0;
}

/* Resolve both lists (no GIL needed): the local descriptors against this
 * process's region table (as table_resolve; each region on `device` too
 * when `devices`, int32 per region, is not NULL), the remote ones against
 * the lease (as lease_resolve), then the totals compared (equal, above 0,
 * at most max_bytes). -1 when all passed (r->total: the bytes); else the
 * side refused, with *index: 0 local descriptor *index, 1 remote
 * descriptor *index, 2 the totals (*index -1). */
static int leased_resolve(struct leased *r, int writing, const Py_buffer *ld, const Py_buffer *bb,
                          const Py_buffer *sb, const Py_buffer *fb, const int32_t *devices, int device,
                          unsigned int need, unsigned int mask, const Py_buffer *db, const Py_buffer *rb,
                          const Py_buffer *lb, unsigned int granted, unsigned long long max_bytes, Py_ssize_t *index)
{
    uint64_t lt = 0, rt = 0;
    unsigned int access = writing ? LEASE_WRITE : LEASE_READ;
    *index = table_resolve(ld->buf, r->nlocal, bb->buf, sb->buf, fb->buf, (size_t)fb->len, need, mask, r->l_addr,
                           r->l_len, &lt);
    if (*index >= 0)
        return 0;
    if (devices != NULL) {
        const struct kvx_desc *d = ld->buf;
        for (size_t i = 0; i < r->nlocal; i++) {
            if (devices[d[i].region] != device) { /* in range: table_resolve checked it */
                *index = (Py_ssize_t)i;
                return 0;
            }
        }
    }
    *index = lease_resolve(db->buf, r->ndescs, rb->buf, r->nregions, lb->buf, (granted & access) == access,
                           r->r_addr, r->r_len, &rt);
    if (*index >= 0)
        return 1;
    if (lt != rt || lt == 0 || lt > (uint64_t)max_bytes) {
        *index = -1;
        return 2;
    }
    r->total = lt;
    return -1;
}

/* leased_post: a whole small shm transfer in one call. The lists resolved
 * and checked (leased_resolve, no device table), adjacent pieces merged,
 * the bytes moved with the GIL released.
 *
 * Returns the bytes moved once every byte moved; else, with nothing moved, a pair
 * (side, index): (0, i) local descriptor i refused, (1, i) remote
 * descriptor i refused, (2, -1) the totals differ, are 0 or exceed
 * max_bytes. The copy's failures raise OSError with errno; malformed
 * buffers ValueError. */
/* leased_post's work once its buffers are parsed; the region ids and lease
 * words may be the caller's own (conn_leased_post). */
static PyObject *leased_post_run(int pid, int writing, Py_buffer *ld, Py_buffer *bb, Py_buffer *sb, Py_buffer *fb,
                                 unsigned int need, unsigned int mask, Py_buffer *db, Py_buffer *rb, Py_buffer *lb,
                                 unsigned int granted, unsigned long long max_bytes)
{
    PyObject *result = NULL;
    struct leased r;
    struct iovec *liov = NULL, *riov = NULL;
    if (leased_prepare("leased_post", ld, bb, sb, fb, db, rb, lb, &r) < 0)
        goto out;
    liov = PyMem_RawMalloc(IOV_MAX * sizeof(struct iovec));
    riov = PyMem_RawMalloc(IOV_MAX * sizeof(struct iovec));
    if (liov == NULL || riov == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    Py_ssize_t bad;
    int side, err = 0;
    Py_BEGIN_ALLOW_THREADS
    side = leased_resolve(&r, writing, ld, bb, sb, fb, NULL, 0, need, mask, db, rb, lb, granted, max_bytes, &bad);
    if (side < 0) {
        struct cursor local = {r.l_addr, r.l_len, merge(r.l_addr, r.l_len, r.nlocal), 0, 0};
        struct cursor remote = {r.r_addr, r.r_len, merge(r.r_addr, r.r_len, r.ndescs), 0, 0};
        err = move_ranges(pid, writing, &local, &remote, r.total, liov, riov);
    }
    Py_END_ALLOW_THREADS
    if (side >= 0) {
        result = Py_BuildValue("(in)", side, bad);
    } else if (err) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
    } else {
        result = PyLong_FromUnsignedLongLong((unsigned long long)r.total);
    }
out:
    PyMem_RawFree(r.work);
    PyMem_RawFree(liov);
    PyMem_RawFree(riov);
    return result;
}

static PyObject *kvx_leased_post(PyObject *self, PyObject *args)
{
    (void)self;
    int pid, writing;
    unsigned int need, mask, granted;
    unsigned long long max_bytes;
    Py_buffer ld, bb, sb, fb, db, rb, lb;
    if (!PyArg_ParseTuple(args, "ipy*y*y*y*IIy*y*y*IK:leased_post", &pid, &writing, &ld, &bb, &sb, &fb, &need,
                          &mask, &db, &rb, &lb, &granted, &max_bytes))
        return NULL;
    PyObject *result = leased_post_run(pid, writing, &ld, &bb, &sb, &fb, need, mask, &db, &rb, &lb, granted, max_bytes);
    PyBuffer_Release(&ld);
    PyBuffer_Release(&bb);
    PyBuffer_Release(&sb);
    PyBuffer_Release(&fb);
    PyBuffer_Release(&db);
    PyBuffer_Release(&rb);
    PyBuffer_Release(&lb);
    return result;
}

/* A connection's leases, as kvx.backends.control.link.Connection keeps them:
 * under conn.lock, conn.leases maps (region id, writing) to the lease's
 * answer (base, size, extras...), conn.lease_uses counts per region the
 * copies using its lease, conn.copies all copies under way; a copy's end
 * notifies conn.copies_done when conn.copy_waiters, and one that ends after
 * conn.error was set and leaves no copy calls conn._copies_ended_broken().
 * lease_take and lease_give are Connection.lease and Connection.unlease,
 * here so that conn_leased_post is one call; keep the three in step. */
static PyObject *s_lock, *s_acquire, *s_release, *s_error, *s_leases, *s_lease_uses, *s_copies, *s_copy_waiters,
    *s_copies_done, *s_notify_all, *s_ended_broken;

static int intern_names(void)
{
    struct {
        PyObject **slot;
        const char *name;
    } names[] = {
        {&s_lock, "lock"},
        {&s_acquire, "acquire"},
        {&s_release, "release"},
        {&s_error, "error"},
        {&s_leases, "leases"},
        {&s_lease_uses, "lease_uses"},
        {&s_copies, "copies"},
        {&s_copy_waiters, "copy_waiters"},
        {&s_copies_done, "copies_done"},
        {&s_notify_all, "notify_all"},
        {&s_ended_broken, "_copies_ended_broken"},
    };
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        *names[i].slot = PyUnicode_InternFromString(names[i].name);
        if (*names[i].slot == NULL)
            return -1;
    }
    return 0;
}

/* conn.<name> += delta (the sum into *sum when not NULL); 0 or -1 with an
 * error set. */
static int attr_add(PyObject *conn, PyObject *name, long delta, long *sum)
{
    PyObject *v = PyObject_GetAttr(conn, name);
    if (v == NULL)
        return -1;
    long n = PyLong_AsLong(v);
    Py_DECREF(v);
    if (n == -1 && PyErr_Occurred())
        return -1;
    if (sum != NULL)
        *sum = n + delta;
    PyObject *nv = PyLong_FromLong(n + delta);
    if (nv == NULL)
        return -1;
    int rc = PyObject_SetAttr(conn, name, nv);
    Py_DECREF(nv);
    return rc;
}

/* uses[rid] += delta, the entry deleted at 0; 0 or -1 with an error set. */
static int uses_add(PyObject *uses, uint32_t rid, long delta)
{
    PyObject *key = PyLong_FromUnsignedLong(rid);
    if (key == NULL)
        return -1;
    int rc = -1;
    PyObject *cur = PyDict_GetItemWithError(uses, key); /* borrowed */
    long n = 0;
    if (cur != NULL) {
        n = PyLong_AsLong(cur);
        if (n == -1 && PyErr_Occurred())
            goto out;
    } else if (PyErr_Occurred()) {
        goto out;
    }
    n += delta;
    if (n < 0) { /* a use given back twice: never store it, or a revoke would wait for good */
        PyErr_Format(PyExc_SystemError, "conn_leased_post: region %lu has no use to give back", (unsigned long)rid);
        goto out;
    }
    if (n) {
        PyObject *nv = PyLong_FromLong(n);
        if (nv == NULL)
            goto out;
        rc = PyDict_SetItem(uses, key, nv);
        Py_DECREF(nv);
    } else {
        rc = cur != NULL ? PyDict_DelItem(uses, key) : 0;
    }
out:
    Py_DECREF(key);
    return rc;
}

/* The first error of a sequence of steps that must all run (a lease given
 * back): keep_error moves the pending error aside, keeping only the first;
 * restore_error raises it again at the end (-1), or returns 0. */
struct first_error {
    PyObject *type, *value, *tb;
};

static void keep_error(struct first_error *e)
{
    if (!PyErr_Occurred())
        return;
    if (e->type == NULL)
        PyErr_Fetch(&e->type, &e->value, &e->tb);
    else
        PyErr_Clear();
}

static int restore_error(struct first_error *e)
{
    if (e->type == NULL)
        return 0;
    PyErr_Restore(e->type, e->value, e->tb);
    return -1;
}

/* lock.acquire() or lock.release() with no error pending, retried when it
 * fails (a signal's exception while the acquire waits): what the lock guards
 * must be given back. The failures go to *e. 0, or -1 after many tries. */
static int lock_call(PyObject *lock, PyObject *name, struct first_error *e)
{
    for (int tries = 0; tries < 1000; tries++) {
        PyObject *got = PyObject_CallMethodNoArgs(lock, name);
        if (got != NULL) {
            Py_DECREF(got);
            return 0;
        }
        keep_error(e);
    }
    return -1;
}

/* Connection.lease for the sorted, distinct `ids`: with conn.lock held, and
 * conn.error None, every (id, writing) leased; then its (base, size) into
 * words (a pair per id), a use counted per id and a copy under way.
 * 1 leased, 0 not (nothing counted), -1 with an error set (nothing counted). */
static int lease_take(PyObject *conn, PyObject *lock, const uint32_t *ids, size_t n, int writing, uint64_t *words)
{
    PyObject *got = PyObject_CallMethodNoArgs(lock, s_acquire);
    if (got == NULL)
        return -1;
    Py_DECREF(got);
    int rc = -1;
    size_t counted = 0;
    PyObject *leases = NULL, *uses = NULL, *error = PyObject_GetAttr(conn, s_error);
    if (error == NULL)
        goto unlock;
    if (error != Py_None) {
        rc = 0;
        goto unlock;
    }
    leases = PyObject_GetAttr(conn, s_leases);
    uses = PyObject_GetAttr(conn, s_lease_uses);
    if (leases == NULL || uses == NULL)
        goto unlock;
    if (!PyDict_Check(leases) || !PyDict_Check(uses)) {
        PyErr_SetString(PyExc_TypeError, "conn_leased_post: conn.leases and conn.lease_uses must be dicts");
        goto unlock;
    }
    for (size_t k = 0; k < n; k++) {
        PyObject *rid = PyLong_FromUnsignedLong(ids[k]);
        PyObject *key = rid == NULL ? NULL : PyTuple_Pack(2, rid, writing ? Py_True : Py_False);
        Py_XDECREF(rid);
        if (key == NULL)
            goto unlock;
        PyObject *pairs = PyDict_GetItemWithError(leases, key); /* borrowed */
        Py_DECREF(key);
        if (pairs == NULL) {
            if (!PyErr_Occurred())
                rc = 0;
            goto unlock;
        }
        if (!PyTuple_Check(pairs) || PyTuple_GET_SIZE(pairs) < 2) {
            PyErr_SetString(PyExc_TypeError, "conn_leased_post: a lease is a tuple (base, size, ...)");
            goto unlock;
        }
        words[2 * k] = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(pairs, 0));
        words[2 * k + 1] = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(pairs, 1));
        if (PyErr_Occurred())
            goto unlock;
    }
    for (; counted < n; counted++) {
        if (uses_add(uses, ids[counted], 1) < 0)
            goto unlock;
    }
    if (attr_add(conn, s_copies, 1, NULL) < 0)
        goto unlock;
    rc = 1;
unlock:;
    /* No Python code runs with an error pending: it waits aside until the lock is released. */
    struct first_error e = {NULL, NULL, NULL};
    keep_error(&e);
    for (size_t k = 0; rc < 0 && k < counted; k++) { /* a failure: take back what was counted */
        if (uses_add(uses, ids[k], -1) < 0)
            keep_error(&e);
    }
    Py_XDECREF(error);
    Py_XDECREF(leases);
    Py_XDECREF(uses);
    lock_call(lock, s_release, &e);
    return restore_error(&e) < 0 ? -1 : rc;
}

/* Connection.unlease for what lease_take counted: each id's use and the copy
 * given back, the copy's waiters woken, and a connection that broke
 * meanwhile shut down once no copy runs. 0, or -1 with an error set. */
static int lease_give(PyObject *conn, PyObject *lock, const uint32_t *ids, size_t n)
{
    /* Every step runs whatever failed before it; the first error (the
     * copy's, when one is pending) is the one raised. */
    struct first_error e = {NULL, NULL, NULL};
    keep_error(&e);
    int broken = 0;
    if (lock_call(lock, s_acquire, &e) < 0) { /* the lock is not a lock */
        restore_error(&e);
        return -1;
    }
    PyObject *uses = PyObject_GetAttr(conn, s_lease_uses);
    if (uses != NULL) {
        for (size_t k = 0; k < n; k++) {
            if (uses_add(uses, ids[k], -1) < 0)
                keep_error(&e);
        }
        Py_DECREF(uses);
    }
    keep_error(&e);
    long copies = 1;
    if (attr_add(conn, s_copies, -1, &copies) < 0)
        keep_error(&e);
    PyObject *waiters = PyObject_GetAttr(conn, s_copy_waiters);
    int wake = waiters == NULL ? -1 : PyObject_IsTrue(waiters);
    Py_XDECREF(waiters);
    keep_error(&e);
    if (wake) { /* on an error too: a waiter must not sleep through it */
        PyObject *cond = PyObject_GetAttr(conn, s_copies_done);
        PyObject *woke = cond == NULL ? NULL : PyObject_CallMethodNoArgs(cond, s_notify_all);
        Py_XDECREF(cond);
        Py_XDECREF(woke);
        keep_error(&e);
    }
    PyObject *error = PyObject_GetAttr(conn, s_error);
    broken = error != NULL && error != Py_None && copies == 0;
    Py_XDECREF(error);
    keep_error(&e);
    lock_call(lock, s_release, &e);
    if (broken) { /* shutdown() came during the copy and left the socket to us */
        PyObject *got = PyObject_CallMethodNoArgs(conn, s_ended_broken);
        Py_XDECREF(got);
        keep_error(&e);
    }
    return restore_error(&e);
}

static int cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return (x > y) - (x < y);
}

/* conn_leased_post: leased_post through what connection `conn` leases. The
 * regions of the remote descriptors leased to conn for this direction and
 * their uses counted (Connection.lease), the copy (leased_post), the uses
 * given back (Connection.unlease), in one call. None, with nothing done,
 * when a region is not leased or the connection broke; else as
 * leased_post. */
static PyObject *kvx_conn_leased_post(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *conn;
    int pid, writing;
    unsigned int need, mask, granted;
    unsigned long long max_bytes;
    Py_buffer ld, bb, sb, fb, db;
    if (!PyArg_ParseTuple(args, "Oipy*y*y*y*IIy*IK:conn_leased_post", &conn, &pid, &writing, &ld, &bb, &sb, &fb,
                          &need, &mask, &db, &granted, &max_bytes))
        return NULL;
    PyObject *result = NULL, *lock = NULL;
    uint32_t small_ids[16];
    uint64_t small_words[32];
    uint32_t *ids = small_ids;
    uint64_t *words = small_words;
    size_t ndescs = (size_t)db.len / sizeof(struct kvx_desc), n = 0;
    if (db.len % (Py_ssize_t)sizeof(struct kvx_desc)) {
        PyErr_SetString(PyExc_ValueError, "conn_leased_post: malformed descriptor buffer");
        goto out;
    }
    if (ndescs > 16) {
        ids = PyMem_Malloc(ndescs * sizeof(uint32_t));
        words = PyMem_Malloc(2 * ndescs * sizeof(uint64_t));
        if (ids == NULL || words == NULL) {
            PyErr_NoMemory();
            goto out;
        }
    }
    /* The remote regions, sorted and distinct: runs of one region are common. */
    const struct kvx_desc *d = db.buf;
    for (size_t i = 0; i < ndescs; i++) {
        if (n == 0 || ids[n - 1] != d[i].region)
            ids[n++] = d[i].region;
    }
    if (n > 1) {
        qsort(ids, n, sizeof(uint32_t), cmp_u32);
        size_t m = 1;
        for (size_t i = 1; i < n; i++) {
            if (ids[i] != ids[m - 1])
                ids[m++] = ids[i];
        }
        n = m;
    }
    lock = PyObject_GetAttr(conn, s_lock);
    if (lock == NULL)
        goto out;
    int leased = lease_take(conn, lock, ids, n, writing, words);
    if (leased <= 0) {
        if (leased == 0)
            result = Py_NewRef(Py_None);
        goto out;
    }
    Py_buffer rb = {.buf = ids, .len = (Py_ssize_t)(n * sizeof(uint32_t))};
    Py_buffer lb = {.buf = words, .len = (Py_ssize_t)(2 * n * sizeof(uint64_t))};
    result = leased_post_run(pid, writing, &ld, &bb, &sb, &fb, need, mask, &db, &rb, &lb, granted, max_bytes);
    if (lease_give(conn, lock, ids, n) < 0)
        Py_CLEAR(result);
out:
    Py_XDECREF(lock);
    if (ids != small_ids)
        PyMem_Free(ids);
    if (words != small_words)
        PyMem_Free(words);
    PyBuffer_Release(&ld);
    PyBuffer_Release(&bb);
    PyBuffer_Release(&sb);
    PyBuffer_Release(&fb);
    PyBuffer_Release(&db);
    return result;
}

/* Walk two resolved range lists of equal total in order, cutting where a
 * range of either side ends and at `piece` bytes: the (dst, src, len)
 * triples of the copy. With `lens` NULL only counts them. READ copies the
 * remote ranges into the local ones; WRITE the other way. */
static size_t pair_ranges(int writing, const struct leased *r, uint64_t piece, uint64_t *srcs, uint64_t *dsts,
                          uint64_t *lens)
{
    size_t i = 0, j = 0, k = 0;
    uint64_t li = 0, rj = 0;
    while (i < r->nlocal && j < r->ndescs) {
        if (li == r->l_len[i]) {
            i++;
            li = 0;
            continue;
        }
        if (rj == r->r_len[j]) {
            j++;
            rj = 0;
            continue;
        }
        uint64_t take = r->l_len[i] - li;
        if (r->r_len[j] - rj < take)
            take = r->r_len[j] - rj;
        if (piece < take)
            take = piece;
        if (lens != NULL) {
            uint64_t local = r->l_addr[i] + li, remote = r->r_addr[j] + rj;
            dsts[k] = writing ? remote : local;
            srcs[k] = writing ? local : remote;
            lens[k] = take;
        }
        k++;
        li += take;
        rj += take;
    }
    return k;
}

/* leased_triples: the checks of leased_post for a copy that the GPU makes
 * (cuda_ipc through a lease). The lists resolved and checked
 * (leased_resolve), each local region on `device` (`devices`: int32 per
 * region), the lease's (base, size) pairs being where each leased region
 * lies in this process (its CUDA IPC mapping). Then the copy's (dst, src,
 * len) triples, each at most `piece` bytes, written at `out` (uint64 words:
 * srcs[0:n], dsts[n:2n], lens[2n:3n]; the caller owns that memory,
 * `out_words` long). No byte moves here.
 *
 * Returns n, the triples written; else, with nothing written, a pair
 * (side, index): (0, i) local descriptor i refused, (1, i) remote
 * descriptor i refused, (2, -1) the totals differ, are 0 or exceed
 * max_bytes, (3, n) `out` holds fewer than 3n words. Malformed buffers
 * raise ValueError. */
static PyObject *kvx_leased_triples(PyObject *self, PyObject *args)
{
    (void)self;
    int writing, device;
    unsigned int need, mask, granted;
    unsigned long long max_bytes, piece, out, out_words;
    Py_buffer ld, bb, sb, fb, vb, db, rb, lb;
    if (!PyArg_ParseTuple(args, "py*y*y*y*y*iIIy*y*y*IKKKK:leased_triples", &writing, &ld, &bb, &sb, &fb, &vb,
                          &device, &need, &mask, &db, &rb, &lb, &granted, &max_bytes, &piece, &out, &out_words))
        return NULL;
    PyObject *result = NULL;
    struct leased r = {0};
    if (vb.len != fb.len * 4 || piece == 0 || (out == 0 && out_words != 0)) {
        PyErr_SetString(PyExc_ValueError, "leased_triples: malformed descriptor, table, region or lease buffers");
        goto out;
    }
    if (leased_prepare("leased_triples", &ld, &bb, &sb, &fb, &db, &rb, &lb, &r) < 0)
        goto out;
    Py_ssize_t bad;
    int side;
    size_t n = 0;
    Py_BEGIN_ALLOW_THREADS
    side = leased_resolve(&r, writing, &ld, &bb, &sb, &fb, vb.buf, device, need, mask, &db, &rb, &lb, granted,
                          max_bytes, &bad);
    if (side < 0) {
        n = pair_ranges(writing, &r, piece, NULL, NULL, NULL);
        if (n <= out_words / 3) {
            uint64_t *words = (uint64_t *)(uintptr_t)out;
            pair_ranges(writing, &r, piece, words, words + n, words + 2 * n);
        }
    }
    Py_END_ALLOW_THREADS
    if (side >= 0) {
        result = Py_BuildValue("(in)", side, bad);
    } else if (n > out_words / 3) {
        result = Py_BuildValue("(in)", 3, (Py_ssize_t)n);
    } else {
        result = PyLong_FromSize_t(n);
    }
out:
    PyMem_RawFree(r.work);
    PyBuffer_Release(&ld);
    PyBuffer_Release(&bb);
    PyBuffer_Release(&sb);
    PyBuffer_Release(&fb);
    PyBuffer_Release(&vb);
    PyBuffer_Release(&db);
    PyBuffer_Release(&rb);
    PyBuffer_Release(&lb);
    return result;
}

static PyMethodDef methods[] = {
    {"descs_bad", kvx_descs_bad, METH_VARARGS, "descs_bad(descs, flags, sizes, need) -> first bad index or -1"},
    {"vm_readv", kvx_vm_readv, METH_VARARGS, "vm_readv(pid, local_addrs, local_lens, remote_addrs, remote_lens)"},
    {"vm_writev", kvx_vm_writev, METH_VARARGS,
     "vm_writev(pid, local_addrs, local_lens, remote_addrs, remote_lens)"},
    {"memcpyv", kvx_memcpyv, METH_VARARGS, "memcpyv(dsts, srcs, lens)"},
    {"leased_copy", kvx_leased_copy, METH_VARARGS,
     "leased_copy(pid, writing, local_addrs, local_lens, descs, regions, lease, granted) -> -1 or bad index"},
    {"leased_post", kvx_leased_post, METH_VARARGS,
     "leased_post(pid, writing, local_descs, bases, sizes, flags, need, mask, descs, regions, lease, granted, "
     "max_bytes) -> bytes moved or (side, index)"},
    {"conn_leased_post", kvx_conn_leased_post, METH_VARARGS,
     "conn_leased_post(conn, pid, writing, local_descs, bases, sizes, flags, need, mask, descs, granted, max_bytes) "
     "-> None (not leased), bytes moved or (side, index)"},
    {"post_check", kvx_post_check, METH_VARARGS,
     "post_check(local_descs, bases, sizes, flags, need, mask, descs, peer_sizes, peer_flags, peer_need, "
     "max_bytes) -> (addrs, lens, total) or None"},
    {"leased_triples", kvx_leased_triples, METH_VARARGS,
     "leased_triples(writing, local_descs, bases, sizes, flags, devices, device, need, mask, descs, regions, "
     "lease, granted, max_bytes, piece, out, out_words) -> triples written or (side, index)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvx._datapath._cma", "Cross-memory attach for same-host kvx peers.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__cma(void)
{
    if (intern_names() < 0)
        return NULL;
    if (array_type == NULL) {
        PyObject *array = PyImport_ImportModule("array");
        if (array == NULL)
            return NULL;
        array_type = PyObject_GetAttrString(array, "array");
        Py_DECREF(array);
        if (array_type == NULL)
            return NULL;
    }
    return PyModule_Create(&module);
}
