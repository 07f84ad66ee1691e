/* A consumed batch of confluent-kafka messages split by partition in one C pass.
 *
 * What ``persist_lib.ingest.kafka.split._split`` does in Python (four ``map``s over the batch,
 * numpy arrays to find where a run of one partition ends) plus what decoding then does
 * per run (``b"\n".join`` of the values, the value lengths): measured ~0.25 s of CPU per
 * 1M messages, all of it holding the GIL on the ingestion's critical path; here ~0.03 s.
 *
 * No assumption about confluent-kafka's object layout: the Message type's own METH_NOARGS
 * methods (``error``, ``partition``, ``offset``, ``value``) are called directly, found by
 * name in the type's method table by ``bind(confluent_kafka.Message)``. Anything
 * unexpected (not bound, another type in the list, an error event in the batch, a value
 * that is not bytes) returns None and the caller takes the Python path, which handles
 * every case.
 *
 * split(msgs: list) -> list[tuple[int, int, int, list[int], list[bytes | None], bytes | None, bytes]] | None
 *   one tuple per run of one partition with ascending offsets, in batch order:
 *   (partition, start index, end index, offsets, values, joined, lengths) where
 *   ``joined`` is the run's values joined by b"\n" (None when a value is None or holds a
 *   b"\n" or b"\r": those runs take the line-by-line path) and ``lengths`` the value
 *   lengths as native int64 (0 for None).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static PyTypeObject *msg_type = NULL;
static PyCFunction m_error = NULL, m_partition = NULL, m_offset = NULL, m_value = NULL;

static PyCFunction find_noargs(PyTypeObject *t, const char *name) {
    for (PyMethodDef *d = t->tp_methods; d != NULL && d->ml_name != NULL; d++) {
        if (strcmp(d->ml_name, name) == 0) {
            return (d->ml_flags & (METH_NOARGS | METH_VARARGS | METH_KEYWORDS | METH_O | METH_FASTCALL)) == METH_NOARGS
                       ? d->ml_meth
                       : NULL;
        }
    }
    return NULL;
}

/* bind(Message) -> bool: the Message type's methods, looked up once; False when one is
 * missing or of another kind (the caller then keeps the Python path). */
static PyObject *bind(PyObject *self, PyObject *arg) {
    (void)self;
    if (!PyType_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "bind() takes confluent_kafka.Message");
        return NULL;
    }
    PyTypeObject *t = (PyTypeObject *)arg;
    PyCFunction e = find_noargs(t, "error"), p = find_noargs(t, "partition");
    PyCFunction o = find_noargs(t, "offset"), v = find_noargs(t, "value");
    if (!e || !p || !o || !v) Py_RETURN_FALSE;
    Py_INCREF(t);
    Py_XDECREF(msg_type);
    msg_type = t;
    m_error = e; m_partition = p; m_offset = o; m_value = v;
    Py_RETURN_TRUE;
}

