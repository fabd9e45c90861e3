/*
 * kvx._datapath._native: scatter-gather socket I/O for the tcp backend.
 *
 * Byte work, with one exception. For sendv and recvv Python decides which
 * memory may be touched (the agent validates every descriptor against its
 * registered regions before calling here); they move bytes between a socket
 * and lists of (address, length) pairs with sendmsg/recvmsg, batched by the
 * kernel's iovec limit, with the GIL released for the whole loop. The
 * exception: serve_read and serve_write check a peer's descriptors against
 * the region table themselves (below), as kvx.memory.RegionTable.resolve
 * does, and refuse what it would refuse.
 *
 *   sendv(fd, prefix, addrs, lens, timeout_ms) -> None
 *   recvv(fd, addrs, lens, timeout_ms) -> None
 *   wait_readable(fd, spin_us) -> bool
 *   peek(fd, nbytes) -> bytes
 *   serve_read(fd, header, payload_len, table, need, max_bytes, timeout_ms)
 *       -> None, or the descriptor payload
 *   serve_write(fd, header, payload_len, data_len, table, need, timeout_ms)
 *       -> None, or the descriptor payload
 *   recv_answer(fd, expect, addrs, lens, timeout_ms) -> bool
 *
 * addrs and lens are C-contiguous buffers of native uint64 (numpy uint64
 * arrays), of equal length. prefix is a bytes-like object sent before the
 * first descriptor (a frame header), so that a small request costs one
 * system call. timeout_ms bounds the time without progress: the call fails
 * with TimeoutError when the socket accepts or yields no byte for that long.
 * The socket may be non-blocking (EAGAIN waits in poll()) or blocking with
 * SO_RCVTIMEO/SO_SNDTIMEO set (the kernel waits; EAGAIN is the timeout).
 *
 * wait_readable polls a socket without sleeping for at most spin_us
 * microseconds (a bounded busy-poll, the GIL released): True as soon as it
 * is readable (bytes, the end of the connection, an error the next call
 * reports), False when the time ran out. A thread that expects an answer
 * within microseconds calls it before it sleeps in poll(), and saves the
 * kernel's wake-up of a sleeping thread.
 *
 * peek returns up to nbytes (1 to PEEK_MAX) of what the socket holds,
 * leaving them there (MSG_PEEK, never waiting: BlockingIOError when it holds
 * nothing, b"" at the end of the connection).
 *
 * serve_read answers a small READ_REQ whose 32-byte header the caller has
 * read: it receives the payload_len bytes of descriptors (24 bytes each:
 * uint32 region, 4 bytes of padding, uint64 offset, uint64 length; at most
 * SERVE_MAX_DESCS), then pins the regions they name (`table`, a
 * kvx.memory.RegionTable: pin_table(ids) gives (token, bases and sizes uint64,
 * flags uint8, devices int32, indexed by region id); release(token) after,
 * whatever happens), checks each descriptor (the region's flags carry
 * VALID and every bit of `need`, it is host memory (device < 0), the range
 * lies inside it) and the total against max_bytes, and sends `header` (the
 * READ_RESP frame, its last 8 bytes set here to the total, little-endian)
 * and the ranges with sendmsg (one call, unless the socket's buffer fills).
 * When a check fails it sends nothing and returns the payload, for the
 * caller to find and answer the error. No pin is held while the
 * descriptors are awaited; it is while the answer goes out.
 *
 * serve_write is its twin for a small WRITE_REQ without a notification: the
 * descriptors received, the table pinned, each descriptor checked (as
 * above, with `need` the write flags) and their total against data_len,
 * the connection checked for a reset by the initiator (which gave up on the
 * WRITE: its data must not land late; ConnectionResetError), the data
 * received into the ranges, the pin released, then `header` (the
 * WRITE_RESP) sent. Refused: the payload comes back, the data left unread
 * on the socket.
 *
 * recv_answer takes an expected answer off the socket in one recvmsg: when
 * the socket holds the 32-byte header `expect` byte for byte, then at least
 * the sum of lens more bytes, it receives the header (discarded) and those
 * bytes into the ranges and returns True; otherwise it takes nothing and
 * returns False (the caller's general path reads what is there). It
 * never waits for bytes to come.
 *
 * Python's own recv and send on a socket with a timeout poll before every
 * call; sendv and recvv try the call first and poll only when it would
 * block, and peek never polls.
 *
 * Every function has a pure-Python twin in kvx/_datapath/io_py.py; tests run both.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>

#ifndef IOV_MAX
#define IOV_MAX 1024
#endif

/* The most peek returns: a message header is 32 bytes. */
#define PEEK_MAX 4096

