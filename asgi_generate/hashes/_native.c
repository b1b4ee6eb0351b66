/* The hash chains' accelerator (asgi_generate.hashes._native), optional: the
 * package's pure-Python path (hashes/_python.py) gives the same values, and
 * setup.py installs without this module when no C compiler builds it.
 *
 * The replay block hash chain: hashing from Python costs two XXH3 calls per
 * block through the interpreter; here the whole chain runs over the packed
 * prompt's bytes in place, with the GIL released for long prompts, and
 * chain_json() also writes the hashes as the record's JSON text (orjson
 * spent ~45 ns on each of these 64-bit ints). The scheme is documented in
 * tracing/hashing.py and docs/traces.md; XXH3 itself is xxHash's
 * (asgi_generate/_vendor/xxhash, v0.8.4, BSD-2).
 *
 * The KV index's hot loops: kv_chain() gives exactly what the Python
 * definition, hash((parent, *block_tokens)) per block, gives, with CPython's
 * own tuple and int hashes (Objects/tupleobject.c tuplehash, the
 * xxHash-based one of CPython 3.8 and later; Objects/longobject.c
 * long_hash, modulo 2**61 - 1) written out for 64-bit builds: the
 * interpreter spends ~110 ns a token building and hashing a tuple per
 * block (SGLang's page size 1: a block a token). The mask_*() functions
 * are the index all workers share (block key -> a 64-bit mask of the
 * workers holding it), one dict probe a key without the interpreter's
 * loop: one walk narrows the mask and gives every worker's overlap,
 * probing a worker's own predictions only where it still walks and lacks
 * the key; expire() is a worker's prediction expiry.
 *
 * The kv-aware policy's loops over its candidates: kv_lowest() gives the
 * workers tied at the lowest (cost, cached tokens, requests), and
 * rendezvous() the tied one(s) with the highest XXH3-64 of the prompt tail
 * seeded by the URL's.
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

/* ---- The KV index: block keys, the shared mask index, prediction expiry ---- */

/* On 64-bit builds CPython's tuple and int hashes are written out below;
 * elsewhere (their primes and modulus differ) each block's tuple is built
 * and hashed by the interpreter, still hash((parent, *tokens)). */
#if SIZEOF_VOID_P == 8 && SIZEOF_LONG_LONG == 8 && SIZEOF_PY_HASH_T == 8
#define TUPLE_HASH_64 1
#endif

#ifdef TUPLE_HASH_64
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

#endif /* TUPLE_HASH_64 */

PyDoc_STRVAR(kv_chain_doc,
"kv_chain(start, ids, block) -> list[int]\n\n"
"The chained hashes of the full block-token blocks of ids (a sequence of\n"
"ints, or a buffer of unsigned 32-bit ints such as array('I')): each is\n"
"hash((parent, *tokens)), the first block's parent start. Equal to\n"
"its definition in Python (hashes/_python.py). Raises TypeError for ids of another\n"
"kind or a start that is not a 64-bit int, ValueError for block < 1.");

static PyObject *
kv_chain_py(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "kv_chain(start, ids, block) takes 3 arguments");
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
#ifdef TUPLE_HASH_64
    uint64_t len = (uint64_t)block + 1;
