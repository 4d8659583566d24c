/* flexkvd._fast: the optional compiled fast path of the flexkvd package (CPython C API; docs/python.md "Fast path").
 * It calls the same libflexkv the package loaded with ctypes, through function pointers handed over by bind(), so
 * it never loads a second copy and links nothing but libpython's API.
 *
 * Contract with the Python side (_native.py, keys.py, client.py, _ticket.py):
 *  - Every function either does exactly what the ctypes path does, or returns None ("not handled here": odd input,
 *    a value out of range, a type it does not read) so that the ctypes path runs and raises its own error. It never
 *    raises a flexkvd.Error itself; libflexkv failures come back as the int return code, and the caller reads
 *    flexkv_last_error() on the same thread, as after a ctypes call.
 *  - It never consumes an iterator: only lists, tuples and buffers are read.
 *  - Blocking calls (wait) and long ones (key hashing over many tokens) release the GIL.
 * Thread safety: bind() runs once at import, before any other call; everything else keeps no state. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "flexkv/c.h"

typedef int (*match_fn)(flexkv_client*, const flexkv_block_key*, size_t, int, flexkv_ticket*);
typedef int (*prefetch_fn)(flexkv_client*, const flexkv_block_key*, size_t, flexkv_ticket*);
typedef int (*release_fn)(flexkv_client*, uint64_t, flexkv_ticket*);
typedef int (*wait_fn)(flexkv_client*, flexkv_ticket, int64_t, flexkv_op_result*);
typedef int (*try_wait_fn)(flexkv_client*, flexkv_ticket, flexkv_op_result*);
typedef int (*keys_fn)(const char*, size_t, const int32_t*, size_t, uint32_t, flexkv_block_key*, size_t, size_t*);

static match_fn p_match;
static prefetch_fn p_prefetch;
static release_fn p_release;
static wait_fn p_wait;
static try_wait_fn p_try_wait;
static keys_fn p_compute_block_keys;
/* OpResult (the frozen dataclass) and {int code: StatusCode}, from bind(). */
static PyObject* op_result_type;
static PyObject* status_codes;
static PyObject* unknown_status; /* status_codes[FLEXKV_UNKNOWN] */
static PyObject* empty_tuple;
static PyObject* str_fields[7];
static const char* const kFieldNames[7] = {"status_code", "matched_blocks", "done_blocks", "match_handle",
                                           "message", "bytes", "source"};

/* Hashing releases the GIL from this many tokens on (below it, releasing costs more than it frees). */
#define RELEASE_GIL_TOKENS 4096

static int address(PyObject* obj, void** out) {
  *out = PyLong_AsVoidPtr(obj);
  return (*out == NULL && PyErr_Occurred()) ? -1 : 0;
}

static PyObject* bind(PyObject* self, PyObject* args) {
  PyObject *m, *pf, *r, *w, *tw, *k;
  unsigned int abi;
  (void)self;
  if (!PyArg_ParseTuple(args, "IOOOOOOOO:bind", &abi, &m, &pf, &r, &w, &tw, &k, &op_result_type, &status_codes)) {
    return NULL;
  }
  if (abi != FLEXKV_ABI_VERSION) {
    return PyErr_Format(PyExc_ImportError, "flexkvd._fast was built for C ABI version %d; the package speaks %u",
                        FLEXKV_ABI_VERSION, abi);
  }
  void* fns[6];
  PyObject* objs[6] = {m, pf, r, w, tw, k};
  for (int i = 0; i < 6; ++i) {
    if (address(objs[i], &fns[i]) < 0) return NULL;
    if (fns[i] == NULL) return PyErr_Format(PyExc_ValueError, "bind: function pointer %d is NULL", i);
  }
  /* memcpy: ISO C has no cast from an object pointer to a function pointer (POSIX guarantees they convert). */
  memcpy(&p_match, &fns[0], sizeof p_match);
  memcpy(&p_prefetch, &fns[1], sizeof p_prefetch);
  memcpy(&p_release, &fns[2], sizeof p_release);
  memcpy(&p_wait, &fns[3], sizeof p_wait);
  memcpy(&p_try_wait, &fns[4], sizeof p_try_wait);
  memcpy(&p_compute_block_keys, &fns[5], sizeof p_compute_block_keys);
  Py_INCREF(op_result_type);
  Py_INCREF(status_codes);
  PyObject* unknown = PyLong_FromLong(FLEXKV_UNKNOWN);
  if (unknown == NULL) return NULL;
  unknown_status = PyDict_GetItemWithError(status_codes, unknown);
  Py_DECREF(unknown);
  if (unknown_status == NULL) {
    return PyErr_Occurred() ? NULL : PyErr_Format(PyExc_ValueError, "bind: status_codes lacks UNKNOWN");
  }
  Py_INCREF(unknown_status);
  empty_tuple = PyTuple_New(0);
  if (empty_tuple == NULL) return NULL;
  for (int i = 0; i < 7; ++i) {
    str_fields[i] = PyUnicode_InternFromString(kFieldNames[i]);
    if (str_fields[i] == NULL) return NULL;
  }
  Py_RETURN_NONE;
}