/* serve_read: a frame header's size, a descriptor's, the most descriptors. */
#define HEADER_BYTES 32
#define DESC_BYTES 24
#define SERVE_MAX_DESCS 64

enum io_status {
    IO_OK = 0,
    IO_ERRNO = 1,   /* errno holds the reason */
    IO_EOF = 2,     /* the peer closed the connection */
    IO_TIMEOUT = 3, /* no progress for timeout_ms */
};

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Wait until fd is ready for `events`; IO_TIMEOUT after timeout_ms.
 * On a blocking socket EAGAIN means its SO_RCVTIMEO/SO_SNDTIMEO expired:
 * the kernel already waited, so that is the timeout. */
static enum io_status wait_ready(int fd, int blocking, short events, int timeout_ms)
{
    if (blocking)
        return IO_TIMEOUT;
    struct pollfd pfd = {.fd = fd, .events = events, .revents = 0};
    int64_t end = now_ns() + (int64_t)timeout_ms * 1000000;
    int left_ms = timeout_ms;
    for (;;) {
        int rc = poll(&pfd, 1, left_ms);
        if (rc > 0)
            return IO_OK; /* readable, writable, or an error the next call reports */
        if (rc == 0)
            return IO_TIMEOUT;
        if (errno != EINTR)
            return IO_ERRNO;
        /* A signal: poll again for what is left, so that signals cannot stretch the wait. */
        if (timeout_ms < 0)
            continue;
        int64_t left_ns = end - now_ns();
        if (left_ns <= 0)
            return IO_TIMEOUT;
        left_ms = (int)((left_ns + 999999) / 1000000);
    }
}

/* Move all bytes of iov[0..iovcnt) through fd. Modifies iov in place. */
static enum io_status move_all(int fd, struct iovec *iov, size_t iovcnt, int sending,
                               int timeout_ms, size_t *moved)
{
    size_t at = 0;
    int blocking = -1; /* looked up on the first EAGAIN: most calls never wait */
    *moved = 0;
    while (at < iovcnt) {
        if (iov[at].iov_len == 0) {
            at++;
            continue;
        }
        size_t batch = iovcnt - at;
        if (batch > IOV_MAX)
            batch = IOV_MAX;
        struct msghdr msg;
        memset(&msg, 0, sizeof(msg));
        msg.msg_iov = &iov[at];
        msg.msg_iovlen = batch;
        ssize_t n = sending ? sendmsg(fd, &msg, MSG_NOSIGNAL) : recvmsg(fd, &msg, 0);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                if (blocking < 0) {
                    int flags = fcntl(fd, F_GETFL);
                    blocking = flags >= 0 && !(flags & O_NONBLOCK);
                }
                enum io_status st = wait_ready(fd, blocking, sending ? POLLOUT : POLLIN, timeout_ms);
                if (st != IO_OK)
                    return st;
                continue;
            }
            return IO_ERRNO;
        }
        if (n == 0 && !sending)
            return IO_EOF;
        *moved += (size_t)n;
        /* Skip the fully moved entries, then trim the partly moved one. */
        size_t left = (size_t)n;
        while (at < iovcnt && left >= iov[at].iov_len) {
            left -= iov[at].iov_len;
            at++;
        }
        if (left > 0) {
            iov[at].iov_base = (char *)iov[at].iov_base + left;
            iov[at].iov_len -= left;
        }
    }
    return IO_OK;
}

/* Check that addrs and lens are uint64 buffers of one length; set the pair count. */
static int get_pairs(Py_buffer *addrs, Py_buffer *lens, size_t *count)
{
    if (addrs->len % 8 != 0 || lens->len % 8 != 0 || addrs->len != lens->len) {
        PyErr_SetString(PyExc_ValueError,
                        "addrs and lens must be uint64 buffers of equal length");
        return -1;
    }
    *count = (size_t)addrs->len / 8;
    return 0;
}

static PyObject *raise_status(enum io_status st, int saved_errno, size_t moved, size_t total)
{
    switch (st) {
    case IO_EOF:
        PyErr_Format(PyExc_ConnectionResetError,
                     "connection closed by peer after %zu of %zu bytes", moved, total);
        break;
    case IO_TIMEOUT:
        PyErr_Format(PyExc_TimeoutError, "no progress on socket after %zu of %zu bytes",
                     moved, total);
        break;
    default:
        errno = saved_errno;
        PyErr_SetFromErrno(PyExc_OSError);
        break;
    }
    return NULL;
}