static PyObject *split(PyObject *self, PyObject *arg) {
    (void)self;
    if (!PyList_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "split() takes a list of messages");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(arg);
    if (n == 0) return PyList_New(0);
    if (msg_type == NULL) Py_RETURN_NONE;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (Py_TYPE(PyList_GET_ITEM(arg, i)) != msg_type) Py_RETURN_NONE;
    }
    int64_t *parts = PyMem_Malloc(sizeof(int64_t) * n);
    int64_t *offs = PyMem_Malloc(sizeof(int64_t) * n);
    PyObject **offobj = PyMem_Calloc(n, sizeof(PyObject *));
    PyObject **vals = PyMem_Calloc(n, sizeof(PyObject *));
    PyObject *out = NULL;
    Py_ssize_t i = 0;
    if (!parts || !offs || !offobj || !vals) {
        PyErr_NoMemory();
        goto done;
    }
    for (i = 0; i < n; i++) {
        PyObject *m = PyList_GET_ITEM(arg, i);
        PyObject *e = m_error(m, NULL);
        if (e == NULL) goto done;
        int is_event = e != Py_None;
        Py_DECREF(e);
        if (is_event) {  /* (an event in the batch: the Python path) */
            out = Py_None;
            Py_INCREF(out);
            goto done;
        }
        PyObject *p = m_partition(m, NULL);
        if (p == NULL) goto done;
        parts[i] = PyLong_AsLongLong(p);
        Py_DECREF(p);
        if (parts[i] == -1 && PyErr_Occurred()) goto done;
        PyObject *o = m_offset(m, NULL);
        if (o == NULL) goto done;
        offs[i] = PyLong_AsLongLong(o);
        offobj[i] = o;
        if (offs[i] == -1 && PyErr_Occurred()) goto done;
        PyObject *v = m_value(m, NULL);
        if (v == NULL) goto done;
        vals[i] = v;
        if (v != Py_None && !PyBytes_Check(v)) {
            out = Py_None;
            Py_INCREF(out);
            goto done;
        }
    }
    out = PyList_New(0);
    if (out == NULL) goto done;
    Py_ssize_t start = 0;
    for (Py_ssize_t j = 1; j <= n; j++) {
        if (j < n && parts[j] == parts[j - 1] && offs[j] > offs[j - 1]) continue;
        Py_ssize_t k = j - start;
        PyObject *ol = PyList_New(k), *vl = PyList_New(k);
        PyObject *lens = PyBytes_FromStringAndSize(NULL, sizeof(int64_t) * k);
        PyObject *joined = NULL, *item = NULL;
        if (!ol || !vl || !lens) {
            Py_XDECREF(ol); Py_XDECREF(vl); Py_XDECREF(lens);
            goto fail;
        }
        int64_t *lp = (int64_t *)PyBytes_AS_STRING(lens);
        Py_ssize_t total = 0;
        int clean = 1;
        for (Py_ssize_t x = 0; x < k; x++) {
            PyObject *v = vals[start + x];
            Py_INCREF(offobj[start + x]);
            PyList_SET_ITEM(ol, x, offobj[start + x]);
            Py_INCREF(v);
            PyList_SET_ITEM(vl, x, v);
            if (v == Py_None) {
                lp[x] = 0;
                clean = 0;
                continue;
            }
            Py_ssize_t len = PyBytes_GET_SIZE(v);
            const char *s = PyBytes_AS_STRING(v);
            lp[x] = len;
            total += len;
            if (clean && (memchr(s, '\n', len) || memchr(s, '\r', len))) clean = 0;
        }
        if (clean) {
            joined = PyBytes_FromStringAndSize(NULL, total + k - 1);
            if (joined == NULL) {
                Py_DECREF(ol); Py_DECREF(vl); Py_DECREF(lens);
                goto fail;
            }
            char *w = PyBytes_AS_STRING(joined);
            for (Py_ssize_t x = 0; x < k; x++) {
                PyObject *v = vals[start + x];
                Py_ssize_t len = PyBytes_GET_SIZE(v);
                if (x) *w++ = '\n';
                memcpy(w, PyBytes_AS_STRING(v), len);
                w += len;
            }
        } else {
            joined = Py_None;
            Py_INCREF(joined);
        }
        item = Py_BuildValue("(LnnNNNN)", (long long)parts[start], start, j, ol, vl, joined, lens);
        if (item == NULL || PyList_Append(out, item) < 0) {
            Py_XDECREF(item);
            goto fail;
        }
        Py_DECREF(item);
        start = j;
    }
    goto done;
fail:
    Py_CLEAR(out);
done:
    for (Py_ssize_t x = 0; x < n && vals != NULL && offobj != NULL; x++) {
        Py_XDECREF(offobj[x]);
        Py_XDECREF(vals[x]);
    }
    PyMem_Free(parts);
    PyMem_Free(offs);
    PyMem_Free(offobj);
    PyMem_Free(vals);
    if (out == NULL && !PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "split() failed");
    return out;
}

static PyMethodDef methods[] = {
    {"bind", bind, METH_O, "Binds confluent_kafka.Message's methods; False when unusable."},
    {"split", split, METH_O, "Splits a consumed batch by partition (see the module's source)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_split",
    "A consumed Kafka batch split by partition in one C pass (persist_lib.ingest.kafka.split).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__split(void) { return PyModule_Create(&module); }
