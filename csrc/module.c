/* fastai_resume._core: the thin CPython binding over the frk core.
 *
 * Writer  encodes a value tree (driven from Python) and commits it with the
 *         GIL released (background saves call commit from a Python thread).
 * Mapping a checkpoint's bytes, exported through the buffer protocol: read
 *         into memory of the process's own, or mapped privately (copy on
 *         write); freed when the last view of it (a loaded tensor) is gone.
 * Reader  the validated index of a Mapping; builds the Python value tree.
 * SkipToIter  the resume state machine of csrc/skip.c.
 *
 * One file of about 1,000 lines, as CPython's own extension modules are: the four types share
 * the module state, the error type and the GIL rules, and each type's methods, slots and spec
 * sit together below it.  The format itself (parsing, building, committing) is in the core's
 * files, which include no Python.h.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "frk.h"

/* Below this many bytes the checksum costs less than releasing the GIL (zlib's choice). */
#define CRC_GIL_THRESHOLD (5 * 1024)

typedef struct {
    PyObject *CheckpointError;
    PyTypeObject *Writer, *Mapping, *Reader, *SkipToIter;
} core_state;

static core_state *state_of_type(PyTypeObject *t) { return PyType_GetModuleState(t); }

static int no_arguments(const char *name, PyObject *args, PyObject *kw)
{
    if (PyTuple_GET_SIZE(args) || (kw && PyDict_GET_SIZE(kw))) {
        PyErr_Format(PyExc_TypeError, "%s() takes no arguments", name);
        return 0;
    }
    return 1;
}

/* Raises the Python exception that matches a failed frk call.  The message may hold a path in
 * any bytes (not UTF-8, or cut by the buffer's size): undecodable bytes are shown as \xNN escapes,
 * so that reporting an error can never itself fail. */
static PyObject *raise_frk(core_state *st, const frk_error *err)
{
    if (err->status == FRK_ENOMEM)
        return PyErr_NoMemory();
    PyObject *msg = PyUnicode_DecodeUTF8(err->msg, (Py_ssize_t)strnlen(err->msg, sizeof err->msg),
                                         "backslashreplace");
    if (!msg)
        return NULL;
    if (err->status == FRK_EIO) {
        PyObject *e = PyObject_CallFunction(PyExc_OSError, "iO", err->sys_errno, msg);
        if (e) {
            PyErr_SetObject((PyObject *)Py_TYPE(e), e);
            Py_DECREF(e);
        }
    } else {
        PyErr_SetObject(err->status == FRK_ECORRUPT ? st->CheckpointError : PyExc_ValueError, msg);
    }
    Py_DECREF(msg);
    return NULL;
}

/* ---- Writer ----------------------------------------------------------------- */

typedef enum {
    WRITER_OPEN,       /* values may be added */
    WRITER_COMMITTING, /* commit(), write() or publish() runs without the GIL */
    WRITER_WRITTEN,    /* write() has written the file: publish() or abandon() is next */
    WRITER_DONE,
} writer_phase;

typedef struct {
    PyObject_HEAD
    frk_builder *b;
    Py_buffer *views;
    Py_ssize_t n_views, cap_views;
    writer_phase phase;
    char *path;
    unsigned flags;
    uint64_t written;
    int rc;
    frk_error err;
    frk_pending *pending; /* WRITER_WRITTEN: the written file, not yet in place */
} WriterObject;

/* True while values may still be added; otherwise raises. */
static int writer_open(WriterObject *w)
{
    if (w->phase == WRITER_OPEN)
        return 1;
    PyErr_SetString(PyExc_RuntimeError, "this Writer has already been committed");
    return 0;
}

/* None, or the exception of a failed frk call. */
static PyObject *writer_status(WriterObject *w, int rc, const frk_error *err)
{
    if (rc != FRK_OK)
        return raise_frk(state_of_type(Py_TYPE(w)), err);
    Py_RETURN_NONE;
}

static PyObject *Writer_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    if (!no_arguments("Writer", args, kw))
        return NULL;
    WriterObject *w = (WriterObject *)type->tp_alloc(type, 0);
    if (!w)
        return NULL;
    w->b = frk_builder_new();
    if (!w->b) {
        Py_DECREF(w);
        return PyErr_NoMemory();
    }
    return (PyObject *)w;
}

static void writer_release_views(WriterObject *w)
{
    for (Py_ssize_t i = 0; i < w->n_views; i++)
        PyBuffer_Release(&w->views[i]);
    PyMem_Free(w->views);
    w->views = NULL;
    w->n_views = w->cap_views = 0;
}

static void Writer_dealloc(WriterObject *w)
{
    PyTypeObject *tp = Py_TYPE(w);
    writer_release_views(w);
    frk_abandon(w->pending); /* written, never published: its temporary file goes */
    frk_builder_free(w->b);
    PyMem_Free(w->path);
    tp->tp_free(w);
    Py_DECREF(tp);
}

static PyObject *Writer_add_blob(WriterObject *w, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"", "crc", NULL};
    PyObject *obj, *crc_o = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|O:add_blob", kwlist, &obj, &crc_o) ||
        !writer_open(w))
        return NULL;
    unsigned long crc = 0;
    if (crc_o != Py_None) {
        crc = PyLong_AsUnsignedLong(crc_o);
        if (crc == (unsigned long)-1 && PyErr_Occurred())
            return NULL;
        if (crc > 0xFFFFFFFFul) {
            PyErr_SetString(PyExc_OverflowError, "crc must fit in 32 bits");
            return NULL;
        }
    }
    if (w->n_views == w->cap_views) {
        Py_ssize_t cap = w->cap_views ? w->cap_views * 2 : 16;
        Py_buffer *nv = PyMem_Realloc(w->views, (size_t)cap * sizeof *nv);
        if (!nv)
            return PyErr_NoMemory();
        w->views = nv;
        w->cap_views = cap;
    }
    Py_buffer *v = &w->views[w->n_views];
    if (PyObject_GetBuffer(obj, v, PyBUF_SIMPLE) < 0)
        return NULL;
    uint64_t idx;
    frk_error err;
    int rc = crc_o == Py_None ? frk_builder_add_blob(w->b, v->buf, (uint64_t)v->len, &idx, &err)
                              : frk_builder_add_blob_crc(w->b, v->buf, (uint64_t)v->len,
                                                         (uint32_t)crc, &idx, &err);
    if (rc) {
        PyBuffer_Release(v);
        return raise_frk(state_of_type(Py_TYPE(w)), &err);
    }
    w->n_views++;
    return PyLong_FromUnsignedLongLong(idx);
}

static int read_dims(PyObject *seq, int64_t *out, Py_ssize_t *n, const char *what)
{
    PyObject *fast = PySequence_Fast(seq, what);
    if (!fast)
        return -1;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(fast);
    if (len > (Py_ssize_t)FRK_MAX_NDIM) {
        Py_DECREF(fast);
        PyErr_Format(PyExc_ValueError, "%s: more than %u dimensions", what, FRK_MAX_NDIM);
        return -1;
    }
    for (Py_ssize_t i = 0; i < len; i++) {
        long long v = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i));
        if (v == -1 && PyErr_Occurred()) {
            Py_DECREF(fast);
            return -1;
        }
        out[i] = v;
    }
    *n = len;
    Py_DECREF(fast);
    return 0;
}

