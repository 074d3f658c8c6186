/* metricbus._speedups: the commit's two hot loops over an update's plain records, in C.
 *
 * Optional: metricbus works the same without it (metricbus/native.py falls back to the numpy code, and
 * METRICBUS_PURE_PYTHON=1 turns it off). Each function gives exactly the bits of the Python code it stands for
 * (tests/test_native.py checks both on random data), or says "not here" and leaves the rare cases to that code.
 *
 * append_dict(metrics, fast) -> longest | -1            see metricbus.collect.Collector.log_floats
 * take_plain(buffers)  -> (counts, records) | None     see metricbus.accumulate.PlainBuffers.take
 * finite_nonzero(fields, rows) -> bool                 see metricbus.rank_level._all_finite_nonzero
 * columns(flat, sizes, fields, near) -> 0 | reason     see metricbus.micro_columns._columns
 *
 * Built with -ffp-contract=off: every product and sum rounds as IEEE 754 says, as numpy's loops do.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define ABI 1 /* metricbus/native.py loads this module only at this version (a stale build is not used) */

/* append_dict: log(dict)'s fast path. Where every key of ``metrics`` is a str with a buffer (a list) in ``fast``
 * and every value a float (exactly), append each value to its buffer, in the dict's order, and return the longest
 * of those buffers' lengths; else append nothing and return -1. The GIL is held throughout and no Python code runs,
 * so the call's records are appended together or not at all. */
static PyObject *append_dict(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *metrics, *fast, *key, *value, *held[16];
    if (!PyArg_ParseTuple(args, "O!O!", &PyDict_Type, &metrics, &PyDict_Type, &fast)) {
        return NULL;
    }
    Py_ssize_t n = PyDict_GET_SIZE(metrics), pos = 0, i = 0, longest = -1;
    if (n == 0) {
        return PyLong_FromLong(-1);
    }
    PyObject **buffers = n <= 16 ? held : (PyObject **)PyMem_Malloc((size_t)n * sizeof(PyObject *));
    if (buffers == NULL) {
        return PyErr_NoMemory();
    }
    while (PyDict_Next(metrics, &pos, &key, &value)) {
        if (!PyFloat_CheckExact(value) || !PyUnicode_CheckExact(key)) {
            goto out;
        }
        PyObject *buffer = PyDict_GetItemWithError(fast, key); /* exact str keys: no Python code runs */
        if (buffer == NULL || !PyList_CheckExact(buffer)) {
            if (PyErr_Occurred()) {
                longest = -2;
            }
            goto out;
        }
        buffers[i++] = buffer;
    }
    longest = 0;
    pos = 0;
    i = 0;
    while (PyDict_Next(metrics, &pos, &key, &value)) {
        PyObject *buffer = buffers[i++];
        if (PyList_Append(buffer, value) < 0) {
            longest = -2;
            goto out;
        }
        if (PyList_GET_SIZE(buffer) > longest) {
            longest = PyList_GET_SIZE(buffer);
        }
    }
out:
    if (buffers != held) {
        PyMem_Free(buffers);
    }
    return longest == -2 ? NULL : PyLong_FromSsize_t(longest);
}

/* take_plain: every record of every buffer (lists of floats), one after another as native doubles, and each
 * buffer's count; the buffers are emptied. None, touching nothing, where an item is not a float. The GIL is held
 * throughout and no Python code runs, so no record can be appended between reading a buffer and emptying it. */
static PyObject *take_plain(PyObject *self, PyObject *buffers) {
    (void)self;
    if (!PyList_Check(buffers)) {
        PyErr_SetString(PyExc_TypeError, "take_plain: buffers must be a list of lists");
        return NULL;
    }
    Py_ssize_t k = PyList_GET_SIZE(buffers), total = 0;
    for (Py_ssize_t i = 0; i < k; i++) {
        PyObject *buffer = PyList_GET_ITEM(buffers, i);
        if (!PyList_Check(buffer)) {
            PyErr_SetString(PyExc_TypeError, "take_plain: buffers must be a list of lists");
            return NULL;
        }
        Py_ssize_t n = PyList_GET_SIZE(buffer);
        for (Py_ssize_t j = 0; j < n; j++) {
            if (!PyFloat_Check(PyList_GET_ITEM(buffer, j))) {
                Py_RETURN_NONE;
            }
        }
        total += n;
    }
    PyObject *counts = PyList_New(k);
    if (counts == NULL) {
        return NULL;
    }
    PyObject *records = PyBytes_FromStringAndSize(NULL, total * (Py_ssize_t)sizeof(double));
    if (records == NULL) {
        Py_DECREF(counts);
        return NULL;
    }
    double *out = (double *)PyBytes_AS_STRING(records);
    for (Py_ssize_t i = 0; i < k; i++) {
        PyObject *buffer = PyList_GET_ITEM(buffers, i);
        Py_ssize_t n = PyList_GET_SIZE(buffer);
        PyObject *count = PyLong_FromSsize_t(n);
        if (count == NULL) {
            Py_DECREF(counts);
            Py_DECREF(records);
            return NULL;
        }
        PyList_SET_ITEM(counts, i, count);
        for (Py_ssize_t j = 0; j < n; j++) {
            *out++ = PyFloat_AS_DOUBLE(PyList_GET_ITEM(buffer, j));
        }
    }
    /* only now, with nothing left that can fail but the slice deletions (which free nothing but floats) */
    for (Py_ssize_t i = 0; i < k; i++) {
        PyObject *buffer = PyList_GET_ITEM(buffers, i);
        Py_ssize_t n = PyList_GET_SIZE(buffer);
        if (n && PyList_SetSlice(buffer, 0, n, NULL) < 0) {
            Py_DECREF(counts);
            Py_DECREF(records);
            return NULL;
        }
    }
    return Py_BuildValue("(NN)", counts, records);
}

