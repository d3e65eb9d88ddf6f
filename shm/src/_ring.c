/* CPython binding of the ring core: segments (shm_open + mmap), GIL-free waits, exceptions.
 * The Python-facing API with its documentation lives in shm/ring.py and shm/control.py. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ring.h"

/* Blocking waits sleep at most this long at a time, to notice a dead peer and to run
 * Python's signal handlers (Ctrl-C) promptly. An idle waiter wakes 4 times a second. */
#define WAIT_SLICE_NS 250000000LL

static PyObject *RingError, *SegmentError, *PeerDiedError, *RecordTooLargeError;

/* ---- segments ------------------------------------------------------------------------- */

typedef struct {
    void *base;
    size_t size;
} mapping;

static int valid_name(const char *name) {
    size_t n = strlen(name);
    if (n < 2 || n > 250 || name[0] != '/')
        return 0;
    return strchr(name + 1, '/') == NULL;
}

/* Create (O_EXCL) or open a segment and map it; raises OSError naming the segment.
 * `populate` prefaults the whole mapping (MAP_POPULATE, best effort): the segment's pages are
 * allocated and this process's page tables filled now, so that no push or pop takes a
 * first-touch page fault (tens of microseconds in a VM) in the middle of a record's latency. */
static int map_segment(const char *name, size_t create_size, int populate, mapping *m) {
    int fd, flags = O_RDWR | (create_size ? O_CREAT | O_EXCL : 0);
    if (!valid_name(name)) {
        PyErr_Format(PyExc_ValueError,
                     "bad shared-memory name '%s': it must be '/' followed by 1-249 characters "
                     "without another '/'",
                     name);
        return -1;
    }
    Py_BEGIN_ALLOW_THREADS
    fd = shm_open(name, flags, 0600);
    Py_END_ALLOW_THREADS
    if (fd < 0) {
        PyErr_SetFromErrnoWithFilename(PyExc_OSError, name);
        return -1;
    }
    size_t size = create_size;
    if (create_size) {
        if (ftruncate(fd, (off_t)create_size) != 0) {
            PyErr_SetFromErrnoWithFilename(PyExc_OSError, name);
            close(fd);
            shm_unlink(name);
            return -1;
        }
    } else {
        struct stat st;
        if (fstat(fd, &st) != 0) {
            PyErr_SetFromErrnoWithFilename(PyExc_OSError, name);
            close(fd);
            return -1;
        }
        size = (size_t)st.st_size;
        if (size == 0) {
            close(fd);
            PyErr_Format(SegmentError, "segment %s is empty: not an omni-gateway segment", name);
            return -1;
        }
    }
    void *base = mmap(NULL, size, PROT_READ | PROT_WRITE,
                      MAP_SHARED | (populate ? MAP_POPULATE : 0), fd, 0);
    close(fd);
    if (base == MAP_FAILED) {
        PyErr_SetFromErrnoWithFilename(PyExc_OSError, name);
        if (create_size)
            shm_unlink(name);
        return -1;
    }
    m->base = base;
    m->size = size;
    return 0;
}

static int raise_status(og_status st, const char *name) {
    switch (st) {
    case OG_BAD_MAGIC:
        PyErr_Format(SegmentError, "segment %s has a wrong magic: it is not an omni-gateway "
                                   "segment of this kind (or is still being created)", name);
        break;
    case OG_BAD_VERSION:
        PyErr_Format(SegmentError, "segment %s has layout version other than %u: it was made "
                                   "by a different omni-gateway build", name, OG_LAYOUT_VERSION);
        break;
    case OG_BAD_SIZE:
        PyErr_Format(SegmentError, "segment %s is smaller than its header says", name);
        break;
    case OG_CORRUPT:
        PyErr_Format(SegmentError, "ring %s holds a corrupt record header", name);
        break;
    default:
        PyErr_Format(RingError, "ring %s: unexpected status %d", name, (int)st);
    }
    return -1;
}