static PyObject *Writer_add_tensor(WriterObject *w, PyObject *args)
{
    unsigned kind, dtype;
    unsigned long long blob, offset;
    PyObject *sizes_o, *strides_o;
    if (!PyArg_ParseTuple(args, "IIKKOO:add_tensor", &kind, &dtype, &blob, &offset, &sizes_o,
                          &strides_o))
        return NULL;
    int64_t sizes[FRK_MAX_NDIM], strides[FRK_MAX_NDIM];
    Py_ssize_t nd, nd2;
    if (read_dims(sizes_o, sizes, &nd, "sizes") || read_dims(strides_o, strides, &nd2, "strides"))
        return NULL;
    if (nd != nd2) {
        PyErr_SetString(PyExc_ValueError, "sizes and strides differ in length");
        return NULL;
    }
    if (!writer_open(w))
        return NULL;
    uint64_t idx;
    frk_error err;
    if (frk_builder_add_tensor(w->b, kind, dtype, blob, offset, (unsigned)nd, sizes, strides, &idx,
                               &err))
        return raise_frk(state_of_type(Py_TYPE(w)), &err);
    return PyLong_FromUnsignedLongLong(idx);
}

static PyObject *Writer_put_none(WriterObject *w, PyObject *Py_UNUSED(a))
{
    if (!writer_open(w))
        return NULL;
    frk_error err;
    return writer_status(w, frk_builder_put_scalar(w->b, FRK_TAG_NONE, &err), &err);
}

static PyObject *Writer_put_bool(WriterObject *w, PyObject *v)
{
    int t = PyObject_IsTrue(v);
    if (t < 0 || !writer_open(w))
        return NULL;
    frk_error err;
    return writer_status(w, frk_builder_put_scalar(w->b, t ? FRK_TAG_TRUE : FRK_TAG_FALSE, &err),
                         &err);
}

static PyObject *Writer_put_int(WriterObject *w, PyObject *v)
{
    int overflow;
    long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (x == -1 && PyErr_Occurred())
        return NULL;
    if (overflow) {
        PyErr_SetString(PyExc_OverflowError, "int does not fit in 64 bits");
        return NULL;
    }
    if (!writer_open(w))
        return NULL;
    frk_error err;
    return writer_status(w, frk_builder_put_int(w->b, x, &err), &err);
}

/* A list's or tuple's items as ints, where every item is an int (not a bool) that fits in 64 bits:
 * the same values put_int appends one by one. Returns False, having appended nothing, where one is
 * not. */
static int put_ints_of(WriterObject *w, PyObject *v);

static PyObject *Writer_put_ints(WriterObject *w, PyObject *v)
{
    if (!PyList_Check(v) && !PyTuple_Check(v)) {
        PyErr_SetString(PyExc_TypeError, "put_ints takes a list or a tuple");
        return NULL;
    }
    if (!writer_open(w))
        return NULL;
    int got = put_ints_of(w, v);
    if (got < 0)
        return NULL;
    return PyBool_FromLong(got);
}

static PyObject *Writer_put_float(WriterObject *w, PyObject *v)
{
    double x = PyFloat_AsDouble(v);
    if ((x == -1.0 && PyErr_Occurred()) || !writer_open(w))
        return NULL;
    frk_error err;
    return writer_status(w, frk_builder_put_float(w->b, x, &err), &err);
}

static PyObject *Writer_put_str(WriterObject *w, PyObject *v)
{
    Py_ssize_t n;
    const char *s = PyUnicode_AsUTF8AndSize(v, &n);
    if (!s || !writer_open(w))
        return NULL;
    frk_error err;
    return writer_status(w, frk_builder_put_str(w->b, FRK_TAG_STR, s, (uint64_t)n, &err), &err);
}

static PyObject *Writer_put_bytes(WriterObject *w, PyObject *v)
{
    if (!writer_open(w))
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(v, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    frk_error err;
    int rc = frk_builder_put_str(w->b, FRK_TAG_BYTES, view.buf, (uint64_t)view.len, &err);
    PyBuffer_Release(&view);
    return writer_status(w, rc, &err);
}

static PyObject *writer_put_container(WriterObject *w, PyObject *v, frk_tag tag)
{
    unsigned long long n = PyLong_AsUnsignedLongLong(v);
    if ((n == (unsigned long long)-1 && PyErr_Occurred()) || !writer_open(w))
        return NULL;
    frk_error err;
    return writer_status(w, frk_builder_put_container(w->b, tag, n, &err), &err);
}

static PyObject *Writer_put_list(WriterObject *w, PyObject *v)
{
    return writer_put_container(w, v, FRK_TAG_LIST);
}

static PyObject *Writer_put_tuple(WriterObject *w, PyObject *v)
{
    return writer_put_container(w, v, FRK_TAG_TUPLE);
}

static PyObject *Writer_put_dict(WriterObject *w, PyObject *v)
{
    return writer_put_container(w, v, FRK_TAG_DICT);
}

static PyObject *Writer_put_tensor(WriterObject *w, PyObject *v)
{
    unsigned long long i = PyLong_AsUnsignedLongLong(v);
    if ((i == (unsigned long long)-1 && PyErr_Occurred()) || !writer_open(w))
        return NULL;
    frk_error err;
    return writer_status(w, frk_builder_put_tensor(w->b, i, &err), &err);
}

/* ---- put_tree: the value tree walked here, as fastai_resume.io._Encoder.value walks it ---- */

typedef struct {
    WriterObject *w;
    PyObject *kinds;    /* the classes handed to on_other (torch.Tensor, numpy.ndarray) */
    PyObject *on_other; /* on_other(v) -> the tensor index of v */
} tree_walk;

static int walk_value(tree_walk *t, PyObject *v);

/* 1: appended; 0: not every item is an int of 64 bits (nothing appended); -1: an error. */
static int put_ints_of(WriterObject *w, PyObject *v)
{
    Py_ssize_t n = PySequence_Fast_GET_SIZE(v);
    PyObject **items = PySequence_Fast_ITEMS(v);
    for (Py_ssize_t i = 0; i < n; i++) {
        int overflow;
        if (!PyLong_CheckExact(items[i]))
            return 0;
        long long x = PyLong_AsLongLongAndOverflow(items[i], &overflow);
        if (overflow || (x == -1 && PyErr_Occurred())) {
            PyErr_Clear();
            return 0;
        }
    }
    frk_error err;
    for (Py_ssize_t i = 0; i < n; i++) {
        int rc = frk_builder_put_int(w->b, PyLong_AsLongLong(items[i]), &err);
        if (rc != FRK_OK) {
            raise_frk(state_of_type(Py_TYPE(w)), &err);
            return -1;
        }
    }
    return 1;
}

static int walk_status(WriterObject *w, int rc, const frk_error *err)
{
    if (rc == FRK_OK)
        return 0;
    raise_frk(state_of_type(Py_TYPE(w)), err);
    return -1;
}

static int walk_unstorable(PyObject *v)
{
    PyErr_Format(PyExc_TypeError, "%s is not storable", Py_TYPE(v)->tp_name);
    return -1;
}

static int walk_items(tree_walk *t, PyObject *it)
{
    PyObject *x;
    while ((x = PyIter_Next(it))) {
        int rc = walk_value(t, x);
        Py_DECREF(x);
        if (rc)
            return -1;
    }
    return PyErr_Occurred() ? -1 : 0;
}

static int walk_key(tree_walk *t, PyObject *k)
{
    if (PyBool_Check(k) || !(PyUnicode_Check(k) || PyLong_Check(k)))
        return walk_unstorable(k); /* (the Python walk says which key) */
    return walk_value(t, k);
}

static int walk_dict(tree_walk *t, PyObject *v)
{
    frk_error err;
    Py_ssize_t n = PyObject_Length(v);
    if (n < 0)
        return -1;
    if (walk_status(t->w, frk_builder_put_container(t->w->b, FRK_TAG_DICT, (uint64_t)n, &err),
                    &err))
        return -1;
    if (PyDict_CheckExact(v)) {
        Py_ssize_t pos = 0;
        PyObject *k, *x;
        while (PyDict_Next(v, &pos, &k, &x)) {
            Py_INCREF(k);
            Py_INCREF(x);
            int rc = walk_key(t, k) || walk_value(t, x);
            Py_DECREF(k);
            Py_DECREF(x);
            if (rc)
                return -1;
        }
        return 0;
    }
    /* A subclass (an OrderedDict: its own order) is walked in the order its items() gives. */
    PyObject *items = PyObject_CallMethod(v, "items", NULL);
    PyObject *it = items ? PyObject_GetIter(items) : NULL;
    Py_XDECREF(items);
    if (!it)
        return -1;
    PyObject *pair;
    int rc = 0;
    while (!rc && (pair = PyIter_Next(it))) {
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2)
            rc = walk_unstorable(v);
        else
            rc = walk_key(t, PyTuple_GET_ITEM(pair, 0)) || walk_value(t, PyTuple_GET_ITEM(pair, 1));
        Py_DECREF(pair);
    }
    Py_DECREF(it);
    return rc || PyErr_Occurred() ? -1 : 0;
}

