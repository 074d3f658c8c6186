/* metricbus._speedups: the hot loops of log(dict), a commit's plain records and an array fold, in C.
 *
 * Optional: metricbus works the same without it (metricbus/native.py falls back to the numpy code, and
 * METRICBUS_PURE_PYTHON=1 turns it off). Each function gives exactly the bits of the Python code it stands for
 * (tests/test_native.py checks both on random data), or says "not here" and leaves the rare cases to that code.
 *
 * append_dict(metrics, fast) -> longest | -1            see metricbus.collect.Collector.log_floats
 * take_plain(buffers)  -> (counts, records) | None     see metricbus.accumulate.PlainBuffers.take
 * finite_nonzero(fields, rows) -> bool                 see metricbus.rank_level._all_finite_nonzero
 * array_parts(values) -> (lowest, highest, sums) | None  see metricbus.summary_arrays._of_block
 * columns(flat, sizes, fields, near) -> 0 | reason     see metricbus.micro_columns._columns
 * compact_into(target, where, fields, count, step, crc) -> size | 0   see metricbus.journal.compact.CompactFrame
 *
 * Built with -ffp-contract=off: every product and sum rounds as IEEE 754 says, as numpy's loops do.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

#define ABI 3 /* metricbus/native.py loads this module only at this version (a stale build is not used) */

/* append_dict: log(dict)'s fast path. Where ``metrics`` holds at least two keys (a one-key dict takes the
 * validated path, as in the Python code), every key is a str (exactly) with a buffer (a list) in ``fast`` and every
 * value a float (exactly), append each value to its buffer, in the dict's order, and return the longest of those
 * buffers' lengths; else append nothing and return -1. The buffers are held (a new reference each) while they are
 * looked up: a lookup may compare a str subclass's key in ``fast`` with __eq__ (Python code); where that changed
 * ``metrics``, nothing is appended. The appends themselves run no Python code, so the call's records are appended
 * together with no other thread in between. */
static PyObject *append_dict(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *metrics, *fast, *key, *value, *held[16];
    if (!PyArg_ParseTuple(args, "O!O!", &PyDict_Type, &metrics, &PyDict_Type, &fast)) {
        return NULL;
    }
    Py_ssize_t n = PyDict_GET_SIZE(metrics), pos = 0, found = 0, longest = -1;
    if (n < 2) {
        return PyLong_FromLong(-1);
    }
    PyObject **buffers = n <= 16 ? held : (PyObject **)PyMem_Malloc((size_t)n * sizeof(PyObject *));
    if (buffers == NULL) {
        return PyErr_NoMemory();
    }
    while (found < n && PyDict_Next(metrics, &pos, &key, &value)) {
        if (!PyFloat_CheckExact(value) || !PyUnicode_CheckExact(key)) {
            goto out;
        }
        PyObject *buffer = PyDict_GetItemWithError(fast, key);
        if (buffer == NULL || !PyList_CheckExact(buffer)) {
            if (PyErr_Occurred()) {
                longest = -2;
            }
            goto out;
        }
        Py_INCREF(buffer);
        buffers[found++] = buffer;
    }
    if (found != n || PyDict_GET_SIZE(metrics) != n) { /* the dict changed while its keys were looked up */
        goto out;
    }
    longest = 0;
    pos = 0;
    for (Py_ssize_t i = 0; i < n && PyDict_Next(metrics, &pos, &key, &value); i++) {
        if (PyList_Append(buffers[i], value) < 0) { /* (only under MemoryError: the values before it stay) */
            longest = -2;
            goto out;
        }
        if (PyList_GET_SIZE(buffers[i]) > longest) {
            longest = PyList_GET_SIZE(buffers[i]);
        }
    }
out:
    for (Py_ssize_t i = 0; i < found; i++) {
        Py_DECREF(buffers[i]);
    }
    if (buffers != held) {
        PyMem_Free(buffers);
    }
    return longest == -2 ? NULL : PyLong_FromSsize_t(longest);
}