/* ---- Control -------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    og_control_shared *shared;
    size_t size;
    char name[256];
    int owner;
} ControlObject;

static PyTypeObject ControlType;

static int control_check(ControlObject *self) {
    if (self->shared == NULL) {
        PyErr_Format(PyExc_ValueError, "control segment %s is closed", self->name);
        return -1;
    }
    return 0;
}

static PyObject *control_new(const char *name, uint32_t max_sessions, int create) {
    mapping m;
    if (create && max_sessions == 0) {
        PyErr_SetString(PyExc_ValueError, "max_sessions must be at least 1");
        return NULL;
    }
    if (map_segment(name, create ? og_control_segment_size(max_sessions) : 0, 1, &m) < 0)
        return NULL;
    if (create)
        og_control_init(m.base, max_sessions, (int32_t)getpid());
    og_status st = og_control_open(m.base, m.size);
    if (st != OG_OK) {
        munmap(m.base, m.size);
        raise_status(st, name);
        return NULL;
    }
    ControlObject *self = PyObject_New(ControlObject, &ControlType);
    if (!self) {
        munmap(m.base, m.size);
        if (create)
            shm_unlink(name);
        return NULL;
    }
    self->shared = m.base;
    self->size = m.size;
    snprintf(self->name, sizeof self->name, "%s", name);
    self->owner = create;
    return (PyObject *)self;
}

/* Parse a session id argument against the segment; -1 with an exception when it is bad. */
static int session_arg(ControlObject *self, PyObject *arg, uint32_t *session) {
    unsigned long value = PyLong_AsUnsignedLong(arg);
    if ((value == (unsigned long)-1 && PyErr_Occurred()) || control_check(self) < 0)
        return -1;
    if (value >= self->shared->max_sessions) {
        PyErr_Format(PyExc_ValueError, "session %lu is outside control segment %s "
                     "(max_sessions=%u)", value, self->name, self->shared->max_sessions);
        return -1;
    }
    *session = (uint32_t)value;
    return 0;
}

static PyObject *Control_epoch(ControlObject *self, PyObject *arg) {
    uint32_t session, epoch;
    if (session_arg(self, arg, &session) < 0)
        return NULL;
    og_control_epoch(self->shared, session, &epoch);
    return PyLong_FromUnsignedLong(epoch);
}

static PyObject *Control_cancel(ControlObject *self, PyObject *arg) {
    uint32_t session, epoch;
    if (session_arg(self, arg, &session) < 0)
        return NULL;
    og_control_cancel(self->shared, session, &epoch);
    return PyLong_FromUnsignedLong(epoch);
}