static PyObject *do_io(int fd, Py_buffer *prefix, Py_buffer *addrs, Py_buffer *lens,
                       int timeout_ms, int sending)
{
    size_t count = 0;
    if (get_pairs(addrs, lens, &count) < 0)
        return NULL;
    size_t has_prefix = (prefix != NULL && prefix->len > 0) ? 1 : 0;
    size_t iovcnt = count + has_prefix;
    if (iovcnt == 0)
        Py_RETURN_NONE;
    struct iovec *iov = PyMem_RawMalloc(iovcnt * sizeof(struct iovec));
    if (iov == NULL)
        return PyErr_NoMemory();

    const uint64_t *a = (const uint64_t *)addrs->buf;
    const uint64_t *l = (const uint64_t *)lens->buf;
    size_t total = 0;
    if (has_prefix) {
        iov[0].iov_base = prefix->buf;
        iov[0].iov_len = (size_t)prefix->len;
        total += (size_t)prefix->len;
    }
    for (size_t i = 0; i < count; i++) {
        iov[has_prefix + i].iov_base = (void *)(uintptr_t)a[i];
        iov[has_prefix + i].iov_len = (size_t)l[i];
        total += (size_t)l[i];
    }

    size_t moved = 0;
    enum io_status st;
    int saved_errno = 0;
    Py_BEGIN_ALLOW_THREADS
    st = move_all(fd, iov, iovcnt, sending, timeout_ms, &moved);
    saved_errno = errno;
    Py_END_ALLOW_THREADS
    PyMem_RawFree(iov);
    if (st != IO_OK)
        return raise_status(st, saved_errno, moved, total);
    Py_RETURN_NONE;
}

static PyObject *kvx_sendv(PyObject *self, PyObject *args)
{
    int fd, timeout_ms;
    Py_buffer prefix, addrs, lens;
    (void)self;
    if (!PyArg_ParseTuple(args, "iy*y*y*i:sendv", &fd, &prefix, &addrs, &lens, &timeout_ms))
        return NULL;
    PyObject *res = do_io(fd, &prefix, &addrs, &lens, timeout_ms, 1);
    PyBuffer_Release(&prefix);
    PyBuffer_Release(&addrs);
    PyBuffer_Release(&lens);
    return res;
}

static PyObject *kvx_recvv(PyObject *self, PyObject *args)
{
    int fd, timeout_ms;
    Py_buffer addrs, lens;
    (void)self;
    if (!PyArg_ParseTuple(args, "iy*y*i:recvv", &fd, &addrs, &lens, &timeout_ms))
        return NULL;
    PyObject *res = do_io(fd, NULL, &addrs, &lens, timeout_ms, 0);
    PyBuffer_Release(&addrs);
    PyBuffer_Release(&lens);
    return res;
}

static PyObject *kvx_wait_readable(PyObject *self, PyObject *args)
{
    int fd, spin_us;
    (void)self;
    if (!PyArg_ParseTuple(args, "ii:wait_readable", &fd, &spin_us))
        return NULL;
    if (spin_us < 0 || fd < 0) {
        PyErr_SetString(PyExc_ValueError, spin_us < 0 ? "spin_us must not be negative" : "fd must not be negative");
        return NULL;
    }
    int ready = 0;
    Py_BEGIN_ALLOW_THREADS
    struct pollfd pfd = {.fd = fd, .events = POLLIN, .revents = 0};
    int64_t end = now_ns() + (int64_t)spin_us * 1000;
    for (;;) {
        int rc = poll(&pfd, 1, 0);
        if (rc > 0 || (rc < 0 && errno != EINTR)) {
            ready = 1; /* readable, or an error the caller's next call reports */
            break;
        }
        if (now_ns() >= end)
            break;
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#elif defined(__aarch64__)
        __asm__ __volatile__("yield");
#endif
    }
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(ready);
}

