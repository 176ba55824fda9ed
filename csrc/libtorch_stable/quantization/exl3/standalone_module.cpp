// SPDX-License-Identifier: Apache-2.0
// Python entry point of the quick-build extension vllm/_exl3_C.abi3.so.
// Importing it runs the static registrations of exl3_ops.cpp
// (torch.ops._C.exl3_*); the module itself is empty. The full build links the
// same sources into _C_stable_libtorch, whose REGISTER_EXTENSION provides the
// entry point instead, so this file is not part of that build.
#ifndef Py_LIMITED_API
  #define Py_LIMITED_API \
    0x03090000  // abi3: one binary for every CPython >= 3.9
#endif
#include <Python.h>

static struct PyModuleDef exl3_module = {PyModuleDef_HEAD_INIT, "_exl3_C",
                                         "EXL3 kernels (torch.ops._C.exl3_*)",
                                         -1, nullptr};

PyMODINIT_FUNC PyInit__exl3_C(void) { return PyModule_Create(&exl3_module); }