static PyObject *Control_advance(ControlObject *self, PyObject *args) {
    PyObject *session_obj, *epoch_obj;
    uint32_t session, now;
    if (!PyArg_ParseTuple(args, "OO:advance", &session_obj, &epoch_obj))
        return NULL;
    if (session_arg(self, session_obj, &session) < 0)
        return NULL;
    unsigned long long epoch = PyLong_AsUnsignedLongLong(epoch_obj);
    if (epoch == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    if (epoch > 0xFFFFFFFFull) {
        PyErr_Format(PyExc_ValueError, "advance: epoch %llu is not a 32-bit epoch", epoch);
        return NULL;
    }
    og_control_advance(self->shared, session, (uint32_t)epoch, &now);
    return PyLong_FromUnsignedLong(now);
}

static PyObject *Control_claim(ControlObject *self, PyObject *args) {
    uint32_t session;
    unsigned int first = 0, step = 1;
    if (!PyArg_ParseTuple(args, "|II:claim", &first, &step))
        return NULL;
    if (control_check(self) < 0)
        return NULL;
    if (step == 0) {
        PyErr_SetString(PyExc_ValueError, "claim: step must be at least 1");
        return NULL;
    }
    if (og_control_claim(self->shared, (int32_t)getpid(), first, step, &session) != OG_OK)
        Py_RETURN_NONE;
    return PyLong_FromUnsignedLong(session);
}

static PyObject *Control_release(ControlObject *self, PyObject *arg) {
    uint32_t session;
    if (session_arg(self, arg, &session) < 0)
        return NULL;
    og_control_release(self->shared, session);
    Py_RETURN_NONE;
}

static PyObject *Control_holder(ControlObject *self, PyObject *arg) {
    uint32_t session;
    int32_t pid;
    if (session_arg(self, arg, &session) < 0)
        return NULL;
    og_control_holder(self->shared, session, &pid);
    return PyLong_FromLong(pid);
}

static PyObject *Control_close(ControlObject *self, PyObject *unused) {
    if (self->shared) {
        munmap(self->shared, self->size);
        self->shared = NULL;
        if (self->owner)
            shm_unlink(self->name);
    }
    Py_RETURN_NONE;
}

static void Control_dealloc(ControlObject *self) {
    Py_XDECREF(Control_close(self, NULL));
    PyObject_Free(self);
}

static PyObject *Control_get_max_sessions(ControlObject *self, void *c) {
    if (control_check(self) < 0)
        return NULL;
    return PyLong_FromUnsignedLong(self->shared->max_sessions);
}
static PyObject *Control_get_owner_pid(ControlObject *self, void *c) {
    if (control_check(self) < 0)
        return NULL;
    return PyLong_FromLong(self->shared->owner_pid);
}
static PyObject *Control_get_name(ControlObject *self, void *c) {
    return PyUnicode_FromString(self->name);
}
static PyObject *Control_get_closed(ControlObject *self, void *c) {
    return PyBool_FromLong(self->shared == NULL);
}

static PyMethodDef Control_methods[] = {
    {"epoch", (PyCFunction)Control_epoch, METH_O, "The session's current epoch."},
    {"cancel", (PyCFunction)Control_cancel, METH_O, "Increment the session's epoch; return it."},
    {"advance", (PyCFunction)Control_advance, METH_VARARGS,
     "advance(session, epoch): raise the session's epoch to epoch unless it is there or past it; "
     "return the epoch after."},
    {"claim", (PyCFunction)Control_claim, METH_VARARGS,
     "claim(first=0, step=1): claim the lowest free slot of first, first+step, ..."},
    {"release", (PyCFunction)Control_release, METH_O, "Free a session slot."},
    {"holder", (PyCFunction)Control_holder, METH_O, "pid holding a slot, 0 if free."},
    {"close", (PyCFunction)Control_close, METH_NOARGS, "Unmap (and unlink, for the owner)."},
    {NULL}};

static PyGetSetDef Control_getset[] = {
    {"max_sessions", (getter)Control_get_max_sessions, NULL, NULL, NULL},
    {"owner_pid", (getter)Control_get_owner_pid, NULL, NULL, NULL},
    {"name", (getter)Control_get_name, NULL, NULL, NULL},
    {"closed", (getter)Control_get_closed, NULL, NULL, NULL},
    {NULL}};

static PyTypeObject ControlType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "shm._ring.ControlCore",
    .tp_basicsize = sizeof(ControlObject),
    .tp_dealloc = (destructor)Control_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_methods = Control_methods,
    .tp_getset = Control_getset,
};

/* ---- Ring ----------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    og_ring ring;
    void *base;
    size_t size;
    char name[256];
    int owner;
    int32_t self_pid;
    int producer_registered, consumer_registered;
    ControlObject *control;
    /* the record handed out by pop_view, exported through the buffer protocol */
    const uint8_t *view_ptr;
    Py_ssize_t view_len;
    int view_held;
    Py_ssize_t exports;
} RingObject;

static PyTypeObject RingType;

static int ring_check(RingObject *self) {
    if (self->base == NULL) {
        PyErr_Format(PyExc_ValueError, "ring %s is closed", self->name);
        return -1;
    }
    return 0;
}

static PyObject *ring_new(const char *name, uint64_t capacity, int create, PyObject *control) {
    mapping m;
    if (control != Py_None && !PyObject_TypeCheck(control, &ControlType)) {
        PyErr_SetString(PyExc_TypeError, "control must be a ControlCore or None");
        return NULL;
    }
    if (create && (capacity < 256 || (capacity & (capacity - 1)) != 0)) {
        PyErr_Format(PyExc_ValueError, "ring capacity must be a power of two >= 256, got %llu",
                     (unsigned long long)capacity);
        return NULL;
    }
    if (map_segment(name, create ? og_ring_segment_size(capacity) : 0, 1, &m) < 0)
        return NULL;
    if (create)
        og_ring_init(m.base, capacity, (int32_t)getpid());
    RingObject *self = PyObject_New(RingObject, &RingType);
    if (!self) {
        munmap(m.base, m.size);
        if (create)
            shm_unlink(name);
        return NULL;
    }
    og_status st = og_ring_open(&self->ring, m.base, m.size);
    if (st != OG_OK) {
        munmap(m.base, m.size);
        self->base = NULL;
        self->control = NULL;
        self->owner = 0;
        snprintf(self->name, sizeof self->name, "%s", name);
        raise_status(st, name);
        Py_DECREF(self);
        return NULL;
    }
    self->base = m.base;
    self->size = m.size;
    snprintf(self->name, sizeof self->name, "%s", name);
    self->owner = create;
    self->self_pid = (int32_t)getpid();
    self->producer_registered = self->consumer_registered = 0;
    self->view_ptr = NULL;
    self->view_len = 0;
    self->view_held = 0;
    self->exports = 0;
    self->control = NULL;
    if (control != Py_None) {
        Py_INCREF(control);
        self->control = (ControlObject *)control;
        self->ring.control = self->control->shared;
    }
    return (PyObject *)self;
}