#endif
    for (Py_ssize_t b = 0; b < blocks; b++) {
        Py_ssize_t base = b * block;
#ifdef TUPLE_HASH_64
        uint64_t acc = lane(PRIME_5, int_hash(parent));
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
#else
        PyObject *tuple = PyTuple_New(block + 1), *item;
        if (tuple == NULL || (item = PyLong_FromLongLong(parent)) == NULL) {
            Py_XDECREF(tuple);
            goto fail;
        }
        PyTuple_SET_ITEM(tuple, 0, item);
        for (Py_ssize_t i = 0; i < block; i++) {
            item = u32 != NULL ? PyLong_FromUnsignedLong(u32[base + i]) : Py_NewRef(items[base + i]);
            if (item == NULL) {
                Py_DECREF(tuple);
                goto fail;
            }
            PyTuple_SET_ITEM(tuple, i + 1, item);
        }
        Py_hash_t h = PyObject_Hash(tuple);
        Py_DECREF(tuple);
        if (h == -1 && PyErr_Occurred())
            goto fail;
        parent = (int64_t)h;
#endif
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

/* The rendezvous tie-break (workers/policies/kv_aware.py): XXH3-64 of the
 * prompt's tail seeded by the XXH3-64 of the worker's URL, as the PyPI
 * xxhash's xxh3_64_intdigest(tail, seed=xxh3_64_intdigest(url)) gives it.
 * Through the interpreter it costs ~0.3 us a worker: a fleet of hundreds
 * tied (an idle fleet, every engine holding the same system prompt) hashed
 * all of them on every request. */
static inline uint64_t
rendezvous_weight(PyObject *url, const unsigned char *t, size_t nt)
{
    XXH64_hash_t seed = XXH3_64bits(PyBytes_AS_STRING(url), (size_t)PyBytes_GET_SIZE(url));
    return XXH3_64bits_withSeed(t, nt, seed);
}

PyDoc_STRVAR(rendezvous_doc,
"rendezvous(urls, tail) -> list[int]\n\n"
"The indexes in urls (a non-empty list of bytes), in order, of those whose\n"
"xxh3_64_intdigest(tail, seed=xxh3_64_intdigest(url)) is\n"
"the highest (more than one only for equal URLs, or a 64-bit collision);\n"
"tail is bytes.");

static PyObject *
rendezvous_py(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyList_Check(args[0]) || !PyBytes_Check(args[1]) || PyList_GET_SIZE(args[0]) == 0) {
        PyErr_SetString(PyExc_TypeError, "rendezvous(urls: non-empty list of bytes, tail: bytes)");
        return NULL;
    }
    PyObject *urls = args[0], *tail = args[1];
    const unsigned char *t = (const unsigned char *)PyBytes_AS_STRING(tail);
    size_t nt = (size_t)PyBytes_GET_SIZE(tail);
    Py_ssize_t n = PyList_GET_SIZE(urls), first = 0, equal = 0;
    uint64_t high = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *url = PyList_GET_ITEM(urls, i);
        if (!PyBytes_Check(url)) {
            PyErr_SetString(PyExc_TypeError, "rendezvous: urls must be bytes");
            return NULL;
        }
        uint64_t w = rendezvous_weight(url, t, nt);
        if (i == 0 || w > high) {
            first = i;
            high = w;
            equal = 1;
        } else if (w == high) {
            equal++;
        }
    }
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = first; i < n && PyList_GET_SIZE(out) < equal; i++) {
        PyObject *url = PyList_GET_ITEM(urls, i);
        if (i == first || rendezvous_weight(url, t, nt) == high) {
            PyObject *at = PyLong_FromSsize_t(i);
            if (at == NULL || PyList_Append(out, at) < 0) {
                Py_XDECREF(at);
                Py_DECREF(out);
                return NULL;
            }
            Py_DECREF(at);
        }
    }
    return out;
}

/* kv-aware's costs (workers/policies/kv_aware.py), in doubles: every count
 * is an int below 2**53, so each product and sum rounds as Python's int and
 * float arithmetic rounds it, in the same order. Not fused into
 * multiply-adds, which round once where Python rounds twice. */
#if defined(__GNUC__) && !defined(__clang__)
#define NO_FMA __attribute__((optimize("fp-contract=off")))
#else
#define NO_FMA
#endif

static int
doubles_of(PyObject *list, Py_ssize_t n, double *out)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        out[i] = PyFloat_AsDouble(PyList_GET_ITEM(list, i));
        if (out[i] == -1.0 && PyErr_Occurred())
            return -1;
    }
    return 0;
}

static int
ints_of(PyObject *list, Py_ssize_t n, long long *out)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        out[i] = PyLong_AsLongLong(PyList_GET_ITEM(list, i));
        if (out[i] == -1 && PyErr_Occurred())
            return -1;
    }
    return 0;
}

PyDoc_STRVAR(kv_lowest_doc,
"kv_lowest(prompt, weights, blocks, guessed, pending, count, sizes, outstanding,\n"
"          per_request, others, extra) -> list[int]\n\n"
"kv-aware's scoring: for each worker i (the lists, all of one length n > 0:\n"
"ints but per_request, int or float), requests = outstanding * per_request\n"
"+ others and, with (ow, qw, lw) = weights,\n"
"  cost = ow * (prompt - blocks * sizes) + qw * ((pending - guessed) * sizes)\n"
"         + lw * requests (+ extra[i], a list of floats, unless None);\n"
"the indexes, in order, of the workers tied at the lowest (cost,\n"
"(count + pending) * sizes, requests).");