static int walk_sequence(tree_walk *t, PyObject *v)
{
    frk_error err;
    Py_ssize_t n = PyObject_Length(v);
    if (n < 0)
        return -1;
    frk_tag tag = PyTuple_Check(v) ? FRK_TAG_TUPLE : FRK_TAG_LIST;
    if (walk_status(t->w, frk_builder_put_container(t->w->b, tag, (uint64_t)n, &err), &err))
        return -1;
    if (n >= 8) {
        int got = put_ints_of(t->w, v); /* (an RNG's state: the same values, in one call) */
        if (got)
            return got < 0 ? -1 : 0;
    }
    if (PyList_CheckExact(v) || PyTuple_CheckExact(v)) {
        for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(v); i++) {
            PyObject *x = PySequence_Fast_GET_ITEM(v, i);
            Py_INCREF(x);
            int rc = walk_value(t, x);
            Py_DECREF(x);
            if (rc)
                return -1;
        }
        return 0;
    }
    PyObject *it = PyObject_GetIter(v);
    if (!it)
        return -1;
    int rc = walk_items(t, it);
    Py_DECREF(it);
    return rc;
}

static int walk_value(tree_walk *t, PyObject *v)
{
    WriterObject *w = t->w;
    frk_error err;
    if (v == Py_None)
        return walk_status(w, frk_builder_put_scalar(w->b, FRK_TAG_NONE, &err), &err);
    if (v == Py_True || v == Py_False)
        return walk_status(
            w, frk_builder_put_scalar(w->b, v == Py_True ? FRK_TAG_TRUE : FRK_TAG_FALSE, &err),
            &err);
    if (PyLong_Check(v)) {
        int overflow;
        long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
        if (x == -1 && PyErr_Occurred())
            return -1;
        if (overflow) {
            PyErr_SetString(PyExc_OverflowError, "int does not fit in 64 bits");
            return -1;
        }
        return walk_status(w, frk_builder_put_int(w->b, x, &err), &err);
    }
    if (PyFloat_Check(v))
        return walk_status(w, frk_builder_put_float(w->b, PyFloat_AS_DOUBLE(v), &err), &err);
    if (PyUnicode_Check(v)) {
        Py_ssize_t n;
        const char *s = PyUnicode_AsUTF8AndSize(v, &n);
        if (!s)
            return -1;
        return walk_status(w, frk_builder_put_str(w->b, FRK_TAG_STR, s, (uint64_t)n, &err), &err);
    }
    if (PyBytes_Check(v) || PyByteArray_Check(v)) {
        Py_buffer view;
        if (PyObject_GetBuffer(v, &view, PyBUF_SIMPLE) < 0)
            return -1;
        int rc = frk_builder_put_str(w->b, FRK_TAG_BYTES, view.buf, (uint64_t)view.len, &err);
        PyBuffer_Release(&view);
        return walk_status(w, rc, &err);
    }
    int other = PyObject_IsInstance(v, t->kinds);
    if (other < 0)
        return -1;
    if (other) {
        PyObject *idx = PyObject_CallOneArg(t->on_other, v);
        if (!idx)
            return -1;
        unsigned long long i = PyLong_AsUnsignedLongLong(idx);
        Py_DECREF(idx);
        if (i == (unsigned long long)-1 && PyErr_Occurred())
            return -1;
        return walk_status(w, frk_builder_put_tensor(w->b, i, &err), &err);
    }
    if (!PyDict_Check(v) && !PyList_Check(v) && !PyTuple_Check(v))
        return walk_unstorable(v);
    if (Py_EnterRecursiveCall(" while saving a value tree"))
        return -1;
    int rc = PyDict_Check(v) ? walk_dict(t, v) : walk_sequence(t, v);
    Py_LeaveRecursiveCall();
    return rc;
}

/* put_tree(value, kinds, on_other): the whole tree appended, as the put_* calls of a walk in
 * Python append it; a value of `kinds` (a class or a tuple of them) is on_other(value)'s tensor.
 * Raises on a value it cannot store, with part of the tree appended: the Writer is then to be
 * dropped (fastai_resume.io walks the tree again in Python, for the error naming the value). */
static PyObject *Writer_put_tree(WriterObject *w, PyObject *args)
{
    tree_walk t = {w, NULL, NULL};
    PyObject *v;
    if (!PyArg_ParseTuple(args, "OOO:put_tree", &v, &t.kinds, &t.on_other) || !writer_open(w))
        return NULL;
    if (walk_value(&t, v))
        return NULL;
    Py_RETURN_NONE;
}