/* numpy's pairwise sum of doubles (DOUBLE_pairwise_sum, numpy/_core/src/umath), which np.add.reduce and
 * np.add.reduceat apply to a segment's elements after its first: the same association, so the same bits. */
static double pairwise(const double *a, Py_ssize_t n) {
    if (n < 8) {
        double res = 0.;
        for (Py_ssize_t i = 0; i < n; i++) {
            res += a[i];
        }
        return res;
    }
    if (n <= 128) {
        double r[8];
        Py_ssize_t i;
        for (int j = 0; j < 8; j++) {
            r[j] = a[j];
        }
        for (i = 8; i < n - (n % 8); i += 8) {
            for (int j = 0; j < 8; j++) {
                r[j] += a[i + j];
            }
        }
        double res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; i++) {
            res += a[i];
        }
        return res;
    }
    Py_ssize_t n2 = n / 2;
    n2 -= n2 % 8;
    return pairwise(a, n2) + pairwise(a + n2, n - n2);
}

/* reasons columns() leaves a call to the numpy code */
enum {
    DONE = 0,
    NOT_FINITE = 1,    /* a NaN or an infinity */
    NEGATIVE_ZERO = 2, /* a -0.0 record (signed_zero's rules) */
    LARGE = 3,         /* a magnitude from 2**500 (squares may overflow) or beyond the extraction's range */
    UNSETTLED = 4,     /* an exact sum of more than two components: fsum */
    NEAR_MEAN = 5,     /* a spread tiny next to the mean: m2 is taken again (summary.NEAR) */
};

#define QUIET 0x1p500
#define EXP_TOP 1020

static int shift_of(Py_ssize_t longest) { /* M of _exact_sums: (2 * longest - 1).bit_length() */
    unsigned long long v = (unsigned long long)(2 * longest - 1);
    int bits = 0;
    while (v) {
        bits++;
        v >>= 1;
    }
    return bits;
}

/* columns(flat, sizes, fields, near): the fields of micro_columns._columns for finite records, each metric's
 * (``sizes[i]`` of them, in order) summarised into column i of ``fields`` (float64, N_FIELDS x k, C order).
 * Returns 0, or the reason (above) the numpy code must do it instead; ``fields`` is then meaningless. */
