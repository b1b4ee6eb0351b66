/* The replay block hash chain in one C loop (asgi_generate.tracing._hashchain).
 *
 * Hashing from Python cost two XXH3 calls per block through the interpreter
 * (~180 ns a block, 65 us for a 16K-token prompt); here the whole chain runs
 * over the packed prompt's bytes in place, with the GIL released for long
 * prompts, and chain_json() also writes the hashes as the record's JSON text
 * (orjson spent ~45 ns on each of these 64-bit ints). The scheme is
 * documented in hashing.py and docs/traces.md; XXH3 itself is xxHash's
 * (asgi_generate/_vendor/xxhash, v0.8.4, BSD-2).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#define XXH_INLINE_ALL
#include "xxhash.h"

#define SEED 1337
/* Bytes from which the GIL is released while hashing: 64 KiB (16K tokens)
 * take ~7-10 us, long enough for the event loop thread to use (a loop
 * thread next to a hashing thread did 7-9 M steps/s instead of 5-6 M). */
#define NOGIL_BYTES 65536

/* XXH3's secret for SEED, derived once: with it XXH3_64bits_withSecretandSeed
 * equals XXH3_64bits_withSeed(SEED) and skips re-deriving it for every block
 * over 240 bytes (blocks of more than 60 tokens). */
static unsigned char secret[XXH3_SECRET_DEFAULT_SIZE];

static void
put_le64(unsigned char *p, uint64_t v)
{
    for (int i = 0; i < 8; i++) {
        p[i] = (unsigned char)(v >> (8 * i));
    }
}

/* out[i] = the sequence hash of block i; n blocks of step bytes, the last
 * one possibly shorter (len bytes in all). */
static void
chain(const unsigned char *data, size_t len, size_t step, uint64_t *out, Py_ssize_t n)
{
    unsigned char pair[16];
    uint64_t parent = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        size_t start = (size_t)i * step;
        size_t size = len - start < step ? len - start : step;
        uint64_t h = XXH3_64bits_withSecretandSeed(data + start, size, secret, sizeof secret, SEED);
        if (i > 0) {
            put_le64(pair, parent);
            put_le64(pair + 8, h);
            h = XXH3_64bits_withSeed(pair, sizeof pair, SEED);
        }
        parent = h;
        out[i] = h;
    }
}

/* "00" to "99": two digits per division, half the divisions of one at a time. */
static const char DIGIT_PAIRS[201] =
    "0001020304050607080910111213141516171819"
    "2021222324252627282930313233343536373839"
    "4041424344454647484950515253545556575859"
    "6061626364656667686970717273747576777879"
    "8081828384858687888990919293949596979899";

/* Writes x (< 10**8) in decimal at p, without leading zeros; returns the
 * digits written. */
static size_t
put_u32(char *p, uint32_t x)
{
    char tmp[8];
    size_t pos = sizeof tmp;
    while (x >= 100) {
        uint32_t pair = (x % 100) * 2;
        x /= 100;
        tmp[--pos] = DIGIT_PAIRS[pair + 1];
        tmp[--pos] = DIGIT_PAIRS[pair];
    }
    if (x >= 10) {
        tmp[--pos] = DIGIT_PAIRS[x * 2 + 1];
        tmp[--pos] = DIGIT_PAIRS[x * 2];
    } else {
        tmp[--pos] = (char)('0' + x);
    }
    memcpy(p, tmp + pos, sizeof tmp - pos);
    return sizeof tmp - pos;
}

/* Writes x (< 10**8) at p as exactly 8 digits. */
static void
put_8_digits(char *p, uint32_t x)
{
    for (int pos = 6; pos >= 0; pos -= 2) {
        uint32_t pair = (x % 100) * 2;
        x /= 100;
        p[pos] = DIGIT_PAIRS[pair];
        p[pos + 1] = DIGIT_PAIRS[pair + 1];
    }
}

/* Writes v in decimal at p; returns the digits written (1 to 20). Two
 * 64-bit divisions at most, the digits themselves in 32-bit arithmetic. */
static size_t
put_decimal(char *p, uint64_t v)
{
    const uint64_t e8 = 100000000;
    if (v < e8) {
        return put_u32(p, (uint32_t)v);
    }
    uint64_t high = v / e8;
    uint32_t low = (uint32_t)(v % e8);
    size_t n;
    if (high < e8) {
        n = put_u32(p, (uint32_t)high);
    } else {  /* v >= 10**16: at most 4 leading digits, then 8 */
        n = put_u32(p, (uint32_t)(high / e8));
        put_8_digits(p + n, (uint32_t)(high % e8));
        n += 8;
    }
    put_8_digits(p + n, low);
    return n + 8;
}

/* The JSON array of the n hashes at out (room for 2 + 21 n bytes); returns
 * its length. */
static size_t
put_json(char *out, const uint64_t *hashes, Py_ssize_t n)
{
    char *p = out;
    *p++ = '[';
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i > 0) {
            *p++ = ',';
        }
        p += put_decimal(p, hashes[i]);
    }
    *p++ = ']';
    return (size_t)(p - out);
}