static int ring_control_ok(RingObject *self) {
    if (self->control && self->control->shared == NULL) {
        PyErr_Format(PyExc_ValueError, "ring %s: its control segment %s is closed", self->name,
                     self->control->name);
        return -1;
    }
    return 0;
}

/* Deadline arithmetic: timeout < 0 means forever. */
static int64_t slice_for(int64_t deadline, uint64_t now) {
    if (deadline < 0)
        return WAIT_SLICE_NS;
    int64_t left = deadline - (int64_t)now;
    if (left <= 0)
        return 0;
    return left < WAIT_SLICE_NS ? left : WAIT_SLICE_NS;
}

static int64_t deadline_from(PyObject *timeout, int *ok) {
    *ok = 1;
    if (timeout == Py_None)
        return -1;
    double t = PyFloat_AsDouble(timeout);
    if (t == -1.0 && PyErr_Occurred()) {
        *ok = 0;
        return 0;
    }
    if (t < 0) {
        PyErr_SetString(PyExc_ValueError, "timeout must be >= 0 or None");
        *ok = 0;
        return 0;
    }
    return (int64_t)og_monotonic_ns() + (int64_t)(t * 1e9);
}

/* Sleep one slice; returns 0 to look again, 1 when the deadline passed, -1 with an exception. */
static int wait_slice(RingObject *self, int64_t deadline, int writer, uint32_t length) {
    int64_t slice = slice_for(deadline, og_monotonic_ns());
    if (slice == 0)
        return 1;
    int32_t peer = writer ? atomic_load(&self->ring.shared->cons.pid)
                          : atomic_load(&self->ring.shared->prod.pid);
    og_status st;
    Py_BEGIN_ALLOW_THREADS
    st = writer ? og_ring_wait_writable(&self->ring, length, slice)
                : og_ring_wait_readable(&self->ring, slice);
    Py_END_ALLOW_THREADS
    switch (st) {
    case OG_OK:
    case OG_TIMEOUT:
    case OG_INTERRUPTED:
        /* lets Ctrl-C through: the signal interrupts the sleep, or, when it landed between
         * Python's last check and the futex call, is seen at the end of this slice */
        return PyErr_CheckSignals() < 0 ? -1 : 0;
    case OG_PEER_DIED:
        PyErr_Format(PeerDiedError, "ring %s: the %s (pid %d) died", self->name,
                     writer ? "consumer" : "producer", (int)peer);
        return -1;
    default:
        return raise_status(st, self->name);
    }
}