/* Parses commit's arguments into w->path and w->flags. */
static int writer_prepare(WriterObject *w, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"path", "fsync", "direct", NULL};
    PyObject *path_o;
    int do_fsync = 1, direct = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O&|pp", kwlist, PyUnicode_FSConverter, &path_o,
                                     &do_fsync, &direct))
        return -1;
    if (!writer_open(w)) {
        Py_DECREF(path_o);
        return -1;
    }
    const char *p = PyBytes_AS_STRING(path_o);
    size_t n = strlen(p) + 1;
    w->path = PyMem_Malloc(n);
    if (!w->path) {
        Py_DECREF(path_o);
        PyErr_NoMemory();
        return -1;
    }
    memcpy(w->path, p, n);
    Py_DECREF(path_o);
    /* Around the page cache only when the bytes must reach the disk anyway. */
    w->flags = do_fsync ? FRK_COMMIT_FSYNC | (direct ? FRK_COMMIT_DIRECT : 0) : 0;
    return 0;
}

static PyObject *writer_result(WriterObject *w)
{
    PyMem_Free(w->path);
    w->path = NULL;
    writer_release_views(w); /* the bytes are on disk: let the tensors go */
    if (w->rc)
        return raise_frk(state_of_type(Py_TYPE(w)), &w->err);
    return PyLong_FromUnsignedLongLong(w->written);
}

static PyObject *Writer_commit(WriterObject *w, PyObject *args, PyObject *kw)
{
    if (writer_prepare(w, args, kw))
        return NULL;
    w->phase = WRITER_COMMITTING; /* other threads may run meanwhile: they must not add */
    Py_BEGIN_ALLOW_THREADS
    w->rc = frk_builder_commit(w->b, w->path, w->flags, &w->written, &w->err);
    Py_END_ALLOW_THREADS
    w->phase = WRITER_DONE;
    return writer_result(w);
}

static PyObject *Writer_write(WriterObject *w, PyObject *args, PyObject *kw)
{
    if (writer_prepare(w, args, kw))
        return NULL;
    w->phase = WRITER_COMMITTING;
    Py_BEGIN_ALLOW_THREADS
    w->rc = frk_builder_write(w->b, w->path, w->flags, &w->written, &w->pending, &w->err);
    Py_END_ALLOW_THREADS
    w->phase = w->rc ? WRITER_DONE : WRITER_WRITTEN;
    return writer_result(w); /* the bytes are in the file: the tensors go */
}

/* True in WRITER_WRITTEN (the step that follows a write is taken by this thread); otherwise raises.
 */
static int writer_written(WriterObject *w)
{
    if (w->phase == WRITER_WRITTEN)
        return 1;
    PyErr_SetString(PyExc_RuntimeError, "this Writer holds no written file (write() first, once)");
    return 0;
}

static PyObject *Writer_publish(WriterObject *w, PyObject *Py_UNUSED(a))
{
    if (!writer_written(w))
        return NULL;
    frk_pending *p = w->pending;
    w->pending = NULL;
    w->phase = WRITER_COMMITTING;
    Py_BEGIN_ALLOW_THREADS
    w->rc = frk_publish(p, w->flags, &w->err);
    Py_END_ALLOW_THREADS
    w->phase = WRITER_DONE;
    if (w->rc)
        return raise_frk(state_of_type(Py_TYPE(w)), &w->err);
    return PyLong_FromUnsignedLongLong(w->written);
}

static PyObject *Writer_abandon(WriterObject *w, PyObject *Py_UNUSED(a))
{
    if (!writer_written(w))
        return NULL;
    frk_abandon(w->pending);
    w->pending = NULL;
    w->phase = WRITER_DONE;
    Py_RETURN_NONE;
}

static PyObject *Writer_get_size(WriterObject *w, void *Py_UNUSED(c))
{
    if (!writer_open(w)) /* a commit may be reading the builder in another thread */
        return NULL;
    uint64_t size;
    frk_error err;
    int rc = frk_builder_size(w->b, &size, &err);
    return rc ? writer_status(w, rc, &err) : PyLong_FromUnsignedLongLong(size);
}

#define PUT_DOC(name, arg, what) #name "($self, " #arg ", /)\n--\n\n" what
static PyMethodDef Writer_methods[] = {
    {"add_blob", (PyCFunction)(void (*)(void))Writer_add_blob, METH_VARARGS | METH_KEYWORDS,
     "add_blob($self, buffer, /, crc=None)\n--\n\n"
     "Register buffer's bytes as a blob; returns its index. The buffer is held, not copied, "
     "until the commit ends. crc: the bytes' CRC32C when the caller has it (copy_crc32c); "
     "the commit then does not read them for it."},
    {"add_tensor", (PyCFunction)Writer_add_tensor, METH_VARARGS,
     "add_tensor($self, kind, dtype, blob, storage_offset, sizes, strides, /)\n--\n\n"
     "Add a tensor entry (a strided view of blob); returns its index."},
    {"put_none", (PyCFunction)Writer_put_none, METH_NOARGS,
     "put_none($self, /)\n--\n\nAppend None to the value tree."},
    {"put_bool", (PyCFunction)Writer_put_bool, METH_O, PUT_DOC(put_bool, v, "Append a bool.")},
    {"put_int", (PyCFunction)Writer_put_int, METH_O,
     PUT_DOC(put_int, v, "Append an int (64-bit).")},
    {"put_float", (PyCFunction)Writer_put_float, METH_O, PUT_DOC(put_float, v, "Append a float.")},
    {"put_str", (PyCFunction)Writer_put_str, METH_O, PUT_DOC(put_str, v, "Append a str.")},
    {"put_bytes", (PyCFunction)Writer_put_bytes, METH_O,
     PUT_DOC(put_bytes, v, "Append bytes (any bytes-like object).")},
    {"put_ints", (PyCFunction)Writer_put_ints, METH_O,
     PUT_DOC(put_ints, seq,
             "Append a list's or tuple's items as ints, where all are ints that fit in 64 bits "
             "(then True; else False, nothing appended).")},
    {"put_list", (PyCFunction)Writer_put_list, METH_O,
     PUT_DOC(put_list, n, "Append a list of the next n values.")},
    {"put_tuple", (PyCFunction)Writer_put_tuple, METH_O,
     PUT_DOC(put_tuple, n, "Append a tuple of the next n values.")},
    {"put_dict", (PyCFunction)Writer_put_dict, METH_O,
     PUT_DOC(put_dict, n, "Append a dict of the next n (key, value) pairs.")},
    {"put_tensor", (PyCFunction)Writer_put_tensor, METH_O,
     PUT_DOC(put_tensor, index, "Append a reference to tensor index.")},
    {"put_tree", (PyCFunction)Writer_put_tree, METH_VARARGS,
     "put_tree($self, value, kinds, on_other, /)\n--\n\n"
     "Append a whole value tree, walked here as a walk in Python putting each value appends it;\n"
     "a value of kinds is appended as the tensor index on_other(value) returns. Raises on a value\n"
     "it cannot store, with part of the tree appended (drop the Writer then)."},
    {"commit", (PyCFunction)(void (*)(void))Writer_commit, METH_VARARGS | METH_KEYWORDS,
     "commit($self, /, path, fsync=True, direct=True)\n--\n\n"
     "Write the checkpoint atomically, with the GIL released; returns the bytes written.\n"
     "With fsync, direct writes around the page cache (O_DIRECT) where the file system allows."},
    {"write", (PyCFunction)(void (*)(void))Writer_write, METH_VARARGS | METH_KEYWORDS,
     "write($self, /, path, fsync=True, direct=True)\n--\n\n"
     "The first half of commit: the whole file written to a temporary name beside path and kept\n"
     "there (the GIL released); returns the bytes written. publish() puts it in place."},
    {"publish", (PyCFunction)Writer_publish, METH_NOARGS,
     "publish($self, /)\n--\n\n"
     "The second half of commit: the written file synced (fsync=True), renamed onto its path and\n"
     "its directory synced, with the GIL released; returns the bytes written."},
    {"abandon", (PyCFunction)Writer_abandon, METH_NOARGS,
     "abandon($self, /)\n--\n\nRemove the written file, never published."},
    {NULL},
};
#undef PUT_DOC