static PyObject *kvx_peek(PyObject *self, PyObject *args)
{
    int fd, nbytes;
    (void)self;
    if (!PyArg_ParseTuple(args, "ii:peek", &fd, &nbytes))
        return NULL;
    if (fd < 0) {
        PyErr_SetString(PyExc_ValueError, "fd must not be negative");
        return NULL;
    }
    if (nbytes < 1 || nbytes > PEEK_MAX) {
        PyErr_Format(PyExc_ValueError, "nbytes must be 1 to %d", PEEK_MAX);
        return NULL;
    }
    char buf[PEEK_MAX];
    ssize_t n;
    do {
        n = recv(fd, buf, (size_t)nbytes, MSG_PEEK | MSG_DONTWAIT);
    } while (n < 0 && errno == EINTR);
    if (n < 0)
        return PyErr_SetFromErrno(PyExc_OSError); /* EAGAIN: BlockingIOError */
    return PyBytes_FromStringAndSize(buf, n);
}

/* The wire is little-endian; descriptors and the header's length are read
 * and written in host order. */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "kvx's wire format is little-endian; this host is not"
#endif

struct wire_desc {
    uint32_t region;
    uint32_t pad;
    uint64_t offset;
    uint64_t length;
};

/* serve_read's checks: the iovecs of the ranges and their total, or -1 when
 * a descriptor or the total is refused. */
static int serve_resolve(const struct wire_desc *d, size_t nd, const uint64_t *bases, const uint64_t *sizes,
                         const uint8_t *flags, const int32_t *devices, size_t top, unsigned int need,
                         uint64_t max_bytes, struct iovec *iov, uint64_t *total)
{
    uint64_t t = 0;
    for (size_t i = 0; i < nd; i++) {
        uint32_t r = d[i].region;
        if (r >= top || (flags[r] & need) != need || devices[r] >= 0)
            return -1;
        uint64_t base = bases[r], size = sizes[r], off = d[i].offset, n = d[i].length;
        if (off > size || n > size - off || base > UINT64_MAX - off || n > UINT64_MAX - (base + off) ||
            n > max_bytes - t)
            return -1;
        iov[i].iov_base = (void *)(uintptr_t)(base + off);
        iov[i].iov_len = (size_t)n;
        t += n;
    }
    *total = t;
    return 0;
}

static PyObject *s_pin_table, *s_release; /* RegionTable's methods, interned */

