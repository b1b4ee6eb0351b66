/* The KV index's hot loops in C (asgi_generate.workers._blockhash).
 *
 * block_hashes() gives exactly what block_hash.py's reference chain gives,
 * hash((parent, *block_tokens)) per block, with CPython's own tuple and int
 * hashes (Objects/tupleobject.c tuplehash, the xxHash-based one of CPython
 * 3.8 and later; Objects/longobject.c long_hash, modulo 2**61 - 1) written
 * out for 64-bit ints, so keys stay the ones the simulator and every
 * replica compute: the interpreter spent ~110 ns a token building and
 * hashing a tuple per block (SGLang's page size 1: a block a token).
 * walk(), missing() and expire() are the index's prefix walk, prediction
 * filter and prediction expiry, one set or dict probe a key without the
 * interpreter's loop.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>

#if SIZEOF_VOID_P != 8 || SIZEOF_LONG_LONG != 8
#error "64-bit builds only: the hashes are CPython's 64-bit ones"
#endif

#define PRIME_1 11400714785074694791ULL
#define PRIME_2 14029467366897019727ULL
#define PRIME_5 2870177450012600261ULL
#define MODULUS ((1ULL << 61) - 1) /* _PyHASH_MODULUS on 64-bit builds */

/* hash(v) of a Python int v that fits 64 bits (long_hash). */
static inline uint64_t
int_hash(int64_t v)
{
    uint64_t magnitude = v < 0 ? (uint64_t)0 - (uint64_t)v : (uint64_t)v;
    int64_t h = (int64_t)(magnitude % MODULUS);
    if (v < 0)
        h = -h;
    return (uint64_t)(h == -1 ? -2 : h);
}

/* tuplehash's accumulator. */
static inline uint64_t
lane(uint64_t acc, uint64_t h)
{
    acc += h * PRIME_2;
    acc = (acc << 31) | (acc >> 33);
    return acc * PRIME_1;
}

static inline int64_t
finish(uint64_t acc, uint64_t len)
{
    acc += len ^ (PRIME_5 ^ 3527539ULL);
    return acc == (uint64_t)-1 ? 1546275796 : (int64_t)acc;
}

PyDoc_STRVAR(block_hashes_doc,
"block_hashes(start, ids, block) -> list[int]\n\n"
"The chained hashes of the full block-token blocks of ids (a sequence of\n"
"ints, or a buffer of unsigned 32-bit ints such as array('I')): each is\n"
"hash((parent, *tokens)), the first block's parent start. Equal to\n"
"block_hash.py's reference loop. Raises TypeError for ids of another\n"
"kind or a start that is not a 64-bit int, ValueError for block < 1.");