static PyGetSetDef Writer_getset[] = {
    {"size", (getter)Writer_get_size, NULL,
     "The bytes a commit of what this Writer holds will write (before the commit)", NULL},
    {NULL},
};

static PyType_Slot Writer_slots[] = {
    {Py_tp_new, Writer_new},
    {Py_tp_dealloc, Writer_dealloc},
    {Py_tp_methods, Writer_methods},
    {Py_tp_getset, Writer_getset},
    {Py_tp_doc, "Writer()\n--\n\nEncodes one checkpoint, then commits it atomically."},
    {0, NULL},
};

static PyType_Spec Writer_spec = {"fastai_resume._core.Writer", sizeof(WriterObject), 0,
                                  Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE, Writer_slots};

/* ---- Mapping ----------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    uint8_t *base;
    size_t len;
} MappingObject;

static PyObject *Mapping_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"path", "copy", "verify", NULL};
    PyObject *path_o;
    int copy = 0, verify = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O&|$pp:Mapping", kwlist, PyUnicode_FSConverter,
                                     &path_o, &copy, &verify))
        return NULL;
    MappingObject *m = (MappingObject *)type->tp_alloc(type, 0);
    if (!m) {
        Py_DECREF(path_o);
        return NULL;
    }
    frk_error err;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = frk_load_file(PyBytes_AS_STRING(path_o),
                       (copy ? FRK_LOAD_COPY : 0u) | (verify ? FRK_LOAD_VERIFY : 0u), &m->base,
                       &m->len, &err);
    Py_END_ALLOW_THREADS
    Py_DECREF(path_o);
    if (rc) {
        Py_DECREF(m);
        return raise_frk(state_of_type(type), &err);
    }
    return (PyObject *)m;
}

static void Mapping_dealloc(MappingObject *m)
{
    PyTypeObject *tp = Py_TYPE(m);
    frk_unmap(m->base, m->len);
    tp->tp_free(m);
    Py_DECREF(tp);
}

static int Mapping_getbuffer(MappingObject *m, Py_buffer *view, int flags)
{
    return PyBuffer_FillInfo(view, (PyObject *)m, m->base, (Py_ssize_t)m->len, 0, flags);
}

static PyObject *Mapping_get_size(MappingObject *m, void *Py_UNUSED(c))
{
    return PyLong_FromSize_t(m->len);
}

static PyGetSetDef Mapping_getset[] = {
    {"size", (getter)Mapping_get_size, NULL, "bytes mapped", NULL},
    {NULL},
};
static PyType_Slot Mapping_slots[] = {
    {Py_tp_new, Mapping_new},
    {Py_tp_dealloc, Mapping_dealloc},
    {Py_tp_getset, Mapping_getset},
    {Py_bf_getbuffer, Mapping_getbuffer},
    {Py_tp_doc, "Mapping(path, *, copy=False, verify=False)\n--\n\n"
                "A checkpoint file's bytes, exported through the buffer protocol: a private\n"
                "copy-on-write mapping of the file, or with copy=True the file read whole into\n"
                "memory of the process's own (what later happens to the file cannot reach it).\n"
                "verify=True checks the structure and every blob's CRC32C on the way in, on all\n"
                "the CPUs; a Reader of it then need not check the blobs again."},
    {0, NULL},
};
static PyType_Spec Mapping_spec = {"fastai_resume._core.Mapping", sizeof(MappingObject), 0,
                                   Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE, Mapping_slots};

/* ---- Reader ------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    Py_buffer view; /* holds the mapping (or any bytes-like) alive */
    frk_reader *r;
} ReaderObject;

static PyObject *Reader_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"data", "verify", NULL};
    PyObject *data;
    int verify = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|p:Reader", kwlist, &data, &verify))
        return NULL;
    ReaderObject *ro = (ReaderObject *)type->tp_alloc(type, 0);
    if (!ro)
        return NULL;
    if (PyObject_GetBuffer(data, &ro->view, PyBUF_SIMPLE) < 0) {
        ro->view.obj = NULL;
        Py_DECREF(ro);
        return NULL;
    }
    frk_error err;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = frk_reader_open(ro->view.buf, (size_t)ro->view.len, verify, &ro->r, &err);
    Py_END_ALLOW_THREADS
    if (rc) {
        Py_DECREF(ro);
        return raise_frk(state_of_type(type), &err);
    }
    return (PyObject *)ro;
}

static void Reader_dealloc(ReaderObject *ro)
{
    PyTypeObject *tp = Py_TYPE(ro);
    frk_reader_free(ro->r);
    if (ro->view.obj)
        PyBuffer_Release(&ro->view);
    tp->tp_free(ro);
    Py_DECREF(tp);
}

static PyObject *Reader_blobs(ReaderObject *ro, PyObject *Py_UNUSED(a))
{
    size_t n = frk_reader_blob_count(ro->r);
    PyObject *out = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; out && i < n; i++) {
        const frk_blob *b = frk_reader_blob(ro->r, i);
        PyObject *t = Py_BuildValue("KKI", (unsigned long long)b->offset,
                                    (unsigned long long)b->length, (unsigned)b->crc);
        if (!t) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, (Py_ssize_t)i, t);
    }
    return out;
}

static PyObject *dims_tuple(const int64_t *d, unsigned n)
{
    PyObject *t = PyTuple_New(n);
    for (unsigned i = 0; t && i < n; i++) {
        PyObject *v = PyLong_FromLongLong(d[i]);
        if (!v) {
            Py_CLEAR(t);
            break;
        }
        PyTuple_SET_ITEM(t, i, v);
    }
    return t;
}

static PyObject *Reader_tensors(ReaderObject *ro, PyObject *Py_UNUSED(a))
{
    size_t n = frk_reader_tensor_count(ro->r);
    PyObject *out = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; out && i < n; i++) {
        const frk_tensor *t = frk_reader_tensor(ro->r, i);
        PyObject *sz = dims_tuple(t->sizes, t->ndim), *stv = dims_tuple(t->strides, t->ndim);
        PyObject *e = sz && stv ? Py_BuildValue("IIKKOO", (unsigned)t->kind, (unsigned)t->dtype,
                                                (unsigned long long)t->blob,
                                                (unsigned long long)t->storage_offset, sz, stv)
                                : NULL;
        Py_XDECREF(sz);
        Py_XDECREF(stv);
        if (!e) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, (Py_ssize_t)i, e);
    }
    return out;
}