static PyObject *Ring_push(RingObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"payload", "session", "kind", "epoch", "flags", "timeout", NULL};
    Py_buffer buf;
    unsigned int session, kind, flags = 0;
    PyObject *epoch_obj = Py_None, *timeout = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "y*II|OIO", kwlist, &buf, &session, &kind,
                                     &epoch_obj, &flags, &timeout))
        return NULL;
    PyObject *result = NULL;
    if (ring_check(self) < 0 || ring_control_ok(self) < 0)
        goto done;
    if (kind >= OG_KIND_RESERVED || flags > 0xFFFF) {
        PyErr_Format(PyExc_ValueError, "kind must be below 0x%x and flags fit 16 bits "
                     "(got kind=%u flags=%u)", OG_KIND_RESERVED, kind, flags);
        goto done;
    }
    if ((uint64_t)buf.len > og_ring_max_payload(self->ring.mask + 1)) {
        PyErr_Format(RecordTooLargeError, "payload of %zd bytes exceeds ring %s's largest "
                     "record payload of %llu bytes", buf.len, self->name,
                     (unsigned long long)og_ring_max_payload(self->ring.mask + 1));
        goto done;
    }
    og_record_header hdr = {.kind = (uint16_t)kind, .flags = (uint16_t)flags,
                            .session = session};
    if (epoch_obj != Py_None) {
        unsigned long e = PyLong_AsUnsignedLong(epoch_obj);
        if (e == (unsigned long)-1 && PyErr_Occurred())
            goto done;
        hdr.epoch = (uint32_t)e;
    }
    if (self->control) {
        uint32_t current;
        if (og_control_epoch(self->control->shared, session, &current) != OG_OK) {
            PyErr_Format(PyExc_ValueError, "session %u is outside control segment %s "
                         "(max_sessions=%u)", session, self->control->name,
                         self->control->shared->max_sessions);
            goto done;
        }
        if (epoch_obj == Py_None)
            hdr.epoch = current;
    }
    int ok;
    int64_t deadline = deadline_from(timeout, &ok);
    if (!ok)
        goto done;
    if (!self->producer_registered) {
        atomic_store(&self->ring.shared->prod.pid, self->self_pid);
        self->producer_registered = 1;
    }
    for (;;) {
        og_status st = og_ring_push(&self->ring, &hdr, buf.buf, (uint32_t)buf.len);
        if (st == OG_OK) {
            result = Py_NewRef(Py_True);
            break;
        }
        if (st != OG_FULL) {
            raise_status(st, self->name);
            break;
        }
        int w = wait_slice(self, deadline, 1, (uint32_t)buf.len);
        if (w < 0)
            break;
        if (w == 1) {
            og_ring_count_full(&self->ring);
            result = Py_NewRef(Py_False);
            break;
        }
    }
done:
    PyBuffer_Release(&buf);
    return result;
}

static PyObject *header_tuple(const og_record_header *h, PyObject *payload) {
    if (!payload)
        return NULL;
    return Py_BuildValue("(IIIIKKN)", (unsigned)h->kind, (unsigned)h->flags, h->session,
                         h->epoch, (unsigned long long)h->seq, (unsigned long long)h->t_ns,
                         payload);
}

/* Give back the record handed out by pop_view. Fails while its payload is still exported. */
static int release_view(RingObject *self) {
    if (!self->view_held)
        return 0;
    if (self->exports > 0) {
        PyErr_Format(PyExc_BufferError, "ring %s: the previous record's payload view is still "
                     "in use (%zd exports); release it (and arrays made from it) before popping "
                     "again", self->name, self->exports);
        return -1;
    }
    self->view_held = 0;
    self->view_ptr = NULL;
    og_ring_advance(&self->ring);
    return 0;
}

/* Wait for the next deliverable record; 1 found, 0 timed out, -1 exception. */
static int next_record(RingObject *self, PyObject *timeout, og_record_header *h,
                       const uint8_t **payload) {
    if (ring_check(self) < 0 || ring_control_ok(self) < 0 || release_view(self) < 0)
        return -1;
    int ok;
    int64_t deadline = deadline_from(timeout, &ok);
    if (!ok)
        return -1;
    if (!self->consumer_registered) {
        atomic_store(&self->ring.shared->cons.pid, self->self_pid);
        self->consumer_registered = 1;
    }
    for (;;) {
        og_status st = og_ring_peek(&self->ring, h, payload);
        if (st == OG_OK)
            return 1;
        if (st != OG_EMPTY)
            return raise_status(st, self->name);
        int w = wait_slice(self, deadline, 0, 0);
        if (w != 0)
            return w < 0 ? -1 : 0;
    }
}

static PyObject *Ring_pop(RingObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"timeout", NULL};
    PyObject *timeout = Py_None;
    og_record_header h;
    const uint8_t *payload;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|O", kwlist, &timeout))
        return NULL;
    int r = next_record(self, timeout, &h, &payload);
    if (r <= 0)
        return r < 0 ? NULL : Py_NewRef(Py_None);
    PyObject *bytes = PyBytes_FromStringAndSize((const char *)payload, h.length);
    if (bytes)
        og_ring_advance(&self->ring);
    return header_tuple(&h, bytes);
}

