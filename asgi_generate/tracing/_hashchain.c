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

/* On x86-64 with GCC or Clang, XXH3's AVX2 loop is compiled beside the SSE2
 * baseline and chosen at import when the CPU and OS support it (as xxHash's
 * own xxh_x86dispatch.c does): a 64-token block's 4 stripes of 64 bytes take
 * two 256-bit operations each instead of four 128-bit ones, 12% off the
 * chain of a long prompt. (AVX-512 measured no faster on 64-token blocks.) */
#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__) && !defined(XXH_VECTOR)
#define DISPATCH 1
#define XXH_X86DISPATCH 1  /* accumulators aligned for any x86 loop */
#define XXH_DISPATCH_AVX2 1
#define XXH_TARGET_AVX2 __attribute__((__target__("avx2")))
#include <immintrin.h>
#endif

#define XXH_INLINE_ALL
#include "xxhash.h"

#define SEED 1337
/* Bytes from which the GIL is released while hashing: 64 KiB (16K tokens)
 * take a few microseconds, long enough for the event loop thread to use
 * (a loop thread next to a hashing thread did 7-9 M steps/s instead of
 * 5-6 M). */
#define NOGIL_BYTES 65536

/* XXH3's secret for SEED, derived once: with it XXH3's long-input loop
 * (blocks of more than 60 tokens, 240 bytes) gives XXH3_64bits_withSeed(SEED)
 * without re-deriving it for every block. */
XXH_ALIGN(64) static unsigned char secret[XXH3_SECRET_DEFAULT_SIZE];

/* The sequence hash of a block, given its block hash h and its parent's:
 * XXH3-64 (seed SEED) of the two as little-endian u64. */
static inline uint64_t
chain_link(uint64_t parent, uint64_t h)
{
    unsigned char pair[16];
    XXH_writeLE64(pair, parent);
    XXH_writeLE64(pair + 8, h);
    return XXH3_64bits_withSeed(pair, sizeof pair, SEED);
}

/* CHAIN(name, target, acc, scramble) defines name(data, len, step, out, n):
 * out[i] = the sequence hash of block i; n blocks of step bytes, the last
 * one possibly shorter (len bytes in all), long blocks hashed with XXH3's
 * acc and scramble loops under the target attribute. Short blocks take
 * XXH3's seeded short path, as XXH3_64bits_withSecretandSeed does. */
#define CHAIN(name, target, acc, scramble)                                              \
    target static void                                                                  \
    name(const unsigned char *data, size_t len, size_t step, uint64_t *out, Py_ssize_t n) \
    {                                                                                   \
        uint64_t parent = 0;                                                            \
        for (Py_ssize_t i = 0; i < n; i++) {                                            \
            size_t start = (size_t)i * step;                                            \
            size_t size = len - start < step ? len - start : step;                      \
            uint64_t h = size <= XXH3_MIDSIZE_MAX                                       \
                ? XXH3_64bits_withSeed(data + start, size, SEED)                        \
                : XXH3_hashLong_64b_internal(data + start, size, secret, sizeof secret, \
                                             acc, scramble);                            \
            parent = out[i] = i > 0 ? chain_link(parent, h) : h;                        \
        }                                                                               \
    }

CHAIN(chain_baseline, , XXH3_accumulate, XXH3_scrambleAcc)
#ifdef DISPATCH
CHAIN(chain_avx2, XXH_TARGET_AVX2, XXH3_accumulate_avx2, XXH3_scrambleAcc_avx2)
#endif

typedef void (*chain_fn)(const unsigned char *, size_t, size_t, uint64_t *, Py_ssize_t);

/* The loops this build has, best first; those the CPU runs are usable. */
static const struct {
    const char *name;
    chain_fn fn;
} LOOPS[] = {
#ifdef DISPATCH
    {"avx2", chain_avx2},
#endif
    {"baseline", chain_baseline},
};
#define N_LOOPS (sizeof LOOPS / sizeof LOOPS[0])

static int
usable(size_t i)
{
#ifdef DISPATCH
    /* GCC and Clang check the OS saves the registers (XGETBV) too. */
    if (LOOPS[i].fn == chain_avx2) {
        return __builtin_cpu_supports("avx2");
    }
#endif
    (void)i;
    return 1;
}

/* The loop in use: the best usable one, unless use_loop() chose another. */
static size_t current;

static void
chain(const unsigned char *data, size_t len, size_t step, uint64_t *out, Py_ssize_t n)
{
    LOOPS[current].fn(data, len, step, out, n);
}

/* "00" to "99": two digits per division, half the divisions of one at a time. */
static const char DIGIT_PAIRS[201] =
    "0001020304050607080910111213141516171819"
    "2021222324252627282930313233343536373839"
    "4041424344454647484950515253545556575859"
    "6061626364656667686970717273747576777879"
    "8081828384858687888990919293949596979899";

/* The number of decimal digits of v (1 to 20). */
static size_t
decimal_length(uint64_t v)
{
    static const uint64_t POW10[20] = {
        1ull, 10ull, 100ull, 1000ull, 10000ull, 100000ull, 1000000ull, 10000000ull, 100000000ull,
        1000000000ull, 10000000000ull, 100000000000ull, 1000000000000ull, 10000000000000ull,
        100000000000000ull, 1000000000000000ull, 10000000000000000ull, 100000000000000000ull,
        1000000000000000000ull, 10000000000000000000ull,
    };
    size_t n = 1;
    while (n < 20 && v >= POW10[n]) {
        n++;
    }
    return n;
}

/* Writes the last `digits` digits of x (< 10**8) so that they end at end,
 * zero-padded: two per step, in 32-bit arithmetic. */