static PyObject *build(ReaderObject *ro, const frk_node *nodes, size_t *i, PyObject *make_tensor)
{
    const frk_node *nd = &nodes[(*i)++];
    switch (nd->tag) {
    case FRK_TAG_NONE:
        Py_RETURN_NONE;
    case FRK_TAG_FALSE:
        Py_RETURN_FALSE;
    case FRK_TAG_TRUE:
        Py_RETURN_TRUE;
    case FRK_TAG_INT:
        return PyLong_FromLongLong(nd->ival);
    case FRK_TAG_FLOAT:
        return PyFloat_FromDouble(nd->fval);
    case FRK_TAG_STR:
        return PyUnicode_DecodeUTF8((const char *)nd->data, (Py_ssize_t)nd->count, "strict");
    case FRK_TAG_BYTES:
        return PyBytes_FromStringAndSize((const char *)nd->data, (Py_ssize_t)nd->count);
    case FRK_TAG_TENSOR: {
        PyObject *idx = PyLong_FromUnsignedLongLong(nd->count);
        if (!idx)
            return NULL;
        PyObject *t = PyObject_CallOneArg(make_tensor, idx);
        Py_DECREF(idx);
        return t;
    }
    case FRK_TAG_LIST:
    case FRK_TAG_TUPLE: {
        int is_list = nd->tag == FRK_TAG_LIST;
        PyObject *c =
            is_list ? PyList_New((Py_ssize_t)nd->count) : PyTuple_New((Py_ssize_t)nd->count);
        for (uint64_t k = 0; c && k < nd->count; k++) {
            PyObject *v = build(ro, nodes, i, make_tensor);
            if (!v) {
                Py_CLEAR(c);
                break;
            }
            if (is_list)
                PyList_SET_ITEM(c, (Py_ssize_t)k, v);
            else
                PyTuple_SET_ITEM(c, (Py_ssize_t)k, v);
        }
        return c;
    }
    case FRK_TAG_DICT: {
        PyObject *d = PyDict_New();
        for (uint64_t k = 0; d && k < nd->count; k++) {
            PyObject *key = build(ro, nodes, i, make_tensor);
            /* interned, as the literals a state dict's keys come from are: an object saved again
               with pickle (a between-stage learn.save) then memoizes its repeated keys as it did
               before */
            if (key && PyUnicode_CheckExact(key))
                PyUnicode_InternInPlace(&key);
            PyObject *v = key ? build(ro, nodes, i, make_tensor) : NULL;
            if (!v || PyDict_SetItem(d, key, v) < 0)
                Py_CLEAR(d);
            Py_XDECREF(key);
            Py_XDECREF(v);
        }
        if (d && (uint64_t)PyDict_GET_SIZE(d) != nd->count) {
            PyErr_SetString(state_of_type(Py_TYPE(ro))->CheckpointError,
                            "a dict in the value tree repeats a key");
            Py_CLEAR(d);
        }
        return d;
    }
    }
    PyErr_SetString(PyExc_SystemError, "unvalidated node in the value tree");
    return NULL;
}

static PyObject *Reader_tree(ReaderObject *ro, PyObject *make_tensor)
{
    if (!PyCallable_Check(make_tensor)) {
        PyErr_SetString(PyExc_TypeError, "tree(make_tensor): make_tensor must be callable");
        return NULL;
    }
    size_t i = 0;
    return build(ro, frk_reader_nodes(ro->r), &i, make_tensor);
}

static PyObject *Reader_verify_blob(ReaderObject *ro, PyObject *v)
{
    size_t i = PyLong_AsSize_t(v);
    if (i == (size_t)-1 && PyErr_Occurred())
        return NULL;
    frk_error err;
    int rc;
    const frk_blob *blob = frk_reader_blob(ro->r, i);
    if (blob && blob->length >= CRC_GIL_THRESHOLD) {
        Py_BEGIN_ALLOW_THREADS
        rc = frk_reader_verify_blob(ro->r, i, &err);
        Py_END_ALLOW_THREADS
    } else {
        rc = frk_reader_verify_blob(ro->r, i, &err);
    }
    if (rc)
        return raise_frk(state_of_type(Py_TYPE(ro)), &err);
    Py_RETURN_NONE;
}

static PyObject *Reader_get_version(ReaderObject *ro, void *Py_UNUSED(c))
{
    return PyLong_FromUnsignedLong(frk_reader_version(ro->r));
}

static PyMethodDef Reader_methods[] = {
    {"blobs", (PyCFunction)Reader_blobs, METH_NOARGS,
     "blobs($self, /)\n--\n\nThe blob table: [(offset, length, crc32c)]."},
    {"tensors", (PyCFunction)Reader_tensors, METH_NOARGS,
     "tensors($self, /)\n--\n\n"
     "The tensor table: [(kind, dtype, blob, storage_offset, sizes, strides)]."},
    {"tree", (PyCFunction)Reader_tree, METH_O,
     "tree($self, make_tensor, /)\n--\n\n"
     "The value tree; make_tensor(i) builds tensor i (called once per reference)."},
    {"verify_blob", (PyCFunction)Reader_verify_blob, METH_O,
     "verify_blob($self, index, /)\n--\n\nCheck blob index's CRC32C."},
    {NULL},
};
static PyGetSetDef Reader_getset[] = {
    {"version", (getter)Reader_get_version, NULL, "format version", NULL},
    {NULL},
};
static PyType_Slot Reader_slots[] = {
    {Py_tp_new, Reader_new},
    {Py_tp_dealloc, Reader_dealloc},
    {Py_tp_methods, Reader_methods},
    {Py_tp_getset, Reader_getset},
    {Py_tp_doc, "Reader(data, verify=True)\n--\n\n"
                "Validates a checkpoint image (a Mapping or bytes) and decodes its index."},
    {0, NULL},
};
static PyType_Spec Reader_spec = {"fastai_resume._core.Reader", sizeof(ReaderObject), 0,
                                  Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE, Reader_slots};