/* take_plain: every record of every buffer (lists of floats), one after another as native doubles, and each
 * buffer's count; the buffers give up those records. None, touching nothing, where an item is not a float (exactly).
 * Each buffer's length is read once, and exactly that many records are copied and deleted: records appended after
 * it (by another thread's log(), if any Python code ran meanwhile) stay for the next take, as in the Python code.
 * Until the deletions are done nothing here allocates a tracked object (no garbage collection, so no finalizer or
 * other thread can run in between); the counts list is built last. */
static PyObject *take_plain(PyObject *self, PyObject *buffers) {
    (void)self;
    if (!PyList_Check(buffers)) {
        PyErr_SetString(PyExc_TypeError, "take_plain: buffers must be a list of lists");
        return NULL;
    }
    Py_ssize_t k = PyList_GET_SIZE(buffers), total = 0;
    Py_ssize_t *lengths = (Py_ssize_t *)PyMem_Malloc((size_t)(k ? k : 1) * sizeof(Py_ssize_t));
    if (lengths == NULL) {
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < k; i++) {
        PyObject *buffer = PyList_GET_ITEM(buffers, i);
        if (!PyList_Check(buffer)) {
            PyMem_Free(lengths);
            PyErr_SetString(PyExc_TypeError, "take_plain: buffers must be a list of lists");
            return NULL;
        }
        Py_ssize_t n = lengths[i] = PyList_GET_SIZE(buffer);
        for (Py_ssize_t j = 0; j < n; j++) {
            if (!PyFloat_CheckExact(PyList_GET_ITEM(buffer, j))) {
                PyMem_Free(lengths);
                Py_RETURN_NONE;
            }
        }
        total += n;
    }
    PyObject *records = PyBytes_FromStringAndSize(NULL, total * (Py_ssize_t)sizeof(double)); /* (untracked) */
    if (records == NULL) {
        PyMem_Free(lengths);
        return NULL;
    }
    double *out = (double *)PyBytes_AS_STRING(records);
    for (Py_ssize_t i = 0; i < k; i++) {
        PyObject *buffer = PyList_GET_ITEM(buffers, i);
        for (Py_ssize_t j = 0; j < lengths[i]; j++) {
            *out++ = PyFloat_AS_DOUBLE(PyList_GET_ITEM(buffer, j));
        }
    }
    for (Py_ssize_t i = 0; i < k; i++) { /* freeing exact floats runs no Python code */
        if (lengths[i] && PyList_SetSlice(PyList_GET_ITEM(buffers, i), 0, lengths[i], NULL) < 0) {
            PyMem_Free(lengths);
            Py_DECREF(records);
            return NULL;
        }
    }
    PyObject *counts = PyList_New(k);
    for (Py_ssize_t i = 0; counts != NULL && i < k; i++) {
        PyObject *count = PyLong_FromSsize_t(lengths[i]);
        if (count == NULL) {
            Py_CLEAR(counts);
            break;
        }
        PyList_SET_ITEM(counts, i, count);
    }
    PyMem_Free(lengths);
    if (counts == NULL) {
        Py_DECREF(records); /* (the records are gone from the buffers: only under MemoryError) */
        return NULL;
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

static int bit_length(unsigned long long v) { /* Python's int.bit_length() */
    int bits = 0;
    while (v) {
        bits++;
        v >>= 1;
    }
    return bits;
}

static int shift_of(Py_ssize_t longest) { /* M of _exact_sums: (2 * longest - 1).bit_length() */
    return bit_length((unsigned long long)(2 * longest - 1));
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

#define ARRAY_LIMIT 0x1p960  /* exact._ARRAY_LIMIT */
#define SIGMA_FLOOR 0x1p-1022 /* exact._SIGMA_FLOOR */
#define MAX_ROUNDS 64         /* exact._MAX_ROUNDS */

/* The loops below over a long array run in SSE2 lanes where the compiler targets them (minpd/maxpd are the
 * scalar loops' ``v < m ? v : m``, lane by lane), several vectors at once, so that the array is not one chain of
 * dependent comparisons or additions (the compiler may not reorder floating-point ones itself); elsewhere, and for
 * the last few records, the plain loops. extract_round's sums keep CHAINS chains there too. */
#define CHAINS 8

/* min and max of x[0..n) (n > 0) into *lowest, *highest (a zero's sign is settled by the caller); 0 where a
 * record is a NaN, an infinity or +-DBL_MAX (the list path's), else 1. */
static int extrema(const double *x, Py_ssize_t n, double *lowest, double *highest) {
    Py_ssize_t i = 0;
    double lo = x[0], hi = x[0];
    int bad = 0;
#ifdef __SSE2__
    /* minpd(v, m) is (v < m ? v : m) lane by lane, as the scalar loop below; four vectors, eight chains */
    const __m128d absmask = _mm_castsi128_pd(_mm_set1_epi64x(0x7fffffffffffffffLL)), top = _mm_set1_pd(DBL_MAX);
    __m128d l0 = _mm_set1_pd(lo), l1 = l0, l2 = l0, l3 = l0, h0 = l0, h1 = l0, h2 = l0, h3 = l0;
    __m128d ok = _mm_castsi128_pd(_mm_set1_epi64x(-1));
    for (; i + 8 <= n; i += 8) {
        __m128d a = _mm_loadu_pd(x + i), b = _mm_loadu_pd(x + i + 2), c = _mm_loadu_pd(x + i + 4),
                d = _mm_loadu_pd(x + i + 6);
        ok = _mm_and_pd(ok, _mm_and_pd(_mm_and_pd(_mm_cmplt_pd(_mm_and_pd(a, absmask), top),
                                                  _mm_cmplt_pd(_mm_and_pd(b, absmask), top)),
                                       _mm_and_pd(_mm_cmplt_pd(_mm_and_pd(c, absmask), top),
                                                  _mm_cmplt_pd(_mm_and_pd(d, absmask), top))));
        l0 = _mm_min_pd(a, l0), l1 = _mm_min_pd(b, l1), l2 = _mm_min_pd(c, l2), l3 = _mm_min_pd(d, l3);
        h0 = _mm_max_pd(a, h0), h1 = _mm_max_pd(b, h1), h2 = _mm_max_pd(c, h2), h3 = _mm_max_pd(d, h3);
    }
    bad = _mm_movemask_pd(ok) != 3;
    double lanes[16];
    _mm_storeu_pd(lanes, l0), _mm_storeu_pd(lanes + 2, l1), _mm_storeu_pd(lanes + 4, l2), _mm_storeu_pd(lanes + 6, l3);
    _mm_storeu_pd(lanes + 8, h0), _mm_storeu_pd(lanes + 10, h1), _mm_storeu_pd(lanes + 12, h2);
    _mm_storeu_pd(lanes + 14, h3);
    for (int j = 0; j < 8; j++) {
        lo = lanes[j] < lo ? lanes[j] : lo;
        hi = lanes[8 + j] > hi ? lanes[8 + j] : hi;
    }
#endif
    for (; i < n; i++) {
        double v = x[i];
        bad |= !(fabs(v) < DBL_MAX); /* a NaN fails it */
        lo = v < lo ? v : lo;
        hi = v > hi ? v : hi;
    }
    *lowest = lo;
    *highest = hi;
    return !bad;
}

/* The least nonzero |x| of x[0..n) (HUGE_VAL where all are zeros). */
static double least_magnitude(const double *x, Py_ssize_t n) {
    Py_ssize_t i = 0;
    double least = HUGE_VAL;
#ifdef __SSE2__
    const __m128d absmask = _mm_castsi128_pd(_mm_set1_epi64x(0x7fffffffffffffffLL)), zero = _mm_setzero_pd();
    const __m128d inf = _mm_set1_pd(HUGE_VAL);
    __m128d m0 = inf, m1 = inf;
    for (; i + 4 <= n; i += 4) { /* a zero becomes +inf, then the least */
        __m128d a = _mm_and_pd(_mm_loadu_pd(x + i), absmask), b = _mm_and_pd(_mm_loadu_pd(x + i + 2), absmask);
        a = _mm_or_pd(_mm_andnot_pd(_mm_cmpeq_pd(a, zero), a), _mm_and_pd(_mm_cmpeq_pd(a, zero), inf));
        b = _mm_or_pd(_mm_andnot_pd(_mm_cmpeq_pd(b, zero), b), _mm_and_pd(_mm_cmpeq_pd(b, zero), inf));
        m0 = _mm_min_pd(a, m0), m1 = _mm_min_pd(b, m1);
    }
    double lanes[4];
    _mm_storeu_pd(lanes, m0), _mm_storeu_pd(lanes + 2, m1);
    for (int j = 0; j < 4; j++) {
        least = lanes[j] < least ? lanes[j] : least;
    }
#endif
    for (; i < n; i++) {
        double a = fabs(x[i]);
        least = a != 0.0 && a < least ? a : least;
    }
    return least;
}

/* Whether x[0..n) holds a -0.0, and whether it holds a +0.0. */
static void zero_signs(const double *x, Py_ssize_t n, int *negative, int *positive) {
    Py_ssize_t i = 0;
    int neg = 0, pos = 0;
#ifdef __SSE2__
    const __m128d zero = _mm_setzero_pd();
    __m128d seen_neg = zero, seen_pos = zero; /* sign bits: where a lane held -0.0, where it held +0.0 */
    for (; i + 2 <= n; i += 2) {
        __m128d a = _mm_loadu_pd(x + i), eq = _mm_cmpeq_pd(a, zero); /* eq: all ones where a is a zero */
        seen_neg = _mm_or_pd(seen_neg, _mm_and_pd(eq, a));            /* its sign bit: a's */
        seen_pos = _mm_or_pd(seen_pos, _mm_andnot_pd(a, eq));         /* its sign bit: not a's */
    }
    neg = _mm_movemask_pd(seen_neg) != 0;
    pos = _mm_movemask_pd(seen_pos) != 0;
#endif
    for (; i < n; i++) {
        neg |= x[i] == 0.0 && signbit(x[i]);
        pos |= x[i] == 0.0 && !signbit(x[i]);
    }
    *negative = neg;
    *positive = pos;
}

/* One round of exact.array_components: each record's part at ``sigma`` (``(x + sigma) - sigma``, exact) summed,
 * which is exact in any order; what is left of each record goes into ``residual`` (which may be ``rest``), or,
 * where ``residual`` is NULL (the last round), is summed into *left (exact too). */
static double extract_round(const double *rest, double *residual, Py_ssize_t n, double sigma, double *left) {
    double s[CHAINS] = {0.0}, l[CHAINS] = {0.0};
    Py_ssize_t i = 0;
#ifdef __SSE2__
    const __m128d sig = _mm_set1_pd(sigma);
    __m128d s0 = _mm_setzero_pd(), s1 = s0, l0 = s0, l1 = s0;
    for (; i + 4 <= n; i += 4) {
        __m128d a = _mm_loadu_pd(rest + i), b = _mm_loadu_pd(rest + i + 2);
        __m128d ta = _mm_sub_pd(_mm_add_pd(a, sig), sig), tb = _mm_sub_pd(_mm_add_pd(b, sig), sig);
        s0 = _mm_add_pd(s0, ta), s1 = _mm_add_pd(s1, tb);
        if (residual == NULL) {
            l0 = _mm_add_pd(l0, _mm_sub_pd(a, ta)), l1 = _mm_add_pd(l1, _mm_sub_pd(b, tb));
        } else {
            _mm_storeu_pd(residual + i, _mm_sub_pd(a, ta)), _mm_storeu_pd(residual + i + 2, _mm_sub_pd(b, tb));
        }
    }
    _mm_storeu_pd(s, s0), _mm_storeu_pd(s + 2, s1), _mm_storeu_pd(l, l0), _mm_storeu_pd(l + 2, l1);
#endif
    for (; i < n; i++) {
        double v = rest[i], taken = (v + sigma) - sigma;
        s[i % CHAINS] += taken;
        if (residual == NULL) {
            l[i % CHAINS] += v - taken;
        } else {
            residual[i] = v - taken;
        }
    }
    for (int j = 1; j < CHAINS; j++) {
        s[0] += s[j];
        l[0] += l[j];
    }
    *left = l[0];
    return s[0];
}

/* array_parts(values): for a 1-D float64 array of n > 0 records, its min and max (a zero min is -0.0 where any
 * zero record is, a zero max -0.0 where every one is: signed_zero.of_array) and the exact partial sums of
 * exact.array_components' rounds (each sum exact, so the same value in any order), whose greedy components are the
 * exact sum; None where the Python code takes the list path (a NaN, an infinity or +-MAX, all zeros, a magnitude
 * from 2**960, or too many records). Two passes over the records and one per round, no temporaries but one. */
static PyObject *array_parts(PyObject *self, PyObject *arg) {
    (void)self;
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_C_CONTIGUOUS) < 0) {
        return NULL;
    }
    const double *x = (const double *)view.buf;
    Py_ssize_t n = view.len / (Py_ssize_t)sizeof(double);
    PyObject *out = NULL;
    double *residual = NULL;
    if (n < 1) {
        goto none;
    }
    double lowest, highest;
    if (!extrema(x, n, &lowest, &highest)) {
        goto none;
    }
    if (lowest == 0.0 || highest == 0.0) { /* which zero: a zero min is -0.0 where any zero record is, a zero max
                                            * -0.0 where every one is */
        int negative, positive;
        zero_signs(x, n, &negative, &positive);
        if (lowest == 0.0) {
            lowest = negative ? -0.0 : 0.0;
        }
        if (highest == 0.0) {
            highest = positive ? 0.0 : -0.0;
        }
    }
    double least; /* the least nonzero magnitude: free for one-signed data */
    if (lowest > 0.0) {
        least = lowest;
    } else if (highest < 0.0) {
        least = -highest;
    } else {
        least = least_magnitude(x, n);
    }
    double largest = highest >= -lowest ? highest : -lowest;
    int m = bit_length((unsigned long long)(2 * n)); /* 2**m > 2n */
    if (m >= 50 || !(0.0 < largest && largest < ARRAY_LIMIT)) {
        goto none;
    }
    double limit = ldexp(nextafter(least, HUGE_VAL) - least, 106); /* n * sigma up to this: the residuals' sum is exact */
    int e;
    (void)frexp(largest, &e);
    double sigma = ldexp(1.0, e + m), scale = ldexp(1.0, m - 53);
    if (sigma < SIGMA_FLOOR) {
        sigma = SIGMA_FLOOR;
    }
    out = PyList_New(0);
    if (out == NULL) {
        goto done;
    }
    const double *rest = x;
    for (int round = 0; round < MAX_ROUNDS; round++) {
        int last = (double)n * sigma <= limit; /* then one plain sum of the residuals is exact: the rounds stop */
        if (!last && residual == NULL) {
            residual = (double *)PyMem_Malloc((size_t)n * sizeof(double));
            if (residual == NULL) {
                PyErr_NoMemory();
                Py_CLEAR(out);
                goto done;
            }
        }
        double left = 0.0;
        PyObject *sum = PyFloat_FromDouble(extract_round(rest, last ? NULL : residual, n, sigma, &left));
        if (sum == NULL || PyList_Append(out, sum) < 0) {
            Py_XDECREF(sum);
            Py_CLEAR(out);
            goto done;
        }
        Py_DECREF(sum);
        if (last) {
            sum = PyFloat_FromDouble(left);
            if (sum == NULL || PyList_Append(out, sum) < 0) {
                Py_XDECREF(sum);
                Py_CLEAR(out);
                goto done;
            }
            Py_DECREF(sum);
            PyObject *found = Py_BuildValue("(ddN)", lowest, highest, out);
            out = found;
            goto done;
        }
        rest = residual; /* (updated in place from here: each element is read before it is written) */
        sigma *= scale;
        if (sigma < SIGMA_FLOOR) {
            sigma = SIGMA_FLOOR;
        }
    }
    Py_CLEAR(out); /* not expected: each round takes 53 - m bits and the floor ends the rounds */
none:
    PyMem_Free(residual);
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
done:
    PyMem_Free(residual);
    PyBuffer_Release(&view);
    return out;
}

/* True if the ``n`` bytes at ``p`` are all zero. */
static int all_zero(const char *p, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        if (p[i]) {
            return 0;
        }
    }
    return 1;
}