/* chain() and chain_json(): the arguments checked, the chain run (without
 * the GIL from NOGIL_BYTES on, the JSON text included), the result built. */
static PyObject *
hash_chain(PyObject *const *args, Py_ssize_t nargs, const char *name, int as_json)
{
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "%s() takes 2 arguments (%zd given)", name, nargs);
        return NULL;
    }
    Py_ssize_t block_size = PyLong_AsSsize_t(args[1]);
    if (block_size == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (block_size < 1) {
        PyErr_Format(PyExc_ValueError, "block_size must be at least 1, not %zd", block_size);
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_C_CONTIGUOUS) < 0) {
        return NULL;
    }
    PyObject *result = NULL;
    uint64_t *hashes = NULL;
    char *text = NULL;
    size_t len = (size_t)view.len, text_len = 0;
    if (len % 4 != 0) {
        PyErr_Format(PyExc_ValueError, "%zd bytes are not whole u32 token ids", view.len);
        goto done;
    }
    size_t tokens = len / 4;
    Py_ssize_t n = (Py_ssize_t)((tokens + (size_t)block_size - 1) / (size_t)block_size);
    size_t step = (size_t)block_size > SIZE_MAX / 4 ? SIZE_MAX : (size_t)block_size * 4;
    hashes = PyMem_Malloc(((size_t)n + 1) * sizeof *hashes);
    text = as_json ? PyMem_Malloc(2 + 21 * (size_t)n) : NULL;
    if (hashes == NULL || (as_json && text == NULL)) {
        PyErr_NoMemory();
        goto done;
    }
    if (len >= NOGIL_BYTES) {
        /* The exporter (array, bytearray) cannot resize while the view is held. */
        Py_BEGIN_ALLOW_THREADS
        chain(view.buf, len, step, hashes, n);
        if (as_json) {
            text_len = put_json(text, hashes, n);
        }
        Py_END_ALLOW_THREADS
    } else {
        chain(view.buf, len, step, hashes, n);
        if (as_json) {
            text_len = put_json(text, hashes, n);
        }
    }
    if (as_json) {
        result = PyBytes_FromStringAndSize(text, (Py_ssize_t)text_len);
        goto done;
    }
    if ((result = PyList_New(n)) == NULL) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *h = PyLong_FromUnsignedLongLong(hashes[i]);
        if (h == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, i, h);
    }
done:
    PyMem_Free(text);
    PyMem_Free(hashes);
    PyBuffer_Release(&view);
    return result;
}

PyDoc_STRVAR(chain_doc,
"chain(data, block_size, /)\n--\n\n"
"The chained replay block hashes of packed token ids.\n\n"
"data: a contiguous buffer of little-endian u32 token ids (4 bytes each,\n"
"e.g. an array('I') on a little-endian host); block_size: tokens per block,\n"
"at least 1. Returns ceil(len(data) / 4 / block_size) ints in [0, 2**64):\n"
"block i's sequence hash (XXH3-64, seed 1337, of its bytes; from block 1\n"
"on, of the parent's sequence hash and that hash as two little-endian u64).\n"
"Raises ValueError when block_size < 1 or len(data) is not a multiple of 4,\n"
"TypeError when data is not a buffer or block_size not an int, BufferError\n"
"when data is not contiguous.");

static PyObject *
chain_py(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    return hash_chain(args, nargs, "chain", 0);
}

PyDoc_STRVAR(chain_json_doc,
"chain_json(data, block_size, /)\n--\n\n"
"chain(data, block_size) as the ASCII bytes of a JSON array of decimal\n"
"integers, no spaces (b'[]' for no data): what orjson.dumps gives for the\n"
"list, without a Python int per hash. Same arguments and errors as chain().");

static PyObject *
chain_json_py(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    return hash_chain(args, nargs, "chain_json", 1);
}

static PyMethodDef methods[] = {
    {"chain", (PyCFunction)(void (*)(void))chain_py, METH_FASTCALL, chain_doc},
    {"chain_json", (PyCFunction)(void (*)(void))chain_json_py, METH_FASTCALL, chain_json_doc},
    {NULL, NULL, 0, NULL},
};

static int
exec_module(PyObject *module)
{
    XXH3_generateSecret_fromSeed(secret, SEED);
    return PyModule_AddIntConstant(module, "NOGIL_BYTES", NOGIL_BYTES);
}

static PyModuleDef_Slot slots[] = {
    {Py_mod_exec, exec_module},
    {0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "asgi_generate.tracing._hashchain",
    .m_doc = "The replay block hash chain over packed u32 token ids, in C (see hashing.py).",
    .m_size = 0,
    .m_methods = methods,
    .m_slots = slots,
};

PyMODINIT_FUNC
PyInit__hashchain(void)
{
    return PyModuleDef_Init(&module_def);
}
