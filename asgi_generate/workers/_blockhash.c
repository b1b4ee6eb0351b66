/* The KV index's hot loops in C (asgi_generate.workers._blockhash).
 *
 * block_hashes() gives exactly what block_hash.py's reference chain gives,
 * hash((parent, *block_tokens)) per block, with CPython's own tuple and int
 * hashes (Objects/tupleobject.c tuplehash, the xxHash-based one of CPython
 * 3.8 and later; Objects/longobject.c long_hash, modulo 2**61 - 1) written
 * out for 64-bit ints, so keys stay the ones the simulator and every
 * replica compute: the interpreter spent ~110 ns a token building and
 * hashing a tuple per block (SGLang's page size 1: a block a token).
 * The mask_*() functions are the index all workers share (block key -> a
 * 64-bit mask of the workers holding it), one dict probe a key without the
 * interpreter's loop: one walk narrows the mask and gives every worker's
 * overlap, probing a worker's own predictions only where it still walks and
 * lacks the key; expire() is a worker's prediction expiry.
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

/* The shared index: a dict of block key -> a mask of workers (a Python int
 * below 2**64, bit i for the index's worker i). */

static inline int
mask_of(PyObject *dict, PyObject *key, uint64_t *out)
{
    PyObject *value = PyDict_GetItemWithError(dict, key); /* borrowed */
    if (value == NULL) {
        *out = 0;
        return PyErr_Occurred() ? -1 : 0;
    }
    *out = PyLong_AsUnsignedLongLong(value);
    return *out == (uint64_t)-1 && PyErr_Occurred() ? -1 : 0;
}

static inline int
mask_put(PyObject *dict, PyObject *key, uint64_t mask)
{
    if (mask == 0)
        return PyDict_DelItem(dict, key);
    PyObject *value = PyLong_FromUnsignedLongLong(mask);
    if (value == NULL)
        return -1;
    int rc = PyDict_SetItem(dict, key, value);
    Py_DECREF(value);
    return rc;
}

static int
bit_arg(PyObject *arg, uint64_t *out)
{
    *out = PyLong_AsUnsignedLongLong(arg);
    if (*out == (uint64_t)-1 && PyErr_Occurred())
        return -1;
    return 0;
}

#define MASK_BITS 64

PyDoc_STRVAR(mask_walk_doc,
"mask_walk(keys, held, active, predicted) -> (overlaps, guessed)\n\n"
"One walk down keys (a list) for every worker of the mask active at once:\n"
"held is a dict of key -> worker mask, predicted a list of (slot, dict)\n"
"pairs, worker slot's predicted keys (bit 1 << slot; workers predicting\n"
"nothing left out). Worker i's overlap (overlaps[i], lists of 64) is its\n"
"count of leading keys whose held mask has bit i or that are in its\n"
"predicted dict, and guessed[i] how many of those are predicted only.\n"
"A predicted dict is probed only\n"
"where its worker is still in the walk and does not hold the key; the walk\n"
"stops once no active worker is left. Bits outside active are 0.");