static PyObject *
block_hashes_py(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "block_hashes(start, ids, block) takes 3 arguments");
        return NULL;
    }
    long long start = PyLong_AsLongLong(args[0]);
    if (start == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t block = PyLong_AsSsize_t(args[2]);
    if (block == -1 && PyErr_Occurred())
        return NULL;
    if (block < 1) {
        PyErr_SetString(PyExc_ValueError, "block must be at least 1");
        return NULL;
    }
    const uint32_t *u32 = NULL;
    PyObject *seq = NULL;
    Py_buffer view = {0};
    Py_ssize_t n;
    if (PyObject_CheckBuffer(args[1]) && !PyBytes_Check(args[1])) {
        if (PyObject_GetBuffer(args[1], &view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0)
            return NULL;
        if (view.itemsize != 4 || view.format == NULL || (strcmp(view.format, "I") && strcmp(view.format, "=I") &&
                                                          strcmp(view.format, "<I"))) {
            PyBuffer_Release(&view);
            PyErr_SetString(PyExc_TypeError, "ids buffer must be of unsigned 32-bit ints ('I')");
            return NULL;
        }
        u32 = (const uint32_t *)view.buf;
        n = view.len / 4;
    } else {
        seq = PySequence_Fast(args[1], "ids must be a sequence of ints or a buffer of 'I'");
        if (seq == NULL)
            return NULL;
        n = PySequence_Fast_GET_SIZE(seq);
    }
    Py_ssize_t blocks = n / block;
    PyObject *out = PyList_New(blocks);
    if (out == NULL)
        goto fail;
    PyObject **items = seq != NULL ? PySequence_Fast_ITEMS(seq) : NULL;
    int64_t parent = start;
    uint64_t len = (uint64_t)block + 1;
    for (Py_ssize_t b = 0; b < blocks; b++) {
        uint64_t acc = lane(PRIME_5, int_hash(parent));
        Py_ssize_t base = b * block;
        if (u32 != NULL) {
            for (Py_ssize_t i = 0; i < block; i++)
                acc = lane(acc, (uint64_t)u32[base + i]); /* < 2**32: its own hash */
        } else {
            for (Py_ssize_t i = 0; i < block; i++) {
                Py_hash_t h = PyObject_Hash(items[base + i]);
                if (h == -1)
                    goto fail;
                acc = lane(acc, (uint64_t)h);
            }
        }
        parent = finish(acc, len);
        PyObject *value = PyLong_FromLongLong(parent);
        if (value == NULL)
            goto fail;
        PyList_SET_ITEM(out, b, value);
    }
    if (u32 != NULL)
        PyBuffer_Release(&view);
    Py_XDECREF(seq);
    return out;
fail:
    Py_XDECREF(out);
    if (u32 != NULL)
        PyBuffer_Release(&view);
    Py_XDECREF(seq);
    return NULL;
}

PyDoc_STRVAR(walk_doc,
"walk(keys, held, predicted) -> (n, guessed)\n\n"
"How many leading keys (a list) are in the set held or the dict predicted,\n"
"and how many of those are in predicted only: the walk stops at the first\n"
"key in neither.");

static PyObject *
walk_py(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyList_Check(args[0]) || !PyAnySet_Check(args[1]) || !PyDict_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "walk(keys: list, held: set, predicted: dict)");
        return NULL;
    }
    PyObject *keys = args[0], *held = args[1], *predicted = args[2];
    int guess = PyDict_GET_SIZE(predicted) > 0;
    Py_ssize_t n = 0, guessed = 0, size = PyList_GET_SIZE(keys);
    for (; n < size; n++) {
        PyObject *key = PyList_GET_ITEM(keys, n);
        int in = PySet_Contains(held, key);
        if (in < 0)
            return NULL;
        if (in)
            continue;
        if (!guess)
            break;
        in = PyDict_Contains(predicted, key);
        if (in < 0)
            return NULL;
        if (!in)
            break;
        guessed++;
    }
    return Py_BuildValue("(nn)", n, guessed);
}

PyDoc_STRVAR(missing_doc,
"missing(keys, held) -> list\n\n"
"The keys (a list) not in the set held, in order.");

static PyObject *
missing_py(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyList_Check(args[0]) || !PyAnySet_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "missing(keys: list, held: set)");
        return NULL;
    }
    PyObject *keys = args[0], *held = args[1];
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    Py_ssize_t size = PyList_GET_SIZE(keys);
    for (Py_ssize_t i = 0; i < size; i++) {
        PyObject *key = PyList_GET_ITEM(keys, i);
        int in = PySet_Contains(held, key);
        if (in < 0 || (!in && PyList_Append(out, key) < 0)) {
            Py_DECREF(out);
            return NULL;
        }
    }
    return out;
}

PyDoc_STRVAR(expire_doc,
"expire(keys, predicted, until) -> None\n\n"
"Delete from the dict predicted each of keys (a list) whose value still\n"
"equals until: a key predicted again since expires with that later one.");

static PyObject *
expire_py(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyList_Check(args[0]) || !PyDict_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "expire(keys: list, predicted: dict, until: float)");
        return NULL;
    }
    PyObject *keys = args[0], *predicted = args[1], *until = args[2];
    Py_ssize_t size = PyList_GET_SIZE(keys);
    for (Py_ssize_t i = 0; i < size && PyDict_GET_SIZE(predicted) > 0; i++) {
        PyObject *key = PyList_GET_ITEM(keys, i);
        PyObject *value = PyDict_GetItemWithError(predicted, key); /* borrowed */
        if (value == NULL) {
            if (PyErr_Occurred())
                return NULL;
            continue;
        }
        int same = value == until ? 1 : PyObject_RichCompareBool(value, until, Py_EQ);
        if (same < 0 || (same && PyDict_DelItem(predicted, key) < 0))
            return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"block_hashes", (PyCFunction)(void (*)(void))block_hashes_py, METH_FASTCALL, block_hashes_doc},
    {"walk", (PyCFunction)(void (*)(void))walk_py, METH_FASTCALL, walk_doc},
    {"missing", (PyCFunction)(void (*)(void))missing_py, METH_FASTCALL, missing_doc},
    {"expire", (PyCFunction)(void (*)(void))expire_py, METH_FASTCALL, expire_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_blockhash",
    "The KV index's block hash chain, prefix walk and prediction filter in C.", 0, methods,
};

PyMODINIT_FUNC
PyInit__blockhash(void)
{
    return PyModule_Create(&module);
}