/* ---- SkipToIter --------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    frk_skip s;
} SkipObject;

static PyObject *Skip_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    if (!no_arguments("SkipToIter", args, kw))
        return NULL;
    SkipObject *o = (SkipObject *)type->tp_alloc(type, 0);
    if (o)
        frk_skip_disarm(&o->s);
    return (PyObject *)o;
}

static void Skip_dealloc(SkipObject *o)
{
    PyTypeObject *tp = Py_TYPE(o);
    tp->tp_free(o);
    Py_DECREF(tp);
}

static PyObject *Skip_arm(SkipObject *o, PyObject *args)
{
    long long e, i, ne, ni;
    if (!PyArg_ParseTuple(args, "LLLL:arm", &e, &i, &ne, &ni))
        return NULL;
    frk_error err;
    if (frk_skip_arm(&o->s, e, i, ne, ni, &err))
        return raise_frk(state_of_type(Py_TYPE(o)), &err);
    Py_RETURN_NONE;
}

static PyObject *Skip_before_epoch(SkipObject *o, PyObject *v)
{
    long long e = PyLong_AsLongLong(v);
    if (e == -1 && PyErr_Occurred())
        return NULL;
    frk_skip_step st = frk_skip_before_epoch(&o->s, e);
    return Py_BuildValue("iiL", st.action, st.rng, (long long)st.first_iter);
}

static PyObject *Skip_take_rng(SkipObject *o, PyObject *Py_UNUSED(a))
{
    return PyBool_FromLong(frk_skip_take_rng(&o->s));
}

static PyObject *Skip_after_epoch(SkipObject *o, PyObject *v)
{
    long long e = PyLong_AsLongLong(v);
    if (e == -1 && PyErr_Occurred())
        return NULL;
    frk_skip_after_epoch(&o->s, e);
    Py_RETURN_NONE;
}

static PyObject *Skip_after_last_epoch(SkipObject *o, PyObject *Py_UNUSED(a))
{
    return PyBool_FromLong(frk_skip_after_last_epoch(&o->s));
}

static PyObject *Skip_get_pending(SkipObject *o, void *Py_UNUSED(c))
{
    return PyBool_FromLong(frk_skip_pending(&o->s));
}

static PyMethodDef Skip_methods[] = {
    {"arm", (PyCFunction)Skip_arm, METH_VARARGS,
     "arm($self, epoch, iter, n_epoch, n_iter, /)\n--\n\n"
     "Resume at (epoch, iter) in a fit of n_epoch epochs of n_iter batches."},
    {"before_epoch", (PyCFunction)Skip_before_epoch, METH_O,
     "before_epoch($self, epoch, /)\n--\n\n"
     "At the start of each epoch: (action, rng_action, first_iter), with action one of\n"
     "STEP_RUN, STEP_SKIP, STEP_RESUME and rng_action one of RNG_NONE, RNG_SAVED,\n"
     "RNG_EPOCH_START."},
    {"take_rng", (PyCFunction)Skip_take_rng, METH_NOARGS,
     "take_rng($self, /)\n--\n\n"
     "True exactly once, when the saved mid-epoch RNG state is due."},
    {"after_epoch", (PyCFunction)Skip_after_epoch, METH_O,
     "after_epoch($self, epoch, /)\n--\n\nAt the end of each epoch that ran."},
    {"after_last_epoch", (PyCFunction)Skip_after_last_epoch, METH_NOARGS,
     "after_last_epoch($self, /)\n--\n\n"
     "True once, after the last epoch, if the resume's target was the fit's very end."},
    {NULL},
};
static PyGetSetDef Skip_getset[] = {
    {"pending", (getter)Skip_get_pending, NULL, "the resume still has work to do", NULL},
    {NULL},
};
static PyType_Slot Skip_slots[] = {
    {Py_tp_new, Skip_new},
    {Py_tp_dealloc, Skip_dealloc},
    {Py_tp_methods, Skip_methods},
    {Py_tp_getset, Skip_getset},
    {Py_tp_doc, "SkipToIter()\n--\n\nThe resume state machine (csrc/skip.c)."},
    {0, NULL},
};
static PyType_Spec Skip_spec = {"fastai_resume._core.SkipToIter", sizeof(SkipObject), 0,
                                Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE, Skip_slots};

/* ---- module functions ------------------------------------------------------------ */

static PyObject *core_crc32c(PyObject *Py_UNUSED(m), PyObject *args)
{
    Py_buffer v;
    unsigned int crc = 0;
    if (!PyArg_ParseTuple(args, "y*|I:crc32c", &v, &crc))
        return NULL;
    uint32_t r;
    if (v.len >= CRC_GIL_THRESHOLD) {
        Py_BEGIN_ALLOW_THREADS
        r = frk_crc32c(crc, v.buf, (size_t)v.len);
        Py_END_ALLOW_THREADS
    } else {
        r = frk_crc32c(crc, v.buf, (size_t)v.len);
    }
    PyBuffer_Release(&v);
    return PyLong_FromUnsignedLong(r);
}

static PyObject *core_crc32c_combine(PyObject *Py_UNUSED(m), PyObject *args)
{
    unsigned int crc1, crc2;
    unsigned long long len2;
    if (!PyArg_ParseTuple(args, "IIK:crc32c_combine", &crc1, &crc2, &len2))
        return NULL;
    return PyLong_FromUnsignedLong(frk_crc32c_combine(crc1, crc2, (uint64_t)len2));
}

static PyObject *core_copy_crc32c(PyObject *Py_UNUSED(m), PyObject *args)
{
    Py_buffer dst, src;
    if (!PyArg_ParseTuple(args, "w*y*:copy_crc32c", &dst, &src))
        return NULL;
    PyObject *r = NULL;
    if (dst.len != src.len) {
        PyErr_Format(PyExc_ValueError, "copy_crc32c: dst has %zd bytes, src %zd", dst.len, src.len);
    } else if ((const char *)dst.buf < (const char *)src.buf + src.len &&
               (const char *)src.buf < (const char *)dst.buf + dst.len) {
        PyErr_SetString(PyExc_ValueError, "copy_crc32c: dst and src overlap");
    } else {
        uint32_t crc;
        Py_BEGIN_ALLOW_THREADS
        crc = frk_copy_crc32c(dst.buf, src.buf, (size_t)src.len);
        Py_END_ALLOW_THREADS
        r = PyLong_FromUnsignedLong(crc);
    }
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return r;
}

/* crc32c_many(buffers, threads): one list in, one list out; every buffer is held (so none can be
 * freed or resized) while the threads read them without the GIL. */
static PyObject *core_crc32c_many(PyObject *Py_UNUSED(m), PyObject *args)
{
    PyObject *seq_in, *seq = NULL, *r = NULL;
    int threads;
    if (!PyArg_ParseTuple(args, "Oi:crc32c_many", &seq_in, &threads))
        return NULL;
    if (!(seq = PySequence_Fast(seq_in, "crc32c_many: buffers must be a sequence")))
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), held = 0;
    size_t count = n ? (size_t)n : 1;
    Py_buffer *views = PyMem_Calloc(count, sizeof *views);
    const void **data = PyMem_Calloc(count, sizeof *data);
    size_t *len = PyMem_Calloc(count, sizeof *len);
    uint32_t *out = PyMem_Calloc(count, sizeof *out);
    if (!views || !data || !len || !out) {
        PyErr_NoMemory();
        goto error;
    }
    for (; held < n; held++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, held), &views[held], PyBUF_SIMPLE) < 0)
            goto error;
        data[held] = views[held].buf;
        len[held] = (size_t)views[held].len;
    }
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = frk_crc32c_many((size_t)n, data, len, out, threads < 1 ? 1 : threads);
    Py_END_ALLOW_THREADS
    if (status != FRK_OK) {
        PyErr_NoMemory();
        goto error;
    }
    if (!(r = PyList_New(n)))
        goto error;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = PyLong_FromUnsignedLong(out[i]);
        if (!v) {
            Py_CLEAR(r);
            goto error;
        }
        PyList_SET_ITEM(r, i, v);
    }
error:
    for (Py_ssize_t i = 0; i < held; i++)
        PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    PyMem_Free(data);
    PyMem_Free(len);
    PyMem_Free(out);
    Py_DECREF(seq);
    return r;
}

static PyObject *core_has_magic(PyObject *Py_UNUSED(m), PyObject *arg)
{
    Py_buffer v;
    if (PyObject_GetBuffer(arg, &v, PyBUF_SIMPLE) < 0)
        return NULL;
    int r = frk_has_magic(v.buf, (size_t)v.len);
    PyBuffer_Release(&v);
    return PyBool_FromLong(r);
}