static void
put_digits_before(char *end, uint32_t x, size_t digits)
{
    for (; digits >= 2; digits -= 2) {
        uint32_t q = x / 100;
        end -= 2;
        memcpy(end, DIGIT_PAIRS + (x - q * 100) * 2, 2);
        x = q;
    }
    if (digits) {
        end[-1] = (char)('0' + x % 10);
    }
}

/* Writes v in decimal at p, right to left straight into place (no leading
 * zeros); returns the digits written (1 to 20). */
static size_t
put_decimal_any(char *p, uint64_t v)
{
    const uint64_t e8 = 100000000;
    size_t n = decimal_length(v), left = n;
    char *end = p + n;
    while (left > 8) {
        put_digits_before(end, (uint32_t)(v % e8), 8);
        v /= e8;
        end -= 8;
        left -= 8;
    }
    put_digits_before(end, (uint32_t)v, left);
    return n;
}

/* Writes x (< 10**8) at p as exactly 8 digits: two halves of 4, each two
 * pairs, so the divisions do not wait on one another. */
static inline void
put_8_digits(char *p, uint32_t x)
{
    uint32_t high = x / 10000, low = x % 10000;
    memcpy(p, DIGIT_PAIRS + (high / 100) * 2, 2);
    memcpy(p + 2, DIGIT_PAIRS + (high % 100) * 2, 2);
    memcpy(p + 4, DIGIT_PAIRS + (low / 100) * 2, 2);
    memcpy(p + 6, DIGIT_PAIRS + (low % 100) * 2, 2);
}

/* Writes v in decimal at p (no leading zeros; room for 20 bytes at p);
 * returns the digits written (1 to 20). A hash is 17 to 20 digits long
 * 99.95% of the time, in a random mix: those take no branch on their
 * length, whose mispredictions cost more than the digits (the leading 1 to
 * 4 digits are written as 4, shifted down in one word on a little-endian
 * host, and the 16 others written after them). */
static size_t
put_decimal(char *p, uint64_t v)
{
    const uint64_t e16 = 10000000000000000ull;
    if (v < e16 || !XXH_CPU_LITTLE_ENDIAN) {
        return put_decimal_any(p, v);
    }
    uint32_t lead = (uint32_t)(v / e16);  /* 1 to 1844 */
    uint64_t rest = v % e16;
    size_t skip = (size_t)(lead < 1000) + (lead < 100) + (lead < 10);
    uint16_t pairs[2];
    uint32_t word;
    memcpy(&pairs[0], DIGIT_PAIRS + (lead / 100) * 2, 2);
    memcpy(&pairs[1], DIGIT_PAIRS + (lead % 100) * 2, 2);
    memcpy(&word, pairs, 4);
    word >>= 8 * skip;  /* the leading zeros out; the bytes after them are overwritten below */
    memcpy(p, &word, 4);
    p += 4 - skip;
    put_8_digits(p, (uint32_t)(rest / 100000000));
    put_8_digits(p + 8, (uint32_t)(rest % 100000000));
    return 20 - skip;
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

PyDoc_STRVAR(loops_doc,
"loops(/)\n--\n\n"
"The names of the XXH3 loops this CPU runs, best first (the one in use\n"
"unless use_loop() chose another): 'avx2' (x86-64 builds with GCC or\n"
"Clang, on a CPU and OS with AVX2), then 'baseline' (what the compiler\n"
"targets: SSE2 on x86-64).");

static PyObject *
loops_py(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(args))
{
    PyObject *names = PyList_New(0);
    if (names == NULL) {
        return NULL;
    }
    for (size_t i = 0; i < N_LOOPS; i++) {
        if (!usable(i)) {
            continue;
        }
        PyObject *name = PyUnicode_FromString(LOOPS[i].name);
        if (name == NULL || PyList_Append(names, name) < 0) {
            Py_XDECREF(name);
            Py_DECREF(names);
            return NULL;
        }
        Py_DECREF(name);
    }
    PyObject *result = PyList_AsTuple(names);
    Py_DECREF(names);
    return result;
}

PyDoc_STRVAR(use_loop_doc,
"use_loop(name, /)\n--\n\n"
"Hash with the XXH3 loop name (one of loops()) from now on, in this\n"
"process, and return the name of the one used so far: for tests and\n"
"benchmarks, as every loop gives the same hashes. Raises ValueError for a\n"
"name not in loops(), TypeError for a name that is not a str.");

static PyObject *
use_loop_py(PyObject *Py_UNUSED(module), PyObject *arg)
{
    const char *name = PyUnicode_AsUTF8(arg);
    if (name == NULL) {
        return NULL;
    }
    for (size_t i = 0; i < N_LOOPS; i++) {
        if (strcmp(LOOPS[i].name, name) == 0 && usable(i)) {
            size_t previous = current;
            current = i;
            return PyUnicode_FromString(LOOPS[previous].name);
        }
    }
    PyErr_Format(PyExc_ValueError, "no XXH3 loop %R on this CPU", arg);
    return NULL;
}

static PyMethodDef methods[] = {
    {"chain", (PyCFunction)(void (*)(void))chain_py, METH_FASTCALL, chain_doc},
    {"chain_json", (PyCFunction)(void (*)(void))chain_json_py, METH_FASTCALL, chain_json_doc},
    {"loops", loops_py, METH_NOARGS, loops_doc},
    {"use_loop", use_loop_py, METH_O, use_loop_doc},
    {NULL, NULL, 0, NULL},
};

static int
exec_module(PyObject *module)
{
    XXH3_generateSecret_fromSeed(secret, SEED);
#ifdef DISPATCH
    __builtin_cpu_init();
#endif
    current = 0;
    while (!usable(current)) {  /* the baseline is always usable */
        current++;
    }
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