/* ---- integers ---- */

/* Reads `obj` as n 4-byte integers in lo..hi into *out: a list or tuple of Python ints, or a 1-D C-contiguous buffer
 * of native integers. *borrowed is set when *out points into `view` (an exact int32/uint32 buffer: no copy; release
 * the view after use), else *out is PyMem_Malloc'ed. Returns 1 when read, 0 when not handled here (nothing to free,
 * no error set), -1 on a Python error. */
static int read_ints(PyObject* obj, int is_signed, Py_ssize_t* n_out, void** out, Py_buffer* view, int* borrowed) {
  const long long lo = is_signed ? INT32_MIN : 0;
  const long long hi = is_signed ? INT32_MAX : UINT32_MAX;
  *borrowed = 0;
  if (PyList_CheckExact(obj) || PyTuple_CheckExact(obj)) {
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(obj);
    PyObject** items = PySequence_Fast_ITEMS(obj);
    int32_t* buf = PyMem_Malloc((size_t)(n > 0 ? n : 1) * 4);
    if (buf == NULL) {
      PyErr_NoMemory();
      return -1;
    }
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* item = items[i];
      if (!PyLong_Check(item)) goto not_handled;  /* NumPy integers & co: the ctypes path takes them */
      int overflow = 0;
      const long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
      if (overflow || v < lo || v > hi) goto not_handled;  /* the ctypes path names the value and the range */
      buf[i] = (int32_t)(uint32_t)v;
      continue;
    not_handled:
      PyMem_Free(buf);
      return 0;
    }
    *n_out = n;
    *out = buf;
    return 1;
  }
  if (!PyObject_CheckBuffer(obj)) return 0;
  if (PyObject_GetBuffer(obj, view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
    PyErr_Clear();
    return 0;
  }
  const char* f = view->format ? view->format : "B";
  if (*f == '@' || *f == '=' || *f == '<') ++f;  /* native order (this is little-endian x86-64 / aarch64) */
  const char fmt = f[0];
  if (view->ndim != 1 || fmt == '\0' || f[1] != '\0' || strchr("bBhHiIlLqQnN", fmt) == NULL) {
    PyBuffer_Release(view);
    return 0;
  }
  const Py_ssize_t n = view->shape ? view->shape[0] : view->len / (view->itemsize ? view->itemsize : 1);
  if ((fmt == 'i' && is_signed) || (fmt == 'I' && !is_signed)) {
    if (view->itemsize == 4) {
      *n_out = n;
      *out = view->buf;
      *borrowed = 1;
      return 1;
    }
  }
  int32_t* buf = PyMem_Malloc((size_t)(n > 0 ? n : 1) * 4);
  if (buf == NULL) {
    PyBuffer_Release(view);
    PyErr_NoMemory();
    return -1;
  }
  const int unsigned_fmt = (fmt >= 'A' && fmt <= 'Z');
  const char* p = view->buf;
  for (Py_ssize_t i = 0; i < n; ++i, p += view->itemsize) {
    long long v;
    if (unsigned_fmt) {
      unsigned long long u;
      switch (view->itemsize) {
        case 1: u = *(const uint8_t*)p; break;
        case 2: { uint16_t x; memcpy(&x, p, 2); u = x; break; }
        case 4: { uint32_t x; memcpy(&x, p, 4); u = x; break; }
        case 8: { uint64_t x; memcpy(&x, p, 8); u = x; break; }
        default: goto give_up;
      }
      if (u > (unsigned long long)hi) goto give_up;
      v = (long long)u;
    } else {
      switch (view->itemsize) {
        case 1: v = *(const int8_t*)p; break;
        case 2: { int16_t x; memcpy(&x, p, 2); v = x; break; }
        case 4: { int32_t x; memcpy(&x, p, 4); v = x; break; }
        case 8: { int64_t x; memcpy(&x, p, 8); v = x; break; }
        default: goto give_up;
      }
    }
    if (v < lo || v > hi) goto give_up;
    buf[i] = (int32_t)(uint32_t)v;
  }
  PyBuffer_Release(view);
  *n_out = n;
  *out = buf;
  return 1;
give_up:
  PyMem_Free(buf);
  PyBuffer_Release(view);
  return 0;
}