static NO_FMA PyObject *
kv_lowest_py(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
    if (nargs != 11 || !PyTuple_Check(args[1]) || PyTuple_GET_SIZE(args[1]) != 3) {
        PyErr_SetString(PyExc_TypeError, "kv_lowest(prompt, (ow, qw, lw), blocks, guessed, pending, count, sizes, "
                        "outstanding, per_request, others, extra)");
        return NULL;
    }
    Py_ssize_t n = -1;
    for (int a = 2; a < 11; a++) {
        if (a == 10 && args[a] == Py_None)
            continue;
        if (!PyList_Check(args[a]) || (n >= 0 && PyList_GET_SIZE(args[a]) != n)) {
            PyErr_SetString(PyExc_TypeError, "kv_lowest: lists of one length");
            return NULL;
        }
        n = PyList_GET_SIZE(args[a]);
    }
    if (n <= 0) {
        PyErr_SetString(PyExc_ValueError, "kv_lowest: no workers");
        return NULL;
    }
    long long prompt = PyLong_AsLongLong(args[0]);
    if (prompt == -1 && PyErr_Occurred())
        return NULL;
    double ow = PyFloat_AsDouble(PyTuple_GET_ITEM(args[1], 0)), qw = PyFloat_AsDouble(PyTuple_GET_ITEM(args[1], 1)),
           lw = PyFloat_AsDouble(PyTuple_GET_ITEM(args[1], 2));
    if (PyErr_Occurred())
        return NULL;
    /* One allocation: 6 int columns, 2 double columns (outstanding read as
     * an int), the extra column, then each worker's key. */
    long long *ints = PyMem_Malloc(sizeof(long long) * 7 * n);
    double *dbl = PyMem_Malloc(sizeof(double) * 5 * n);
    PyObject *out = NULL;
    if (ints == NULL || dbl == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    long long *blocks = ints, *guessed = ints + n, *pending = ints + 2 * n, *count = ints + 3 * n,
              *sizes = ints + 4 * n, *outstanding = ints + 5 * n, *others = ints + 6 * n;
    double *per_request = dbl, *extra = dbl + n, *cost = dbl + 2 * n, *requests = dbl + 3 * n;
    long long *cached = (long long *)(dbl + 4 * n);
    if (ints_of(args[2], n, blocks) < 0 || ints_of(args[3], n, guessed) < 0 || ints_of(args[4], n, pending) < 0 ||
        ints_of(args[5], n, count) < 0 || ints_of(args[6], n, sizes) < 0 || ints_of(args[7], n, outstanding) < 0 ||
        doubles_of(args[8], n, per_request) < 0 || ints_of(args[9], n, others) < 0 ||
        (args[10] != Py_None && doubles_of(args[10], n, extra) < 0))
        goto done;
    Py_ssize_t low = 0, tied = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        double r = (double)outstanding[i] * per_request[i];
        r = r + (double)others[i];
        double c = ow * (double)(prompt - blocks[i] * sizes[i]);
        double q = qw * (double)((pending[i] - guessed[i]) * sizes[i]);
        c = c + q;
        double l = lw * r;
        c = c + l;
        if (args[10] != Py_None)
            c = c + extra[i];
        cost[i] = c;
        requests[i] = r;
        cached[i] = (count[i] + pending[i]) * sizes[i];
        if (i == 0 || c < cost[low] || (c == cost[low] && (cached[i] < cached[low] ||
                                                            (cached[i] == cached[low] && r < requests[low])))) {
            low = i;
            tied = 1;
        } else if (c == cost[low] && cached[i] == cached[low] && r == requests[low]) {
            tied++;
        }
    }
    out = PyList_New(tied);
    if (out == NULL)
        goto done;
    for (Py_ssize_t i = low, k = 0; k < tied; i++) {
        if (cost[i] == cost[low] && cached[i] == cached[low] && requests[i] == requests[low]) {
            PyObject *at = PyLong_FromSsize_t(i);
            if (at == NULL) {
                Py_CLEAR(out);
                goto done;
            }
            PyList_SET_ITEM(out, k++, at);
        }
    }
done:
    PyMem_Free(ints);
    PyMem_Free(dbl);
    return out;
}

static PyMethodDef methods[] = {
    {"chain", (PyCFunction)(void (*)(void))chain_py, METH_FASTCALL, chain_doc},
    {"chain_json", (PyCFunction)(void (*)(void))chain_json_py, METH_FASTCALL, chain_json_doc},
    {"loops", loops_py, METH_NOARGS, loops_doc},
    {"use_loop", use_loop_py, METH_O, use_loop_doc},
    {"kv_chain", (PyCFunction)(void (*)(void))kv_chain_py, METH_FASTCALL, kv_chain_doc},
    {"expire", (PyCFunction)(void (*)(void))expire_py, METH_FASTCALL, expire_doc},
    {"mask_walk", (PyCFunction)(void (*)(void))mask_walk_py, METH_FASTCALL, mask_walk_doc},
    {"mask_set", (PyCFunction)(void (*)(void))mask_set_py, METH_FASTCALL, mask_set_doc},
    {"mask_drop", (PyCFunction)(void (*)(void))mask_drop_py, METH_FASTCALL, mask_drop_doc},
    {"mask_remove", (PyCFunction)(void (*)(void))mask_remove_py, METH_FASTCALL, mask_remove_doc},
    {"mask_missing", (PyCFunction)(void (*)(void))mask_missing_py, METH_FASTCALL, mask_missing_doc},
    {"rendezvous", (PyCFunction)(void (*)(void))rendezvous_py, METH_FASTCALL, rendezvous_doc},
    {"kv_lowest", (PyCFunction)(void (*)(void))kv_lowest_py, METH_FASTCALL, kv_lowest_doc},
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
    .m_name = "asgi_generate.hashes._native",
    .m_doc = "The hash chains in C: the replay chain over packed u32 token ids and the KV index's block keys and mask loops (see hashes/_python.py).",
    .m_size = 0,
    .m_methods = methods,
    .m_slots = slots,
};

PyMODINIT_FUNC
PyInit__native(void)
{
    return PyModuleDef_Init(&module_def);
}