static PyObject *core_skip_plan(PyObject *Py_UNUSED(m), PyObject *args)
{
    int has_saved;
    long long se, si, e0, i0;
    if (!PyArg_ParseTuple(args, "pLLLL:skip_plan", &has_saved, &se, &si, &e0, &i0))
        return NULL;
    int64_t e, i;
    if (!frk_skip_plan(has_saved, se, si, e0, i0, &e, &i))
        Py_RETURN_NONE;
    return Py_BuildValue("LL", (long long)e, (long long)i);
}

static PyObject *core_copy_use_openmp(PyObject *Py_UNUSED(m), PyObject *v)
{
    int on = PyObject_IsTrue(v);
    if (on < 0)
        return NULL;
    return PyBool_FromLong(frk_copy_use_openmp(on));
}

static PyObject *core_dtype_size(PyObject *Py_UNUSED(m), PyObject *v)
{
    long c = PyLong_AsLong(v);
    if (c == -1 && PyErr_Occurred())
        return NULL;
    return PyLong_FromSize_t(c < 0 ? 0 : frk_dtype_size((unsigned)c));
}

static PyMethodDef core_methods[] = {
    {"crc32c", core_crc32c, METH_VARARGS,
     "crc32c($module, data, crc=0, /)\n--\n\nCRC32C of data, continuing from crc."},
    {"crc32c_combine", core_crc32c_combine, METH_VARARGS,
     "crc32c_combine($module, crc1, crc2, len2, /)\n--\n\n"
     "The CRC32C of A then B, from A's (crc1), B's (crc2) and B's length in bytes (len2)."},
    {"crc32c_many", core_crc32c_many, METH_VARARGS,
     "crc32c_many($module, buffers, threads, /)\n--\n\n"
     "The CRC32C of each buffer, as a list, computed on `threads` threads with the GIL released."},
    {"copy_crc32c", core_copy_crc32c, METH_VARARGS,
     "copy_crc32c($module, dst, src, /)\n--\n\n"
     "Copy src's bytes into dst (the same size, not overlapping), with the GIL released; returns\n"
     "their CRC32C, taken while they were copied."},
    {"copy_use_openmp", core_copy_use_openmp, METH_O,
     "copy_use_openmp($module, on, /)\n--\n\n"
     "Whether copy_crc32c splits big copies over an OpenMP team (on) or a thread of its own;\n"
     "returns whether OpenMP is used (False where the process has no libgomp.so.1 loaded)."},
    {"has_magic", core_has_magic, METH_O,
     "has_magic($module, head, /)\n--\n\nTrue if head starts with this format's magic bytes."},
    {"skip_plan", core_skip_plan, METH_VARARGS,
     "skip_plan($module, has_saved, saved_epoch, saved_iter, start_epoch, start_iter, /)\n--\n\n"
     "The (epoch, iter) a fit resumes at, or None when it runs from the start; negative start\n"
     "values mean not given."},
    {"dtype_size", core_dtype_size, METH_O,
     "dtype_size($module, code, /)\n--\n\nBytes per element of a dtype code (0: unknown)."},
    {NULL},
};

/* A heap type of module m, added to it: a new reference, or NULL with an exception set. */
static PyTypeObject *add_type(PyObject *m, PyType_Spec *spec)
{
    PyTypeObject *t = (PyTypeObject *)PyType_FromModuleAndSpec(m, spec, NULL);
    if (t && PyModule_AddType(m, t) < 0)
        Py_CLEAR(t);
    return t;
}

static int core_exec(PyObject *m)
{
    core_state *st = PyModule_GetState(m);
    st->CheckpointError = PyErr_NewExceptionWithDoc(
        "fastai_resume.CheckpointError",
        "A checkpoint file is damaged, truncated, hostile or not a checkpoint.", PyExc_ValueError,
        NULL);
    if (!st->CheckpointError || PyModule_AddObjectRef(m, "CheckpointError", st->CheckpointError))
        return -1;
    if (!(st->Writer = add_type(m, &Writer_spec)) || !(st->Mapping = add_type(m, &Mapping_spec)) ||
        !(st->Reader = add_type(m, &Reader_spec)) || !(st->SkipToIter = add_type(m, &Skip_spec)))
        return -1;
    if (PyModule_AddStringConstant(m, "crc32c_impl", frk_crc32c_impl()) ||
        PyModule_AddIntConstant(m, "FORMAT_VERSION", FRK_FORMAT_VERSION) ||
        PyModule_AddIntConstant(m, "BLOB_ALIGN", FRK_BLOB_ALIGN) ||
        PyModule_AddIntConstant(m, "PAGE_ALIGN", FRK_PAGE_ALIGN) ||
        PyModule_AddIntConstant(m, "PAGE_ALIGN_MIN", (long)FRK_PAGE_ALIGN_MIN) ||
        PyModule_AddIntConstant(m, "MAX_DEPTH", FRK_MAX_DEPTH) ||
        /* SkipToIter.before_epoch's answers (csrc/frk.h), so that Python never mirrors them */
        PyModule_AddIntConstant(m, "STEP_RUN", FRK_SKIP_RUN) ||
        PyModule_AddIntConstant(m, "STEP_SKIP", FRK_SKIP_SKIP) ||
        PyModule_AddIntConstant(m, "STEP_RESUME", FRK_SKIP_RESUME) ||
        PyModule_AddIntConstant(m, "RNG_NONE", FRK_RNG_NONE) ||
        PyModule_AddIntConstant(m, "RNG_SAVED", FRK_RNG_SAVED) ||
        PyModule_AddIntConstant(m, "RNG_EPOCH_START", FRK_RNG_EPOCH_START))
        return -1;
    return 0;
}

static int core_traverse(PyObject *m, visitproc visit, void *arg)
{
    core_state *st = PyModule_GetState(m);
    Py_VISIT(st->CheckpointError);
    Py_VISIT(st->Writer);
    Py_VISIT(st->Mapping);
    Py_VISIT(st->Reader);
    Py_VISIT(st->SkipToIter);
    return 0;
}

static int core_clear(PyObject *m)
{
    core_state *st = PyModule_GetState(m);
    Py_CLEAR(st->CheckpointError);
    Py_CLEAR(st->Writer);
    Py_CLEAR(st->Mapping);
    Py_CLEAR(st->Reader);
    Py_CLEAR(st->SkipToIter);
    return 0;
}

static void core_free(void *m) { core_clear((PyObject *)m); }

static PyModuleDef_Slot core_slots[] = {
    {Py_mod_exec, core_exec},
    {0, NULL},
};

static struct PyModuleDef core_module = {
    PyModuleDef_HEAD_INIT,
    "fastai_resume._core",
    "The C core of fastai_resume: checkpoint format, CRC32C, atomic commit, SkipToIter.",
    sizeof(core_state),
    core_methods,
    core_slots,
    core_traverse,
    core_clear,
    core_free,
};

PyMODINIT_FUNC PyInit__core(void) { return PyModuleDef_Init(&core_module); }