static PyObject *
mask_walk_py(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 || !PyList_Check(args[0]) || !PyDict_Check(args[1]) || !PyList_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "mask_walk(keys: list, held: dict, active: int, predicted: list)");
        return NULL;
    }
    PyObject *keys = args[0], *held = args[1], *pairs = args[3];
    uint64_t alive, guessing = 0;
    if (bit_arg(args[2], &alive) < 0)
        return NULL;
    PyObject *dicts[MASK_BITS] = {NULL}; /* borrowed from pairs */
    for (Py_ssize_t p = 0; p < PyList_GET_SIZE(pairs); p++) {
        PyObject *pair = PyList_GET_ITEM(pairs, p);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2 || !PyDict_Check(PyTuple_GET_ITEM(pair, 1))) {
            PyErr_SetString(PyExc_TypeError, "predicted: a list of (slot, dict)");
            return NULL;
        }
        Py_ssize_t slot = PyLong_AsSsize_t(PyTuple_GET_ITEM(pair, 0));
        if (slot == -1 && PyErr_Occurred())
            return NULL;
        if (slot < 0 || slot >= MASK_BITS) {
            PyErr_SetString(PyExc_ValueError, "slot out of 0..63");
            return NULL;
        }
        if (PyDict_GET_SIZE(PyTuple_GET_ITEM(pair, 1)) > 0) {
            dicts[slot] = PyTuple_GET_ITEM(pair, 1);
            guessing |= 1ULL << slot;
        }
    }
    Py_ssize_t overlap[MASK_BITS] = {0}, guessed[MASK_BITS] = {0};
    Py_ssize_t i = 0, size = PyList_GET_SIZE(keys);
    for (; i < size && alive; i++) {
        PyObject *key = PyList_GET_ITEM(keys, i);
        uint64_t h;
        if (mask_of(held, key, &h) < 0)
            return NULL;
        uint64_t lack = alive & ~h;
        for (uint64_t probe = lack & guessing; probe; probe &= probe - 1) {
            int slot = __builtin_ctzll(probe);
            int in = PyDict_Contains(dicts[slot], key);
            if (in < 0)
                return NULL;
            if (in) {
                lack &= ~(1ULL << slot);
                guessed[slot]++;
            }
        }
        for (uint64_t gone = lack; gone; gone &= gone - 1)
            overlap[__builtin_ctzll(gone)] = i;
        alive &= ~lack;
    }
    for (; alive; alive &= alive - 1)
        overlap[__builtin_ctzll(alive)] = i;
    PyObject *a = PyList_New(MASK_BITS), *b = PyList_New(MASK_BITS);
    if (a == NULL || b == NULL)
        goto fail;
    for (int bit = 0; bit < MASK_BITS; bit++) {
        PyObject *x = PyLong_FromSsize_t(overlap[bit]), *y = PyLong_FromSsize_t(guessed[bit]);
        if (x == NULL || y == NULL) {
            Py_XDECREF(x);
            Py_XDECREF(y);
            goto fail;
        }
        PyList_SET_ITEM(a, bit, x);
        PyList_SET_ITEM(b, bit, y);
    }
    PyObject *out = PyTuple_Pack(2, a, b);
    Py_DECREF(a);
    Py_DECREF(b);
    return out;
fail:
    Py_XDECREF(a);
    Py_XDECREF(b);
    return NULL;
}

PyDoc_STRVAR(mask_set_doc,
"mask_set(keys, masks, bit) -> int\n\n"
"Set bit (an int, one bit) in the mask of each of keys (an iterable) in the\n"
"dict masks, adding absent keys; the count of masks that lacked it.");

static PyObject *
mask_set_py(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyDict_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "mask_set(keys, masks: dict, bit: int)");
        return NULL;
    }
    PyObject *masks = args[1];
    uint64_t bit;
    if (bit_arg(args[2], &bit) < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(args[0], "keys must be iterable");
    if (seq == NULL)
        return NULL;
    Py_ssize_t added = 0, size = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < size; i++) {
        /* One probe for a key not there yet, the common case (the dict
         * grew: an equal mask already there may be the same small int). */
        Py_ssize_t before = PyDict_GET_SIZE(masks);
        PyObject *value = PyDict_SetDefault(masks, items[i], args[2]); /* borrowed */
        if (value == NULL)
            goto fail;
        if (PyDict_GET_SIZE(masks) > before) {
            added++;
            continue;
        }
        uint64_t m = PyLong_AsUnsignedLongLong(value);
        if (m == (uint64_t)-1 && PyErr_Occurred())
            goto fail;
        if (m & bit)
            continue;
        if (mask_put(masks, items[i], m | bit) < 0)
            goto fail;
        added++;
    }
    Py_DECREF(seq);
    return PyLong_FromSsize_t(added);
fail:
    Py_DECREF(seq);
    return NULL;
}

PyDoc_STRVAR(mask_drop_doc,
"mask_drop(masks, bit) -> int\n\n"
"Clear bit in every mask of the dict masks, deleting the keys whose mask\n"
"falls to 0 (a worker's index reset); the count of masks that had it.");

static PyObject *
mask_drop_py(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyDict_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "mask_drop(masks: dict, bit: int)");
        return NULL;
    }
    PyObject *masks = args[0];
    uint64_t bit;
    if (bit_arg(args[1], &bit) < 0)
        return NULL;
    PyObject *gone = PyList_New(0);
    if (gone == NULL)
        return NULL;
    Py_ssize_t pos = 0, cleared = 0;
    PyObject *key, *value;
    while (PyDict_Next(masks, &pos, &key, &value)) {
        uint64_t m = PyLong_AsUnsignedLongLong(value);
        if (m == (uint64_t)-1 && PyErr_Occurred())
            goto fail;
        if (!(m & bit))
            continue;
        cleared++;
        if (m == bit) { /* deleted after the loop: the dict may not change size while iterated */
            if (PyList_Append(gone, key) < 0)
                goto fail;
            continue;
        }
        PyObject *rest = PyLong_FromUnsignedLongLong(m & ~bit);
        if (rest == NULL)
            goto fail;
        int rc = PyDict_SetItem(masks, key, rest); /* an existing key: no resize */
        Py_DECREF(rest);
        if (rc < 0)
            goto fail;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(gone); i++)
        if (PyDict_DelItem(masks, PyList_GET_ITEM(gone, i)) < 0)
            goto fail;
    Py_DECREF(gone);
    return PyLong_FromSsize_t(cleared);