static void free_ints(void* data, Py_buffer* view, int borrowed) {
  if (borrowed) {
    PyBuffer_Release(view);
  } else {
    PyMem_Free(data);
  }
}

/* ints(values, signed) -> bytearray of len(values) native int32 (signed) / uint32, or None (not handled). */
static PyObject* ints(PyObject* self, PyObject* args) {
  PyObject* values;
  int is_signed;
  (void)self;
  if (!PyArg_ParseTuple(args, "Op:ints", &values, &is_signed)) return NULL;
  Py_ssize_t n = 0;
  void* data = NULL;
  Py_buffer view;
  int borrowed = 0;
  const int got = read_ints(values, is_signed, &n, &data, &view, &borrowed);
  if (got <= 0) {
    if (got < 0) return NULL;
    Py_RETURN_NONE;
  }
  PyObject* out = PyByteArray_FromStringAndSize(data, n * 4);
  free_ints(data, &view, borrowed);
  return out;
}

/* block_keys(namespace: bytes, tokens, tokens_per_block >= 1) -> bytearray of the keys (16 bytes each), or None
 * (tokens not handled here). */
static PyObject* block_keys(PyObject* self, PyObject* args) {
  const char* ns;
  Py_ssize_t ns_len;
  PyObject* tokens;
  unsigned int per_block;
  (void)self;
  if (!PyArg_ParseTuple(args, "y#OI:block_keys", &ns, &ns_len, &tokens, &per_block)) return NULL;
  if (per_block == 0) Py_RETURN_NONE;
  Py_ssize_t n = 0;
  void* data = NULL;
  Py_buffer view;
  int borrowed = 0;
  const int got = read_ints(tokens, 1, &n, &data, &view, &borrowed);
  if (got <= 0) {
    if (got < 0) return NULL;
    Py_RETURN_NONE;
  }
  const size_t capacity = (size_t)n / per_block;
  PyObject* out = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)(capacity * sizeof(flexkv_block_key)));
  if (out == NULL) {
    free_ints(data, &view, borrowed);
    return NULL;
  }
  size_t count = 0;
  int rc;
  flexkv_block_key* keys = (flexkv_block_key*)PyByteArray_AS_STRING(out);
  static const int32_t kNoTokens[1] = {0};
  const int32_t* toks = n > 0 ? (const int32_t*)data : kNoTokens;
  if (n >= RELEASE_GIL_TOKENS) {
    Py_BEGIN_ALLOW_THREADS
    rc = p_compute_block_keys(ns, (size_t)ns_len, toks, (size_t)n, per_block, keys, capacity, &count);
    Py_END_ALLOW_THREADS
  } else {
    rc = p_compute_block_keys(ns, (size_t)ns_len, toks, (size_t)n, per_block, keys, capacity, &count);
  }
  free_ints(data, &view, borrowed);
  if (rc != 0 || count != capacity) {  /* not reachable with per_block >= 1; the ctypes path reports it */
    Py_DECREF(out);
    Py_RETURN_NONE;
  }
  return out;
}

/* ---- data plane ---- */

static PyObject* ticket_tuple(int rc, const flexkv_ticket* t) {
  if (rc != 0) return Py_BuildValue("(iKK)", rc, 0ULL, 0ULL);
  return Py_BuildValue("(iKK)", rc, (unsigned long long)t->id, (unsigned long long)t->generation);
}

/* The keys of a BlockKeys' ctypes array (its buffer: 16 bytes per key). */
static int keys_view(PyObject* obj, Py_buffer* view) {
  if (PyObject_GetBuffer(obj, view, PyBUF_SIMPLE) < 0) return -1;
  if (view->len % (Py_ssize_t)sizeof(flexkv_block_key) != 0) {
    PyBuffer_Release(view);
    PyErr_SetString(PyExc_ValueError, "block keys buffer is not a whole number of 16-byte keys");
    return -1;
  }
  return 0;
}