static PyObject *Ring_pop_view(RingObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"timeout", NULL};
    PyObject *timeout = Py_None;
    og_record_header h;
    const uint8_t *payload;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|O", kwlist, &timeout))
        return NULL;
    int r = next_record(self, timeout, &h, &payload);
    if (r <= 0)
        return r < 0 ? NULL : Py_NewRef(Py_None);
    self->view_ptr = payload;
    self->view_len = h.length;
    self->view_held = 1;
    /* the memoryview holds a reference to the ring, so the mapping outlives it */
    return header_tuple(&h, PyMemoryView_FromObject((PyObject *)self));
}

static PyObject *Ring_release_view(RingObject *self, PyObject *unused) {
    if (ring_check(self) < 0 || release_view(self) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static int Ring_getbuffer(RingObject *self, Py_buffer *view, int flags) {
    if (!self->view_held || self->base == NULL) {
        PyErr_Format(PyExc_BufferError, "ring %s has no record view to export", self->name);
        view->obj = NULL;
        return -1;
    }
    if (PyBuffer_FillInfo(view, (PyObject *)self, (void *)self->view_ptr, self->view_len, 1,
                          flags) < 0)
        return -1;
    self->exports++;
    return 0;
}

static void Ring_releasebuffer(RingObject *self, Py_buffer *view) {
    self->exports--;
}

static PyBufferProcs Ring_as_buffer = {
    .bf_getbuffer = (getbufferproc)Ring_getbuffer,
    .bf_releasebuffer = (releasebufferproc)Ring_releasebuffer,
};

static PyObject *Ring_register(RingObject *self, PyObject *arg) {
    const char *role = PyUnicode_AsUTF8(arg);
    if (!role || ring_check(self) < 0)
        return NULL;
    if (strcmp(role, "producer") == 0) {
        atomic_store(&self->ring.shared->prod.pid, self->self_pid);
        self->producer_registered = 1;
    } else if (strcmp(role, "consumer") == 0) {
        atomic_store(&self->ring.shared->cons.pid, self->self_pid);
        self->consumer_registered = 1;
    } else {
        return PyErr_Format(PyExc_ValueError, "role must be 'producer' or 'consumer', not %R",
                            arg);
    }
    Py_RETURN_NONE;
}

static PyObject *Ring_stats(RingObject *self, PyObject *unused) {
    if (ring_check(self) < 0)
        return NULL;
    og_ring_shared *s = self->ring.shared;
    uint64_t head = atomic_load(&s->prod.head), tail = atomic_load(&s->cons.tail);
    return Py_BuildValue("{s:K,s:K,s:K,s:K,s:K,s:K,s:i,s:i}", "capacity",
                         (unsigned long long)(self->ring.mask + 1), "bytes_used",
                         (unsigned long long)(head - tail), "pushed",
                         (unsigned long long)atomic_load(&s->prod.pushed), "popped",
                         (unsigned long long)atomic_load(&s->cons.popped), "skipped",
                         (unsigned long long)atomic_load(&s->cons.skipped), "full",
                         (unsigned long long)atomic_load(&s->prod.full), "producer_pid",
                         (int)atomic_load(&s->prod.pid), "consumer_pid",
                         (int)atomic_load(&s->cons.pid));
}

static PyObject *Ring_close(RingObject *self, PyObject *unused) {
    if (self->base == NULL)
        Py_RETURN_NONE;
    if (self->exports > 0) {
        return PyErr_Format(PyExc_BufferError, "cannot close ring %s: a record payload view is "
                            "still in use", self->name);
    }
    munmap(self->base, self->size);
    self->base = NULL;
    if (self->owner)
        shm_unlink(self->name);
    Py_CLEAR(self->control);
    Py_RETURN_NONE;
}

static void Ring_dealloc(RingObject *self) {
    if (self->base) { /* no exports can remain: every memoryview holds a reference */
        munmap(self->base, self->size);
        if (self->owner)
            shm_unlink(self->name);
    }
    Py_XDECREF(self->control);
    PyObject_Free(self);
}

static PyObject *Ring_get_name(RingObject *self, void *c) { return PyUnicode_FromString(self->name); }
static PyObject *Ring_get_closed(RingObject *self, void *c) { return PyBool_FromLong(!self->base); }
static PyObject *Ring_get_owner(RingObject *self, void *c) { return PyBool_FromLong(self->owner); }
static PyObject *Ring_get_capacity(RingObject *self, void *c) {
    return PyLong_FromUnsignedLongLong(self->ring.mask + 1);
}
static PyObject *Ring_get_max_payload(RingObject *self, void *c) {
    return PyLong_FromUnsignedLongLong(og_ring_max_payload(self->ring.mask + 1));
}
static PyObject *Ring_get_owner_pid(RingObject *self, void *c) {
    if (ring_check(self) < 0)
        return NULL;
    return PyLong_FromLong(self->ring.shared->meta.owner_pid);
}

static PyMethodDef Ring_methods[] = {
    {"push", (PyCFunction)(void (*)(void))Ring_push, METH_VARARGS | METH_KEYWORDS, NULL},
    {"pop", (PyCFunction)(void (*)(void))Ring_pop, METH_VARARGS | METH_KEYWORDS, NULL},
    {"pop_view", (PyCFunction)(void (*)(void))Ring_pop_view, METH_VARARGS | METH_KEYWORDS,
     NULL},
    {"release_view", (PyCFunction)Ring_release_view, METH_NOARGS, NULL},
    {"register", (PyCFunction)Ring_register, METH_O, NULL},
    {"stats", (PyCFunction)Ring_stats, METH_NOARGS, NULL},
    {"close", (PyCFunction)Ring_close, METH_NOARGS, NULL},
    {NULL}};

static PyObject *Ring_get_wake_yield(RingObject *self, void *closure) {
    return PyBool_FromLong(self->ring.wake_yield);
}

static int Ring_set_wake_yield(RingObject *self, PyObject *value, void *closure) {
    int enabled = value == NULL ? -1 : PyObject_IsTrue(value);
    if (value == NULL)
        PyErr_SetString(PyExc_AttributeError, "wake_yield cannot be deleted");
    if (enabled < 0 || ring_check(self) < 0)
        return -1;
    self->ring.wake_yield = enabled;
    return 0;
}

static PyGetSetDef Ring_getset[] = {
    {"wake_yield", (getter)Ring_get_wake_yield, (setter)Ring_set_wake_yield, NULL, NULL},
    {"name", (getter)Ring_get_name, NULL, NULL, NULL},
    {"closed", (getter)Ring_get_closed, NULL, NULL, NULL},
    {"owner", (getter)Ring_get_owner, NULL, NULL, NULL},
    {"capacity", (getter)Ring_get_capacity, NULL, NULL, NULL},
    {"max_payload", (getter)Ring_get_max_payload, NULL, NULL, NULL},
    {"owner_pid", (getter)Ring_get_owner_pid, NULL, NULL, NULL},
    {NULL}};

static PyTypeObject RingType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "shm._ring.RingCore",
    .tp_basicsize = sizeof(RingObject),
    .tp_dealloc = (destructor)Ring_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_methods = Ring_methods,
    .tp_getset = Ring_getset,
    .tp_as_buffer = &Ring_as_buffer,
};

/* ---- module functions ----------------------------------------------------------------- */

static PyObject *mod_create_ring(PyObject *m, PyObject *args) {
    const char *name;
    unsigned long long capacity;
    PyObject *control = Py_None;
    if (!PyArg_ParseTuple(args, "sK|O", &name, &capacity, &control))
        return NULL;
    return ring_new(name, capacity, 1, control);
}

static PyObject *mod_attach_ring(PyObject *m, PyObject *args) {
    const char *name;
    PyObject *control = Py_None;
    if (!PyArg_ParseTuple(args, "s|O", &name, &control))
        return NULL;
    return ring_new(name, 0, 0, control);
}

static PyObject *mod_create_control(PyObject *m, PyObject *args) {
    const char *name;
    unsigned int max_sessions;
    if (!PyArg_ParseTuple(args, "sI", &name, &max_sessions))
        return NULL;
    return control_new(name, max_sessions, 1);
}

static PyObject *mod_attach_control(PyObject *m, PyObject *args) {
    const char *name;
    if (!PyArg_ParseTuple(args, "s", &name))
        return NULL;
    return control_new(name, 0, 0);
}

/* (kind, owner_pid) of a segment, kind being "ring", "control" or None; for reaping. */
static PyObject *mod_segment_owner(PyObject *m, PyObject *args) {
    const char *name;
    if (!PyArg_ParseTuple(args, "s", &name))
        return NULL;
    mapping mp;
    if (map_segment(name, 0, 0, &mp) < 0) /* a header peek: no need to fault the rest in */
        return NULL;
    PyObject *res;
    uint64_t magic = mp.size >= 8 ? *(uint64_t *)mp.base : 0;
    if (magic == OG_RING_MAGIC && mp.size >= sizeof(og_ring_meta))
        res = Py_BuildValue("(si)", "ring", ((og_ring_meta *)mp.base)->owner_pid);
    else if (magic == OG_CONTROL_MAGIC && mp.size >= sizeof(og_control_shared))
        res = Py_BuildValue("(si)", "control", ((og_control_shared *)mp.base)->owner_pid);
    else
        res = Py_BuildValue("(Oi)", Py_None, 0);
    munmap(mp.base, mp.size);
    return res;
}

static PyObject *mod_pid_alive(PyObject *m, PyObject *arg) {
    long pid = PyLong_AsLong(arg);
    if (pid == -1 && PyErr_Occurred())
        return NULL;
    return PyBool_FromLong(og_pid_alive((int32_t)pid));
}

static PyObject *mod_monotonic_ns(PyObject *m, PyObject *unused) {
    return PyLong_FromUnsignedLongLong(og_monotonic_ns());
}

static PyMethodDef module_methods[] = {
    {"create_ring", mod_create_ring, METH_VARARGS, NULL},
    {"attach_ring", mod_attach_ring, METH_VARARGS, NULL},
    {"create_control", mod_create_control, METH_VARARGS, NULL},
    {"attach_control", mod_attach_control, METH_VARARGS, NULL},
    {"segment_owner", mod_segment_owner, METH_VARARGS, NULL},
    {"pid_alive", mod_pid_alive, METH_O, NULL},
    {"monotonic_ns", mod_monotonic_ns, METH_NOARGS, NULL},
    {NULL}};

static struct PyModuleDef ring_module = {
    PyModuleDef_HEAD_INIT, "shm._ring", "C core of the shared-memory ring.", -1,
    module_methods};

PyMODINIT_FUNC PyInit__ring(void) {
    if (PyType_Ready(&RingType) < 0 || PyType_Ready(&ControlType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&ring_module);
    if (!m)
        return NULL;
    RingError = PyErr_NewExceptionWithDoc("shm.RingError", "A shared-memory ring failed.",
                                          PyExc_Exception, NULL);
    SegmentError = PyErr_NewExceptionWithDoc(
        "shm.SegmentError", "A segment is not what it should be (magic, version, size, owner).",
        RingError, NULL);
    PeerDiedError = PyErr_NewExceptionWithDoc(
        "shm.PeerDiedError", "The process on the other end of a ring died.", RingError, NULL);
    PyObject *bases = PyTuple_Pack(2, RingError, PyExc_ValueError);
    RecordTooLargeError = PyErr_NewExceptionWithDoc(
        "shm.RecordTooLargeError", "A payload can never fit in the ring.", bases, NULL);
    Py_XDECREF(bases);
    if (!RingError || !SegmentError || !PeerDiedError || !RecordTooLargeError ||
        PyModule_AddObjectRef(m, "RingError", RingError) < 0 ||
        PyModule_AddObjectRef(m, "SegmentError", SegmentError) < 0 ||
        PyModule_AddObjectRef(m, "PeerDiedError", PeerDiedError) < 0 ||
        PyModule_AddObjectRef(m, "RecordTooLargeError", RecordTooLargeError) < 0 ||
        PyModule_AddObjectRef(m, "RingCore", (PyObject *)&RingType) < 0 ||
        PyModule_AddObjectRef(m, "ControlCore", (PyObject *)&ControlType) < 0 ||
        PyModule_AddIntConstant(m, "HEADER_SIZE", sizeof(og_record_header)) < 0 ||
        PyModule_AddIntConstant(m, "KIND_RESERVED", OG_KIND_RESERVED) < 0 ||
        PyModule_AddIntConstant(m, "FLAG_NO_PURGE", OG_FLAG_NO_PURGE) < 0 ||
        PyModule_AddIntConstant(m, "LAYOUT_VERSION", OG_LAYOUT_VERSION) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