fail:
    Py_DECREF(gone);
    return NULL;
}

PyDoc_STRVAR(mask_remove_doc,
"mask_remove(hashes, keys, masks, bit) -> int\n\n"
"For each of hashes (a sequence: engine block hashes), pop it from the dict\n"
"keys (engine hash -> block key) and clear bit in that block key's mask in\n"
"the dict masks, deleting a key whose mask falls to 0; hashes keys does\n"
"not hold are skipped. The\n"
"count of masks that had bit.");

static PyObject *
mask_remove_py(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 || !PyDict_Check(args[1]) || !PyDict_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "mask_remove(hashes, keys: dict, masks: dict, bit: int)");
        return NULL;
    }
    PyObject *keys = args[1], *masks = args[2];
    uint64_t bit;
    if (bit_arg(args[3], &bit) < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(args[0], "hashes must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t cleared = 0, size = PySequence_Fast_GET_SIZE(seq);
    PyObject **hashes = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < size && PyDict_GET_SIZE(keys) > 0; i++) {
        PyObject *key = PyDict_GetItemWithError(keys, hashes[i]); /* borrowed */
        if (key == NULL) {
            if (PyErr_Occurred())
                goto fail;
            continue;
        }
        Py_INCREF(key);
        uint64_t m;
        if (PyDict_DelItem(keys, hashes[i]) < 0 || mask_of(masks, key, &m) < 0 ||
            ((m & bit) && mask_put(masks, key, m & ~bit) < 0)) {
            Py_DECREF(key);
            goto fail;
        }
        Py_DECREF(key);
        cleared += (m & bit) != 0;
    }
    Py_DECREF(seq);
    return PyLong_FromSsize_t(cleared);
fail:
    Py_DECREF(seq);
    return NULL;
}

PyDoc_STRVAR(mask_missing_doc,
"mask_missing(keys, masks, bit, start=0) -> list\n\n"
"The keys (a list) from index start on whose mask in the dict masks lacks\n"
"bit, in order: one worker's keys not in its share of the index (a caller\n"
"that knows the first start keys have bit skips them).");

static PyObject *
mask_missing_py(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if ((nargs != 3 && nargs != 4) || !PyList_Check(args[0]) || !PyDict_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "mask_missing(keys: list, masks: dict, bit: int, start: int = 0)");
        return NULL;
    }
    PyObject *keys = args[0], *masks = args[1];
    uint64_t bit;
    if (bit_arg(args[2], &bit) < 0)
        return NULL;
    Py_ssize_t start = 0;
    if (nargs == 4) {
        start = PyLong_AsSsize_t(args[3]);
        if (start == -1 && PyErr_Occurred())
            return NULL;
        if (start < 0) {
            PyErr_SetString(PyExc_ValueError, "start must be at least 0");
            return NULL;
        }
    }
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    Py_ssize_t size = PyList_GET_SIZE(keys);
    for (Py_ssize_t i = start; i < size; i++) {
        PyObject *key = PyList_GET_ITEM(keys, i);
        uint64_t m;
        if (mask_of(masks, key, &m) < 0 || (!(m & bit) && PyList_Append(out, key) < 0)) {
            Py_DECREF(out);
            return NULL;
        }
    }
    return out;
}

static PyMethodDef methods[] = {
    {"block_hashes", (PyCFunction)(void (*)(void))block_hashes_py, METH_FASTCALL, block_hashes_doc},
    {"expire", (PyCFunction)(void (*)(void))expire_py, METH_FASTCALL, expire_doc},
    {"mask_walk", (PyCFunction)(void (*)(void))mask_walk_py, METH_FASTCALL, mask_walk_doc},
    {"mask_set", (PyCFunction)(void (*)(void))mask_set_py, METH_FASTCALL, mask_set_doc},
    {"mask_drop", (PyCFunction)(void (*)(void))mask_drop_py, METH_FASTCALL, mask_drop_doc},
    {"mask_remove", (PyCFunction)(void (*)(void))mask_remove_py, METH_FASTCALL, mask_remove_doc},
    {"mask_missing", (PyCFunction)(void (*)(void))mask_missing_py, METH_FASTCALL, mask_missing_doc},
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