/* Fill `b` from a C-contiguous buffer of `itemsize`-byte items; 0 or -1. */
static int table_buffer(const char *name, PyObject *obj, Py_buffer *b, Py_ssize_t itemsize, Py_ssize_t count)
{
    if (PyObject_GetBuffer(obj, b, PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    if (b->len != itemsize * count) {
        PyBuffer_Release(b);
        PyErr_Format(PyExc_ValueError,
                     "%s: pin_table() must give (token, bases u64, sizes u64, flags u8, devices i32) of one length",
                     name);
        return -1;
    }
    return 0;
}

/* serve_read's and serve_write's work under the pin: the table's arrays
 * taken from `pinned` (pin_table's tuple), the descriptors resolved (their
 * total at most `limit`; for a write, exactly `limit`, the data announced),
 * then for a read the header and the ranges sent, for a write the data
 * received into the ranges. 1: refused, nothing moved; 0: done; -1: a
 * Python error set. */
static int serve_pinned(int writing, int fd, const Py_buffer *header, const struct wire_desc *descs, size_t nd,
                        PyObject *pinned, unsigned int need, uint64_t limit, int timeout_ms)
{
    /* `pinned` is a 5-tuple: serve_request checked. */
    const char *name = writing ? "serve_write" : "serve_read";
    Py_buffer fb, bb, sb, db;
    if (PyObject_GetBuffer(PyTuple_GET_ITEM(pinned, 3), &fb, PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    Py_ssize_t top = fb.len;
    int rc = -1;
    if (table_buffer(name, PyTuple_GET_ITEM(pinned, 1), &bb, 8, top) < 0)
        goto no_bases;
    if (table_buffer(name, PyTuple_GET_ITEM(pinned, 2), &sb, 8, top) < 0)
        goto no_sizes;
    if (table_buffer(name, PyTuple_GET_ITEM(pinned, 4), &db, 4, top) < 0)
        goto no_devices;
    struct iovec iov[SERVE_MAX_DESCS + 1];
    uint64_t total = 0;
    if (serve_resolve(descs, nd, bb.buf, sb.buf, fb.buf, db.buf, (size_t)top, need, limit, iov + 1, &total) ||
        (writing && total != limit)) {
        rc = 1;
        goto done;
    }
    size_t moved = 0;
    enum io_status st;
    int saved_errno = 0;
    if (writing) {
        /* The initiator reset the connection: it gave up on this WRITE, which
         * must not land late, over newer data (InboundConnection.abandoned). */
        int err = 0;
        socklen_t errlen = sizeof(err);
        if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &errlen) != 0 || err != 0) {
            PyErr_SetString(PyExc_ConnectionResetError,
                            "the initiator reset the connection; its buffered WRITE is dropped");
            goto done;
        }
        Py_BEGIN_ALLOW_THREADS
        st = move_all(fd, iov + 1, nd, 0, timeout_ms, &moved);
        saved_errno = errno;
        Py_END_ALLOW_THREADS
    } else {
        unsigned char frame[HEADER_BYTES];
        memcpy(frame, header->buf, HEADER_BYTES);
        for (int i = 0; i < 8; i++)
            frame[HEADER_BYTES - 8 + i] = (unsigned char)(total >> (8 * i));
        iov[0].iov_base = frame;
        iov[0].iov_len = HEADER_BYTES;
        Py_BEGIN_ALLOW_THREADS
        st = move_all(fd, iov, nd + 1, 1, timeout_ms, &moved);
        saved_errno = errno;
        Py_END_ALLOW_THREADS
    }
    if (st != IO_OK)
        raise_status(st, saved_errno, moved, (writing ? 0 : HEADER_BYTES) + (size_t)total);
    else
        rc = 0;
done:
    PyBuffer_Release(&db);
no_devices:
    PyBuffer_Release(&sb);
no_sizes:
    PyBuffer_Release(&bb);
no_bases:
    PyBuffer_Release(&fb);
    return rc;
}

/* serve_read and serve_write: the descriptors received with nothing pinned
 * (a peer that sends them slowly holds up no deregister), the table pinned,
 * the work done, the pin released whatever happened; for a write, then the
 * header (the WRITE_RESP) sent. */
static PyObject *serve_request(int writing, int fd, Py_buffer *header, Py_ssize_t payload_len, PyObject *table,
                               unsigned int need, unsigned long long limit, int timeout_ms)
{
    const char *name = writing ? "serve_write" : "serve_read";
    if (header->len != HEADER_BYTES) {
        PyErr_Format(PyExc_ValueError, "%s: the header must be 32 bytes", name);
        return NULL;
    }
    if (payload_len <= 0 || payload_len > SERVE_MAX_DESCS * DESC_BYTES || payload_len % DESC_BYTES) {
        PyErr_Format(PyExc_ValueError, "%s: 1 to %d whole descriptors of %d bytes", name, SERVE_MAX_DESCS,
                     DESC_BYTES);
        return NULL;
    }
    struct wire_desc descs[SERVE_MAX_DESCS];
    struct iovec piov = {.iov_base = descs, .iov_len = (size_t)payload_len};
    size_t moved = 0;
    enum io_status st;
    int saved_errno = 0;
    Py_BEGIN_ALLOW_THREADS
    st = move_all(fd, &piov, 1, 0, timeout_ms, &moved);
    saved_errno = errno;
    Py_END_ALLOW_THREADS
    if (st != IO_OK)
        return raise_status(st, saved_errno, moved, (size_t)payload_len);
    /* Pin only the regions the descriptors name (pin_table(ids)): a request that lasts,
     * its data trickled by its peer, holds back no other region's deregistration. */
    size_t nd = (size_t)payload_len / DESC_BYTES, nids = 0;
    uint32_t ids[SERVE_MAX_DESCS];
    for (size_t i = 0; i < nd; i++) {
        size_t j = 0;
        while (j < nids && ids[j] != descs[i].region)
            j++;
        if (j == nids)
            ids[nids++] = descs[i].region;
    }
    PyObject *id_tuple = PyTuple_New((Py_ssize_t)nids);
    if (id_tuple == NULL)
        return NULL;
    for (size_t j = 0; j < nids; j++) {
        PyObject *id = PyLong_FromUnsignedLong(ids[j]);
        if (id == NULL) {
            Py_DECREF(id_tuple);
            return NULL;
        }
        PyTuple_SET_ITEM(id_tuple, (Py_ssize_t)j, id);
    }
    PyObject *pinned = PyObject_CallMethodOneArg(table, s_pin_table, id_tuple);
    Py_DECREF(id_tuple);
    if (pinned == NULL)
        return NULL;
    if (!PyTuple_Check(pinned) || PyTuple_GET_SIZE(pinned) != 5) {
        /* Not the pin expected: give back what looks like its token, then refuse. */
        PyObject *token = PySequence_Check(pinned) ? PySequence_GetItem(pinned, 0) : NULL;
        PyErr_Clear();
        if (token != NULL) {
            PyObject *r = PyObject_CallMethodOneArg(table, s_release, token);
            Py_XDECREF(r);
            Py_DECREF(token);
            PyErr_Clear();
        }
        PyErr_Format(PyExc_ValueError, "%s: pin_table() must give a 5-tuple", name);
        Py_DECREF(pinned);
        return NULL;
    }
    /* VALID (bit 0) always: pin_table's contract reads only regions that carry it. */
    int rc = serve_pinned(writing, fd, header, descs, (size_t)payload_len / DESC_BYTES, pinned, need | 1u,
                          (uint64_t)limit, timeout_ms);
    /* The pin goes back whatever happened; the first error wins. */
    PyObject *et, *ev, *etb;
    PyErr_Fetch(&et, &ev, &etb);
    PyObject *r = PyObject_CallMethodOneArg(table, s_release, PyTuple_GET_ITEM(pinned, 0));
    Py_DECREF(pinned);
    if (r == NULL) {
        if (et != NULL) {
            PyErr_Clear();
            PyErr_Restore(et, ev, etb);
        }
        return NULL;
    }
    Py_DECREF(r);
    if (et != NULL) {
        PyErr_Restore(et, ev, etb);
        return NULL;
    }
    if (rc == 1)
        return PyBytes_FromStringAndSize((const char *)descs, payload_len);
    if (writing) {
        struct iovec hiov = {.iov_base = header->buf, .iov_len = HEADER_BYTES};
        Py_BEGIN_ALLOW_THREADS
        st = move_all(fd, &hiov, 1, 1, timeout_ms, &moved);
        saved_errno = errno;
        Py_END_ALLOW_THREADS
        if (st != IO_OK)
            return raise_status(st, saved_errno, moved, HEADER_BYTES);
    }
    Py_RETURN_NONE;
}

static PyObject *kvx_serve_read(PyObject *self, PyObject *args)
{
    int fd, timeout_ms;
    unsigned int need;
    long long max_bytes;
    Py_ssize_t payload_len;
    Py_buffer header;
    PyObject *table;
    (void)self;
    if (!PyArg_ParseTuple(args, "iy*nOILi:serve_read", &fd, &header, &payload_len, &table, &need, &max_bytes,
                          &timeout_ms))
        return NULL;
    if (max_bytes < 0) {
        PyBuffer_Release(&header);
        PyErr_SetString(PyExc_ValueError, "serve_read: max_bytes must not be negative");
        return NULL;
    }
    PyObject *result =
        serve_request(0, fd, &header, payload_len, table, need, (unsigned long long)max_bytes, timeout_ms);
    PyBuffer_Release(&header);
    return result;
}

static PyObject *kvx_serve_write(PyObject *self, PyObject *args)
{
    int fd, timeout_ms;
    unsigned int need;
    long long data_len;
    Py_ssize_t payload_len;
    Py_buffer header;
    PyObject *table;
    (void)self;
    if (!PyArg_ParseTuple(args, "iy*nLOIi:serve_write", &fd, &header, &payload_len, &data_len, &table, &need,
                          &timeout_ms))
        return NULL;
    if (data_len < 0) {
        PyBuffer_Release(&header);
        PyErr_SetString(PyExc_ValueError, "serve_write: data_len must not be negative");
        return NULL;
    }
    PyObject *result =
        serve_request(1, fd, &header, payload_len, table, need, (unsigned long long)data_len, timeout_ms);
    PyBuffer_Release(&header);
    return result;
}

static PyObject *kvx_recv_answer(PyObject *self, PyObject *args)
{
    int fd, timeout_ms;
    Py_buffer expect, addrs, lens;
    (void)self;
    if (!PyArg_ParseTuple(args, "iy*y*y*i:recv_answer", &fd, &expect, &addrs, &lens, &timeout_ms))
        return NULL;
    PyObject *result = NULL;
    struct iovec *iov = NULL;
    size_t count = 0;
    if (fd < 0) {
        PyErr_SetString(PyExc_ValueError, "fd must not be negative");
        goto done;
    }
    if (expect.len != HEADER_BYTES) {
        PyErr_SetString(PyExc_ValueError, "recv_answer: the expected header must be 32 bytes");
        goto done;
    }
    if (get_pairs(&addrs, &lens, &count) < 0)
        goto done;
    const uint64_t *a = addrs.buf, *l = lens.buf;
    uint64_t total = HEADER_BYTES;
    for (size_t i = 0; i < count; i++) {
        if (l[i] > (uint64_t)INT_MAX - total) { /* more than FIONREAD can count: not ours to take */
            result = Py_False;
            Py_INCREF(result);
            goto done;
        }
        total += l[i];
    }
    iov = PyMem_RawMalloc((count + 1) * sizeof(struct iovec));
    if (iov == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    unsigned char scratch[HEADER_BYTES];
    iov[0].iov_base = scratch;
    iov[0].iov_len = HEADER_BYTES;
    for (size_t i = 0; i < count; i++) {
        iov[1 + i].iov_base = (void *)(uintptr_t)a[i];
        iov[1 + i].iov_len = (size_t)l[i];
    }
    int took = 0, saved_errno = 0;
    size_t moved = 0;
    enum io_status st = IO_OK;
    Py_BEGIN_ALLOW_THREADS
    int avail = 0;
    ssize_t n;
    if (ioctl(fd, FIONREAD, &avail) == 0 && (uint64_t)avail >= total) {
        do {
            n = recv(fd, scratch, HEADER_BYTES, MSG_PEEK | MSG_DONTWAIT);
        } while (n < 0 && errno == EINTR);
        if (n == HEADER_BYTES && memcmp(scratch, expect.buf, HEADER_BYTES) == 0) {
            took = 1; /* all of it is buffered: this recvmsg does not wait on the peer */
            st = move_all(fd, iov, count + 1, 0, timeout_ms, &moved);
            saved_errno = errno;
        }
    }
    Py_END_ALLOW_THREADS
    if (st != IO_OK) {
        raise_status(st, saved_errno, moved, (size_t)total);
        goto done;
    }
    result = took ? Py_True : Py_False;
    Py_INCREF(result);
done:
    PyMem_RawFree(iov);
    PyBuffer_Release(&expect);
    PyBuffer_Release(&addrs);
    PyBuffer_Release(&lens);
    return result;
}

static PyMethodDef kvx_methods[] = {
    {"sendv", kvx_sendv, METH_VARARGS,
     "sendv(fd, prefix, addrs, lens, timeout_ms): send prefix, then each (addr, len)."},
    {"recvv", kvx_recvv, METH_VARARGS,
     "recvv(fd, addrs, lens, timeout_ms): receive exactly into each (addr, len)."},
    {"wait_readable", kvx_wait_readable, METH_VARARGS,
     "wait_readable(fd, spin_us): poll fd without sleeping for up to spin_us; True once readable."},
    {"peek", kvx_peek, METH_VARARGS,
     "peek(fd, nbytes): up to nbytes of what the socket holds, left there; never waits."},
    {"serve_read", kvx_serve_read, METH_VARARGS,
     "serve_read(fd, header, payload_len, table, need, max_bytes, timeout_ms): "
     "answer a small READ_REQ; None once sent, else its descriptor payload, nothing sent."},
    {"serve_write", kvx_serve_write, METH_VARARGS,
     "serve_write(fd, header, payload_len, data_len, table, need, timeout_ms): "
     "take a small WRITE_REQ's data and answer header; None once done, else its descriptor payload, "
     "nothing more read."},
    {"recv_answer", kvx_recv_answer, METH_VARARGS,
     "recv_answer(fd, expect, addrs, lens, timeout_ms): take the answer whose header is expect "
     "and whose data fills the ranges, once all of it is buffered; False, nothing taken, otherwise."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef kvx_module = {
    PyModuleDef_HEAD_INIT, "kvx._datapath._native", "Scatter-gather socket I/O for kvx.", -1, kvx_methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void)
{
    if (s_pin_table == NULL && (s_pin_table = PyUnicode_InternFromString("pin_table")) == NULL)
        return NULL;
    if (s_release == NULL && (s_release = PyUnicode_InternFromString("release")) == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&kvx_module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "IOV_MAX", IOV_MAX) < 0 ||
        PyModule_AddIntConstant(m, "PEEK_MAX", PEEK_MAX) < 0 ||
        PyModule_AddIntConstant(m, "SERVE_MAX_DESCS", SERVE_MAX_DESCS) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
