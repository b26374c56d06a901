// The Python module: its functions, each defined beside the code it runs.
#include "common.h"

namespace specdecode {

PyObject* py_linear(PyObject*, PyObject* args);           // linear.cpp
PyObject* py_isa(PyObject*, PyObject*);                   // linear.cpp
PyObject* py_amx(PyObject*, PyObject* args);              // linear.cpp
PyObject* py_has_avx2(PyObject*, PyObject*);              // linear.cpp
PyObject* py_decoder_layers(PyObject*, PyObject* args);   // layer_stack.cpp
PyObject* py_kv_store(PyObject*, PyObject* args);         // layer_stack.cpp
PyObject* py_top_probability(PyObject*, PyObject* args);  // softmax.cpp
PyObject* py_words_sums(PyObject*, PyObject* args);       // checksums.cpp

namespace {

PyMethodDef kMethods[] = {
    {"linear", py_linear, METH_VARARGS, "Row-invariant linear on raw CPU pointers"},
    {"decoder_layers", py_decoder_layers, METH_VARARGS, "Decoder layers for decode / verification rows"},
    {"kv_store", py_kv_store, METH_VARARGS, "kv_store(fmt, src, dst, n): floats to a KV cache format"},
    {"has_avx2", py_has_avx2, METH_NOARGS, "True if compiled with AVX2/FMA intrinsics"},
    {"isa", py_isa, METH_NOARGS, "Instruction set of the W8A8 path"},
    {"top_probability", py_top_probability, METH_VARARGS, "top_probability(ptr, n): max of softmax of n floats"},
    {"words_sums", py_words_sums, METH_VARARGS, "words_sums(base, fd, [(offset, nbytes, from_file)]): checksums"},
    {"amx", py_amx, METH_VARARGS, "amx([on]): switch AMX tiles for multi-row W8A8 / W4A8 calls; returns whether in use"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "specdecode_cpu_linear", nullptr, -1, kMethods,
                       nullptr, nullptr, nullptr, nullptr};

}  // namespace
}  // namespace specdecode

#define SPECDECODE_CAT2(a, b) a##b
#define SPECDECODE_CAT(a, b) SPECDECODE_CAT2(a, b)
PyMODINIT_FUNC SPECDECODE_CAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&specdecode::kModule); }