static PyObject *columns(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer flat_view, sizes_view, fields_view;
    double near;
    if (!PyArg_ParseTuple(args, "y*y*w*d", &flat_view, &sizes_view, &fields_view, &near)) {
        return NULL;
    }
    long reason = DONE;
    double *deviations = NULL;
    const double *flat = (const double *)flat_view.buf;
    const Py_ssize_t *sizes = (const Py_ssize_t *)sizes_view.buf;
    double *fields = (double *)fields_view.buf;
    Py_ssize_t n_flat = flat_view.len / (Py_ssize_t)sizeof(double);
    Py_ssize_t k = sizes_view.len / (Py_ssize_t)sizeof(Py_ssize_t);
    Py_ssize_t longest = 0, total = 0;
    for (Py_ssize_t i = 0; i < k; i++) {
        if (sizes[i] < 1) {
            PyErr_SetString(PyExc_ValueError, "columns: every size must be at least 1");
            goto fail;
        }
        total += sizes[i];
        if (sizes[i] > longest) {
            longest = sizes[i];
        }
    }
    if (total != n_flat || fields_view.len != (Py_ssize_t)(12 * k * sizeof(double))) {
        PyErr_SetString(PyExc_ValueError, "columns: flat must hold sum(sizes) doubles and fields 12 x len(sizes)");
        goto fail;
    }
    if (k == 0) {
        goto done;
    }
    deviations = (double *)PyMem_Malloc((size_t)longest * sizeof(double));
    if (deviations == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    int shift = shift_of(longest);
    double sigma0 = ldexp(1.0, shift), scale = ldexp(1.0, shift - 53), top = ldexp(1.0, EXP_TOP - shift);
    Py_ssize_t start = 0;
    for (Py_ssize_t i = 0; i < k; start += sizes[i], i++) {
        const double *x = flat + start;
        Py_ssize_t c = sizes[i];
        double lowest = x[0], highest = x[0];
        for (Py_ssize_t j = 0; j < c; j++) {
            double v = x[j];
            uint64_t bits;
            memcpy(&bits, &v, sizeof bits);
            if (!isfinite(v)) {
                reason = NOT_FINITE;
                goto done;
            }
            if (bits == 0x8000000000000000ULL) {
                reason = NEGATIVE_ZERO;
                goto done;
            }
            if (v < lowest) {
                lowest = v;
            }
            if (v > highest) {
                highest = v;
            }
        }
        double big = -lowest > highest ? -lowest : highest;
        if (big >= QUIET || big >= top) {
            reason = LARGE;
            goto done;
        }
        int e;
        (void)frexp(big, &e);
        double sigma = ldexp(sigma0, e);
        double sum = 0.0, tail = 0.0;
        int left_any = 0;
        for (Py_ssize_t j = 0; j < c; j++) { /* the first extraction: exact in any order */
            double q = (sigma + x[j]) - sigma;
            double left = x[j] - q;
            sum += q;
            deviations[j] = left;
            left_any |= left != 0.0;
        }
        if (left_any) {
            double sigma2 = sigma * scale;
            for (Py_ssize_t j = 0; j < c; j++) {
                double q = (sigma2 + deviations[j]) - sigma2;
                if (deviations[j] - q != 0.0) {
                    reason = UNSETTLED;
                    goto done;
                }
                tail += q;
            }
        }
        double hi = sum + tail, b = hi - sum;
        double lo = sum - (hi - b);
        lo += tail - b;
        double n = (double)c, mean = hi / n;
        for (Py_ssize_t j = 0; j < c; j++) {
            double d = x[j] - mean;
            deviations[j] = d * d;
        }
        double m2 = deviations[0] + pairwise(deviations + 1, c - 1);
        double bound = mean * mean;
        bound *= n * near;
        if (m2 <= bound && m2 != 0.0) {
            reason = NEAR_MEAN;
            goto done;
        }
        fields[0 * k + i] = n;
        fields[1 * k + i] = n;
        fields[2 * k + i] = 0.0;
        fields[3 * k + i] = hi;
        fields[4 * k + i] = lo;
        fields[5 * k + i] = hi;
        fields[6 * k + i] = lo;
        fields[7 * k + i] = m2;
        fields[8 * k + i] = lowest;
        fields[9 * k + i] = highest;
        fields[10 * k + i] = x[0];
        fields[11 * k + i] = x[c - 1];
    }
done:
    PyMem_Free(deviations);
    PyBuffer_Release(&flat_view);
    PyBuffer_Release(&sizes_view);
    PyBuffer_Release(&fields_view);
    return PyLong_FromLong(reason);
fail:
    PyMem_Free(deviations);
    PyBuffer_Release(&flat_view);
    PyBuffer_Release(&sizes_view);
    PyBuffer_Release(&fields_view);
    return NULL;
}

/* finite_nonzero(fields, rows): True if every double of the given rows of ``fields`` (float64, C order, its first
 * axis the rows: e.g. (N_FIELDS, R, C)) is finite and nonzero; one pass, no temporaries. */
static PyObject *finite_nonzero(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer view;
    PyObject *rows;
    Py_ssize_t n_rows;
    if (!PyArg_ParseTuple(args, "y*O!n", &view, &PyTuple_Type, &rows, &n_rows)) {
        return NULL;
    }
    Py_ssize_t total = view.len / (Py_ssize_t)sizeof(double);
    if (n_rows < 1 || total % n_rows) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "finite_nonzero: fields must hold n_rows rows of equal length");
        return NULL;
    }
    Py_ssize_t width = total / n_rows;
    const double *fields = (const double *)view.buf;
    int ok = 1;
    for (Py_ssize_t i = 0; ok && i < PyTuple_GET_SIZE(rows); i++) {
        Py_ssize_t row = PyLong_AsSsize_t(PyTuple_GET_ITEM(rows, i));
        if (row < 0 || row >= n_rows) {
            PyBuffer_Release(&view);
            if (!PyErr_Occurred()) {
                PyErr_SetString(PyExc_IndexError, "finite_nonzero: a row out of range");
            }
            return NULL;
        }
        const double *x = fields + row * width;
        for (Py_ssize_t j = 0; j < width; j++) {
            double a = fabs(x[j]);
            if (!(a > 0.0 && a < HUGE_VAL)) { /* a NaN fails both */
                ok = 0;
                break;
            }
        }
    }
    PyBuffer_Release(&view);
    return PyBool_FromLong(ok);
}

static PyMethodDef methods[] = {
    {"finite_nonzero", finite_nonzero, METH_VARARGS, "Every double of the rows finite and nonzero."},
    {"append_dict", append_dict, METH_VARARGS, "log(dict)'s fast path: the longest buffer appended to, or -1."},
    {"take_plain", take_plain, METH_O, "Every record of the buffers as native doubles, and their counts."},
    {"columns", columns, METH_VARARGS, "An update's micro fields in columns; 0, or why the numpy code must."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "metricbus._speedups", NULL, -1, methods};

PyMODINIT_FUNC PyInit__speedups(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "ABI", ABI) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