/* Little-endian bytes of ``value`` at ``out`` (``n`` of them). */
static void put_le(unsigned char *out, unsigned long long value, int n) {
    for (int i = 0; i < n; i++) {
        out[i] = (unsigned char)(value >> (8 * i));
    }
}

/* compact_into(target, where, fields, count, step, crc): CompactFrame.frame(step, fields) built straight into the
 * writable buffer ``target`` at offset ``where`` (the journal's stage: metricbus/journal/stage.py), the same bytes,
 * its 8-byte frame head (length, then ``crc`` of the payload: the journal's CRC-32 function, called on a read-only
 * view of it) written last. ``count`` is the CompactFrame's _count: (the first three columns of a steady commit,
 * the count column, (heads with wsum_lo stored, heads with it zero), the one-record scheme's heads or None).
 * Returns the frame's size; 0 where ``fields`` is not a C-contiguous buffer of 12 equal columns whose first three
 * are ``count[0]`` and whose total and total_lo are wsum and wsum_lo (the scheme does not hold, or the count
 * column changed: the Python code says which, and recounts), or where the frame does not fit before the end of
 * ``target``; then nothing was written. Where ``crc`` raises (or gives no 32-bit value), the exception is raised and
 * the frame's bytes are left zeros (as the stage's bytes past those staged are); a view ``crc`` kept is released. */