/* match(client, keys array, pin) -> (rc, id, generation). */
static PyObject* match(PyObject* self, PyObject* args) {
  PyObject *cobj, *kobj;
  int pin;
  void* client;
  Py_buffer view;
  flexkv_ticket t = {0, 0};
  (void)self;
  if (!PyArg_ParseTuple(args, "OOp:match", &cobj, &kobj, &pin)) return NULL;
  if (address(cobj, &client) < 0 || keys_view(kobj, &view) < 0) return NULL;
  const int rc = p_match(client, view.buf, (size_t)view.len / sizeof(flexkv_block_key), pin, &t);
  PyBuffer_Release(&view);
  return ticket_tuple(rc, &t);
}

/* prefetch(client, keys array) -> (rc, id, generation). */
static PyObject* prefetch(PyObject* self, PyObject* args) {
  PyObject *cobj, *kobj;
  void* client;
  Py_buffer view;
  flexkv_ticket t = {0, 0};
  (void)self;
  if (!PyArg_ParseTuple(args, "OO:prefetch", &cobj, &kobj)) return NULL;
  if (address(cobj, &client) < 0 || keys_view(kobj, &view) < 0) return NULL;
  const int rc = p_prefetch(client, view.buf, (size_t)view.len / sizeof(flexkv_block_key), &t);
  PyBuffer_Release(&view);
  return ticket_tuple(rc, &t);
}

/* release(client, match_handle) -> (rc, id, generation). */
static PyObject* release(PyObject* self, PyObject* args) {
  PyObject* cobj;
  unsigned long long handle;
  void* client;
  flexkv_ticket t = {0, 0};
  (void)self;
  if (!PyArg_ParseTuple(args, "OK:release", &cobj, &handle)) return NULL;
  if (address(cobj, &client) < 0) return NULL;
  return ticket_tuple(p_release(client, handle, &t), &t);
}

/* The OpResult of a C result, built as OpResult._from_c builds it (without running the frozen __init__). */
static PyObject* op_result(const flexkv_op_result* r) {
  PyObject* key = PyLong_FromLong(r->status_code);
  if (key == NULL) return NULL;
  PyObject* status = PyDict_GetItemWithError(status_codes, key);  /* borrowed */
  Py_DECREF(key);
  if (status == NULL) {
    if (PyErr_Occurred()) return NULL;
    status = unknown_status;
  }
  PyObject* values[7];
  values[0] = Py_NewRef(status);
  values[1] = PyLong_FromUnsignedLong(r->matched_blocks);
  values[2] = PyLong_FromUnsignedLong(r->done_blocks);
  values[3] = PyLong_FromUnsignedLongLong(r->match_handle);
  values[4] = r->status_code != 0 ? PyUnicode_DecodeUTF8(r->message, (Py_ssize_t)strnlen(r->message, sizeof r->message),
                                                         "replace")
                                  : PyUnicode_FromStringAndSize("", 0);
  values[5] = PyLong_FromUnsignedLongLong(r->bytes);
  values[6] = PyUnicode_DecodeUTF8(r->source, (Py_ssize_t)strnlen(r->source, sizeof r->source), "replace");
  PyObject* obj = NULL;
  for (int i = 0; i < 7; ++i) {
    if (values[i] == NULL) goto done;
  }
  obj = PyBaseObject_Type.tp_new((PyTypeObject*)op_result_type, empty_tuple, NULL);
  if (obj == NULL) goto done;
  for (int i = 0; i < 7; ++i) {
    if (PyObject_GenericSetAttr(obj, str_fields[i], values[i]) < 0) {
      Py_CLEAR(obj);
      goto done;
    }
  }
done:
  for (int i = 0; i < 7; ++i) Py_XDECREF(values[i]);
  return obj;
}

/* wait(client, id, generation, timeout_us) -> OpResult, or the int code of a failed flexkv_wait. GIL released. */
static PyObject* wait(PyObject* self, PyObject* args) {
  PyObject* cobj;
  unsigned long long id, generation;
  long long timeout_us;
  void* client;
  flexkv_op_result r;
  int rc;
  (void)self;
  if (!PyArg_ParseTuple(args, "OKKL:wait", &cobj, &id, &generation, &timeout_us)) return NULL;
  if (address(cobj, &client) < 0) return NULL;
  const flexkv_ticket t = {id, generation};
  Py_BEGIN_ALLOW_THREADS
  rc = p_wait(client, t, timeout_us, &r);
  Py_END_ALLOW_THREADS
  if (rc != 0) return PyLong_FromLong(rc);
  return op_result(&r);
}