static PyObject *compact_into(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 6) {
        PyErr_Format(PyExc_TypeError, "compact_into takes 6 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *count = args[3], *crc = args[5];
    Py_ssize_t where = PyLong_AsSsize_t(args[1]);
    if (where == -1 && PyErr_Occurred()) {
        return NULL;
    }
    long long step = PyLong_AsLongLong(args[4]);
    if (step == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (!PyTuple_Check(count) || PyTuple_GET_SIZE(count) != 4 || !PyBytes_Check(PyTuple_GET_ITEM(count, 0)) ||
        !PyTuple_Check(PyTuple_GET_ITEM(count, 2)) || PyTuple_GET_SIZE(PyTuple_GET_ITEM(count, 2)) != 2) {
        PyErr_SetString(PyExc_TypeError, "compact_into: count must be a CompactFrame's _count tuple");
        return NULL;
    }
    PyObject *steady = PyTuple_GET_ITEM(count, 0), *heads = PyTuple_GET_ITEM(count, 2);
    PyObject *single = PyTuple_GET_ITEM(count, 3);
    if (single != Py_None && (!PyTuple_Check(single) || PyTuple_GET_SIZE(single) != 2)) {
        PyErr_SetString(PyExc_TypeError, "compact_into: count[3] must be a pair of heads or None");
        return NULL;
    }
    for (int i = 0; i < 2; i++) {
        if (!PyBytes_Check(PyTuple_GET_ITEM(heads, i)) ||
            (single != Py_None && !PyBytes_Check(PyTuple_GET_ITEM(single, i)))) {
            PyErr_SetString(PyExc_TypeError, "compact_into: the heads must be bytes");
            return NULL;
        }
    }
    Py_buffer raw;
    if (PyObject_GetBuffer(args[2], &raw, PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear(); /* (not contiguous: the Python code copies it) */
        return PyLong_FromLong(0);
    }
    const char *r = (const char *)raw.buf;
    Py_ssize_t w = raw.len / 12;
    if (w == 0 || raw.len != 12 * w || PyBytes_GET_SIZE(steady) != 3 * w ||
        memcmp(r, PyBytes_AS_STRING(steady), (size_t)(3 * w)) || memcmp(r + 5 * w, r + 3 * w, (size_t)(2 * w))) {
        PyBuffer_Release(&raw);
        return PyLong_FromLong(0);
    }
    const char *sums = r + 3 * w, *stored = r + 7 * w;
    Py_ssize_t n_stored = 5 * w;
    PyObject *pair = heads;
    if (single != Py_None && all_zero(r + 7 * w, w) && !memcmp(r + 8 * w, sums, (size_t)w) &&
        !memcmp(r + 9 * w, sums, (size_t)w) && !memcmp(r + 10 * w, sums, (size_t)w) &&
        !memcmp(r + 11 * w, sums, (size_t)w)) {
        pair = single; /* one record each: only wsum is stored */
        n_stored = 0;
    }
    int zero_lo = all_zero(r + 4 * w, w);
    PyObject *head = PyTuple_GET_ITEM(pair, zero_lo ? 1 : 0);
    Py_ssize_t n_head = PyBytes_GET_SIZE(head), n_sums = zero_lo ? w : 2 * w;
    Py_ssize_t payload = 9 + n_head + n_sums + n_stored;
    Py_buffer out;
    if (PyObject_GetBuffer(args[0], &out, PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&raw);
        return NULL;
    }
    if (where < 0 || where > out.len || payload > 0xFFFFFFFFLL || payload + 8 > out.len - where) {
        PyBuffer_Release(&out);
        PyBuffer_Release(&raw);
        return PyLong_FromLong(0);
    }
    unsigned char *p = (unsigned char *)out.buf + where + 8;
    p[0] = 'P';
    put_le(p + 1, (unsigned long long)step, 8);
    memcpy(p + 9, PyBytes_AS_STRING(head), (size_t)n_head);
    memcpy(p + 9 + n_head, sums, (size_t)n_sums);
    memcpy(p + 9 + n_head + n_sums, stored, (size_t)n_stored);
    PyBuffer_Release(&raw);
    PyObject *view = PyMemoryView_FromMemory((char *)p, payload, PyBUF_READ);
    PyObject *sum = view == NULL ? NULL : PyObject_CallOneArg(crc, view);
    if (view != NULL && Py_REFCNT(view) > 1) { /* kept by ``crc``: released, so it never reads the target later */
        PyObject *error, *value, *trace;
        PyErr_Fetch(&error, &value, &trace);
        PyObject *released = PyObject_CallMethod(view, "release", NULL);
        Py_XDECREF(released);
        if (released == NULL) {
            PyErr_Clear();
        }
        PyErr_Restore(error, value, trace);
    }
    Py_XDECREF(view);
    unsigned long checksum = sum == NULL ? 0 : PyLong_AsUnsignedLong(sum);
    Py_XDECREF(sum);
    if (sum == NULL || (checksum == (unsigned long)-1 && PyErr_Occurred()) || checksum > 0xFFFFFFFFUL) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_ValueError, "compact_into: crc gave no 32-bit checksum");
        }
        memset(p, 0, (size_t)payload); /* the stage's bytes past those staged stay zeros */
        PyBuffer_Release(&out);
        return NULL;
    }
    unsigned char frame_head[8];
    put_le(frame_head, (unsigned long long)payload, 4);
    put_le(frame_head + 4, checksum, 4);
    memcpy(p - 8, frame_head, 8); /* last: a reader sees a frame only once its payload is there */
    PyBuffer_Release(&out);
    return PyLong_FromSsize_t(8 + payload);
}

static PyMethodDef methods[] = {
    {"array_parts", array_parts, METH_O, "An array's min, max and exact partial sums; None: the list path."},
    {"finite_nonzero", finite_nonzero, METH_VARARGS, "Every double of the rows finite and nonzero."},
    {"append_dict", append_dict, METH_VARARGS, "log(dict)'s fast path: the longest buffer appended to, or -1."},
    {"take_plain", take_plain, METH_O, "Every record of the buffers as native doubles, and their counts."},
    {"columns", columns, METH_VARARGS, "An update's micro fields in columns; 0, or why the numpy code must."},
    {"compact_into", (PyCFunction)(void (*)(void))compact_into, METH_FASTCALL,
     "A steady commit's \"P\" frame built into a buffer: its size, or 0 where the Python code must."},
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