/* try_wait(client, id, generation) -> OpResult, or the int code of a failed flexkv_try_wait. */
static PyObject* try_wait(PyObject* self, PyObject* args) {
  PyObject* cobj;
  unsigned long long id, generation;
  void* client;
  flexkv_op_result r;
  (void)self;
  if (!PyArg_ParseTuple(args, "OKK:try_wait", &cobj, &id, &generation)) return NULL;
  if (address(cobj, &client) < 0) return NULL;
  const flexkv_ticket t = {id, generation};
  const int rc = p_try_wait(client, t, &r);
  if (rc != 0) return PyLong_FromLong(rc);
  return op_result(&r);
}

/* ---- baselines for python -m flexkvd.bench: the same calls in a C loop, no Python between them ---- */

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* bench_round_trips(client, keys array, pin, iterations) -> list of ns per match + wait (+ release + wait when pin),
 * or the int code of the first failed call. GIL released while it runs. */
static PyObject* bench_round_trips(PyObject* self, PyObject* args) {
  PyObject *cobj, *kobj;
  int pin, iterations;
  void* client;
  Py_buffer view;
  (void)self;
  if (!PyArg_ParseTuple(args, "OOpi:bench_round_trips", &cobj, &kobj, &pin, &iterations)) return NULL;
  if (iterations < 1) return PyErr_Format(PyExc_ValueError, "iterations is %d; expected >= 1", iterations);
  if (address(cobj, &client) < 0 || keys_view(kobj, &view) < 0) return NULL;
  int64_t* samples = PyMem_Malloc((size_t)iterations * sizeof(int64_t));
  if (samples == NULL) {
    PyBuffer_Release(&view);
    return PyErr_NoMemory();
  }
  const size_t n = (size_t)view.len / sizeof(flexkv_block_key);
  int rc = 0;
  Py_BEGIN_ALLOW_THREADS
  for (int i = 0; i < iterations && rc == 0; ++i) {
    flexkv_ticket t;
    flexkv_op_result r;
    const int64_t t0 = now_ns();
    rc = p_match(client, view.buf, n, pin, &t);
    if (rc == 0) rc = p_wait(client, t, 10000000, &r);
    if (rc == 0) rc = r.status_code;
    if (rc == 0 && pin) rc = p_release(client, r.match_handle, &t);
    if (rc == 0 && pin) rc = p_wait(client, t, 10000000, &r);
    samples[i] = now_ns() - t0;
  }
  Py_END_ALLOW_THREADS
  PyBuffer_Release(&view);
  PyObject* out = rc != 0 ? PyLong_FromLong(rc) : PyList_New(iterations);
  for (int i = 0; rc == 0 && out != NULL && i < iterations; ++i) {
    PyObject* v = PyLong_FromLongLong(samples[i]);
    if (v == NULL) {
      Py_CLEAR(out);
      break;
    }
    PyList_SET_ITEM(out, i, v);
  }
  PyMem_Free(samples);
  return out;
}

static PyMethodDef kMethods[] = {
    {"bench_round_trips", bench_round_trips, METH_VARARGS,
     "bench_round_trips(client, keys, pin, iterations) -> list of ns, or int code."},
    {"bind", bind, METH_VARARGS, "bind(abi, match, prefetch, release, wait, try_wait, compute_block_keys, OpResult, "
                                 "status_codes): the libflexkv functions (addresses) and types to use."},
    {"ints", ints, METH_VARARGS, "ints(values, signed) -> bytearray of native int32/uint32, or None."},
    {"block_keys", block_keys, METH_VARARGS, "block_keys(namespace, tokens, tokens_per_block) -> bytearray or None."},
    {"match", match, METH_VARARGS, "match(client, keys, pin) -> (rc, id, generation)."},
    {"prefetch", prefetch, METH_VARARGS, "prefetch(client, keys) -> (rc, id, generation)."},
    {"release", release, METH_VARARGS, "release(client, match_handle) -> (rc, id, generation)."},
    {"wait", wait, METH_VARARGS, "wait(client, id, generation, timeout_us) -> OpResult or int code."},
    {"try_wait", try_wait, METH_VARARGS, "try_wait(client, id, generation) -> OpResult or int code."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "flexkvd._fast",
                                     "The compiled fast path of flexkv (see _native.py).", -1, kMethods,
                                     NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__fast(void) {
  PyObject* m = PyModule_Create(&kModule);
  if (m == NULL) return NULL;
  if (PyModule_AddIntConstant(m, "ABI_VERSION", FLEXKV_ABI_VERSION) < 0) {
    Py_DECREF(m);
    return NULL;
  }
  return m;
}
